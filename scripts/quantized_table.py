#!/usr/bin/env python
"""What quantized experts cost in quality and buy in bytes, on a trained base: `results/quantized.json`.

For each variant, `expertcache quantize` writes the checkpoint (routed experts packed, everything else unchanged;
the `+linears` variants pack the attention matrices too); `expertcache eval` scores it through the engine with
every expert resident (capacity 1.0, host tier: the cache changes nothing, so only the weights differ) on the same
blocks and documents as the base; `gate` decides on paired intervals against the base. The `bf16` row is the
base's expert weights rounded to bf16 (what a bf16 checkpoint stores; the other weights unchanged, as `quantize`
leaves them), computed in fp32 like the others. Bytes: the experts' bytes against the bf16 experts'. Decode:
`bench decode` at 1/4 of the experts from disk (TPOT, bytes moved per token).

4-bit on miss (`--engine.miss_precision 4 --engine.miss_copy <the int4-g32 copy>`, HOBBIT's idea as a cache policy):
the base served at 1/8 and 1/4 of E from disk, each miss computed from the int4 copy and not admitted, an expert
served that way twice at a layer then upgraded to full precision in the background. It is lossy (outputs depend on
the cache), so it is evaluated token by token on a smaller sample (`--lossy_blocks`, `--lossy_limit`) against the
base evaluated on the same blocks and documents; its bytes are the bytes moved per token against the same capacity
served blocking (`bench decode`, the same tokens).

    python scripts/quantized_table.py --base runs/base-tiny/model --work runs/quantized --out results/quantized.json

Mixed by usage (`quantize --by_usage`): the base's routing recorded on the corpus's train split (`trace record
--split train`; the evals read the test split), the most used experts written at int8 (group 32) and the rest at
int4 (group 128) within 0.35x and 0.30x the bf16 expert bytes; served like the others.

`--keep_rows` adds variants to an existing table: the rows of --out this run does not measure are kept, each with
the command that measured it (`measured_by`).

Targets (#20): int8 gate PASS at Δppl <= +0.3%; the best 4-bit variant gate PASS at <= 0.35x the bf16 expert
bytes. Resumable: a variant already quantized, or an eval already written, is reused.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from expertcache.evals.gate import EVAL_FORMAT_VERSION, gate
from expertcache.evals.run import evaluate
from expertcache.runtime.engine.config import EngineConfig
from expertcache.telemetry.atomic import atomic_dir, write_text
from expertcache.telemetry.errors import count

VARIANTS = {"int8-g32": (8, 32), "int4-g32": (4, 32), "int4-g64": (4, 64), "int4-g128": (4, 128),
            # the non-expert linears packed too (`quantize --linears true`: attention; the tied output head and the
            # routers stay exact), as llama.cpp's Q8_0 / Q4_0 files pack every matrix
            "int8-g32+linears": (8, 32), "int4-g32+linears": (4, 32),
            # symmetric int4 (`quantize --symmetric true`): llama.cpp's Q4_0 layout, 4.5 bits per weight at group 32
            "int4-sym-g32": (4, 32, True), "int4-sym-g32+linears": (4, 32, True)}
# precision by usage (`quantize --by_usage`): the experts the base uses most on the corpus's train split at int8
# (group 32), the rest at int4 (group 128), within a fraction of the bf16 expert bytes
MIXED = {"mixed-by-usage@0.35": ((8, 32), (4, 128), 0.35), "mixed-by-usage@0.30": ((8, 32), (4, 128), 0.30)}


def bf16_copy(base: Path, out: Path) -> Path:
    """The base with its routed experts' weights rounded to bf16 (the other weights unchanged, as `quantize`
    leaves them), saved in the base's dtype; tokenizer and generation config copied."""
    if (out / "config.json").is_file():
        return out
    import shutil

    import torch

    from expertcache.telemetry.hf import load_causal_lm

    m = load_causal_lm(base)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".mlp.experts." in name:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    with atomic_dir(out) as tmp:
        m.save_pretrained(tmp)
        for f in base.iterdir():
            if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
                shutil.copy2(f, tmp / f.name)
    return out


