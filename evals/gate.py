"""The pre-registered quality gate (METRICS.md): a candidate against its baseline, both `expertcache eval` JSON.

Δppl: relative change of the step-wise token perplexity (same tokens, cache in order), overall and per domain.
Δacc: change in points of every accuracy task both ran (cloze acc, math exact match). lm-eval's bits per byte
is the cross-check: its change must have the sign of the token Δppl, overall (all ppl tasks pooled by mean).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

ACC_METRICS = {"acc": "acc,none", "exact_match": "exact_match,answer"}


@dataclass
class GateThresholds:
    ppl_overall: float = 1.0  # % relative, at most
    ppl_domain: float = 2.0  # % relative in every domain, at most
    acc_points: float = -1.0  # points, at least (on every accuracy task)


def _accs(res: dict) -> dict[str, float]:
    out = {}
    for task, r in (res.get("lm_eval") or {}).items():
        for key in ACC_METRICS.values():
            if key in r:
                out[task] = 100 * float(r[key])
    return out


def _bpb(res: dict, tasks: set[str]) -> float | None:
    """Mean bits per byte over `tasks` (the rolling-perplexity tasks both runs have)."""
    v = [float(r["bits_per_byte,none"]) for t, r in (res.get("lm_eval") or {}).items() if t in tasks]
    return sum(v) / len(v) if v else None


def _ppl_tasks(res: dict) -> set[str]:
    return {t for t, r in (res.get("lm_eval") or {}).items() if "bits_per_byte,none" in r}


def gate(baseline: dict, candidate: dict, th: GateThresholds = GateThresholds()) -> dict:
    bp, cp = baseline["stepwise"]["ppl"], candidate["stepwise"]["ppl"]
    dppl = {d: 100 * (cp[d] / bp[d] - 1) for d in bp if d in cp}
    ba, ca = _accs(baseline), _accs(candidate)
    dacc = {t: ca[t] - ba[t] for t in ba if t in ca}
    fails = []
    if dppl.get("overall", 0) > th.ppl_overall:
        fails.append(f"Δppl overall {dppl['overall']:+.2f}% > +{th.ppl_overall:g}%")
    fails += [f"Δppl {d} {v:+.2f}% > +{th.ppl_domain:g}%" for d, v in dppl.items()
              if d != "overall" and v > th.ppl_domain]
    fails += [f"Δacc {t} {v:+.2f} pts < {th.acc_points:+g}" for t, v in dacc.items() if v < th.acc_points]
    shared = _ppl_tasks(baseline) & _ppl_tasks(candidate)
    b0, b1 = _bpb(baseline, shared), _bpb(candidate, shared)
    cross = None
    if b0 is not None and b1 is not None:
        d_bpb = b1 - b0
        cross = {"tasks": sorted(shared), "bits_per_byte_baseline": b0, "bits_per_byte_candidate": b1, "delta": d_bpb,
                 "agrees_in_sign": (d_bpb >= 0) == (dppl.get("overall", 0) >= 0) or abs(d_bpb) < 1e-9
                 or abs(dppl.get("overall", 0)) < 1e-9}
        if not cross["agrees_in_sign"]:
            fails.append(f"lm-eval bits/byte moved {d_bpb:+.4f} against the token Δppl "
                         f"{dppl.get('overall', 0):+.2f}%: the two measures disagree in sign")
    return {"baseline": {"model": baseline.get("model"), "policy": baseline.get("policy")},
            "candidate": {"model": candidate.get("model"), "policy": candidate.get("policy")},
            "dppl_percent": dppl, "dacc_points": dacc, "bpb_crosscheck": cross, "thresholds": asdict(th),
            "pass": not fails, "failures": fails}


def format_gate(g: dict) -> str:
    lines = [f"gate: {'PASS' if g['pass'] else 'FAIL'}  ({g['candidate']['model']} [{g['candidate']['policy']}] vs "
             f"{g['baseline']['model']} [{g['baseline']['policy']}])"]
    lines += [f"  Δppl {d:<8} {v:+7.2f}%" for d, v in g["dppl_percent"].items()]
    lines += [f"  Δacc {t:<16} {v:+7.2f} pts" for t, v in g["dacc_points"].items()]
    if g["bpb_crosscheck"]:
        c = g["bpb_crosscheck"]
        lines.append(f"  lm-eval bits/byte {c['bits_per_byte_baseline']:.4f} -> {c['bits_per_byte_candidate']:.4f} "
                     f"(agrees in sign: {c['agrees_in_sign']})")
    lines += [f"  FAIL: {f}" for f in g["failures"]]
    return "\n".join(lines)
