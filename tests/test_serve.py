"""`expertcache serve`: a real uvicorn server on 127.0.0.1 (free port) over the tiny model with the offload
engine attached, called with the official `openai` client, plain and streamed; /metrics moves; bad input gets a
400 and the server goes on; a client that goes away mid-stream stops its decode."""

import json
import time

import httpx
import pytest
from helpers import LiveServer
from tiny_lm import make_tiny_checkpoint, one_torch_thread  # noqa: F401 - autouse fixture

from expertcache.runtime.engine.config import EngineConfig
from expertcache.runtime.engine.engine import offload
from expertcache.runtime.serve.request import encode
from expertcache.runtime.serve.serve import create_app
from expertcache.runtime.storage.store import write_store

NAME = "tiny-moe"




@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("serve")
    ckpt = make_tiny_checkpoint(root / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    write_store(model, root / "experts.store")
    model.expertcache = offload(model, root / "experts.store", EngineConfig(capacity=0.25, tier="disk"))
    app = create_app(model, tok, NAME, max_tokens_default=32, torch_threads=1)
    with LiveServer(app) as url:
        yield {"url": url, "tok": tok, "model": model}
    model.expertcache.close()


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(url) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")] = s.value
    return out


def _idle(url, timeout=30.0):
    t0 = time.time()
    while True:
        h = httpx.get(url + "/health").json()
        if h["running"] == 0 and h["queued"] == 0:
            return h
        assert time.time() - t0 < timeout, h
        time.sleep(0.05)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    h = httpx.get(server["url"] + "/health").json()
    assert h["status"] == "ok" and "continuous batching" in h["scheduling"]
    assert h["engine"]["capacity"] == 2 and h["engine"]["tier"].startswith("disk")


def test_completions_plain_and_streamed_agree_and_count_usage(server, client):
    prompt = "thou art the king"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(encode(server["tok"], prompt))
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) > 1  # token by token, not one piece
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason


def test_chat_plain_and_streamed(server, client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what say you"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0)
    m = r.choices[0].message
    assert r.object == "chat.completion" and m.role == "assistant" and r.usage.completion_tokens <= 10
    stream = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == m.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # sampled, seeded: the same seed gives the same text
    a, b = (client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=1.0, top_p=0.9,
                                           seed=5).choices[0].message.content for _ in range(2))
    assert a == b


