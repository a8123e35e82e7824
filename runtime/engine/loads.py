"""The loads stage: every read of an expert's bytes into a slot. Demand loads (a step's misses: the last k into
the layer's staging slots, the rest through the shared stream slots, or from the packed copy of `miss_precision`)
and prefetches (what the predictor names for later layers, bounded in-flight bytes, gated by `PrefetchGuard`),
all over the one `LoadQueue` (demand first, then nearer layers); the bookkeeping of what is in flight (settled
before a layer computes, protected from eviction while loading). Also the sizing rules the engine starts with:
a `budget_gb` as a capacity (`fit_budget`, through `cachesim.budget_capacity` as bench big does) and whether the
cache and the tier fit in memory (`check_fits`)."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import replace

import torch

from expertcache.telemetry.errors import InputError

from expertcache.runtime.storage.loadqueue import LoadQueue
from expertcache.runtime.storage.tiers import SlotPool, available_memory, choose_tier, usable_cores
from expertcache.runtime.storage.weight_checks import expert_checks

from expertcache.runtime.engine.config import STREAM_SLOTS_PER_K, LoadConfig
from expertcache.runtime.engine.stats import PrefetchGuard


def fit_budget(budget_gb: float, block_bytes: int, n_layers: int, k: int, e: int, budget: str) -> int:
    """Experts per layer that `budget_gb` of slots holds (k staging slots per pool included), at most E."""
    from expertcache.telemetry.cachesim import budget_capacity

    cap = budget_capacity(budget_gb * 2**30, block_bytes, n_layers, k, e, budget)
    if cap < 1:
        slots = budget_capacity(budget_gb * 2**30, block_bytes, 1, 0, 1 << 62)  # slots it holds
        least = n_layers * (k + 1) if budget == "layer" else n_layers + k
        raise InputError(f"budget_gb={budget_gb:g} holds {slots} slots of {block_bytes / 2**20:.2f} MiB; {n_layers} "
                         f"layers need at least {least} (raise --engine.budget_gb, or give --engine.capacity)")
    return cap


def resolve_tier(cfg, meta, fast_bytes: int, tier=None):
    """`(cfg, why)`: an `EngineConfig` whose tier `auto` is resolved (host when a RAM copy of every expert fits,
    else disk; `tier`: an already opened tier to reuse), and why (None when the tier was given)."""
    if cfg.tier != "auto":
        return cfg, None
    chosen, why = (tier.name, "auto: the tier given") if tier is not None else \
        choose_tier(meta, fast_bytes, cfg.workers)
    cfg = replace(cfg, tier=chosen if chosen in ("disk", "host") else "host")
    if cfg.miss == "host" and cfg.tier != "host":
        raise InputError(f"miss policy host computes experts where they live, in RAM; {why} "
                         f"(give --engine.tier host to insist)")
    return cfg, why


def check_fits(capacity: int, k: int, n_layers: int, fast: str, fast_bytes: int, host_bytes: int, tier: str) -> None:
    """The slots (on `fast`) and the tier's host copy fit in 90% of the memory available, or one line says why not."""
    if fast == "cuda":
        avail = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        need = fast_bytes
        if host_bytes > 0.9 * available_memory():
            raise InputError(f"tier {tier} holds every expert in host RAM ({host_bytes / 2**30:.2f} "
                             f"GiB); only {available_memory() / 2**30:.2f} GiB is available (use "
                             f"--engine.tier disk)")
    else:
        avail, need = available_memory(), fast_bytes + host_bytes
    if need > 0.9 * avail:
        big_host = host_bytes > 2**26
        raise InputError(f"a cache of {capacity} experts per layer (+{k} staging) x {n_layers} layers needs "
                         f"{fast_bytes / 2**30:.2f} GiB"
                         + (f" and tier {tier} {host_bytes / 2**30:.2f} GiB" if big_host else "")
                         + f"; only {avail / 2**30:.2f} GiB is available on the {fast} (lower --engine.capacity"
                         + (" or use --engine.tier disk" if big_host else "") + ")")


