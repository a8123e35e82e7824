#!/usr/bin/env python
"""A/B of a change to the CPU expert kernels (runtime/kernels/csrc/experts_cpu.cpp): the working tree's source against the
same file at a git revision, built side by side (each in its own cached build folder), in alternated fresh
processes on the same inputs.

    python scripts/kernel_ab.py --base HEAD~1 --formats int4-g32,int4-g128 --pools 8,32 --rounds 5 --threads 1

For each format: `outputs_identical` (swiglu for 1 and 3 tokens and a 4096x2048 linear, both sources, compared bit
for bit) and, per pool size, the GB/s of one token through 8 experts of 2048x768 drawn at random from `pool` per call
(bench_kernels' expert figure: pool 32 streams from memory, pool 8 mostly from cache), the median over rounds of
each process's median over 200 calls; `speedup` is B's median over A's. Run it alone: a second busy process moves
these figures by 2-5x, and the rounds are printed so their spread shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from expertcache.telemetry.errors import count

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "runtime" / "kernels" / "csrc" / "experts_cpu.cpp"
FORMATS = {"int8-g32": (8, 32), "int4-g32": (4, 32), "int4-g64": (4, 64), "int4-g128": (4, 128)}


def child(src: str, build: str, mode: str, bits: int, group: int, pool: int, threads: int, out: str) -> None:
    """One process: build/load `src` as the extension, then either save outputs or print GB/s."""
    import torch
    from torch.utils import cpp_extension

    from expertcache.runtime.kernels import cpu_kernels as ck
    from expertcache.runtime.kernels import quant

    Path(build).mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name="expertcache_cpu", sources=[src], extra_cflags=ck.flags(), extra_ldflags=["-fopenmp"],
                       build_directory=build, is_python_module=False)
    ck._state.update(ok=True, why=None)
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    h, i, k = 2048, 768, 8
    gu = (torch.randn(pool, 2 * i, h, generator=g) * 0.02).bfloat16()
    dn = (torch.randn(pool, h, i, generator=g) * 0.02).bfloat16()
    x = torch.randn(3, h, generator=g).bfloat16()
    w = torch.rand(3, k, generator=g)
    qg, qd = quant.quantize(gu, bits, group), quant.quantize(dn, bits, group)
    if mode == "outputs":
        res = {}
        for t in (1, 3):
            s = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)])
            res[f"swiglu-{t}"] = ck.swiglu_q(x[:t], qg, qd, bits, group, s, w[:t])
        lin = quant.quantize((torch.randn(4096, h, generator=g) * 0.02).bfloat16(), bits, group)
        res["linear"] = ck.linear_q(x, lin["q"], lin["scales"], lin.get("mins"), bits, group)
        from expertcache.telemetry.atomic import atomic_open

        with atomic_open(out) as f:
            torch.save(res, f)
        print(json.dumps({"outputs": out}))
        return
    nbytes = k * (quant.nbytes(qg) + quant.nbytes(qd)) // pool
    times = []
    for r in range(203):
        s = torch.randperm(pool, generator=g)[:k][None]
        t0 = time.perf_counter()
        ck.swiglu_q(x[:1], qg, qd, bits, group, s, w[:1])
        if r >= 3:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"gbps": nbytes / statistics.median(times) / 1e9}))


def run(src, build, mode, bits, group, pool, threads, out="") -> dict:
    """One child (`runner.run_child`, the page cache kept), its arguments crossing as a YAML file."""
    import tempfile

    from expertcache.runtime.bench.runner import run_child, write_config

    d = Path(tempfile.mkdtemp(prefix="kernel-ab-child-"))
    cfg = write_config(d / "child.yaml", {"src": src, "build": build, "mode": mode, "bits": bits, "group": group,
                                          "pool": pool, "threads": threads, "out": out})
    r = run_child([sys.executable, __file__, "--child"], cfg, d / "child.log", drop_caches=False)
    if "error" in r:
        raise SystemExit(f"kernel_ab: a child failed: {r['error']}")
    return r if mode == "time" else {}


def main(argv: list[str] | None = None) -> int | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of A (B is the working tree)")
    ap.add_argument("--formats", default="int4-g32,int4-g128")
    ap.add_argument("--pools", default="8,32")
    ap.add_argument("--rounds", type=count, default=5)
    ap.add_argument("--threads", type=count, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        from expertcache.runtime.bench.runner import read_config

        return child(**read_config(a.child))
    bad = [f for f in a.formats.split(",") if f not in FORMATS]
    if bad or not a.formats:
        print(f"kernel_ab: --formats {a.formats}: expected a subset of {','.join(FORMATS)}", file=sys.stderr)
        return 2
    import torch

    from expertcache.runtime.kernels.cpu_kernels import cache_dir
    from expertcache.telemetry.atomic import write_text

    from expertcache.runtime.bench.harness import alternate, claimed
    from expertcache.runtime.bench.results import started, write_result
    from expertcache.telemetry.provenance import rev_parse

    prov = started()  # B's code (the working tree) and the machine, before the work
    rev = rev_parse(a.base, ROOT)
    if not rev:
        print(f"kernel_ab: {a.base!r} names no commit in {ROOT}", file=sys.stderr)
        return 2
    base_src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:runtime/kernels/csrc/experts_cpu.cpp"],
                              capture_output=True, text=True, check=True).stdout
    tmp = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    write_text(tmp / "a.cpp", base_src)
    builds = cache_dir().parent
    sides = {"A": (str(tmp / "a.cpp"), str(builds / f"ab-{rev}")), "B": (str(SRC), str(builds / "ab-worktree"))}
    rows = []
    for fmt in a.formats.split(","):
        bits, group = FORMATS[fmt]
        outs = {}
        for side, (src, build) in sides.items():
            run(src, build, "outputs", bits, group, 8, a.threads, str(tmp / f"{side}.pt"))
            outs[side] = torch.load(tmp / f"{side}.pt")
        same = all(torch.equal(outs["A"][key], outs["B"][key]) for key in outs["A"])
        for pool in (int(p) for p in a.pools.split(",")):
            r = alternate(["A", "B"], a.rounds,  # the order swapped every round
                          lambda side, i: run(*sides[side], "time", bits, group, pool, a.threads)["gbps"])
            ma, mb = statistics.median(r["A"]), statistics.median(r["B"])
            rows.append({"format": fmt, "pool": pool, "threads": a.threads, "outputs_identical": same,
                         "gbps_A": ma, "gbps_B": mb, "speedup": mb / ma, "rounds_A": r["A"], "rounds_B": r["B"],
                         "claimed": claimed(r["B"], r["A"])})
            print(f"{fmt} pool {pool}: A {ma:.2f} GB/s, B {mb:.2f} GB/s ({mb / ma:.3f}x); outputs identical: {same}",
                  file=sys.stderr)
    res = {"command": " ".join(["python", "scripts/kernel_ab.py", *sys.argv[1:]]), "A": f"git {rev}",
           "B": "working tree", "rows": rows}
    if a.out:
        res = write_result(a.out, res, config=vars(a), command=res["command"], provenance=prov)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
