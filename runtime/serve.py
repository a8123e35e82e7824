"""`expertcache serve`: an OpenAI-compatible HTTP server over one loaded model (FastAPI + uvicorn).

    app = create_app(model, tokenizer, "tiny")      # model.expertcache, when present, is the engine reported
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (`stream: true` for server-sent events, usage in
every non-streamed answer and, with `stream_options.include_usage`, in a last streamed chunk), `GET /v1/models`,
`GET /health`, `GET /metrics` (Prometheus text: the engine's cache counters, a TPOT histogram, requests).

Scheduling: one decode at a time, no batching. Every request's decode runs on one worker thread, in arrival
order (a FIFO queue); `/health` reports the queue. A client that disconnects stops its decode at the next token
(or before it starts, if it was still queued). Bad input gets a 400 with an OpenAI-style error body, and the
server goes on serving.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from expertcache.telemetry.errors import InputError

from .generate import Generation, SamplingParams, chat_prompt, encode

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
SCHEDULING = "one decode at a time (FIFO queue, no batching)"


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
        self.generated = Counter("expertcache_generated_tokens", "Tokens generated", registry=r)
        self.queued = Gauge("expertcache_queue_depth", "Requests waiting for the decode worker", registry=r)
        self.running = Gauge("expertcache_running", "Requests decoding now (0 or 1)", registry=r)
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


class _EngineCollector:
    """The engine's cumulative counters (`engine.stats`, read at scrape time) as Prometheus metrics."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.stats
        d = s.to_dict(self.engine.meta.expert_bytes)
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


