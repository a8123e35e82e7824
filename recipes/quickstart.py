"""The main job on embedded defaults: corpus -> smoke base -> trace + analysis -> cache-aware post-training ->
decode benchmark -> gate -> a report in `runs/<timestamp>/` (Markdown with the plots, JSON with every figure, the
command of each step). Every step is the `expertcache` command the report quotes, run in this process."""

from __future__ import annotations

import json
import shlex
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

from expertcache.telemetry.atomic import write_json, write_text


def run_quickstart(data: str, runs: str, prose_sdist: str, max_mb: float = 24.0) -> dict:
    from expertcache.recipes.cli import main

    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    rep = Path(runs) / stamp
    rep.mkdir(parents=True, exist_ok=True)
    smoke = Path(runs) / "smoke"
    ca = Path(runs) / "ca-smoke"
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
    step("pretrain smoke base", ["pretrain", "--recipe", "smoke", f"data.corpus={corpus}", f"data.tokenizer={tok}",
                                 f"out_dir={smoke}"])
    trace = smoke / "trace-test.parquet"
    step("trace", ["trace", "record", "--model", str(smoke / "model"), "--corpus", corpus, "--out", str(trace),
                   "--prompt_len", "64", "--decode_tokens", "32", "--max_seqs", "8", "--hidden", "true"])
    step("analysis", ["analyze", "--trace", str(trace), "--out", str(smoke / "analysis"), "--model",
                      str(smoke / "model")])
    step("cache-aware post-training", ["train-cache-aware", "--recipe", "smoke", f"base={smoke / 'model'}",
                                       f"data.corpus={corpus}", f"data.tokenizer={smoke / 'model'}",
                                       f"out_dir={ca}"],
         ok=(0, 1, 3))  # trained; its own gate's verdict (PASS, FAIL, INCONCLUSIVE on smoke sizes) is reported
    bench = rep / "bench-decode.json"
    step("decode benchmark", ["bench", "decode", "--model", str(ca / "model"), "--corpus", corpus,
                              "--engine.tier", "disk", "--capacities", "[0.25]", "--predictors", "[probe:1]",
                              "--tokens", "32", "--rounds", "5", "--prompts", "1", "--out", str(bench)])
    ev = {}
    # a lossy policy is evaluated one token at a time (cache in order): fewer documents, two tasks
    lossy = ["--engine.capacity", "0.25", "--engine.miss", "reroute", "--engine.tau", "0.1", "--tasks",
             "[ec_ppl_prose,ec_cloze_prose]", "--limit", "4"]
    # lossless: whole blocks per forward, so 32 blocks per domain cost seconds (8, eval's default, left the
    # post-trained row's code domain INCONCLUSIVE: about 23 would resolve it)
    plain = ["--limit", "16", "--ppl_blocks", "32"]
    for name, model, extra in (("base", smoke / "model", plain), ("post-trained", ca / "model", plain),
                               ("post-trained+reroute", ca / "model", lossy)):
        out = rep / f"eval-{name}.json"
        step(f"eval {name}", ["eval", "--model", str(model), "--corpus", corpus, "--out", str(out),
                              "--task_dir", str(rep / "task-data"), *extra])
        ev[name] = out
    # the lossy candidate ran fewer documents: its Δacc is against the base on exactly those
    base_small = rep / "eval-base-small.json"
    step("eval base (reroute's documents)", ["eval", "--model", str(smoke / "model"), "--corpus", corpus, "--out",
                                             str(base_small), "--task_dir", str(rep / "task-data"), *lossy[6:]])
    gates = {}
    for name, baseline in (("post-trained", ev["base"]), ("post-trained+reroute", base_small)):
        out = rep / f"gate-{name}.json"
        step(f"gate {name}", ["gate", "--baseline", str(baseline), "--candidate", str(ev[name]), "--out", str(out)],
             ok=(0, 1, 3))  # PASS, FAIL, INCONCLUSIVE: results, each reported
        gates[name] = json.loads(out.read_text())
    report = _report(rep, smoke, ca, bench, ev, gates, steps, time.time() - t_all)
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


