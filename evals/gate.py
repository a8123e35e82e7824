"""The pre-registered quality gate (METRICS.md): a candidate against its baseline, both `expertcache eval` JSON.

Δppl: relative change of the step-wise token perplexity (same tokens, cache in order), overall and per domain.
Δacc: change in points of every accuracy task both ran (cloze acc, math exact match). Each comes with a paired
interval (`telemetry.stats`): Δppl a seeded paired bootstrap (the same blocks resampled for both runs), Δacc
Tango's score interval for paired proportions (honest where the runs disagree on few documents or none), and the
verdict is PASS / FAIL / INCONCLUSIVE by the rule in `telemetry.metrics.gate_verdict` (PASS: every interval
inside its threshold; FAIL: one outside; INCONCLUSIVE: one across it, with the sample size that would resolve it).
lm-eval's bits per byte is the cross-check: it fails the gate only when its interval and the token Δppl's
interval exclude each other's sign (all ppl tasks pooled by mean).

The gate cannot pass what it cannot compare: both inputs must come from this format of `expertcache eval`
(`format_version`), measure finite, positive perplexities and finite accuracies in [0, 1], with the same
tokenizer (vocabulary fingerprint), the same step-wise tokens (token counts per domain and a hash of the blocks'
token ids), the same lm-eval tasks with the same limits, sample counts and documents, and the per-block NLLs and
per-document scores the intervals are computed on. Anything else is an `InputError` (exit 2 at the CLI), never
a PASS; FAIL and INCONCLUSIVE are normal results (exit 1 and 3 at the CLI).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.metrics import PASS, GateThresholds, gate_verdict
from expertcache.telemetry.stats import (DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, check_bootstrap, dacc_interval,
                                         dacc_samples_to_resolve, dbpb_interval, dppl_intervals)

ACC_METRICS = {"acc": "acc,none", "exact_match": "exact_match,answer"}
DACC_METHOD = "Tango's paired score interval"  # recorded in the gate JSON beside the intervals
# evals/run.py writes it; 1 (no field) lacks the tokenizer and token-set fingerprints, 2 the per-block NLLs and
# per-document scores of the gate's intervals
EVAL_FORMAT_VERSION = 3


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


def _check_stepwise(res: dict, step, name: str) -> None:
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
    _check_blocks(res, name)


def check_eval(res, name: str = "eval") -> dict:
    """`res` (an `expertcache eval` result) is complete and sane for the gate; an `InputError` naming what is not."""
    if not isinstance(res, dict):
        raise InputError(f"{name}: not an `expertcache eval` result (a JSON object expected, got {type(res).__name__})")
    v = res.get("format_version")
    if v is None:
        raise InputError(f"{name}: written by an older `expertcache eval` (no format_version, no tokenizer or token-set "
                         f"fingerprint); re-run `expertcache eval` on it")
    if v == 2:
        raise InputError(f"{name}: written by `expertcache eval` format 2, which keeps no per-block NLLs or "
                         f"per-document scores; the gate's paired intervals need them: re-run `expertcache eval`")
    if v != EVAL_FORMAT_VERSION:
        raise InputError(f"{name}: eval format_version {v!r}, this gate reads {EVAL_FORMAT_VERSION}; re-run "
                         f"`expertcache eval`")
    step = res.get("stepwise")
    accuracy_only = step is None and "stepwise" in res  # `eval --ppl_blocks 0`: the gate decides on accuracy
    if not accuracy_only:
        _check_stepwise(res, step, name)
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
    _check_docs(res, name)
    if accuracy_only and not _accs(res):
        raise InputError(f"{name}: no step-wise perplexity (--ppl_blocks 0) and no accuracy task: nothing to gate on")
    return res


def _numbers(x, n: int | None = None) -> bool:
    return isinstance(x, list) and bool(x) and (n is None or len(x) == n) and all(_finite(v) for v in x)


def _check_blocks(res: dict, name: str) -> None:
    """The per-block NLLs and token counts of every domain: present, finite, adding up to stepwise.tokens."""
    step = res["stepwise"]
    nll, tok = step.get("block_nll"), step.get("block_tokens")
    if not isinstance(nll, dict) or not isinstance(tok, dict):
        raise InputError(f"{name}: no per-block step-wise NLLs (stepwise.block_nll, block_tokens); the gate's "
                         f"intervals need them: re-run `expertcache eval`")
    doms = set(step["ppl"]) - {"overall"}
    if set(nll) != doms or set(tok) != doms:
        raise InputError(f"{name}: stepwise.block_nll covers {sorted(nll)}, the perplexities {sorted(doms)}")
    for d in sorted(doms):
        if not _numbers(nll[d]) or not _numbers(tok[d], len(nll[d])) or any(t < 1 for t in tok[d]):
            raise InputError(f"{name}: stepwise.block_nll/block_tokens of {d}: not one finite NLL and one token "
                             f"count >= 1 per block")
        ppl = math.exp(min(sum(nll[d]) / sum(tok[d]), 700))
        if not math.isclose(ppl, step["ppl"][d], rel_tol=1e-6):
            raise InputError(f"{name}: the {d} blocks' NLLs give perplexity {ppl:.6g}, stepwise.ppl says "
                             f"{step['ppl'][d]:.6g}: an edited or corrupted eval")


def _doc_metric(r: dict) -> str | None:
    return next((m for m, key in ACC_METRICS.items() if key in r), None)


def _check_docs(res: dict, name: str) -> None:
    """Every gated lm-eval task has its per-document scores (lm_eval_docs): accuracy tasks one 0/1 score per
    document, bits-per-byte tasks one log-likelihood and byte count per document."""
    lm = res.get("lm_eval") or {}
    docs = res.get("lm_eval_docs")
    if lm and not isinstance(docs, dict):
        raise InputError(f"{name}: no per-document lm-eval scores (lm_eval_docs); the gate's intervals need them: "
                         f"re-run `expertcache eval`")
    for task, r in lm.items():
        metric = _doc_metric(r)
        if metric is None and "bits_per_byte,none" not in r:
            continue
        t = docs.get(task)
        if not isinstance(t, dict) or not isinstance(t.get("doc_id"), list) or not t["doc_id"]:
            raise InputError(f"{name}: no per-document scores for {task} (lm_eval_docs[{task!r}]); re-run "
                             f"`expertcache eval`")
        n = len(t["doc_id"])
        if metric is not None and (not _numbers(t.get(metric), n) or any(not 0 <= v <= 1 for v in t[metric])):
            raise InputError(f"{name}: lm_eval_docs[{task!r}][{metric!r}]: not one score in [0, 1] per document")
        if "bits_per_byte,none" in r and (not _numbers(t.get("bpb_ll"), n) or not _numbers(t.get("bpb_bytes"), n)
                                          or any(b <= 0 for b in t["bpb_bytes"])):
            raise InputError(f"{name}: lm_eval_docs[{task!r}]: not one log-likelihood and one positive byte count "
                             f"per document")


def check_comparable(baseline: dict, candidate: dict) -> None:
    """Same tokenizer, same step-wise tokens, same lm-eval tasks and limits; an `InputError` otherwise."""
    tb, tc = baseline["tokenizer"]["vocab_sha256"], candidate["tokenizer"]["vocab_sha256"]
    if tb != tc:
        raise InputError(f"baseline and candidate use different tokenizers (vocabulary {tb[:12]} vs {tc[:12]}): "
                         f"their perplexities are not comparable")
    sb, sc = baseline["stepwise"], candidate["stepwise"]
    if (sb is None) != (sc is None):
        which = "baseline" if sb is None else "candidate"
        raise InputError(f"the {which} has no step-wise perplexity (--ppl_blocks 0) and the other has: evaluate both "
                         f"the same way")
    if sb is not None:
        _comparable_stepwise(sb, sc)
    _comparable_tasks(baseline, candidate)


def _comparable_stepwise(sb: dict, sc: dict) -> None:
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
    if sb["block_tokens"] != sc["block_tokens"]:
        raise InputError("baseline and candidate list different step-wise blocks (stepwise.block_tokens differ, "
                         "same hash): an edited or corrupted eval")
    for name, s in (("baseline", sb), ("candidate", sc)):
        for d, t in s["block_tokens"].items():
            if s["tokens"].get(d) != sum(t):
                raise InputError(f"{name}: the {d} blocks' token counts add up to {sum(t)}, stepwise.tokens says "
                                 f"{s['tokens'].get(d)!r}: an edited or corrupted eval")


def _comparable_tasks(baseline: dict, candidate: dict) -> None:
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
    db, dc = baseline.get("lm_eval_docs") or {}, candidate.get("lm_eval_docs") or {}
    for t in sorted(set(db) & set(dc) & set(lb)):
        if db[t]["doc_id"] != dc[t]["doc_id"] or db[t].get("docs_sha256") != dc[t].get("docs_sha256"):
            raise InputError(f"baseline and candidate ran {t} on different documents (document ids or contents "
                             f"differ); the paired intervals compare the same documents only")


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


def gate(baseline: dict, candidate: dict, th: GateThresholds = GateThresholds(),
         confidence: float = DEFAULT_CONFIDENCE, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict:
    """PASS / FAIL / INCONCLUSIVE of `candidate` against `baseline` on paired intervals at `confidence` (Δppl and
    bits per byte: `resamples` bootstrap resamples, seeded; Δacc: Tango's score interval); an `InputError` when
    the two cannot be compared (see above)."""
    check_bootstrap(confidence, resamples)
    check_eval(baseline, "baseline")
    check_eval(candidate, "candidate")
    check_comparable(baseline, candidate)
    bs, cs = baseline["stepwise"], candidate["stepwise"]
    kw = dict(confidence=confidence, resamples=resamples, seed=seed)
    accuracy_only = bs is None
    if accuracy_only:  # both evals ran with --ppl_blocks 0
        dppl, dppl_iv, iv = {}, {}, {"n_blocks": {}, "max_domain": [None, None, None]}
    else:
        bp, cp = bs["ppl"], cs["ppl"]
        dppl = {d: 100 * (cp[d] / bp[d] - 1) for d in bp if d in cp}
        iv = dppl_intervals(bs["block_nll"], cs["block_nll"], bs["block_tokens"], **kw)
        dppl_iv = {"overall": [dppl["overall"], *iv["overall"][1:]]}
        dppl_iv.update({d: [dppl[d], *v[1:]] for d, v in iv["domains"].items()})
    ba, ca = _accs(baseline), _accs(candidate)
    dacc = {t: ca[t] - ba[t] for t in ba if t in ca}
    lm_b, docs_b, docs_c = baseline.get("lm_eval") or {}, baseline.get("lm_eval_docs") or {}, \
        candidate.get("lm_eval_docs") or {}
    dacc_iv, n_docs, dacc_need = {}, {}, {}
    for t in dacc:
        m = _doc_metric(lm_b[t])
        dacc_iv[t] = [dacc[t], *dacc_interval(docs_b[t][m], docs_c[t][m], confidence, name=t)[1:]]
        dacc_need[t] = dacc_samples_to_resolve(docs_b[t][m], docs_c[t][m], th.acc_points, confidence, name=t)
        n_docs[t] = len(docs_b[t]["doc_id"])
    v = gate_verdict(dppl_iv, dacc_iv, iv["n_blocks"], n_docs, th, dacc_need)
    fails = v["failures"]
    shared = _ppl_tasks(baseline) & _ppl_tasks(candidate)
    b0, b1 = _bpb(baseline, shared), _bpb(candidate, shared)
    cross = None
    if b0 is not None and b1 is not None and not accuracy_only:
        d_bpb = b1 - b0
        _, lo, hi = dbpb_interval({t: docs_b[t]["bpb_ll"] for t in shared}, {t: docs_c[t]["bpb_ll"] for t in shared},
                                  {t: docs_b[t]["bpb_bytes"] for t in shared}, **kw)
        # like with like: bits per byte on one domain's text against that domain's token Δppl, else overall
        domains = {t.removeprefix("ec_ppl_") for t in shared}
        against = domains.pop() if len(domains) == 1 and next(iter(domains)) in dppl_iv else "overall"
        _, plo, phi = dppl_iv[against]
        disagree = (lo > 0 and phi < 0) or (hi < 0 and plo > 0)  # the intervals exclude each other's sign
        cross = {"tasks": sorted(shared), "bits_per_byte_baseline": b0, "bits_per_byte_candidate": b1,
                 "delta": d_bpb, "delta_ci95": [lo, hi], "against_dppl": against, "agrees_in_sign": not disagree}
        if disagree:
            fails.append(f"lm-eval bits/byte moved {d_bpb:+.4f} [{lo:+.4f}, {hi:+.4f}] against the token Δppl "
                         f"({against}) {dppl[against]:+.2f}% [{plo:+.2f}, {phi:+.2f}]: the two measures' intervals "
                         f"exclude each other's sign")
    verdict = "FAIL" if fails else v["gate"]
    worst = max((d for d in dppl if d != "overall"), key=lambda d: dppl[d], default=None)
    return {"baseline": _side(baseline), "candidate": _side(candidate),
            "gate": verdict, "pass": verdict == PASS,
            "dppl_percent": dppl, "dacc_points": dacc,
            "dppl_overall_ci95": dppl_iv["overall"][1:] if dppl_iv else None,
            "dppl_max_domain_percent": dppl[worst] if worst else None,
            "dppl_max_domain": worst, "dppl_max_domain_ci95": iv["max_domain"][1:] if worst else None,
            "accuracy_only": accuracy_only,
            "dppl_ci95": {d: x[1:] for d, x in dppl_iv.items()}, "dacc_ci95": {t: x[1:] for t, x in dacc_iv.items()},
            "n_blocks": min(iv["n_blocks"].values(), default=0), "n_blocks_per_domain": iv["n_blocks"],
            "n_documents": n_docs,
            "confidence": confidence, "resamples": resamples, "seed": seed, "dacc_method": DACC_METHOD,
            "bpb_crosscheck": cross, "thresholds": asdict(th),
            "failures": fails, "unresolved": v["unresolved"], "resolve": v["resolve"]}


TASK_FIELDS = ("lm_eval", "lm_eval_samples", "lm_eval_docs", "n_documents", "lm_eval_versions")


def with_tasks(r: dict, p: dict, tasks: list[str]) -> dict:
    """Eval `r` with `tasks`' documents replaced by eval `p`'s (the same model and serving, those tasks on more
    documents: a growing gate's round, or a frontier row decided on more documents); every other task and the
    step-wise part stay `r`'s; both sides of a gate are replaced alike (their documents are compared). `grown`
    records each replaced task's documents before and after, and the seconds of both evaluations are added."""
    out = dict(r)
    for k in TASK_FIELDS:
        out[k] = {**(r.get(k) or {}), **{t: v for t, v in (p.get(k) or {}).items() if t in tasks}}
    mine = [n for n in p.get("sample_notes", []) if n.split(":", 1)[0] in tasks]
    out["sample_notes"] = [n for n in r.get("sample_notes", []) if n.split(":", 1)[0] not in tasks] + mine
    out["grown"] = {t: [(r.get("n_documents") or {}).get(t), out["n_documents"].get(t)] for t in tasks}
    out["seconds"] = round((r.get("seconds") or 0) + (p.get("seconds") or 0), 1)
    return out


def _side(res: dict) -> dict:
    """What one side of the gate evaluated: enough for `eval --size_from` to evaluate that configuration again."""
    shapes = [s for s in (res.get("stepwise_blocks") or {}).values() if isinstance(s, list) and len(s) == 2]
    return {"model": res.get("model"), "policy": res.get("policy"), "engine": res.get("engine"),
            "tasks": res.get("tasks"), "dtype": res.get("dtype"), "seq_len": shapes[0][1] if shapes else None}


def format_gate(g: dict) -> str:
    c = g.get("confidence", DEFAULT_CONFIDENCE)
    lines = [f"gate: {g['gate']}  ({g['candidate']['model']} [{g['candidate']['policy']}] vs "
             f"{g['baseline']['model']} [{g['baseline']['policy']}]; {100 * c:g}% paired intervals: Δppl bootstrap, "
             f"{g['resamples']} resamples, seed {g['seed']}; Δacc {DACC_METHOD})"]
    if g.get("accuracy_only"):
        lines.append("  no step-wise perplexity in either eval (--ppl_blocks 0): this verdict rests on accuracy alone")
    nb = {d: f"{n} blocks" for d, n in g["n_blocks_per_domain"].items()}
    nb["overall"] = f"{g['n_blocks']} blocks per domain"
    lines += [f"  Δppl {d:<16} {v:+7.2f}%  [{g['dppl_ci95'][d][0]:+.2f}, {g['dppl_ci95'][d][1]:+.2f}]  ({nb[d]})"
              for d, v in g["dppl_percent"].items()]
    lines += [f"  Δacc {t:<16} {v:+7.2f} pts [{g['dacc_ci95'][t][0]:+.2f}, {g['dacc_ci95'][t][1]:+.2f}]  "
              f"({g['n_documents'][t]} documents)" for t, v in g["dacc_points"].items()]
    if g["bpb_crosscheck"]:
        x = g["bpb_crosscheck"]
        lines.append(f"  lm-eval bits/byte {x['bits_per_byte_baseline']:.4f} -> {x['bits_per_byte_candidate']:.4f} "
                     f"(Δ {x['delta']:+.4f} [{x['delta_ci95'][0]:+.4f}, {x['delta_ci95'][1]:+.4f}]; consistent with "
                     f"the token Δppl: {x['agrees_in_sign']})")
    lines += [f"  FAIL: {f}" for f in g["failures"]]
    lines += [f"  unresolved: {u}" for u in g["unresolved"]]
    return "\n".join(lines)
