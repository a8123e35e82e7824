#!/usr/bin/env python
"""Check the analysis against the published Qwen3-30B-A3B routing tables (telemetry/reference/..., shipped).

Imports both NumPy traces into Parquet with `expertcache trace import`'s code, then:
- the layer-24 cache table: every (policy, capacity) row of cache_{code,general}.csv under the reference
  semantics (relative error of demand misses per token), with our token-granularity hit rate beside it;
- reuse@lag1 and chance per layer against stickiness.csv (lag 1);
- experts needed for 90/95/99% coverage per layer against working_set.csv.
Prints one JSON object; `--out FILE` also writes it (with the commit and configuration).

`--ours TOKEN REFERENCE`: two `expertcache analyze` summaries of one of your own traces (`summary.json`, token and
reference semantics) whose figures go beside Qwen's, the same figures taken the same way (the generated table of
docs/telemetry.md: `--ours runs/routing/token/summary.json runs/routing/reference/summary.json --out
results/routing_vs_qwen.json`).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from expertcache.telemetry.analysis import coverage, reuse_lag1
from expertcache.telemetry.cachesim import simulate
from expertcache.telemetry.llamacpp import import_trace
from expertcache.telemetry.parquet_trace import read_trace

DEFAULT_REF = Path(__file__).resolve().parents[1] / "telemetry" / "reference" / "qwen3-30b-a3b-routing"


def cache_table(ids_layer: np.ndarray, csv_path: Path) -> list[dict]:
    k = ids_layer.shape[1]
    cut = int(0.2 * len(ids_layer))  # static: pin the most frequent of the first 20% of tokens, score all
    rows = []
    for r in csv.DictReader(csv_path.open()):
        cap, pol = int(r["capacity"]), r["policy"]
        fit = ids_layer[:cut] if pol == "static" else None
        ref = simulate(ids_layer, cap, pol, "reference", fit=fit)
        tok = simulate(ids_layer, cap, pol, "token", fit=fit)
        pub = float(r["demand_miss_per_tok"])
        rows.append({"policy": pol, "capacity": cap, "cap_frac": round(cap / 128, 4),
                     "published_miss_per_tok": pub, "ours_miss_per_tok": round(ref.misses_per_step, 4),
                     "rel_err": round((ref.misses_per_step - pub) / pub, 5) if pub else 0.0,
                     "published_hit_rate": round(1 - pub / k, 4), "ours_hit_rate_reference": round(ref.hit_rate, 4),
                     "ours_hit_rate_token": round(tok.hit_rate, 4)})
    return rows


CAP_FRAC = 0.125  # the capacity the docs' table compares at (Qwen: 17 of 128 experts, the paper's nearest row)


def mine(token: str, reference: str) -> dict:
    """The figures of two `analyze` summaries of one trace (token, then reference semantics) that the table sets
    beside Qwen's: reuse@lag1 and chance over all layers, the share of experts serving 95% of accesses, each
    policy's hit rate at CAP_FRAC of E (mean over layers) in both semantics, lookahead recall at distance 2."""
    from expertcache.telemetry.errors import InputError

    out = {}
    for want, path in (("token", token), ("reference", reference)):
        try:
            s = json.loads(Path(path).read_text())
            got = s["semantics"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"--ours {path}: not an `expertcache analyze` summary.json ({e})") from None
        if got != want:
            raise InputError(f"--ours {path}: --semantics {got}; expected {want} (TOKEN first, then REFERENCE)")
        hits = {h["policy"]: h["hit_rate_per_layer"] for h in s["hit_curves"]
                if abs(h["capacity_frac"] - CAP_FRAC) < 1e-9}
        if not hits:
            raise InputError(f"--ours {path}: no hit curve at {CAP_FRAC:g} of E (capacities {s['capacities']})")
        out[f"hit_rate_{want}"] = hits
        if want == "token":
            r = s["routing"]
            m = Path(str(s["model"]))  # a folder's name (runs/base-tiny/model: base-tiny/model), no machine path
            out.update({"model": "/".join(m.parts[-2:]) if m.name == "model" else m.name,
                        "num_experts": s["num_experts"], "top_k": s["top_k"], "tokens": r["tokens"], "phase": s["phase"], "reuse_lag1": r["reuse_lag1"],
                        "coverage_95": r["coverage_mean"]["0.95"],
                        "lookahead_recall_2": (s.get("lookahead_recall") or {}).get("2", {}).get("mean")})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=str(DEFAULT_REF), help="the reference folder")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--ours", nargs=2, default=None, metavar=("TOKEN", "REFERENCE"),
                    help="two `expertcache analyze` summary.json files of one trace (--semantics token, then "
                         "reference): their figures beside Qwen's")
    a = ap.parse_args()
    ours = mine(*a.ours) if a.ours else None
    ref = Path(a.ref)
    if not (ref / "code.npz").is_file():
        print(f"reference data not found at {ref}", file=sys.stderr)
        return 2
    sticky = list(csv.DictReader((ref / "stickiness.csv").open()))
    work = list(csv.DictReader((ref / "working_set.csv").open()))
    result = {"reference": str(ref), "domains": {}}
    tmp = Path(tempfile.mkdtemp())
    for dom in ("code", "general"):
        trace = tmp / f"{dom}.parquet"
        import_trace(ref / f"{dom}.npz", trace, domain=dom)
        ids, seq, pos = read_trace(trace).routing()
        e, k = 128, ids.shape[2]
        table = cache_table(ids[24], ref / f"cache_{dom}.csv")
        # reuse@lag1 per layer vs stickiness.csv
        reuse_err, chance_err, ours_reuse, pub_reuse, ours_chance = [], [], [], [], []
        for row in sticky:
            if row["domain"] != dom or int(row["lag"]) != 1:
                continue
            layer = int(row["layer"])
            r = reuse_lag1(ids[layer], seq, pos, e)
            reuse_err.append(abs(r["reuse"] - float(row["reuse_prob"])))
            chance_err.append(abs(r["chance"] - float(row["chance_reuse"])))
            ours_reuse.append(r["reuse"])
            ours_chance.append(r["chance"])
            pub_reuse.append(float(row["reuse_prob"]))
        # experts needed for coverage vs working_set.csv
        cov_err = []
        needed = {}
        for row in work:
            if row["domain"] != dom:
                continue
            layer, x = int(row["layer"]), float(row["coverage"])
            n = round(coverage(ids[layer], e, (x,))[f"{x:g}"] * e)
            cov_err.append(abs(n - int(row["experts_needed"])))
            needed.setdefault(x, []).append(n / e)
        result["domains"][dom] = {
            "tokens": int(ids.shape[1]), "layers": int(ids.shape[0]),
            "layer24_cache_table": table,
            "layer24_max_abs_rel_err": max(abs(r["rel_err"]) for r in table),
            "reuse_lag1": {"ours_mean": round(float(np.mean(ours_reuse)), 4),
                           "published_mean": round(float(np.mean(pub_reuse)), 4),
                           "chance_ours_mean": round(float(np.mean(ours_chance)), 4),
                           "max_abs_err_per_layer": round(max(reuse_err), 6),
                           "chance_max_abs_err_per_layer": round(max(chance_err), 6)},
            "coverage_experts_needed": {"max_abs_err_experts": max(cov_err),
                                        "mean_frac_of_experts": {f"{x:g}": round(float(np.mean(v)), 4)
                                                                 for x, v in needed.items()}},
        }
    worst = max(d["layer24_max_abs_rel_err"] for d in result["domains"].values())
    result["table_within_2pct"] = worst <= 0.02
    if ours is not None:
        result["ours"] = ours
    print(json.dumps(result, indent=2))
    if a.out:
        from expertcache.runtime.bench.results import write_result

        write_result(a.out, result, config=vars(a))
    return 0


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
