"""The offload engine: a HF MoE model whose routed experts live on a slow tier, computed from a bounded cache of
slots on the fast tier, with asynchronous prefetch. `model.generate` (KV cache and all) runs through it.

Each MoE layer's `experts` module is replaced by `OffloadedExperts` (the router, attention and everything else
are untouched). When layer i runs:
1. the predictor, given the hidden state entering layer i, names the experts of layer i + d; those not
   resident are prefetched asynchronously into slots of layer i + d (at most `max_inflight_bytes` in flight;
   one whose load has not started when its layer runs, and is not needed, is dropped);
2. layer i's needed experts: resident ones are hits (waiting, if their prefetch is still in flight, counts as
   stall); misses go through the miss policy: ``blocking`` loads them into staging slots (lossless),
   ``reroute`` first swaps a missing expert for a resident one whose router probability is within τ of it
   (lossy: outputs change, reported with the accuracy cost); ``speculative`` runs the predicted (prefetched)
   experts in place of missing ones, the most likely first (lossy); ``host`` computes a missing expert where
   its weights live (host and throttled tiers) instead of moving it (lossless in exact arithmetic; the two
   partial sums are added in a different order, so outputs can differ in the last bits);
3. the experts compute with the model's own experts implementation over the slot pool (same kernels, same
   summation order over k: greedy tokens are bit-identical to plain `model.generate`);
4. the cache policy decides what stays (`cache.CacheState`).
"""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from expertcache.telemetry.errors import InputError

from .cache import CacheState, LayerView
from .predictors import Predictor
from .store import check_store, read_store_meta
from .tiers import SlotPool, TierSpec, available_memory, block_views, make_tier

MISS_POLICIES = ("blocking", "reroute", "speculative", "host")


@dataclass
class EngineConfig:
    capacity: float = 0.25  # resident experts per layer: a fraction of E (< 1) or a count (>= 1)
    tier: str = "host"
    policy: str = "lru"  # lru | lfu | static | scored (scored needs a keep-score source, e.g. the Temporal router)
    miss: str = "blocking"
    tau: float = 0.1  # reroute margin on router probabilities
    prefetch_budget: int = 0  # experts prefetched per layer per token (0: as many as the predictor names, up to k)
    max_inflight_bytes: int = 1 << 30
    workers: int = 4  # transfer threads
    budget: str = "layer"  # layer: C slots per layer; global: one cache of C x layers slots shared by all layers

    def slots(self, num_experts: int, top_k: int) -> int:
        c = round(self.capacity * num_experts) if self.capacity < 1 else int(self.capacity)
        if c < 1 or c > num_experts:
            raise InputError(f"capacity {self.capacity} gives {c} resident experts; expected 1..{num_experts}")
        return c


@dataclass
class Stats:
    calls: int = 0
    tokens: int = 0
    accesses: int = 0
    hits: int = 0
    demand_loads: int = 0
    prefetch_loads: int = 0  # issued and executed (used or not)
    prefetch_dropped: int = 0
    prefetch_hits: int = 0  # hits on an expert that a prefetch brought in
    rerouted: int = 0
    host_computed: int = 0  # misses computed where their weights live (miss policy host): no bytes moved
    stall_s: float = 0.0
    bytes_moved: int = 0

    def to_dict(self, expert_bytes: int) -> dict:
        a = max(self.accesses, 1)
        return {"accesses": self.accesses, "hits": self.hits, "hit_rate": self.hits / a,
                "adjusted_hit_rate": 1 - (self.demand_loads + self.prefetch_loads) / a,
                "demand_loads": self.demand_loads, "prefetch_loads": self.prefetch_loads,
                "prefetch_dropped": self.prefetch_dropped, "prefetch_hits": self.prefetch_hits,
                "rerouted": self.rerouted, "host_computed": self.host_computed, "stall_s": self.stall_s, "bytes_moved": self.bytes_moved,
                "traffic_bytes_per_token": (self.demand_loads + self.prefetch_loads) * expert_bytes
                / max(self.tokens, 1)}


