"""The offload engine: a HF MoE model whose routed experts live on a slow tier, computed from a bounded cache of
slots on the fast tier, with asynchronous prefetch. `model.generate` (KV cache and all) runs through it, and so
do the replay, the benchmarks and the server: `run_layer` is the only decode step.

Each MoE layer's `experts` module is replaced by `OffloadedExperts` (the router, attention and everything else
are untouched). When layer i runs:
1. the miss policy may substitute experts first: ``reroute`` swaps a missing expert for a resident one whose
   router probability is within τ of it, ``speculative`` runs the prefetched prediction instead of a missing true
   choice (both lossy, vectorised over tokens, weights re-derived by the family's own rule);
2. the predictor, given the hidden state entering layer i, names the experts of layer i + d; those not
   resident are prefetched asynchronously into slots of layer i + d (at most `max_inflight_bytes` in flight;
   one whose load has not started when its layer runs, and is not needed, is dropped);
3. the misses start loading into staging slots, the resident experts compute meanwhile, and each miss computes
   as soon as its weights arrive (resident first, as mixtral-offloading iterates); waiting counts as stall.
   ``host`` computes a missing expert where its weights live instead of moving it (host/throttled tiers);
4. each expert computes with the model's own experts implementation over its slots, one (token, choice) row at a
   time in the same kernels, and the rows are combined as that implementation combines them (a sum over k, or
   eager's index_add in expert order): with ``kernel="native"`` greedy tokens are bit-identical to plain
   `model.generate`. By default (``auto``) the AVX-512 kernels of `cpu_kernels` compute bf16 SwiGLU experts on
   CPU instead (and the decode-sized linears too): equal up to rounding, several times faster. Experts of an
   `expertcache quantize` checkpoint always compute with the integer kernels (`quant.swiglu`);
5. the cache policy decides what stays (`cache.CacheState`).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from pathlib import Path

import torch

from expertcache.telemetry.cache import CacheState, reroute_choice
from expertcache.telemetry.errors import InputError

from expertcache.runtime.kernels import cpu_kernels, fast_step, patches, quant
from expertcache.runtime.storage.checkpoint import StoreExperts
from expertcache.runtime.engine.layer_view import LayerView
from expertcache.runtime.storage.loadqueue import LoadQueue
from expertcache.runtime.engine.predictors import Predictor
from expertcache.runtime.storage.store import check_store, read_store_meta
from expertcache.runtime.storage.tiers import SlotPool, available_memory, choose_tier, make_tier, tier_host_bytes
from expertcache.runtime.storage.weight_checks import expert_checks

from expertcache.runtime.engine.config import ENGINE_POLICIES, OVERLAP_MIN_BYTES, STREAM_SLOTS_PER_K, EngineConfig
from expertcache.runtime.engine.experts import OffloadedExperts, _check_cpu_kernel
from expertcache.runtime.engine.stats import PrefetchGuard, Stats


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

        self.cfg = cfg
        cfg.check()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.model = model
        self.adapter = adapter_for(model)
        self.layers = self.adapter.moe_layers(model)
        self.source = _as_source(source)
        self.meta = self.source.meta
        if isinstance(self.source, StoreExperts) and self.meta.source != "random":
            check_store(self.meta, model)
        e, k = self.adapter.num_experts, self.adapter.top_k
        if self.meta.num_experts != e or self.meta.num_layers != len(self.layers):
            raise InputError(f"expert source has {self.meta.num_layers} layers x {self.meta.num_experts} experts; "
                             f"the model has {len(self.layers)} x {e}")
        n_l = len(self.layers)
        self.capacity = cfg.slots(e, k) if not cfg.budget_gb else self._fit_budget(cfg, e, k, n_l)
        n_slots = self.capacity + k if cfg.budget == "layer" else self.capacity * n_l + k
        self.fast_bytes = n_slots * self.meta.block_bytes * (n_l if cfg.budget == "layer" else 1)
        self.tier_choice = None
        if cfg.tier == "auto":
            from dataclasses import replace

            chosen, self.tier_choice = (tier.name, "auto: the tier given") if tier is not None else \
                choose_tier(self.meta, self.fast_bytes, cfg.workers)
            cfg = self.cfg = replace(cfg, tier=chosen if chosen in ("disk", "host") else "host")
            if cfg.miss == "host" and cfg.tier != "host":
                raise InputError(f"miss policy host computes experts where they live, in RAM; {self.tier_choice} "
                                 f"(give --engine.tier host to insist)")
        self.host_bytes = 0 if tier is not None else tier_host_bytes(cfg.tier, self.meta, cfg.workers)
        fast = cfg.slot_device
        if fast == "cuda":
            avail = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
            need = self.fast_bytes
            if self.host_bytes > 0.9 * available_memory():
                raise InputError(f"tier {cfg.tier} holds every expert in host RAM ({self.host_bytes / 2**30:.2f} "
                                 f"GiB); only {available_memory() / 2**30:.2f} GiB is available (use "
                                 f"--engine.tier disk)")
        else:
            avail, need = available_memory(), self.fast_bytes + self.host_bytes
        if need > 0.9 * avail:
            big_host = self.host_bytes > 2**26
            raise InputError(f"a cache of {self.capacity} experts per layer (+{k} staging) x {n_l} layers needs "
                             f"{self.fast_bytes / 2**30:.2f} GiB"
                             + (f" and tier {cfg.tier} {self.host_bytes / 2**30:.2f} GiB" if big_host else "")
                             + f"; only {avail / 2**30:.2f} GiB is available on the {fast} (lower --engine.capacity"
                             + (" or use --engine.tier disk" if big_host else "") + ")")
        self.tier = tier or make_tier(cfg.tier, self.source, fast)
        # precision as a cache policy: misses served from a packed copy, hot experts upgraded in the background
        self.low_tier, self._low_pool = None, None
        self.upgrading: list[set[int]] = [set() for _ in self.layers]
        self._low_count: list[dict[int, int]] = [{} for _ in self.layers]
        if cfg.miss_precision:
            self.low_tier = make_tier(cfg.tier, quant.copy_source(cfg.miss_copy, self.meta), fast)
        # `verify`'s reference-free checks on every expert's first read (`weight_checks.ExpertChecks`), by tier
        self._checks = {id(t): expert_checks(t) for t in (self.tier, self.low_tier)
                        if t is not None and cfg.integrity == "on"}
        self.predictor = predictor or Predictor()
        policy = ENGINE_POLICIES.parse(cfg.policy)
        self.cache_policy = policy.name
        if policy.name == "learned":  # a learned eviction policy (`expertcache fit-policy`): lossless
            from expertcache.telemetry.learned_policy import LearnedPolicy

            if keep_scores is None:
                keep_scores = LearnedPolicy.load(policy.arg, num_experts=e, top_k=k, num_layers=len(self.layers))
            self.cache_policy = "scored"
        self.keep_scores = keep_scores
        if self.cache_policy == "scored" and keep_scores is None:
            raise InputError("policy scored needs keep scores (the Temporal router of a cache-aware checkpoint, "
                             "or a learned policy file)")
        self.pinned = pinned or {}
        self.pools, self.modules = [], []
        self.pending: list[dict[int, Future]] = [{} for _ in self.layers]
        self.prefetched: list[set[int]] = [set() for _ in self.layers]
        self.fresh: list[set[int]] = [set() for _ in self.layers]  # prefetched since the layer last ran
        self.shadow: dict[int, set[int]] = {}  # layer -> what the predictor named for it while not prefetching
        self.decode_rows: int | None = None  # set by the decode loop (decode.Batch) during a batched decode step
        self.guard = PrefetchGuard(cfg.prefetch_guard)
        shared = SlotPool(self.meta, n_slots, fast, touch=True) if cfg.budget == "global" else None
        for i, layer in enumerate(self.layers):
            pool = shared or SlotPool(self.meta, n_slots, fast, touch=True)
            self.pools.append(pool)
            mod = OffloadedExperts(self, i, layer.experts, pool)
            if i == 0 and cfg.kernel == "cpu":  # before the model is touched
                _check_cpu_kernel(mod)
            layer.block.experts = mod  # the original expert tensors (or meta placeholders) go with the old module
            self.modules.append(mod)
        self._new_states()
        # decode-sized projections (attention, lm head) through the same kernels as the experts
        self._linears, self._attention, self._step = [], [], []
        m0 = self.modules[0]
        if cfg.kernel in ("cpu", "auto") and cfg.slot_device == "cpu" and (m0.swiglu_ok or m0.quant is not None) \
                and cpu_kernels.available():  # built (once, cached) only for a model the kernels can compute
            for mod in self.modules:
                mod.cpu_kernel = mod.swiglu_ok
            routed, rest = patches.patch_routers([L.router for L in self.layers])
            self._linears = (patches.patch_linears(model) + routed + patches.patch_calls(rest)
                             + patches.patch_norms(model) + patches.patch_attention_modules(model))
            self._attention = patches.patch_attention(model)  # one-token attention over the KV cache
            if os.environ.get("EXPERTCACHE_NO_FAST_STEP") != "1":  # a decode step in one function (Qwen3-MoE)
                self._step = fast_step.patch_decode_step(model)
        # loads run nearest-layer first, demand loads before any prefetch (`loadqueue`)
        self.pool_exec = LoadQueue(cfg.workers, "expert-load")
        self._pass = 0  # forward passes begun: with the layer, a prefetch's place in the load queue
        self._spool: SlotPool | None = None
        # compute each miss as it arrives only when an expert's compute outweighs a call's fixed cost; smaller experts
        # also load in the computing thread: their copy or read costs less than a thread's hand-off (1/4 of the
        # quickstart's experts, 8 sequences: 5.7 -> 3.4 ms per step from host RAM, 6.1 -> 5.7 from disk)
        self.overlap = self.meta.expert_bytes >= OVERLAP_MIN_BYTES
        self._load_pins()
        self.inflight = 0
        self._lock = threading.Lock()
        self._reading, self._read_t0 = 0, 0.0  # reads in flight, and when the first of them began
        self.stats = Stats()
        self._preload_all()
        self.history: dict[int, list[int]] = {}
        self._router_logits: dict[int, torch.Tensor] = {}
        self._hooks = [L.router.register_forward_hook(self._keep_logits(i)) for i, L in enumerate(self.layers)]
        self._fwd_t0: list[float] = []  # the model's forward, timed (nested calls counted once)
        self._hooks += [model.register_forward_pre_hook(self._forward_start),
                        model.register_forward_hook(self._forward_end, always_call=True)]

    @property
    def traffic_expert_bytes(self) -> int | None:
        """Bytes one load moves, for the traffic figures; None where experts differ in size (mixed precision: the
        traffic is then the bytes each load moved)."""
        return None if hasattr(self.source, "expert_nbytes") else self.meta.expert_bytes

    def _fit_budget(self, cfg: EngineConfig, e: int, k: int, n_l: int) -> int:
        """Experts per layer that `budget_gb` of slots holds (k staging slots per pool included), at most E."""
        from expertcache.telemetry.cachesim import budget_capacity

        cap = budget_capacity(cfg.budget_gb * 2**30, self.meta.block_bytes, n_l, k, e, cfg.budget)
        if cap < 1:
            slots = budget_capacity(cfg.budget_gb * 2**30, self.meta.block_bytes, 1, 0, 1 << 62)  # slots it holds
            raise InputError(f"budget_gb={cfg.budget_gb:g} holds {slots} slots of {self.meta.block_bytes / 2**20:.2f} "
                             f"MiB; {n_l} layers need at least {n_l * (k + 1) if cfg.budget == 'layer' else n_l + k} "
                             f"(raise --engine.budget_gb, or give --engine.capacity)")
        return cap

    # --- bookkeeping helpers ---------------------------------------------------------------------------------

    def _forward_start(self, module, args):
        self._fwd_t0.append(time.perf_counter())

    def _forward_end(self, module, args, output):
        t0 = self._fwd_t0.pop()
        if not self._fwd_t0:
            self.stats.forward_s += time.perf_counter() - t0

    def _keep_logits(self, pos):
        def hook(module, args, output):
            self._router_logits[pos] = output[0] if isinstance(output, tuple) else output
        return hook

    def _read(self, tier, pos: int, expert: int, pool: SlotPool, slot: int, lowbit: bool = False) -> None:
        """`tier.read` with its bytes counted and the time any read is in flight (`Stats.read_busy_s`) measured."""
        with self._lock:
            if not self._reading:
                self._read_t0 = time.perf_counter()
            self._reading += 1
        n = 0
        try:
            n = tier.read(pos, expert, pool, slot)
            self._check(tier, pos, expert, pool, slot)
        finally:
            with self._lock:
                self._reading -= 1
                if not self._reading:
                    self.stats.read_busy_s += time.perf_counter() - self._read_t0
                self.stats.bytes_moved += n
                if lowbit:
                    self.stats.lowbit_bytes += n

    def _check(self, tier, pos: int, expert: int, pool: SlotPool, slot: int) -> None:
        c = self._checks.get(id(tier))
        if c is not None:
            c.check(pos, expert, pool, slot)

    def _load(self, pos: int, expert: int, slot: int, pool: SlotPool | None = None) -> None:
        """Copy one expert from the slow tier into a slot of layer `pos`'s pool (or of a transient `pool`)."""
        self._read(self.tier, pos, expert, pool if pool is not None else self.pools[pos], slot)

    def _lowbit_pool(self) -> SlotPool:
        """The packed copy's slots for one layer's misses (every layer uses them in turn), allocated on first use."""
        if self._low_pool is None:
            self._low_pool = SlotPool(self.low_tier.meta, self.adapter.num_experts, self.cfg.slot_device)
        return self._low_pool

    def _load_low(self, pos: int, expert: int, slot: int) -> None:
        self._read(self.low_tier, pos, expert, self._low_pool, slot, lowbit=True)

    def _prefetch_done(self, fut, upgrade: bool = False):
        """A prefetch's read finished (or was cancelled): its bytes leave the in-flight budget, and a read that ran
        and succeeded is counted here, in the window its bytes were (a layer may run past one still loading)."""
        with self._lock:
            self.inflight -= self.meta.expert_bytes
            if not fut.cancelled() and fut.exception() is None:
                if upgrade:
                    self.stats.upgrade_loads += 1
                else:
                    self.stats.prefetch_loads += 1

    def prefetch(self, pos: int, experts: list[int], busy: tuple[int, list[int]] | None = None,
                 supersede: bool = False, upgrade: bool = False) -> None:
        """Asynchronously bring `experts` of layer `pos` into its slots (bounded in-flight bytes), queued by the
        layer's place (nearer layers load first). `supersede`: this prediction for `pos` replaces earlier ones, whose
        loads for experts it no longer names are cancelled if they have not started (their slots free, never
        written). Victims are never a slot whose load is in flight, nor (under a global budget, where they may be
        any layer's) the experts of the layer now running (`busy`). `upgrade`: a hot expert brought in at full
        precision (miss_precision), counted apart from predictions."""
        st = self.states[pos]
        if supersede:
            for e, fut in list(self.pending[pos].items()):
                if e not in experts and fut.cancel():
                    self._drop_pending(pos, e)
                    st.drop(e)
                    self.prefetched[pos].discard(e)
                    self.fresh[pos].discard(e)
                    self.stats.prefetch_cancelled += 1
        protect = set(experts) | self._in_flight(pos, busy)  # an in-flight slot is never a victim
        for e in experts:
            if st.lookup(e) is not None or st.victim(e) is not None:  # resident, or served from its old slot
                continue
            with self._lock:
                if self.inflight + self.meta.expert_bytes > self.cfg.max_inflight_bytes:
                    break
                self.inflight += self.meta.expert_bytes
            slot = st.prefetch_slot(e, protect)
            if slot is None:
                with self._lock:
                    self.inflight -= self.meta.expert_bytes
                break
            fut = self.pool_exec.submit(self._load, pos, e, slot, priority=self._pass * len(self.states) + pos)
            fut.add_done_callback(functools.partial(self._prefetch_done, upgrade=upgrade))
            self.pending[pos][e] = fut
            if upgrade:
                self.upgrading[pos].add(e)
                continue
            self.prefetched[pos].add(e)
            self.fresh[pos].add(e)

    def _in_flight(self, pos: int, busy: tuple[int, list[int]] | None = None) -> set[int]:
        """Layer `pos`'s expert ids whose slot a load may still be writing: its pending prefetches; under a global
        budget (one cache over every layer's keys) every layer's, and the running layer's experts (`busy`), in
        `pos`'s view ids (which may fall outside 0..E-1). The policy never evicts them (`retain`, `prefetch_slot`)."""
        protect = set(self.pending[pos])
        if self.cfg.budget == "global":
            e_n = self.adapter.num_experts
            keys = {p * e_n + x for p, fs in enumerate(self.pending) for x in fs}
            if busy is not None:
                keys |= {busy[0] * e_n + x for x in busy[1]}
            protect |= {key - pos * e_n for key in keys}
        return protect

    def _settle(self, pos: int, needed: set[int]) -> float:
        """Before layer `pos` computes: wait for the prefetches it needs (stall), drop the stale ones that have
        not started, and leave the ones still loading that it does not need in flight (their slots stay resident
        and protected until a later step finds them done: the layer does not wait on a read it will not use).
        Returns the seconds waited. A failed load raises here."""
        waited = 0.0
        for e, fut in list(self.pending[pos].items()):
            up = e in self.upgrading[pos]
            if e in needed:
                t0 = time.perf_counter()
                self._drop_pending(pos, e)
                self._landed(pos, e, fut)
                waited += time.perf_counter() - t0
            elif fut.cancel():
                self._drop_pending(pos, e)
                self.states[pos].drop(e)
                self.prefetched[pos].discard(e)
                if up:
                    self.stats.upgrade_dropped += 1
                else:
                    self.stats.prefetch_dropped += 1
                continue
            elif not fut.done():
                self.stats.prefetch_deferred += 1
                continue
            else:
                self._drop_pending(pos, e)
                self._landed(pos, e, fut)
        return waited

    @staticmethod
    def _quiesce(futs) -> BaseException | None:
        """Cancel the loads of `futs` that have not started and wait for the others: none is still writing a slot (a
        staging, stream or packed-copy slot) that a next step hands out. Returns the first of their errors (a
        cancellation is none), for a caller with no error of its own to raise."""
        first = None
        for f in list(futs):
            if not f.cancel():
                try:
                    f.result()
                except CancelledError:
                    pass
                except BaseException as e:
                    first = first or e
        return first

    def _drop_pending(self, pos: int, e: int) -> None:
        del self.pending[pos][e]
        self.upgrading[pos].discard(e)

    def _landed(self, pos: int, e: int, fut) -> None:
        """A prefetch's result; a failed one leaves no slot claiming `e` (neither resident nor, later, a victim)."""
        try:
            fut.result()
        except BaseException:
            self.states[pos].drop(e)
            self.prefetched[pos].discard(e)
            raise

    def _reroute(self, pos: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 only: set[int] | None = None, tau: float | None = None):
        """Swap each missing expert for the most likely resident one not already chosen (among `only`, if
        given), if its router probability is within τ; the weights re-derived by the family's own rule.
        Vectorised over tokens: one pass per choice column."""
        logits = self._router_logits.get(pos)
        if logits is None:
            return top_k_index, top_k_weights
        tau = self.cfg.tau if tau is None else tau
        probs = self.adapter.scores(logits)  # [tokens, E]
        st = self.states[pos]
        n_e = probs.shape[-1]
        res_ids = [e for e in range(n_e) if st.lookup(e) is not None and (only is None or e in only)]
        resident = torch.zeros(n_e, dtype=torch.bool, device=probs.device)
        resident[res_ids] = True
        idx, swapped = reroute_choice(probs, top_k_index, resident, tau)
        changed = int(swapped.sum())
        if not changed:
            return top_k_index, top_k_weights
        self.stats.rerouted += changed
        return idx, self.adapter.weights(logits, idx).to(top_k_weights.dtype)

    # --- the decode step -------------------------------------------------------------------------------------

    def run_layer(self, mod: OffloadedExperts, hidden, top_k_index, top_k_weights):
        t_layer = time.perf_counter()
        try:
            return self._run_layer(mod, hidden, top_k_index, top_k_weights)
        finally:
            self.stats.layer_s += time.perf_counter() - t_layer

    def _compute(self, fn, *args):
        """Expert compute, timed (the time budget's `expert_compute`)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.stats.compute_s += time.perf_counter() - t0

    def _run_layer(self, mod: OffloadedExperts, hidden, top_k_index, top_k_weights):
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
        # 2. predict and prefetch the next layer(s) while this one loads and computes (history[pos] is now this
        # token's choice here; the later layers' entries are still the previous token's)
        self.history[pos] = needed
        # the guard scores what was named for this layer (prefetched, or in shadow: nothing read) against what it
        # uses now, on decode steps only (one token, or the decode loop's batch of rows): a prefill needs most
        # experts, any prediction is used there and says nothing about decoding
        judge = hidden.shape[0] == 1 or hidden.shape[0] == self.decode_rows
        for named in (self.fresh[pos], self.shadow.pop(pos, set())):
            if named and judge:
                used = len(named.intersection(needed))
                self.guard.outcome(used, len(named) - used)
            named.clear()
        if pos == 0:
            self._pass += 1
        ahead, mode = [], None
        if self.predictor.active:
            mode = self.guard.step()
            if mode == "paused":
                self.stats.prefetch_paused += 1
            elif self.guard.predicts(mode, self._pass, judge):  # in shadow: sampled (`PrefetchGuard`)
                # (distance, scores) for each layer it looks at, nearest first: loads are queued in that order
                ahead = sorted(self.predictor.predict_ahead(pos, hidden, self.history), key=lambda x: x[0])
        budget = self.cfg.prefetch_budget or k
        for d, scores in ahead:
            t = pos + d
            if scores is None or t >= len(self.states):
                continue
            top = scores.float().sum(0).topk(min(budget, scores.shape[-1])).indices.tolist()
            if mode == "on":
                self.prefetch(t, top, busy=(pos, needed), supersede=True)
            else:  # scored like a prefetch: only what would have been read (not resident now)
                self.shadow[t] = {e for e in top if self.states[t].lookup(e) is None
                                  and self.states[t].victim(e) is None}
        stall = self._settle(pos, set(needed))
        slot_of = {e: st.lookup(e) for e in needed}  # (one lookup each: the hits' slots, None for the misses)
        hits = [e for e in needed if slot_of[e] is not None]
        misses = [e for e in needed if slot_of[e] is None]
        reused = []  # misses whose bytes a staging slot still holds (victims): served from there, nothing read
        if self._victims_on():
            reused = [e for e in misses if st.victim(e) is not None]
            misses = [e for e in misses if e not in reused]
        self.stats.prefetch_hits += sum(e in self.prefetched[pos] for e in hits)
        self.prefetched[pos].difference_update(needed)
        n_tok = hidden.shape[0]
        self.stats.calls += 1
        self.stats.tokens += n_tok if pos == 0 else 0
        self.stats.accesses += int(top_k_index.numel()) if n_tok == 1 else len(needed)
        self.stats.hits += len(hits) + len(reused)
        self.stats.victim_hits += len(reused)
        scores_keep = self._scores(pos, hidden, needed)
        # 3. compute: everything resident -> one call of the family's forward over the slots (plain's own path)
        if not misses and not reused and not mod.eager:
            out = self._compute_in_slots(mod, hidden, [slot_of[e] for e in flat], top_k_index, top_k_weights)
            st.retain(needed, {}, scores_keep, protect=self._in_flight(pos))
        elif self.low_tier is not None:  # computed from the packed copy, not admitted; hot ones upgraded after
            self.stats.lowbit_served += len(misses)
            out, (_, _, waited) = self._stream(mod, pos, hidden, top_k_index, top_k_weights, flat, hits, misses,
                                               low=True)
            stall += waited
            st.retain([e for e in needed if e not in misses], {}, scores_keep, protect=self._in_flight(pos))
            counts, hot = self._low_count[pos], []
            for e in misses:
                counts[e] = counts.get(e, 0) + 1
                if counts[e] >= self.cfg.miss_upgrade:
                    hot.append(e)
                    del counts[e]
            if hot:  # the layer is done computing: its slots may take the upgrades
                self.prefetch(pos, hot, upgrade=True)
        elif self.cfg.miss == "host":  # computed where the weights live: nothing moved, nothing admitted
            self.stats.host_computed += len(misses)
            out, _ = self._stream(mod, pos, hidden, top_k_index, top_k_weights, flat, hits, misses, host=True)
            st.retain([e for e in needed if e not in misses], {}, scores_keep, protect=self._in_flight(pos))
        else:  # misses stream in (eager's expert-order sum also comes this way when all are resident)
            self.stats.demand_loads += len(misses)
            out, (staged, transient, waited) = self._stream(mod, pos, hidden, top_k_index, top_k_weights, flat,
                                                             hits, misses, reused=reused)
            stall += waited
            st.retain(needed, staged, scores_keep, transient, protect=self._in_flight(pos))
        self.stats.stall_s += stall
        return out

    def _stream(self, mod, pos, hidden, top_k_index, top_k_weights, flat, hits, misses, host=False, low=False,
                reused=()):
        """The misses load (the last ones into the staging slots the victims leave, the rest through the stream
        slots) and compute with the resident experts and the victims; rows are combined as the family's
        implementation combines them. Returns the output
        and `(staged, transient, seconds waited)`: `{expert: staging slot}` (what the policy may keep) and the
        streamed experts (used once, not kept). `host`: the misses computed where they live; `low`: read from the
        packed copy (miss_precision) into its own slots, all at once while the resident experts compute.
        `reused`: victims, in the staging slots that still hold them (staged, nothing read)."""
        st = self.states[pos]
        k = top_k_index.shape[-1]
        rows: dict[int, list[int]] = {}
        for r, e in enumerate(flat):  # (token, choice) rows of each expert
            rows.setdefault(e, []).append(r)
        x_all = hidden.reshape(-1, hidden.shape[-1])
        w_flat = top_k_weights.reshape(-1)
        n_rows = len(flat)
        dev = hidden.device
        parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # expert -> (row ids, weighted outputs)
        # one token through the CPU kernels (bf16 or packed): each call computes its experts' weighted sum in one
        # kernel call, in place of a row per expert gathered and summed at the end (a decode step's Python and small
        # ops). The calls' groups do not depend on when loads land (the resident experts and victims together, then
        # each load alone), and their sums are added in fp32 in the order of their first expert, so a step's output
        # does not depend on load timing; equal to plain up to rounding, as the kernels are
        one = x_all.shape[0] == 1 and not x_all.is_cuda and len(rows) == len(flat) and not mod.eager \
            and (mod.quant is not None or mod.fast_kernel(x_all))
        sums: dict[int, torch.Tensor] = {}  # first expert of a call -> its weighted sum (fp32)

        def run(experts, slot_of, tensors=None, arrivals=False):
            if one:  # `arrivals`: loads that landed together (timing decides which): one call each
                for group in ([[e] for e in experts] if arrivals else [experts]):
                    s = torch.tensor([[slot_of[e] for e in group]], dtype=torch.long)
                    w = w_flat[[rows[e][0] for e in group]][None, :]
                    sums[min(group)] = self._compute(mod.compute, x_all, s, w, tensors).float()
                    parts.update((e, None) for e in group)
                return
            r = torch.tensor([i for e in experts for i in rows[e]], dtype=torch.long)
            s = torch.tensor([slot_of[e] for e in experts for _ in rows[e]], dtype=torch.long)
            rd = r.to(dev)
            y = self._compute(mod.rows, x_all[rd // k], s.to(dev), w_flat[rd], tensors)
            n = 0
            for e in experts:
                m = len(rows[e])
                parts[e] = (rd[n:n + m], y[n:n + m])
                n += m

        waited, staged, transient = 0.0, {}, []
        if host:
            run(hits, {e: st.lookup(e) for e in hits}) if hits else None
            run(misses, {e: e for e in misses}, self._host_views(pos))
        elif low:
            pool = self._lowbit_pool()
            slot_of = {e: j for j, e in enumerate(misses)}
            futs = [self.pool_exec.submit(self._load_low, pos, e, j) for e, j in slot_of.items()]
            try:  # a failed read or compute raises once the other reads have stopped writing their slots
                run(hits, {e: st.lookup(e) for e in hits}) if hits else None
                t0 = time.perf_counter()
                for f in futs:
                    f.result()  # a failed read raises here
                waited += time.perf_counter() - t0
            except BaseException:
                self._quiesce(futs)
                raise
            run(misses, slot_of, pool.views)
        else:
            # the last k misses load into the layer's staging slots (the policy may keep them); the ones before
            # them, when a step needs more than k (a batch, a prefill), stream through the engine's shared stream
            # slots and are gone after computing. Every load is in flight at once, up to the stream slots and the
            # transfer threads. Experts large enough to be worth it (`self.overlap`) compute as their weights
            # arrive, the others once everything is there (one call over the layer's slots: a call costs more
            # than a small expert's compute).
            room = st.k - len(reused)  # staging slots left after the victims served from theirs
            last = misses[len(misses) - min(room, len(misses)):]
            queue = misses[:len(misses) - len(last)]
            transient = list(queue)
            spool = self._stream_pool() if queue else None
            free = list(range(spool.n_slots - 1, -1, -1)) if spool is not None else []
            staged = st.stage(list(reused) + last)

            def submit(fn, *args):
                nonlocal waited
                if self.overlap:
                    return self.pool_exec.submit(fn, *args)
                t0 = time.perf_counter()  # compute waits for an inline load as for one in flight: a stall
                f = self._submit_inline(fn, *args)
                waited += time.perf_counter() - t0
                return f
            futs = {submit(self._load, pos, e, staged[e]): (e, None) for e in last}
            here = {e: st.lookup(e) for e in hits}  # experts in the layer's own slots, not computed yet
            here.update((e, staged[e]) for e in reused)
            held: list[tuple[int, int]] = []  # streamed and arrived, not computed yet

            def feed():
                while queue and free:
                    e, j = queue.pop(0), free.pop()
                    futs[submit(self._load, pos, e, j, spool)] = (e, j)
            try:  # a failed read or compute raises once the step's other loads have stopped writing their slots
                feed()
                if here and futs and self.overlap:  # resident experts (and victims) compute while the misses load
                    run(sorted(here), here)
                    here = {}
                while futs:
                    t0 = time.perf_counter()
                    done, _ = wait(futs, return_when=FIRST_COMPLETED)
                    waited += time.perf_counter() - t0
                    arrived = [futs.pop(f) for f in done]
                    for f in done:
                        f.result()  # a failed read raises here
                    here.update((e, staged[e]) for e, j in arrived if j is None)
                    held += [(e, j) for e, j in arrived if j is not None]
                    if self.overlap and here:
                        run(sorted(here), here, arrivals=True)
                        here = {}
                    if held and (self.overlap or (queue and not free)):
                        run([e for e, _ in sorted(held)], dict(held), spool.views)
                        free.extend(j for _, j in held)  # computed: the slots take the next loads
                        held = []
                        feed()
            except BaseException:
                self._quiesce(futs)
                raise
            if held:
                run([e for e, _ in sorted(held)], dict(held), spool.views)
            if here:
                if not parts and not mod.eager:  # everything in the layer's slots: the family's one call
                    out = self._compute_in_slots(mod, hidden, [here[e] for e in flat], top_k_index, top_k_weights)
                    return out, (staged, transient, waited)
                run(sorted(here), here)
        # combine
        if one:
            out = sum(sums[key] for key in sorted(sums))
            return out.to(hidden.dtype).view_as(hidden), (staged, transient, waited)
        if mod.eager:  # eager: index_add of each expert's rows, in expert order, into the hidden dtype
            out = torch.zeros_like(x_all)
            for e in sorted(parts):
                r, y = parts[e]
                out.index_add_(0, r // k, y.to(out.dtype))
        else:  # grouped/batched implementations: the k weighted rows of a token summed
            buf = torch.empty(n_rows, x_all.shape[-1], dtype=next(iter(parts.values()))[1].dtype, device=dev)
            for r, y in parts.values():
                buf[r] = y
            out = buf.view(-1, k, x_all.shape[-1]).sum(dim=1).to(hidden.dtype)
        return out.view_as(hidden), (staged, transient, waited)

    def _compute_in_slots(self, mod, hidden, slots: list[int], top_k_index, top_k_weights):
        """Every (token, choice) of the layer at once over its own slot pool (`slots`: each row's slot, flat): the
        family's own forward, as plain generate."""
        s = torch.tensor(slots, dtype=torch.long).view_as(top_k_index)
        return self._compute(mod.compute, hidden, s.to(hidden.device), top_k_weights)

    @staticmethod
    def _submit_inline(fn, *args) -> Future:
        """A load done here and now (a memory copy of a small expert costs less than a thread's hand-off)."""
        f = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - raised where the result is read, as from the pool
            f.set_exception(e)
        return f

    def _stream_pool(self) -> SlotPool:
        """The stream slots (STREAM_SLOTS_PER_K x k, at most E), allocated on first use: a step that misses more
        experts than the staging slots hold (a batch, a prefill) loads the rest here, all at once. One layer runs
        at a time, so every layer shares them; `describe()` reports their bytes once allocated."""
        if self._spool is None:
            n = min(STREAM_SLOTS_PER_K * self.adapter.top_k, self.adapter.num_experts)
            self._spool = SlotPool(self.meta, n, self.cfg.slot_device, touch=True)
        return self._spool

    def _host_views(self, pos: int) -> dict[str, torch.Tensor]:
        """`[E, ...]` views of layer `pos`'s experts inside the host tier's copy (no copy)."""
        if not hasattr(self.tier, "layer_views"):
            raise InputError(f"miss policy host computes experts where they live: it needs the host or a throttled "
                             f"tier, not {self.cfg.tier}")
        return self.tier.layer_views(pos)

    def _scores(self, pos, hidden, needed):
        if self.keep_scores is None:
            return None
        return self.keep_scores(pos, hidden, needed)

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = Stats()

    def reset(self) -> None:
        """An empty cache (static pins reloaded), no history, fresh counters: a new, cold pass. A load that
        failed is raised here, not swallowed."""
        failed = None
        for fs in self.pending:  # every load stops (cancelled, or waited for) before anything is cleared; a prefetch
            failed = failed or self._quiesce(fs.values())  # that failed after its layer last ran is raised below
            fs.clear()
        for p in self.prefetched:
            p.clear()
        for p in self.fresh:
            p.clear()
        for p in self.upgrading:
            p.clear()
        for c in self._low_count:
            c.clear()
        self.shadow.clear()
        # the guard's verdict is about the predictor on this model, not about the cache's contents: it carries over
        self._new_states()
        self._load_pins()
        self.history.clear()
        if hasattr(self.keep_scores, "reset"):
            self.keep_scores.reset()
        self._preload_all()
        self.reset_stats()
        if failed is not None:  # raised once, the engine already clean and cold
            raise failed

    def _new_states(self) -> None:
        """Empty caches: one state per layer, or one over `layer * E + expert` keys behind every layer's view."""
        e, k, n_l, c = self.adapter.num_experts, self.adapter.top_k, len(self.layers), self.capacity
        if self.cfg.budget == "layer":
            # victims only where the engine serves them: under miss=host or a packed miss copy, a prefetch (an
            # upgrade) that kept the expert it evicts as a victim would make `prefetch` skip that expert for good
            self.states = [LayerView(CacheState(c, k, self.cache_policy, self.pinned.get(i),
                                                victims=self._victims_on())) for i in range(n_l)]
        else:
            pins = [i * e + x for i in range(n_l) for x in self.pinned.get(i, [])[:c]] if self.pinned else None
            shared = CacheState(c * n_l, k, self.cache_policy, pins)
            self.states = [LayerView(shared, i * e, e * n_l) for i in range(n_l)]

    def _load_pins(self) -> None:
        """Static pins are resident from the start: load them."""
        e = self.adapter.num_experts
        for state in {id(v.state): v.state for v in self.states}.values():
            for key, slot in state.res.items():
                pos = key // e if self.cfg.budget == "global" else next(
                    i for i, v in enumerate(self.states) if v.state is state)
                self.tier.read(pos, key % e, self.pools[pos], slot)
                self._check(self.tier, pos, key % e, self.pools[pos], slot)

    def _preload_all(self) -> None:
        """A cache as large as the layer holds every expert from the start (the all-resident configuration)."""
        if self.capacity < self.adapter.num_experts:
            return
        for pos, st in enumerate(self.states):
            for e in range(self.adapter.num_experts):
                slot = st.prefetch_slot(e, set())
                self.tier.read(pos, e, self.pools[pos], slot)
                self._check(self.tier, pos, e, self.pools[pos], slot)

    def describe(self) -> dict:
        return {"capacity": self.capacity, "capacity_frac": self.capacity / self.adapter.num_experts,
                "staging_slots": self.adapter.top_k, "victims": self._victims_on(),
                "policy": self.cfg.policy, "miss": self.cfg.miss,
                "miss_precision": self.cfg.miss_precision or None,
                "miss_copy": self.cfg.miss_copy or None, "miss_upgrade": self.cfg.miss_upgrade
                if self.cfg.miss_precision else None,
                "tau": self.cfg.tau if self.cfg.miss == "reroute" else None, **self.tier.describe(),
                **self.predictor.describe(), "prefetch_guard": self.guard.describe(),
                "expert_bytes": self.meta.expert_bytes,
                "expert_dtype": self.meta.tensors[0].dtype, "budget": self.cfg.budget, "device": self.cfg.slot_device,
                "fast_tier_bytes": self.fast_bytes, "tier_host_bytes": self.host_bytes,
                "tier_choice": self.tier_choice,
                "stream_slot_bytes": self._spool.n_slots * self.meta.block_bytes if self._spool is not None else 0,
                "integrity": self.integrity(), "weight_checks": self.cfg.integrity}

    def _victims_on(self) -> bool:
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
        fast_step.unpatch_decode_step(self._step)  # first: the step relies on the modules patched below
        patches.unpatch_linears(self._linears)
        patches.unpatch_attention(self._attention)
        self._linears, self._attention, self._step = [], [], []
        self.pool_exec.shutdown(wait=True)
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
