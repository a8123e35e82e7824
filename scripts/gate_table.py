#!/usr/bin/env python
"""The gate on a base against post-trained checkpoints, with and without rerouting; one JSON and one table.

For every checkpoint: `expertcache eval` plain (lm-eval tasks + step-wise token perplexity) and served at a
capacity with the reroute miss policy (step-wise, one token at a time, the cache in order), then `gate` against
the plain base. Miss reduction: demand loads per token during the step-wise evaluation, against the base served
at the same capacity with blocking loads (LRU) on the same tokens.

    python scripts/gate_table.py --base runs/base-tiny/model --candidates runs/ca-*/model --out runs/gates
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from expertcache.evals.gate import EVAL_FORMAT_VERSION, gate
from expertcache.evals.run import evaluate
from expertcache.runtime.engine.config import EngineConfig
from expertcache.telemetry.atomic import write_json, write_text
from expertcache.telemetry.errors import count, fraction

PLAIN_TASKS = ["ec_ppl_code", "ec_ppl_prose", "ec_ppl_math", "ec_cloze_code", "ec_cloze_prose", "ec_cloze_math",
               "ec_math_em"]
LOSSY_TASKS = ["ec_ppl_prose", "ec_cloze_prose"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--candidates", nargs="+", required=True)
    ap.add_argument("--out", required=True, help="folder for every eval JSON, gates.json and gates.md")
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--capacity", type=fraction, default=0.125)
    ap.add_argument("--tau", type=float, default=0.1)
    ap.add_argument("--limit", type=count, default=24, help="documents per plain task")
    ap.add_argument("--lossy-limit", type=count, default=8, help="documents per task under rerouting")
    ap.add_argument("--ppl-blocks", type=count, default=4)
    ap.add_argument("--seq-len", type=count, default=128)
    a = ap.parse_args()
    from expertcache.telemetry.hf import load_config

    for m in [a.base, *a.candidates]:  # every checkpoint named, before the output folder is made
        load_config(m)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(corpus=a.corpus, task_dir=out / "task-data", ppl_blocks=a.ppl_blocks, seq_len=a.seq_len)
    served = EngineConfig(capacity=a.capacity, tier="host")
    reroute = EngineConfig(capacity=a.capacity, tier="host", miss="reroute", tau=a.tau)

    def ev(model, name, policy=None, tasks=PLAIN_TASKS, limit=a.limit):
        f = out / f"eval-{name}.json"
        if f.is_file():
            r = json.loads(f.read_text())
            if r.get("format_version") == EVAL_FORMAT_VERSION:  # older evals lack the gate's fingerprints
                return r
        print(f"eval {name} [{'plain' if policy is None else policy.label()}]", flush=True)
        return evaluate(model, engine=policy, tasks=tasks, out=f, limit=limit, **kw)

    base = ev(a.base, "base")
    # lossy rows run fewer documents: their Δacc is against the plain base on exactly those documents
    base_small = ev(a.base, "base-small", None, LOSSY_TASKS, a.lossy_limit)
    base_lru = ev(a.base, "base-lru", served, [], a.lossy_limit)
    base_misses = base_lru["stepwise"]["engine"]["demand_loads"]
    rows = []
    for cand in [a.base, *a.candidates]:
        name = Path(cand).parent.name if Path(cand).name == "model" else Path(cand).name
        for label, policy, tasks, limit in (("plain", None, PLAIN_TASKS, a.limit),
                                            ("reroute", reroute, LOSSY_TASKS, a.lossy_limit)):
            is_base = cand == a.base and label == "plain"
            r = base if is_base else ev(cand, f"{name}-{label}", policy, tasks, limit)
            if label == "plain":
                lru = base_lru if cand == a.base else ev(cand, f"{name}-lru", served, [], a.lossy_limit)
                misses = lru["stepwise"]["engine"]["demand_loads"]
            else:
                misses = r["stepwise"]["engine"]["demand_loads"]
            g = gate(base if label == "plain" else base_small, r)
            rows.append({"checkpoint": name, "serving": label, "dppl_percent": g["dppl_percent"],
                         "dacc_points": g["dacc_points"], "bpb_crosscheck": g["bpb_crosscheck"],
                         "dppl_overall_ci95": g["dppl_overall_ci95"], "dppl_max_domain_ci95": g["dppl_max_domain_ci95"],
                         "dacc_ci95": g["dacc_ci95"], "n_blocks": g["n_blocks"], "n_documents": g["n_documents"],
                         "unresolved": g["unresolved"], "resolve": g["resolve"],
                         "miss_reduction_vs_base_lru": 1 - misses / base_misses, "demand_loads": misses,
                         "rerouted": r["stepwise"].get("engine", {}).get("rerouted", 0),
                         "gate": g["gate"], "failures": g["failures"]})
    res = {"base": a.base, "capacity": a.capacity, "tau": a.tau, "base_lru_demand_loads": base_misses,
           "stepwise_tokens": base["stepwise"]["tokens"], "rows": rows}
    write_json(out / "gates.json", res)
    md = [f"Capacity {a.capacity:g} E per layer (host tier), reroute τ = {a.tau:g}; miss reduction = demand loads "
          f"per token during the step-wise evaluation vs the base with LRU (blocking) on the same tokens "
          f"({base['stepwise']['tokens']['overall']} tokens). Δacc: plain rows on {a.limit} documents per task, "
          f"reroute rows on {a.lossy_limit} (against the plain base on the same documents).", "",
          "| checkpoint | serving | miss reduction | Δppl overall | code | prose | math | Δacc (points) | gate |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["dppl_percent"]
        acc = ", ".join(f"{t.removeprefix('ec_')} {v:+.1f}" for t, v in r["dacc_points"].items())
        lo, hi = r["dppl_overall_ci95"]
        md.append(f"| {r['checkpoint']} | {r['serving']} | {100 * r['miss_reduction_vs_base_lru']:+.1f}% | "
                  f"{d['overall']:+.2f}% [{lo:+.2f}, {hi:+.2f}] | {d['code']:+.2f}% | {d['prose']:+.2f}% | "
                  f"{d['math']:+.2f}% | {acc} | {r['gate']} |")
    write_text(out / "gates.md", "\n".join(md) + "\n")
    print(json.dumps(res, indent=2))
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
