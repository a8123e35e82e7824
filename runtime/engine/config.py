"""`EngineConfig`: every option of the offload engine (the `--engine.*` flags wherever a model is served), checked
before anything is allocated; and its parts, one per stage of the engine (`CacheConfig`, `LoadConfig`, `MissConfig`,
`ComputeConfig`: `EngineConfig.parts`), each stage built from its part alone. Users fill the one flat config (its
keys are the flags, the YAML `engine:` keys and the results' config files); `PARTS` is the one table from its keys
to the parts."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple


from expertcache.telemetry.cache import POLICY_REGISTRY
from expertcache.telemetry.errors import InputError
from expertcache.telemetry.registry import Registry

from expertcache.runtime.kernels import quant
from expertcache.runtime.storage.tiers import TierSpec
from expertcache.runtime.storage.weight_checks import INTEGRITY_DEFAULT, check_integrity

from expertcache.runtime.engine.plan import MISS_REGISTRY  # the miss policies, one class each beside the plan stage

MISS_POLICIES = MISS_REGISTRY.names()
LOSSY_MISS = MISS_REGISTRY.view("lossy")
ENGINE_POLICIES = POLICY_REGISTRY.view("engine")  # lru, lfu, static, scored, learned:FILE
KERNEL_REGISTRY = Registry("kernel")  # --engine.kernel
for _k in ("native", "cpu", "auto", "triton"):
    KERNEL_REGISTRY.register(_k)
KERNELS = KERNEL_REGISTRY.names()
# shared stream slots per staging slot: a step that misses more than k experts (a batch of sequences, a prefill)
# has up to (1 + this) x k loads in flight at once instead of waves of k (on the quickstart's model, 8 clients at
# 1/4 capacity from disk: see results/serve_load.json)
STREAM_SLOTS_PER_K = 3
# experts at least this large compute as their weights arrive, overlapping the loads still in flight; smaller ones
# compute in one call once all have arrived (per-arrival calls cost more than they hide: 56% of a batched step's
# time on the quickstart's 24 KiB experts went to them)
OVERLAP_MIN_BYTES = 1 << 20


def _types(part, strings=(), integers=()) -> None:
    """Fields of the wrong type, first: the Python API takes anything."""
    for name in strings:
        if not isinstance(getattr(part, name), str):
            raise InputError(f"{name}={getattr(part, name)!r}; expected a string")
    for name in integers:
        v = getattr(part, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise InputError(f"{name}={v!r}; expected an integer")


@dataclass(frozen=True)
class CacheConfig:
    """The cache's part: how many slots, shared how, and what stays (`CacheState`, `LayerView`)."""
    capacity: int | float
    budget: str
    budget_gb: float
    policy: str
    victims: bool

    def check(self) -> None:
        from expertcache.telemetry.cachesim import capacity_count

        _types(self, strings=("policy", "budget"))
        if not isinstance(self.victims, bool):
            raise InputError(f"victims={self.victims!r}; expected true or false")
        if isinstance(self.budget_gb, bool) or not isinstance(self.budget_gb, numbers.Real) \
                or not math.isfinite(self.budget_gb) or self.budget_gb < 0:
            raise InputError(f"budget_gb={self.budget_gb!r}; expected GiB >= 0 (0: use capacity)")
        ENGINE_POLICIES.parse(self.policy)
        if self.budget not in ("layer", "global"):
            raise InputError(f"budget={self.budget!r}; expected layer or global")
        capacity_count(self.capacity, None)  # the form (a fraction or a count); the range needs the model's E


@dataclass(frozen=True)
class LoadConfig:
    """The loads stage's part (`loads.Loads`): where the bytes come from, how many move at once, what is
    prefetched, and the checks on what is read."""
    tier: str
    workers: int
    max_inflight_bytes: int
    predictor: str
    prefetch_budget: int
    prefetch_guard: float
    integrity: str

    def check(self) -> None:
        _types(self, strings=("tier", "predictor", "integrity"),
               integers=("prefetch_budget", "max_inflight_bytes", "workers"))
        TierSpec.parse(self.tier)
        if isinstance(self.prefetch_guard, bool) or not isinstance(self.prefetch_guard, numbers.Real) \
                or not 0 <= self.prefetch_guard <= 1:
            raise InputError(f"prefetch_guard={self.prefetch_guard!r}; expected a precision in [0, 1] (0: never pause)")
        for name in ("prefetch_budget", "max_inflight_bytes"):
            if getattr(self, name) < 0:
                raise InputError(f"{name}={getattr(self, name)}; expected >= 0")
        if self.workers < 1:
            raise InputError(f"workers={self.workers}; expected >= 1")
        check_integrity(self.integrity, "integrity")


