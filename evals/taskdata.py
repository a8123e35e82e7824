"""The local lm-eval tasks' data, built from held-out text of our corpus (no hub), and the task configs.

Files (JSON lines, in `out_dir`): `ppl_<domain>.jsonl` ({text}: chunks for rolling perplexity),
`cloze_<domain>.jsonl` ({context, choices, gold}: the true continuation among 3 continuations taken from other
places of the same domain), `math_em.jsonl` ({question, answer}: held-out generated problems); 2,000 documents
per accuracy task by default (what resolving the gate's -1 point limit takes: ~400 documents when the two runs
answer every one alike, ~2,000 when they disagree on 5%), from held-out text only, and `built.json` says how
many and from which text. The task YAMLs in `evals/tasks/` name these files relative to `out_dir`;
`task_configs` resolves them.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import yaml

from expertcache.telemetry.corpus import DOMAINS, load_corpus
from expertcache.telemetry.errors import InputError

TASK_DIR = Path(__file__).resolve().parent / "tasks"
DEFAULT_TASKS = tuple(f"ec_ppl_{d}" for d in DOMAINS) + tuple(f"ec_cloze_{d}" for d in DOMAINS) + ("ec_math_em",)
SKIPPED = "skipped.json"  # the local tasks whose documents the corpus could not give, and why
LOCAL_TASKS = frozenset(p.stem for p in TASK_DIR.glob("*.yaml"))  # built from the project corpus's held-out split
# the local tasks whose documents are generated text (`output_type: generate_until`), not scored by loglikelihood
GENERATION_TASKS = frozenset(p.stem for p in TASK_DIR.glob("*.yaml") if "output_type: generate_until" in p.read_text())
MATH_RE = re.compile(r"Question: (?P<q>.*?)\nSolution: .*?Answer: (?P<a>-?\d+)", re.S)


def _chunks(text: str, size: int) -> list[str]:
    """Pieces of about `size` characters cut at line ends."""
    out, cur = [], []
    n = 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if n >= size:
            out.append("".join(cur))
            cur, n = [], 0
    if n > size // 4:
        out.append("".join(cur))
    return out


TASK_DOCS = 2000  # documents per accuracy task unless --limit asks for more (issue #44: enough to resolve -1 point)
# step-wise perplexity blocks per domain (the gate's Δppl; eval, gate and evaluate's default): the frontier's
# intervals on 32 blocks were about ±0.4% overall and up to ±1% in the worst domain, across +1% / +2% for
# estimates that near them; 64 narrows them by 1/sqrt(2) (the plain base: ~7 s batched)
PPL_BLOCKS = 64
PPL_DOCS = 24  # rolling-perplexity documents per domain (lm-eval's bits per byte: the gate's cross-check)
TASK_DATA_VERSION = 2  # 2: cloze items from every window of the held-out text, which goes past the test split
BUILT = "built.json"  # how many documents per task the folder was built for, and from which text


def task_docs_built(out_dir: str | Path) -> int:
    """The documents per accuracy task `out_dir` was built for; 0 for a folder an older version built (its items
    are cut differently: build it again)."""
    import json

    try:
        built = json.loads((Path(out_dir) / BUILT).read_text())
        return int(built["per_domain"]) if built.get("version") == TASK_DATA_VERSION else 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def _windows(pieces: list[str], ctx_chars: int, cont_chars: int) -> list[tuple[str, str]]:
    """(context, continuation) of every consecutive, non-overlapping window of `ctx_chars + cont_chars` characters
    inside each piece: the items never share text, so each document is its own draw."""
    w = ctx_chars + cont_chars
    return [(p[i:i + ctx_chars], p[i + ctx_chars:i + w]) for p in pieces for i in range(0, len(p) - w + 1, w)]


def _cloze(spans: list[tuple[str, str]], n: int, rng: random.Random) -> list[dict] | None:
    """`n` 4-way cloze items (fewer where the text has fewer windows): a window's context, its true continuation
    and 3 distinct continuations drawn from other windows; None when the text repeats itself so much that half
    the items cannot find 3 distinct distractors."""
    docs, failed = [], 0
    for i in sorted(rng.sample(range(len(spans)), min(n, len(spans)))):
        ctx, cont = spans[i]
        others: list[str] = []
        for _ in range(50):  # rejection sampling: spans are thousands, a pool per item would be quadratic
            o = spans[rng.randrange(len(spans))][1]
            if o != cont and o not in others:
                others.append(o)
                if len(others) == 3:
                    break
        if len(others) < 3:
            failed += 1
            continue
        gold = rng.randrange(4)
        docs.append({"context": ctx, "choices": others[:gold] + [cont] + others[gold:], "gold": gold})
    return None if failed > len(docs) else docs


def build_task_data(corpus: str | Path, out_dir: str | Path, split: str = "test", per_domain: int = TASK_DOCS,
                    ppl_chars: int = 1500, ctx_chars: int = 240, cont_chars: int = 60, seed: int = 0,
                    ppl_docs: int = PPL_DOCS) -> dict:
    """Write the task files from held-out text only; returns how many documents each got.

    The held-out text of a domain is its `split` documents, and where they hold fewer than `per_domain` cloze
    windows (or math problems), the source text no split of the corpus holds (`trainer.corpus.unused_documents`:
    standard-library modules the corpus's budget left out, math problems generated past the corpus's; prose has
    none). No training document is ever read into a task."""
    from expertcache.trainer.corpus import unused_documents

    ds = load_corpus(corpus)[split]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    counts: dict = {}
    sources: dict = {}
    by_dom = {d: [t for t, dd in zip(ds["text"], ds["domain"]) if dd == d] for d in DOMAINS}
    skipped: dict[str, str] = {}
    for dom, texts in list(by_dom.items()):
        if not texts:
            raise InputError(f"split {split!r} of {corpus} has no {dom} text")
        have = sum(len(t.encode()) for t in texts)
        # ~10% of the text is lost to pieces' ends: ask for that much more than per_domain windows
        extra = unused_documents(corpus, dom, int(1.1 * per_domain * (ctx_chars + cont_chars)) - have)
        sources[dom] = {"split": split, "split_documents": len(texts), "split_bytes": have,
                        "unused_documents": len(extra), "unused_bytes": sum(len(d.text.encode()) for d in extra)}
        by_dom[dom] = texts = texts + [d.text for d in extra]
        joined = "\n".join(texts)  # short documents (math problems) join up
        # a small held-out split still gets several pieces (never shorter than a cloze item)
        size = max(ctx_chars + cont_chars + 20, min(ppl_chars, len(joined) // 8))
        pieces = _chunks(joined, size)
        take = [pieces[i] for i in sorted(rng.sample(range(len(pieces)), min(ppl_docs, len(pieces))))]
        _write(out / f"ppl_{dom}.jsonl", [{"text": p} for p in take])
        # cloze: a window's context + its true continuation; distractors are continuations of other windows
        spans = _windows(pieces, ctx_chars, cont_chars)
        docs = _cloze(spans, per_domain, rng) if len({c for _, c in spans}) >= 4 else None
        if not docs:  # a task on this domain cannot be built; the others can (asked for, it is refused by name)
            skipped[f"ec_cloze_{dom}"] = (
                f"not enough held-out {dom} text for a 4-way cloze ({len(joined)} characters in the {split!r} split "
                f"of {corpus})" if len(spans) < 4 else
                f"held-out {dom} text repeats itself: fewer than 3 distinct continuations for a 4-way cloze (the "
                f"{split!r} split of {corpus})")
            (out / f"cloze_{dom}.jsonl").unlink(missing_ok=True)
            counts[dom] = {"ppl_docs": len(take), "cloze_docs": 0}
            continue
        _write(out / f"cloze_{dom}.jsonl", docs)
        counts[dom] = {"ppl_docs": len(take), "cloze_docs": len(docs)}
    probs = [m for t in by_dom["math"] for m in MATH_RE.finditer(t)]
    pick = sorted(rng.sample(range(len(probs)), min(per_domain, len(probs))))
    _write(out / "math_em.jsonl", [{"question": probs[i]["q"], "answer": probs[i]["a"]} for i in pick])
    counts["math_em"] = len(pick)
    from expertcache.telemetry.atomic import write_json

    write_json(out / SKIPPED, skipped)
    write_task_yamls(out)
    write_json(out / BUILT, {"version": TASK_DATA_VERSION, "per_domain": per_domain, "ppl_docs": ppl_docs,
                             "split": split, "counts": counts, "sources": sources})
    return counts


def _write(path: Path, rows: list[dict]) -> None:
    from expertcache.telemetry.atomic import write_jsonl

    write_jsonl(path, rows)


def lm_eval_tasks(names: list[str], data_dir: str | Path, include_path: str | Path | None = None):
    """`(tasks, task_manager)` for `lm_eval.simple_evaluate`: the local `ec_*` tasks as configs in hand, any other
    name resolved by lm-eval itself, in `include_path` (a folder of the user's task YAMLs, lm-eval's convention) or
    among its built-in tasks. The ~13k built-in YAMLs are indexed only when a name is found nowhere else."""
    from lm_eval.tasks import TaskManager

    local = [n for n in names if (TASK_DIR / f"{n}.yaml").is_file()]
    other = [n for n in names if n not in local]
    if include_path is not None and not Path(include_path).is_dir():
        raise InputError(f"--include_path {include_path} is not a directory of task YAMLs")
    inc = str(include_path) if include_path is not None else None
    tm = TaskManager(include_defaults=False, include_path=inc)
    if any(n not in tm.all_tasks for n in other):
        tm = TaskManager(include_defaults=True, include_path=inc)
    missing = [n for n in other if n not in tm.all_tasks]
    if missing:
        known = sorted(p.stem for p in TASK_DIR.glob("*.yaml"))
        raise InputError(f"unknown task(s) {', '.join(missing)}: not local ({', '.join(known)}), not in "
                         f"{include_path or 'an --include_path'}, not an lm-eval task (`lm-eval ls tasks`)")
    for name in other:  # before any model is opened
        _check_loadable(name, tm)
    return task_configs(local, data_dir) + other, tm


def _check_loadable(name: str, tm) -> None:
    """An lm-eval task whose data cannot be read (a hub dataset offline and not in the local cache) as one line
    naming it (#46: `--tasks arc_easy` offline ended in a traceback, after the model had loaded). lm-eval caches
    what it builds here, so the evaluation itself reads it again from the cache."""
    from datasets.exceptions import DatasetsError
    from lm_eval.tasks import get_task_dict

    try:
        get_task_dict([name], tm)
    except (OSError, DatasetsError) as e:  # requests' and huggingface_hub's connection errors are OSErrors
        first = next((x.strip() for x in str(e).splitlines() if x.strip()), "")[:200]
        raise InputError(f"task {name}: its data could not be loaded ({type(e).__name__}: {first}); lm-eval reads "
                         f"it from the Hugging Face hub or the local datasets cache (HF_DATASETS_CACHE): run once "
                         f"online, or use a local task") from None


def _skipped(data_dir: str | Path) -> dict[str, str]:
    import json

    f = Path(data_dir) / SKIPPED
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError):
        return {}


def write_task_yamls(data_dir: str | Path) -> Path:
    """`data_dir/lm_eval_tasks/*.yaml`: the local tasks with their data files resolved, for lm-eval's own command
    line (`lm_eval --include_path DATA_DIR/lm_eval_tasks --tasks ec_cloze_prose ...`, e.g. against `serve`)."""
    from expertcache.telemetry.atomic import write_text

    folder = Path(data_dir) / "lm_eval_tasks"
    folder.mkdir(parents=True, exist_ok=True)
    for name in sorted(LOCAL_TASKS - set(_skipped(data_dir))):
        (cfg,) = task_configs([name], data_dir)
        write_text(folder / f"{name}.yaml", yaml.safe_dump(cfg, sort_keys=False))
    return folder


def task_configs(names: list[str], data_dir: str | Path) -> list[dict]:
    """The YAML configs of `names` with their data files resolved under `data_dir`."""
    data_dir = Path(data_dir).resolve()
    out = []
    for name in names:
        f = TASK_DIR / f"{name}.yaml"
        if not f.is_file():
            known = sorted(p.stem for p in TASK_DIR.glob("*.yaml"))
            raise InputError(f"unknown task {name!r}; local tasks: {', '.join(known)}")
        cfg = yaml.safe_load(f.read_text())
        files = cfg["dataset_kwargs"]["data_files"]
        for split, rel in files.items():
            p = data_dir / rel
            if not p.is_file():
                why = _skipped(data_dir).get(name)
                raise InputError(f"task {name}: {why}" if why else
                                 f"task data {p} missing; build it with build_task_data (expertcache eval does)")
            files[split] = str(p)
        out.append(cfg)
    return out
