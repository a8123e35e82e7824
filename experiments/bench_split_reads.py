"""A/B of split expert reads (one O_DIRECT read per expert vs four concurrent aligned pieces) through the engine's
own step, on-demand at a stated capacity, the reference trace's routing, passes alternated in one process.
Prints JSON.   python experiments/bench_split_reads.py [--capacity 0.125] [--rounds 3]"""

import argparse
import json
import sys

import numpy as np

from expertcache.runtime.storage import tiers
from expertcache.runtime.engine.config import EngineConfig
from expertcache.runtime.bench.harness import alternate, compare
from expertcache.runtime.bench.replay import REFERENCE_TRACE, ReplayConfig, Replayer, ensure_store
from expertcache.telemetry.routing import load_routing

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=float, default=0.125)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--store-dir", default="runs/stores")
    a = ap.parse_args()
    r = load_routing(REFERENCE_TRACE)
    ids, e = r.ids, r.num_experts
    ids = ids[21:27]
    store = ensure_store(a.store_dir, 6, e, 2048, 768, "bfloat16")
    rp = Replayer(store, ids, EngineConfig(capacity=a.capacity, tier="disk"))
    span = range(2000, 2000 + a.warmup + a.tokens)

    def one(mode: str, r: int) -> dict:
        tiers.SPLIT_MIN = 4 << 20 if mode == "split" else 1 << 62
        out = rp.run(ReplayConfig("on-demand"), span)
        return {"tpot": float(np.median(out["times"][a.warmup:])), "stall": out["stall"] / len(out["times"])}

    try:
        runs = alternate(["whole", "split"], a.rounds, one)
    finally:
        rp.close()
    res = {k: [x["tpot"] for x in v] for k, v in runs.items()}
    stall = {k: [x["stall"] for x in v] for k, v in runs.items()}
    print(json.dumps({"capacity": a.capacity, "tpot_median_s": res, "stall_per_token_s": stall,
                      "split_over_whole": [s / w for s, w in zip(res["split"], res["whole"])],
                      "split_vs_whole": compare(res["split"], res["whole"])}, indent=1))


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
