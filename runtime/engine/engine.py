"""The offload engine: a HF MoE model whose routed experts live on a slow tier, computed from a bounded cache of
slots on the fast tier, with asynchronous prefetch. `model.generate` (KV cache and all) runs through it, and so
do the replay, the benchmarks and the server: `run_layer` is the only decode step.

Each MoE layer's `experts` module is replaced by `OffloadedExperts` (the router, attention and everything else
are untouched). `OffloadEngine` runs three stages per layer, each built from its part of `EngineConfig`
(`EngineConfig.parts`), and counts the step's figures in one place (`_count`):
1. plan (`plan.Plan`): the miss policy's substitutions (``reroute``, ``speculative``: lossy, vectorised over
   tokens, weights re-derived by the family's own rule), then what serves each needed expert (a slot, a victim, or
   the policy's way for a miss: a demand load, ``host``'s compute where the weights live, a packed copy);
2. loads (`loads.Loads`): prefetch for the layers ahead (the predictor, gated by `PrefetchGuard`), this layer's
   prefetches settled, the misses loading into staging (and stream) slots over one `LoadQueue`;
3. compute (`experts.Compute`, through each pool's weight format class, `formats`): resident experts while the
   misses load, each miss as its weights arrive (resident first, as mixtral-offloading iterates), rows combined as
   the family's implementation combines them: with ``kernel="native"`` greedy tokens are bit-identical to plain
   `model.generate`; by default (``auto``) the AVX-512 kernels of `cpu_kernels` compute bf16 SwiGLU experts (and
   the decode-sized linears) on CPU, equal up to rounding;
then the cache policy decides what stays (`cache.CacheState`, through `layer_view.LayerView`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from expertcache.telemetry.errors import InputError

from expertcache.runtime.kernels import quant
from expertcache.runtime.storage.checkpoint import StoreExperts
from expertcache.runtime.engine.layer_view import cache_views, keep_policy
from expertcache.runtime.engine.predictors import Predictor
from expertcache.runtime.storage.store import check_store, read_store_meta
from expertcache.runtime.storage.tiers import SlotPool, make_tier, tier_host_bytes

from expertcache.runtime.engine.config import OVERLAP_MIN_BYTES, EngineConfig
from expertcache.runtime.engine.experts import Compute, OffloadedExperts
from expertcache.runtime.engine.loads import Loads, check_fits, fit_budget, resolve_tier
from expertcache.runtime.engine.plan import Plan
from expertcache.runtime.engine.stats import Stats


def _as_source(source):
    """An expert source, or the path of a repacked store file."""
    if isinstance(source, (str, Path)):
        return StoreExperts(source, read_store_meta(source))
    return source


class OffloadEngine:
    def __init__(self, model, source, cfg: EngineConfig, predictor: Predictor | None = None,
                 pinned: dict[int, list[int]] | None = None, keep_scores=None, tier=None):
        """`source`: where the experts' bytes are (`checkpoint.CheckpointExperts`, `checkpoint.StoreExperts` or
        a store path). `tier`: an already opened tier for `source` to reuse (a benchmark swapping engine
        configurations on one model keeps one host copy)."""
        from expertcache.telemetry.adapters import adapter_for

        cfg.check()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.model, self.adapter = model, adapter_for(model)
        self.layers = self.adapter.moe_layers(model)
        self.source = _as_source(source)
        self.meta = self.source.meta
        if isinstance(self.source, StoreExperts) and self.meta.source != "random":
            check_store(self.meta, model)
        e, k, n_l = self.adapter.num_experts, self.adapter.top_k, len(self.layers)
        if self.meta.num_experts != e or self.meta.num_layers != n_l:
            raise InputError(f"expert source has {self.meta.num_layers} layers x {self.meta.num_experts} experts; "
                             f"the model has {n_l} x {e}")
        self.capacity = cfg.slots(e, k) if not cfg.budget_gb else fit_budget(cfg.budget_gb, self.meta.block_bytes,
                                                                             n_l, k, e, cfg.budget)
        n_slots = self.capacity + k if cfg.budget == "layer" else self.capacity * n_l + k
        self.fast_bytes = n_slots * self.meta.block_bytes * (n_l if cfg.budget == "layer" else 1)
        cfg, self.tier_choice = resolve_tier(cfg, self.meta, self.fast_bytes, tier)
        self.cfg, parts, fast = cfg, cfg.parts, cfg.slot_device
        self.host_bytes = 0 if tier is not None else tier_host_bytes(cfg.tier, self.meta, cfg.workers)
        check_fits(self.capacity, k, n_l, fast, self.fast_bytes, self.host_bytes, cfg.tier)
        self.tier = tier or make_tier(cfg.tier, self.source, fast)
        # precision as a cache policy: misses served from a packed copy, hot experts upgraded in the background
        self.low_tier = make_tier(cfg.tier, quant.copy_source(cfg.miss_copy, self.meta), fast) \
            if cfg.miss_precision else None
        self.predictor = predictor or Predictor()
        self.cache_policy, self.keep_scores = keep_policy(cfg.policy, keep_scores, e, k, n_l)
        self.pinned = pinned or {}
        self.decode_rows: int | None = None  # set by the decode loop (decode.Batch) during a batched decode step
        self.pools, self.modules = [], []
        shared = SlotPool(self.meta, n_slots, fast, touch=True) if cfg.budget == "global" else None
        for i, layer in enumerate(self.layers):
            pool = shared or SlotPool(self.meta, n_slots, fast, touch=True)
            self.pools.append(pool)
            mod = OffloadedExperts(self, i, layer.experts, pool, cfg.kernel, fast)
            if i == 0 and cfg.kernel == "cpu":  # before the model is touched
                mod.check_cpu_kernel()
            layer.block.experts = mod  # the original expert tensors (or meta placeholders) go with the old module
            self.modules.append(mod)
        # compute each miss as it arrives only when an expert's compute outweighs a call's fixed cost; smaller experts
        # also load in the computing thread: their copy or read costs less than a thread's hand-off (1/4 of the
        # quickstart's experts, 8 sequences: 5.7 -> 3.4 ms per step from host RAM, 6.1 -> 5.7 from disk)
        self.loads = Loads(parts.load, self.tier, self.low_tier, self.meta, self.pools, fast, e, k, self.predictor,
                           overlap=self.meta.expert_bytes >= OVERLAP_MIN_BYTES)
        self.plan = Plan(parts.miss, self.adapter, n_l, self.victims_on())
        self.compute = Compute(parts.compute)
        self.stats = Stats()
        self._new_states()
        if cfg.kernel in ("cpu", "auto") and fast == "cpu" and self.modules[0].fmt.one_call:  # (the extension is
            self.compute.patch(model, [L.router for L in self.layers])  # built, once, only for a model it computes)
        self.loads.preload(self.capacity)
        self._hooks = [L.router.register_forward_hook(self._keep_logits(i)) for i, L in enumerate(self.layers)]
        self._fwd_t0: list[float] = []  # the model's forward, timed (nested calls counted once)
        self._hooks += [model.register_forward_pre_hook(self._forward_start),
                        model.register_forward_hook(self._forward_end, always_call=True)]

    # the stages' objects the rest of the runtime reads (bench's bandwidth probe, the prefetch guard's figures)
    pool_exec = property(lambda self: self.loads.queue)
    guard = property(lambda self: self.loads.guard)

    @property
    def stats(self) -> Stats:
        return self._stats

    @stats.setter
    def stats(self, stats: Stats) -> None:  # one object, counted by every stage
        self._stats = self.loads.stats = self.compute.stats = stats

    @property
    def traffic_expert_bytes(self) -> int | None:
        """Bytes one load moves, for the traffic figures; None where experts differ in size (mixed precision: the
        traffic is then the bytes each load moved)."""
        return None if hasattr(self.source, "expert_nbytes") else self.meta.expert_bytes

    def _forward_start(self, module, args):
        self._fwd_t0.append(time.perf_counter())

    def _forward_end(self, module, args, output):
        t0 = self._fwd_t0.pop()
        if not self._fwd_t0:
            self.end_step()
            self.stats.forward_s += time.perf_counter() - t0

    def end_step(self) -> None:
        """A step's output may leave the engine once every expert it read has passed its first-read check (where a
        core is free they run beside the compute): waits for the checks still running, and raises a failed one. The
        model's forward ends with it; a caller driving `run_layer` itself calls it after the step's last layer.
        After a failure the cache starts cold (counters kept): no slot, victim or prefetch of the damaged expert
        serves again without being read, and checked, again (so a later step that needs it is refused again)."""
        try:
            self.loads.end_step()
        except BaseException:
            self.reset(stats=False)
            raise

    def _keep_logits(self, pos):
        def hook(module, args, output):
            self.plan.logits[pos] = output[0] if isinstance(output, tuple) else output
        return hook

    # --- the decode step -------------------------------------------------------------------------------------

    def run_layer(self, mod: OffloadedExperts, hidden, top_k_index, top_k_weights):
        t_layer = time.perf_counter()
        try:
            return self._run_layer(mod, hidden, top_k_index, top_k_weights)
        finally:
            self.stats.layer_s += time.perf_counter() - t_layer

    def _run_layer(self, mod: OffloadedExperts, hidden, top_k_index, top_k_weights):
        pos, st, loads = mod.pos, self.states[mod.pos], self.loads
        # 1. plan: what this layer needs, after the miss policy's substitutions
        top_k_index, top_k_weights, rerouted = self.plan.substitute(pos, top_k_index, top_k_weights,
                                                                    loads.prefetched[pos])
        flat = top_k_index.reshape(-1).tolist()  # the one host sync of the layer: what it needs
        needed = sorted(set(flat))
        # 2. loads: predict and prefetch the next layer(s) while this one loads and computes; this layer's prefetches
        # settled (waited for where needed: a stall)
        judge = hidden.shape[0] == 1 or hidden.shape[0] == self.decode_rows  # a decode step
        loads.ahead(pos, hidden, needed, top_k_index.shape[-1], judge)
        stall = loads.settle(pos, set(needed))
        p = self.plan.serve(pos, needed, mod.eager)  # what serves each needed expert, now the loads are settled
        self._count(pos, p, hidden.shape[0], top_k_index, rerouted)
        scores_keep = self.keep_scores(pos, hidden, needed) if self.keep_scores is not None else None
        # 3. compute (the misses loading meanwhile), then what stays
        out, (staged, transient, waited) = self.compute.layer(mod, p, hidden, top_k_index, top_k_weights, flat, loads)
        kept = needed if p.serve in ("slots", "load") else [e for e in needed if e not in p.misses]
        st.retain(kept, staged, scores_keep, transient, protect=loads.in_flight(pos))
        if p.serve != "slots":
            p.policy.after(loads, pos, p.misses)
        self.stats.stall_s += stall + waited
        return out

    def _count(self, pos: int, p, n_tok: int, top_k_index, rerouted: int) -> None:
        """The layer step's figures, counted once (the loads stage counts what finishes in its threads)."""
        s, needed = self.stats, p.needed
        s.rerouted += rerouted
        s.prefetch_hits += sum(e in self.loads.prefetched[pos] for e in p.hits)
        self.loads.prefetched[pos].difference_update(needed)
        s.calls += 1
        s.tokens += n_tok if pos == 0 else 0
        s.accesses += int(top_k_index.numel()) if n_tok == 1 else len(needed)
        s.hits += len(p.hits) + len(p.reused)
        s.victim_hits += len(p.reused)
        if p.serve == "low":
            s.lowbit_served += len(p.misses)
        elif p.serve == "host":
            s.host_computed += len(p.misses)
        elif p.serve == "load":
            s.demand_loads += len(p.misses)

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = Stats()

    def reset(self, stats: bool = True) -> None:
        """An empty cache (static pins reloaded), no history, fresh counters (`stats`): a new, cold pass. A load
        or check that failed is raised here, not swallowed."""
        failed = self.loads.reset()  # a prefetch that failed after its layer last ran is raised below
        self.plan.reset()
        self._new_states()
        if hasattr(self.keep_scores, "reset"):
            self.keep_scores.reset()
        self.loads.preload(self.capacity)
        if stats:
            self.reset_stats()
        if failed is not None:  # raised once, the engine already clean and cold
            raise failed

    def _new_states(self) -> None:
        """Empty caches (`layer_view.cache_views`), handed to the stages that read and fill them."""
        self.states = cache_views(self.cfg.parts.cache, self.capacity, self.adapter.num_experts, self.adapter.top_k,
                                  len(self.layers), self.cache_policy, self.pinned, self.victims_on())
        self.loads.states = self.plan.states = self.states

    def describe(self) -> dict:
        cfg, spool = self.cfg, self.loads.spool
        return {"capacity": self.capacity, "capacity_frac": self.capacity / self.adapter.num_experts,
                "staging_slots": self.adapter.top_k, "victims": self.victims_on(),
                "policy": cfg.policy, "miss": cfg.miss, "miss_precision": cfg.miss_precision or None,
                "miss_copy": cfg.miss_copy or None, "miss_upgrade": cfg.miss_upgrade if cfg.miss_precision else None,
                "tau": cfg.tau if cfg.miss == "reroute" else None, **self.tier.describe(),
                **self.predictor.describe(), "prefetch_guard": self.guard.describe(),
                "expert_bytes": self.meta.expert_bytes,
                "expert_dtype": self.meta.tensors[0].dtype, "budget": cfg.budget, "device": cfg.slot_device,
                "fast_tier_bytes": self.fast_bytes, "tier_host_bytes": self.host_bytes,
                "tier_choice": self.tier_choice,
                "stream_slot_bytes": spool.n_slots * self.meta.block_bytes if spool is not None else 0,
                "integrity": self.integrity(), "weight_checks": cfg.integrity}

    def victims_on(self) -> bool:
        """Whether victims serve misses here: asked for, a per-layer budget, a policy that evicts (not static), and
        misses that load into the staging slots (not miss=host, not miss_precision's packed copy)."""
        return (self.cfg.victims and self.cfg.budget == "layer" and self.cache_policy != "static"
                and self.low_tier is None and self.cfg.miss != "host")

    def integrity(self) -> str:
        """Whether the experts served are checked against a reference: `verified (...)` or `unverified (why)`."""
        fn = getattr(self.source, "integrity", None)
        if self.meta.source == "random":
            return "random experts (a replay store)"
        return fn() if fn is not None else "unverified"

    def detach(self) -> None:
        """Stop serving: hooks removed, loads finished (the tier stays open for a next engine)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.compute.unpatch()
        self.loads.shutdown()
        for mod in self.modules:  # break the engine <-> module cycle: the slot pools go when the engine does
            mod._engine = [None]

    def close(self) -> None:
        self.detach()
        self.tier.close()
        if self.low_tier is not None:
            self.low_tier.close()


def offload(model, source, cfg: EngineConfig | None = None, **kw) -> OffloadEngine:
    """Attach an engine to `model` (in place). Every routed expert then comes from `source` (an expert source
    of `checkpoint`, or a store path)."""
    return OffloadEngine(model, source, cfg or EngineConfig(), **kw)
