"""Cache-aware post-training of a trained MoE: locality losses on the backbone's routers, auxiliary Temporal and
Spatio routers, and the end-of-run cache and perplexity figures with the pre-registered gate.

Modes:
- `joint`: the backbone (LM loss + its load-balancing loss + locality losses) and the auxiliary routers are
  trained together; the routers' cache loss is weighted by `routers.weight` and its gradient reaches the
  backbone's hidden states.
- `aux-only`: the backbone is frozen (bit-identical); only the auxiliary routers train.
- `locality-only`: the backbone with locality losses, no auxiliary routers.
Inference always uses the model's native top-k: nothing here changes which experts a token computes with once
it is served. `serving.reroute` changes the *training* forward only: each training sequence is replayed token by
token through an LRU cache of `serving.capacity` experts per layer, and every layer computes with the experts the
engine's reroute miss policy would serve (`locality.ServedRouting`), so the model learns to work with them
(serving-aware fine-tuning); `locality.kind=margin` teaches the router to choose those experts itself.

Run folder (`out_dir`): recipe.yaml, checkpoints/ (resumable), logs/, model/ (HF checkpoint + tokenizer +
aux_routers.safetensors), trace-<split>.parquet (the run's decode routing), result.json, result.md,
training_curve.png, cache.png.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from expertcache.telemetry.cachesim import capacity_count
from expertcache.telemetry.errors import InputError

from .config import RecipeError, apply_overrides, from_dict, opt, to_dict
from .data import DataSpec
from .lm_module import CausalLMModule, TrainSpec
from expertcache.telemetry.atomic import write_figure, write_json, write_text

MODES = ("joint", "aux-only", "locality-only")
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
        from .locality import LOCALITY_KINDS

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

    def __post_init__(self):
        if self.trainable not in TRAINABLE:
            raise RecipeError(f"quality.trainable={self.trainable!r}; expected one of {', '.join(TRAINABLE)}")
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
    lossy_ppl_blocks: int = opt(4, "step-wise perplexity blocks per domain, reroute rows")
    lossy_seq_len: int = opt(128, "tokens per step-wise block, reroute rows")
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
        if min(self.limit, self.ppl_blocks, self.seq_len, self.lossy_limit, self.lossy_ppl_blocks,
               self.lossy_seq_len) < 1:
            raise RecipeError("frontier limits, blocks and sequence lengths must be >= 1")


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
        if self.sweep.key and not self.sweep.values:
            raise RecipeError(f"sweep.key={self.sweep.key} has no sweep.values")
        if self.frontier.variants and self.sweep.key:
            raise RecipeError("a recipe is a sweep or a frontier, not both")


class CacheAwareModule(CausalLMModule):
    def __init__(self, model, recipe: CacheAwareRecipe, val_domains: list[str], aux=None,
                 allowed: torch.Tensor | None = None, teacher=None):
        super().__init__(model, recipe.train, val_domains)
        self._teacher = [teacher] if teacher is not None else []  # a list: not a submodule, never saved
        from expertcache.telemetry.adapters import adapter_for

        from .locality import layer_weights

        self.recipe, self.aux, self.allowed = recipe, aux, allowed
        self.adapter = adapter_for(model)
        self.moe = self.adapter.moe_layers(model)
        self.layer_w = layer_weights(recipe.locality.layer_weights, len(self.moe))
        self._hidden: dict[int, torch.Tensor] = {}
        self._capture = False
        self.served = None
        sv = recipe.serving
        if sv.reroute or (recipe.locality.kind == "margin" and recipe.locality.weight):  # the replay is paid per step
            from expertcache.telemetry.cachesim import capacity_count

            from .locality import ServedRouting

            c = capacity_count(sv.capacity, self.adapter.num_experts)
            if c < self.adapter.top_k:
                raise RecipeError(f"serving.capacity={sv.capacity} is {c} experts, fewer than top_k="
                                  f"{self.adapter.top_k}: the served replay needs a step's experts to fit")
            self.served = ServedRouting(self.moe, self.adapter, c, sv.tau, apply=sv.reroute)
        if aux is not None:
            for i, layer in enumerate(self.moe):
                layer.router.register_forward_hook(self._keep_input(i))
        if recipe.mode == "aux-only":
            for p in model.parameters():
                p.requires_grad_(False)
        elif recipe.quality.trainable != "all":
            keep = {id(p) for L in self.moe for p in L.router.parameters()}
            if recipe.quality.trainable == "moe":
                keep |= {id(p) for L in self.moe for p in L.experts.parameters()}
            for p in model.parameters():
                p.requires_grad_(id(p) in keep)

    def optimizer_groups(self) -> list[dict]:
        from .lm_module import param_groups

        groups = param_groups(self.model, self.spec.weight_decay)
        if self.aux is not None:
            lr = self.recipe.routers.lr or self.spec.lr
            groups += [dict(g, lr=lr) for g in param_groups(self.aux, self.spec.weight_decay)]
        return groups

    def _keep_input(self, i: int):
        def hook(module, args, output):
            if self._capture:
                self._hidden[i] = args[0].reshape(-1, args[0].shape[-1])  # [B*T, H] entering MoE layer i
        return hook

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]  # [B, T]
        b = ids.shape[0]
        loc, r = self.recipe.locality, self.recipe.routers
        self._capture = self.aux is not None
        if self.served is not None:
            self.served.active, self.served.batch = True, b
        try:
            if self.recipe.mode == "aux-only":
                with torch.no_grad():
                    out = self.model(input_ids=ids, output_router_logits=True, use_cache=False)
                total = torch.zeros((), device=ids.device)
            else:
                q = self.recipe.quality
                out = self.model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
                total, lm, bal = self.lm_losses(out)
                total = total + (q.lm_weight - 1.0) * lm
                self.log("train/loss", lm.detach(), prog_bar=True, sync_dist=self.trainer.world_size > 1)
                if bal is not None:
                    self.log("train/aux_loss", bal.detach())
                if q.distill:
                    kl = self.distill_loss(ids, out.logits)
                    total = total + q.distill * kl
                    self.log("train/distill", kl.detach(), prog_bar=True)
            if self.served is not None:
                self.log("train/rerouted", self.served.rerouted_fraction())
            if loc.weight:
                from .locality import locality_loss, served_margin_loss

                if loc.kind == "margin":
                    lo = served_margin_loss(out.router_logits, [self.served.served[i] for i in range(len(self.moe))],
                                            loc.margin, self.layer_w)
                else:
                    lo = locality_loss(out.router_logits, b, loc.kind, self.layer_w, loc.temperature,
                                       self.adapter.top_k, loc.cache)
                ramp = min(1.0, (self.global_step + 1) / loc.warmup_steps) if loc.warmup_steps else 1.0
                total = total + ramp * loc.weight * lo
                self.log("train/locality", lo.detach(), prog_bar=True)
            if loc.domain_weight:
                from .locality import domain_loss

                do = domain_loss(out.router_logits, b, batch["domain"], self.allowed)
                total = total + loc.domain_weight * do
                self.log("train/domain", do.detach())
            if self.aux is not None:
                with torch.no_grad():
                    native = [self.adapter.route(lg, self.adapter.router_bias(L.router))[0]
                              for lg, L in zip(out.router_logits, self.moe)]
                hidden = [self._hidden[i] for i in range(len(self.moe))]
                losses = self.aux.loss(hidden, native, [L.router for L in self.moe], b)
                w = 1.0 if self.recipe.mode == "aux-only" else r.weight
                for name, v in losses.items():
                    total = total + w * v
                    self.log(f"train/{name}", v.detach(), prog_bar=True)
        finally:
            self._capture = False
            self._hidden.clear()
            if self.served is not None:
                self.served.active = False
                self.served.clear()
        return total


    def on_fit_start(self) -> None:
        for t in self._teacher:
            t.to(self.device)

    def distill_loss(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """KL(base || model) of the next-token distributions, summed over the vocabulary, mean over tokens."""
        with torch.no_grad():
            ref = self._teacher[0](input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
        own = logits.float().log_softmax(-1)
        return torch.nn.functional.kl_div(own.flatten(0, 1), ref.flatten(0, 1), log_target=True,
                                          reduction="batchmean")


# --- a run ---------------------------------------------------------------------------------------------------

def _check_base(base: str | Path) -> Path:
    from expertcache.telemetry.errors import InputError

    base = Path(base)
    if not (base / "config.json").is_file():
        raise InputError(f"no HF checkpoint at {base} (expected {base / 'config.json'}); pretrain one first: "
                         f"expertcache pretrain --recipe base-tiny")
    return base


def baseline_eval(recipe: CacheAwareRecipe) -> dict:
    """The base checkpoint under the run's eval spec; cached beside the base (every run of a table shares it)."""
    from .cache_eval import evaluate_checkpoint

    base = _check_base(recipe.base)
    ev = to_dict(recipe.eval)
    key = hashlib.sha256(json.dumps([ev, recipe.data.corpus, (base / "config.json").read_text(),
                                     (base / "model.safetensors").stat().st_mtime], sort_keys=True,
                                    default=str).encode()).hexdigest()[:12]
    folder = base.parent / "cache-aware-baseline"
    path = folder / f"{key}.json"
    if path.is_file():
        res = json.loads(path.read_text())
        if "block_nll" in res:  # one cached before the gate's intervals is measured again
            return res
    folder.mkdir(parents=True, exist_ok=True)
    e = recipe.eval
    res = evaluate_checkpoint(base, recipe.data.corpus, e.split, folder / f"trace-{key}.parquet", e.prompt_len,
                              e.decode_tokens, e.max_seqs, e.capacities, e.ppl_blocks, e.seq_len)
    write_json(path, res)
    return res


