"""The engine's per-layer window on the one cache state machine (`expertcache.telemetry.cache.CacheState`): the only
cache module of the runtime (there is one `cache.py`, in telemetry)."""

from __future__ import annotations

from expertcache.telemetry.cache import CacheState
from expertcache.telemetry.errors import InputError


class LayerView:
    """One MoE layer's window on a cache: expert ids of the layer <-> keys of `state`. A per-layer cache is its
    own state (offset 0); a global budget is one state over keys `layer * E + expert` shared by every layer's
    view. The engine talks to views only, so both budgets run the same code."""

    def __init__(self, state: CacheState, offset: int = 0, num_keys: int | None = None):
        self.state, self.off, self.num_keys = state, offset, num_keys

    @property
    def k(self) -> int:
        return self.state.k

    @property
    def policy(self) -> str:
        return self.state.policy

    def lookup(self, e: int) -> int | None:
        return self.state.lookup(e + self.off)

    def victim(self, e: int) -> int | None:
        return self.state.victim(e + self.off)

    def stage(self, misses: list[int]) -> dict[int, int]:
        return {e: s for e, s in zip(misses, self.state.stage([m + self.off for m in misses]).values())}

    def retain(self, step: list[int], staged: dict[int, int | None], scores: list[float] | None = None,
               transient=(), protect=()):
        if scores is not None and self.num_keys is not None:  # a global state ranks every layer's keys
            full = list(self.state.prio) if self.state.prio is not None else [float("-inf")] * self.num_keys
            full[self.off:self.off + len(scores)] = scores
            scores = full
        copies = self.state.retain([e + self.off for e in step], {e + self.off: s for e, s in staged.items()}, scores,
                                   [e + self.off for e in transient], {p + self.off for p in protect})
        return [(key - self.off, s) for key, s in copies]

    def prefetch_slot(self, e: int, protect: set[int]) -> int | None:
        return self.state.prefetch_slot(e + self.off, {p + self.off for p in protect})

    def drop(self, e: int) -> None:
        self.state.drop(e + self.off)


def keep_policy(policy: str, keep_scores, num_experts: int, top_k: int, num_layers: int):
    """`(CacheState policy, keep scores)` of an engine policy name: `learned:FILE` (`expertcache fit-policy`, lossless)
    is the scored policy over the file's keep scores; `scored` needs keep scores given (the Temporal router)."""
    from expertcache.runtime.engine.config import ENGINE_POLICIES

    spec = ENGINE_POLICIES.parse(policy)
    name = spec.name
    if name == "learned":
        from expertcache.telemetry.learned_policy import LearnedPolicy

        if keep_scores is None:
            keep_scores = LearnedPolicy.load(spec.arg, num_experts=num_experts, top_k=top_k, num_layers=num_layers)
        name = "scored"
    if name == "scored" and keep_scores is None:
        raise InputError("policy scored needs keep scores (the Temporal router of a cache-aware checkpoint, "
                         "or a learned policy file)")
    return name, keep_scores


def cache_views(part, capacity: int, num_experts: int, top_k: int, num_layers: int, policy: str,
                pinned: dict[int, list[int]], victims: bool) -> list[LayerView]:
    """Empty caches from the config's `CacheConfig` (`part.budget`): one state per layer, or one over
    `layer * E + expert` keys behind every layer's view. `capacity`: experts per layer (resolved from the part's
    capacity or budget_gb); `victims`: only where the engine serves them (`OffloadEngine.victims_on`): under miss=host
    or a packed miss copy, a prefetch (an upgrade) that kept the expert it evicts as a victim would make `prefetch`
    skip that expert for good."""
    e, k, n_l, c = num_experts, top_k, num_layers, capacity
    if part.budget == "layer":
        return [LayerView(CacheState(c, k, policy, pinned.get(i), victims=victims)) for i in range(n_l)]
    pins = [i * e + x for i in range(n_l) for x in pinned.get(i, [])[:c]] if pinned else None
    shared = CacheState(c * n_l, k, policy, pins)
    return [LayerView(shared, i * e, e * n_l) for i in range(n_l)]