def test_metrics_move_after_a_request(server, client):
    url = server["url"]
    before = _metrics(url)
    r = client.completions.create(model=NAME, prompt="fair heaven", max_tokens=9, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = _metrics(url)
    n = r.usage.completion_tokens
    assert n == 9
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d['expertcache_requests_total{"endpoint": "/v1/completions", "outcome": "ok"}'] == 1
    assert d["expertcache_generated_tokens_total"] == n
    assert d["expertcache_prompt_tokens_total"] == r.usage.prompt_tokens
    assert d["expertcache_tpot_seconds_count"] == n - 1  # decode steps, the prefill's token excluded
    # the engine's counters: every token through both MoE layers, top-2 (prefill included)
    assert d["expertcache_cache_tokens_total"] == r.usage.prompt_tokens + n - 1
    assert d["expertcache_cache_accesses_total"] >= (n - 1) * 2 * 2
    assert d["expertcache_cache_bytes_moved_total"] > 0 and d["expertcache_cache_demand_loads_total"] > 0
    assert 0 <= after["expertcache_cache_hit_rate"] <= 1 and "expertcache_cache_adjusted_hit_rate" in after
    assert "expertcache_cache_stall_seconds_total" in after


def test_malformed_requests_get_400_and_the_server_keeps_serving(server, client):
    url = server["url"]
    bad = [(url + "/v1/completions", b'{"prompt": "x", "max_tokens": ', "JSON"),
           (url + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": -1}).encode(), "max_tokens"),
           (url + "/v1/chat/completions", json.dumps({"model": NAME}).encode(), "messages"),
           (url + "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                      "top_p": 0}).encode(), "top_p"),
           (url + "/v1/completions", json.dumps({"prompt": "x", "model": "other"}).encode(), "not served")]
    for u, body, word in bad:
        r = httpx.post(u, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert word in err["message"] and err["type"] == "invalid_request_error", err
        assert err["param"] == (None if word in ("JSON", "not served") else word)
    import openai

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", max_tokens=-1)
    r = client.completions.create(model=NAME, prompt="thou", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_a_client_gone_mid_stream_stops_its_decode(server):
    url, limit = server["url"], 3000
    _idle(url)
    before = _metrics(url)
    body = {"model": NAME, "prompt": "thou art", "max_tokens": limit, "stream": True, "ignore_eos": True,
            "temperature": 0}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [ln for ln in (next(lines) for _ in range(8)) if ln.startswith("data:")]
            assert len(got) >= 3
    _idle(url)  # the decode ended (it would take seconds to reach 3000 tokens)
    after = _metrics(url)
    key = 'expertcache_requests_total{"endpoint": "/v1/completions", "outcome": "cancelled"}'
    assert after.get(key, 0) - before.get(key, 0) == 1
    generated = after["expertcache_generated_tokens_total"] - before["expertcache_generated_tokens_total"]
    assert 3 <= generated < limit // 2, generated
    r = httpx.post(url + "/v1/completions", json={"prompt": "thou", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_max_tokens_beyond_the_context_is_refused_and_the_server_goes_on(server):
    """Found by scripts/load_test.py: max_tokens=10**9 (ignore_eos) was accepted and held the one decode slot past
    the model's context until its client gave up; now a 400, as OpenAI answers."""
    url = server["url"]
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "thou"}],
                                                 "max_tokens": 10 ** 9, "ignore_eos": True, "stream": True}),
                       ("/v1/completions", {"prompt": "thou art", "max_tokens": 4096})):
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400 and "context is 4096 positions" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": "thou", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


@pytest.mark.slow  # many requests through a server (about 1.5 s)
def test_concurrent_requests_are_batched_with_the_same_answers(server, client):
    """Four clients at once share the running batch (the health endpoint saw more than one sequence decoding)
    and each gets the greedy text it gets alone: rows of different lengths do not see each other's tokens."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(prompt):
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=60, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    prompts = ["thou art", "fair heaven", "my lord", "come hither"]
    alone = [ask(p) for p in prompts]
    url, seen = server["url"], []
    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(ask, p) for p in prompts]
        while not all(f.done() for f in futs):
            h = httpx.get(url + "/health").json()
            seen.append((h["running"], h["queued"]))
            time.sleep(0.01)
        together = [f.result() for f in futs]
    assert together == alone  # no state leaks between requests sharing the model, its cache and the engine
    assert max(r for r, _ in seen) >= 2, seen


def test_unsupported_openai_fields_are_a_400_naming_them(server):
    """What this server does not implement is refused by name (never a 200 with nothing done); `user` (OpenAI's
    end-user id) changes nothing and is accepted."""
    url = server["url"]
    for field, value in (("best_of", 2), ("suffix", "x"), ("tools", []),
                         ("response_format", {"type": "json_object"}), ("frobnicate", 1)):
        r = httpx.post(url + "/v1/completions", json={"prompt": "thou", "max_tokens": 2, field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["message"].startswith(f"{field} is not supported by this server"), r.text
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                        "tool_choice": "auto"})
    assert r.status_code == 400 and "tool_choice is not supported" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "thou", "max_tokens": 2, "user": "someone"})
    assert r.status_code == 200, r.text
    for body, word in (({"logit_bias": {"x": 1}}, "not a token id"), ({"logit_bias": {"999999": 1}}, "token ids in"),
                       ({"logit_bias": {"5": 101}}, "-100..100"), ({"top_k": -2}, "top_k"),
                       ({"presence_penalty": 3}, "presence_penalty"), ({"n": 9}, "n"),
                       ({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "echo"),
                       ({"prompt": ["thou", 5]}, "mixing"), ({"prompt": [5, 10**6]}, "outside this model's vocabulary"),
                       ({"prompt": []}, "empty list"), ({"prompt": [[1, 2], []]}, "prompt[1] is an empty list"),
                       ({"prompt": [[1, 2]] * 9, "n": 8}, "at most 64")):
        r = httpx.post(url + "/v1/completions", json={"prompt": "thou", "max_tokens": 2, **body})
        assert r.status_code == 400 and word in r.json()["error"]["message"], (body, r.text)
    _idle(url)


def test_logit_bias_and_penalties_change_what_is_chosen(server):
    """At temperature 0: a +100 bias makes that token every token; a -100 bias on the greedy first token changes
    it; a strong frequency penalty stops a token repeating; top_k = 1 at temperature 1 is greedy."""
    url = server["url"]

    def ids(**kw):
        r = httpx.post(url + "/v1/completions", json={"prompt": "thou shalt", "max_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True, **kw})
        assert r.status_code == 200, r.text
        return server["tok"](r.json()["choices"][0]["text"], add_special_tokens=False)["input_ids"]

    plain = ids()
    target = (plain[0] + 7) % 100 + 10
    forced = ids(logit_bias={str(target): 100})
    assert forced and set(forced) == {target}
    assert ids(logit_bias={str(plain[0]): -100})[0] != plain[0]
    biased = ids(logit_bias={str(target): 5})
    penalised = ids(frequency_penalty=2.0, presence_penalty=2.0, logit_bias={str(target): 5})
    assert biased.count(target) >= 4 and penalised.count(target) < biased.count(target), (biased, penalised)
    sampled = ids(temperature=1.0, top_k=1, seed=3)
    assert sampled == plain
    _idle(url)


def test_logprobs_echo_token_ids_and_lists(server):
    """lm-eval's `local-completions` requests: token-id prompts in a list, echo, logprobs 1, max_tokens 1. The
    prompt's logprobs equal the plain model's log-softmax (first position null), the chosen token's logprob is the
    top one at temperature 0, and choice i answers prompt i."""
    import torch

    url, tok, model = server["url"], server["tok"], server["model"]
    prompts = [encode(tok, "thou art more lovely"), encode(tok, "my lord")]
    r = httpx.post(url + "/v1/completions", json={"prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True,
                                                  "logprobs": 1, "seed": 1234})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for ids, c in zip(prompts, choices):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and all(len(t) == 1 for t in lp["top_logprobs"][1:])
        model.expertcache.reset()
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
        want = [float(ref[j, ids[j + 1]]) for j in range(len(ids) - 1)]
        assert lp["token_logprobs"][1:-1] == pytest.approx(want, abs=1e-4)
        assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1].max()), abs=1e-4)  # greedy: the top one
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())  # lm-eval's is_greedy test
        assert c["text"].startswith(tok.decode(ids, skip_special_tokens=True))
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # a list of strings, n choices: prompt-major order, seeded choices reproducible and different
    body = {"prompt": ["thou", "fair"], "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7, "ignore_eos": True}
    a, b = (httpx.post(url + "/v1/completions", json=body).json() for _ in range(2))
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len(a["choices"]) == 6 and len({c["text"] for c in a["choices"][:3]}) > 1
    assert a["usage"]["completion_tokens"] == 48
    # echo with max_tokens 0 scores the prompt alone
    r = httpx.post(url + "/v1/completions", json={"prompt": "thou art", "max_tokens": 0, "echo": True, "logprobs": 0})
    c = r.json()["choices"][0]
    assert r.status_code == 200 and c["text"] == "thou art" and r.json()["usage"]["completion_tokens"] == 0
    assert len(c["logprobs"]["token_logprobs"]) == len(encode(tok, "thou art"))
    # chat: logprobs per generated token with top_logprobs alternatives, streamed too
    msgs = [{"role": "user", "content": "thou"}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "temperature": 0,
                                                       "ignore_eos": True, "logprobs": True, "top_logprobs": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(e["top_logprobs"]) == 3 for e in content)
    assert all(e["logprob"] == e["top_logprobs"][0]["logprob"] for e in content)
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "thou", "max_tokens": 5, "temperature": 0,
                                                             "ignore_eos": True, "logprobs": 2, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [x for c in chunks for x in ((c["choices"][0].get("logprobs") or {}).get("token_logprobs") or [])]
    assert len(streamed) == 5
    _idle(url)


def test_api_key(tmp_path):
    """With an API key the /v1 endpoints answer 401 without it and 200 with it; /health stays open."""
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    app = create_app(model, AutoTokenizer.from_pretrained(str(ckpt)), NAME, api_key="s3cret", torch_threads=1)
    with TestClient(app) as c:
        body = {"prompt": "thou", "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 401
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200


def test_serve_trace_records_live_requests_that_analyze_reads(tmp_path):
    """`serve --trace`: the routing of every request (prefill and decode, batched) in rotating Parquet traces,
    each complete under its final name with the requests' ids beside it; `analyze` reads them; the metadata
    names the dtype served; /metrics counts the tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.telemetry.analysis import analyze
    from expertcache.telemetry.parquet_trace import read_meta, read_trace

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    app = create_app(model, tok, NAME, torch_threads=1, trace_dir=str(tmp_path / "traces"), trace_rotate_tokens=40)
    prompts = ["thou art", "my lord of the night", "come", "fair heaven and day"]
    with TestClient(app) as c:
        with ThreadPoolExecutor(4) as ex:
            rs = list(ex.map(lambda p: c.post("/v1/completions", json={"prompt": p, "max_tokens": 12,
                                                                       "ignore_eos": True}), prompts))
        assert all(r.status_code == 200 for r in rs)
        ids = {r.json()["id"] for r in rs}
        h = c.get("/health").json()["trace"]
    files = sorted((tmp_path / "traces").glob("trace-*.parquet"))
    assert len(files) >= 2 and not list((tmp_path / "traces").glob(".*tmp*"))  # rotated; nothing half-written
    total_tokens = sum(len(encode(tok, p)) + 12 - 1 for p in prompts)  # the last token is never fed back
    rows = [read_trace(f).table for f in files]
    n_layers = read_meta(files[0]).num_layers
    assert sum(t.num_rows for t in rows) == total_tokens * len(read_meta(files[0]).moe_layers)
    # every token recorded: written, or handed to the writer when /health was read (it writes behind the decode)
    assert h["tokens"] + h["pending_tokens"] == total_tokens and h["dropped_tokens"] == 0 and n_layers >= 1
    assert read_meta(files[0]).dtype == "float32"
    seen = {}
    for f in files:
        seen.update(json.loads(f.with_name(f.stem + ".requests.json").read_text())["requests"])
    assert set(seen.values()) == ids and len(seen) == 4
    phases = set(x for t in rows for x in t["phase"].to_pylist())
    assert phases == {"prefill", "decode"}
    s = analyze(str(files[0]), tmp_path / "analysis", phase=None)
    assert s["routing"]["tokens"] > 0 and s["hit_curves"]


def _sized(step_s: float, n_min: int):
    """The chunk-sizing state of a `Decoder` (its rule alone: no model, no thread)."""
    import types

    from expertcache.runtime.serve.serve import Decoder

    d = types.SimpleNamespace(_step_s=step_s, _floor_s=None, _n=n_min, _min=n_min)
    d._timed = types.MethodType(Decoder._timed, d)
    return d


def test_a_useful_chunk_touches_nearly_every_expert():
    from transformers import Qwen3MoeConfig

    from expertcache.runtime.serve.serve import MIN_CHUNK, useful_chunk

    assert useful_chunk(Qwen3MoeConfig(num_experts=128, num_experts_per_tok=8)) == 36  # Qwen3-30B-A3B
    assert useful_chunk(Qwen3MoeConfig(num_experts=32, num_experts_per_tok=4)) == 18  # the quickstart's
    assert useful_chunk(Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2)) == MIN_CHUNK
    assert useful_chunk(object()) == MIN_CHUNK  # not a model the adapters know


@pytest.mark.parametrize("fixed_s,per_token_s,step_s,want_n", [
    (0.001, 0.0001, 0.02, 190),   # a small fixed part: a chunk takes about one step (as before)
    (0.25, 0.002, 0.2, 36),       # a MoE prompt chunk touches most experts: 36 tokens (0.32 s), not 16 (0.28 s)
    (0.5, 0.002, 0.2, 16),        # 36 tokens take over two steps: what fits in two, at least MIN_CHUNK
])
def test_prefill_chunks_beside_decoding_carry_prompt_and_keep_streams_within_three_steps(
        fixed_s, per_token_s, step_s, want_n):
    """Chunks timed as `fixed + per_token x n` converge to one step's time where that carries at least the useful
    chunk (36 tokens for 128 experts, top-8); where it would carry fewer, to the useful chunk while that takes at
    most 2 steps: a 4-layer Qwen3-30B-A3B-shaped model (0.25 s to touch its experts, 0.2 s steps) prefills 36
    tokens a chunk instead of 16. After the first few, no chunk delays a stream's next token past 3 steps."""
    from expertcache.runtime.serve.serve import MIN_CHUNK

    d = _sized(step_s, 36)
    times = []
    for _ in range(30):
        n = d._n
        t = fixed_s + per_token_s * n
        times.append(t)
        d._timed(n, t)
    assert abs(d._n - want_n) <= 2, d._n
    if want_n > MIN_CHUNK:
        assert all(step_s + t <= 3.05 * step_s for t in times[5:])


def test_a_turns_prefill_grows_with_the_prompts_that_could_start_and_one_prompt_gets_one_chunk():
    """While sequences decode, a turn may prefill one chunk (`_n` tokens, about a decode step's time) for each prompt
    waiting for its first token that could start (the one under way, and queued ones up to the free rows), at most
    PREFILL_SHARE_MAX, never beyond `--prefill_chunk`; with nothing decoding, a whole `--prefill_chunk`. One long
    prompt beside running streams gets one chunk a turn (what keeps their inter-token latency within CHUNK_STEPS + 1
    steps); prompts that no free row could take do not count."""
    import collections
    import types

    from expertcache.runtime.serve.serve import PREFILL_SHARE_MAX, Decoder

    class Rows(list):
        prefill_chunk, max_rows = 4096, 32

    d = types.SimpleNamespace(batch=Rows(["a", "b"]), pending=collections.deque(), job=object(), _n=36)
    chunk = types.MethodType(Decoder._chunk, d)
    assert chunk() == 36  # one prompt under way, none queued: one chunk
    d.pending.extend(range(3))
    assert chunk() == 4 * 36  # four prompts wait for their first token, each with a row to take
    d.pending.extend(range(20))
    assert chunk() == PREFILL_SHARE_MAX * 36  # bounded
    d.batch.max_rows = 4  # 2 rows decode, 1 is the prompt under way's: 1 free row for the 23 queued
    assert chunk() == 2 * 36
    d.batch.max_rows = 3  # no free row: the queued prompts cannot start, so they buy nothing
    assert chunk() == 36
    d.batch.max_rows, d.batch.prefill_chunk = 32, 100
    assert chunk() == 100  # never past --prefill_chunk
    d.job, d.pending = None, collections.deque()
    assert chunk() == 36  # nothing waits yet: a turn still has room for one chunk
    d.batch = Rows()
    d.batch.prefill_chunk = 100
    assert chunk() == 100  # nothing decoding: nobody waits on the prefill
