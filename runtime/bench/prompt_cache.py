"""`expertcache bench prompt-cache`: prompt reuse and chunked prefill in `expertcache serve`, measured over HTTP
against servers started by their own command lines."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from expertcache.telemetry.errors import InputError, check_counts

from expertcache.runtime.bench.harness import order

DEFAULT_MODEL = "runs/starter/model"
NAME = "m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: Path, capacity: float, prompt_cache: bool, chunk: int, log) -> tuple[subprocess.Popen, str, list]:
    port = _free_port()
    cmd = [sys.executable, "-m", "expertcache.recipes.cli", "serve", "--model", str(model), "--port", str(port),
           "--served_model_name", NAME, "--log_level", "warning", "--engine.capacity", str(capacity),
           "--engine.threads", "1", "--prompt_cache", str(prompt_cache).lower(), "--prefill_chunk", str(chunk)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
    return p, f"http://127.0.0.1:{port}", cmd


def _wait(p: subprocess.Popen, url: str, timeout: float = 300) -> None:
    from expertcache.runtime.bench.runner import wait_serving

    if wait_serving(p, url, timeout, poll_s=0.5):
        return
    if p.poll() is not None:
        raise SystemExit(f"server exited with {p.returncode} (see the log)")
    raise SystemExit(f"server at {url} did not start in {timeout} s")


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def _stream(client, url: str, prompt: list[int], n: int, on_chunk=None) -> tuple[float, list[str]]:
    """(time to the first token's chunk, the tokens as pieces) of a greedy streamed completion of `prompt`."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0}
    t0, first, tokens = time.perf_counter(), None, []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ch = json.loads(line[6:])["choices"]
            if not ch:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - t0
            tokens += (ch[0].get("logprobs") or {}).get("tokens") or []
            if on_chunk is not None:
                on_chunk(now)
    return first, tokens


async def _first_token(client, url: str, prompt: list[int]) -> float:
    """Time to first token: the wall time of a one-token completion (a streamed one's first chunk can wait for a
    later token when the first is part of a UTF-8 character)."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/completions", json=body, timeout=600)
    t = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    return t


def _texts_ids(tok, need: int) -> list[int]:
    """`need` token ids of the repository's own prose (README and docs), in order; from an installed package
    without them, of its own source files."""
    ids: list[int] = []
    root = Path(__file__).resolve().parents[2]  # the repository (an editable install), or the package
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))] if (root / "README.md").is_file() \
        else sorted(root.rglob("*.py"))
    for p in files:
        ids += tok(p.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            return ids[:need]
    raise InputError(f"the prompts' text holds {len(ids)} tokens; {need} needed (lower --rounds, --history, --long)")


async def _ttft_rounds(servers: dict, tok, text: list[int], a) -> dict:
    import httpx

    out = {k: [] for k in servers}
    equal, reused, lengths = True, [], []
    async with httpx.AsyncClient() as client:
        for r in range(a.rounds):
            history = text[r * a.history:(r + 1) * a.history]
            question = text[-(r + 1) * a.question:][:a.question]
            got = {}
            for name in order(list(servers), r):  # the harness's order: reversed every other round
                url = servers[name]
                _, answer = await _stream(client, url, history, a.answer)
                follow = history + tok("".join(answer), add_special_tokens=False)["input_ids"] + question
                before = _metric(url, "expertcache_prompt_tokens_reused_total")
                ttft = await _first_token(client, url, follow)
                if name == "reuse":
                    reused.append(_metric(url, "expertcache_prompt_tokens_reused_total") - before)
                    lengths.append(len(follow))
                _, tokens = await _stream(client, url, follow, a.new)
                out[name].append(ttft)
                got[name] = tokens
            equal = equal and got["reuse"] == got["no_reuse"]
    return {"ttft_reuse_s": statistics.median(out["reuse"]), "ttft_no_reuse_s": statistics.median(out["no_reuse"]),
            "ttft_reuse_rounds_s": out["reuse"], "ttft_no_reuse_rounds_s": out["no_reuse"],
            "equal_tokens": equal, "follow_up_prompt_tokens": lengths, "reused_prompt_tokens": reused}


async def _itl_rounds(url: str, text: list[int], long_len: int, a) -> dict:
    import httpx

    base, during, windows = [], [], []
    async with httpx.AsyncClient() as client:
        for r in range(a.rounds):
            arrivals = [[] for _ in range(a.streams)]
            tasks = [asyncio.create_task(_stream(client, url, text[100 * i + r:100 * i + r + 32], a.stream_tokens,
                                                 arrivals[i].append)) for i in range(a.streams)]
            while min(len(x) for x in arrivals) < a.stream_tokens // 3:  # the streams decode a while alone first
                await asyncio.sleep(0.01)
            long_prompt = text[-long_len - r:len(text) - r]  # a fresh prompt each round: nothing cached to reuse
            t_sent = time.perf_counter()
            first, _ = await _stream(client, url, long_prompt, 1)
            window = (t_sent, t_sent + first)
            windows.append(first)
            await asyncio.gather(*tasks)
            for times in arrivals:
                for x, y in zip(times, times[1:]):
                    (during if window[0] < y <= window[1] else base).append(y - x)
    return {"itl_p50_s": statistics.median(base), "itl_p99_during_prefill_s": _pct(during, 99),
            "itl_p50_during_prefill_s": statistics.median(during), "itl_gaps_outside": len(base),
            "itl_gaps_during": len(during), "itl_p99_outside_s": _pct(base, 99), "long_prompt_ttft_s": windows}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def bench_prompt_cache(model: str = DEFAULT_MODEL, capacities: list[float] = [1.0, 0.25], rounds: int = 3,
                       history: int = 1000, answer: int = 8, question: int = 8, new: int = 8, long: int = 2048,
                       streams: int = 2, stream_tokens: int = 240, prefill_chunk: int = 256,
                       out: Optional[str] = None) -> dict:
    """Prompt reuse and chunked prefill in `expertcache serve`, measured over HTTP.

    The servers are `expertcache serve` started by their own command lines (child processes, `--engine.threads 1`)
    on a copy of the checkpoint (the loader may write a checksum index beside it), at each `--capacities` value,
    one with the prompt cache and one with `--prompt_cache false`. TTFT of a follow-up turn: per round a new
    history (`--history` tokens of the repository's own docs), sent as turn 1 (`--answer` greedy tokens), then the
    follow-up (history + turn 1's answer + `--question` new tokens); TTFT = the wall time of its one-token
    completion; its `--new` greedy tokens from a second request. Both servers get both turns, in alternating order,
    every round; medians over `--rounds`; `equal_tokens`: the follow-up's tokens are the same on both. Chunked
    prefill: on the prompt-cache server at the first capacity, `--streams` streams decode while a long prompt is
    sent each round; ITL = the gap between two chunks of a stream, `itl_p50_s` outside every long prefill,
    `itl_p99_during_prefill_s` over the gaps that end between the long request being sent and its first token.
    Targets: reuse at most 0.2x the TTFT without it; ITL p99 during a prefill at most 3x the p50. Run it alone.

    Args:
        model: checkpoint (default: the quickstart's); read only, served from a copy
        capacities: the servers' --engine.capacity values
        rounds: rounds of each measurement (servers alternated)
        history: tokens of history before the follow-up turn (turn 1's prompt and answer)
        answer: turn 1's answer (greedy tokens)
        question: the follow-up turn's new tokens
        new: greedy tokens decoded for the follow-up turn
        long: the long prompt of the chunked-prefill rounds (at most the model's positions)
        streams: streams decoding while the long prompt is prefilled
        stream_tokens: tokens each of those streams asks for
        prefill_chunk: the servers' --prefill_chunk
        out: also write the JSON here
    """
    config = dict(locals())
    a = SimpleNamespace(**config)
    check_counts(**{k: v for k, v in config.items() if k not in ("model", "capacities", "out")})
    if not capacities or any(not 0 < c <= 1 for c in capacities):
        raise InputError(f"--capacities {capacities}: expected fractions of the experts in (0, 1]")
    if answer >= history:
        raise InputError(f"--answer {answer}: must be below --history {history} (turn 1's answer is part of it)")
    from expertcache.telemetry.atomic import check_output, copy_tree
    from expertcache.telemetry.hf import context_length, load_config, load_tokenizer

    from expertcache.runtime.bench.results import command_line, started, write_result

    check_output(out, model)
    prov = started()  # the code and the machine, before the work

    src = Path(model)
    try:
        ctx = context_length(load_config(src))
        tok = load_tokenizer(src)
    except InputError as e:  # (no model yet on a fresh clone: the default's line says what makes it)
        raise InputError(f"--model: {e}" + ("; `make quickstart` makes the default one"
                                            if model == DEFAULT_MODEL else "")) from None
    hist_turn1 = a.history - a.answer  # turn 1's prompt; its answer completes the history
    a_hist = SimpleNamespace(**{**vars(a), "history": hist_turn1})
    long_len = min(a.long, ctx - 1) if ctx else a.long
    text = _texts_ids(tok, a.rounds * hist_turn1 + a.rounds * a.question + long_len + a.rounds + 200)
    rows, itl, load_start = [], None, os.getloadavg()
    cmds = {}
    with tempfile.TemporaryDirectory() as d:
        copy = copy_tree(src, Path(d) / "model")
        log = sys.stderr if os.environ.get("SERVE_LOG") else subprocess.DEVNULL
        for cap in a.capacities:
            procs = {}
            try:
                for name, on in (("reuse", True), ("no_reuse", False)):
                    p, url, cmd = _start(copy, cap, on, a.prefill_chunk, log)
                    procs[name] = (p, url)
                    cmds[f"{cap}/{name}"] = "python " + " ".join(cmd[1:]).replace(str(copy), "MODEL").replace(
                        f"--port {url.rsplit(':', 1)[1]}", "--port PORT")
                for p, url in procs.values():
                    _wait(p, url)
                urls = {k: u for k, (_, u) in procs.items()}
                for url in urls.values():  # warm-up: the engine's caches and the kernels, both servers alike
                    asyncio.run(_stream_once(url, text[:64]))
                res = asyncio.run(_ttft_rounds(urls, tok, text, a_hist))
                import httpx

                eng = httpx.get(urls["reuse"] + "/health").json()["engine"] or {}
                rows.append({"capacity": cap, **res, "ratio": res["ttft_reuse_s"] / res["ttft_no_reuse_s"],
                             "engine": {k: eng.get(k) for k in ("capacity", "tier", "tier_choice", "kernel")},
                             "no_reuse_server_reused_tokens": _metric(urls["no_reuse"],
                                                                      "expertcache_prompt_tokens_reused_total")})
                print(json.dumps(rows[-1]), file=sys.stderr)
                if itl is None:
                    itl = {"capacity": cap, "long_prompt_tokens": long_len, "streams": a.streams,
                           "prefill_chunk": a.prefill_chunk,
                           **asyncio.run(_itl_rounds(urls["reuse"], text, long_len, a))}
                    print(json.dumps(itl), file=sys.stderr)
            finally:
                for p, _ in procs.values():
                    p.terminate()
                    p.wait(timeout=60)
    res = {"inputs": {"model": str(model), "context": ctx, "history_tokens": a.history, "answer_tokens": a.answer,
                      "question_tokens": a.question, "new_tokens": a.new, "rounds": a.rounds,
                      "long_prompt_asked": a.long, "long_prompt_tokens": long_len,
                      "server_commands": cmds, "engine_threads": 1, "cpu_count": os.cpu_count(),
                      "load_avg_at_start": load_start, "load_avg_at_end": os.getloadavg()},
           "rows": rows, "itl_p50_s": itl["itl_p50_s"], "itl_p99_during_prefill_s": itl["itl_p99_during_prefill_s"],
           "itl_ratio": itl["itl_p99_during_prefill_s"] / itl["itl_p50_s"], "chunked_prefill": itl,
           "targets": {"ratio_max": 0.2, "itl_ratio_max": 3.0},
           "targets_met": {"ratio": all(r["ratio"] <= 0.2 for r in rows),
                           "itl_ratio": itl["itl_p99_during_prefill_s"] / itl["itl_p50_s"] <= 3.0},
           "commit": prov["commit"], "dirty": prov["dirty"]}
    if out:
        res = write_result(out, res, config, command_line("bench prompt-cache", bench_prompt_cache, config),
                           provenance=prov)
    return res


async def _stream_once(url: str, prompt: list[int]) -> None:
    import httpx

    async with httpx.AsyncClient() as client:
        await _stream(client, url, prompt, 4)