@dataclass(frozen=True)
class MissConfig:
    """The plan stage's part (`plan.Plan`): what serves a miss."""
    miss: str
    tau: float
    miss_precision: int
    miss_copy: str
    miss_upgrade: int

    def check(self) -> None:
        _types(self, strings=("miss", "miss_copy"), integers=("miss_precision", "miss_upgrade"))
        if isinstance(self.tau, bool) or not isinstance(self.tau, numbers.Real):
            raise InputError(f"tau={self.tau!r}; expected a number")
        MISS_REGISTRY.parse(self.miss)
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise InputError(f"tau={self.tau}; expected a finite margin >= 0")
        if self.miss_precision not in (0, 4, 8):
            raise InputError(f"miss_precision={self.miss_precision}; expected 0 (off), 4 or 8 bits")
        if self.miss_upgrade < 1:
            raise InputError(f"miss_upgrade={self.miss_upgrade}; expected >= 1")
        if not self.miss_precision:
            if self.miss_copy:
                raise InputError("miss_copy is the packed copy of --engine.miss_precision; give that too, or drop it")
            return
        if self.miss != "blocking":
            raise InputError(f"miss_precision serves a miss from its packed copy; it replaces the miss policy "
                             f"{self.miss!r} (use --engine.miss blocking)")

    def check_copy(self) -> None:
        """The packed copy of `miss_precision`: a folder `expertcache quantize` wrote at that many bits."""
        if not self.miss_precision:
            return
        if not self.miss_copy:
            raise InputError(f"miss_precision={self.miss_precision} needs --engine.miss_copy DIR: `expertcache "
                             f"quantize --model CKPT --bits {self.miss_precision} --out DIR` of this checkpoint")
        if not Path(self.miss_copy).is_dir():
            raise InputError(f"miss_copy {self.miss_copy}: no such folder")
        qc = quant.read_config(self.miss_copy)
        if qc is None:
            raise InputError(f"miss_copy {self.miss_copy} is not an `expertcache quantize` checkpoint (its config has "
                             f"no quantization_config)")
        if qc["bits"] != self.miss_precision:
            raise InputError(f"miss_copy {self.miss_copy} is packed at {qc['bits']} bits; miss_precision is "
                             f"{self.miss_precision}")


@dataclass(frozen=True)
class ComputeConfig:
    """The compute stage's part (`experts.Compute`): where and with which kernels experts compute."""
    device: str
    kernel: str
    threads: int

    def check(self) -> None:
        _types(self, strings=("device", "kernel"), integers=("threads",))
        if self.device not in ("cpu", "cuda"):
            raise InputError(f"device={self.device!r}; expected cpu or cuda")
        if self.threads < 0:
            raise InputError(f"threads={self.threads}; expected >= 1, or 0 for one per core")
        if self.kernel not in KERNELS:
            raise InputError(f"kernel={self.kernel!r}; expected one of {', '.join(KERNELS)}")


class EngineParts(NamedTuple):
    cache: CacheConfig
    load: LoadConfig
    miss: MissConfig
    compute: ComputeConfig


# the one table from the flat keys users give (`--engine.capacity`, YAML `engine: {capacity: ...}`) to the parts:
# each key in exactly one part
_PART_TYPES = (CacheConfig, LoadConfig, MissConfig, ComputeConfig)  # in EngineParts' order
PARTS = {name: tuple(f.name for f in fields(cls)) for name, cls in zip(EngineParts._fields, _PART_TYPES)}


