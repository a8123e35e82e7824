"""The engine's counters (`Stats`: hits, loads, bytes, stall and where the time went) and the prefetch guard that pauses
a predictor whose prefetches are not used."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


from expertcache.telemetry.cachesim import CacheResult


@dataclass
class Stats:
    calls: int = 0
    tokens: int = 0
    accesses: int = 0
    hits: int = 0
    demand_loads: int = 0
    prefetch_loads: int = 0  # issued and executed (used or not)
    prefetch_dropped: int = 0  # not started when their layer ran without needing them: cancelled, never read
    prefetch_cancelled: int = 0  # not started when a nearer prediction for their layer no longer named them
    prefetch_deferred: int = 0  # times a layer ran past an unneeded prefetch still loading (not waited for)
    lowbit_served: int = 0  # misses computed from the packed copy (miss_precision), not admitted
    lowbit_bytes: int = 0  # bytes of those reads (also in bytes_moved)
    upgrade_loads: int = 0  # hot experts loaded at full precision in the background and admitted
    upgrade_dropped: int = 0  # upgrades that had not started when their layer ran again: cancelled
    prefetch_hits: int = 0  # hits on an expert that a prefetch brought in
    victim_hits: int = 0  # hits on an expert that had left the cache but whose staging slot still held it
    prefetch_paused: int = 0  # layer steps the prefetch guard skipped (the predictor's precision did not pay)
    rerouted: int = 0
    host_computed: int = 0  # misses computed where their weights live (miss policy host): no bytes moved
    stall_s: float = 0.0
    bytes_moved: int = 0
    read_busy_s: float = 0.0  # wall time with at least one read in flight: bytes_moved over it is the achieved
    # read bandwidth, comparable with the tier's measured limits (`tiers.read_limits`)
    # the time budget (seconds, cumulative): expert compute (the kernels over the slots), all of
    # run_layer (compute + stall + the engine's bookkeeping), and the model's whole forward (a hook on the model)
    compute_s: float = 0.0
    layer_s: float = 0.0
    forward_s: float = 0.0

    def __sub__(self, other: "Stats") -> "Stats":
        return Stats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __add__(self, other: "Stats") -> "Stats":
        return Stats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def time_budget(self, wall_s: float, tokens: int) -> dict:
        """Seconds per token of the steps these stats cover, measured by the engine's clocks: `expert_compute`,
        `stall` (waiting on reads), `other_compute` (the model's forward outside the expert layers: attention,
        norms, routers, lm head, and the model's own Python), `overhead` (the engine's bookkeeping, and `wall_s`
        outside the model's forward: generate's loop, sampling, streamer). They sum to `wall_s / tokens`
        (`tpot`; `sum` is their sum, for the check)."""
        n = max(tokens, 1)
        outside = wall_s - self.forward_s
        parts = {"expert_compute": self.compute_s / n, "stall": self.stall_s / n,
                 "other_compute": (self.forward_s - self.layer_s) / n,
                 "overhead": (self.layer_s - self.compute_s - self.stall_s + outside) / n}
        return {**parts, "tpot": wall_s / n, "sum": sum(parts.values())}

    def counters(self, tokens: int | None = None) -> CacheResult:
        """The cache's counts in the one counters type every area reports through (one step per token; `tokens`:
        the decoded tokens they cover, default `self.tokens`)."""
        # a miss served from the packed copy (miss_precision) is a load the step waited for; an upgrade, one it
        # did not (as a prefetch)
        return CacheResult("engine", 0, "token", self.tokens if tokens is None else tokens, self.accesses, self.hits,
                           self.demand_loads + self.lowbit_served, self.prefetch_loads + self.upgrade_loads)

    def per_token(self, expert_bytes: int | None, tokens: int | None = None) -> dict:
        """The figures per decoded token that every command prints: the cache's (`CacheResult.per_step`), bytes
        moved and seconds stalled. `expert_bytes` None: the experts differ in size (a mixed-precision checkpoint,
        `OffloadEngine.traffic_expert_bytes`), so the traffic is each load's own bytes, as moved."""
        c = self.counters(tokens)
        n = c.steps
        d = c.per_step(expert_bytes or 0, "token")
        if expert_bytes is None:
            d["traffic_bytes_per_token"] = self.bytes_moved / n if n else 0.0
        elif self.lowbit_served and n:  # packed reads are smaller than `expert_bytes`: their own bytes, counted
            d["traffic_bytes_per_token"] = ((self.demand_loads + self.prefetch_loads + self.upgrade_loads)
                                            * expert_bytes + self.lowbit_bytes) / n
        return {**d, "bytes_moved_per_token": self.bytes_moved / n if n else 0.0,
                "stall_per_token_s": self.stall_s / n if n else 0.0,
                "read_busy_per_token_s": self.read_busy_s / n if n else 0.0,
                "read_GBps_in_flight": self.bytes_moved / self.read_busy_s / 1e9 if self.read_busy_s > 0 else None}

    def to_dict(self, expert_bytes: int | None, tokens: int | None = None) -> dict:
        return {**asdict(self), **self.per_token(expert_bytes, tokens)}


