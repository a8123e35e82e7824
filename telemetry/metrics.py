"""The pre-registered quality gate's rule (METRICS.md), the one place it is written: the thresholds and which of
a candidate's changes break them. `expertcache.evals.gate` applies it to two `expertcache eval` results; the
trainer applies it to the perplexities it measures at the end of a post-training run."""

from __future__ import annotations

from dataclasses import dataclass


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
