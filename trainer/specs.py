"""The recipes' typed sections, free of torch and Lightning: `expertcache pretrain --help`, `train-cache-aware
--help` and the other recipe commands build their command line from these without importing the trainer (#46:
4-5 s of imports). The modules that run them re-export them (data.DataSpec, lm_module.TrainSpec,
pretrain.PretrainRecipe, cache_aware.recipe.*)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from expertcache.telemetry.cachesim import capacity_count
from expertcache.telemetry.errors import InputError

from .config import RecipeError, opt
from .models import BaseModelSpec

@dataclass
class DataSpec:
    corpus: str = opt("data/corpus", "corpus directory written by `expertcache data build`")
    tokenizer: str = opt("data/tokenizer", "tokenizer directory (AutoTokenizer) written by `expertcache data build`")
    seq_len: int = opt(256, "tokens per packed training block")
    batch_size: int = opt(16, "blocks per optimizer step")
    val_batches: int = opt(8, "validation batches per domain at each validation")

    def __post_init__(self):
        from .config import RecipeError

        if self.seq_len < 2:
            raise RecipeError(f"data.seq_len={self.seq_len}; expected an integer >= 2")
        for name in ("batch_size", "val_batches"):
            if getattr(self, name) < 1:
                raise RecipeError(f"data.{name}={getattr(self, name)}; expected an integer >= 1")
        for name in ("corpus", "tokenizer"):
            if not getattr(self, name):
                raise RecipeError(f"data.{name} is empty; expected a folder")


BALANCE_LOSSES = ("per_layer", "hf")


@dataclass
class TrainSpec:
    max_steps: int = opt(2000, "optimizer steps in the whole run")
    lr: float = opt(1e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak (cosine decay)")
    warmup_steps: int = opt(100, "linear warm-up steps")
    weight_decay: float = opt(0.1, "AdamW weight decay on matrices (not on norms or embeddings)")
    beta2: float = opt(0.95, "AdamW beta2")
    grad_clip: float = opt(1.0, "gradient norm clip (0: off)")
    precision: str = opt("32-true", "Lightning precision: 32-true, or bf16-mixed where the device has fast bf16 "
                         "(GPUs from Ampere on; CPUs with avx512_bf16)")
    accelerator: str = opt("auto", "Lightning accelerator: auto (the GPU when there is one), cpu, gpu")
    devices: str = opt("auto", "devices (processes) to train on: auto, or a count; data.batch_size is the global "
                       "batch, split evenly across them")
    strategy: str = opt("auto", "Lightning strategy: auto, ddp (gloo on CPU, nccl on GPUs), fsdp (sharded: several "
                        "GPUs, or CPU processes in float32); ddp and fsdp need 2 or more processes (devices x "
                        "num_nodes)")
    num_nodes: int = opt(1, "machines the run spans (Lightning's num_nodes); each runs train.devices processes; "
                         "docs/post-training.md says how to launch them")
    val_every: int = opt(200, "validate every N optimizer steps")
    ckpt_every: int = opt(100, "write a resumable checkpoint every N optimizer steps")
    log_every: int = opt(10, "log training metrics every N steps")
    seed: int = opt(0, "seed for initialisation and data order")
    deterministic: bool = opt(True, "torch's deterministic algorithms while training (Lightning's deterministic="
                              "'warn': a warning names any op that has none), so a run repeated with the same seed, "
                              "data and thread count gives the same weights; false: torch's defaults, whose parallel "
                              "reductions may sum in another order on each run")
    threads: int = opt(0, "torch intra-op threads (0: leave torch's default)")
    wandb: bool = opt(True, "log to wandb (offline unless WANDB_MODE says otherwise)")
    wandb_project: str = opt("expertcache", "wandb project name")
    balance: str = opt("per_layer", "load-balancing loss: per_layer (Switch loss in every MoE layer, averaged) or "
                       "hf (transformers' loss, which pools all layers' experts and can hide per-layer imbalance)")
    memory_gb: float = opt(0.0, "train-cache-aware: the memory (GB) the run may use with its routed experts frozen "
                           "and streamed from the checkpoint, layer by layer (routers train; a budget below the "
                           "floor is refused, the floor printed); 0: the whole model in memory")
    expert_tier: str = opt("disk", "with train.memory_gb: where streamed experts are read from (disk: the "
                           "checkpoint, page cache bypassed; host: every expert in RAM; throttled:<GB/s>)")
    frozen_dtype: str = opt("fp32", "with streamed experts: the frozen non-expert weights (attention, norms, "
                            "embeddings) and the activations through them in fp32, or bf16 (half their memory, their "
                            "matmuls on the CPU's bf16 units; the routers, their gradients and Adam's state stay "
                            "fp32)")


    def __post_init__(self):
        for name in ("max_steps", "val_every", "ckpt_every", "log_every"):
            if getattr(self, name) < 1:
                raise RecipeError(f"train.{name}={getattr(self, name)}; expected an integer >= 1")
        for name in ("warmup_steps", "threads"):
            if getattr(self, name) < 0:
                raise RecipeError(f"train.{name}={getattr(self, name)}; expected an integer >= 0")
        if not 0 <= self.seed < 2 ** 32:
            raise RecipeError(f"train.seed={self.seed}; expected an integer in [0, 2^32)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise RecipeError(f"train.lr={self.lr}; expected a finite number > 0")
        if not 0 <= self.min_lr_ratio <= 1:  # NaN fails too
            raise RecipeError(f"train.min_lr_ratio={self.min_lr_ratio}; expected a number in [0, 1]")
        if not 0 <= self.beta2 < 1:
            raise RecipeError(f"train.beta2={self.beta2}; expected a number in [0, 1)")
        for name in ("weight_decay", "grad_clip"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise RecipeError(f"train.{name}={getattr(self, name)}; expected a finite number >= 0")
        if self.devices != "auto" and not (str(self.devices).isdigit() and int(self.devices) >= 1):
            raise RecipeError(f"train.devices={self.devices!r}; expected auto or a count >= 1")
        if not (math.isfinite(self.memory_gb) and self.memory_gb >= 0):
            raise RecipeError(f"train.memory_gb={self.memory_gb}; expected a finite number >= 0 (0: no streaming)")
        if self.frozen_dtype not in ("fp32", "bf16"):
            raise RecipeError(f"train.frozen_dtype={self.frozen_dtype!r}; expected fp32 or bf16")
        if self.num_nodes < 1:
            raise RecipeError(f"train.num_nodes={self.num_nodes}; expected an integer >= 1")
        if str(self.devices).isdigit():  # `auto` is checked once Lightning resolved it (distributed.check_world)
            from .distributed import check_processes

            check_processes(self, int(self.devices) * self.num_nodes, self.accelerator == "cpu")
        if self.balance not in BALANCE_LOSSES:
            raise RecipeError(f"train.balance={self.balance!r}; expected one of {', '.join(BALANCE_LOSSES)}")


@dataclass
class PretrainRecipe:
    name: str = opt("base", "run name (used in logs)")
    out_dir: str = opt("runs/base", "run folder: checkpoints, logs, HF model, metrics")
    data: DataSpec = opt(DataSpec(), "corpus, tokenizer and batching")
    model: BaseModelSpec = opt(BaseModelSpec(), "the Qwen3-MoE base model's shape")
    train: TrainSpec = opt(TrainSpec(), "optimisation, validation, checkpoints, logging")
    eval_blocks: int = opt(64, "validation blocks per domain in the final metrics.json")

    def __post_init__(self):
        if self.eval_blocks < 1:
            raise RecipeError(f"eval_blocks={self.eval_blocks}; expected an integer >= 1")
        if not self.out_dir:
            raise RecipeError("out_dir is empty; expected the run folder")
        if self.train.memory_gb:
            raise RecipeError(f"train.memory_gb={self.train.memory_gb:g}: pretraining trains every expert, so none "
                              f"can be streamed frozen (train-cache-aware streams them); set it to 0")


MODES = ("joint", "aux-only", "locality-only")
LOCALITY_KINDS = ("dot", "l2", "resident", "miss", "margin")  # trainer/locality.py implements each
TRAINABLE = ("all", "routers", "moe")


@dataclass
class LocalitySpec:
    weight: float = opt(0.0, "lambda: weight of the adjacent-token routing-locality loss (0: off)")
    kind: str = opt("dot", "dot: 1 - <p_t, p_t-1>; l2: ||p_t - p_t-1||^2 (softmax router probabilities); "
                    "resident: router mass off an LRU cache of `cache` experts; miss: mass of the chosen experts "
                    "that cache lacks (hard top-k, straight-through)")
    cache: int = opt(0, "C of the simulated LRU cache for kind=resident|miss (0: the model's top_k, i.e. the "
                     "previous token's experts)")
    temperature: float = opt(1.0, "router temperature for the locality loss only (< 1 sharpens; routing unchanged)")
    warmup_steps: int = opt(0, "ramp lambda linearly from 0 over this many optimizer steps (0: full from the start)")
    layer_weights: list[float] = opt([], "one weight per MoE layer (normalised to mean 1); [] = all equal")
    margin: float = opt(0.5, "kind=margin: the logit margin by which the served experts should beat the rest")
    domain_weight: float = opt(0.0, "weight of the domain loss: routing mass outside the domain's expert set")
    domain_frac: float = opt(0.5, "each domain's allowed experts, as a fraction of E, from the base's own usage")

    def __post_init__(self):
        if self.kind not in LOCALITY_KINDS:
            raise RecipeError(f"locality.kind={self.kind!r}; expected one of {', '.join(LOCALITY_KINDS)}")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise RecipeError(f"locality.weight={self.weight}; expected a finite number >= 0")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise RecipeError(f"locality.temperature={self.temperature}; expected a finite number > 0")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise RecipeError(f"locality.margin={self.margin}; expected a finite number >= 0")
        if self.cache < 0 or self.warmup_steps < 0:
            raise RecipeError("locality.cache and locality.warmup_steps must be >= 0")
        if not (math.isfinite(self.domain_weight) and self.domain_weight >= 0) or not 0 < self.domain_frac <= 1:
            raise RecipeError(f"locality.domain_weight={self.domain_weight}, locality.domain_frac={self.domain_frac}; "
                              f"expected a finite weight >= 0 and a fraction in (0, 1]")
        if not all(math.isfinite(w) and w >= 0 for w in self.layer_weights):
            raise RecipeError(f"locality.layer_weights={self.layer_weights}; expected finite numbers >= 0")


@dataclass
class QualitySpec:
    lm_weight: float = opt(1.0, "weight of the next-token LM loss")
    distill: float = opt(0.0, "weight of distillation to the frozen base: KL(base || model) of the next-token "
                         "distributions, token by token (0: off); lets routing move while the outputs stay")
    trainable: str = opt("all", "what the backbone trains: all | routers (router weights only) | moe (routers and "
                         "routed experts)")
    lora_rank: int = opt(0, "low-rank adapters (peft LoRA) of this rank on attention's projections, trained beside "
                         "the routers (trainable=routers or moe; in memory or streamed) and merged into the saved "
                         "checkpoint; 0: none")
    lora_alpha: float = opt(16.0, "the adapters' scale is lora_alpha / lora_rank")
    lora_targets: list[str] = opt(["q_proj", "k_proj", "v_proj", "o_proj"], "the projections that get an adapter "
                                  "(the last name of each Linear)")

    def __post_init__(self):
        if self.trainable not in TRAINABLE:
            raise RecipeError(f"quality.trainable={self.trainable!r}; expected one of {', '.join(TRAINABLE)}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise RecipeError(f"quality.lora_rank={self.lora_rank!r}; expected an integer >= 0 (0: no adapters)")
        if not (isinstance(self.lora_alpha, (int, float)) and math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise RecipeError(f"quality.lora_alpha={self.lora_alpha!r}; expected a number > 0")
        if self.lora_rank and self.trainable == "all":
            raise RecipeError("quality.lora_rank applies to quality.trainable=routers or moe (adapters beside a "
                              "frozen backbone); trainable=all trains attention's weights themselves")
        if self.lora_rank and not self.lora_targets:
            raise RecipeError("quality.lora_targets=[]: name the projections that get an adapter, e.g. "
                              "[q_proj,k_proj,v_proj,o_proj]")
        if not (self.lm_weight >= 0 and self.distill >= 0) or not (self.lm_weight or self.distill) \
                or not math.isfinite(self.lm_weight + self.distill):
            raise RecipeError("quality.lm_weight and quality.distill must be >= 0, and not both 0")


@dataclass
class ServingSpec:
    reroute: bool = opt(False, "serving-aware fine-tuning: the training forward computes with the experts the "
                        "reroute miss policy would serve (an LRU cache of `capacity` experts per layer, misses "
                        "swapped for resident experts within tau), replayed token by token")
    capacity: int | float = opt(0.125, "the served cache per layer: a fraction of E as a float in (0, 1] (1.0 = "
                                "all), or a count of experts as an integer (at least top_k): for serving.reroute "
                                "and for locality.kind=margin")
    tau: float = opt(0.1, "the reroute threshold on router probabilities, as the engine's --engine.tau")

    def __post_init__(self):
        try:
            capacity_count(self.capacity, None)
        except InputError as e:
            raise RecipeError(f"serving.{e}") from None
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise RecipeError(f"serving.tau={self.tau}; expected a finite number >= 0")


@dataclass
class RouterSpec:
    temporal: bool = opt(False, "train a Temporal router (update-only: what the cache keeps after an access)")
    spatio: bool = opt(False, "train a Spatio router (prefetch up to R experts from the previous layer's state)")
    rank: int = opt(32, "width of each head's low-rank correction")
    refine_budget: int = opt(2, "R: Spatio prefetches per layer per token, at most")
    prefetch_threshold: float = opt(0.5, "prefetch a Spatio prediction only if its probability (sigmoid) >= this")
    horizon: int = opt(8, "Temporal target: tokens ahead it looks for an expert's next use")
    horizon_decay: float = opt(0.5, "Temporal target gamma^(d-1) for a next use d tokens ahead (0: next token only)")
    history: int = opt(8, "Temporal input: the experts each of the last N tokens used at the layer")
    weight: float = opt(1.0, "weight of the routers' cache loss in joint mode")
    lr: float = opt(0.0, "peak learning rate of the routers (0: train.lr); fresh heads usually want more than "
                         "the pretrained backbone")
    trace: str = opt("", "mode=aux-only: train from this trace's hidden states and routing (`expertcache trace "
                     "record --hidden true`, --offload true for a base bigger than memory) instead of forwards of "
                     "the model; no expert is read (empty: live forwards on data.corpus)")

    def __post_init__(self):
        for name, lo in (("rank", 1), ("refine_budget", 0), ("horizon", 1), ("history", 1)):
            if getattr(self, name) < lo:
                raise RecipeError(f"routers.{name}={getattr(self, name)}; expected an integer >= {lo}")
        for name in ("prefetch_threshold", "horizon_decay"):
            if not 0 <= getattr(self, name) <= 1:  # NaN fails too
                raise RecipeError(f"routers.{name}={getattr(self, name)}; expected a number in [0, 1]")
        for name in ("weight", "lr"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise RecipeError(f"routers.{name}={getattr(self, name)}; expected a finite number >= 0")


@dataclass
class EvalSpec:
    split: str = opt("test", "held-out split for the cache figures and perplexity")
    prompt_len: int = opt(64, "prefill tokens per recorded sequence")
    decode_tokens: int = opt(64, "greedy decode tokens per recorded sequence (the cache is scored on these)")
    max_seqs: int = opt(16, "recorded sequences per domain")
    capacities: list[int | float] = opt([0.125, 0.25], "cache capacities per layer: fractions of E as floats in "
                                        "(0, 1] (1.0 = all), counts of experts as integers")
    ppl_blocks: int = opt(64, "perplexity blocks per domain")
    seq_len: int = opt(256, "tokens per perplexity block")
    gate_ppl_overall: float = opt(1.0, "gate: largest allowed Δppl overall, in %")
    gate_ppl_domain: float = opt(2.0, "gate: largest allowed Δppl in any domain, in %")

    def __post_init__(self):
        if self.split not in ("train", "validation", "test"):
            raise RecipeError(f"eval.split={self.split!r}; expected train, validation or test")
        for name, lo in (("prompt_len", 1), ("decode_tokens", 1), ("max_seqs", 1), ("ppl_blocks", 1),
                         ("seq_len", 2)):
            if getattr(self, name) < lo:
                raise RecipeError(f"eval.{name}={getattr(self, name)}; expected an integer >= {lo}")
        if not self.capacities:
            raise RecipeError("eval.capacities is empty; expected fractions of E (e.g. [0.125, 0.25])")
        for c in self.capacities:
            try:
                capacity_count(c, None)
            except InputError as e:
                raise RecipeError(f"eval.capacities has {e}") from None
        for name in ("gate_ppl_overall", "gate_ppl_domain"):
            if not math.isfinite(getattr(self, name)):
                raise RecipeError(f"eval.{name}={getattr(self, name)}; expected a finite number")


@dataclass
class SweepSpec:
    key: str = opt("", "recipe key to sweep, e.g. locality.weight (empty: a single run)")
    values: list[float] = opt([], "values of that key; each runs into out_dir/<key>=<value>/")


@dataclass
class FrontierSpec:
    variants: dict = opt({}, "name -> list of key=value overrides of this recipe; each variant is one run in "
                             "out_dir/<name>/")
    control: str = opt("", "the variant that is the λ = 0 control (same steps, no locality); empty for none")
    reroute: list[str] = opt([], "variants also served with the reroute miss policy ('base': the base itself)")
    capacity: float = opt(0.125, "served cache per layer, as a fraction of E in (0, 1] (1.0 = all), for the "
                          "reroute rows")
    tau: float = opt(0.1, "reroute threshold: a miss is served by a resident expert within tau of its weight")
    split: str = opt("test", "held-out split of the evaluation (the documents of every lm-eval task and block)")
    tasks: list[str] = opt(["ec_ppl_code", "ec_ppl_prose", "ec_ppl_math", "ec_cloze_code", "ec_cloze_prose",
                            "ec_cloze_math", "ec_math_em"], "lm-eval tasks of the plain rows")
    limit: int = opt(24, "documents per task, plain rows")
    ppl_blocks: int = opt(16, "step-wise perplexity blocks per domain, plain rows")
    seq_len: int = opt(256, "tokens per step-wise block, plain rows")
    lossy_tasks: list[str] = opt(["ec_cloze_code", "ec_cloze_prose", "ec_cloze_math"],
                                 "lm-eval tasks of the reroute rows (served token by token: slower)")
    lossy_limit: int = opt(8, "documents per task, reroute rows")
    lossy_accuracy: str = opt("token", "how the reroute rows' documents are served: token (one token at a time "
                              "through the engine) | replay (the rule replayed per document in batched forwards, "
                              "each from an empty cache: `expertcache eval --accuracy replay`, for thousands of "
                              "documents; loglikelihood tasks only)")
    lossy_ppl_blocks: int = opt(4, "step-wise perplexity blocks per domain, reroute rows")
    lossy_seq_len: int = opt(128, "tokens per step-wise block, reroute rows")
    grow: list[str] = opt([], "variants whose plain row, when INCONCLUSIVE on accuracy alone and the held-out text "
                          "can grow its unresolved tasks, is decided on more documents: the base and the variant "
                          "evaluated again on those tasks with the documents the gate asks for (a quarter above its "
                          "estimate, at most grow_documents per task) and gated on them")
    grow_documents: int = opt(8000, "the most documents per task a grown row is evaluated on")
    out: str = opt("results/frontier.json", "the rows (a JSON list); the plot is written beside it (.png)")

    def __post_init__(self):
        for name, ov in self.variants.items():
            if not isinstance(ov, list) or not all(isinstance(x, str) for x in ov):
                raise RecipeError(f"frontier.variants.{name}: expected a list of key=value strings, got {ov!r}")
            if not name or "/" in name or name.startswith("."):
                raise RecipeError(f"frontier.variants: {name!r} is not a usable folder name")
        unknown = [r for r in self.reroute if r != "base" and r not in self.variants]
        if unknown:
            raise RecipeError(f"frontier.reroute names {unknown[0]!r}, which is not a variant")
        if self.control and self.control not in self.variants:
            raise RecipeError(f"frontier.control={self.control!r} is not a variant")
        if not (0 < self.capacity <= 1) or not (math.isfinite(self.tau) and self.tau >= 0):
            raise RecipeError("frontier.capacity must be in (0, 1] and frontier.tau a finite number >= 0")
        if self.lossy_accuracy not in ("token", "replay"):
            raise RecipeError(f"frontier.lossy_accuracy={self.lossy_accuracy!r}; expected token or replay")
        if min(self.limit, self.ppl_blocks, self.seq_len, self.lossy_limit, self.lossy_ppl_blocks,
               self.lossy_seq_len) < 1:
            raise RecipeError("frontier limits, blocks and sequence lengths must be >= 1")
        if [g for g in self.grow if g not in self.variants]:
            raise RecipeError(f"frontier.grow names {[g for g in self.grow if g not in self.variants][0]!r}, which "
                              f"is not a variant")
        if self.grow_documents < 1:
            raise RecipeError(f"frontier.grow_documents={self.grow_documents}: expected a document count >= 1")


@dataclass
class CacheAwareRecipe:
    name: str = opt("cache-aware", "run name (used in logs)")
    out_dir: str = opt("runs/cache-aware", "run folder")
    base: str = opt("runs/base-tiny/model", "HF checkpoint to post-train (a pretrained base)")
    mode: str = opt("joint", "joint | aux-only | locality-only")
    data: DataSpec = opt(DataSpec(), "corpus, tokenizer and batching")
    train: TrainSpec = opt(TrainSpec(max_steps=200, lr=3e-4, warmup_steps=20, val_every=100, ckpt_every=25,
                                     log_every=5), "optimisation, validation, checkpoints, logging")
    locality: LocalitySpec = opt(LocalitySpec(), "routing-locality losses on the backbone's routers")
    quality: QualitySpec = opt(QualitySpec(), "the quality terms (LM loss, distillation) and what trains")
    serving: ServingSpec = opt(ServingSpec(), "the served routing (reroute) replayed in training")
    routers: RouterSpec = opt(RouterSpec(), "auxiliary Temporal / Spatio routers")
    eval: EvalSpec = opt(EvalSpec(), "end-of-run cache figures, perplexity and the gate")
    sweep: SweepSpec = opt(SweepSpec(), "run one key over a grid and write one table")
    frontier: FrontierSpec = opt(FrontierSpec(), "named variants of this recipe, each trained, gated plain and "
                                 "(some) served with reroute; one JSON of rows and a plot (train-cache-aware "
                                 "runs them when variants is not empty)")

    def __post_init__(self):
        has_routers = self.routers.temporal or self.routers.spatio
        if self.mode not in MODES:
            raise RecipeError(f"mode={self.mode!r}; expected one of {', '.join(MODES)}")
        if self.mode == "locality-only" and has_routers:
            raise RecipeError("mode=locality-only trains no auxiliary routers; set routers.temporal and "
                              "routers.spatio to false, or use mode=joint")
        if self.mode != "locality-only" and not has_routers:
            raise RecipeError(f"mode={self.mode} needs routers.temporal and/or routers.spatio")
        if self.mode == "aux-only" and (self.locality.weight or self.locality.domain_weight):
            raise RecipeError("mode=aux-only freezes the backbone, so locality.weight and locality.domain_weight "
                              "would do nothing; set them to 0")
        if self.quality.lora_rank and self.mode == "aux-only":
            raise RecipeError("quality.lora_rank trains adapters in the backbone; mode aux-only keeps the backbone "
                              "frozen (set quality.lora_rank=0, or mode locality-only / joint)")
        if self.routers.trace and self.mode != "aux-only":
            raise RecipeError(f"routers.trace is for mode=aux-only (the backbone frozen); mode={self.mode} trains "
                              f"the backbone on live forwards")
        if self.sweep.key and not self.sweep.values:
            raise RecipeError(f"sweep.key={self.sweep.key} has no sweep.values")
        if self.frontier.variants and self.sweep.key:
            raise RecipeError("a recipe is a sweep or a frontier, not both")