class OffloadedExperts(nn.Module):
    """Stands in for a HF experts module; computes with the original class's forward over the slot pool."""

    def __init__(self, engine: "OffloadEngine", pos: int, original: nn.Module, pool: SlotPool):
        super().__init__()
        self._engine = [engine]  # a list: not registered as a submodule
        self.pos = pos
        tmpl = copy.copy(original)  # shares config, act_fn, _apply_gate...; its parameters replaced below
        tmpl._parameters = {}
        tmpl._modules = dict(original._modules)
        for name, view in pool.views.items():
            setattr(tmpl, name, view)
        tmpl.num_experts = pool.n_slots
        self._tmpl = tmpl
        self._forward = type(original).forward
        self._eager = getattr(getattr(original, "config", None), "_experts_implementation", None) in (None, "eager")
        self._names = list(pool.views)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self._engine[0].run_layer(self, hidden_states, top_k_index, top_k_weights)

    def compute(self, hidden, slot_index, weights):
        return self._forward(self._tmpl, hidden, slot_index, weights)

    def compute_compact(self, hidden, top_k_index, weights, tensors: dict[str, torch.Tensor]):
        """Over a compact stack of the needed experts, sorted by expert id (same order as the original)."""
        t = copy.copy(self._tmpl)
        for n, v in tensors.items():
            setattr(t, n, v)
        t.num_experts = next(iter(tensors.values())).shape[0]
        return self._forward(t, hidden, top_k_index, weights)


