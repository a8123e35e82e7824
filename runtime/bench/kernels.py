"""`expertcache bench kernels`: expert compute at memory speed, and decode against llama.cpp on the same weights."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from expertcache.telemetry.errors import InputError, check_count_list, check_counts

# (bits, group[, symmetric]). int4 group 32 stores a minimum beside each scale: 5 bits per weight against Q4_0's
# 4.5; int4-sym is Q4_0's own layout (one scale, no minimum: 4.5 bits); int4-g128 4.25 bits
FORMATS = {"bf16": None, "int8": (8, 32), "int4": (4, 32), "int4-sym": (4, 32, True), "int4-g128": (4, 128)}
PEER = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0", "int4-sym": "q4_0", "int4-g128": "q4_0",
        "q8_0-file": "q8_0", "q4_0-file": "q4_0"}
# llama.cpp's own file, read by `expertcache import-gguf`: both sides decode the same expert and attention bytes
FILE_FORMATS = {"q8_0-file": "q8_0", "q4_0-file": "q4_0"}


def _spec(spec) -> tuple[int, int, bool]:
    """(bits, group, symmetric) of a FORMATS entry."""
    bits, group, *rest = spec
    return bits, group, bool(rest and rest[0])


def _tuning() -> dict | None:
    from expertcache.runtime.kernels import cpu_kernels as ck

    return ck.tuning() or None


def kernel_figures(threads: int, pool: int = 32, k: int = 8, rounds: int = 30, formats=tuple(FORMATS)) -> list[dict]:
    import torch

    from expertcache.runtime.kernels import cpu_kernels as ck
    from expertcache.runtime.kernels import quant

    if not ck.available():
        raise InputError(f"the CPU kernels are unavailable here ({ck.why_unavailable()})")
    torch.set_num_threads(threads)
    H, I = 2048, 768
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(pool, 2 * I, H, generator=g) * 0.02).bfloat16()
    dn = (torch.randn(pool, H, I, generator=g) * 0.02).bfloat16()
    x = torch.randn(1, H, generator=g).bfloat16()
    w = torch.rand(1, k, generator=g)
    bw = ck.read_bandwidth(1 << 30)
    out = []

    def measure(fn, args, nbytes: int, fmt: str, spec, **kind) -> None:
        """A row: the median of `rounds` timed calls `fn(*args(r))` after 3 untimed ones (`args` is not timed)."""
        times = []
        for r in range(rounds + 3):
            a = args(r)
            t0 = time.perf_counter()
            fn(*a)
            if r >= 3:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        out.append({**kind, "format": fmt, "group": None if spec is None else spec[1], "threads": threads,
                    "bytes": nbytes, "ms": t * 1e3, "gbps": nbytes / t / 1e9, "read_bandwidth_gbps": bw / 1e9,
                    "fraction_of_read_bandwidth": nbytes / t / bw})

    def draw(r):  # k experts of the pool, drawn anew each call
        return (torch.randperm(pool, generator=g)[:k][None],)

    for fmt, spec in ((f, x) for f, x in FORMATS.items() if f in formats):
        if spec is None:
            nbytes = k * 3 * H * I * 2
            call = lambda s: ck.swiglu_bf16(x, gu, dn, s, w)  # noqa: E731
        else:
            bits, group, sym = _spec(spec)
            qg, qd = quant.quantize(gu, bits, group, sym), quant.quantize(dn, bits, group, sym)
            nbytes = k * (quant.nbytes(qg) + quant.nbytes(qd)) // pool
            call = lambda s, qg=qg, qd=qd, b=bits, gr=group: ck.swiglu_q(x, qg, qd, b, gr, s, w)  # noqa: E731
        measure(call, draw, nbytes, fmt, spec)
    # a non-expert matrix: one token through the attention's query projection (4096 x 2048), 8 copies in turn so
    # the weights come from memory
    ws = [(torch.randn(4096, H, generator=g) * 0.02).bfloat16() for _ in range(8)]
    for fmt, spec in ((f, x) for f, x in FORMATS.items() if f in formats):
        if spec is None:
            calls = [lambda w=w: ck.linear_bf16(x, w) for w in ws]
            nbytes = ws[0].numel() * 2
        else:
            bits, group, sym = _spec(spec)
            qs = [quant.quantize(w, bits, group, sym) for w in ws]
            calls = [lambda q=q, b=bits, gr=group: ck.linear_q(x, q["q"], q["scales"], q.get("mins"), b, gr)
                     for q in qs]
            nbytes = quant.nbytes(qs[0])
        measure(lambda i: calls[i](), lambda r: (r % len(calls),), nbytes, fmt, spec, kind="linear 4096x2048")
    return out


def worker(model: str, threads: int, tokens: int, reps: int, depth: int = 0) -> dict:
    """One process: load, warm up, time greedy decode `reps` times (fresh prompts of max(8, depth) tokens)."""
    import torch

    from expertcache.runtime import EngineConfig, load

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    m = load(model, verify=False, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    load_s = time.perf_counter() - t0

    from expertcache.runtime.serve.generate import timed_greedy

    def tpot(n, seed):  # the decode loop of generate and serve; its clock excludes the prefill
        ids = torch.randint(2, 4000, (1, max(8, depth)), generator=torch.Generator().manual_seed(seed))
        times, _, _ = timed_greedy(m, ids, n + 1)
        return (times[-1] - times[0]) / n

    tpot(4, 0)  # warm-up
    tp = [tpot(tokens, r + 1) for r in range(reps)]
    # this process's memory read bandwidth at its thread count, right after the timed runs: on a shared host it
    # moves between states (about 50 against 80 GB/s at two threads here, per process), which a round's figure
    # then carries; kept beside each round so the spread has its cause in the JSON
    from expertcache.runtime.kernels import cpu_kernels as ck

    bw = ck.read_bandwidth(512 << 20, rounds=3) / 1e9 if ck.available() else None
    return {"tpot_s": statistics.median(tp), "tpot_runs_s": tp, "load_s": load_s, "read_bandwidth_gbps": bw}


def ours(model: str, threads: int, tokens: int, reps: int = 3, depth: int = 0) -> dict:
    """One decode worker in a process of its own (`runner.run_child`, the page cache kept: a kernel figure is from
    memory), its arguments crossing as a YAML file."""
    import tempfile

    from expertcache.runtime.bench.runner import run_child, write_config

    d = Path(tempfile.mkdtemp(prefix="bench-kernels-"))
    cfg = write_config(d / "worker.yaml", {"model": model, "threads": threads, "tokens": tokens, "reps": reps,
                                           "depth": depth})
    r = run_child("expertcache.runtime.bench.kernels", cfg, d / "worker.log", drop_caches=False)
    if "error" in r:
        raise InputError(f"the decode worker failed on {model}: {r['error']}")  # (its log kept)
    import shutil

    shutil.rmtree(d, ignore_errors=True)
    return r


def quantized(model: Path, fmt: str, work: Path, linears: bool) -> Path:
    if fmt in FILE_FORMATS:  # the GGUF llama.cpp decodes (its converter, llama-quantize), imported as it is
        out = work / f"{model.name}-{fmt}"
        if not (out / "config.json").exists():
            from expertcache.runtime.bench import llamacpp
            from expertcache.runtime.kernels.gguf_import import import_gguf

            src = llamacpp.source_dir()
            import_gguf(llamacpp.gguf(model, FILE_FORMATS[fmt], src, llamacpp.build(src)), out)
        return out
    if FORMATS[fmt] is None:
        return model
    bits, group, sym = _spec(FORMATS[fmt])
    out = work / f"{model.name}-int{bits}-g{group}{'-sym' if sym else ''}{'-linears' if linears else ''}"
    if not (out / "config.json").exists():
        from expertcache.runtime.kernels.quant_write import write_quantized

        write_quantized(model, out, bits, group, linears=linears, symmetric=sym)
    return out


CONDITIONS = ("alone", "memory-contended")
# Says "streaming" once its arrays are written and the first copy is done: the condition starts from there.
STREAMER = ("import os, numpy as np\nos.sched_setaffinity(0, {%d})\na = np.ones(%d); b = np.empty_like(a)\n"
            "np.copyto(b, a)\nprint('streaming', flush=True)\nwhile True:\n    np.copyto(b, a)\n")


class Condition:
    """`with Condition(name):` the measurements inside run under it: `alone` changes nothing; `memory-contended`
    starts a process streaming memory on the second core (`STREAMER`) and pins this process (and the processes it
    starts) to the first, until the block ends. The streamer copies arrays of `elements` float64 (512 MiB each by
    default: far beyond any cache; a test passes fewer, to start faster)."""

    def __init__(self, name: str, elements: int = 1 << 26):
        self.name, self.proc, self.saved, self.elements = name, None, None, elements

    def __enter__(self):
        if self.name == "alone":
            return self
        import subprocess

        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise InputError("--conditions memory-contended needs two cores (one for the streaming process)")
        self.saved = set(cpus)
        os.sched_setaffinity(0, {cpus[0]})
        self.proc = subprocess.Popen([sys.executable, "-c", STREAMER % (cpus[1], self.elements)],
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "streaming":  # '' when it died before streaming
            self.proc.wait()
            raise RuntimeError(f"bench kernels: the memory-streaming process exited ({self.proc.returncode})")
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        if self.saved is not None:
            os.sched_setaffinity(0, self.saved)
        return False


def bench_kernels(model: Optional[str] = None, threads: list[int] = [1, 2], rounds: int = 3, tokens: int = 32,
                  reps: int = 3, depth: int = 0, linears: bool = True, formats: list[str] = list(FORMATS),
                  kernels: bool = True, conditions: list[str] = ["alone"], prefetch_sweep: bool = False,
                  work: str = "runs/bench-kernels", out: Optional[str] = None) -> dict:
    """Expert compute at memory speed, and decode against llama.cpp on the same weights.

    `kernels`: one token through 8 experts of 2048x768 (Qwen3-30B-A3B's expert shape), drawn at random from 32 per
    call so the weights come from memory: bytes of the 8 experts / median time, per format of `--formats` (bf16,
    int8, int4 group 32, ...) and thread count, beside this machine's memory read bandwidth at that thread count (1 GiB streamed, median
    of 5). Target: >= 0.7 of it at one thread. `pairs` (with `--model`, a bf16 Hugging Face checkpoint with its
    tokenizer): the model decoded with every expert resident (capacity 1.0, host tier, kernel cpu) through the
    decode loop of generate and serve, time per output token = the N decode steps after the prefill / N, against
    `llama-bench -p 0 -n N` on the GGUF conversion of the same weights: bf16 vs BF16, int8 vs Q8_0, int4 vs Q4_0
    (our packed copies from `expertcache quantize --linears true`, as llama-quantize packs every matrix; the routers
    stay exact). Each round runs every (format, threads) pair, ours then theirs in the harness's order, in fresh
    processes; the figure is the median over rounds (`round_ratios`: each round's ours / theirs). Target: ours <=
    1.25x theirs in each pair. `--conditions [alone,memory-contended]`: each figure also taken while a second
    process streams memory on the other core (a stand-in for a host with less memory bandwidth), this process
    pinned to the first core meanwhile (one thread). Run it alone: a second busy process moves these figures 2-5x.

    Args:
        model: bf16 checkpoint (with tokenizer) for the decode pairs; none: the kernels only
        threads: thread counts
        rounds: rounds of the decode pairs
        tokens: tokens decoded per timed run
        reps: timed runs per process (their median is the round's figure)
        depth: tokens already in the context when decode starts (ours: the prompt's length, at least 8;
            llama-bench -d): long contexts time the attention over the KV cache
        linears: int8/int4: pack the non-expert linears too (as llama.cpp's Q8_0/Q4_0 do)
        formats: a subset of bf16, int8, int4, int4-sym, int4-g128, q8_0-file, q4_0-file (the last two:
            llama.cpp's own GGUF imported with `expertcache import-gguf`)
        kernels: measure the kernels alone (false: only the decode pairs)
        conditions: alone, memory-contended (a second process streaming memory on the other core; one thread only)
        prefetch_sweep: also time the int8 and int4 kernels under every prefetch distance the first-use tuning
            chooses from (one thread, 7 alternated rounds), in each condition
        work: where quantized copies of --model are kept
        out: also write the JSON here
    """
    config = dict(locals())
    from expertcache.telemetry.atomic import check_output

    from expertcache.runtime.bench.results import command_line, started, write_result

    check_count_list("threads", threads, "thread", "[1,2]")
    if not formats or any(f not in FORMATS and f not in FILE_FORMATS for f in formats):
        raise InputError(f"--formats {formats}: expected a subset of {','.join([*FORMATS, *FILE_FORMATS])}")
    if not conditions or any(c not in CONDITIONS for c in conditions):
        raise InputError(f"--conditions {conditions}: expected a subset of {','.join(CONDITIONS)}")
    check_counts(("depth",), rounds=rounds, tokens=tokens, reps=reps, depth=depth)
    if not kernels and model is None:
        raise InputError("nothing to measure: --kernels false and no --model (the decode pairs need one)")
    if "memory-contended" in conditions:
        if 1 not in threads:
            raise InputError(f"--conditions [memory-contended] runs at one thread; --threads {threads} has no 1")
        if len(os.sched_getaffinity(0)) < 2:
            raise InputError("--conditions memory-contended needs two cores (one for the streaming process)")
    if model is not None:
        from expertcache.telemetry.hf import load_config

        load_config(model)  # a checkpoint, before any build, conversion or timed run
    check_output(out, model)

    def threads_in(cond: str) -> list[int]:  # the contended condition pins this process to one core
        return threads if cond == "alone" else [t for t in threads if t == 1]

    t_start = time.time()
    prov = started()  # the code and the machine, before the work
    krows = []
    for cond in conditions if kernels else []:
        with Condition(cond):
            krows += [{**row, "condition": cond} for t in threads_in(cond)
                      for row in kernel_figures(t, formats=formats)]
    for row in krows:
        print(json.dumps(row), file=sys.stderr, flush=True)
    sweep = {}
    if prefetch_sweep:
        from expertcache.runtime.kernels import cpu_kernels as ck

        for cond in conditions:
            with Condition(cond):
                sweep[cond] = ck.measure_prefetch(rounds=7)
            print(json.dumps({cond: {f: m["best"] for f, m in sweep[cond].items()}}), file=sys.stderr, flush=True)
    pairs = []
    model_info = None
    if model:
        from expertcache.runtime.bench import llamacpp

        model_dir = Path(model).resolve()
        paths = {f: quantized(model_dir, f, Path(work), linears) for f in formats}
        runs: dict[tuple[str, int], dict] = {}
        peer_runs: dict[tuple[int, int, str], dict] = {}
        from expertcache.runtime.bench.harness import order

        def pair_round(runs, peer_runs, cond, r, t, f):
            """One round of format `f` at `t` threads: ours and llama.cpp's in the harness's order (reversed every
            other round), one llama.cpp run per (condition, round, threads, its format)."""
            key = (cond, r, t, PEER[f])
            for arm in order(["ours", "peer"], r):
                if arm == "ours":
                    mine = ours(str(paths[f]), t, tokens, reps, depth)
                elif key not in peer_runs:
                    peer_runs[key] = llamacpp.decode(model_dir, PEER[f], t, tokens, reps, depth=depth)
            peer = peer_runs[key]
            d = runs.setdefault((f, t, cond), {"ours": [], "peer": [], "peer_stddev_tok_s": [], "bw": []})
            d["ours"].append(mine["tpot_s"])
            d["bw"].append(mine.get("read_bandwidth_gbps"))
            d["peer"].append(peer["tpot_s"])
            d["peer_stddev_tok_s"].append(peer["tok_s_stddev"])
            d["peer_build"], d["peer_gguf_bytes"] = peer["build"], peer["gguf_bytes"]
            print(json.dumps({"condition": cond, "round": r, "format": f, "threads": t,
                              "expertcache_tpot_s": mine["tpot_s"], "llamacpp_tpot_s": peer["tpot_s"],
                              "expertcache_read_bandwidth_gbps": mine.get("read_bandwidth_gbps")}),
                  file=sys.stderr, flush=True)

        for cond in conditions:
            with Condition(cond):
                for r in range(rounds):
                    for t in threads_in(cond):
                        for f in formats:
                            pair_round(runs, peer_runs, cond, r, t, f)
        from expertcache.runtime.bench.harness import claimed

        for (f, t, cond), d in runs.items():
            e, p = statistics.median(d["ours"]), statistics.median(d["peer"])
            pairs.append({"format": f, "llamacpp_format": PEER[f].upper(), "threads": t, "condition": cond,
                          "expertcache_tpot_s": e,
                          "llamacpp_tpot_s": p, "ratio": e / p, "expertcache_rounds_s": d["ours"],
                          "llamacpp_rounds_s": d["peer"], "round_ratios": [x / y for x, y in zip(d["ours"], d["peer"])],
                          "claimed": claimed(d["ours"], d["peer"]),
                          "expertcache_read_bandwidth_gbps": d["bw"], "llamacpp_build": d["peer_build"],
                          "llamacpp_gguf_bytes": d["peer_gguf_bytes"],
                          "expertcache_checkpoint": str(paths[f].name),
                          "expertcache_linears_packed": f in FILE_FORMATS or (f != "bf16" and linears),
                          "depth": depth})
        cfg = json.loads((model_dir / "config.json").read_text())
        model_info = {k: cfg.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size", "num_experts",
                                              "moe_intermediate_size", "num_experts_per_tok", "vocab_size",
                                              "num_attention_heads", "num_key_value_heads", "head_dim")}
    one = [k for k in krows if k["threads"] == 1 and "kind" not in k]  # the target is on the experts

    def tag(cond: str) -> str:
        return "" if cond == "alone" else f"/{cond}"
    res = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        # the kernels' prefetch settings in force (this machine's tuning.json, chosen at first use; every child
        # process reads the same file), and where they came from
        "tuning": _tuning(),
        "model": model_info, "tokens": tokens, "depth": depth, "rounds": rounds,
        "seconds": round(time.time() - t_start, 1),
        "kernels": krows, "pairs": pairs, **({"prefetch_sweep": sweep} if sweep else {}),
        "targets": {"kernel_fraction_one_thread": 0.7, "tpot_ratio": 1.25},
        "pass": {"kernels": {k["format"] + tag(k["condition"]): k["fraction_of_read_bandwidth"] >= 0.7 for k in one},
                 "pairs": {f"{p['format']}@{p['threads']}{tag(p['condition'])}": p["ratio"] <= 1.25 for p in pairs}},
    }
    if out:
        res = write_result(out, res, config, command_line("bench kernels", bench_kernels, config), provenance=prov)
    return res


def main() -> int:
    """A decode worker (`ours`): `python -m expertcache.runtime.bench.kernels CONFIG.yaml` prints its JSON."""
    from expertcache.runtime.bench.runner import read_config

    print(json.dumps(worker(**read_config(sys.argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
