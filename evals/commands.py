"""The evaluation commands: plain typed functions; `expertcache` builds its command line from their signatures and
docstrings (expertcache.recipes.cli)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Optional

from expertcache.runtime.engine.config import EngineConfig
from expertcache.telemetry.errors import InputError

from .taskdata import DEFAULT_TASKS, LOCAL_TASKS, PPL_BLOCKS, TASK_DOCS

from expertcache.telemetry.hf import DTYPE_NAMES as DTYPES  # noqa: E402 - the one dtype map


def _check(dtype: str, limit: Optional[int], ppl_blocks: int, seq_len: int, include_path: Optional[str],
           tasks=None) -> None:
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    if (limit is not None and limit < 1) or ppl_blocks < 0 or seq_len < 2:
        raise InputError("--limit must be >= 1, --ppl_blocks >= 0 (0: no step-wise perplexity) and --seq_len >= 2")
    if ppl_blocks == 0 and tasks is not None and not tasks:
        raise InputError("--ppl_blocks 0 and --tasks []: nothing to evaluate")
    if include_path is not None and not Path(include_path).is_dir():
        raise InputError(f"--include_path {include_path} is not a folder of task YAMLs")


def eval(model: str, engine: Optional[EngineConfig] = None, tasks: Optional[list[str]] = None,
         corpus: str = "data/corpus", out: Optional[str] = None, task_dir: Optional[str] = None,
         limit: Optional[int] = None, ppl_blocks: int = PPL_BLOCKS, seq_len: int = 128,
         include_path: Optional[str] = None,
         dtype: str = "fp32", device: str = "cpu", size_from: Optional[str] = None, ppl_file: Optional[str] = None,
         ppl_field: str = "text", stepwise: str = "auto", target_width: Optional[float] = None,
         accuracy: str = "token") -> dict:
    """lm-eval tasks and the step-wise token perplexity of a checkpoint, plain or served by the offload engine.

    The JSON keeps every step-wise block's NLL and every document's score (the gate's paired intervals) and
    reports the samples: `n_blocks` per domain, `n_documents` per task, and `sample_notes` where the held-out
    text had fewer than asked. `--size_from GATE.json` sizes the sample from an INCONCLUSIVE gate: the blocks per
    domain and documents per task that would resolve it at the variance it observed, for the configuration that
    gate compared (its tasks, and the engine options of the side --model names), or refuses when told another.

    Args:
        model: HF checkpoint: a local directory or a hub id (from the local cache while HF_HUB_OFFLINE=1)
        engine: serve the model through the offload engine with these options (absent: the plain model, or for
            an `expertcache quantize` checkpoint, which has no plain form, every expert resident);
            e.g. --engine.capacity 0.25 --engine.miss reroute --engine.tau 0.1
        tasks: local tasks (evals/tasks/), any lm-eval task (e.g. arc_easy), tasks in --include_path; [] for none
            (default: ec_ppl_prose, ec_cloze_prose, ec_math_em; with --size_from, the gate's tasks)
        corpus: corpus whose held-out split gives the local ec_* tasks' documents and the perplexity blocks (not
            read when neither needs it: other tasks and --ppl_file or --ppl_blocks 0)
        out: JSON to write (lm-eval's own JSON beside it)
        task_dir: where the task files are built (default: beside --out)
        limit: documents per task (lm-eval's limit; the local tasks hold 2,000 each, from held-out text only, or
            as many as this asks where the held-out text has them)
        ppl_blocks: step-wise perplexity blocks per domain (0: none; a gate on this eval then decides on accuracy
            alone, and says so)
        seq_len: tokens per step-wise block
        include_path: a folder of your own lm-eval task YAMLs; their names then work in --tasks
        dtype: fp32 (the gates' figures) | bf16 | fp16 | auto (the checkpoint's own)
        device: cpu | cuda | auto (the GPU when there is one)
        ppl_file: the step-wise perplexity on your own text instead of the corpus: plain text (documents separated
            by blank lines) or JSONL (the text under --ppl_field); one domain, named after the file
        ppl_field: the JSONL field holding the text
        size_from: an `expertcache gate` JSON: take --ppl_blocks and --limit from the sample it says would resolve
            it (never fewer than given here)
        target_width: with --size_from: size --ppl_blocks instead so that every Δppl interval of that gate (each
            domain and overall) would be at most this wide on either side of its estimate, in %, at the paired
            variance the gate observed (e.g. 0.5 for ±0.5%)
        stepwise: how the step-wise blocks are fed: auto (whole blocks per forward for the plain model and
            lossless policies, one token at a time through the KV cache for lossy ones) | token | batched (refused
            under a lossy policy)
        accuracy: how lm-eval's documents meet a lossy policy: token (one token at a time through the engine, its
            cache warm from one document to the next) | replay (reroute only: the plain model in batched forwards,
            the reroute rule replayed in its routers per document, each from an empty cache; on the base-tiny
            model 24 cloze documents took 798 s token by token and 47-90 s replayed, mostly set-up; for thousands
            of documents; loglikelihood tasks only). The step-wise blocks still go through the engine token by
            token
    """
    from expertcache.telemetry.progress import Progress

    from .run import evaluate

    from expertcache.telemetry.atomic import check_output

    sizing = None
    if target_width is not None and (size_from is None or not target_width > 0):
        raise InputError("--target_width needs --size_from GATE.json (the paired variance it sizes from) and must "
                         "be > 0 (a half-width in %)")
    if size_from is not None:
        engine, tasks = gated_configuration(size_from, model, engine, tasks, seq_len, dtype)
        ppl_blocks, limit, sizing = sample_from_gate(size_from, ppl_blocks, limit, target_width)
    tasks = list(DEFAULT_TASKS) if tasks is None else tasks
    _check(dtype, limit, ppl_blocks, seq_len, include_path, tasks)
    check_output(out, model, ppl_file)
    if engine is not None:
        engine.check()
    with Progress(transient=True) as prog:
        task = prog.add_task("step-wise perplexity", total=ppl_blocks * (1 if ppl_file else 3))
        res = evaluate(model, corpus, engine, tasks, out, task_dir, limit, ppl_blocks, seq_len,
                       include_path=include_path, dtype=dtype, device=device, progress=lambda: prog.advance(task),
                       ppl_file=ppl_file, ppl_field=ppl_field, stepwise=stepwise, accuracy=accuracy)
    for note in (sizing or {}).get("notes", []) + res.get("sample_notes", []):  # fewer than asked: say so
        print(f"eval: {note}", file=sys.stderr)
    if sizing is not None:
        res["sizing"] = sizing
        if out:
            from expertcache.telemetry.atomic import write_json

            write_json(out, res)
    return {k: v for k, v in res.items() if k != "lm_eval_versions"}


# engine options that change where experts live and how fast they move, not what a served model computes
_SPEED_ONLY = {"tier", "device", "kernel", "workers", "threads", "max_inflight_bytes"}


def _read_gate(path: str) -> dict:
    import json

    try:
        g = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"--size_from {path}: not a readable gate JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(g, dict) or not isinstance(g.get("resolve"), dict):
        raise InputError(f"--size_from {path}: not an `expertcache gate` JSON with intervals (no 'resolve'); "
                         f"gate with this version first")
    return g


def gated_configuration(path: str, model: str, engine: Optional[EngineConfig], tasks: Optional[list[str]],
                        seq_len: int, dtype: str) -> tuple[Optional[EngineConfig], list[str]]:
    """(engine, tasks) of the side of the gate in `path` that this eval repeats, so that its sample size applies
    (#46: a gate on reroute at C=0.25 over two tasks sized a plain eval on seven, without a word). The side is the
    one whose model and engine options are `model` and `engine` (options that only move bytes faster aside), or,
    with no `engine` given, the one side whose model it is (its options adopted, and said so). Tasks: the gate's
    when none are given, else a subset of them. A one-line `InputError` for anything else."""
    import dataclasses

    g = _read_gate(path)
    sides = {k: g.get(k) for k in ("baseline", "candidate")}
    if not all(isinstance(s, dict) and "engine" in s and isinstance(s.get("tasks"), list) for s in sides.values()):
        raise InputError(f"--size_from {path}: the gate does not record the configurations it compared (written by "
                         f"an older version); gate again with this version")

    def same_model(a: str, b) -> bool:
        return a == b or (isinstance(b, str) and Path(a).exists() and Path(b).exists()
                          and Path(a).resolve() == Path(b).resolve())

    def options(e) -> Optional[dict]:
        d = dataclasses.asdict(e) if isinstance(e, EngineConfig) else e
        return None if d is None else {k: v for k, v in d.items() if k not in _SPEED_ONLY}

    mine = [k for k, s in sides.items() if same_model(model, s.get("model"))]
    match = [k for k in mine if options(sides[k]["engine"]) == options(engine)]
    if not match and engine is None and len(mine) == 1:
        match = mine  # that side's engine options, not given again
    if not match:
        described = "; ".join(f"{k} {s.get('model')} [{s.get('policy')}]" for k, s in sides.items())
        given = "plain" if engine is None else engine.label()
        raise InputError(f"--size_from {path}: this eval ({model} [{given}]) is neither side of that gate "
                         f"({described}); give --model and the --engine.* options of the side to size")
    side = sides[match[0]]
    if engine is None and side["engine"] is not None:
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        engine = EngineConfig(**{k: v for k, v in side["engine"].items() if k in known})
        engine.check()
        said = f"served as the gate's {match[0]} was ({engine.label()}, policy {engine.policy})"
    else:
        said = f"the gate's {match[0]} ({side.get('policy')})"
    gated = side["tasks"]
    if tasks is None:
        tasks = list(gated)
    elif not set(tasks) <= set(gated):
        raise InputError(f"--size_from {path}: the gate ran the tasks {', '.join(gated) or '(none)'}; "
                         f"{', '.join(sorted(set(tasks) - set(gated)))} were not gated (omit --tasks to run the "
                         f"gate's, or give some of them)")
    for flag, given_v, gated_v in (("--seq_len", seq_len, side.get("seq_len")),
                                   ("--dtype", dtype, side.get("dtype"))):
        if gated_v is not None and given_v != gated_v:
            raise InputError(f"--size_from {path}: the gate's evals used {flag} {gated_v}, this one {given_v}: "
                             f"pass {flag} {gated_v}")
    print(f"eval: --size_from: {said} on {', '.join(tasks) or 'no tasks'}", file=sys.stderr)
    return engine, tasks


def sample_from_gate(path: str, ppl_blocks: int, limit: Optional[int], target_width: Optional[float] = None
                     ) -> tuple[int, Optional[int], dict]:
    """(ppl_blocks, limit, what was decided) from a gate JSON's `resolve`: the blocks per domain and the largest
    documents per task that would resolve its INCONCLUSIVE intervals at the observed variance; with `target_width`
    (in %), the blocks per domain at which its widest Δppl half-width would shrink to it (a half-width falls as
    1/sqrt(n)); a one-line `InputError` for a file that is not a gate result."""
    p = Path(path)
    g = _read_gate(path)
    r = g["resolve"]
    if "blocks_per_domain" not in r or not isinstance(r.get("documents"), dict):
        raise InputError(f"--size_from {path}: not an `expertcache gate` JSON with intervals (no 'resolve'); "
                         f"gate with this version first")
    notes = []
    b = r["blocks_per_domain"]
    if target_width is not None:
        ivs = [v for v in (g.get("dppl_ci95") or {}).values() if isinstance(v, list) and len(v) == 2
               and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)]
        n0 = g.get("n_blocks")
        if not ivs or not isinstance(n0, int) or n0 < 1:
            raise InputError(f"--size_from {path}: the gate has no Δppl intervals to size --target_width from")
        half = max((hi - lo) / 2 for lo, hi in ivs)
        if not half > 0:
            raise InputError(f"--size_from {path}: the gate's Δppl intervals have no width to size --target_width from")
        b = max(n0, math.ceil(n0 * (half / target_width) ** 2))
        notes.append(f"the gate's widest Δppl interval was ±{half:.3g}% on {n0} blocks per domain: ~{b} give "
                     f"±{target_width:g}%")
        if b > ppl_blocks:
            ppl_blocks = b
        b = None
    if b == -1:
        notes.append("a Δppl estimate sits on its threshold: no number of blocks resolves it")
    elif isinstance(b, int) and b > ppl_blocks:
        ppl_blocks = b
    docs = [n for n in r["documents"].values() if isinstance(n, int)]
    if -1 in docs:
        notes.append("a Δacc estimate sits on its threshold: no number of documents resolves it")
    if docs and limit is not None and max(docs) > limit:  # (no limit: every document already)
        limit = max(docs)
    if g.get("gate") != "INCONCLUSIVE" and target_width is None:
        notes.append(f"the gate was {g.get('gate')}: nothing to resolve, the sample is as given")
    return ppl_blocks, limit, {"from": str(p), "ppl_blocks": ppl_blocks, "limit": limit,
                               "target_width": target_width, "notes": notes}


def gate(baseline: str, candidate: str, engine: Optional[EngineConfig] = None, max_dppl: float = 1.0,
         max_dppl_domain: float = 2.0, min_dacc: float = -1.0, tasks: list[str] = list(DEFAULT_TASKS),
         corpus: str = "data/corpus", task_dir: str = "runs/task-data", limit: Optional[int] = None,
         ppl_blocks: int = PPL_BLOCKS, seq_len: int = 128, include_path: Optional[str] = None, dtype: str = "fp32",
         device: str = "cpu", out: Optional[str] = None, confidence: float = 0.95, resamples: int = 2000,
         seed: int = 0, grow: int = 0, max_blocks: int = 256, max_documents: int = 4 * TASK_DOCS) -> dict:
    """PASS / FAIL / INCONCLUSIVE of a candidate against a baseline on paired intervals (METRICS.md thresholds and
    rule): Δppl a seeded paired bootstrap, Δacc Tango's score interval for paired proportions (documents on which
    both answer alike still leave an interval, ±z²/(n+z²): 16 such documents cannot PASS a -1 point limit, ~400
    can); exit status 0 PASS, 1 FAIL, 3 INCONCLUSIVE, 2 bad input.

    PASS: every interval inside its threshold (upper bounds of Δppl, lower bounds of Δacc); FAIL: one outside;
    INCONCLUSIVE: one across it, with the blocks per domain or documents per task that would resolve it.
    `--grow N` (checkpoint directories) then evaluates both again, up to N times, on that sample plus a quarter
    (the estimate moves as the sample grows), within --max_blocks and --max_documents, and says when it cannot.

    Args:
        baseline: checkpoint directory or an `expertcache eval` JSON
        candidate: checkpoint directory or an `expertcache eval` JSON
        engine: serve the candidate with these engine options (checkpoint directories only)
        max_dppl: largest Δppl overall, in %
        max_dppl_domain: largest Δppl in any domain, in %
        min_dacc: smallest Δacc on any accuracy task, in points
        tasks: the tasks both are evaluated on (checkpoint directories; the same default as eval)
        corpus: corpus of the task documents and the perplexity blocks
        task_dir: where the task files are built
        limit: documents per task
        ppl_blocks: step-wise perplexity blocks per domain
        seq_len: tokens per step-wise block
        include_path: a folder of your own lm-eval task YAMLs
        dtype: fp32 | bf16 | fp16 | auto
        device: cpu | cuda | auto
        out: write the gate's JSON here
        confidence: interval level, in (0, 1)
        resamples: paired bootstrap resamples of the Δppl and bits-per-byte intervals (1 to 200000)
        seed: the bootstrap's seed (the same inputs and seed give the same intervals)
        grow: rounds of re-evaluation while INCONCLUSIVE, each on the sample the intervals ask for (0: none;
            checkpoint directories only; a lossy --engine policy runs token by token, so each round costs about
            the first round's seconds times the growth)
        max_blocks: the most step-wise blocks per domain a --grow round may ask for (the held-out text caps it too)
        max_documents: the most documents per task a --grow round may ask for (the held-out text caps it too)
    """
    from expertcache.telemetry.atomic import write_json

    from expertcache.telemetry.metrics import GateThresholds

    from expertcache.telemetry.stats import check_bootstrap

    from .gate import format_gate, gate as judge, load_eval, with_tasks
    from .run import evaluate

    from expertcache.telemetry.atomic import check_output

    check_bootstrap(confidence, resamples)
    _check(dtype, limit, ppl_blocks, seq_len, include_path)
    check_output(out, baseline, candidate)
    if grow < 0 or max_blocks < 1 or max_documents < 1:
        raise InputError("--grow must be >= 0, --max_blocks and --max_documents >= 1")
    if grow and any(Path(x).suffix == ".json" for x in (baseline, candidate)):
        raise InputError("--grow evaluates both again on a larger sample: give checkpoint directories, not eval JSONs")

    from expertcache.telemetry.progress import Progress

    def load(x: str, served: Optional[EngineConfig], side: str, rnd: int, only=None) -> dict:
        if Path(x).suffix == ".json":
            return load_eval(x)
        if only is not None:  # (tasks, documents): those tasks alone on more documents, no blocks, their task
            ts, n = only  # data built apart (the documents already scored stay what they were)
            print(f"gate: round {rnd}/{grow + 1}: {side}'s {', '.join(ts)} on {n} documents", file=sys.stderr)
            apart = Path(task_dir).with_name(f"{Path(task_dir).name}-{n}")
            return evaluate(x, corpus, served, ts, None, apart, n, 0, seq_len, include_path=include_path,
                            dtype=dtype, device=device)
        with Progress(transient=True) as prog:  # a growing gate runs for minutes: show where it is (#46)
            what = (f"gate round {rnd}/{grow + 1}: " if grow else "") + f"{side} step-wise perplexity"
            task = prog.add_task(what, total=ppl_blocks * 3)
            return evaluate(x, corpus, served, tasks, None, task_dir, limit, ppl_blocks, seq_len,
                            include_path=include_path, dtype=dtype, device=device,
                            progress=lambda: prog.advance(task))

    th = GateThresholds(max_dppl, max_dppl_domain, min_dacc)
    t0 = time.time()
    sides = [load(baseline, None, "baseline", 1), load(candidate, engine, "candidate", 1)]
    g = judge(*sides, th, confidence, resamples, seed)
    rounds = [_round(g, ppl_blocks, limit, time.time() - t0)]
    notes: list[str] = []
    for _ in range(grow):
        if g["gate"] != "INCONCLUSIVE":
            break
        only: list[str] = []
        if limit is not None and (g.get("resolve") or {}).get("blocks_per_domain") is None:
            # the blocks resolve and only documents can decide: the unresolved tasks alone are evaluated again,
            # task by task as the frontier does (one whose held-out text is spent stops the growth: no other
            # task's documents can make the gate PASS), the blocks and every other task's documents kept
            want, why = documents_to_grow(g, limit, max_documents)
            if not want:
                notes.append(why)
                break
            only, nb, nl = sorted(want), ppl_blocks, max(want.values())
        else:
            nb, nl, why = grow_sample(g, ppl_blocks, limit, max_blocks, max_documents,
                                      docs_can_grow=limit is not None or any(t in LOCAL_TASKS for t in tasks or ()))
            notes += why
            if (nb, nl) == (ppl_blocks, limit):
                break
        # the next round's cost at the last one's pace: it grows with the blocks (and documents) evaluated
        scale = max(nb / max(ppl_blocks, 1), (nl or 0) / max(limit or nl or 1, 1))
        print(f"gate: round {len(rounds)}/{grow + 1} INCONCLUSIVE on {g['n_blocks']} blocks per domain"
              + (f" and {max(g['n_documents'].values())} documents per task" if g["n_documents"] else "")
              + "".join(f" ({u})" for u in g["unresolved"][:1])
              + (f"; round {len(rounds) + 1}: {', '.join(only)} again on {nl} documents (the blocks and other "
                 f"tasks kept)" if only else f"; round {len(rounds) + 1}: both again on {nb} blocks"
                 + (f" and {nl} documents" if nl is not None else ""))
              + f", ~{rounds[-1]['seconds'] * scale:.0f} s at the last round's pace", file=sys.stderr)
        ppl_blocks, limit = nb, nl
        t0 = time.time()
        rnd = len(rounds) + 1
        if only:
            sides = [with_tasks(sides[0], load(baseline, None, "baseline", rnd, (only, nl)), only),
                     with_tasks(sides[1], load(candidate, engine, "candidate", rnd, (only, nl)), only)]
        else:
            sides = [load(baseline, None, "baseline", rnd), load(candidate, engine, "candidate", rnd)]
        g = judge(*sides, th, confidence, resamples, seed)
        # (a round that grew some tasks: `limit` is theirs, the others kept the documents they had)
        rounds.append({**_round(g, ppl_blocks, limit, time.time() - t0), "tasks_grown": only or None})
    if grow:
        if g["gate"] == "INCONCLUSIVE" and len(rounds) == grow + 1:
            notes.append(f"still INCONCLUSIVE after {grow} growth round(s): --grow more, or accept the interval")
        g["sizing"] = {"grow": grow, "max_blocks": max_blocks, "max_documents": max_documents, "rounds": rounds,
                       "notes": notes}
        for n in notes:
            print(f"gate: {n}", file=sys.stderr)
    if out:
        write_json(out, g)
    print(format_gate(g), file=sys.stderr)
    return g


GROWTH_MARGIN = 1.25  # a resolve count is where the interval would just touch its threshold at today's estimate


def documents_to_grow(g: dict, limit: int, cap: int, cap_name: str = "--max_documents"
                      ) -> tuple[dict[str, int], str | None]:
    """`({task: documents}, why not)` for a gate INCONCLUSIVE on accuracy alone (perplexity resolved, nothing
    failing): each unresolved task with the documents that would resolve it, a quarter above the gate's estimate
    (`GROWTH_MARGIN`), at most `cap`. Nothing, and the reason, when more documents cannot decide it: a task whose
    held-out text gave fewer than `limit` asked (it has no more; growing the others cannot make the gate PASS), an
    estimate on its threshold, or every task already at the cap. Task by task: `gate --grow` and the frontier's
    `frontier.grow` both ask this one function."""
    r = g.get("resolve") or {}
    if g.get("gate") != "INCONCLUSIVE" or g.get("failures") or r.get("blocks_per_domain") is not None:
        return {}, "not INCONCLUSIVE on accuracy alone"
    have = g.get("n_documents") or {}
    want = {}
    for task, need in sorted((r.get("documents") or {}).items()):
        if need == -1:
            return {}, f"{task}: its Δacc estimate sits on the threshold (no number of documents resolves it)"
        if not isinstance(need, int) or need <= have.get(task, 0):
            continue
        if have.get(task, 0) < limit:
            return {}, f"{task}: the held-out text gave {have.get(task, 0)} documents, ~{need} would resolve it"
        want[task] = min(math.ceil(need * GROWTH_MARGIN), cap)
    want = {t: n for t, n in want.items() if n > have.get(t, 0)}
    return want, None if want else f"no unresolved task can grow within {cap_name} {cap}"


def _round(g: dict, ppl_blocks: int, limit: Optional[int], seconds: float) -> dict:
    return {"ppl_blocks": ppl_blocks, "limit": limit, "n_blocks": g["n_blocks"], "n_documents": g["n_documents"],
            "gate": g["gate"], "dppl_overall_ci95": g["dppl_overall_ci95"], "resolve": g["resolve"],
            "seconds": round(seconds, 1)}


def grow_sample(g: dict, ppl_blocks: int, limit: Optional[int], max_blocks: int, max_documents: int,
                docs_can_grow: bool = True) -> tuple[int, Optional[int], list[str]]:
    """The next sample of a growing gate: (blocks per domain, documents per task, notes) from an INCONCLUSIVE gate's
    `resolve`, each count a quarter above what it asks (an interval that would just touch its threshold at today's
    estimate resolves it only half the time), within the caps and above the sample the gate already had (the
    held-out text may have held fewer than asked). Unchanged counts, with a note saying why, when nothing can grow.
    `docs_can_grow` false: no --limit and no local task, so every document is in already."""
    r, notes = g["resolve"], []
    had_blocks = g["n_blocks"]  # what the text gave (the fewest over the domains)
    nb = ppl_blocks
    b = r.get("blocks_per_domain")
    if b == -1:
        notes.append("a Δppl estimate sits on its threshold: no number of blocks resolves it")
    elif isinstance(b, int) and b > had_blocks:
        want = math.ceil(b * GROWTH_MARGIN)
        if had_blocks < ppl_blocks:
            notes.append(f"the held-out text gave {had_blocks} blocks per domain, {ppl_blocks} asked: "
                         f"~{b} would resolve Δppl, which it cannot give")
        elif ppl_blocks >= max_blocks:
            notes.append(f"~{b} blocks per domain would resolve Δppl; --max_blocks {max_blocks} stops the growth")
        else:
            nb = min(want, max_blocks)
            if want > max_blocks:
                notes.append(f"~{b} blocks per domain would resolve Δppl; growing to --max_blocks {max_blocks}")
    docs = [n for n in (r.get("documents") or {}).values() if isinstance(n, int)]
    nl = limit
    if -1 in docs:
        notes.append("a Δacc estimate sits on its threshold: no number of documents resolves it")
    need = max((n for n in docs if n > 0), default=0)
    had_docs = max(g["n_documents"].values(), default=0)
    if need > had_docs and not docs_can_grow:
        notes.append(f"~{need} documents per task would resolve Δacc; without --limit these tasks gave all theirs "
                     f"({had_docs})")
    elif need > had_docs:
        asked = limit if limit is not None else had_docs
        if had_docs < asked:
            notes.append(f"the held-out text gave {had_docs} documents per task, {asked} asked: ~{need} would "
                         f"resolve Δacc, which it cannot give")
        elif asked >= max_documents:
            notes.append(f"~{need} documents per task would resolve Δacc; --max_documents {max_documents} stops "
                         f"the growth")
        else:
            want = math.ceil(need * GROWTH_MARGIN)
            nl = min(want, max_documents)
            if want > max_documents:
                notes.append(f"~{need} documents per task would resolve Δacc; growing to --max_documents "
                             f"{max_documents}")
    return nb, nl, notes