@dataclass
class EngineConfig:
    """How the offload engine serves a model: the one set of engine options of every command and API.

    Args:
        capacity: resident experts per MoE layer: a fraction of E is a float in (0, 1] (0.25 = a quarter, 1.0 =
            all E), a count of experts an integer >= 1 (16); a float above 1 is refused; see
            `expertcache.telemetry.cachesim.capacity_count`
        tier: where the experts live: auto (the default: host when a RAM copy of every expert fits in half the
            memory available, else disk; the choice and why are in `describe()` and every command's output) | disk
            (O_DIRECT reads of the checkpoint's files) | host (a RAM copy) | throttled:<GB/s> (host, paced like a
            slower link) | cuda (host RAM pinned, slots on the GPU)
        policy: cache eviction: lru | lfu | static | scored (the checkpoint's Temporal router decides what stays) |
            learned:FILE (fitted with `expertcache fit-policy`)
        miss: blocking (lossless: wait for the expert) | reroute (lossy: a resident expert within tau of the
            missed one's router weight takes its place) | speculative (lossy) | host (compute a miss where it lives)
        tau: reroute margin on router probabilities
        predictor: what is prefetched for later layers: none | probe:D (layer L+D) | lookahead:D (L+1..L+D) |
            persistence | estimator:FILE | spatio (the checkpoint's Spatio router)
        prefetch_budget: experts prefetched per layer per token (0: as many as the predictor names, up to k)
        prefetch_guard: the least precision (experts predicted for a layer that it then used / predicted) a
            predictor must show for prefetching to go on, measured online: it starts in shadow (predicting, reading
            nothing) and prefetches once 32 scored experts reach this precision; a window of 32 prefetches under it
            pauses prefetching and the predictor for 256 layer steps (doubling while it keeps failing, up to 16x),
            then shadow again (in shadow the predictor runs on one decode token in 8: `PrefetchGuard`). A wrong
            prefetch reads an expert and evicts one the cache would have kept, a right one saves one read: under
            about half right it costs more than it saves. 0: no guard, always prefetch
        max_inflight_bytes: bytes of transfers in flight at most
        workers: transfer threads
        budget: layer (C slots per layer) | global (one cache of C x layers slots shared by every layer)
        device: where the slots and the non-expert model live: cpu | cuda
        kernel: auto (the default: cpu where it applies, else native) | native (the family's own expert forward:
            greedy tokens bit-identical to plain generate) | cpu (the AVX-512 kernels of `runtime.cpu_kernels`:
            bf16 SwiGLU experts on CPU slots and the decode-sized linears, fp32 accumulation, each weight read
            once; equal to plain up to rounding, refused where it cannot run) | triton (SwiGLU families on CUDA)
        budget_gb: the cache's size in GiB of slots instead of a capacity in experts (0: use capacity): as many
            experts per layer as fit (staging slots included; a quantized checkpoint's packed experts take their
            packed size, so the same GiB holds 2-3x more), at most E
        threads: compute threads (torch's intra-op pool, which the CPU kernels share; set process-wide when the
            engine starts): 0 keeps torch's default, one per core. Measured here (results/kernels.json): 2 threads
            decode 1.1-1.5x faster than 1 on this 2-core machine, so the default uses every core
        miss_precision: 0 (a miss is read at the checkpoint's own precision) | 4 | 8: precision as a cache
            policy (lossy). A miss is computed from the packed copy in `miss_copy`, read at its size and not
            admitted; an expert served that way `miss_upgrade` times at a layer is then loaded at full precision
            in the background and admitted, so hot experts run at full precision and cold ones cost a small read
        miss_copy: the packed copy for `miss_precision`: `expertcache quantize --model CKPT --bits N` of this
            checkpoint
        miss_upgrade: low-precision serves of an expert at a layer before it is upgraded (loaded at full
            precision and admitted); 1 upgrades every miss for the tokens after it
        victims: the k staging slots every layer holds anyway keep the bytes of the experts that last left the
            cache, and a miss on one of them is served from there with nothing read (lossless). It applies with a
            per-layer budget, a policy that evicts (not static) and misses read into the staging slots (not miss
            host, not miss_precision); `describe()` says whether it is on. In one-token steps without prefetch,
            LRU over C slots then hits as LRU over C + k would without it (the simulator's figure at C + k); batched
            and prefill steps, which stream extra misses through other slots, differ. false: the simulator's C
        integrity: on (every expert's first read, and the non-expert weights at load, pass `verify`'s reference-free
            checks: finite, and no tensor over 1000x its siblings' magnitude (an exponent flip); a failure is refused
            naming the tensor) | off (served as read)
    """

    capacity: int | float = 0.25
    tier: str = "auto"
    policy: str = "lru"
    miss: str = "blocking"
    tau: float = 0.1
    predictor: str = "none"
    prefetch_budget: int = 0
    prefetch_guard: float = 0.5
    max_inflight_bytes: int = 1 << 30
    workers: int = 4
    budget: str = "layer"
    device: str = "cpu"
    kernel: str = "auto"
    budget_gb: float = 0.0
    threads: int = 0
    miss_precision: int = 0
    miss_copy: str = ""
    miss_upgrade: int = 2
    victims: bool = True
    integrity: str = INTEGRITY_DEFAULT

    @classmethod
    def from_text(cls, options: dict) -> "EngineConfig":
        """The config named by options given as text (lm-eval's `key=value,...` model args): each value parsed by
        its field's type, then checked. `capacity`: `16` is a count of experts, `0.25` and `1.0` fractions of E."""
        types = {f.name: f.type for f in cls.__dataclass_fields__.values()}
        unknown = sorted(set(options) - set(types))
        if unknown:
            raise InputError(f"unknown engine option(s) {', '.join(unknown)}; expected {', '.join(sorted(types))}")
        out = {}
        for k, v in options.items():
            t = types[k]
            try:
                if isinstance(v, str):
                    v = v.strip()
                    if t == "int | float":
                        v = int(v) if v.lstrip("+-").isdigit() else float(v)
                    elif t in ("int", "float"):
                        v = int(v) if t == "int" else float(v)
                    elif t == "bool":
                        if v.lower() not in ("true", "false", "1", "0"):
                            raise ValueError(v)
                        v = v.lower() in ("true", "1")
                out[k] = v
            except ValueError:
                what = {"int | float": "a float or an integer", "bool": "true or false"}.get(t, f"a {t}")
                raise InputError(f"engine option {k}={v!r}: expected {what}") from None
        cfg = cls(**out)
        cfg.check()
        return cfg

    @property
    def parts(self) -> EngineParts:
        """The config as the engine's stages take it: one part each (`PARTS` says which key goes where)."""
        return EngineParts(*(cls(**{k: getattr(self, k) for k in PARTS[name]})
                             for name, cls in zip(EngineParts._fields, _PART_TYPES)))

    @classmethod
    def from_parts(cls, parts: EngineParts) -> "EngineConfig":
        """The flat config of `parts` (`EngineConfig.parts` inverted)."""
        return cls(**{k: getattr(part, k) for part, name in zip(parts, EngineParts._fields) for k in PARTS[name]})

    @property
    def lossy(self) -> bool:
        """Outputs depend on the cache state (evaluated one token at a time); `host` only reorders a sum."""
        return self.miss in LOSSY_MISS or bool(self.miss_precision)

    def label(self) -> str:
        c = self.capacity  # 1 (a count: one expert) and 1.0 (a fraction: all E) must not print alike
        s = f"C={int(c) if isinstance(c, int) else float(c)},{self.miss}" if not self.budget_gb else \
            f"{self.budget_gb:g}GiB,{self.miss}"
        return s + (f",tau={self.tau:g}" if self.miss == "reroute" else "") + \
            (f",miss{self.miss_precision}bit,up{self.miss_upgrade}" if self.miss_precision else "")

    def slots(self, num_experts: int, top_k: int) -> int:
        from expertcache.telemetry.cachesim import capacity_count

        return capacity_count(self.capacity, num_experts)

    def check(self) -> None:
        """Every field in range, before anything is allocated: each part's own fields (`CacheConfig.check`, ...,
        in `EngineParts`' order), then what one part's fields require of another's."""
        parts = self.parts
        for part in parts:
            part.check()
        if self.miss == "host" and TierSpec.parse(self.tier).kind not in ("host", "throttled", "auto"):
            raise InputError(f"miss policy host computes experts where they live: it needs the host or a "
                             f"throttled tier, not {self.tier}")
        if self.miss_precision and self.slot_device != "cpu":
            raise InputError("miss_precision computes packed experts on the CPU: drop --engine.device cuda")
        parts.miss.check_copy()
        if self.kernel == "cpu" and self.slot_device != "cpu":
            raise InputError("kernel cpu computes on CPU slots: drop --engine.device cuda / --engine.tier cuda, or use "
                             "--engine.kernel triton")
        if self.kernel == "triton":  # where it cannot run, the native path would run without a word
            if self.slot_device != "cuda":
                raise InputError("kernel triton runs on CUDA slots only: add --engine.device cuda (or --engine.tier "
                                 "cuda), or use --engine.kernel native")
            from expertcache.runtime.kernels.triton_experts import HAVE_TRITON

            if not HAVE_TRITON:
                raise InputError("kernel triton: the triton package is not installed here; use --engine.kernel "
                                 "native")

    @property
    def slot_device(self) -> str:
        return "cuda" if self.tier == "cuda" else self.device