def summarize(recipe: CacheAwareRecipe, base: dict, cand: dict) -> dict:
    """Miss reduction against the base's LRU, the routers against LRU on the same model, Δppl and the gate."""
    caps = {}
    for row in cand["cache"]:
        c = caps.setdefault(str(row["capacity"]), {"capacity_frac": row["capacity_frac"]})
        c[row["policy"]] = row
    for cap, c in caps.items():
        base_lru = next(r for r in base["cache"] if str(r["capacity"]) == cap and r["policy"] == "lru")
        c["base_lru"] = base_lru
        c["lru_miss_reduction"] = 1 - c["lru"]["misses_per_token"] / base_lru["misses_per_token"]
        routed = [p for p in ("spatio_temporal", "temporal", "spatio") if p in c]
        if routed:
            best = max(routed, key=lambda p: c[p]["adjusted_hit_rate"])
            c["best_router_policy"] = best
            c["router_adjusted_gain_points"] = 100 * (c[best]["adjusted_hit_rate"] - c["lru"]["adjusted_hit_rate"])
            c["router_traffic_ratio"] = c[best]["traffic_bytes_per_token"] / c["lru"]["traffic_bytes_per_token"]
    dppl = {d: 100 * (cand["ppl"][d] / base["ppl"][d] - 1) for d in cand["ppl"]}
    e = recipe.eval
    from expertcache.telemetry.metrics import GateThresholds, gate_verdict
    from expertcache.telemetry.stats import dppl_intervals

    th = GateThresholds(e.gate_ppl_overall, e.gate_ppl_domain)
    # the same blocks for both (the same corpus, split, seq_len and ppl_blocks): paired intervals, the gate's rule
    iv = dppl_intervals(base["block_nll"], cand["block_nll"], base["block_tokens"])
    est = {"overall": [dppl["overall"], *iv["overall"][1:]],
           **{d: [dppl[d], *v[1:]] for d, v in iv["domains"].items()}}
    v = gate_verdict(est, {}, iv["n_blocks"], {}, th)
    return {"capacities": caps, "dppl_percent": dppl, "gate": {
        "verdict": v["gate"], "pass": v["gate"] == "PASS", "failures": v["failures"], "unresolved": v["unresolved"],
        "resolve": v["resolve"], "dppl_ci95": {d: x[1:] for d, x in est.items()},
        "dppl_max_domain_ci95": iv["max_domain"][1:], "n_blocks": iv["n_blocks"],
        "ppl_overall_max": e.gate_ppl_overall, "ppl_domain_max": e.gate_ppl_domain}}


