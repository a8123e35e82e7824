"""The one expert cache: which expert sits in which slot, and what stays after each access. A pure state machine
(no bytes move here): the offload engine drives it while it moves bytes, and the simulator
(`expertcache.telemetry.cachesim`) drives the very same object over a trace, so analysis, the trainer's cache
figures, the replay and the engine count hits with one piece of code.

Token semantics (METRICS.md, cachesim): a step's k experts are needed together. Resident ones are hits; the
misses are loaded into *staging* slots (k of them beside the C resident slots) and computed there. After the
step, `retain` decides which C keys of (resident ∪ step) stay, by the policy; a staged expert that stays swaps
roles with the slot of the one it replaces (no copy). Policies:
- ``lru``: the C most recently used (the step's own keys most recent, ties by their position in the step);
- ``lfu``: the step's keys, then the others by (use count, recency, key);
  for both, when C < k the step cannot fit: its hits stay and its misses take the room the other keys leave,
  in step order; the rest stream through staging without being kept;
- ``static``: a pinned set that never changes (from a trace); everything else streams through staging;
- ``scored``: the top C by a predictor's scores for the next step (a Temporal router, or an oracle's next-use
  ranking, which makes it Belady), ties to the more recent.
Prefetch: `prefetch_slot` gives an expert a resident slot ahead of its access, evicting the lowest-priority
resident not itself predicted.

Victims (`victims=True`, the offload engine's default): an expert that leaves the resident set keeps its bytes in
the slot it leaves, which becomes a staging slot; until a later step's misses overwrite that slot (the least
recently used such expert first), a miss on it is served from there with nothing read (`victim`, then `stage`).
The k staging slots are memory every cache holds anyway; with victims, LRU over C resident slots hits exactly as
LRU over C + k without them (tested), so the simulator predicts the engine's LRU with `capacity + k`.

The reroute miss policy's rule (`reroute_choice`) is here too, with the two batched torch replays of this cache
that the trainer's losses and its serving-aware forward use: `lru_resident` (what an LRU cache holds before each
token of a batch of sequences; its misses are the simulator's LRU demand loads) and `served_routing` (the reroute
policy over an LRU cache, token by token). torch is imported by these functions only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from .errors import InputError
from .registry import Registry

if TYPE_CHECKING:  # annotations only: torch is imported by the functions that use it
    import torch

# Every cache policy name, once. Tags say who takes it: `state` (CacheState itself), `sim` (`cachesim.simulate`),
# `engine` (`EngineConfig.policy`). belady is the scored policy ranked by a trace's next use (the simulator's
# offline optimum, `simkernels.belady`); learned:FILE is a fitted policy's keep scores through the scored path
# (`learned_policy.LearnedPolicy`; the simulator takes its scores as `simulate(policy="learned", keep=...)`).
POLICY_REGISTRY = Registry("cache policy")
POLICY_REGISTRY.register("lru", tags=("state", "sim", "engine"))
POLICY_REGISTRY.register("lfu", tags=("state", "sim", "engine"))
POLICY_REGISTRY.register("static", tags=("state", "sim", "engine"))
POLICY_REGISTRY.register("scored", tags=("state", "engine"))
POLICY_REGISTRY.register("belady", tags=("sim",))
POLICY_REGISTRY.register("learned", takes_arg="FILE", tags=("engine",))
STATE_POLICIES = POLICY_REGISTRY.view("state")
POLICIES = STATE_POLICIES.names()  # ("lru", "lfu", "static", "scored"): what CacheState takes


def check_slots(slots: int) -> int:
    """A cache's size in keys (what `cachesim.capacity_count` turns a user's capacity into): a whole number >= 1."""
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
        raise InputError(f"cache capacity must be a whole number of experts >= 1, got {slots!r}")
    return int(slots)


class CacheState:
    def __init__(self, capacity: int, k: int, policy: str = "lru", pinned: list[int] | None = None,
                 slot_base: int = 0, victims: bool = False):
        STATE_POLICIES.parse(policy)
        check_slots(capacity)
        self.capacity, self.k, self.policy = capacity, k, policy
        # victims: slot -> the expert whose bytes a non-resident slot still holds (written and complete: set
        # only by `retain`, after the step that wrote it succeeded; cleared when a slot is handed out again)
        self.victims = victims
        self.held: dict[int, int] = {}
        self._seq: dict[int, int] = {}  # slot -> when its victim left (older victims are overwritten first)
        self._n_left = 0
        self.res: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recent first
        self.free = list(range(slot_base, slot_base + capacity))  # resident slots not holding anything
        self.staging = list(range(slot_base + capacity, slot_base + capacity + k))
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.prio: list[float] | None = None  # scores of the last retain (scored policy)
        self.t = 0
        self.pinned = set()
        if policy == "static":
            if pinned is None:
                raise InputError("the static policy needs the pinned experts (from a trace)")
            for e in list(pinned)[:capacity]:
                self.res[e] = self.free.pop(0)
            self.pinned = set(self.res)

    @property
    def n_slots(self) -> int:
        return self.capacity + self.k

    def lookup(self, e: int) -> int | None:
        return self.res.get(e)

    def victim(self, e: int) -> int | None:
        """The staging slot that still holds `e`'s bytes (victims on), else None: a miss served with no read."""
        if not self.victims:
            return None
        for s in self.staging:
            if self.held.get(s) == e:
                return s
        return None

    def stage(self, misses: list[int]) -> dict[int, int]:
        """Staging slots for this step's misses. With victims, a miss whose bytes a staging slot still holds
        gets that slot (nothing to read: `victim`); the others get the slots holding nothing first, then those
        of the least recently used victims. Every slot handed out for a read forgets what it held."""
        if len(misses) > len(self.staging):
            raise RuntimeError(f"{len(misses)} misses but {len(self.staging)} staging slots")
        if not self.victims:
            return dict(zip(misses, self.staging[:len(misses)]))
        out = {e: s for e in misses if (s := self.victim(e)) is not None}
        taken = set(out.values())
        spare = sorted((s for s in self.staging if s not in taken), key=lambda s: self._seq.get(s, -1))
        for e in misses:
            if e not in out:
                out[e] = s = spare.pop(0)
                self._forget(s)
        return {e: out[e] for e in misses}

    def _touch(self, step: list[int]) -> None:
        for e in step:
            self.count[e] = self.count.get(e, 0) + 1
            self.last[e] = self.t
            if e in self.res:
                self.res.move_to_end(e)

    def retain(self, step: list[int], staged: dict[int, int | None], scores: list[float] | None = None,
               transient=(), protect=frozenset()):
        """After the step: update counters and choose the resident set; staged experts that stay take over the
        slot of the expert they replace, which becomes a staging slot. Experts staged as None (computed from a
        transient buffer) get a free slot instead: returns those `(expert, slot)` pairs, to be copied in.
        `transient` experts were used and are gone (a prefill's earlier waves through the staging slots): they
        count as used but cannot be kept. `protect`: residents whose slot a load is still writing (a prefetch in
        flight) stay resident whatever the policy says; the others share what capacity is left."""
        self._touch(step)
        self.t += 1
        if self.policy == "static" or (self.policy != "scored" and not staged):
            return []  # nothing new arrived: LRU/LFU order was updated by the touch, nothing is evicted
        gone = set(transient)
        cur = set(step)
        held = [e for e in self.res if e in protect and e not in cur]  # loads in flight: they stay
        room = max(0, self.capacity - len(held))
        hits = [e for e in step if e in self.res]
        new = [e for e in step if e not in self.res and e not in gone]
        others = [e for e in self.res if e not in cur and e not in protect]  # least recent first
        if self.policy == "scored":
            if scores is None:
                raise InputError("the scored policy needs scores at every step")
            self.prio = scores
            cand = [e for e in self.res if e not in held] + new  # recency order: a stable sort keeps the more
            keep = held + (sorted(cand, key=lambda e: scores[e])[-room:] if room else [])  # recent among ties
        else:
            if self.policy == "lfu":
                others.sort(key=lambda e: (self.count[e], self.last[e], e))  # the least valuable first
            n_new = max(0, min(len(new), room - len(hits)))  # the step's misses that can stay
            n_old = max(0, min(len(others), room - len(hits) - n_new))
            keep = held + others[len(others) - n_old:] + hits + new[:n_new]
        keep_set = set(keep)
        for e in [e for e in self.res if e not in keep_set]:
            self.free.append(self.res.pop(e))
            if self.victims:  # settled and computed from: its bytes stay in the slot it leaves
                self._hold(self.free[-1], e)
        if self.victims:
            for e, s in staged.items():  # read (or reused) this step and not kept: still there
                if s is not None and e not in keep_set:
                    self._hold(s, e)
        copies = []
        for e in new:  # newly kept staged experts, in step order
            if e in keep_set and e not in self.res:
                f = self.free.pop()
                s = staged.get(e)
                if s is None:  # computed outside the slots: its bytes must be copied into slot f
                    self.res[e] = f
                    self._forget(f)
                    copies.append((e, f))
                else:  # swap roles: the staging slot becomes resident, the freed slot becomes staging
                    self.staging[self.staging.index(s)] = f
                    self.res[e] = s
                    self._forget(s)
        for e in step:  # a step's keys are equally recent; ties by their position in the step
            if e in self.res:
                self.res.move_to_end(e)
        return copies

    def _forget(self, slot: int) -> None:
        self.held.pop(slot, None)
        self._seq.pop(slot, None)

    def _hold(self, slot: int, e: int) -> None:
        self.held[slot], self._seq[slot] = e, self._n_left
        self._n_left += 1

    def prefetch_slot(self, e: int, protect: set[int]) -> int | None:
        """A resident slot for `e` before it is accessed: a free one, or the lowest-priority resident's not in
        `protect`. None if every resident is protected (or the policy pins its set). With victims, the resident
        it evicts keeps its bytes, as a miss's eviction does: its slot becomes a staging slot holding it, and `e`
        is written into the staging slot whose victim left longest ago (or that holds nothing), never one holding
        an expert in `protect` (named by the same prediction: it is served from there). Without that, every
        prefetch threw away the victim cache's newest entry, and prefetching read more than demand loading."""
        if e in self.res:
            return self.res[e]
        if self.policy == "static":
            return None
        if self.free:
            s = self.free.pop(0)
            self._forget(s)  # about to be written
        else:
            cands = [v for v in self.res if v not in protect]  # least recent first
            if not cands:
                return None
            if self.policy == "scored" and self.prio is not None:
                victim = min(cands, key=lambda v: self.prio[v])
            elif self.policy == "lfu":
                victim = min(cands, key=lambda v: (self.count[v], self.last[v], v))
            else:
                victim = cands[0]
            s = self.res.pop(victim)
            spare = [x for x in self.staging if self.held.get(x) not in protect] if self.victims else []
            if spare:  # (a named victim stays)
                ev, s = s, min(spare, key=lambda x: self._seq.get(x, -1))
                self._forget(s)  # about to be written
                self.staging[self.staging.index(s)] = ev
                self._hold(ev, victim)
        self.res[e] = s
        return s

    def drop(self, e: int) -> None:
        """Forget `e` (a cancelled prefetch): its slot is free again."""
        if e in self.res:
            self.free.append(self.res.pop(e))