def _report(rep: Path, smoke: Path, ca: Path, bench: Path, ev: dict, gates: dict, steps: list, total_s: float) -> dict:
    from expertcache.runtime.bench import table as bench_table
    from expertcache.trainer.cache_aware import results_table

    for src, dst in ((smoke / "training_curve.png", "base_training_curve.png"),
                     (ca / "training_curve.png", "post_training_curve.png"), (ca / "cache.png", "cache.png")):
        if src.is_file():
            shutil.copy(src, rep / dst)
    for png in sorted((smoke / "analysis").glob("*.png")):
        shutil.copy(png, rep / f"analysis_{png.name}")
    base_metrics = json.loads((smoke / "metrics.json").read_text())
    analysis = json.loads((smoke / "analysis" / "summary.json").read_text())
    ca_res = json.loads((ca / "result.json").read_text())
    b = json.loads(bench.read_text())
    evals = {k: json.loads(Path(v).read_text()) for k, v in ev.items()}
    summary_rows = [gate_summary(name, g, evals[name]) for name, g in gates.items()]
    cap8 = next(iter(ca_res["summary"]["capacities"].values()))
    report = {"total_seconds": round(total_s, 1), "steps": steps, "base": base_metrics["validation"],
              "routing": {"reuse_lag1": analysis["routing"]["reuse_lag1"],
                          "coverage_mean": analysis["routing"]["coverage_mean"],
                          "lookahead_recall": {d: v["mean"] for d, v in (analysis.get("lookahead_recall") or {}).items()}},
              "cache_aware": {"summary": ca_res["summary"], "parameters": ca_res["parameters"]},
              "bench_decode": b, "evals": {k: {"policy": v["policy"], "stepwise": v["stepwise"],
                                                 "lm_eval": v.get("lm_eval")} for k, v in evals.items()},
              "gates": summary_rows}
    report["report_md"] = str(rep / "report.md")
    write_json(rep / "report.json", report)
    md = [f"# expertcache quickstart report ({rep.name})", "",
          f"Total {total_s / 60:.1f} min on this machine. Every figure below is in `report.json`; each step's command "
          "is listed at the end.", "",
          "## Base model (smoke)", "",
          "Validation perplexity: " + ", ".join(f"{d} {v:.2f}" for d, v in base_metrics["validation"]["ppl"].items()),
          "", "![base training curve](base_training_curve.png)", "",
          "## Routing of the base (decode tokens, test split)", "",
          f"reuse@lag1 {analysis['routing']['reuse_lag1']['reuse']:.3f} vs chance "
          f"{analysis['routing']['reuse_lag1']['chance']:.3f}; lookahead probe recall " +
          ", ".join(f"d={d}: {v['mean']:.3f}" for d, v in (analysis.get("lookahead_recall") or {}).items()), "",
          *[f"![{p.name}]({p.name})" for p in sorted(rep.glob("analysis_*.png"))], "",
          "## Cache-aware post-training (smoke recipe)", "", results_table([ca_res]), "",
          f"Capacity {cap8['capacity_frac']:g} E: LRU hit {cap8['lru']['hit_rate']:.3f} (base "
          f"{cap8['base_lru']['hit_rate']:.3f}); best router policy {cap8.get('best_router_policy')}.", "",
          "![cache](cache.png)", "",
          "## Decode benchmark (disk tier, capacity 1/4, lookahead probe)", "", bench_table(b), "",
          "## Gate (step-wise token Δppl; lm-eval accuracy tasks; bits/byte cross-check)", "",
          *gate_table(summary_rows)]
    md += ["", "## Commands", "", "| step | seconds | command |", "|---|---|---|"]
    md += [f"| {s['step']} | {s['seconds']} | `{s['command']}` |" for s in steps]
    write_text(rep / "report.md", "\n".join(md) + "\n")
    print("\n" + "\n".join(md[md.index("## Gate (step-wise token Δppl; lm-eval accuracy tasks; bits/byte "
                                         "cross-check)"):]))
    print(f"\nreport: {rep / 'report.md'} (and report.json); total {total_s / 60:.1f} min")
    return report
