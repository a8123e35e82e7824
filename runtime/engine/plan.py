"""The plan stage: given the experts a layer's tokens chose and the cache's state, what serves each one. A resident
slot (a hit), the bytes a staging slot still holds (a victim), or, for a miss, what its miss policy says: a demand
load (`blocking`), a resident expert within tau of it (`reroute`), the prefetched prediction (`speculative`), a
compute where its weights live (`host`), or the packed copy of `miss_precision` (`LowBit`). The policies are one
class each in `MISS_REGISTRY`, the names users give (`--engine.miss`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertcache.telemetry.cache import reroute_choice
from expertcache.telemetry.registry import Registry

# What a step does about a missing expert: wait for it, swap it for a resident one within tau, run the prediction
# instead, or compute it where it lives. `lossy`: outputs depend on the cache state.
MISS_REGISTRY = Registry("miss policy")


class MissPolicy:
    """What serves a layer's misses. `serve`: how the compute stage gets them (`load`: demand loads into the staging
    and stream slots; `host`: computed where their weights live; `low`: read from the packed copy); `admits`:
    whether the cache may keep them afterwards."""

    serve = "load"
    admits = True

    def __init__(self, part):  # part: the config's `MissConfig`
        self.part = part

    def substitute(self, plan: "Plan", pos: int, index, weights, prefetched: set[int]):
        """The layer's choices after the policy's substitutions (vectorised over tokens), and how many changed."""
        return index, weights, 0

    def after(self, loads, pos: int, misses: list[int]) -> None:
        """Once the layer has computed (its slots may take new loads)."""


@MISS_REGISTRY.register("blocking")
class Blocking(MissPolicy):
    """Wait for a missing expert (lossless)."""


@MISS_REGISTRY.register("reroute", tags=("lossy",))
class Reroute(MissPolicy):
    """A resident expert whose router probability is within tau of the missed one's takes its place."""

    def substitute(self, plan, pos, index, weights, prefetched):
        return plan.reroute(pos, index, weights, tau=self.part.tau)


@MISS_REGISTRY.register("speculative", tags=("lossy",))
class Speculative(MissPolicy):
    """The prefetched prediction runs instead of a missing true choice."""

    def substitute(self, plan, pos, index, weights, prefetched):
        return plan.reroute(pos, index, weights, set(prefetched), float("inf"))


@MISS_REGISTRY.register("host")
class Host(MissPolicy):
    """A miss computes where its weights live (host or throttled tier): nothing moved, nothing admitted."""

    serve, admits = "host", False


class LowBit(MissPolicy):
    """Precision as a cache policy (`miss_precision`, beside miss blocking): a miss computes from the packed copy,
    read at its size and not admitted; an expert served so `miss_upgrade` times at a layer is then loaded at full
    precision in the background and admitted."""

    serve, admits = "low", False

    def __init__(self, part, num_layers: int):
        super().__init__(part)
        self.count: list[dict[int, int]] = [{} for _ in range(num_layers)]

    def after(self, loads, pos, misses):
        counts, hot = self.count[pos], []
        for e in misses:
            counts[e] = counts.get(e, 0) + 1
            if counts[e] >= self.part.miss_upgrade:
                hot.append(e)
                del counts[e]
        if hot:  # the layer is done computing: its slots may take the upgrades
            loads.prefetch(pos, hot, upgrade=True)

    def reset(self) -> None:
        for c in self.count:
            c.clear()


@dataclass
class LayerPlan:
    """What serves each expert a layer needs: `slot_of` the resident ones' slots, `misses` to be served by the
    policy, `reused` victims served from the staging slot that still holds them; `serve`: `slots` when every
    (token, choice) is resident and the family's one call computes them, else the policy's."""

    needed: list[int]
    slot_of: dict[int, int | None]
    hits: list[int]
    misses: list[int]
    reused: list[int]
    serve: str
    policy: MissPolicy


class Plan:
    """The plan stage over the layers' cache views (`states`, handed over by the engine on reset), from the part of
    the config it is given (`MissConfig`). `victims`: whether victims serve misses (`OffloadEngine.victims_on`);
    `adapter`: the family's routing rule, for the weights of a substituted choice; `logits`: each layer's router
    logits of the running step (kept by a hook), for the reroute rule."""

    def __init__(self, part, adapter, num_layers: int, victims: bool):
        self.part, self.adapter, self.victims = part, adapter, victims
        self.states: list = []
        self.logits: dict[int, torch.Tensor] = {}
        self.policy: MissPolicy = LowBit(part, num_layers) if part.miss_precision else \
            MISS_REGISTRY.parse(part.miss).obj(part)

    def substitute(self, pos: int, index, weights, prefetched: set[int]):
        return self.policy.substitute(self, pos, index, weights, prefetched)

    def serve(self, pos: int, needed: list[int], eager: bool) -> LayerPlan:
        st = self.states[pos]
        slot_of = {e: st.lookup(e) for e in needed}  # (one lookup each: the hits' slots, None for the misses)
        hits = [e for e in needed if slot_of[e] is not None]
        misses = [e for e in needed if slot_of[e] is None]
        reused = []  # misses whose bytes a staging slot still holds (victims): served from there, nothing read
        if self.victims:
            reused = [e for e in misses if st.victim(e) is not None]
            misses = [e for e in misses if e not in reused]
        # everything resident -> one call of the family's forward over the slots (plain's own path); eager's
        # expert-order sum goes the policy's way
        serve = "slots" if not misses and not reused and not eager else self.policy.serve
        return LayerPlan(needed, slot_of, hits, misses, reused, serve, self.policy)

    def reroute(self, pos: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                only: set[int] | None = None, tau: float | None = None):
        """Swap each missing expert for the most likely resident one not already chosen (among `only`, if
        given), if its router probability is within tau; the weights re-derived by the family's own rule.
        Vectorised over tokens: one pass per choice column. Returns (index, weights, choices swapped)."""
        logits = self.logits.get(pos)
        if logits is None:
            return top_k_index, top_k_weights, 0
        tau = self.part.tau if tau is None else tau
        probs = self.adapter.scores(logits)  # [tokens, E]
        st = self.states[pos]
        n_e = probs.shape[-1]
        res_ids = [e for e in range(n_e) if st.lookup(e) is not None and (only is None or e in only)]
        resident = torch.zeros(n_e, dtype=torch.bool, device=probs.device)
        resident[res_ids] = True
        idx, swapped = reroute_choice(probs, top_k_index, resident, tau)
        changed = int(swapped.sum())
        if not changed:
            return top_k_index, top_k_weights, 0
        return idx, self.adapter.weights(logits, idx).to(top_k_weights.dtype), changed

    def reset(self) -> None:
        if isinstance(self.policy, LowBit):
            self.policy.reset()