class Decoder:
    """Runs `Generation`s one at a time on a single worker thread; yields their events to the event loop."""

    def __init__(self, model, tokenizer, metrics: _Metrics, torch_threads: int | None = None):
        import torch

        n = torch_threads or torch.get_num_threads()
        # torch's intra-op thread count is per thread: the worker takes the server's setting
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="expertcache-decode",
                                       initializer=torch.set_num_threads, initargs=(n,))
        self.model, self.tokenizer, self.metrics = model, tokenizer, metrics
        self.queued = self.running = 0  # changed by the event loop and the worker: under `_count`
        self._count = threading.Lock()
        self.live: set[threading.Event] = set()

    async def run(self, prompt_ids: list[int], params: SamplingParams, request):
        """Async iterator of ("text", str) events, then ("done", Generation). Cancelled (closed, or the client
        gone) -> the decode stops at its next token."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        self.live.add(cancel)

        def put(*ev):
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the event loop is gone (server shutting down): nobody to tell
                cancel.set()

        def work():
            self._move(queued=-1, running=+1)
            g, err = None, None
            try:
                g = Generation(self.model, self.tokenizer, prompt_ids, params, cancel)
                for text in g:
                    put("text", text)
            except BaseException as e:  # noqa: BLE001 - handed to the request's task, which raises it
                err = e
            if g is not None:  # what the decode did, whether or not its client stayed to the end
                self.metrics.observe(g)
            self._move(running=-1)
            if err is not None:
                put("error", err)
            else:
                put("done", g)

        async def watch():
            while not cancel.is_set():
                if await request.is_disconnected():
                    cancel.set()
                    return
                await asyncio.sleep(0.05)

        self._move(queued=+1)
        self.pool.submit(work)
        watcher = asyncio.create_task(watch())
        try:
            while True:
                kind, val = await events.get()
                if kind == "error":
                    raise val
                yield kind, val
                if kind == "done":
                    return
        finally:
            cancel.set()  # normal end: a no-op; cancelled or closed early: the decode stops
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
        self.pool.shutdown(wait=True, cancel_futures=True)


# --- request bodies -----------------------------------------------------------------------------------------------

# fields a client may send that change nothing here: OpenAI's end-user id. Any other field this server does not
# implement is a 400 naming it (`_params`), never a silent no-op.
IGNORED_FIELDS = frozenset({"user"})


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, so that `_params` can name what is not supported
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, description="default: the checkpoint's, else 1")
    top_p: float | None = Field(None, gt=0, le=1, description="default: the checkpoint's, else 1")
    n: int = Field(1, ge=1, le=1, description="one choice per request")
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
    prompt: str | list[str] = Field(..., description="one prompt (a list of one string is accepted)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


SUPPORTED = ("model, prompt/messages, max_tokens, max_completion_tokens, temperature, top_p, top_k, min_p, n (1), "
             "stop, seed, stream, stream_options, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, "
             "ignore_eos, user")


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
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or default_max
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
                       frequency_penalty=req.frequency_penalty, logit_bias=bias)
    p.check(vocab_size)
    return p


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


# --- the app ---------------------------------------------------------------------------------------------------

def create_app(model, tokenizer, model_name: str = "expertcache", max_tokens_default: int | None = None,
               torch_threads: int | None = None):
    """The ASGI app. `max_tokens_default`: chat requests without max_tokens decode up to this many tokens
    (default: the model's context length less the prompt)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    engine = getattr(model, "expertcache", None)
    metrics = _Metrics(engine)
    decoder = Decoder(model, tokenizer, metrics, torch_threads)
    created = int(time.time())
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    from .generate import checkpoint_sampling

    sampling = checkpoint_sampling(model)  # the checkpoint's generation_config: defaults for what a request omits

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        decoder.shutdown()

    app = FastAPI(title="expertcache", lifespan=lifespan)
    app.state.decoder, app.state.metrics = decoder, metrics

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
                "queued": decoder.queued, "engine": engine.describe() if engine is not None else None}

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
        hold the one decode slot past any position the model knows, until its client gives up."""
        if context and len(prompt_ids) + params.max_tokens > context:
            left = max(0, context - len(prompt_ids))
            raise InputError(f"this model's context is {context} tokens: the prompt has {len(prompt_ids)} and "
                             f"max_tokens={params.max_tokens} asks for more than the {left} left")

    async def respond(request: Request, endpoint: str, req, prompt_ids: list[int], params: SamplingParams,
                      chat: bool):
        t0 = time.perf_counter()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"

        def usage(g: Generation) -> dict:
            return {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
                    "total_tokens": g.prompt_tokens + g.completion_tokens}

        def record(outcome: str) -> None:  # the decode's own figures are recorded by the decoder
            metrics.requests.labels(endpoint, outcome).inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)

        def extra(g: Generation) -> dict:
            s = g.summary()
            return {k: s[k] for k in ("decode_tokens_per_s", "tpot_s", "hit_rate", "adjusted_hit_rate",
                                      "bytes_moved_per_token") if k in s}

        events = decoder.run(prompt_ids, params, request)
        if not req.stream:
            pieces, g = [], None
            try:
                async for kind, val in events:
                    if kind == "text":
                        pieces.append(val)
                    else:
                        g = val
            except BaseException:
                record("error")
                raise
            finally:
                await events.aclose()
            if g.finish_reason == "cancelled":
                record("cancelled")
                return _error(499, "client closed the request")
            record("ok")
            text = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                       "finish_reason": g.finish_reason} if chat else
                      {"index": 0, "text": text, "logprobs": None, "finish_reason": g.finish_reason})
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                 "choices": [choice], "usage": usage(g), "expertcache": extra(g)})

        include_usage = bool((req.stream_options or {}).get("include_usage"))

        def chunk(choices: list, **more) -> str:
            body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": int(time.time()), "model": model_name, "choices": choices, **more}
            return f"data: {json.dumps(body)}\n\n"

        async def sse():
            g, outcome = None, "cancelled"  # until the last event arrives, an exit is the client going away
            try:
                if chat:
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                async for kind, val in events:
                    if kind == "text":
                        yield chunk([{"index": 0, "delta": {"content": val}, "logprobs": None,
                                      "finish_reason": None}] if chat else
                                    [{"index": 0, "text": val, "logprobs": None, "finish_reason": None}])
                        continue
                    g = val
                    if g.finish_reason == "cancelled":
                        return
                    outcome = "ok"
                    yield chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": g.finish_reason}]
                                if chat else [{"index": 0, "text": "", "logprobs": None,
                                               "finish_reason": g.finish_reason}])
                    if include_usage:
                        yield chunk([], usage=usage(g), expertcache=extra(g))
                    yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - the headers are sent: the error goes in the stream
                outcome = "error"
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
            finally:
                await events.aclose()
                record(outcome)

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req)
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise InputError(f"prompt is a list of {len(prompt)} strings; this server takes one prompt "
                                 f"per request")
            prompt = prompt[0]
        ids = encode(tokenizer, prompt)
        params = _params(req, DEFAULT_MAX_TOKENS, vocab, sampling)
        fit_context(ids, params)
        return await respond(request, "/v1/completions", req, ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req)
        msgs = [{"role": m.role, "content": _text_content(m.content)} for m in req.messages]
        templated = bool(getattr(tokenizer, "chat_template", None))
        ids = encode(tokenizer, chat_prompt(tokenizer, msgs), templated=templated)
        params = _params(req, default_max(ids, max_tokens_default), vocab, sampling)
        fit_context(ids, params)
        if not templated:  # the plain transcript: stop before the model writes the user's next turn
            params.stop = [*params.stop, "\nuser:"]
        return await respond(request, "/v1/chat/completions", req, ids, params, chat=True)

    return app


def serve(model, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(create_app(model, tokenizer, model_name), host=host, port=port, log_level=log_level)