def bf16_expert_bytes(model_dir: Path) -> int:
    """What the checkpoint's routed experts take in bf16: 2 bytes a weight."""
    import math

    from expertcache.runtime.storage.checkpoint import Checkpoint

    return sum(2 * math.prod(t.shape) for k, t in Checkpoint(model_dir).tensors.items() if ".mlp.experts." in k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="runs/base-tiny/model")
    ap.add_argument("--work", default="runs/quantized", help="quantized checkpoints and eval JSONs")
    ap.add_argument("--out", default="results/quantized.json")
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--variants", nargs="+", default=[*VARIANTS, *MIXED], choices=[*VARIANTS, *MIXED])
    ap.add_argument("--ppl_blocks", type=count, default=64, help="step-wise blocks per domain")
    ap.add_argument("--seq_len", type=count, default=128)
    ap.add_argument("--limit", type=count, default=None, help="documents per accuracy task (default: all)")
    ap.add_argument("--decode_tokens", type=int, default=32, help="bench decode tokens per pass (0: skip decode)")
    ap.add_argument("--on_miss", nargs="*", type=float, default=[0.125, 0.25],
                    help="capacities (fractions of E) of the 4-bit-on-miss rows (none: skip them)")
    ap.add_argument("--lossy_blocks", type=count, default=8, help="step-wise blocks per domain, on-miss rows")
    ap.add_argument("--lossy_limit", type=count, default=16, help="documents per task, on-miss rows")
    ap.add_argument("--keep_rows", action="store_true",
                    help="keep the rows of --out (written by an earlier run) whose names this run does not measure, "
                         "each marked with the command that measured it: a new variant joins the table without "
                         "evaluating the others again (the base and bf16 rows are always measured anew)")
    ap.add_argument("--gguf", nargs="*", default=[],
                    help="NAME=FILE[:int4|int8]: llama.cpp GGUF files of the base (llama.cpp's converter and "
                         "llama-quantize), each imported with `expertcache import-gguf` (with --requantize when given) "
                         "and evaluated as a row (none: skipped)")
    a = ap.parse_args()
    base, work = Path(a.base), Path(a.work)
    from expertcache.telemetry.hf import load_config

    load_config(base)  # a base that is not a checkpoint: one line before anything is made
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "expertcache.recipes.cli"]
    served = EngineConfig(capacity=1.0, tier="host")
    kw = dict(corpus=a.corpus, task_dir=work / "task-data", ppl_blocks=a.ppl_blocks, seq_len=a.seq_len,
              limit=a.limit, engine=served)

    def ev(model: Path, name: str, **over) -> dict:
        f = work / f"eval-{name}.json"
        if f.is_file():
            r = json.loads(f.read_text())
            if r.get("format_version") == EVAL_FORMAT_VERSION:
                return r
        t = time.perf_counter()
        r = evaluate(model, out=f, **{**kw, **over})
        print(f"eval {name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        return r

    def decode(model: Path, cap: float = 0.25, extra=(), tag: str = "") -> dict:
        if not a.decode_tokens:
            return {}
        f = work / f"decode-{model.name}{tag}.json"
        if not f.is_file():
            subprocess.run(cli + ["bench", "decode", "--model", str(model), "--corpus", a.corpus, "--engine.tier",
                                  "disk", "--capacities", f"[{cap:g}]", "--predictors", "[none]", "--tokens",
                                  str(a.decode_tokens), "--rounds", "2", "--prompts", "1", *extra, "--out", str(f)],
                           check=True, capture_output=True)
        d = json.loads(f.read_text())["configs"][f"on-demand@{cap:g}"]
        return {"tpot_s": d["tpot_median_s"], "traffic_bytes_per_token": d["traffic_bytes_per_token"],
                "bytes_moved_per_token": d["bytes_moved_per_token"], "hit_rate": d["hit_rate"],
                "lowbit_served": d.get("lowbit_served"), "upgrade_loads": d.get("upgrade_loads"),
                "greedy_tokens_equal_plain": d.get("greedy_tokens_equal_plain")}

    t0 = time.perf_counter()
    ref = ev(base, "base")
    b16 = bf16_copy(base, work / "bf16")
    models = {"bf16": (16, None, b16)}
    reports, skipped = {}, {}
    usage = work / "usage-train.parquet"  # the base's routing on the train split (the evals read the test split)
    if any(n in MIXED for n in a.variants) and not usage.is_file():
        subprocess.run(cli + ["trace", "record", "--model", str(base), "--corpus", a.corpus, "--split", "train",
                              "--out", str(usage)], check=True, capture_output=True)
    for name in a.variants:
        out = work / name
        rep_f = work / f"{name}.report.json"
        if name in MIXED:
            (hb, hg), (bits, group), ratio = MIXED[name]
            extra = ["--by_usage", str(usage), "--hot_bits", str(hb), "--hot_group_size", str(hg),
                     "--max_bytes_ratio", str(ratio)]
        else:
            bits, group, *sym = VARIANTS[name]
            extra = ["--linears", "true" if name.endswith("+linears") else "false"] + \
                (["--symmetric", "true"] if sym and sym[0] else [])
        if not (out / "config.json").is_file():
            r = subprocess.run(cli + ["quantize", "--model", str(base), "--bits", str(bits), "--group_size",
                                      str(group), "--out", str(out), *extra],
                               capture_output=True, text=True)
            if r.returncode:  # e.g. a group or chunk size the model's dimensions do not take: said, not hidden
                skipped[name] = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
                print(f"{name}: skipped: {skipped[name]}", file=sys.stderr, flush=True)
                continue
            write_text(rep_f, r.stdout)
        reports[name] = json.loads(rep_f.read_text())
        models[name] = ("mixed" if name in MIXED else bits, group, out)
    for spec in a.gguf:  # llama.cpp's own quantization of the same base, read through import-gguf
        name, _, f = spec.partition("=")
        f, _, requant = f.partition(":")  # FILE:int4 for a file whose experts must be quantized again (K-quants)
        out, rep_f = work / name, work / f"{name}.report.json"
        if not (out / "config.json").is_file():
            r = subprocess.run(cli + ["import-gguf", "--gguf", f, "--out", str(out)]
                               + (["--requantize", requant] if requant else []), capture_output=True, text=True)
            if r.returncode:
                skipped[name] = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
                continue
            write_text(rep_f, r.stdout)
        reports[name] = {**json.loads(rep_f.read_text()), "relative_error": None}
        qc = json.loads((out / "config.json").read_text()).get("quantization_config") or {}
        models[name] = (qc.get("bits", 16), qc.get("group_size"), out)
    bf16_bytes = None
    rows = []
    for name, (bits, group, model) in models.items():
        g = gate(ref, ev(model, name))
        if name == "bf16":
            bf16_bytes = stored = bf16_expert_bytes(base)
            err = None
        else:
            stored = reports[name]["expert_bytes"]
            err = max(max(v) for v in reports[name]["relative_error"].values()) \
                if reports[name]["relative_error"] else None
        lin = reports[name].get("linears") if name in reports else None
        if name in reports and "packed_linear_modules" in reports[name]:  # an imported GGUF's same-type linears
            lin = {"modules": reports[name]["packed_linear_modules"]}
        mix = {} if name not in MIXED else {
            "formats": reports[name]["formats"], "by_usage": reports[name]["by_usage"],
            "policy": f"the most used experts (train-split trace) at int{MIXED[name][0][0]} g{MIXED[name][0][1]}, "
                      f"the rest at int{MIXED[name][1][0]} g{MIXED[name][1][1]}, within {MIXED[name][2]:g}x the bf16 "
                      f"expert bytes"}
        if "gguf" in reports.get(name, {}):
            rq = reports[name].get("requantized")
            mix = {"policy": f"llama.cpp's {reports[name]['experts_type']} file of the base (its converter, then "
                             f"llama-quantize), read by import-gguf: "
                             + (f"experts dequantized and quantized again to {reports[name]['experts']} group 32"
                                if rq else "experts and same-type attention as stored")
                             + ", other tensors dequantized to bf16", "gguf": reports[name]["gguf"]}
            if rq:  # the second rounding's own error (against the file's weights, not the base's)
                mix["relative_error_vs_gguf_max"] = max(reports[name]["relative_error_vs_gguf"])
        rows.append({"name": name, "bits": bits, "group_size": group, **mix,
                     "linears_packed": (lin or {}).get("modules", []),
                     "linears_relative_error_max": max((lin or {}).get("relative_error", {}).values(), default=None),
                     "dppl_overall_pct": g["dppl_percent"]["overall"],
                     "dppl_max_domain_pct": g["dppl_max_domain_percent"], "dppl_percent": g["dppl_percent"],
                     "dppl_overall_ci95": g["dppl_overall_ci95"], "dppl_max_domain_ci95": g["dppl_max_domain_ci95"],
                     "dacc_points": g["dacc_points"], "dacc_ci95": g["dacc_ci95"], "n_blocks": g["n_blocks"],
                     "n_documents": g["n_documents"], "gate": g["gate"], "failures": g["failures"],
                     "dacc_method": g.get("dacc_method"),
                     "expert_bytes": stored, "expert_bytes_ratio": stored / bf16_bytes,
                     "relative_error_max": err,
                     # the bf16 row's copy stores the rounded weights in the base's fp32: its decode would move
                     # fp32 bytes, so it has none (the bytes column is what bf16 storage takes)
                     **({} if name == "bf16" else decode(model))})
        print(f"{name}: Δppl {rows[-1]['dppl_overall_pct']:+.3f}% {g['dppl_overall_ci95']}, gate {g['gate']}, "
              f"bytes {rows[-1]['expert_bytes_ratio']:.3f}x bf16", file=sys.stderr, flush=True)
    copy = models.get("int4-g32")
    if a.on_miss and copy is not None:
        lossy = dict(ppl_blocks=a.lossy_blocks, limit=a.lossy_limit)
        ref_small = ev(base, "base-lossy", **lossy)  # the same blocks and documents as the on-miss rows
        for cap in a.on_miss:
            name = f"int4-on-miss@{cap:g}"
            cfg = EngineConfig(capacity=cap, tier="disk", miss_precision=4, miss_copy=str(copy[2]))
            g = gate(ref_small, ev(base, name, engine=cfg, **lossy))
            on = decode(base, cap, ["--engine.miss_precision", "4", "--engine.miss_copy", str(copy[2])],
                        f"-on-miss@{cap:g}")
            blk = decode(base, cap, (), f"-blocking@{cap:g}")
            rows.append({"name": name, "bits": 4, "policy": "4-bit on miss, full precision once hot (miss_upgrade 2)",
                         "group_size": 32, "capacity": cap,
                         "dppl_overall_pct": g["dppl_percent"]["overall"],
                         "dppl_max_domain_pct": g["dppl_max_domain_percent"], "dppl_percent": g["dppl_percent"],
                         "dppl_overall_ci95": g["dppl_overall_ci95"],
                         "dppl_max_domain_ci95": g["dppl_max_domain_ci95"], "dacc_points": g["dacc_points"],
                         "dacc_ci95": g["dacc_ci95"], "n_blocks": g["n_blocks"], "n_documents": g["n_documents"],
                         "gate": g["gate"], "failures": g["failures"], "dacc_method": g.get("dacc_method"),
                         # on disk: the checkpoint and its int4 copy; what it buys is bytes moved per token
                         "expert_bytes": bf16_bytes + reports["int4-g32"]["expert_bytes"],
                         "expert_bytes_ratio": 1 + reports["int4-g32"]["expert_bytes"] / bf16_bytes,
                         **on, "blocking_tpot_s": blk.get("tpot_s"),
                         "blocking_bytes_moved_per_token": blk.get("bytes_moved_per_token"),
                         # measured bytes (the cache's traffic figure counts full-precision loads only)
                         "traffic_ratio_vs_blocking": on["bytes_moved_per_token"] / blk["bytes_moved_per_token"]
                         if on and blk and blk["bytes_moved_per_token"] else None,
                         "tpot_ratio_vs_blocking": on["tpot_s"] / blk["tpot_s"] if on and blk else None})
            print(f"{name}: Δppl {rows[-1]['dppl_overall_pct']:+.3f}% {g['dppl_overall_ci95']}, gate {g['gate']}, "
                  f"traffic {rows[-1]['traffic_ratio_vs_blocking']}x blocking", file=sys.stderr, flush=True)
    if a.keep_rows and Path(a.out).is_file():  # an earlier run's rows for what this run did not measure
        old = json.loads(Path(a.out).read_text())
        have = {r["name"] for r in rows}
        carried = [{**r, "measured_by": r.get("measured_by") or old["command"]} for r in old.get("rows", [])
                   if r["name"] not in have]
        rows = [rows[0], *carried, *rows[1:]] if rows and rows[0]["name"] == "bf16" else [*carried, *rows]
    int8 = [r for r in rows if r["bits"] == 8]
    four = [r for r in rows if r["bits"] in (4, "mixed") and "capacity" not in r and r["gate"] == "PASS"
            and r["expert_bytes_ratio"] <= 0.35]
    res = {"command": " ".join(["python", "scripts/quantized_table.py", *sys.argv[1:]]), "base": str(base),
           "served": "capacity 1.0, host tier (every expert resident: only the weights differ)",
           "ppl_blocks_per_domain": a.ppl_blocks, "seq_len": a.seq_len, "limit": a.limit,
           "on_miss": {"capacities": a.on_miss, "ppl_blocks_per_domain": a.lossy_blocks, "limit": a.lossy_limit,
                       "served": "disk tier, miss_precision 4 from the int4-g32 copy, miss_upgrade 2",
                       "baseline": "the base on the same blocks and documents (eval-base-lossy)"},
           "seconds": round(time.perf_counter() - t0, 1), "rows": rows, "skipped": skipped,
           "not_measured": [],
           "targets": {"int8": "gate PASS at dppl_overall_pct <= +0.3",
                       "best_4bit": "gate PASS at expert_bytes_ratio <= 0.35 (4-bit or mixed by usage)"},
           "pass": {"int8": bool(int8) and all(r["gate"] == "PASS" and r["dppl_overall_pct"] <= 0.3 for r in int8),
                    "best_4bit": bool(four)}}
    from expertcache.runtime.bench.results import write_result

    write_result(a.out, res, config=vars(a), command=res["command"])
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