def run_cache_aware(recipe: CacheAwareRecipe, resume: bool = True) -> dict:
    """Post-train, save, evaluate; returns (and writes) result.json. A sweep runs every point, then the table."""
    if recipe.sweep.key:
        return run_sweep(recipe, resume)
    from expertcache.telemetry.errors import InputError

    from .aux_routers import AuxRouters, config_for
    from .cache_eval import evaluate_checkpoint
    from expertcache.telemetry.corpus import packed_blocks

    from .data import CorpusDataModule
    from .evaluate import check_vocab
    from .models import count_parameters, save_model_dir
    from .runfolder import fit_resumable, plot_training_curve, prepare_run

    base = _check_base(recipe.base)
    tok, out, done = prepare_run(recipe, resume, ("result.json", "model/config.json"))
    if done is not None:
        return done
    from expertcache.telemetry.hf import load_causal_lm

    model = load_causal_lm(base, dtype=torch.float32)
    check_vocab(tok, model.config)
    if (base / "tokenizer.json").is_file():
        from expertcache.telemetry.hf import load_tokenizer

        if load_tokenizer(str(base)).get_vocab() != tok.get_vocab():
            raise InputError(f"data.tokenizer {recipe.data.tokenizer} is not the tokenizer of the base {base} (their "
                             f"vocabularies differ); pass data.tokenizer={base}")
    r = recipe.routers
    aux = AuxRouters(config_for(model, r.temporal, r.spatio, r.rank, r.refine_budget, r.prefetch_threshold,
                                r.horizon, r.horizon_decay, r.history)) \
        if recipe.mode != "locality-only" else None
    n_backbone = count_parameters(model)["total"]
    n_aux = aux.num_parameters() if aux is not None else 0
    if n_aux > 0.01 * n_backbone:
        raise RecipeError(f"auxiliary routers have {n_aux} parameters, over 1% of the backbone's {n_backbone}; "
                          f"lower routers.rank ({r.rank})")
    allowed = None
    if recipe.locality.domain_weight:
        from expertcache.telemetry.corpus import DOMAINS
        from .locality import allowed_experts

        blocks = [torch.from_numpy(packed_blocks(recipe.data.corpus, recipe.data.tokenizer, "train", d,
                                                 recipe.data.seq_len)[:16].astype("int64")) for d in DOMAINS]
        if any(len(b) == 0 for b in blocks):
            raise InputError("the domain loss needs training text in every domain")
        allowed = allowed_experts(model, blocks, recipe.locality.domain_frac)
    dm = CorpusDataModule(recipe.data, seed=recipe.train.seed)
    dm.setup("fit")
    model.train()  # from_pretrained returns eval mode
    teacher = None
    if recipe.quality.distill and recipe.mode != "aux-only":
        teacher = load_causal_lm(base, dtype=torch.float32).eval().requires_grad_(False)
    module = CacheAwareModule(model, recipe, dm.val_domains(), aux, allowed, teacher)
    start_step, train_s, trainer = fit_resumable(recipe, module, dm, out, resume)
    if trainer.global_rank != 0:  # data-parallel workers: rank 0 alone writes the checkpoint and the reports
        return None

    model_dir = out / "model"
    save_model_dir(model, tok, model_dir, aux)
    plot_training_curve(out / "logs", out / "training_curve.png")

    e = recipe.eval
    base_res = baseline_eval(recipe)
    cand = evaluate_checkpoint(model_dir, recipe.data.corpus, e.split, out / f"trace-{e.split}.parquet",
                               e.prompt_len, e.decode_tokens, e.max_seqs, e.capacities, e.ppl_blocks, e.seq_len,
                               aux=aux.eval() if aux is not None else None)
    result = {"name": recipe.name, "mode": recipe.mode, "base": str(base), "out_dir": str(out),
              "global_step": trainer.global_step, "resumed_from_step": start_step,
              "train_seconds_this_run": round(train_s, 1),
              "locality": to_dict(recipe.locality), "routers": to_dict(recipe.routers) if aux is not None else None,
              "parameters": {"backbone": n_backbone, "aux_routers": n_aux,
                             "aux_fraction_of_backbone": n_aux / n_backbone},
              "baseline": base_res, "candidate": cand, "summary": summarize(recipe, base_res, cand)}
    from expertcache.telemetry.atomic import write_json

    write_json(out / "result.json", result)
    write_text(out / "result.md", results_table([result]) + "\n")
    plot_cache(result, out / "cache.png")
    return result