class OffloadEngine:
    def __init__(self, model, store_path, cfg: EngineConfig, predictor: Predictor | None = None,
                 pinned: dict[int, list[int]] | None = None, keep_scores=None):
        from expertcache.telemetry.adapters import adapter_for

        self.cfg = cfg
        self.model = model
        self.adapter = adapter_for(model)
        self.layers = self.adapter.moe_layers(model)
        self.meta = read_store_meta(store_path)
        check_store(self.meta, model)
        TierSpec.parse(cfg.tier)  # a bad tier name is refused before anything is allocated
        if cfg.miss not in MISS_POLICIES:
            raise InputError(f"unknown miss policy {cfg.miss!r}; expected one of {', '.join(MISS_POLICIES)}")
        if cfg.miss == "host" and TierSpec.parse(cfg.tier).kind not in ("host", "throttled"):
            raise InputError(f"miss policy host computes experts where they live: it needs the host or a "
                             f"throttled tier, not {cfg.tier}")
        e, k = self.adapter.num_experts, self.adapter.top_k
        if self.meta.num_experts != e or self.meta.num_layers != len(self.layers):
            raise InputError(f"store has {self.meta.num_layers} layers x {self.meta.num_experts} experts; the model "
                             f"has {len(self.layers)} x {e}")
        self.capacity = cfg.slots(e, k)
        if cfg.budget not in ("layer", "global"):
            raise InputError(f"budget={cfg.budget!r}; expected layer or global")
        n_l = len(self.layers)
        n_slots = self.capacity + k if cfg.budget == "layer" else self.capacity * n_l + k
        need = n_slots * self.meta.block_bytes * (n_l if cfg.budget == "layer" else 1)
        avail = available_memory()
        if cfg.tier.startswith("cuda"):
            avail = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        if need > 0.9 * avail:
            raise InputError(f"a cache of {self.capacity} experts per layer (+{k} staging) x {len(self.layers)} "
                             f"layers needs {need / 2**30:.2f} GiB; only {avail / 2**30:.2f} GiB is available "
                             f"on the fast tier (lower --capacity)")
        self.tier = make_tier(cfg.tier, store_path, self.meta)
        self.predictor = predictor or Predictor()
        self.keep_scores = keep_scores  # callable(pos, hidden, ids) -> [E] scores for the scored policy
        if cfg.policy == "scored" and keep_scores is None:
            raise InputError("policy scored needs keep scores (the Temporal router of a cache-aware checkpoint)")
        device = "cuda" if cfg.tier == "cuda" else "cpu"
        self.pinned = pinned or {}
        self.pools, self.modules = [], []
        self.pending: list[dict[int, Future]] = [{} for _ in self.layers]
        self.prefetched: list[set[int]] = [set() for _ in self.layers]
        shared = SlotPool(self.meta, n_slots, device) if cfg.budget == "global" else None
        for i, layer in enumerate(self.layers):
            pool = shared or SlotPool(self.meta, n_slots, device)
            self.pools.append(pool)
            mod = OffloadedExperts(self, i, layer.experts, pool)
            layer.block.experts = mod  # the original expert tensors are released with the old module
            self.modules.append(mod)
        self._new_states()
        self.pool_exec = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="expert-load")
        self._load_pins()
        self.inflight = 0
        self._lock = threading.Lock()
        self.stats = Stats()
        self._preload_all()
        self.history: dict[int, list[int]] = {}
        self._router_logits: dict[int, torch.Tensor] = {}
        self._hooks = [L.router.register_forward_hook(self._keep_logits(i)) for i, L in enumerate(self.layers)]

    # --- bookkeeping helpers ---------------------------------------------------------------------------------

    def _keep_logits(self, pos):
        def hook(module, args, output):
            self._router_logits[pos] = output[0] if isinstance(output, tuple) else output
        return hook

    def _load(self, pos: int, expert: int, slot: int, pool: SlotPool | None = None) -> None:
        """Copy one expert from the slow tier into a slot of layer `pos`'s pool (or of a transient `pool`)."""
        n = self.tier.read(pos, expert, pool if pool is not None else self.pools[pos], slot)
        with self._lock:
            self.stats.bytes_moved += n

    def _prefetch_done(self, fut):
        with self._lock:
            self.inflight -= self.meta.expert_bytes

    def prefetch(self, pos: int, experts: list[int], busy: tuple[int, list[int]] | None = None) -> None:
        """Asynchronously bring `experts` of layer `pos` into its slots (bounded in-flight bytes). Under a global
        budget the victims are any layer's: never the experts of the layer now running (`busy`) nor a slot whose
        load is still in flight."""
        st = self.states[pos]
        protect = set(experts)
        if self.cfg.budget == "global":
            e_n = self.adapter.num_experts
            keys = {p * e_n + x for p, fs in enumerate(self.pending) for x in fs}
            if busy is not None:
                keys |= {busy[0] * e_n + x for x in busy[1]}
            protect |= {key - pos * e_n for key in keys}  # in the target view's ids (may fall outside 0..E-1)
        for e in experts:
            if st.lookup(e) is not None:
                continue
            if self.inflight + self.meta.expert_bytes > self.cfg.max_inflight_bytes:
                break
            slot = st.prefetch_slot(e, protect)
            if slot is None:
                break
            self.inflight += self.meta.expert_bytes
            fut = self.pool_exec.submit(self._load, pos, e, slot)
            fut.add_done_callback(self._prefetch_done)
            self.pending[pos][e] = fut
            self.prefetched[pos].add(e)

    def _settle(self, pos: int, needed: set[int]) -> float:
        """Before layer `pos` computes: wait for the prefetches it needs (stall), drop the stale ones that have
        not started. Returns the seconds waited."""
        waited = 0.0
        for e, fut in list(self.pending[pos].items()):
            if e in needed:
                if not fut.done():
                    t0 = time.perf_counter()
                    fut.result()
                    waited += time.perf_counter() - t0
                else:
                    fut.result()
                self.stats.prefetch_loads += 1
            elif fut.cancel():
                self.states[pos].drop(e)
                self.prefetched[pos].discard(e)
                self.stats.prefetch_dropped += 1
            else:
                fut.result()
                self.stats.prefetch_loads += 1
            del self.pending[pos][e]
        return waited

    def _reroute(self, pos: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 only: set[int] | None = None, tau: float | None = None):
        """Swap each missing expert for the most likely resident one not already chosen (among `only`, if
        given), if its router probability is within τ; weights re-derived from the router probabilities."""
        logits = self._router_logits.get(pos)
        if logits is None:
            return top_k_index, top_k_weights
        tau = self.cfg.tau if tau is None else tau
        probs = logits.float().softmax(-1)  # [tokens, E]
        st = self.states[pos]
        resident = torch.tensor([st.lookup(e) is not None and (only is None or e in only)
                                 for e in range(probs.shape[-1])])
        idx = top_k_index.clone()
        changed = 0
        for t in range(idx.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                if resident[e]:
                    continue
                cand = probs[t].masked_fill(~resident, -1.0)
                cand[idx[t]] = -1.0
                r = int(cand.argmax())
                if cand[r] >= 0 and probs[t, e] - probs[t, r] <= tau:
                    idx[t, j] = r
                    changed += 1
        if not changed:
            return top_k_index, top_k_weights
        self.stats.rerouted += changed
        w = probs.gather(1, idx)
        if self.adapter.norm_topk_prob or self.adapter.family == "mixtral":
            w = w / w.sum(-1, keepdim=True)
        return idx, w.to(top_k_weights.dtype)

    # --- the layer ---------------------------------------------------------------------------------------------

    def run_layer(self, mod: OffloadedExperts, hidden, top_k_index, top_k_weights):
        pos = mod.pos
        st = self.states[pos]
        k = top_k_index.shape[-1]
        # 1. what this layer needs (after the miss policy's substitutions)
        if self.cfg.miss == "reroute":
            top_k_index, top_k_weights = self._reroute(pos, top_k_index, top_k_weights)
        elif self.cfg.miss == "speculative":  # the prediction runs instead of a missing true choice
            top_k_index, top_k_weights = self._reroute(pos, top_k_index, top_k_weights, set(self.prefetched[pos]),
                                                       float("inf"))
        flat = top_k_index.reshape(-1).tolist()  # the one host sync of the layer: what it needs
        needed = sorted(set(flat))
        # 2. predict and prefetch the next layer(s) while this one loads and computes
        scores = self.predictor.predict(pos, hidden, self.history)
        if scores is not None:
            budget = self.cfg.prefetch_budget or k
            top = scores.float().sum(0).topk(min(budget, scores.shape[-1])).indices.tolist()
            self.prefetch(pos + self.predictor.distance, top, busy=(pos, needed))
        stall = self._settle(pos, set(needed))
        hits = [e for e in needed if st.lookup(e) is not None]
        misses = [e for e in needed if st.lookup(e) is None]
        self.stats.prefetch_hits += sum(e in self.prefetched[pos] for e in hits)
        self.prefetched[pos].difference_update(needed)
        n_tok = hidden.shape[0]
        self.stats.calls += 1
        self.stats.tokens += n_tok if pos == 0 else 0
        acc = int(top_k_index.numel()) if n_tok == 1 else len(needed)
        self.stats.accesses += acc
        self.stats.hits += len(hits)
        self.stats.demand_loads += len(misses)
        # 3. load the misses and compute
        t0 = time.perf_counter()
        if self.cfg.miss == "host" and misses:
            self.stats.demand_loads -= len(misses)  # nothing is moved: computed where the weights live
            self.stats.host_computed += len(misses)
            out = self._compute_host(mod, pos, hidden, top_k_index, top_k_weights, flat, set(misses))
            # nothing is admitted on a miss: the fast tier fills only through prefetch
            st.retain([e for e in needed if e not in misses], {}, self._scores(pos, hidden, needed))
        elif len(misses) <= st.k and not mod._eager:
            staged = st.stage(misses)
            futs = [self.pool_exec.submit(self._load, pos, e, s) for e, s in staged.items()]
            for f in futs:
                f.result()
            stall += time.perf_counter() - t0
            slot_of = {e: st.lookup(e) for e in hits} | staged
            slots = torch.tensor([slot_of[e] for e in flat], dtype=torch.long).view_as(top_k_index)
            out = mod.compute(hidden, slots, top_k_weights)
            st.retain(needed, staged, self._scores(pos, hidden, needed))
        else:  # many tokens (prefill) or an eager implementation: a transient compact stack, expert order
            out, stall_c = self._compute_compact(mod, pos, hidden, top_k_index, top_k_weights, needed, misses)
            stall += stall_c
        self.stats.stall_s += stall
        self.history[pos] = needed
        return out

    def _compute_host(self, mod, pos, hidden, top_k_index, top_k_weights, flat, misses: set[int]):
        """Resident experts from the slots, missing ones straight from the host copy of the store: two calls of
        the model's experts forward, each with the other's (token, choice) pairs weighted 0, summed."""
        st = self.states[pos]
        miss_mask = torch.tensor([e in misses for e in flat]).view_as(top_k_index)
        any_slot = next((st.lookup(e) for e in flat if e not in misses), 0)
        slots = torch.tensor([any_slot if e in misses else st.lookup(e) for e in flat]).view_as(top_k_index)
        w_res = top_k_weights.masked_fill(miss_mask, 0)
        w_host = top_k_weights.masked_fill(~miss_mask, 0)
        out = mod.compute_compact(hidden, top_k_index, w_host, self._host_views(pos))
        if not bool(miss_mask.all()):
            out = mod.compute(hidden, slots, w_res) + out
        return out

    def _host_views(self, pos: int) -> dict[str, torch.Tensor]:
        """`[E, ...]` views of layer `pos`'s experts inside the host tier's copy of the store (no copy)."""
        host = getattr(self.tier, "host", None)
        if host is None:
            raise InputError(f"miss policy host computes experts where they live: it needs the host or a throttled "
                             f"tier, not {self.cfg.tier}")
        return block_views(host, self.meta, self.adapter.num_experts, self.meta.offset(pos, 0))

    def _scores(self, pos, hidden, needed):
        if self.keep_scores is None:
            return None
        return self.keep_scores(pos, hidden, needed)

    def _compute_compact(self, mod, pos, hidden, top_k_index, top_k_weights, needed, misses):
        st = self.states[pos]
        pool = self.pools[pos]
        n = len(needed)
        stack = SlotPool(self.meta, n, pool.device)
        t0 = time.perf_counter()
        futs = [self.pool_exec.submit(self._load, pos, e, j, stack) for j, e in enumerate(needed) if e in misses]
        b = self.meta.block_bytes
        for j, e in enumerate(needed):
            if e not in misses:
                s = st.lookup(e)
                stack.raw[j * b:(j + 1) * b].copy_(pool.raw[s * b:(s + 1) * b])
        for f in futs:
            f.result()
        stall = time.perf_counter() - t0
        remap = torch.full((self.adapter.num_experts,), -1, dtype=torch.long)
        remap[torch.tensor(needed)] = torch.arange(n)
        out = mod.compute_compact(hidden, remap[top_k_index], top_k_weights, stack.views)
        # what stays: copy newly kept experts from the stack into their resident slots
        for e, slot in st.retain(needed, {e: None for e in misses}, self._scores(pos, hidden, needed)) or []:
            j = needed.index(e)
            pool.raw[slot * b:(slot + 1) * b].copy_(stack.raw[j * b:(j + 1) * b])
        return out, stall


    # --- lifecycle ---------------------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = Stats()

    def reset(self) -> None:
        """An empty cache (static pins reloaded), no history, fresh counters: a new, cold pass."""
        for pos, fs in enumerate(self.pending):
            for f in fs.values():
                f.cancel()
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - a cancelled future raises; nothing was half-written
                    pass
            fs.clear()
        for p in self.prefetched:
            p.clear()
        self._new_states()
        self._load_pins()
        self.history.clear()
        if hasattr(self.keep_scores, "reset"):
            self.keep_scores.reset()
        self._preload_all()
        self.reset_stats()

    def _new_states(self) -> None:
        """Empty caches: one state per layer, or one over `layer * E + expert` keys behind every layer's view."""
        e, k, n_l, c = self.adapter.num_experts, self.adapter.top_k, len(self.layers), self.capacity
        if self.cfg.budget == "layer":
            self.states = [LayerView(CacheState(c, k, self.cfg.policy, self.pinned.get(i))) for i in range(n_l)]
        else:
            pins = [i * e + x for i in range(n_l) for x in self.pinned.get(i, [])[:c]] if self.pinned else None
            shared = CacheState(c * n_l, k, self.cfg.policy, pins)
            self.states = [LayerView(shared, i * e, e * n_l) for i in range(n_l)]

    def _load_pins(self) -> None:
        """Static pins are resident from the start: load them."""
        e = self.adapter.num_experts
        for state in {id(v.state): v.state for v in self.states}.values():
            for key, slot in state.res.items():
                pos = key // e if self.cfg.budget == "global" else next(
                    i for i, v in enumerate(self.states) if v.state is state)
                self.tier.read(pos, key % e, self.pools[pos], slot)

    def _preload_all(self) -> None:
        """A cache as large as the layer holds every expert from the start (the all-resident configuration)."""
        if self.capacity < self.adapter.num_experts:
            return
        for pos, st in enumerate(self.states):
            for e in range(self.adapter.num_experts):
                slot = st.prefetch_slot(e, set())
                self.tier.read(pos, e, self.pools[pos], slot)

    def describe(self) -> dict:
        return {"capacity": self.capacity, "capacity_frac": self.capacity / self.adapter.num_experts,
                "staging_slots": self.adapter.top_k, "policy": self.cfg.policy, "miss": self.cfg.miss,
                "tau": self.cfg.tau if self.cfg.miss == "reroute" else None, **self.tier.describe(),
                **self.predictor.describe(), "expert_bytes": self.meta.expert_bytes,
                "budget": self.cfg.budget,
                "fast_tier_bytes": self.pools[0].n_slots * self.meta.block_bytes * len({id(p) for p in self.pools})}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.pool_exec.shutdown(wait=True)
        self.tier.close()


def offload(model, store_path, cfg: EngineConfig | None = None, **kw) -> OffloadEngine:
    """Attach an engine to `model` (in place). Every routed expert then comes from the store."""
    return OffloadEngine(model, store_path, cfg or EngineConfig(), **kw)