def reroute_choice(probs, idx, resident, tau: float):
    """The reroute miss policy's rule, the one place it is written (the engine serves with it; the trainer's
    serving-aware forward applies it): each chosen expert that is not resident, column by column in the
    choice's order, is swapped for the most likely resident expert not already chosen, if its probability is
    within `tau` of the missing one's.

    `probs [N, E]` router probabilities (float), `idx [N, k]` the router's choice, `resident [E]` or `[N, E]`
    bool. Returns `(idx' [N, k], changed [N, k] bool)`; `idx` itself is not modified."""
    import torch

    resident = resident.expand_as(probs)
    out = idx.clone()
    changed = torch.zeros_like(idx, dtype=torch.bool)
    for j in range(idx.shape[1]):
        miss = ~resident.gather(1, out[:, j:j + 1])[:, 0]  # [N]
        if not bool(miss.any()):
            continue
        taken = torch.zeros_like(resident).scatter_(1, out, True)
        best, r = probs.masked_fill(~resident | taken, -1.0).max(dim=-1)
        ok = miss & (best >= 0) & (probs.gather(1, out[:, j:j + 1])[:, 0] - best <= tau)
        out[:, j] = torch.where(ok, r, out[:, j])
        changed[:, j] = ok
    return out, changed


def lru_resident(logits: torch.Tensor, batch: int, top_k: int, cache: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(resident [B, T-1, E], chosen [B, T-1, E])` bool for tokens 1..T-1 of each sequence: the experts an LRU
    cache of `cache` experts holds before the token (the `cache` most recently used distinct experts of the
    sequence so far, a token's experts ordered by their top-k position) and the token's own top-k choice."""
    import torch

    with torch.no_grad():
        z = logits.view(batch, -1, logits.shape[-1])  # [B, T, E]
        b, t, e = z.shape
        top = z.topk(top_k, dim=-1).indices  # [B, T, k], best first
        chosen = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, top, True)
        # recency key of each use: token index, then position in the token's top-k (later = more recent, as the
        # simulator's LRU orders one step's keys); the running max is each expert's most recent use so far
        order = torch.arange(t, device=z.device).view(1, t, 1) * top_k + torch.arange(top_k, device=z.device)
        key = torch.full(z.shape, -1, dtype=torch.long, device=z.device).scatter_(-1, top, order.expand(b, t, top_k))
        last = key.cummax(dim=1).values
        if cache >= e:
            resident = last >= 0
        else:
            most = last.topk(cache, dim=-1)
            resident = torch.zeros_like(chosen).scatter_(-1, most.indices, most.values >= 0)
        return resident[:, :-1], chosen[:, 1:]


def served_routing(probs: torch.Tensor, idx: torch.Tensor, batch: int, capacity: int, tau: float):
    """What the engine serves with the reroute miss policy and an LRU cache of `capacity` experts per layer,
    replayed over teacher-forced sequences: token by token, each sequence from an empty cache, the router's
    choice `idx [B*T, k]` rerouted (`reroute_choice`, on `probs [B*T, E]`) against the
    `capacity` most recently *served* experts. Exact for `capacity >= k` (a step's experts all stay).
    Returns `(served [B*T, k], changed [B*T, k] bool)`."""
    import torch

    with torch.no_grad():
        e, k = probs.shape[-1], idx.shape[-1]
        p, ix = probs.view(batch, -1, e), idx.view(batch, -1, k)
        t_len = p.shape[1]
        last = torch.full((batch, e), -1, dtype=torch.long, device=p.device)  # most recent use of each expert
        rank = torch.arange(k, device=p.device).expand(batch, k)
        out, changed = torch.empty_like(ix), torch.zeros_like(ix, dtype=torch.bool)
        for t in range(t_len):
            if capacity >= e:
                res = last >= 0
            else:
                most = last.topk(capacity, dim=-1)
                res = torch.zeros_like(last, dtype=torch.bool).scatter_(-1, most.indices, most.values >= 0)
            out[:, t], changed[:, t] = reroute_choice(p[:, t], ix[:, t], res, tau)
            last.scatter_(1, out[:, t], t * k + rank)
        return out.view(-1, k), changed.view(-1, k)