def run_sweep(recipe: CacheAwareRecipe, resume: bool = True) -> dict:
    """Every value of `sweep.key` as its own run under out_dir, then one table (sweep.md, sweep.json)."""
    out = Path(recipe.out_dir)
    base = to_dict(recipe)
    base["sweep"] = {"key": "", "values": []}
    results = []
    for v in recipe.sweep.values:
        point = apply_overrides(json.loads(json.dumps(base)), [f"{recipe.sweep.key}={v}"])
        point["out_dir"] = str(out / f"{recipe.sweep.key}={v:g}")
        point["name"] = f"{recipe.name}-{recipe.sweep.key}={v:g}"
        results.append(run_cache_aware(from_dict(CacheAwareRecipe, point), resume))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep.json", [result_row(r) for r in results])
    write_text(out / "sweep.md", results_table(results) + "\n")
    return {"sweep": recipe.sweep.key, "values": recipe.sweep.values, "rows": [result_row(r) for r in results],
            "table": str(out / "sweep.md")}


# --- tables and plots ----------------------------------------------------------------------------------------

def result_row(result: dict) -> dict:
    """The figures of one run that the table shows."""
    s = result["summary"]
    row = {"name": result["name"], "mode": result["mode"], "lambda": result["locality"]["weight"],
           "dppl_percent": s["dppl_percent"],
           "gate": s["gate"].get("verdict", "PASS" if s["gate"]["pass"] else "FAIL")}
    for cap, c in s["capacities"].items():
        row[f"C={cap}"] = {
            "capacity_frac": c["capacity_frac"], "lru_miss_reduction": c["lru_miss_reduction"],
            "lru_hit_rate": c["lru"]["hit_rate"], "base_lru_hit_rate": c["base_lru"]["hit_rate"],
            "best_router_policy": c.get("best_router_policy"),
            "router_adjusted_hit_rate": c[c["best_router_policy"]]["adjusted_hit_rate"] if "best_router_policy" in c else None,
            "router_hit_rate": c[c["best_router_policy"]]["hit_rate"] if "best_router_policy" in c else None,
            "router_adjusted_gain_points": c.get("router_adjusted_gain_points"),
            "lru_traffic_MB_per_token": c["lru"]["traffic_bytes_per_token"] / 1e6,
            "router_traffic_MB_per_token": c[c["best_router_policy"]]["traffic_bytes_per_token"] / 1e6
            if "best_router_policy" in c else None}
    return row