class PrefetchGuard:
    """Prefetch only while it pays (`EngineConfig.prefetch_guard`). A predictor starts in *shadow*: it predicts,
    nothing is read, and each prediction is scored against what its layer then uses. After `first` scored
    experts at a precision of at least `min_precision` it goes *on* (prefetches are issued, and scored the same
    way over windows of `window`); under it, or when a window on falls under it, prefetching and the predictor
    *pause* for `pause` layer steps (doubling while it keeps failing, up to 16x), then shadow again. So a predictor
    that does not pay costs its own compute for a few steps now and then, and rarely a read (a shadow verdict on
    8 experts was measured too optimistic: the first decode steps after a prefill are easy to predict).

    In shadow the predictor is *sampled*: it runs on one decode token in `shadow_every` (every layer of that token,
    so each layer's predictions are scored), never on a prefill (whose predictions are not scored), so a predictor
    kept in shadow costs about 1/`shadow_every` of its full-rate compute (issue 46: `lookahead:2` in shadow for a
    whole run, all its predictions resident so none scored, ran 1.12x on-demand; sampled 1 in 8 it is within 2% of
    TPOT). Once a sampled token's predictions are scored (some named expert was not resident), the predictor runs
    on every decode token while they keep being scored (`hot`), so a verdict takes `first` scored experts, not
    `shadow_every` times as many tokens (sampled throughout, the replay's oracle never reached one in 64 tokens:
    0.54 prefetches per token against 4.17, hit rate 0.903 against 0.978); a token that scores nothing drops it back
    to one in `shadow_every`. On, the predictor runs at every step (its prefetches pay for it)."""

    def __init__(self, min_precision: float, window: int = 32, pause: int = 256, first: int = 32,
                 shadow_every: int = 8):
        self.min_precision, self.window, self.pause, self.first = min_precision, window, pause, first
        self.shadow_every = shadow_every
        self.state = "shadow" if min_precision > 0 else "on"
        self.used = self.judged = self.paused_for = self.pauses = 0
        self.backoff, self.last_precision = 1, None
        self.hot, self._scored_now = False, 0  # in shadow: the last token's predictions were scored

    def step(self) -> str:
        """The state for this layer step: shadow | on | paused."""
        if self.state == "paused":
            self.paused_for -= 1
            if self.paused_for <= 0:
                self.state = "shadow"
            return "paused"
        return self.state

    def new_token(self) -> None:
        """A forward pass begins (layer 0): the predictor stays `hot` in shadow if the pass before scored any of its
        predictions."""
        self.hot, self._scored_now = self._scored_now > 0 and self.state == "shadow", 0

    def predicts(self, mode: str, token: int, decoding: bool) -> bool:
        """Whether the predictor runs at this layer step in `mode` (`step()`'s answer): on, always; paused, never;
        in shadow, on decode steps of every `shadow_every`-th token (`token`: the engine's count of forward passes),
        and of every token while it is `hot`."""
        if mode == "shadow":
            return decoding and (self.hot or token % self.shadow_every == 0)
        return mode == "on"

    def outcome(self, used: int, wasted: int) -> None:
        if not self.min_precision or not used + wasted or self.state == "paused":
            return
        if self.state == "shadow":
            self._scored_now += used + wasted
        self.used, self.judged = self.used + used, self.judged + used + wasted
        if self.judged < (self.first if self.state == "shadow" else self.window):
            return
        self.last_precision = self.used / self.judged
        self.used = self.judged = 0
        if self.last_precision < self.min_precision:
            self.state, self.paused_for = "paused", self.pause * self.backoff
            self.backoff = min(2 * self.backoff, 16)
            self.pauses += 1
        else:
            self.state, self.backoff = "on", 1

    def describe(self) -> dict:
        return {"min_precision": self.min_precision, "state": self.state, "shadow_every": self.shadow_every,
                "last_window_precision": self.last_precision, "pauses": self.pauses}
