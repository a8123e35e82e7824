"""Pretrain the base MoE with Lightning: resumable, logged (CSV + wandb offline), saved as a HF checkpoint.

Run folder layout (`out_dir`):
    recipe.yaml          resolved recipe (every key, defaults filled in)
    checkpoints/         Lightning checkpoints; a re-run resumes from the newest complete one
    logs/version_N/      CSV log of every logged metric, one folder per (re)start of the run
    model/               HF checkpoint (safetensors) + tokenizer: loads with plain transformers
    metrics.json         final per-domain validation perplexity and per-layer expert-usage entropy
    training_curve.png   train loss and per-domain validation perplexity against step
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .config import opt, save_recipe, to_dict
from .data import CorpusDataModule, DataSpec
from .lm_module import CausalLMModule, TrainSpec
from .models import BaseModelSpec, count_parameters


@dataclass
class PretrainRecipe:
    name: str = opt("base", "run name (used in logs)")
    out_dir: str = opt("runs/base", "run folder: checkpoints, logs, HF model, metrics")
    data: DataSpec = opt(DataSpec(), "corpus, tokenizer and batching")
    model: BaseModelSpec = opt(BaseModelSpec(), "the Qwen3-MoE base model's shape")
    train: TrainSpec = opt(TrainSpec(), "optimisation, validation, checkpoints, logging")
    eval_blocks: int = opt(64, "validation blocks per domain in the final metrics.json")


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
    trainer = L.Trainer(
        max_steps=t.max_steps, accelerator=t.accelerator, precision=t.precision,
        devices=int(t.devices) if str(t.devices).isdigit() else t.devices, strategy=t.strategy,
        use_distributed_sampler=False,  # the data module splits each global batch across ranks itself
        val_check_interval=t.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        gradient_clip_val=t.grad_clip or None, log_every_n_steps=t.log_every, logger=_loggers(recipe, out),
        callbacks=[ModelCheckpoint(dirpath=str(ckpt_dir), filename="step{step}", every_n_train_steps=t.ckpt_every,
                                   save_top_k=1, save_last=True, auto_insert_metric_name=False),
                   LearningRateMonitor(logging_interval="step")],
        enable_model_summary=False, default_root_dir=str(out))
    started = time.time()
    trainer.fit(module, datamodule=dm, ckpt_path=str(latest) if latest else None, weights_only=True)
    return start_step, time.time() - started, trainer


def latest_checkpoint(ckpt_dir: Path) -> tuple[Path | None, int]:
    """The checkpoint with the highest global step, and that step. A kill can land between `stepN.ckpt` and its
    copy `last.ckpt`, so the newest file is not always `last.ckpt`. Files are written atomically (fsspec
    transaction), so every file present is complete."""
    import torch

    best, best_step = None, -1
    for f in sorted(ckpt_dir.glob("*.ckpt")):
        step = int(torch.load(f, map_location="cpu", weights_only=True, mmap=True)["global_step"])
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
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def prepare_run(recipe) -> tuple[object, Path]:
    """What every training run does first, for a recipe with `data`, `train` and `out_dir`: reject bad input
    (corpus, tokenizer) before any model is built, set threads, write the resolved recipe, seed.
    Returns (tokenizer, run folder)."""
    import lightning as L
    import torch

    from expertcache.telemetry.corpus import load_corpus
    from expertcache.telemetry.corpus import load_tokenizer

    load_corpus(recipe.data.corpus)
    tok = load_tokenizer(recipe.data.tokenizer)
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    out = Path(recipe.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_recipe(recipe, out / "recipe.yaml")
    L.seed_everything(recipe.train.seed, workers=True, verbose=False)
    return tok, out


def run_pretrain(recipe: PretrainRecipe, resume: bool = True) -> dict:
    from transformers import AutoModelForCausalLM

    from .evaluate import check_vocab, evaluate_lm

    tok, out = prepare_run(recipe)
    hf_config = recipe.model.to_hf_config(len(tok), tok.eos_token_id, tok.pad_token_id)
    check_vocab(tok, hf_config)
    model = AutoModelForCausalLM.from_config(hf_config)
    dm = CorpusDataModule(recipe.data, seed=recipe.train.seed)
    dm.setup("fit")
    module = CausalLMModule(model, recipe.train, dm.val_domains())
    start_step, train_s, trainer = fit_resumable(recipe, module, dm, out, resume)
    if trainer.global_rank != 0:  # data-parallel workers: rank 0 alone writes the checkpoint and the reports
        return None

    model_dir = out / "model"
    model.save_pretrained(str(model_dir), safe_serialization=True)
    tok.save_pretrained(str(model_dir))
    final = evaluate_lm(model, recipe.data.corpus, recipe.data.tokenizer, "validation", recipe.data.seq_len,
                        recipe.eval_blocks)
    metrics = {"name": recipe.name, "global_step": trainer.global_step, "resumed_from_step": start_step,
               "train_seconds_this_run": round(train_s, 1),
               "tokens_per_step": recipe.data.batch_size * recipe.data.seq_len,
               "parameters": count_parameters(model), "validation": final}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    plot_training_curve(out / "logs", out / "training_curve.png")
    return metrics