def _f(v, fmt):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def results_table(results: list[dict]) -> str:
    """Markdown: per run, per capacity, LRU miss reduction vs the base, the routers vs LRU, Δppl and the gate."""
    rows = [result_row(r) for r in results]
    caps = [k for k in rows[0] if k.startswith("C=")]
    head = ["run", "mode", "λ"]
    for c in caps:
        frac = rows[0][c]["capacity_frac"]
        head += [f"LRU miss red. @{frac:g}E", f"LRU hit @{frac:g}E", f"routers adj. hit @{frac:g}E (Δ pts)",
                 f"traffic MB/tok LRU→routers @{frac:g}E"]
    head += ["Δppl overall", "Δppl code", "Δppl prose", "Δppl math", "gate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], r["mode"], _f(r["lambda"], "g")]
        for c in caps:
            x = r[c]
            cells += [f"{100 * x['lru_miss_reduction']:+.1f}%",
                      f"{x['lru_hit_rate']:.3f} (base {x['base_lru_hit_rate']:.3f})",
                      f"{_f(x['router_adjusted_hit_rate'], '.3f')} ({_f(x['router_adjusted_gain_points'], '+.1f')})",
                      f"{x['lru_traffic_MB_per_token']:.2f}→{_f(x['router_traffic_MB_per_token'], '.2f')}"]
        d = r["dppl_percent"]
        cells += [f"{d.get(k, float('nan')):+.2f}%" for k in ("overall", "code", "prose", "math")] + [r["gate"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def frontier_table(rows: list[dict]) -> str:
    """Markdown of the frontier's rows (expertcache.recipes.frontier): one line per (variant, serving); the
    README's post-training table. Gate figures carry their 95% paired intervals (and n: blocks per domain) where
    the row has them."""
    def pct(v, sign=False):
        return "—" if v is None else (f"{v:+.2f}%" if sign else f"{100 * v:.1f}%")

    def ci(iv, n=None):  # a 95% interval (rows gated before issue #23 have none)
        return "" if not iv else f" [{iv[0]:+.2f}, {iv[1]:+.2f}]" + ("" if n is None else f" n={n}")

    def worst_acc(r):
        if not r.get("dacc_ci95") or not r.get("dacc_points"):
            return None
        t = min(r["dacc_points"], key=r["dacc_points"].get)
        return r["dacc_ci95"][t]

    lines = ["| run | serving | LRU misses removed 1/8 E | 1/4 E | LRU hit 1/8 (Belady) | Δppl overall | worst domain | "
             "Δppl 64 blocks (vs λ=0 control) | Δacc worst (pts) | Temporal vs LRU 1/8 (traffic) | gate |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "—" if r["dacc_min_points"] is None else f"{r['dacc_min_points']:+.1f}"
        hit = "—" if r.get("lru_hit_1_8") is None else f"{r['lru_hit_1_8']:.3f} ({r['belady_hit_1_8']:.3f})"
        ctl = r.get("dppl_vs_control_pct", {}).get("overall")
        own = r.get("dppl_eval_blocks_pct", {}).get("overall")
        big = "—" if own is None else f"{pct(own, True)} ({pct(ctl, True)})"
        tg = r.get("temporal_adjusted_gain_points_1_8")
        tmp = "—" if tg is None else f"{tg:+.1f} pts ({r['temporal_traffic_ratio_1_8']:.2f}x)"
        serving = r["serving"] + (f" τ={r['tau']:g}" if r.get("tau") is not None else "")
        lines.append(f"| {r['name']} | {serving} | {pct(r['miss_reduction_1_8'])} | "
                     f"{pct(r.get('miss_reduction_1_4'))} | {hit} | "
                     f"{pct(r['dppl_overall_pct'], True)}{ci(r.get('dppl_overall_ci95'), r.get('n_blocks'))} | "
                     f"{pct(r['dppl_max_domain_pct'], True)}{ci(r.get('dppl_max_domain_ci95'))} | {big} | "
                     f"{acc}{ci(worst_acc(r))} | {tmp} | {r['gate']} |")
    return "\n".join(lines)


def plot_cache(result: dict, out_png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = result["summary"]["capacities"]
    fig, axes = plt.subplots(1, len(caps), figsize=(5 * len(caps), 4), squeeze=False)
    for ax, (cap, c) in zip(axes[0], caps.items()):
        names = ["base_lru", "lru"] + [p for p in ("temporal", "spatio", "spatio_temporal") if p in c]
        hit = [c[n]["hit_rate"] for n in names]
        adj = [c[n]["adjusted_hit_rate"] for n in names]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], hit, 0.4, label="hit rate")
        ax.bar([i + 0.2 for i in x], adj, 0.4, label="adjusted hit rate")
        ax.axhline(c["lru"]["belady_hit_rate"], ls="--", c="k", lw=1, label="Belady (this model)")
        ax.set_xticks(list(x), ["base LRU", "LRU"] + names[2:], rotation=20)
        ax.set(title=f"C = {cap} experts ({c['capacity_frac']:.3g} of E)", ylim=(0, 1))
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['name']}: decode cache figures ({result['mode']})")
    fig.tight_layout()
    write_figure(fig, out_png)
    plt.close(fig)
