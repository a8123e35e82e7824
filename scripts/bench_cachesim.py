#!/usr/bin/env python
"""Cache simulator speed: 1 M accesses through LRU and Belady (target: each under 10 s on 2 cores). Prints JSON.

Default input: the real Qwen3-30B-A3B routing (code domain, all 48 layers as one global-budget stream:
8000 tokens x 48 layers x top-8 = 3.07 M accesses, the first 1 M taken), else a seeded random trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from expertcache.telemetry.cachesim import global_steps, simulate

REF = Path(__file__).resolve().parents[1] / "telemetry" / "reference" / "qwen3-30b-a3b-routing" / "code.npz"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accesses", type=int, default=1_000_000)
    ap.add_argument("--capacity-frac", type=float, default=0.125, help="per-layer capacity as a fraction of E")
    a = ap.parse_args()
    if REF.is_file():
        ids = np.load(REF, allow_pickle=False)["experts"]  # [48, 8000, 8]
        e, source = 128, "qwen3-30b-a3b code.npz, global stream"
        steps = global_steps(ids, e)
        cap = int(round(a.capacity_frac * e)) * ids.shape[0]
    else:
        rng = np.random.default_rng(0)
        e, source = 128, "random"
        steps = rng.integers(0, e * 48, (a.accesses // 8 + 1, 8))
        cap = int(round(a.capacity_frac * e)) * 48
    steps = steps[: a.accesses // steps.shape[1]]
    out = {"benchmark": "cachesim", "input": source, "accesses": int(steps.size), "capacity": cap, "results": {}}
    for pol in ("lru", "belady"):
        for sem in ("token", "reference"):
            t = time.perf_counter()
            r = simulate(steps, cap, pol, sem)
            dt = time.perf_counter() - t
            out["results"][f"{pol}/{sem}"] = {"seconds": round(dt, 3), "hit_rate": round(r.hit_rate, 4),
                                              "accesses_per_s": round(r.accesses / dt)}
    out["target"] = "each under 10 s"
    out["pass"] = all(v["seconds"] < 10 for v in out["results"].values())
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
