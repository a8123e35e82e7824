#!/usr/bin/env python
"""Honest evaluation of the learned eviction policy (issue 13): fit on one trace, score on another.

Reference Qwen3-30B-A3B routing (telemetry/reference/qwen3-30b-a3b-routing): fitted on code.npz and scored on
general.npz, and the reverse. Token semantics, one cache per layer, every layer, capacities 1/16, 1/8 and 1/4 of
E: hit rate of LRU, the learned policy and Belady, the learned policy's fraction of Belady, and the share of the
LRU-to-Belady gap it closes. A base model's validation -> test pair is added when `--base-fit/--base-test` name
two Parquet traces (or runs/*/trace-validation.parquet and trace-test.parquet exist).

Prints one JSON object and writes it to `--out` (default results/learned_policy.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from expertcache.telemetry.errors import nonnegative

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from expertcache.telemetry.cachesim import capacity_count, simulate  # noqa: E402
from expertcache.telemetry.learned_policy import fit, simulate_learned  # noqa: E402
from expertcache.telemetry.routing import load_routing  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REF = REPO / "telemetry" / "reference" / "qwen3-30b-a3b-routing"
FRACTIONS = (1 / 16, 1 / 8, 1 / 4)


def score(policy, trace: Path, fractions=FRACTIONS) -> dict:
    r = load_routing(trace)
    ids, probs, meta = r.ids, r.probs, r.meta
    policy.check_shape(meta["num_experts"], meta["top_k"], f"trace {trace}")
    e = meta["num_experts"]
    caps = [capacity_count(f, e) for f in fractions]
    t0 = time.perf_counter()
    learned = simulate_learned(policy, ids, caps, probs if policy.uses_probs else None, "layer")
    t_learned = time.perf_counter() - t0
    rows = []
    for c in caps:
        h = {}
        for pol in ("lru", "belady"):
            hits = acc = 0
            for layer in range(ids.shape[0]):
                r = simulate(ids[layer], c, pol, "token")
                hits, acc = hits + r.hits, acc + r.accesses
            h[pol] = hits / acc
        h["learned"] = learned[c]["hit_rate"]
        gap = h["belady"] - h["lru"]
        rows.append({"capacity": c, "capacity_frac": c / e, "hit_rate_lru": round(h["lru"], 4),
                     "hit_rate_learned": round(h["learned"], 4), "hit_rate_belady": round(h["belady"], 4),
                     "learned_of_belady": round(h["learned"] / h["belady"], 4),
                     "lru_of_belady": round(h["lru"] / h["belady"], 4),
                     "gap_closed": round((h["learned"] - h["lru"]) / gap, 4) if gap > 0 else None})
    return {"scored_on": str(trace), "layers": int(ids.shape[0]), "tokens": int(ids.shape[1]),
            "simulation_seconds": round(t_learned, 1), "scorer_cost": scorer_cost(policy, ids), "rows": rows}


def scorer_cost(policy, ids: np.ndarray, tokens: int = 200) -> dict:
    """The runtime's per-token cost of the scorer: `policy(pos, None, ids)` for every layer of `tokens` tokens."""
    policy.reset()
    n_l = ids.shape[0]
    t0 = time.perf_counter()
    for t in range(tokens):
        for i in range(n_l):
            policy(i, None, ids[i, t].tolist())
    dt = time.perf_counter() - t0
    policy.reset()
    return {"us_per_layer_call": round(1e6 * dt / (tokens * n_l), 1), "ms_per_token": round(1e3 * dt / tokens, 2),
            "layers": int(n_l), "threads": 1}


def pair(fit_on: Path, test_on: Path, seed: int) -> dict:
    t0 = time.perf_counter()
    pol = fit([fit_on], seed=seed)
    out = {"fitted_on": str(fit_on), "fit_seconds": round(time.perf_counter() - t0, 1), **score(pol, test_on)}
    print(json.dumps({"fitted_on": fit_on.name, "scored_on": test_on.name,
                      "gap_closed": {r["capacity"]: r["gap_closed"] for r in out["rows"]}}), file=sys.stderr)
    return out


def main() -> int:
    import torch

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=str(DEFAULT_REF), help="the reference folder (code.npz, general.npz)")
    ap.add_argument("--base-fit", default=None, help="our base's validation trace (Parquet)")
    ap.add_argument("--base-test", default=None, help="our base's test trace (Parquet)")
    ap.add_argument("--seed", type=nonnegative, default=0)
    ap.add_argument("--out", default=str(REPO / "results" / "learned_policy.json"))
    a = ap.parse_args()
    ref = Path(a.ref)
    if not (ref / "code.npz").is_file():
        print(f"reference data not found at {ref}", file=sys.stderr)
        return 2
    if (a.base_fit is None) != (a.base_test is None):
        print("learned_policy_eval: --base-fit and --base-test name a pair: give both or neither", file=sys.stderr)
        return 2
    for name, p in (("--base-fit", a.base_fit), ("--base-test", a.base_test)):
        if p is not None and not Path(p).is_file():  # checked before the reference fits, which take minutes
            print(f"learned_policy_eval: {name} {p}: no such trace", file=sys.stderr)
            return 2
    from expertcache.telemetry.provenance import provenance

    prov = provenance(REPO)
    res = {"what": "learned eviction policy vs LRU and Belady; fitted on one trace, scored on another; token "
                   "semantics, one cache per layer, all layers",
           "command": "python experiments/learned_policy_eval.py", **prov,
           "machine": {"threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()},
           "reference": []}
    res["reference"].append(pair(ref / "code.npz", ref / "general.npz", a.seed))
    res["reference"].append(pair(ref / "general.npz", ref / "code.npz", a.seed))
    base_fit, base_test = a.base_fit, a.base_test
    if base_fit is None:
        vals = sorted((REPO / "runs").glob("*/trace-validation.parquet"))
        tests = [v.with_name("trace-test.parquet") for v in vals]
        found = [(v, t) for v, t in zip(vals, tests) if t.is_file()]
        if found:
            base_fit, base_test = found[0]
    if base_fit and base_test:
        res["base"] = pair(Path(base_fit), Path(base_test), a.seed)
    else:
        res["base"] = ("not measured: no trained base model's validation and test traces here (runs/ has none; "
                       "`make quickstart` trains one and records them)")
    held = {f"{Path(p['fitted_on']).stem}->{Path(p['scored_on']).stem}": {r["capacity"]: r["gap_closed"] for r in
                                                                       p["rows"]} for p in res["reference"]}
    res["gap_closed_held_out"] = held
    out = json.dumps(res, indent=2)
    print(out)
    if a.out:
        from expertcache.runtime.bench.results import write_result

        write_result(a.out, res, config=vars(a))
    return 0


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
