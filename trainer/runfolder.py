"""A training run's folder, shared by every training command (pretrain, train-cache-aware, each frontier variant):
set up or resume it, fit with Lightning into it, read its logs back.

Layout (`out_dir`; what each command adds beside these is in its own module):
    recipe.yaml          resolved recipe (every key, defaults filled in), written before training
    checkpoints/         Lightning checkpoints; a re-run resumes from the newest complete one
    logs/version_N/      CSV log of every logged metric, one folder per (re)start of the run
    .previous-run/       a run started over (resume=false) keeps the old one here until its first checkpoint

A resume with a recipe other than the one the run was started with is refused (`check_resume`, `RESUME_FREE`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from expertcache.telemetry.atomic import write_figure
from expertcache.telemetry.errors import InputError

from .config import RecipeError, to_dict


def _loggers(recipe, out: Path):
    """CSV (always) and wandb (offline unless WANDB_MODE says otherwise) loggers for a recipe with `name` and
    `train: TrainSpec`."""
    from lightning.pytorch.loggers import CSVLogger

    # One version folder per (re)start: Lightning's CSVLogger would overwrite an existing metrics.csv on resume.
    # Flushed at every logging step, so a killed run keeps its curve up to the kill.
    loggers = [CSVLogger(str(out), name="logs", flush_logs_every_n_steps=recipe.train.log_every)]
    if recipe.train.wandb:
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(project=recipe.train.wandb_project, name=recipe.name, save_dir=str(out),
                                   offline=os.environ["WANDB_MODE"] == "offline", config=to_dict(recipe)))
    return loggers


def fit_resumable(recipe, module, dm, out: Path, resume: bool = True) -> tuple[int, float, object]:
    """Fit `module` with Lightning under `recipe.train`, checkpointing into `out/checkpoints` and resuming from
    the newest complete checkpoint there. Returns (step resumed from, seconds trained this run, trainer)."""
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    ckpt_dir = out / "checkpoints"
    latest, start_step = latest_checkpoint(ckpt_dir) if resume else (None, 0)
    t = recipe.train

    class DropPrevious(L.Callback):
        """A run started over (resume=false) keeps the old one in PREVIOUS until its own first checkpoint."""

        def _drop(self, trainer) -> None:
            if trainer.is_global_zero and (out / PREVIOUS).exists() and any(ckpt_dir.glob("*.ckpt")):
                shutil.rmtree(out / PREVIOUS, ignore_errors=True)

        def on_train_batch_start(self, trainer, *args) -> None:
            self._drop(trainer)

        def on_fit_end(self, trainer, *args) -> None:
            self._drop(trainer)

    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from .distributed import check_world, strategy_for, unshard
    from .progress_bar import training_bar

    callbacks = [ModelCheckpoint(dirpath=str(ckpt_dir), filename="step{step}", every_n_train_steps=t.ckpt_every,
                                 save_top_k=1, save_last=True, auto_insert_metric_name=False),
                 LearningRateMonitor(logging_interval="step"), DropPrevious(), training_bar()]
    with deterministic_algorithms(t.deterministic):  # (Lightning sets them for the process: restored after)
        try:
            trainer = L.Trainer(
                max_steps=t.max_steps, accelerator=t.accelerator, precision=t.precision,
                devices=int(t.devices) if str(t.devices).isdigit() else t.devices, num_nodes=t.num_nodes,
                strategy=strategy_for(t),
                use_distributed_sampler=False,  # the data module splits each global batch across ranks itself
                val_check_interval=t.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                gradient_clip_val=t.grad_clip or None, log_every_n_steps=t.log_every, logger=_loggers(recipe, out),
                callbacks=callbacks, enable_model_summary=False, default_root_dir=str(out),
                deterministic="warn" if t.deterministic else None)
        except (MisconfigurationException, ValueError, ImportError) as e:  # an accelerator, precision or strategy
            # Lightning lacks, or one whose package is not installed (tpu: torch_xla)
            raise RecipeError(f"train.accelerator/precision/devices/num_nodes/strategy: {' '.join(str(e).split())}") \
                from None
        check_world(trainer, t, recipe.data.batch_size)
        started = time.time()
        trainer.fit(module, datamodule=dm, ckpt_path=str(latest) if latest else None, weights_only=True)
    unshard(trainer, module)  # FSDP: rank 0's module gets the whole weights it saves and evaluates
    return start_step, time.time() - started, trainer


@contextlib.contextmanager
def deterministic_algorithms(on: bool):
    """torch's deterministic algorithms for the block when `on` (`train.deterministic`; warn_only: an op without
    one is named in a warning, never refused), without their filling of every new tensor's memory (a write of each
    `torch.empty` that no result depends on), and the process's own settings as they were afterwards."""
    import torch
    import torch.utils.deterministic as det

    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = det.fill_uninitialized_memory
    try:
        if on:
            torch.use_deterministic_algorithms(True, warn_only=True)
            det.fill_uninitialized_memory = False
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        det.fill_uninitialized_memory = fill


