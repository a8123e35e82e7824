"""A bounded load test of `expertcache serve`: concurrent streaming clients for a fixed time, malformed requests and
mid-stream disconnects mixed in; the server must keep serving, answer bad input with 4xx (never 5xx), and hold
its memory and file descriptors. Prints JSON (and writes it with --out).

The server runs in a child process (this script with --child) over a tiny Qwen3-MoE checkpoint built here
(tests/tiny_lm.py: its own byte-level BPE, no hub), the offload engine attached (1/4 of the experts, disk tier,
a repacked store), so its RSS and /proc/<pid>/fd are its own. Before: after a warm-up (a few requests of every
kind); after: once the load has stopped and the server is idle again.

    python scripts/load_test.py --seconds 40 --clients 6 --out results/load_test.json

Batched serving throughput, against vLLM and on a chat load, is `expertcache bench serve` (docs/serving.md).
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

from expertcache.runtime.bench.runner import wait_serving
from expertcache.runtime.bench.serve_load import WORDS, _pct, _stop, _wait_idle
from expertcache.telemetry.atomic import open_log
from expertcache.telemetry.errors import count, nonnegative, positive

REPO = Path(__file__).resolve().parents[1]
NAME = "tiny-moe"


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




def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=positive, default=40)
    ap.add_argument("--clients", type=count, default=6)
    ap.add_argument("--seed", type=nonnegative, default=0)
    ap.add_argument("--timeout", type=positive, default=30, help="per-request client timeout (s)")
    ap.add_argument("--max-positions", type=count, default=1024, help="the tiny model's context length")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.dir, a.port, a.max_positions)
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