def submit_inline(fn, *args) -> Future:
    """A load done here and now (a memory copy of a small expert costs less than a thread's hand-off)."""
    f = Future()
    try:
        f.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - raised where the result is read, as from the pool
        f.set_exception(e)
    return f


def quiesce(futs) -> BaseException | None:
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


class Loads:
    """Reads into slots over one `LoadQueue`, from the part of the config it is given (`LoadConfig`). `states` are
    the layers' cache views (`LayerView`; the engine hands new ones over on reset), `pools` their slot pools,
    `fast` the slots' device; `overlap`: loads in the load threads while experts compute (experts of 1 MiB or
    more), else in the computing thread. `stats` is the engine's `Stats`, for what happens in the load threads."""

    def __init__(self, part: LoadConfig, tier, low_tier, meta, pools: list[SlotPool], fast: str, num_experts: int,
                 top_k: int, predictor, overlap: bool):
        self.part, self.tier, self.low_tier, self.meta, self.pools = part, tier, low_tier, meta, pools
        self.fast, self.num_experts, self.top_k, self.predictor, self.overlap = fast, num_experts, top_k, predictor, \
            overlap
        n_l = len(pools)
        self.states: list = []
        self.stats = None
        # `verify`'s reference-free checks on every expert's first read (`weight_checks.ExpertChecks`), by tier
        self.checks = {id(t): expert_checks(t) for t in (tier, low_tier) if t is not None and part.integrity == "on"}
        # A first read's check runs beside the compute, not before it (`check_later`), where a core is free for it:
        # the layer computes as soon as the bytes land, and the step's output is held (`end_step`) until every check
        # of its reads has passed. One thread: a check scans memory (the whole expert once). Where the compute's
        # threads take every core, the check runs in the load thread before the read completes, as a third thread
        # beside two compute threads on two cores costs more than it hides (replay, bench integrity, 2 threads:
        # +17% TPOT on first reads beside the compute against +10% before it; 1 thread: +2-5% -> 0).
        self.checker = ThreadPoolExecutor(1, thread_name_prefix="expert-check") if self.checks and overlap else None
        self._cores = usable_cores()
        self._checking: dict[tuple[int, int], Future] = {}  # (id(pool), slot) -> the check of the bytes it holds
        self._failed: list[BaseException] = []  # checks that failed, raised at the step's end
        self.queue = LoadQueue(part.workers, "expert-load")  # nearest layer first, demand before any prefetch
        self.guard = PrefetchGuard(part.prefetch_guard)
        self.pending: list[dict[int, Future]] = [{} for _ in range(n_l)]
        self.prefetched: list[set[int]] = [set() for _ in range(n_l)]
        self.fresh: list[set[int]] = [set() for _ in range(n_l)]  # prefetched since the layer last ran
        self.upgrading: list[set[int]] = [set() for _ in range(n_l)]
        self.shadow: dict[int, set[int]] = {}  # layer -> what the predictor named for it while not prefetching
        self.history: dict[int, list[int]] = {}
        self.passes = 0  # forward passes begun: with the layer, a prefetch's place in the load queue
        self.spool: SlotPool | None = None
        self.low_pool: SlotPool | None = None
        self.inflight = 0
        self._lock = threading.Lock()
        self._reading, self._read_t0 = 0, 0.0  # reads in flight, and when the first of them began

    # --- reads -----------------------------------------------------------------------------------------------

    def read(self, tier, pos: int, expert: int, pool: SlotPool, slot: int, lowbit: bool = False) -> None:
        """`tier.read` with its bytes counted and the time any read is in flight (`Stats.read_busy_s`) measured."""
        with self._lock:
            if not self._reading:
                self._read_t0 = time.perf_counter()
            self._reading += 1
        n = 0
        try:
            self._wait_check(pool, slot)  # the bytes a check is still reading are not overwritten
            n = tier.read(pos, expert, pool, slot)
            self.check_later(tier, pos, expert, pool, slot)
        finally:
            with self._lock:
                self._reading -= 1
                if not self._reading:
                    self.stats.read_busy_s += time.perf_counter() - self._read_t0
                self.stats.bytes_moved += n
                if lowbit:
                    self.stats.lowbit_bytes += n

    def check(self, tier, pos: int, expert: int, pool: SlotPool, slot: int) -> None:
        c = self.checks.get(id(tier))
        if c is not None:
            c.check(pos, expert, pool, slot)

    def check_later(self, tier, pos: int, expert: int, pool: SlotPool, slot: int) -> None:
        """An expert's first read checked in the check thread (in this thread where loads do not overlap compute);
        a read seen before costs nothing."""
        c = self.checks.get(id(tier))
        if c is None or c.checked[pos, expert]:
            return
        if self.checker is None or not self.spare_core():
            c.check(pos, expert, pool, slot)
            return
        f = self.checker.submit(c.check, pos, expert, pool, slot)
        with self._lock:
            self._checking[(id(pool), slot)] = f

    def spare_core(self) -> bool:
        """Whether a check beside the compute has a core of its own: the experts compute on a GPU, or the compute's
        threads leave a core free."""
        return self.fast != "cpu" or torch.get_num_threads() < self._cores

    def _wait_check(self, pool: SlotPool, slot: int) -> None:
        """A slot about to be written: the check still reading its old bytes finishes first (a failure is kept for
        the step's end, which raises it; this read is not the damaged one)."""
        with self._lock:
            f = self._checking.pop((id(pool), slot), None)
        if f is not None:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - raised at the step's end
                with self._lock:
                    self._failed.append(e)

    def end_step(self) -> None:
        """Before a step's output is used: every check of the expert reads so far has passed (waited for where one
        is still running). The first failure raises here (the engine then empties its cache: `OffloadEngine.end_step`)."""
        with self._lock:
            futs, self._checking = list(self._checking.values()), {}
        for f in futs:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - raised below, once every check has finished
                self._failed.append(e)
        if self._failed:
            first, self._failed = self._failed[0], []
            raise first

    def shutdown(self) -> None:
        """No new loads or checks; waits for the ones running (the slots are not written after this returns)."""
        self.queue.shutdown(wait=True)
        if self.checker is not None:
            self.checker.shutdown(wait=True)

    def load(self, pos: int, expert: int, slot: int, pool: SlotPool | None = None) -> None:
        """Copy one expert from the slow tier into a slot of layer `pos`'s pool (or of a transient `pool`)."""
        self.read(self.tier, pos, expert, pool if pool is not None else self.pools[pos], slot)

    def load_low(self, pos: int, expert: int, slot: int) -> None:
        self.read(self.low_tier, pos, expert, self.low_pool, slot, lowbit=True)

    def resident(self, pos: int, expert: int, slot: int) -> None:
        """A read at start (static pins, an all-resident cache): not counted, checked."""
        self.tier.read(pos, expert, self.pools[pos], slot)
        self.check(self.tier, pos, expert, self.pools[pos], slot)

    def preload(self, capacity: int) -> None:
        """Static pins are resident from the start; a cache as large as the layer holds every expert from the start
        (the all-resident configuration)."""
        e = self.num_experts
        for state in {id(v.state): v.state for v in self.states}.values():
            for key, slot in state.res.items():
                pos = key // e if self.states[0].num_keys is not None else next(
                    i for i, v in enumerate(self.states) if v.state is state)
                self.resident(pos, key % e, slot)
        if capacity >= e:
            for pos, st in enumerate(self.states):
                for x in range(e):
                    self.resident(pos, x, st.prefetch_slot(x, set()))

    def stream_pool(self) -> SlotPool:
        """The stream slots (STREAM_SLOTS_PER_K x k, at most E), allocated on first use: a step that misses more
        experts than the staging slots hold (a batch, a prefill) loads the rest here, all at once. One layer runs
        at a time, so every layer shares them; `describe()` reports their bytes once allocated."""
        if self.spool is None:
            n = min(STREAM_SLOTS_PER_K * self.top_k, self.num_experts)
            self.spool = SlotPool(self.meta, n, self.fast, touch=True)
        return self.spool

    def lowbit_pool(self) -> SlotPool:
        """The packed copy's slots for one layer's misses (every layer uses them in turn), allocated on first use."""
        if self.low_pool is None:
            self.low_pool = SlotPool(self.low_tier.meta, self.num_experts, self.fast)
        return self.low_pool

    # --- prefetch --------------------------------------------------------------------------------------------

    def ahead(self, pos: int, hidden, needed: list[int], k: int, judge: bool) -> None:
        """Predict and prefetch the next layer(s) while this one loads and computes (history[pos] is now this
        token's choice here; the later layers' entries are still the previous token's). The guard scores what was
        named for this layer (prefetched, or in shadow: nothing read) against what it uses now, on decode steps only
        (`judge`: one token, or the decode loop's batch of rows): a prefill needs most experts, any prediction is
        used there and says nothing about decoding."""
        self.history[pos] = needed
        for named in (self.fresh[pos], self.shadow.pop(pos, set())):
            if named and judge:
                used = len(named.intersection(needed))
                self.guard.outcome(used, len(named) - used)
            named.clear()
        if pos == 0:
            self.passes += 1
            self.guard.new_token()
        ahead, mode = [], None
        if self.predictor.active:
            mode = self.guard.step()
            if mode == "paused":
                self.stats.prefetch_paused += 1
            elif self.guard.predicts(mode, self.passes, judge):  # in shadow: sampled (`PrefetchGuard`)
                # (distance, scores) for each layer it looks at, nearest first: loads are queued in that order
                ahead = sorted(self.predictor.predict_ahead(pos, hidden, self.history), key=lambda x: x[0])
        budget = self.part.prefetch_budget or k
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
        protect = set(experts) | self.in_flight(pos, busy)  # an in-flight slot is never a victim
        for e in experts:
            if st.lookup(e) is not None or st.victim(e) is not None:  # resident, or served from its old slot
                continue
            with self._lock:
                if self.inflight + self.meta.expert_bytes > self.part.max_inflight_bytes:
                    break
                self.inflight += self.meta.expert_bytes
            slot = st.prefetch_slot(e, protect)
            if slot is None:
                with self._lock:
                    self.inflight -= self.meta.expert_bytes
                break
            fut = self.queue.submit(self.load, pos, e, slot, priority=self.passes * len(self.states) + pos)
            fut.add_done_callback(functools.partial(self._prefetch_done, upgrade=upgrade))
            self.pending[pos][e] = fut
            if upgrade:
                self.upgrading[pos].add(e)
                continue
            self.prefetched[pos].add(e)
            self.fresh[pos].add(e)

    def in_flight(self, pos: int, busy: tuple[int, list[int]] | None = None) -> set[int]:
        """Layer `pos`'s expert ids whose slot a load may still be writing: its pending prefetches; under a global
        budget (one cache over every layer's keys) every layer's, and the running layer's experts (`busy`), in
        `pos`'s view ids (which may fall outside 0..E-1). The policy never evicts them (`retain`, `prefetch_slot`)."""
        protect = set(self.pending[pos])
        if self.states[pos].num_keys is not None:  # a global budget's view
            e_n = self.num_experts
            keys = {p * e_n + x for p, fs in enumerate(self.pending) for x in fs}
            if busy is not None:
                keys |= {busy[0] * e_n + x for x in busy[1]}
            protect |= {key - pos * e_n for key in keys}
        return protect

    def settle(self, pos: int, needed: set[int]) -> float:
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

    # --- demand loads ----------------------------------------------------------------------------------------

    def demand(self, pos: int, misses: list[int], reused: list[int]) -> "Demand":
        """A step's misses as loads: the last ones into the staging slots the victims (`reused`) leave, the ones
        before them, when a step needs more than k (a batch, a prefill), through the shared stream slots (gone
        after computing). Every load is in flight at once, up to the stream slots and the transfer threads."""
        return Demand(self, pos, misses, reused)

    def low(self, pos: int, misses: list[int]) -> tuple[list[Future], dict[int, int]]:
        """The misses read from the packed copy into its own slots, all at once: (futures, {expert: slot})."""
        self.lowbit_pool()
        slot_of = {e: j for j, e in enumerate(misses)}
        return [self.queue.submit(self.load_low, pos, e, j) for e, j in slot_of.items()], slot_of

    # --- lifecycle -------------------------------------------------------------------------------------------

    def reset(self) -> BaseException | None:
        """Every load stops (cancelled, or waited for) before anything is cleared; returns the first error of a
        prefetch that failed after its layer last ran (the caller raises it once everything is clean)."""
        failed = None
        for fs in self.pending:
            failed = failed or quiesce(fs.values())
            fs.clear()
        try:
            self.end_step()  # the checks of what was read: a damaged expert is raised, not forgotten with the cache
        except BaseException as e:  # noqa: BLE001 - returned like a failed prefetch, raised by the caller
            failed = failed or e
        for sets in (self.prefetched, self.fresh, self.upgrading):
            for p in sets:
                p.clear()
        self.shadow.clear()
        self.history.clear()
        # the guard's verdict is about the predictor on this model, not about the cache's contents: it carries over
        return failed


