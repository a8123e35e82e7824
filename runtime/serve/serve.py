"""`expertcache serve`: an OpenAI-compatible HTTP server over one loaded model (FastAPI + uvicorn).

    app = create_app(model, tokenizer, "tiny")      # model.expertcache, when present, is the engine reported
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (`stream: true` for server-sent events, usage in
every non-streamed answer and, with `stream_options.include_usage`, in a last streamed chunk), `GET /v1/models`,
`GET /health`, `GET /metrics` (Prometheus text: the engine's cache counters, a TPOT histogram, requests).

Scheduling: continuous batching. One worker thread runs the decode loop (`decode.Batch`): a request's prompt is
prefilled alone, then it joins the running batch, and every step decodes one token for every sequence in one
forward (the engine serves the union of their experts, each expert's weights read once per step); a sequence
leaves the batch when it finishes. Prompts are prefilled in chunks of at most `--prefill_chunk` tokens, one chunk
between two decode steps of the batch (while sequences decode, a chunk is sized to take about one decode step,
adjusted from each chunk's measured time; a turn takes a chunk for each prompt waiting that could start, at most
`PREFILL_SHARE_MAX`), so a long prompt does not stop the running streams. With `--prompt_cache`
(on by default) the KV of earlier prompts and finished sequences is kept (`prefix_cache.PrefixCache`) and a new
prompt starts from its longest cached prefix (a chat's next turn prefills only the new turn). Requests wait in a
FIFO queue while the batch is full (`--max_batch`) or its KV cache would outgrow `--kv_cache_gb`, which bounds the
batch's KV and the prompt cache together (the prompt cache gives way, least recently used first); `/health` and
`/metrics` report the queue, the batch and the prompt cache. `n` choices and
lists of prompts are sequences of the same batch. A client that disconnects stops its sequences at the next token
(or before they start, if still queued). Bad input gets a 400 with an OpenAI-style error body naming the field,
and the server goes on serving. With `api_key`, the /v1 endpoints need `Authorization: Bearer <key>`.

Logprobs are those of the model's distribution (before penalties, bias and temperature), as vLLM reports them;
completions with `echo` and `logprobs` also score the prompt (`logprobs.token_logprobs[0]` is null), which is how
lm-eval's `local-completions` model computes log-likelihoods against this server.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.hf import check_context, context_length

from expertcache.runtime.kernels import fast_step
from expertcache.runtime.serve.generate import Generation
from expertcache.runtime.serve.request import MAX_LOGPROBS, ROLES, SamplingParams, chat_prompt, encode

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 8  # choices per prompt
MAX_SEQUENCES = 64  # prompts x n in one request
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
MIN_CHUNK = 16  # prompt tokens a prefill chunk holds at least (smaller ones are mostly a forward's fixed cost)
CHUNK_STEPS = 2.0  # the most decode steps' time a prefill chunk beside running sequences may take (`_timed`)
COVERAGE = 0.9  # a chunk beside decoding carries tokens enough to touch this share of a layer's experts
PREFILL_SHARE_MAX = 8  # a turn's prefill beside decoding takes at most this many chunks' time, however many wait
SCHEDULING = "continuous batching (FIFO admission, one forward per step for the whole batch)"


def useful_chunk(model) -> int:
    """The fewest prompt tokens worth a forward beside decoding sequences: enough that their routing touches about
    COVERAGE of a layer's experts (n with 1 - (1 - k/E)^n >= COVERAGE: 36 for 128 experts top-8, 18 for 32
    top-4), as a forward reads each expert its tokens touched once however few tokens it carries, so a smaller
    chunk costs about as much and prefills less (the 4-layer Qwen3-30B-A3B shape, one thread: 0.25 s for 16
    tokens, 0.2 s decode steps). At 98% (61 and 30) the quickstart's model measured a p99 inter-token latency of
    3.06-3.24x its median during a long prefill, over the 3x bound. MIN_CHUNK for a model that is not a MoE the
    adapters know."""
    import math

    from expertcache.telemetry.adapters import adapter_for
    from expertcache.telemetry.errors import InputError

    try:
        a = adapter_for(model)
    except (InputError, AttributeError, TypeError, ValueError):
        return MIN_CHUNK
    if not 0 < a.top_k < a.num_experts:
        return MIN_CHUNK
    return max(MIN_CHUNK, math.ceil(math.log(1 - COVERAGE) / math.log(1 - a.top_k / a.num_experts)))


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": None}})


class _Metrics:
    """Prometheus collectors in a registry of this app's own (two apps in one process do not collide)."""

    def __init__(self, engine):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("expertcache_requests", "Requests by endpoint and outcome (ok, bad_request, "
                                "cancelled, error)", ["endpoint", "outcome"], registry=r)
        self.latency = Histogram("expertcache_request_latency_seconds", "Arrival to last token, per request",
                                 ["endpoint"], registry=r)
        self.tpot = Histogram("expertcache_tpot_seconds", "Time per output token in decode (prefill excluded)",
                              buckets=TPOT_BUCKETS, registry=r)
        self.prefill = Histogram("expertcache_prefill_seconds", "Prompt to first token", registry=r)
        self.prompt_tokens = Counter("expertcache_prompt_tokens", "Prompt tokens processed", registry=r)
        self.prompt_reused = Counter("expertcache_prompt_tokens_reused", "Prompt tokens whose KV came from the "
                                     "prompt cache (not prefilled)", registry=r)
        self.prompt_prefilled = Counter("expertcache_prompt_tokens_prefilled", "Prompt tokens prefilled (forwards "
                                        "through the model)", registry=r)
        self.generated = Counter("expertcache_generated_tokens", "Tokens generated", registry=r)
        self.queued = Gauge("expertcache_queue_depth", "Requests waiting for the decode worker", registry=r)
        self.running = Gauge("expertcache_running", "Sequences decoding now (the batch)", registry=r)
        self.batch = Histogram("expertcache_batch_size", "Sequences in the batch, per decode step",
                               buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.request_tpot = Histogram("expertcache_request_tpot_seconds", "Mean time per output token of each "
                                      "sequence (prefill excluded)", buckets=TPOT_BUCKETS, registry=r)
        if engine is not None:
            r.register(_EngineCollector(engine))

    def observe(self, g: Generation) -> None:
        self.prompt_tokens.inc(g.prompt_tokens)
        self.generated.inc(g.completion_tokens)
        t = g.token_times
        if t:
            self.prefill.observe(t[0] - g.t_start)
        for a, b in zip(t, t[1:]):
            self.tpot.observe(b - a)
        if len(t) > 1:
            self.request_tpot.observe((t[-1] - t[0]) / (len(t) - 1))


class _EngineCollector:
    """The engine's cumulative counters (`engine.stats`, read at scrape time) as Prometheus metrics."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.stats
        d = s.to_dict(self.engine.traffic_expert_bytes)
        for name, doc, v in (
                ("accesses", "Expert accesses (token x MoE layer x selected expert)", s.accesses),
                ("hits", "Accesses whose expert was resident when the layer ran", s.hits),
                ("demand_loads", "Experts loaded on a miss", s.demand_loads),
                ("prefetch_loads", "Experts loaded by the prefetcher (used or not)", s.prefetch_loads),
                ("bytes_moved", "Bytes moved slow -> fast tier", s.bytes_moved),
                ("stall_seconds", "Time compute waited on expert loads", s.stall_s),
                ("tokens", "Tokens through the engine (prefill and decode)", s.tokens)):
            yield CounterMetricFamily(f"expertcache_cache_{name}", doc, value=v)
        nan = float("nan")  # no access yet: no rate (not 0, not 1)
        yield GaugeMetricFamily("expertcache_cache_hit_rate", "hits / accesses since start",
                                value=d["hit_rate"] if s.accesses else nan)
        yield GaugeMetricFamily("expertcache_cache_adjusted_hit_rate", "1 - (demand + prefetch loads) / accesses "
                                "since start (METRICS.md)", value=d["adjusted_hit_rate"] if s.accesses else nan)
        yield GaugeMetricFamily("expertcache_cache_traffic_bytes_per_token", "(demand + prefetch loads) x expert "
                                "bytes / tokens", value=d["traffic_bytes_per_token"])
        yield GaugeMetricFamily("expertcache_cache_capacity_experts", "Resident experts per layer",
                                value=self.engine.capacity)


class _TraceCollector:
    """`serve --trace`: tokens recorded, dropped (the writer behind) and files completed."""

    def __init__(self, trace):
        self.trace = trace

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        d = self.trace.describe()
        yield CounterMetricFamily("expertcache_trace_tokens", "Tokens whose routing was recorded", value=d["tokens"])
        yield CounterMetricFamily("expertcache_trace_dropped_tokens", "Tokens not recorded (the trace writer was "
                                  "behind, or failed)", value=d["dropped_tokens"])
        yield CounterMetricFamily("expertcache_trace_files", "Trace files completed", value=d["files"])


class _PrefixCollector:
    """The prompt cache (`prefix_cache.PrefixCache`): its bytes and bound, entries, hits, misses and evictions."""

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.cache
        yield GaugeMetricFamily("expertcache_prefix_cache_bytes", "Bytes of KV the prompt cache holds", value=c.nbytes)
        yield GaugeMetricFamily("expertcache_prefix_cache_bound_bytes", "The prompt cache's bound now: --kv_cache_gb "
                                "less what the running batch may need", value=c.max_bytes)
        yield GaugeMetricFamily("expertcache_prefix_cache_entries", "Sequences whose KV is kept", value=len(c))
        yield CounterMetricFamily("expertcache_prefix_cache_hits", "Prompts that started from a cached prefix",
                                  value=c.hits)
        yield CounterMetricFamily("expertcache_prefix_cache_misses", "Prompts with no cached prefix (a block or more)",
                                  value=c.misses)
        yield CounterMetricFamily("expertcache_prefix_cache_evictions", "Entries evicted (least recently used)",
                                  value=c.evicted)


def check_prefill_chunk(prefill_chunk, context: int | None) -> None:
    """`--prefill_chunk`: prompt tokens per prefill forward, 1 .. the model's context."""
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1 \
            or (context is not None and prefill_chunk > context):
        within = f"1..{context} (this model's context)" if context else ">= 1, at most the model's context"
        raise InputError(f"--prefill_chunk {prefill_chunk!r}: expected an integer {within}: the prompt tokens per "
                         f"prefill forward")


def check_kv_cache_gb(kv_cache_gb) -> None:
    if isinstance(kv_cache_gb, bool) or not isinstance(kv_cache_gb, (int, float)) or not kv_cache_gb > 0 \
            or kv_cache_gb == float("inf"):
        raise InputError(f"--kv_cache_gb {kv_cache_gb!r}: expected a size in GiB > 0 (the running batch's KV and "
                         f"the prompt cache together)")


class Decoder:
    """The scheduler: one worker thread runs the decode loop (`decode.Batch`); requests join the running batch
    between steps and leave it when done, so every step decodes one token for each of them in one forward.

    Admission: FIFO, while the batch has fewer than `max_batch` rows and the KV cache it would need at its longest
    stays within `kv_cache_bytes`; otherwise a request waits in the queue (`/health`, `/metrics`).

    Prefill: each turn of the loop prefills at most `prefill_chunk` prompt tokens (the prompt under way, then the
    next queued ones; while sequences decode, about one decode step's time, and at least the tokens that touch
    nearly every expert where those fit in two steps: `_chunk`, `useful_chunk`), then runs one decode step
    of the batch, so a long prompt never stops the running streams for more than a chunk. With `prompt_cache`, a
    prompt starts from the longest prefix whose KV an earlier sequence left (`prefix_cache.PrefixCache`), which
    holds what `kv_cache_bytes` leaves beside the batch's need (evicted least recently used as the batch grows;
    it never keeps a request waiting)."""

    def __init__(self, model, metrics: _Metrics, torch_threads: int | None = None, max_batch: int = 8,
                 kv_cache_gb: float = 1.0, prompt_cache: bool = True, prefill_chunk: int = 256):
        import collections

        import torch

        from expertcache.runtime.serve.decode import Batch
        from expertcache.runtime.serve.prefix_cache import PrefixCache

        self.metrics = metrics
        self.batch = Batch(model, max_batch)
        self.kv_cache_bytes = int(kv_cache_gb * 2**30)
        self.batch.prefill_chunk = prefill_chunk
        self.prefix = self.batch.prefix_cache = PrefixCache(self.kv_cache_bytes) if prompt_cache else None
        if self.prefix is not None:
            metrics.registry.register(_PrefixCollector(self.prefix))
        self.job = None  # the prefill under way (`decode.Prefill`), advanced one chunk per turn of the loop
        self._per = None  # KV bytes per row and position, from the last cache seen
        self._step_s = None  # a decode step's seconds (running average)
        self._min = useful_chunk(model)  # the fewest prompt tokens a chunk beside decoding carries, where it can
        self._n = self._min  # prompt tokens per chunk while sequences decode (`_chunk`, `_timed`)
        self._floor_s = None  # the seconds of a chunk of `_min` tokens (running average)
        self.threads = torch_threads or torch.get_num_threads()  # torch's intra-op setting is per thread
        self.pending: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.stopped = False
        self.queued = self.running = 0  # changed by the event loop and the worker: under `_count`
        self._count = threading.Lock()
        self.live: set[threading.Event] = set()
        self._event_loop = None  # the server's event loop (set by the first request)
        self._outbox: list = []  # (queue, event) posted by the worker during a step, delivered in one hand-off
        self.worker = threading.Thread(target=self._loop, name="expertcache-decode", daemon=True)
        self.worker.start()

    # --- the worker thread ---
    def _loop(self) -> None:
        import torch

        torch.set_num_threads(self.threads)
        while True:
            with self.cond:
                while not self.stopped and not self.pending and not len(self.batch) and self.job is None:
                    self.cond.wait()
                if self.stopped:
                    break
            gone = [g for g in self.batch.rows if g.cancel.is_set()]
            if gone:
                for g, _ in self.batch.cancel(gone):
                    self._finish(g)
            self._prefill()
            self._flush()
            if not len(self.batch):
                continue
            self.metrics.batch.observe(len(self.batch))
            try:
                t0 = time.perf_counter()
                events = self.batch.step()
                self._step_s = _ema(self._step_s, time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001 - every row of the failed step gets the error
                for g in self.batch.fail():
                    self._finish(g, e)
                self._flush()
                continue
            for g, piece in events:
                if piece:
                    g._put("text", piece, len(g.token_scores))
                if g.finish_reason is not None:
                    self._finish(g)
            self._flush()
        with self.cond:  # shutting down: whoever is still decoding or waiting is cancelled
            waiting, self.pending = list(self.pending), type(self.pending)()
        if self.job is not None:
            waiting.insert(0, self.job.g)
            self._move(queued=+1, running=-1)
            self.job = None
        for g in self.batch.fail():
            g.finish_reason = "cancelled"
            self._finish(g)
        for g in waiting:
            g.finish_reason = "cancelled"
            self._move(queued=-1, running=+1)
            self._finish(g)
        self._flush()

    def _flush(self) -> None:
        """Hand the step's events to the event loop at once (one wake-up per step, not one per sequence)."""
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        try:
            self._event_loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody to tell
            for q, ev, cancel in items:
                cancel.set()

    def _need(self, g=None) -> int:
        """Bytes of KV the batch (with `g`) may need at its longest: every row to its longest sequence's end."""
        b = self.batch
        if len(b):
            self._per = sum(layer.keys.numel() + layer.values.numel() for layer in b.cache.layers) \
                * b.cache.layers[0].keys.element_size() / max(1, len(b) * b.columns())  # bytes per row and column
        rows = b.rows + ([g] if g is not None else [])
        if not rows or self._per is None:
            return 0
        left = max(r.params.max_tokens - r.completion_tokens for r in rows)
        longest = max([b.columns()] + [r.prompt_tokens for r in rows]) + left
        # (a cache the decode step grows in place holds room to spare beside its positions)
        return int(len(rows) * longest * self._per * fast_step.kv_headroom(b.model, longest))

    def _fits(self, g) -> bool:
        """Whether `g` may join: a free row, and the batch's KV cache at its longest within the budget (the prompt
        cache gives up what it holds beyond what is left)."""
        b = self.batch
        if not len(b):
            return True
        return b.can_join() and self._need(g) <= self.kv_cache_bytes

    def _bound(self, g=None) -> None:
        """The prompt cache gets what the batch (and `g`, about to start) may not need of `kv_cache_bytes`."""
        if self.prefix is not None:
            self.prefix.trim(max(0, self.kv_cache_bytes - self._need(g)))

    def _chunk(self) -> float:
        """Prompt tokens this turn may prefill: `prefill_chunk`; while sequences are decoding, a chunk for each
        prompt waiting for its first token that could start (the one under way, and those queued that a free row
        could take), at most PREFILL_SHARE_MAX, spent in arrival order: the prompt under way first, in one forward.
        A chunk is sized to take about one decode step, or to carry `_min` tokens where that takes longer (`_n`,
        adjusted after each chunk from its measured time: `_timed`), on whatever machine this runs.
        The trade: one long prompt alone delays each running stream's next token by one to CHUNK_STEPS steps; with
        k prompts waiting, a turn holds the streams for up to k chunks (k <= PREFILL_SHARE_MAX), so a queue of
        prompts is not starved behind them. (One chunk a turn whatever the queue starved a multi-turn chat: 8
        conversations on the 4-layer Qwen3-30B-A3B shape, all resident, one thread, 31.5-33.1 tokens/s and a
        4.07-4.17 s median time to first token, against 43.0-44.2 tokens/s and 1.40-1.42 s this way, alternated;
        the streams' time per token went from 124-129 to 141-146 ms.)"""
        b = self.batch
        cap = b.prefill_chunk or float("inf")
        if not len(b):
            return cap
        free = max(0, b.max_rows - len(b) - (self.job is not None))  # rows a queued prompt could still take
        waiting = (self.job is not None) + min(len(self.pending), free)
        return min(cap, self._n * min(PREFILL_SHARE_MAX, max(1, waiting)))

    def _timed(self, n: int, seconds: float) -> None:
        """A chunk of `n` tokens took `seconds` while sequences were decoding: the next one sized to take about one
        decode step, and to carry at least `_min` tokens while a chunk of those takes at most CHUNK_STEPS steps
        (where it takes longer, as many as fit in CHUNK_STEPS steps, at least MIN_CHUNK). A chunk's cost is a
        fixed part and a part per token, so scaling the size by target / time converges from either side."""
        step = self._step_s
        if step is None or seconds <= 0:
            return
        if n == self._min:
            self._floor_s = _ema(self._floor_s, seconds)
        lo, target = self._min, step
        if self._floor_s is not None and self._floor_s > CHUNK_STEPS * step:
            lo, target = MIN_CHUNK, CHUNK_STEPS * step
        self._n = max(lo, min(round(n * target / seconds), 1 << 20))

    def _prefill(self) -> None:
        """This turn's prefill: at most `prefill_chunk` prompt tokens, the prompt under way first, then (while
        tokens are left) queued requests as they fit, each starting from its longest cached prefix."""
        budget = self._chunk()
        self._bound(self.job.g if self.job is not None else None)
        while budget > 0:
            if self.job is None:
                with self.cond:
                    if self.stopped or not self.pending or not self._fits(self.pending[0]):
                        return
                    g = self.pending.popleft()
                self._move(queued=-1, running=+1)
                if g.cancel.is_set():
                    g._begin()
                    g.finish_reason = "cancelled"
                    g._end()
                    self._finish(g)
                    continue
                self._bound(g)
                try:
                    self.job = self.batch.start(g)
                except BaseException as e:  # noqa: BLE001 - this request's prefill failed; the batch goes on
                    self._finish(g, e)
                    continue
                self.metrics.prompt_reused.inc(self.job.reused)
            job = self.job
            if job.g.cancel.is_set():  # its client went away mid-prefill
                self.job = None
                job.g.finish_reason = "cancelled"
                job.g._end()
                self._finish(job.g)
                continue
            before = job.pos
            try:
                t0 = time.perf_counter()
                done = job.advance(None if budget == float("inf") else int(budget))
                if len(self.batch) and job.pos - before == budget:  # a whole chunk beside running sequences
                    self._timed(job.pos - before, time.perf_counter() - t0)
                budget -= job.pos - before
                self.metrics.prompt_prefilled.inc(job.pos - before)
                if not done:
                    return
                self.job = None
                kv = job.cache.layers
                self._per = sum(layer.keys.numel() + layer.values.numel() for layer in kv) \
                    * kv[0].keys.element_size() / job.pos  # bytes per position (a batch of one), before the join
                pieces = self.batch.finish(job)
            except BaseException as e:  # noqa: BLE001 - this request's prefill failed; the batch goes on
                self.job = None
                self._finish(job.g, e)
                continue
            g = job.g
            for piece in pieces:
                g._put("text", piece, len(g.token_scores))
            if g.finish_reason is not None:
                self._finish(g)

    def _finish(self, g, err: BaseException | None = None) -> None:
        if g.t_start is not None:  # what the decode did, whether or not its client stayed to the end
            self.metrics.observe(g)
        self._move(running=-1)
        if err is not None:
            g._put("error", err, 0)
        else:
            g._put("done", g, len(g.token_scores))

    # --- the event loop's side ---
    async def run(self, gens: list[Generation], request):
        """Async iterator of (index, kind, value, n_scores) over `gens` decoding together: ("text", str),
        then ("done", Generation) for each. The client gone or the iterator closed -> all of them stop at their
        next token (or before they start, if still queued)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        self.live.add(cancel)

        self._event_loop = loop
        for i, g in enumerate(gens):
            g.cancel = cancel

            def put(kind, val, n, i=i):  # called by the worker; delivered by its next `_flush`
                self._outbox.append((events, (i, kind, val, n), cancel))

            g._put = put

        async def watch():
            while not cancel.is_set():
                if await request.is_disconnected():
                    cancel.set()
                    return
                await asyncio.sleep(0.05)

        with self.cond:
            self.pending.extend(gens)
            self._move(queued=len(gens))
            self.cond.notify()
        watcher = asyncio.create_task(watch())
        left = len(gens)
        try:
            while left:
                i, kind, val, n = await events.get()
                if kind == "error":
                    raise val
                yield i, kind, val, n
                left -= kind == "done"
        finally:
            cancel.set()  # normal end: a no-op; cancelled or closed early: the decodes stop
            watcher.cancel()
            self.live.discard(cancel)

    def _move(self, queued: int = 0, running: int = 0) -> None:
        with self._count:
            self.queued += queued
            self.running += running
            self.metrics.queued.set(self.queued)
            self.metrics.running.set(self.running)

    def shutdown(self) -> None:
        for c in list(self.live):
            c.set()
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.worker.join(timeout=30)


def _ema(old: float | None, new: float, keep: float = 0.8) -> float:
    return new if old is None else keep * old + (1 - keep) * new


def _deliver(items) -> None:
    for q, ev, _ in items:
        q.put_nowait(ev)


# --- request bodies -----------------------------------------------------------------------------------------------

# fields a client may send that change nothing here: OpenAI's end-user id. Any other field this server does not
# implement is a 400 naming it (`_params`), never a silent no-op.
IGNORED_FIELDS = frozenset({"user"})


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, so that `_params` can name what is not supported
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0, description="0 only with echo: the prompt scored, nothing decoded")
    temperature: float | None = Field(None, ge=0, le=2, description="default: the checkpoint's, else 1")
    top_p: float | None = Field(None, gt=0, le=1, description="default: the checkpoint's, else 1")
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt, decoded together")
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False  # vLLM's extension: decode max_tokens regardless of EOS
    top_k: int | None = Field(None, ge=-1, description="keep the k most likely tokens (0 or -1: off)")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Common):
    prompt: Any = Field(..., description="a string, a list of strings, a list of token ids or a list of lists of "
                                         "token ids")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


Role = Literal[ROLES]  # any other role is a 400 naming these, as OpenAI answers


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


SUPPORTED = ("model, prompt/messages, max_tokens, max_completion_tokens, temperature, top_p, top_k, min_p, "
             f"n (<= {MAX_N}), stop, seed, stream, stream_options, repetition_penalty, presence_penalty, "
             "frequency_penalty, logit_bias, logprobs, top_logprobs (chat), echo (completions), ignore_eos, user")


OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


def _params(req, default_max: int | None, vocab_size: int | None = None, defaults: dict | None = None
            ) -> SamplingParams:
    """The request's sampling; a field it leaves out takes the checkpoint's `generation_config` value (`defaults`),
    else OpenAI's default."""
    unsupported = sorted(set(req.model_extra or {}) - IGNORED_FIELDS)
    if unsupported:
        raise InputError(f"{unsupported[0]} is not supported by this server"
                         + (f" (nor {', '.join(unsupported[1:])})" if len(unsupported) > 1 else "")
                         + f"; it takes {SUPPORTED}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if max_tokens is None:
        max_tokens = default_max
    bias = {}
    for k, v in (req.logit_bias or {}).items():
        try:
            bias[int(k)] = float(v)
        except ValueError:
            raise InputError(f"logit_bias key {k!r} is not a token id") from None
    pick = {k: getattr(req, k) if getattr(req, k) is not None else (defaults or {}).get(k, v)
            for k, v in OPENAI_DEFAULTS.items()}
    p = SamplingParams(max_tokens=max_tokens, temperature=pick["temperature"], top_p=pick["top_p"], stop=stop,
                       seed=req.seed, ignore_eos=req.ignore_eos, top_k=max(int(pick["top_k"]), 0), min_p=req.min_p,
                       repetition_penalty=pick["repetition_penalty"], presence_penalty=req.presence_penalty,
                       frequency_penalty=req.frequency_penalty, logit_bias=bias, logprobs=_logprobs(req),
                       echo=bool(getattr(req, "echo", False)))
    if max_tokens == 0 and not p.echo:
        raise InputError("max_tokens=0 decodes nothing; it is only meaningful with echo (the prompt scored)")
    p.check(vocab_size)
    return p


def _logprobs(req) -> int | None:
    """How many alternatives per position the request asks for (None: no logprobs). Completions: `logprobs: n`;
    chat: `logprobs: true` with `top_logprobs: n`."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise InputError("top_logprobs needs logprobs: true")
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def request_prompts(tokenizer, prompt, vocab_size: int) -> list[list[int]]:
    """A completion request's prompts as token ids: a string, a list of strings, a list of token ids (one prompt)
    or a list of lists of token ids, as OpenAI accepts them. Anything else is an InputError naming what is wrong."""
    def ids_ok(ids: list, where: str) -> list[int]:
        if not ids:
            raise InputError(f"{where} is an empty list of token ids")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InputError(f"{where} mixes token ids with {type(t).__name__} values; expected a string, a list "
                                 f"of strings, a list of token ids or a list of lists of token ids")
            if not 0 <= t < vocab_size:
                raise InputError(f"{where} has token id {t}, outside this model's vocabulary [0, {vocab_size})")
        return list(ids)

    if isinstance(prompt, str):
        return [encode(tokenizer, prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise InputError("prompt must be a string, a list of strings, a list of token ids or a list of lists of token "
                         f"ids (got {'an empty list' if prompt == [] else type(prompt).__name__})")
    kinds = {"str" if isinstance(x, str) else "ids" if isinstance(x, list) else
             "int" if isinstance(x, int) and not isinstance(x, bool) else type(x).__name__ for x in prompt}
    if kinds == {"str"}:
        return [encode(tokenizer, x) for x in prompt]
    if kinds == {"int"}:
        return [ids_ok(prompt, "prompt")]
    if kinds == {"ids"}:
        return [ids_ok(x, f"prompt[{i}]") for i, x in enumerate(prompt)]
    raise InputError(f"prompt is a list mixing {', '.join(sorted(kinds))}; expected one kind: strings, token ids or "
                     f"lists of token ids")


def _text_content(content) -> str:
    """A message's text: a string, or OpenAI's list of parts (only `text` parts are supported)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InputError(f"message content part of type {part.get('type')!r}; only text parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def check_api_key(api_key: str | None) -> None:
    """None serves without a key; an empty one (an unset `$KEY` in `--api_key "$KEY"`) would too, silently: refused,
    as is one no client can send (HTTP drops a header value's surrounding whitespace)."""
    if api_key is None:
        return
    if not isinstance(api_key, str) or not api_key.strip():
        raise InputError(f"--api_key {api_key!r} is empty (an unset variable?): the server would accept every "
                         f"request; pass a key, or leave --api_key out to serve without one")
    if api_key != api_key.strip() or any(not c.isprintable() for c in api_key):
        raise InputError("--api_key has surrounding whitespace or unprintable characters: no client could send it "
                         "in an Authorization header")


# --- the app ---------------------------------------------------------------------------------------------------

def create_app(model, tokenizer, model_name: str = "expertcache", max_tokens_default: int | None = None,
               torch_threads: int | None = None, max_batch: int = 8, kv_cache_gb: float = 1.0,
               api_key: str | None = None, trace_dir: str | None = None, trace_rotate_tokens: int = 50_000,
               prompt_cache: bool = True, prefill_chunk: int = 256):
    """The ASGI app. `max_tokens_default`: chat requests without max_tokens decode up to this many tokens
    (default: the model's context length less the prompt). `max_batch`: sequences decoded together (1: one at a
    time); `kv_cache_gb`: the bound of the batch's KV cache and the prompt cache together; `prompt_cache`: keep
    earlier sequences' KV and start each prompt from its longest cached prefix; `prefill_chunk`: prompt tokens per
    prefill forward between the batch's decode steps; `api_key`: required as a bearer token on /v1; `trace_dir`:
    record the routing of every request into rotating Parquet traces there (`telemetry.live_trace`)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    check_api_key(api_key)
    check_kv_cache_gb(kv_cache_gb)
    check_prefill_chunk(prefill_chunk, context_length(model))
    engine = getattr(model, "expertcache", None)
    metrics = _Metrics(engine)
    decoder = Decoder(model, metrics, torch_threads, max_batch, kv_cache_gb, prompt_cache, prefill_chunk)
    trace = None
    if trace_dir is not None:
        from expertcache.telemetry.live_trace import LiveTrace

        trace = LiveTrace(model, trace_dir, model_name, rotate_tokens=trace_rotate_tokens)
        decoder.batch.trace = trace
        metrics.registry.register(_TraceCollector(trace))
    created = int(time.time())
    context = context_length(model)
    from expertcache.runtime.serve.request import checkpoint_sampling

    sampling = checkpoint_sampling(model)  # the checkpoint's generation_config: defaults for what a request omits

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        decoder.shutdown()
        if trace is not None:
            trace.close()

    app = FastAPI(title="expertcache", lifespan=lifespan)
    app.state.decoder, app.state.metrics = decoder, metrics

    if api_key is not None:
        import hmac

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.url.path.startswith("/v1/"):
                got = request.headers.get("authorization", "")
                if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                    return _error(401, "a valid API key is required (Authorization: Bearer <key>)",
                                  kind="authentication_error")
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":  # loc is (body, character offset): no parameter to name
            msg = f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}"
            loc = []
        elif loc:
            msg = f"{'.'.join(loc)}: {msg}"
        metrics.requests.labels(request.url.path, "bad_request").inc()
        return _error(400, msg, ".".join(loc) or None)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError):
        metrics.requests.labels(request.url.path, "bad_request").inc()
        return _error(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), kind="invalid_request_error" if exc.status_code < 500
                      else "server_error")

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        return _error(500, f"{type(exc).__name__}: {exc}", kind="server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "scheduling": SCHEDULING, "running": decoder.running,
                "queued": decoder.queued, "trace": trace.describe() if trace is not None else None,
                "max_batch": decoder.batch.max_rows if decoder.batch.batchable is not False else 1,
                "prefill_chunk": decoder.batch.prefill_chunk,
                "prompt_cache": None if decoder.prefix is None else {
                    "bytes": decoder.prefix.nbytes, "bound_bytes": decoder.prefix.max_bytes,
                    "entries": len(decoder.prefix), "hits": decoder.prefix.hits, "misses": decoder.prefix.misses,
                    "reused_tokens": decoder.prefix.reused_tokens},
                "engine": engine.describe() if engine is not None else None}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "expertcache"}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    vocab = model.get_input_embeddings().num_embeddings

    def check_model(req) -> None:
        if req.model not in (None, "", model_name):
            raise InputError(f"model {req.model!r} is not served here; this server serves {model_name!r}")

    def default_max(prompt_ids: list[int], fallback: int | None) -> int:
        if fallback is not None:
            return fallback
        return max(1, context - len(prompt_ids)) if context else 1024

    def fit_context(prompt_ids: list[int], params: SamplingParams) -> None:
        """The prompt and max_tokens within the model's context (as OpenAI answers): a request for more would
        hold a decode slot past any position the model knows, until its client gives up."""
        check_context(model, len(prompt_ids), params.max_tokens)

    def piece_of(t: int) -> str:
        return tokenizer.decode([t])

    def completion_logprobs(g: Generation, start: int, end: int, prompt_too: bool, offset: int) -> dict:
        """OpenAI's completions `logprobs` for decoded positions [start, end) (and the prompt's first)."""
        rows = (g.prompt_scores if prompt_too else []) + g.token_scores[start:end]
        tokens = [piece_of(t) for t, _, _ in rows]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [None if lp is None else {piece_of(a): v for a, v in top} for _, lp, top in rows],
                "text_offset": offsets}

    def chat_logprobs(g: Generation, start: int, end: int) -> dict:
        def entry(t: int, lp: float) -> dict:
            s = piece_of(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                            for t, lp, top in g.token_scores[start:end]]}

    async def respond(request: Request, endpoint: str, req, gens: list[Generation], chat: bool):
        t0 = time.perf_counter()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        for i, g in enumerate(gens):
            g.request_id = rid if len(gens) == 1 else f"{rid}/{i}"
        obj = "chat.completion" if chat else "text_completion"
        want_lp = gens[0].params.logprobs is not None
        echo = gens[0].params.echo

        def usage() -> dict:
            # a prompt decoded n times is counted once, as OpenAI counts it
            prompt = sum(g.prompt_tokens for i, g in enumerate(gens) if i % req.n == 0)
            done = sum(g.completion_tokens for g in gens)
            return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

        def record(outcome: str) -> None:  # the decode's own figures are recorded by the decoder
            metrics.requests.labels(endpoint, outcome).inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)

        def extra() -> dict:
            out = {"batched": any(g.shared for g in gens)}
            if len(gens) == 1:
                sm = gens[0].summary()
                out.update({k: sm[k] for k in ("decode_tokens_per_s", "tpot_s", "hit_rate", "adjusted_hit_rate",
                                               "bytes_moved_per_token") if k in sm})
            return out

        def prompt_text(g: Generation) -> str:
            return tokenizer.decode(g.prompt_ids, skip_special_tokens=True) if echo else ""

        events = decoder.run(gens, request)
        if not req.stream:
            pieces = [[] for _ in gens]
            try:
                async for i, kind, val, _ in events:
                    if kind == "text":
                        pieces[i].append(val)
            except BaseException:
                record("error")
                raise
            finally:
                await events.aclose()
            if any(g.finish_reason == "cancelled" for g in gens):
                record("cancelled")
                return _error(499, "client closed the request")
            record("ok")
            choices = []
            for i, g in enumerate(gens):
                text = "".join(pieces[i])
                if chat:
                    choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                    "logprobs": chat_logprobs(g, 0, None) if want_lp else None,
                                    "finish_reason": g.finish_reason})
                else:
                    head = prompt_text(g)
                    lp = completion_logprobs(g, 0, None, g.prompt_logprobs, 0) if want_lp else None
                    choices.append({"index": i, "text": head + text, "logprobs": lp,
                                    "finish_reason": g.finish_reason})
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                 "choices": choices, "usage": usage(), "expertcache": extra()})

        include_usage = bool((req.stream_options or {}).get("include_usage"))

        def chunk(choices: list, **more) -> str:
            body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": int(time.time()), "model": model_name, "choices": choices, **more}
            return f"data: {json.dumps(body)}\n\n"

        async def sse():
            outcome = "cancelled"  # until the last event arrives, an exit is the client going away
            sent = [0] * len(gens)  # token scores already sent, per choice
            shown = [0] * len(gens)  # characters already sent (text_offset)
            try:
                for i, g in enumerate(gens):
                    if chat:
                        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}])
                    elif echo:
                        head = prompt_text(g)
                        lp = completion_logprobs(g, 0, 0, g.prompt_logprobs, 0) if want_lp else None
                        shown[i] = len(head)
                        yield chunk([{"index": i, "text": head, "logprobs": lp, "finish_reason": None}])
                finished = 0
                async for i, kind, val, n in events:
                    g = gens[i]
                    if kind == "text":
                        if chat:
                            lp = chat_logprobs(g, sent[i], n) if want_lp else None
                            yield chunk([{"index": i, "delta": {"content": val}, "logprobs": lp,
                                          "finish_reason": None}])
                        else:
                            lp = completion_logprobs(g, sent[i], n, False, shown[i]) if want_lp else None
                            yield chunk([{"index": i, "text": val, "logprobs": lp, "finish_reason": None}])
                        sent[i], shown[i] = n, shown[i] + len(val)
                        continue
                    if g.finish_reason == "cancelled":
                        return
                    yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": g.finish_reason}]
                                if chat else [{"index": i, "text": "", "logprobs": None,
                                               "finish_reason": g.finish_reason}])
                    finished += 1
                outcome = "ok"
                if include_usage:
                    yield chunk([], usage=usage(), expertcache=extra())
                yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - the headers are sent: the error goes in the stream
                outcome = "error"
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
            finally:
                await events.aclose()
                record(outcome)

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def generations(prompts: list[list[int]], params: SamplingParams, n: int) -> list[Generation]:
        """One Generation per prompt and choice (prompt-major, as OpenAI numbers the choices); choice j of a
        seeded request samples with seed + j, so the n choices differ and each is reproducible."""
        if len(prompts) * n > MAX_SEQUENCES:
            raise InputError(f"{len(prompts)} prompts x n={n} is {len(prompts) * n} sequences; at most "
                             f"{MAX_SEQUENCES} per request")
        out = []
        for ids in prompts:
            fit_context(ids, params)
            for j in range(n):
                pj = copy.copy(params)
                pj.stop = list(params.stop)
                if params.seed is not None:
                    pj.seed = params.seed + j
                out.append(Generation(model, tokenizer, ids, pj))
        return out

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req)
        prompts = request_prompts(tokenizer, req.prompt, vocab)
        params = _params(req, DEFAULT_MAX_TOKENS, vocab, sampling)
        return await respond(request, "/v1/completions", req, generations(prompts, params, req.n), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req)
        msgs = [{"role": m.role, "content": _text_content(m.content)} for m in req.messages]
        templated = bool(getattr(tokenizer, "chat_template", None))
        ids = encode(tokenizer, chat_prompt(tokenizer, msgs), templated=templated)
        params = _params(req, default_max(ids, max_tokens_default), vocab, sampling)
        if not templated:  # the plain transcript: stop before the model writes the user's next turn
            params.stop = [*params.stop, "\nuser:"]
        return await respond(request, "/v1/chat/completions", req, generations([ids], params, req.n), chat=True)

    return app


def serve(model, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", **app_options) -> None:
    import uvicorn

    uvicorn.run(create_app(model, tokenizer, model_name, **app_options), host=host, port=port, log_level=log_level)
