#!/usr/bin/env python
"""Lightning training loop vs a bare PyTorch loop: same model, same batches, alternated in one process.

Prints one JSON object. Each round trains a fresh copy of the same initial model for `--steps` steps, first in
Lightning (the same `CausalLMModule` that `expertcache pretrain` uses) and then in a hand-written loop doing the
same work (forward with the load-balancing loss, backward, clip, AdamW, LR schedule). The first `--warmup`
steps of every block are excluded. tokens/s = batch tokens / median step time.

    python scripts/bench_train.py                       # base-tiny shape, 16 x 256 tokens a step
    python scripts/bench_train.py --recipe smoke --steps 20
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from expertcache.telemetry.errors import count, nonnegative


class StepTimer:
    """Wall time between consecutive batch starts: data fetch, forward, backward, optimizer, Lightning hooks."""

    def __init__(self):
        self.starts: list[float] = []

    def as_callback(self):
        import lightning as L

        timer = self

        class _CB(L.Callback):
            def on_train_batch_start(self, *a, **k):
                timer.starts.append(time.perf_counter())

            def on_train_end(self, *a, **k):
                timer.starts.append(time.perf_counter())

        return _CB()

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


def lightning_block(model, spec, batches, steps):
    import lightning as L
    from torch.utils.data import DataLoader

    from expertcache.trainer.lm_module import CausalLMModule

    timer = StepTimer()
    module = CausalLMModule(model, spec, val_domains=[])
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, precision=spec.precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=spec.grad_clip or None, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[timer.as_callback()])
    loader = DataLoader([{"input_ids": b} for b in batches[:steps]], batch_size=None, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    return timer.step_times()


def bare_block(model, spec, batches, steps):
    from expertcache.trainer.lm_module import CausalLMModule, lr_lambda, param_groups

    module = CausalLMModule(model, spec, val_domains=[])  # only for its lm_forward: the same loss
    model.train()
    opt = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=(0.9, spec.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec))
    times = []
    for i in range(steps):
        t = time.perf_counter()
        loss, _, _ = module.lm_forward(batches[i])
        loss.backward()
        if spec.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="base-tiny", help="shipped recipe name or YAML (model shape and batch)")
    ap.add_argument("--steps", type=count, default=8, help="steps per block")
    ap.add_argument("--warmup", type=nonnegative, default=2, help="steps excluded at the start of every block")
    ap.add_argument("--rounds", type=count, default=3, help="Lightning/bare alternations")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from expertcache.recipes.cli import resolve_recipe
    from expertcache.trainer.config import load_recipe
    from expertcache.trainer.pretrain import PretrainRecipe

    if a.threads:
        torch.set_num_threads(a.threads)
    recipe = load_recipe(PretrainRecipe, resolve_recipe(a.recipe))
    vocab = 8192
    cfg = recipe.model.to_hf_config(vocab, 0, 1)
    torch.manual_seed(0)
    init = AutoModelForCausalLM.from_config(cfg).state_dict()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, vocab, (recipe.data.batch_size, recipe.data.seq_len), generator=g)
               for _ in range(a.steps)]
    tokens = recipe.data.batch_size * recipe.data.seq_len

    def fresh():
        m = AutoModelForCausalLM.from_config(cfg)
        m.load_state_dict(copy.deepcopy(init))
        return m

    from expertcache.runtime.bench.harness import alternate, compare
    from expertcache.telemetry.provenance import provenance

    prov = provenance(Path(__file__).parent)  # the code, before the work
    blocks = {"lightning": lightning_block, "bare": bare_block}
    # ABBA order (the harness's), so neither loop always runs on a warmer machine
    runs = alternate(["lightning", "bare"], a.rounds,
                     lambda which, r: blocks[which](fresh(), recipe.train, batches, a.steps)[a.warmup:])
    light, bare = [t for x in runs["lightning"] for t in x], [t for x in runs["bare"] for t in x]
    ml, mb = statistics.median(light), statistics.median(bare)
    out = {
        "benchmark": "train_loop", "recipe": a.recipe, "model_parameters": sum(p.numel() for p in fresh().parameters()),
        "batch": [recipe.data.batch_size, recipe.data.seq_len], "precision": recipe.train.precision,
        "steps_per_block": a.steps, "warmup_excluded": a.warmup, "rounds": a.rounds, "threads": torch.get_num_threads(),
        "lightning": {"median_step_s": round(ml, 4), "tokens_per_s": round(tokens / ml, 1), "steps": len(light)},
        "bare": {"median_step_s": round(mb, 4), "tokens_per_s": round(tokens / mb, 1), "steps": len(bare)},
        "lightning_over_bare_tokens_per_s": round(mb / ml, 4),
        "lightning_vs_bare": compare([statistics.median(x) for x in runs["lightning"]],
                                     [statistics.median(x) for x in runs["bare"]]),
        "target": "lightning within 10% of bare (ratio >= 0.90)", "pass": mb / ml >= 0.90, **prov,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
