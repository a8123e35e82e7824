"""The one cache simulator: analysis, trainer metrics and the runtime's bookkeeping all use it.

Input: `steps [S, k]` integer keys in time order. A per-layer cache gets one layer's experts per token; a global
budget gets keys `layer * E + expert` with steps ordered token-major, layer-minor. Capacity C = resident keys.

Two semantics (METRICS.md; reference README):
- ``token`` (ours, what a real engine needs): a step's k experts must be resident together. Hits are counted
  for the whole step first; then each miss is loaded (through a staging buffer), and what stays resident for
  the next step is decided: LRU/LFU evict a key the current step did not use; if C < k the step cannot fit and
  misses that find no evictable key stream through without being kept.
- ``reference`` (the published simulator, read literally): a step's k experts are accessed one after another;
  a miss inserts the key, evicting first if full, and may evict a key the same step used a moment ago. LRU
  recency is the step index (ties to the smallest key); Belady ranks every resident key by its next use
  *after the current step*, so a key needed later in the same step can be evicted. This reproduces the
  published Qwen3-30B-A3B table (scripts/reference_check.py); it is weaker than the true optimum.

Policies: ``lru`` (recency by step; within a step, by position), ``lfu`` (cumulative access counts, ties to the least recent, then the smallest key),
``static`` (the C most frequent keys of a fit sequence, pinned; misses stream; ties as
numpy's default argsort orders them), ``belady`` (the offline optimum: under ``token`` semantics, once a step
has run, the cache keeps the C keys of (resident ∪ step) whose next use comes soonest, a missing key streaming
through when it would not be among them; the resident keys a step needs are never evicted *during* the step,
but any key may go after it, so Belady bounds every policy here, `simulate_scored`'s included; under
``reference`` semantics every miss is inserted, as published).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cache import POLICY_REGISTRY, CacheState, check_slots
from .errors import InputError
from .registry import Registry
from .rows import check_rows

# The simulator's view of the one policy registry (`cache.POLICY_REGISTRY`): CacheState's policies with `belady`,
# the scored policy ranked by each key's next use in the trace (the offline optimum), in place of `scored`.
SIM_POLICIES = POLICY_REGISTRY.view("sim")
POLICIES = SIM_POLICIES.names()  # ("lru", "lfu", "static", "belady")
LEARNED = "learned"  # a fitted policy file's keep scores through the scored path (not in POLICIES: needs a file)
SEMANTICS_REGISTRY = Registry("semantics")  # analyze --semantics
for _s in ("token", "reference"):
    SEMANTICS_REGISTRY.register(_s)
SEMANTICS = SEMANTICS_REGISTRY.names()
_INF = 1 << 60


@dataclass
class CacheResult:
    policy: str
    capacity: int
    semantics: str
    steps: int
    accesses: int
    hits: int
    loads: int  # demand loads (misses)
    prefetches: int = 0  # loads issued ahead of the access by a predictor, used or not

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def adjusted_hit_rate(self) -> float:
        """`1 - (D + P) / A` (METRICS.md): every load counts, so a wasted prefetch costs as much as a miss."""
        return 1.0 - (self.loads + self.prefetches) / self.accesses if self.accesses else 0.0

    def __add__(self, other: "CacheResult") -> "CacheResult":
        """Counts of two caches (or two runs of one) together; the name and capacity of the first."""
        return CacheResult(self.policy, self.capacity, self.semantics, self.steps + other.steps,
                           self.accesses + other.accesses, self.hits + other.hits, self.loads + other.loads,
                           self.prefetches + other.prefetches)

    @staticmethod
    def total(results: "list[CacheResult]") -> "CacheResult":
        """The counts of several caches (e.g. one per layer) together, under the first one's name and capacity."""
        out = results[0]
        for r in results[1:]:
            out = out + r
        return out

    def traffic_per_step(self, bytes_per_key: int, steps: int | None = None) -> float:
        """Bytes moved (every load, demand or prefetch) per step (per output token when `steps` is the token
        count of several caches' results added together)."""
        n = self.steps if steps is None else steps
        return (self.loads + self.prefetches) * bytes_per_key / n if n else 0.0

    @property
    def misses_per_step(self) -> float:
        return (self.accesses - self.hits) / self.steps if self.steps else 0.0

    def per_step(self, bytes_per_key: int, unit: str = "step", steps: int | None = None) -> dict:
        """The per-step figures every command prints (METRICS.md), named per `unit` (`token` where a step is an
        output token): hit rate, adjusted hit rate, demand loads, prefetch loads, misses and traffic in bytes.
        `steps`: as in `traffic_per_step` (the token count of several layers' caches added together)."""
        n = self.steps if steps is None else steps
        return {"hit_rate": self.hit_rate, "adjusted_hit_rate": self.adjusted_hit_rate,
                f"demand_loads_per_{unit}": self.loads / n if n else 0.0,
                f"prefetch_loads_per_{unit}": self.prefetches / n if n else 0.0,
                f"misses_per_{unit}": (self.accesses - self.hits) / n if n else 0.0,
                f"traffic_bytes_per_{unit}": self.traffic_per_step(bytes_per_key, n)}

    def to_dict(self) -> dict:
        return {"policy": self.policy, "capacity": self.capacity, "semantics": self.semantics, "steps": self.steps,
                "accesses": self.accesses, "hits": self.hits, "loads": self.loads, "prefetches": self.prefetches,
                "hit_rate": round(self.hit_rate, 6), "adjusted_hit_rate": round(self.adjusted_hit_rate, 6),
                "misses_per_step": round(self.misses_per_step, 6)}


