#!/usr/bin/env python
"""Expert compute at memory speed, against llama.cpp on the same weights. Prints JSON and writes
`results/kernels.json` (`--out`).

    python scripts/bench_kernels.py --model /work/ckpt/q30-4l --threads 1,2 --rounds 3

- `kernels`: one token through 8 experts of 2048x768 (Qwen3-30B-A3B's expert shape), drawn at random from 32 per
  call so the weights come from memory, not cache: bytes of the 8 experts / median time, per format (bf16, int8,
  int4; group 32) and thread count, beside this machine's memory read bandwidth at that thread count (the
  extension's streaming read of 1 GiB, median of 5). Target: >= 0.7 of it at one thread.
- `pairs` (with `--model`, a bf16 Hugging Face checkpoint with its tokenizer): the model decoded with every expert
  resident (`load(..., engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))`, greedy decode through the decode loop of generate and
  serve (`generate.timed_greedy`), time per output token = the N decode steps after the prefill / N), against
  `llama-bench -p 0 -n N` on the GGUF conversion of the same weights (`scripts/llamacpp_peer.py`): bf16 vs BF16,
  int8 vs Q8_0, int4 vs Q4_0. Our int8/int4 checkpoints come from `expertcache quantize --linears true` (routed
  experts and the attention and output matrices packed, as llama-quantize packs every matrix; the routers stay
  exact; `--linears false`: experts only, as before). Each round runs every (format, threads) pair, ours then
  theirs, in fresh processes; the figure is the median over rounds (`round_ratios`: each round's ours / theirs, and
  `expertcache_read_bandwidth_gbps`: each of our processes' memory read bandwidth, measured in it after its timed
  runs). Target: ours <= 1.25x theirs in each pair.
- `--conditions alone,memory-contended`: each figure also taken while a second process streams memory on the other
  core (numpy copies of 512 MiB arrays, a fair stand-in for a host with less memory bandwidth); this process and its
  children are pinned to the first core meanwhile, so the contended condition is measured at one thread. Every
  kernel row and pair says its `condition`, and each kernel row carries the read bandwidth measured under it.
Run it alone: a second busy process moves these figures by 2-5x.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from expertcache.telemetry.errors import count

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

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


def kernel_figures(threads: int, pool: int = 32, k: int = 8, rounds: int = 30) -> list[dict]:
    import torch

    from expertcache.runtime.kernels import cpu_kernels as ck
    from expertcache.runtime.kernels import quant

    if not ck.available():
        raise SystemExit(f"bench_kernels: the CPU kernels are unavailable here ({ck.why_unavailable()})")
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

    for fmt, spec in FORMATS.items():
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
    for fmt, spec in FORMATS.items():
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
    r = run_child([sys.executable, __file__, "--worker"], cfg, d / "worker.log", drop_caches=False)
    if "error" in r:
        raise SystemExit(f"bench_kernels: the decode worker failed: {r['error']}")
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


def _bad(msg: str) -> None:
    """Bad input: one line, exit 2."""
    print(msg, file=sys.stderr)
    raise SystemExit(2)


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
            raise SystemExit("bench_kernels: --conditions memory-contended needs two cores (one for the streaming "
                             "process)")
        self.saved = set(cpus)
        os.sched_setaffinity(0, {cpus[0]})
        self.proc = subprocess.Popen([sys.executable, "-c", STREAMER % (cpus[1], self.elements)],
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "streaming":  # '' when it died before streaming
            self.proc.wait()
            raise SystemExit(f"bench_kernels: the memory-streaming process exited ({self.proc.returncode})")
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        if self.saved is not None:
            os.sched_setaffinity(0, self.saved)
        return False


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="bf16 checkpoint (with tokenizer) for the decode pairs; none: kernels only")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=count, default=3)
    ap.add_argument("--tokens", type=count, default=32)
    ap.add_argument("--reps", type=count, default=3)
    ap.add_argument("--depth", type=int, default=0,
                    help="tokens already in the context when decode starts (ours: the prompt's length, at least 8; "
                         "llama-bench -d): long contexts time the attention over the KV cache")
    ap.add_argument("--linears", default="true", choices=["true", "false"],
                    help="int8/int4: pack the non-expert linears too (as llama.cpp's Q8_0/Q4_0 do)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="comma-separated subset of " + ",".join([*FORMATS, *FILE_FORMATS]) + " (q8_0-file / "
                         "q4_0-file: llama.cpp's own GGUF imported with `expertcache import-gguf`)")
    ap.add_argument("--kernels", default="true", choices=["true", "false"],
                    help="measure the kernels alone (false: only the decode pairs)")
    ap.add_argument("--conditions", default="alone",
                    help="comma-separated: alone, memory-contended (a second process streaming memory on the other "
                         "core; one thread only)")
    ap.add_argument("--prefetch_sweep", choices=["true", "false"], default="false",
                    help="also time the int8 and int4 kernels under every prefetch distance the first-use tuning "
                         "chooses from (`cpu_kernels.measure_prefetch`, one thread, 7 alternated rounds), in each "
                         "condition: what this machine's tuning.json chose, and what a slower memory would")
    ap.add_argument("--work", default="runs/bench-kernels", help="where quantized copies of --model are kept")
    ap.add_argument("--out", default=str(ROOT / "results" / "kernels.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        threads = [int(t) for t in a.threads.split(",")]
    except ValueError:
        threads = []
    if not threads or min(threads) < 1:
        _bad(f"bench_kernels: --threads {a.threads}: expected thread counts >= 1, comma-separated (e.g. 1,2)")
    formats = [f for f in a.formats.split(",") if f]
    if not formats or any(f not in FORMATS and f not in FILE_FORMATS for f in formats):
        _bad(f"bench_kernels: --formats {a.formats}: expected a subset of {','.join([*FORMATS, *FILE_FORMATS])}")
    conditions = [c for c in a.conditions.split(",") if c]
    if not conditions or any(c not in CONDITIONS for c in conditions):
        _bad(f"bench_kernels: --conditions {a.conditions}: expected a subset of {','.join(CONDITIONS)}")

    def threads_in(cond: str) -> list[int]:  # the contended condition pins this process to one core
        return threads if cond == "alone" else [t for t in threads if t == 1]

    if a.worker:
        from expertcache.runtime.bench.runner import read_config

        print(json.dumps(worker(**read_config(a.worker))))
        return
    t_start = time.time()
    from expertcache.runtime.bench.results import started, write_result

    prov = started()  # the code and the machine, before the work
    kernels = []
    for cond in conditions if a.kernels == "true" else []:
        with Condition(cond):
            kernels += [{**row, "condition": cond} for t in threads_in(cond) for row in kernel_figures(t)]
    for row in kernels:
        print(json.dumps(row), file=sys.stderr, flush=True)
    sweep = {}
    if a.prefetch_sweep == "true":
        from expertcache.runtime.kernels import cpu_kernels as ck

        for cond in conditions:
            with Condition(cond):
                sweep[cond] = ck.measure_prefetch(rounds=7)
            print(json.dumps({cond: {f: m["best"] for f, m in sweep[cond].items()}}), file=sys.stderr, flush=True)
    pairs = []
    model_info = None
    if a.model:
        import llamacpp_peer

        model = Path(a.model).resolve()
        work = Path(a.work)
        paths = {f: quantized(model, f, work, a.linears == "true") for f in formats}
        runs: dict[tuple[str, int], dict] = {}
        peer_runs: dict[tuple[int, int, str], dict] = {}
        from expertcache.runtime.bench.harness import order

        def pair_round(runs, peer_runs, cond, r, t, f):
            """One round of format `f` at `t` threads: ours and llama.cpp's in the harness's order (reversed every
            other round), one llama.cpp run per (condition, round, threads, its format)."""
            key = (cond, r, t, PEER[f])
            for arm in order(["ours", "peer"], r):
                if arm == "ours":
                    mine = ours(str(paths[f]), t, a.tokens, a.reps, a.depth)
                elif key not in peer_runs:
                    peer_runs[key] = llamacpp_peer.decode(model, PEER[f], t, a.tokens, a.reps, depth=a.depth)
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
                for r in range(a.rounds):
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
                          "expertcache_linears_packed": f in FILE_FORMATS or (f != "bf16" and a.linears == "true"),
                          "depth": a.depth})
        cfg = json.loads((model / "config.json").read_text())
        model_info = {k: cfg.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size", "num_experts",
                                              "moe_intermediate_size", "num_experts_per_tok", "vocab_size",
                                              "num_attention_heads", "num_key_value_heads", "head_dim")}
    one = [k for k in kernels if k["threads"] == 1 and "kind" not in k]  # the target is on the experts

    def tag(cond: str) -> str:
        return "" if cond == "alone" else f"/{cond}"
    res = {
        "command": "python scripts/bench_kernels.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        # the kernels' prefetch settings in force (this machine's tuning.json, chosen at first use; every child
        # process reads the same file), and where they came from
        "tuning": _tuning(),
        "model": model_info, "tokens": a.tokens, "depth": a.depth, "rounds": a.rounds,
        "seconds": round(time.time() - t_start, 1),
        "kernels": kernels, "pairs": pairs, **({"prefetch_sweep": sweep} if sweep else {}),
        "targets": {"kernel_fraction_one_thread": 0.7, "tpot_ratio": 1.25},
        "pass": {"kernels": {k["format"] + tag(k["condition"]): k["fraction_of_read_bandwidth"] >= 0.7 for k in one},
                 "pairs": {f"{p['format']}@{p['threads']}{tag(p['condition'])}": p["ratio"] <= 1.25 for p in pairs}},
    }
    res = write_result(a.out, res, config=vars(a), command=res["command"], provenance=prov)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