def latest_checkpoint(ckpt_dir: Path) -> tuple[Path | None, int]:
    """The checkpoint with the highest global step, and that step. A kill can land between `stepN.ckpt` and its
    copy `last.ckpt`, so the newest file is not always `last.ckpt`. Files are written atomically (fsspec
    transaction), so every file present is complete."""
    import torch

    best, best_step = None, -1
    for f in sorted(ckpt_dir.glob("*.ckpt")):
        try:
            step = int(torch.load(f, map_location="cpu", weights_only=True, mmap=True)["global_step"])
        except (OSError, RuntimeError, KeyError, TypeError, ValueError) as e:
            raise InputError(f"checkpoint {f} is not readable ({' '.join(str(e).split())[:120]}); move it away "
                             f"to resume from the others, or pass --resume false to start over") from None
        if step > best_step:
            best, best_step = f, step
    return best, max(best_step, 0)


def read_metrics(log_dir: Path) -> list[dict]:
    """Rows of every logs/version_*/metrics.csv, in (re)start order."""
    import csv

    rows = []
    for f in sorted(log_dir.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        rows.extend(csv.DictReader(f.open()))
    return rows


def plot_training_curve(log_dir: Path, out_png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(log_dir)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    tr = [(int(r["step"]), float(r["train/loss"])) for r in rows if r.get("train/loss")]
    if tr:
        a.plot(*zip(*tr), lw=1)
    a.set(xlabel="step", ylabel="train LM loss (nats/token)", title="training loss")
    for key in sorted({k for r in rows for k in r if k.startswith("val/ppl_")}):
        pts = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
        if pts:
            b.plot(*zip(*pts), marker="o", label=key.removeprefix("val/ppl_"))
    b.set(xlabel="step", ylabel="validation perplexity", title="validation perplexity by domain", yscale="log")
    if b.get_legend_handles_labels()[0]:
        b.legend()
    fig.tight_layout()
    write_figure(fig, out_png)
    plt.close(fig)


# Recipe keys a resume may change: where and how often it logs, checkpoints, validates and with how many threads
# or devices it runs, how far it trains (max_steps, upward only) and what is measured once training is done
# (eval). Every other key is what the model was trained under: a changed one is refused on resume, named with
# its two values (the run would continue, and its recipe.yaml and result say, a recipe it was not trained with).
RESUME_FREE = ("name", "train.max_steps", "train.threads", "train.wandb", "train.wandb_project", "train.log_every",
               "train.val_every", "train.ckpt_every", "train.accelerator", "train.devices", "train.num_nodes",
               "train.strategy", "train.deterministic",
               "data.val_batches", "eval_blocks", "eval.", "sweep.", "frontier.")
PATH_KEYS = ("data.corpus", "data.tokenizer", "base")
# what a run writes into its folder (moved aside, not deleted, when a run starts over)
RUN_FILES = ("recipe.yaml", "checkpoints", "logs", "model", "metrics.json", "result.json", "result.md",
             "training_curve.png", "cache.png", "wandb")
PREVIOUS = ".previous-run"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _matches(key: str, names) -> bool:
    """`key` is one of `names` or inside one of their sections (a name ending in ".")."""
    return any(key == c or (c.endswith(".") and key.startswith(c)) for c in names)


def _same(key: str, a, b) -> bool:
    if key in PATH_KEYS and isinstance(a, str) and isinstance(b, str):
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def check_resume(recipe, out: Path, resume: bool, outputs: tuple[str, ...]) -> dict | None:
    """Before anything is written into a run folder that holds a checkpoint: a resume with a recipe other than the
    one the run was started with is refused (RecipeError naming each key, its saved and its new value; only the
    `RESUME_FREE` keys may change), and a finished run (checkpoint at max_steps, `outputs` present, the same
    recipe) returns its saved result (outputs[0]). Returns None when the run is to go ahead. Every training
    command goes through it (`prepare_run`: pretrain, train-cache-aware, each frontier variant)."""
    import yaml

    ckpt_dir = out / "checkpoints"
    ckpt, step = latest_checkpoint(ckpt_dir) if ckpt_dir.is_dir() else (None, 0)
    if ckpt is None or not resume:
        return None
    saved_path = out / "recipe.yaml"
    diffs = {}
    if saved_path.is_file():
        try:
            saved = yaml.safe_load(saved_path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
            raise RecipeError(f"{saved_path}: the run's saved recipe is not readable ({type(e).__name__}); "
                              f"restore it, or pass --resume false to start over") from None
        if not isinstance(saved, dict):
            raise RecipeError(f"{saved_path}: the run's saved recipe is not a mapping; restore it, or pass "
                              f"--resume false to start over")
        old, new = _flat(saved), _flat(to_dict(recipe))
        diffs = {k: (old[k], new[k]) for k in old if k in new and k != "out_dir" and not _same(k, old[k], new[k])}
    conflicts = [k for k in diffs if not _matches(k, RESUME_FREE)]
    if conflicts:
        what = "; ".join(f"{k}: {diffs[k][0]!r} in the checkpoint, {diffs[k][1]!r} now" for k in conflicts)
        raise RecipeError(f"{out} holds a checkpoint (step {step}) trained with another recipe ({len(conflicts)} "
                          f"key(s) differ: {what}); a resume continues the recipe the run was started with: use "
                          f"another out_dir, or pass --resume false to start over")
    if recipe.train.max_steps < step:
        raise RecipeError(f"train.max_steps={recipe.train.max_steps} is below the step {step} of {ckpt}; a resume "
                          f"cannot go back: use another out_dir, or pass --resume false to start over")
    if step == recipe.train.max_steps and not diffs and all((out / o).exists() for o in outputs):
        try:
            return json.loads((out / outputs[0]).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None  # damaged: the run writes its outputs again (no training left to do)
    return None


def _rank_zero() -> bool:
    """Not a data-parallel worker process (rank 0 sets the run folder up and marks it; `distributed.is_worker`)."""
    from .distributed import is_worker

    return not is_worker()


def finish_run(out: Path, command: str) -> None:
    """Mark a run folder complete: its outputs are written (a resume of it reports them)."""
    from expertcache.telemetry.atomic import mark_output

    mark_output(out, command, complete=True)


def _set_aside(out: Path) -> None:
    """Start over (resume=false) in a folder holding a run: its files go to out/PREVIOUS, deleted once the new run
    has written its first checkpoint (fit_resumable), so a start-over killed before that loses nothing."""
    from .distributed import is_worker

    if is_worker():
        return  # a data-parallel worker: rank 0 does it (before launching it, or beside it under torchrun/srun)
    if not any((out / "checkpoints").glob("*.ckpt")):
        return
    prev = out / PREVIOUS
    if prev.exists():  # an older start-over's leftovers: the run now in the folder is newer
        shutil.rmtree(prev)
    prev.mkdir()
    for name in RUN_FILES:
        if (out / name).exists():
            (out / name).rename(prev / name)
    print(f"starting over: the previous run in {out} is kept in {prev} until the new run's first checkpoint",
          file=sys.stderr)


def is_run_folder(p: Path) -> bool:
    """A run folder from before output markers: it holds the resolved recipe a run writes first."""
    return (p / "recipe.yaml").is_file()


def holds_runs(p: Path) -> bool:
    """A sweep's or a frontier's folder from before output markers: a run folder (recipe.yaml) inside it."""
    return any((d / "recipe.yaml").is_file() for d in p.iterdir() if d.is_dir())


def claim_runs_folder(out: Path, command: str = "train-cache-aware") -> None:
    """A sweep's or a frontier's folder (one run folder per point, their table, their evaluations): its own, or
    new, or empty; a folder of anything else is refused before the first point trains."""
    from expertcache.telemetry.atomic import own_dir

    if _rank_zero():
        own_dir(out, command, legacy=holds_runs)


def prepare_run(recipe, resume: bool = True, outputs: tuple[str, ...] = ("metrics.json",),
                command: str = "pretrain") -> tuple:
    """What every training run does first, for a recipe with `data`, `train` and `out_dir`: reject bad input
    (corpus, tokenizer, a folder that is not this command's run, a resume the checkpoint cannot follow) before
    anything is written, set threads, write the resolved recipe (atomically), seed. Returns (tokenizer, run
    folder, the saved result of a finished run or None): a finished run resumed with the same recipe is reported
    as it is, nothing rewritten. The folder is marked as `command`'s run (incomplete until `finish_run`)."""
    import lightning as L
    import torch

    from expertcache.telemetry.atomic import claim_dir, mark_output, output_marker, write_text
    from expertcache.telemetry.corpus import load_corpus
    from expertcache.telemetry.hf import load_tokenizer

    out = Path(recipe.out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"out_dir {out} is a file; expected a run folder")
    # a folder of anything but this command's runs is never written (an interrupted run of it is resumed)
    claim_dir(out, command, resume=True, legacy=is_run_folder)
    load_corpus(recipe.data.corpus)
    tok = load_tokenizer(recipe.data.tokenizer)
    done = check_resume(recipe, out, resume, outputs)
    if done is not None:
        print(f"{out}: finished at step {recipe.train.max_steps} with this recipe; nothing to do (raise "
              f"train.max_steps to train on, or pass --resume false to start over)", file=sys.stderr)
        return tok, out, done
    try:
        out.mkdir(parents=True, exist_ok=True)
        if output_marker(out) is None and _rank_zero():
            mark_output(out, command, complete=False)
        if not resume:
            _set_aside(out)
        import yaml

        write_text(out / "recipe.yaml", yaml.safe_dump(to_dict(recipe), sort_keys=False))
    except PermissionError as e:
        raise InputError(f"out_dir {out} is not writable ({e.strerror}: {e.filename})") from None
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    L.seed_everything(recipe.train.seed, workers=True, verbose=False)
    return tok, out, None
