"""The pre-registered quality gate's rule (METRICS.md), the one place it is written: the thresholds and which of
a candidate's changes break them. `expertcache.evals.gate` applies it to two `expertcache eval` results; the
trainer applies it to the perplexities it measures at the end of a post-training run.

The decision rule on intervals (`gate_verdict`; the intervals come from `telemetry.stats`: a paired bootstrap for
Δppl, Tango's paired score interval for Δacc):
- PASS when every interval lies inside its threshold: the upper bound of Δppl overall <= `ppl_overall`, of every
  domain's Δppl <= `ppl_domain`, and the lower bound of every task's Δacc >= `acc_points`;
- FAIL when any interval lies outside: a lower bound of a Δppl above its threshold, or an upper bound of a Δacc
  below `acc_points`;
- INCONCLUSIVE otherwise (an interval straddles its threshold), with the blocks per domain and documents per task
  that would resolve it at the observed variance: `n' = ceil(n * (w / |estimate - threshold|)^2)`, w the
  distance from the estimate to the interval's end on the threshold's side (`telemetry.stats.samples_to_resolve`);
  for Δacc the caller may give the score interval's own count (`telemetry.stats.dacc_samples_to_resolve`).
A difference measured on a single block per domain (or a single document) has no interval: INCONCLUSIVE unless it
is exactly zero. A point estimate is the degenerate interval [x, x]: `gate_failures` is the same rule without
intervals (kept for figures that have no per-item data).
"""

from __future__ import annotations

from dataclasses import dataclass

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"


@dataclass
class GateThresholds:
    ppl_overall: float = 1.0  # Δppl overall, % relative, at most
    ppl_domain: float = 2.0  # Δppl in every domain, % relative, at most
    acc_points: float = -1.0  # Δacc on every accuracy task, points, at least


def gate_failures(dppl: dict[str, float], dacc: dict[str, float], th: GateThresholds = GateThresholds()) -> list[str]:
    """One line per broken threshold: `dppl` in % per domain and 'overall', `dacc` in points per task."""
    fails = []
    if dppl.get("overall", 0) > th.ppl_overall:
        fails.append(f"Δppl overall {dppl['overall']:+.2f}% > +{th.ppl_overall:g}%")
    fails += [f"Δppl {d} {v:+.2f}% > +{th.ppl_domain:g}%" for d, v in dppl.items()
              if d != "overall" and v > th.ppl_domain]
    fails += [f"Δacc {t} {v:+.2f} pts < {th.acc_points:+g}" for t, v in dacc.items() if v < th.acc_points]
    return fails


def gate_verdict(dppl: dict[str, list[float]], dacc: dict[str, list[float]], n_blocks: dict[str, int],
                 n_documents: dict[str, int], th: GateThresholds = GateThresholds(),
                 dacc_resolve: dict[str, int | None] | None = None) -> dict:
    """PASS / FAIL / INCONCLUSIVE from intervals (the rule above). `dppl`: {domain or 'overall': [est, low, high]}
    in %; `dacc`: {task: [est, low, high]} in points; `n_blocks`: blocks per domain; `n_documents`: per task;
    `dacc_resolve`: {task: documents that would resolve its Δacc} where the interval's method knows it exactly
    (the score interval's: the variance rule below assumes a half-width falling as 1/sqrt(n)).

    Returns {'gate', 'failures' (one line per interval outside its threshold), 'unresolved' (one line per interval
    across its threshold, with the sample size that would resolve it), 'resolve': {'blocks_per_domain': n or
    None, 'documents': {task: n}}} (-1: the estimate sits on the threshold, no sample size resolves it)."""
    from expertcache.telemetry.stats import samples_to_resolve

    fails, open_, blocks, docs = [], [], [], {}
    for d, (est, lo, hi) in dppl.items():
        t = th.ppl_overall if d == "overall" else th.ppl_domain
        what = "Δppl overall" if d == "overall" else f"Δppl {d}"
        n = min(n_blocks.values()) if d == "overall" else n_blocks[d]
        if n < 2 and est != 0:  # one block per domain: a difference with no estimate of its spread
            blocks.append(2)
            open_.append(f"{what} {est:+.2f}% on one block per domain: no interval; >= 2 blocks per domain needed")
        elif lo > t:
            fails.append(f"{what} {est:+.2f}% [{lo:+.2f}, {hi:+.2f}] > +{t:g}%")
        elif hi > t:
            need = samples_to_resolve(est, lo, hi, t, n)
            blocks.append(need)
            open_.append(f"{what} {est:+.2f}% [{lo:+.2f}, {hi:+.2f}] straddles +{t:g}%: "
                         + ("the estimate sits on the threshold" if need == -1 else
                            f"~{need} blocks per domain (now {n}) would resolve it"))
    for task, (est, lo, hi) in dacc.items():
        t, n = th.acc_points, n_documents[task]
        if n < 2 and est != 0:
            docs[task] = 2
            open_.append(f"Δacc {task} {est:+.2f} pts on one document: no interval; >= 2 documents needed")
        elif hi < t:
            fails.append(f"Δacc {task} {est:+.2f} pts [{lo:+.2f}, {hi:+.2f}] < {t:+g}")
        elif lo < t:
            need = (dacc_resolve or {}).get(task) or samples_to_resolve(est, lo, hi, t, n)
            docs[task] = need
            open_.append(f"Δacc {task} {est:+.2f} pts [{lo:+.2f}, {hi:+.2f}] straddles {t:+g}: "
                         + ("the estimate sits on the threshold" if need == -1 else
                            f"~{need} documents (now {n}) would resolve it"))
    verdict = FAIL if fails else INCONCLUSIVE if open_ else PASS
    return {"gate": verdict, "failures": fails, "unresolved": open_,
            "resolve": {"blocks_per_domain": (-1 if -1 in blocks else max(blocks)) if blocks else None,
                        "documents": docs}}