def capacity_count(capacity: int | float, num_experts: int | None) -> int | None:
    """The one capacity rule (every command, the engine, the simulator, the trainer's figures): resident experts
    per layer. A float in (0, 1] is a fraction of E, rounded, at least 1 expert (so 1.0 is all E); an integer >= 1
    is a count of experts, at most E. Anything else is an InputError: a float above 1 (16.0 is neither: write 16
    for a count), zero, a negative or non-finite number, a bool, a string. `num_experts` None checks the form only
    (before a model is known) and returns None. Command lines and recipes give `16` as an int, `0.25`/`1.0` as
    floats."""
    import math
    import numbers

    form = "a fraction of E is a float in (0, 1] (1.0 = all experts), a count of experts an integer >= 1"
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Real):
        raise InputError(f"capacity {capacity!r}: {form}")
    if isinstance(capacity, numbers.Integral):
        if capacity < 1:
            raise InputError(f"capacity {int(capacity)}: {form}")
        if num_experts is not None and capacity > num_experts:
            raise InputError(f"capacity {int(capacity)} experts, but a layer has only {num_experts}")
        return None if num_experts is None else int(capacity)
    c = float(capacity)
    if not (math.isfinite(c) and 0 < c <= 1):
        hint = f" (for a count of {int(c)} experts write {int(c)})" if math.isfinite(c) and c > 1 and c == int(c) \
            else ""
        raise InputError(f"capacity {c!r}: {form}{hint}")
    return None if num_experts is None else max(1, round(c * num_experts))