class Demand:
    """One step's demand loads, as events for the compute stage (`Compute.layer`) to compute between:
    ("started", any_in_flight) once the first loads are in flight, then ("staged", {expert: slot}) as loads into
    the layer's staging slots land and ("stream", {expert: stream slot}) when streamed ones are to compute (their
    slots then take the next loads). `waited`: seconds the computing thread waited for loads (a stall)."""

    def __init__(self, loads: Loads, pos: int, misses: list[int], reused: list[int]):
        self.loads, self.pos = loads, pos
        st = loads.states[pos]
        room = st.k - len(reused)  # staging slots left after the victims served from theirs
        self.last = misses[len(misses) - min(room, len(misses)):]
        self.queue = misses[:len(misses) - len(self.last)]
        self.transient = list(self.queue)
        self.spool = loads.stream_pool() if self.queue else None
        self.free = list(range(self.spool.n_slots - 1, -1, -1)) if self.spool is not None else []
        self.staged = st.stage(list(reused) + self.last)
        self.futs: dict[Future, tuple[int, int | None]] = {}
        self.waited = 0.0

    def _submit(self, fn, *args):
        if self.loads.overlap:
            return self.loads.queue.submit(fn, *args)
        t0 = time.perf_counter()  # compute waits for an inline load as for one in flight: a stall
        f = submit_inline(fn, *args)
        self.waited += time.perf_counter() - t0
        return f

    def _feed(self):
        while self.queue and self.free:
            e, j = self.queue.pop(0), self.free.pop()
            self.futs[self._submit(self.loads.load, self.pos, e, j, self.spool)] = (e, j)

    def events(self):
        overlap, staged = self.loads.overlap, self.staged
        self.futs.update((self._submit(self.loads.load, self.pos, e, staged[e]), (e, None)) for e in self.last)
        held: list[tuple[int, int]] = []  # streamed and arrived, not computed yet
        self._feed()
        yield "started", bool(self.futs)
        while self.futs:
            t0 = time.perf_counter()
            done, _ = wait(self.futs, return_when=FIRST_COMPLETED)
            self.waited += time.perf_counter() - t0
            arrived = [self.futs.pop(f) for f in done]
            for f in done:
                f.result()  # a failed read raises here
            landed = {e: staged[e] for e, j in arrived if j is None}
            if landed:
                yield "staged", landed
            held += [(e, j) for e, j in arrived if j is not None]
            if held and (overlap or (self.queue and not self.free)):
                yield "stream", dict(held)
                self.free.extend(j for _, j in held)  # computed: the slots take the next loads
                held = []
                self._feed()
        if held:
            yield "stream", dict(held)

    def quiesce(self) -> None:
        """A failed read or compute: the step's other loads stop writing their slots before the error leaves."""
        quiesce(self.futs)
