"""What the engine's weight checks (`runtime/storage/weight_checks.py`: finite, magnitude against the siblings', on each
expert's first read) cost at decode time, as a share of TPOT, on the replay. Prints JSON.

The replay (`runtime/bench/replay.py`: the engine's own `run_layer`, a real routing trace, random experts of a real
shape in a store on disk, page cache bypassed) on-demand, passes alternated in one process on the same tokens:

- `off`: `--engine.integrity off`;
- `on_cold`: checks on, the checked-expert table cleared before the pass: every expert's first read in the pass is
  scanned (what a fresh process pays while it meets the model's experts: the worst case);
- `on_warm`: checks on, the table kept (steady state: an expert once checked is a table look-up).

Also `scan`: the scan of one expert's bytes, cold in memory (as an O_DIRECT read leaves them), timed in process, x
the experts read per token, against TPOT off: the work a check of every read would add, free of scheduling noise.

    python scripts/bench_integrity.py --layers 2 --tokens 48 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from expertcache.telemetry.errors import count, fraction, nonnegative



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="routing trace (default: the shipped Qwen3-30B-A3B code trace)")
    ap.add_argument("--expert-shape", default="2048x768", help="HIDDENxINTERMEDIATE (Qwen3-30B-A3B: 2048x768)")
    ap.add_argument("--layers", type=count, default=2, help="MoE layers replayed (the store: layers x E experts)")
    ap.add_argument("--capacity", type=fraction, default=0.25)
    ap.add_argument("--tier", default="disk")
    ap.add_argument("--tokens", type=count, default=48)
    ap.add_argument("--warmup", type=nonnegative, default=4)
    ap.add_argument("--rounds", type=count, default=3, help="off / on_cold / on_warm triples (order reversed every other round)")
    ap.add_argument("--store-dir", default="runs/stores")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    from expertcache.runtime.bench.harness import alternate, compare, tpot_figures
    from expertcache.runtime.bench.results import started, write_result

    prov = started()  # the code and the machine, before the work
    from expertcache.runtime.engine.config import EngineConfig
    from expertcache.runtime.bench.replay import REFERENCE_TRACE, ReplayConfig, Replayer, ensure_store, parse_shape
    from expertcache.runtime.storage.weight_checks import expert_checks, magnitudes
    from expertcache.telemetry.routing import load_routing

    r = load_routing(a.trace or REFERENCE_TRACE)
    hidden, inter = parse_shape(a.expert_shape)
    e = r.num_experts
    start = r.ids.shape[0] // 2 - a.layers // 2
    ids = r.ids[start:start + a.layers]
    cut = ids.shape[1] // 5  # the tokens after the first fifth, as the replay benchmark times them
    span = range(cut, cut + a.warmup + a.tokens)
    store = ensure_store(a.store_dir, a.layers, e, hidden, inter, "bfloat16")
    rp = Replayer(store, ids, EngineConfig(capacity=a.capacity, tier=a.tier))
    on_demand = ReplayConfig("on-demand")
    modes = ["off", "on_cold", "on_warm"]
    checks = None

    def one(mode: str, rnd: int) -> dict:  # one pass with the weight checks off, on from cold, or on and warm
        rp.cfg = replace(rp.cfg, integrity="off" if mode == "off" else "on")
        if mode == "on_cold":
            checks.checked[:] = False
        return rp.run(on_demand, span)

    try:
        rp.cfg = replace(rp.cfg, integrity="on")
        rp.run(on_demand, range(cut, cut + a.warmup))  # untimed: threads, files, the checks' start sample
        checks = expert_checks(rp.tier)
        runs = alternate(modes, a.rounds, one)  # off, on_cold, on_warm; reversed every other round
    finally:
        rp.close()
    tpot = {m: [t for x in v for t in x["times"][a.warmup:]] for m, v in runs.items()}
    loads = {m: sum(x["demand"] + x["prefetch"] for x in v) for m, v in runs.items()}
    toks = {m: sum(len(x["times"]) for x in v) for m, v in runs.items()}
    rounds = {m: [float(np.median(x["times"][a.warmup:])) for x in v] for m, v in runs.items()}
    # one expert's scan over bytes in no cache: a 256 MiB region of random bf16 weights walked once, expert by expert
    meta = rp.meta
    n_el = meta.expert_bytes // 2
    region = (torch.randn((256 << 20) // 2) * 0.02).to(torch.bfloat16)
    n = region.numel() // n_el
    t0 = time.perf_counter()
    for i in range(n):
        for t in meta.tensors:  # per tensor, as `ExpertChecks.check` scans a slot
            k = t.nbytes // 2
            magnitudes(region[i * n_el:i * n_el + k].view(1, -1))
    t_scan = (time.perf_counter() - t0) / n
    figures = tpot_figures(tpot)
    med = figures["tpot_median_s"]
    per_tok = loads["on_cold"] / max(toks["on_cold"], 1)
    out = {"inputs": {"trace": str(a.trace or REFERENCE_TRACE), "layers": a.layers, "num_experts": e,
                      "expert_shape": [hidden, inter], "expert_bytes": meta.expert_bytes, "capacity": a.capacity,
                      "tier": a.tier, "page_cache": rp.tier.describe().get("page_cache"), "tokens": a.tokens,
                      "warmup": a.warmup, "rounds": a.rounds, "torch_threads": torch.get_num_threads()},
           **figures,
           "tpot_round_medians_s": rounds, "on_cold_vs_off": compare(rounds["on_cold"], rounds["off"]),
           "on_warm_vs_off": compare(rounds["on_warm"], rounds["off"]),
           "experts_read_per_token": per_tok, "scan_s_per_expert_cold": t_scan,
           "scan_GBps_cold": meta.expert_bytes / t_scan / 1e9,
           "share_of_tpot": {"on_cold_ab": med["on_cold"] / med["off"] - 1, "on_warm_ab": med["on_warm"] / med["off"] - 1,
                             "scan_every_read": per_tok * t_scan / med["off"]},
           "commit": prov["commit"], "dirty": prov["dirty"]}
    print(json.dumps(out, indent=2))
    if a.out:
        write_result(a.out, out, config=vars(a), provenance=prov)


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
