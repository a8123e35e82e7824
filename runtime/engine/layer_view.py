"""The engine's per-layer window on the one cache state machine (`expertcache.telemetry.cache.CacheState`): the only
cache module of the runtime (there is one `cache.py`, in telemetry)."""

from __future__ import annotations

from expertcache.telemetry.cache import CacheState


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
