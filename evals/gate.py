"""The pre-registered quality gate (METRICS.md): a candidate against its baseline, both `expertcache eval` JSON.

Δppl: relative change of the step-wise token perplexity (same tokens, cache in order), overall and per domain.
Δacc: change in points of every accuracy task both ran (cloze acc, math exact match). lm-eval's bits per byte
is the cross-check: its change must have the sign of the token Δppl, overall (all ppl tasks pooled by mean).

The gate cannot pass what it cannot compare: both inputs must come from this format of `expertcache eval`
(`format_version`), measure finite, positive perplexities and finite accuracies in [0, 1], with the same
tokenizer (vocabulary fingerprint), the same step-wise tokens (token counts per domain and a hash of the blocks'
token ids) and the same lm-eval tasks with the same limits and sample counts. Anything else is an `InputError`
(exit 2 at the CLI), never a PASS; FAIL is a normal result.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.metrics import GateThresholds, gate_failures

ACC_METRICS = {"acc": "acc,none", "exact_match": "exact_match,answer"}
EVAL_FORMAT_VERSION = 2  # evals/run.py writes it; 1 (no field) lacks the tokenizer and token-set fingerprints


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


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_eval(res, name: str = "eval") -> dict:
    """`res` (an `expertcache eval` result) is complete and sane for the gate; an `InputError` naming what is not."""
    if not isinstance(res, dict):
        raise InputError(f"{name}: not an `expertcache eval` result (a JSON object expected, got {type(res).__name__})")
    v = res.get("format_version")
    if v is None:
        raise InputError(f"{name}: written by an older `expertcache eval` (no format_version, no tokenizer or token-set "
                         f"fingerprint); re-run `expertcache eval` on it")
    if v != EVAL_FORMAT_VERSION:
        raise InputError(f"{name}: eval format_version {v!r}, this gate reads {EVAL_FORMAT_VERSION}; re-run "
                         f"`expertcache eval`")
    step = res.get("stepwise")
    if not isinstance(step, dict) or not isinstance(step.get("ppl"), dict) or not step["ppl"]:
        raise InputError(f"{name}: no step-wise perplexity (stepwise.ppl); the gate's Δppl needs it")
    if "overall" not in step["ppl"]:
        raise InputError(f"{name}: stepwise.ppl has no 'overall' entry")
    for d, p in step["ppl"].items():
        if not _finite(p) or p <= 0:
            raise InputError(f"{name}: step-wise perplexity {d} = {p!r}: not a finite positive number "
                             f"(corrupted weights, or a broken eval)")
    if not isinstance(step.get("tokens"), dict) or not step["tokens"]:
        raise InputError(f"{name}: no step-wise token counts (stepwise.tokens)")
    if not isinstance(step.get("blocks_sha256"), str):
        raise InputError(f"{name}: no hash of the step-wise blocks (stepwise.blocks_sha256); re-run `expertcache eval`")
    tok = res.get("tokenizer")
    if not isinstance(tok, dict) or not isinstance(tok.get("vocab_sha256"), str):
        raise InputError(f"{name}: no tokenizer fingerprint (tokenizer.vocab_sha256); re-run `expertcache eval`")
    lm = res.get("lm_eval")
    if lm is not None and not isinstance(lm, dict):
        raise InputError(f"{name}: lm_eval is {type(lm).__name__}, expected an object of task results")
    for task, r in (lm or {}).items():
        if not isinstance(r, dict):
            raise InputError(f"{name}: lm_eval[{task!r}] is not an object")
        for key in ACC_METRICS.values():
            if key in r and (not _finite(r[key]) or not 0 <= r[key] <= 1):
                raise InputError(f"{name}: {task} {key} = {r[key]!r}: not a finite accuracy in [0, 1]")
        if "bits_per_byte,none" in r and (not _finite(r["bits_per_byte,none"]) or r["bits_per_byte,none"] <= 0):
            raise InputError(f"{name}: {task} bits_per_byte = {r['bits_per_byte,none']!r}: not a finite positive "
                             f"number")
    return res


def check_comparable(baseline: dict, candidate: dict) -> None:
    """Same tokenizer, same step-wise tokens, same lm-eval tasks and limits; an `InputError` otherwise."""
    tb, tc = baseline["tokenizer"]["vocab_sha256"], candidate["tokenizer"]["vocab_sha256"]
    if tb != tc:
        raise InputError(f"baseline and candidate use different tokenizers (vocabulary {tb[:12]} vs {tc[:12]}): "
                         f"their perplexities are not comparable")
    sb, sc = baseline["stepwise"], candidate["stepwise"]
    if sb["tokens"] != sc["tokens"]:
        raise InputError(f"baseline and candidate were measured on different step-wise tokens (token counts "
                         f"{sb['tokens']} vs {sc['tokens']}); evaluate both with the same corpus, split, "
                         f"--ppl_blocks and --seq_len")
    if sb["blocks_sha256"] != sc["blocks_sha256"]:
        raise InputError(f"baseline and candidate were measured on different step-wise token ids (blocks hash "
                         f"{sb['blocks_sha256'][:12]} vs {sc['blocks_sha256'][:12]}, same counts): a different "
                         f"corpus or split")
    if set(sb["ppl"]) != set(sc["ppl"]):
        raise InputError(f"baseline and candidate have different perplexity domains: {sorted(sb['ppl'])} vs "
                         f"{sorted(sc['ppl'])}")
    lb, lc = baseline.get("lm_eval") or {}, candidate.get("lm_eval") or {}
    if set(lb) != set(lc):
        raise InputError(f"baseline and candidate ran different lm-eval tasks: {sorted(lb)} vs {sorted(lc)}; the "
                         f"gate compares accuracy on the same tasks only")
    if lb and baseline.get("limit") != candidate.get("limit"):
        raise InputError(f"baseline and candidate ran lm-eval with different limits ({baseline.get('limit')} vs "
                         f"{candidate.get('limit')} documents per task)")
    nb, nc = baseline.get("lm_eval_samples") or {}, candidate.get("lm_eval_samples") or {}
    for t in sorted(set(nb) & set(nc)):
        if nb[t] != nc[t]:
            raise InputError(f"baseline and candidate ran {t} on different documents ({nb[t]} vs {nc[t]} samples)")


def load_eval(path: str | Path, name: str | None = None) -> dict:
    """An `expertcache eval` JSON file, checked (`check_eval`); a one-line `InputError` for anything else."""
    p = Path(path)
    name = name or str(p)
    if not p.is_file():
        raise InputError(f"{name}: no such file")
    try:
        res = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{name}: not a readable eval JSON ({str(e).splitlines()[0][:120]})") from None
    return check_eval(res, name)


def gate(baseline: dict, candidate: dict, th: GateThresholds = GateThresholds()) -> dict:
    """PASS/FAIL of `candidate` against `baseline`; an `InputError` when the two cannot be compared (see above)."""
    check_eval(baseline, "baseline")
    check_eval(candidate, "candidate")
    check_comparable(baseline, candidate)
    bp, cp = baseline["stepwise"]["ppl"], candidate["stepwise"]["ppl"]
    dppl = {d: 100 * (cp[d] / bp[d] - 1) for d in bp if d in cp}
    ba, ca = _accs(baseline), _accs(candidate)
    dacc = {t: ca[t] - ba[t] for t in ba if t in ca}
    fails = gate_failures(dppl, dacc, th)
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