def budget_capacity(budget_bytes: int | float, slot_bytes: int, layers: int, top_k: int, num_experts: int,
                    scope: str = "layer") -> int:
    """The one budget rule (the engine's `budget_gb`, bench big's memory budget): experts per layer that
    `budget_bytes` of cache slots of `slot_bytes` each hold, at most E. Each pool keeps `top_k` staging slots
    (a miss reads into one): one pool per layer (`scope` "layer"), or one pool over every layer ("global").
    Below 1 when the budget holds too few slots; the caller says so in its own terms."""
    slots = int(budget_bytes // slot_bytes)
    cap = slots // layers - top_k if scope == "layer" else (slots - top_k) // layers
    return min(cap, num_experts)


def _check(steps: np.ndarray, capacity: int, policy: str, semantics: str) -> np.ndarray:
    """`steps` as a C-contiguous int64 `[S, k]` array of distinct non-negative keys per row, or InputError."""
    SIM_POLICIES.parse(policy)
    if semantics not in SEMANTICS:
        raise InputError(f"unknown semantics {semantics!r}; expected one of {SEMANTICS}")
    check_slots(capacity)
    steps = np.asarray(steps)
    if steps.ndim != 2:
        raise InputError(f"steps must be [S, k], got shape {steps.shape}")
    if steps.size and not np.issubdtype(steps.dtype, np.integer):
        raise InputError(f"steps must be integer keys, got {steps.dtype}")
    steps = np.ascontiguousarray(steps, dtype=np.int64)
    check_rows(steps)
    return steps


def _n_keys(steps: np.ndarray) -> int:
    return int(steps.max()) + 1 if steps.size else 1


def simulate(steps: np.ndarray, capacity: int, policy: str = "lru", semantics: str = "token",
             fit: np.ndarray | None = None, keep=None) -> CacheResult:
    """Hit/miss counts of one cache over `steps`. `fit` (static only): the steps whose frequencies pick the pins.
    ``learned`` (token semantics): the scored path driven by `keep`, a fitted policy's keep scores for these
    steps (an `[S, E]` array; `LearnedPolicy.keep_stream`, expertcache.telemetry.learned_policy).

    Each policy runs as a compiled loop (`simkernels`) that tests prove equal to driving `CacheState`."""
    from . import simkernels as sk

    if policy == LEARNED:
        if semantics != "token":
            raise InputError("the learned policy is simulated under token semantics only")
        if keep is None:
            raise InputError("policy learned needs its keep scores (LearnedPolicy.keep_stream over the trace)")
        return simulate_scored(steps, capacity, keep, name=LEARNED)
    rows = _check(steps, capacity, policy, semantics)
    n = _n_keys(rows)
    if policy == "static":
        pins = _pins(fit if fit is not None else rows, capacity)
        hits = int(np.isin(rows, np.asarray(pins, dtype=np.int64)).sum())
    elif policy == "belady":
        hits = sk.belady(rows, capacity, n, semantics == "token")
    elif semantics == "token":
        hits = (sk.lru_token if policy == "lru" else sk.lfu_token)(rows, capacity, n)
    else:
        hits = simulate_reference(rows, capacity, policy)
    acc = int(rows.size)
    return CacheResult(policy, capacity, semantics, len(rows), acc, int(hits), acc - int(hits))


def _pins(fit, capacity: int) -> list[int]:
    """The static policy's pinned keys: the `capacity` most frequent of `fit`."""
    fit = np.asarray(fit).reshape(-1).astype(np.int64)
    counts = np.bincount(fit)
    # Most frequent first; ties in the order of numpy's default argsort, which reproduces the published table.
    return np.argsort(-counts)[:capacity].tolist()


def _state(rows, capacity: int, policy: str, pinned=None) -> CacheState:
    return CacheState(capacity, max((len(r) for r in rows), default=1), policy, pinned)


def drive(rows, state: CacheState, keep=None, prefetch=None) -> tuple[int, int, int]:
    """(hits, demand loads, prefetch loads) of the cache `state` driven over `rows` (token semantics), exactly as
    the engine drives it: before step s, the keys `prefetch[s]` (-1: none) are given resident slots; then the
    step's resident keys hit, its misses are staged, and `retain` decides what stays (`keep`: the scored
    policy's scores for each step, an `[S, E]` array or an iterator of rows). The definition the compiled
    kernels are tested against, and the path for prefetching (`simulate_scored(prefetch=...)`)."""
    hits = loads = pre = 0
    if keep is not None:
        keep = iter(keep) if _is_stream(keep) else (row.tolist() for row in keep)
    for s, r in enumerate(rows):
        if prefetch is not None:
            want = [e for e in prefetch[s] if e >= 0]
            protect = set(want)
            for e in want:
                if state.lookup(e) is not None:
                    continue
                if state.prefetch_slot(e, protect) is None:
                    break  # every resident key is itself predicted
                pre += 1
        miss = [e for e in r if state.lookup(e) is None]
        hits += len(r) - len(miss)
        loads += len(miss)
        state.retain(r, state.stage(miss), next(keep) if keep is not None else None)
    return hits, loads, pre


# --- the published reference semantics (read literally; reproduces the published Qwen3-30B-A3B table) ---------

def simulate_reference(rows, capacity: int, policy: str) -> int:
    """Hits under the reference semantics: a step's keys accessed one after another, each miss inserted at once
    (evicting first if full), so a key the same step used a moment ago can go. `lru` (the least recent step, ties
    to the smallest key) and `lfu` (the least (count, last step, key)); `belady` and `static` are shared with the
    token semantics: see `simulate`."""
    from . import simkernels as sk

    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if policy == "lru":
        return int(sk.lru_reference(rows, capacity, _n_keys(rows)))
    if policy == "lfu":
        return int(sk.lfu_reference(rows, capacity, _n_keys(rows)))
    raise InputError(f"the reference semantics has lru and lfu of its own; {policy!r} is simulated by `simulate`")


NEVER = _INF  # next use of a key that is never used again


def next_use_steps(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """One layer's `ids [T, k]` -> `[T, E]` int64: the step of each expert's next use after t (`NEVER` if none).
    The dense form of `next_use`: Belady's keep scores (replay), the learned policy's supervision."""
    t_n = ids.shape[0]
    used = np.zeros((t_n, num_experts), bool)
    np.put_along_axis(used, np.asarray(ids, dtype=np.int64), True, axis=1)
    nxt = np.full(num_experts, NEVER, np.int64)
    out = np.empty((t_n, num_experts), np.int64)
    for t in range(t_n - 1, -1, -1):
        out[t] = nxt
        nxt = np.where(used[t], t, nxt)
    return out


def next_use(rows) -> list[list[int]]:
    """nxt[s][j]: the next step after s that uses rows[s][j] (`NEVER` if none)."""
    from . import simkernels as sk

    rows = np.ascontiguousarray(rows, dtype=np.int64)
    return sk.next_use(rows, _n_keys(rows)).tolist()


def simulate_scored(steps: np.ndarray, capacity: int, keep=None, prefetch: np.ndarray | None = None,
                    name: str | None = None) -> CacheResult:
    """One per-layer cache (token semantics) driven by a predictor's scores; LRU where it has none.

    - `keep [S, E]`: scores computed after step s for step s+1 (a Temporal router). After the access the cache
      keeps the top-C keys of (resident ∪ step s's keys) by `keep[s]`, ties to the more recent: an update-only
      policy that never loads anything itself, and may let a just-used key stream through (bypass).
      Without `keep`, every key of the step is kept and the least recently used one is evicted (= `lru`).
      `keep` may also be an iterator of per-step score lists, consumed in step order (a learned policy's
      `keep_stream`: ``learned``; a row may be the same list object updated in place).
    - `prefetch [S, R]`: keys to load before step s is accessed (a Spatio refinement, -1 = none), at most R per
      step. Each one not resident is loaded (counted in `prefetches`, used or not), evicting the resident key
      with the lowest priority (`keep[s-1]`, or recency without `keep`) that is not itself being prefetched.
    """
    rows = _check(steps, capacity, "lru", "token")
    e_max = _n_keys(rows)
    stream = keep is not None and _is_stream(keep)
    if keep is not None and not stream:
        keep = np.asarray(keep, dtype=np.float64)
        if keep.ndim != 2 or keep.shape[0] != len(rows) or keep.shape[1] < e_max:
            raise InputError(f"keep scores have shape {keep.shape}; expected [{len(rows)}, >= {e_max}]")
    if prefetch is not None:
        prefetch = np.asarray(prefetch)
        if prefetch.ndim != 2 or prefetch.shape[0] != len(rows):
            raise InputError(f"prefetch has shape {prefetch.shape}; expected [{len(rows)}, R]")
    label = name or ("scored" if keep is not None else "lru")
    acc = int(rows.size)
    if prefetch is None and not stream:  # the compiled paths
        if keep is None:
            from .simkernels import lru_token

            hits = int(lru_token(rows, capacity, e_max))
        else:
            sc = ScoredCache(capacity, 1, keep.shape[1])
            sc.run(rows[None], keep[:, None, :])
            hits = sc.hits
        return CacheResult(label, capacity, "token", len(rows), acc, hits, acc - hits)
    hits, loads, pre = drive(rows.tolist(), _state(rows, capacity, "scored" if keep is not None else "lru"), keep,
                             None if prefetch is None else prefetch.tolist())
    return CacheResult(label, capacity, "token", len(rows), acc, hits, loads, pre)


class ScoredCache:
    """One cache under the scored policy, fed chunk by chunk (token semantics, no prefetch): `run(ids, keep)`
    with `ids [B, T, k]` the steps of B blocks of E keys (B = 1: a per-layer cache; B = layers: a global budget
    of `capacity` keys, steps token-major) and `keep [T, B, E]` the scores each block's step leaves. Scores
    of a chunk may be dropped once `run` returns, so a learned policy's scores are computed in batches."""

    def __init__(self, capacity: int, blocks: int, num_experts: int):
        self.capacity, self.e = check_slots(capacity), num_experts
        self.res = np.zeros(blocks * num_experts, np.bool_)
        self.rank = np.zeros(blocks * num_experts, np.int64)
        self.bmin = np.full(blocks, -1, np.int64)
        self.state = np.zeros(3, np.int64)  # resident keys, steps, hits
        self.prev = np.full((blocks, num_experts), -np.inf)
        self.accesses = 0

    def run(self, ids: np.ndarray, keep: np.ndarray) -> None:
        from .simkernels import scored_chunk

        ids = np.ascontiguousarray(ids, dtype=np.int64)
        keep = np.ascontiguousarray(keep, dtype=np.float64)
        if keep.shape != (ids.shape[1], ids.shape[0], self.e):
            raise InputError(f"keep scores have shape {keep.shape}; expected {(ids.shape[1], ids.shape[0], self.e)}")
        scored_chunk(ids, keep, self.prev, self.capacity, self.res, self.rank, self.bmin, self.state)
        if len(keep):
            self.prev = keep[-1].copy()
        self.accesses += int(ids.size)

    @property
    def hits(self) -> int:
        return int(self.state[2])

    def result(self, name: str = LEARNED) -> CacheResult:
        return CacheResult(name, self.capacity, "token", int(self.state[1]), self.accesses, self.hits,
                           self.accesses - self.hits)


def _is_stream(keep) -> bool:
    """Keep scores given one row at a time (a generator of per-step lists, e.g. a learned policy's
    `keep_stream`) rather than as an `[S, E]` array."""
    return not isinstance(keep, (np.ndarray, list, tuple))


# --- helpers for traces ------------------------------------------------------------------------------------

def global_steps(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[layers, tokens, k] -> [tokens * layers, k] keys `layer * E + expert`, token-major (the decode order)."""
    n_layers = ids.shape[0]
    keys = ids.astype(np.int64) + (np.arange(n_layers, dtype=np.int64) * num_experts)[:, None, None]
    return keys.transpose(1, 0, 2).reshape(-1, ids.shape[2])
