#!/usr/bin/env python
"""Recording overhead on the base model: forward alone vs forward under the Recorder, alternated in one run.

Targets (issue #3): ids + weights at most 3% of forward time, with hidden states at most 15%, batch 8 x 256.
Measured per variant: the forward with hooks attached plus turning the captured tensors into trace rows
(`rows_from_calls`); the Parquet write is timed separately (it is I/O, done once per batch, off the forward).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from expertcache.telemetry.errors import count, nonnegative
from expertcache.telemetry.parquet_trace import TraceWriter
from expertcache.telemetry.recorder import Recorder, rows_from_calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/base-tiny/model", help="HF checkpoint; if absent, the base-tiny "
                    "recipe's shape with random weights (routing costs the same)")
    ap.add_argument("--batch", type=count, default=8)
    ap.add_argument("--seq", type=count, default=256)
    ap.add_argument("--reps", type=count, default=12, help="alternations (each runs every variant once)")
    ap.add_argument("--warmup", type=nonnegative, default=2)
    a = ap.parse_args()

    from expertcache.telemetry.errors import InputError
    from expertcache.telemetry.hf import load_causal_lm

    if a.model != ap.get_default("model") and not Path(a.model, "config.json").is_file():
        raise InputError(f"--model {a.model}: no checkpoint there (no config.json); leave --model out to time the "
                         f"base-tiny recipe's shape with random weights")
    if Path(a.model, "config.json").is_file():
        model, source = load_causal_lm(a.model, dtype=torch.float32), a.model
    else:
        from expertcache.recipes.cli import resolve_recipe
        from expertcache.trainer.config import load_recipe
        from expertcache.trainer.pretrain import PretrainRecipe

        r = load_recipe(PretrainRecipe, resolve_recipe("base-tiny"))
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM

        model, source = AutoModelForCausalLM.from_config(r.model.to_hf_config(8192, 0, 1)), "base-tiny shape, random"
    model.eval()
    x = torch.randint(2, model.config.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    seq = np.repeat(np.arange(a.batch, dtype=np.int32), a.seq)
    pos = np.tile(np.arange(a.seq, dtype=np.int32), a.batch)

    def plain():
        t = time.perf_counter()
        model(input_ids=x, use_cache=False)
        return time.perf_counter() - t, 0.0

    def recorded(hidden: bool):
        def run():
            with Recorder(model, hidden=hidden) as rec:
                t = time.perf_counter()
                model(input_ids=x, use_cache=False)
                rows = rows_from_calls(rec.take(), [(seq, pos)], False, hidden)
                dt = time.perf_counter() - t
            w = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                with TraceWriter(Path(d) / "t.parquet", rec.meta("bench"), with_hidden=hidden) as tw:
                    tw.write(rows["seq_id"], rows["pos"], rows["layer"], "prefill", "bench",
                             np.zeros(len(rows["seq_id"]), np.int32), rows["ids"], rows["weights"],
                             hidden=rows.get("hidden"))
            return dt, time.perf_counter() - w
        return run

    # plain_control repeats the plain forward: its gap to plain is the noise floor of this measurement
    variants = {"plain": plain, "ids_weights": recorded(False), "plain_control": plain, "with_hidden": recorded(True)}
    from expertcache.telemetry.provenance import provenance
    from expertcache.runtime.bench.harness import alternate, compare

    prov = provenance(Path(__file__).parent)  # the code, before the work
    with torch.no_grad():  # the first --warmup rounds untimed
        runs = alternate(list(variants), a.reps + a.warmup, lambda k, rep: variants[k]())
    times = {k: [dt for dt, _ in v[a.warmup:]] for k, v in runs.items()}
    writes = {k: [wt for _, wt in v[a.warmup:]] for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    over = {k: med[k] / med["plain"] - 1 for k in ("ids_weights", "with_hidden", "plain_control")}
    out = {"benchmark": "telemetry_overhead", "model": source, "batch": [a.batch, a.seq], "reps": a.reps,
           "threads": torch.get_num_threads(),
           "forward_s_median": {k: round(v, 4) for k, v in med.items()},
           "overhead": {k: round(v, 4) for k, v in over.items()},
           "vs_plain": {k: compare(times[k], times["plain"]) for k in over},
           "parquet_write_s_median": {k: round(statistics.median(writes[k]), 4) for k in ("ids_weights", "with_hidden")},
           "targets": {"ids_weights": 0.03, "with_hidden": 0.15},
           "pass": over["ids_weights"] <= 0.03 and over["with_hidden"] <= 0.15, **prov}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
