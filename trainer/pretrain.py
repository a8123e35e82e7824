"""Pretrain the base MoE with Lightning: resumable, logged (CSV + wandb offline), saved as a HF checkpoint.

Run folder layout (`out_dir`; recipe.yaml, checkpoints/ and logs/ as every training run has them: `runfolder.py`):
    model/               HF checkpoint (safetensors) + tokenizer: loads with plain transformers
    metrics.json         final per-domain validation perplexity and per-layer expert-usage entropy
    training_curve.png   train loss and per-domain validation perplexity against step
"""

from __future__ import annotations

from .data import CorpusDataModule
from .lm_module import CausalLMModule
from .models import count_parameters, save_model_dir
from .runfolder import finish_run, fit_resumable, plot_training_curve, prepare_run
from .specs import PretrainRecipe  # noqa: F401 - re-exported


def run_pretrain(recipe: PretrainRecipe, resume: bool = True) -> dict:
    from transformers import AutoModelForCausalLM

    from expertcache.telemetry.atomic import write_json

    from .evaluate import check_vocab, evaluate_lm

    tok, out, done = prepare_run(recipe, resume, ("metrics.json", "model/config.json"), command="pretrain")
    if done is not None:
        return done
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
    save_model_dir(model, tok, model_dir)
    final = evaluate_lm(model, recipe.data.corpus, recipe.data.tokenizer, "validation", recipe.data.seq_len,
                        recipe.eval_blocks)
    metrics = {"name": recipe.name, "global_step": trainer.global_step, "resumed_from_step": start_step,
               "train_seconds_this_run": round(train_s, 1),
               "tokens_per_step": recipe.data.batch_size * recipe.data.seq_len,
               "parameters": count_parameters(model), "validation": final}
    write_json(out / "metrics.json", metrics)
    plot_training_curve(out / "logs", out / "training_curve.png")
    finish_run(out, "pretrain")
    return metrics
