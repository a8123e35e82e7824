"""The trainer's and the recorder's own benchmarks, `expertcache bench train` and `expertcache bench telemetry`:
they build the model of a pretraining recipe, so they live with the recipes (the one area that may import the
trainer and the runtime's harness both)."""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from expertcache.telemetry.errors import InputError

from expertcache.runtime.bench.harness import alternate, compare
from expertcache.runtime.bench.results import command_line, started, write_result


def _counts(**counts: int) -> None:
    bad = [f"--{k} {v}" for k, v in counts.items()
           if not isinstance(v, int) or v < (0 if k in ("warmup", "threads") else 1)]
    if bad:
        raise InputError(f"{', '.join(bad)}: counts must be >= 1 (--warmup, --threads >= 0)")


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


def bench_train(recipe: str = "base-tiny", steps: int = 8, warmup: int = 2, rounds: int = 3, threads: int = 0,
                out: Optional[str] = None) -> dict:
    """Lightning's training loop against a bare PyTorch loop: the same model, the same batches, alternated in one
    process.

    Each round trains a fresh copy of the same initial model for `--steps` steps, in Lightning (the
    `CausalLMModule` that `expertcache pretrain` uses) and in a hand-written loop doing the same work (forward with
    the load-balancing loss, backward, clip, AdamW, the LR schedule), the order reversed every other round. The
    first `--warmup` steps of each block are left out; tokens/s = a batch's tokens / the median step time. Target:
    Lightning within 10% of bare.

    Args:
        recipe: shipped pretraining recipe name or YAML (the model shape and the batch)
        steps: steps per block
        warmup: steps left out at the start of every block
        rounds: Lightning/bare alternations
        threads: torch threads (0: torch's default)
        out: also write the JSON here
    """
    config = dict(locals())
    from expertcache.telemetry.atomic import check_output

    _counts(steps=steps, warmup=warmup, rounds=rounds, threads=threads)
    if warmup >= steps:
        raise InputError(f"--warmup {warmup}: leaves none of --steps {steps} to time")
    check_output(out)
    recipe_name = recipe
    from transformers import AutoModelForCausalLM

    from expertcache.trainer.config import load_recipe

    from expertcache.recipes.cli import resolve_recipe
    from expertcache.trainer.pretrain import PretrainRecipe

    if threads:
        torch.set_num_threads(threads)
    recipe = load_recipe(PretrainRecipe, resolve_recipe(recipe_name))
    vocab = 8192
    cfg = recipe.model.to_hf_config(vocab, 0, 1)
    torch.manual_seed(0)
    init = AutoModelForCausalLM.from_config(cfg).state_dict()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, vocab, (recipe.data.batch_size, recipe.data.seq_len), generator=g)
               for _ in range(steps)]
    tokens = recipe.data.batch_size * recipe.data.seq_len

    def fresh():
        m = AutoModelForCausalLM.from_config(cfg)
        m.load_state_dict(copy.deepcopy(init))
        return m

    prov = started()  # the code and the machine, before the work
    blocks = {"lightning": lightning_block, "bare": bare_block}
    # ABBA order (the harness's), so neither loop always runs on a warmer machine
    runs = alternate(["lightning", "bare"], rounds,
                     lambda which, r: blocks[which](fresh(), recipe.train, batches, steps)[warmup:])
    light, bare = [t for x in runs["lightning"] for t in x], [t for x in runs["bare"] for t in x]
    ml, mb = statistics.median(light), statistics.median(bare)
    res = {
        "benchmark": "train_loop", "recipe": recipe_name,
        "model_parameters": sum(p.numel() for p in fresh().parameters()),
        "batch": [recipe.data.batch_size, recipe.data.seq_len], "precision": recipe.train.precision,
        "steps_per_block": steps, "warmup_excluded": warmup, "rounds": rounds, "threads": torch.get_num_threads(),
        "lightning": {"median_step_s": round(ml, 4), "tokens_per_s": round(tokens / ml, 1), "steps": len(light)},
        "bare": {"median_step_s": round(mb, 4), "tokens_per_s": round(tokens / mb, 1), "steps": len(bare)},
        "lightning_over_bare_tokens_per_s": round(mb / ml, 4),
        "lightning_vs_bare": compare([statistics.median(x) for x in runs["lightning"]],
                                     [statistics.median(x) for x in runs["bare"]]),
        "target": "lightning within 10% of bare (ratio >= 0.90)", "pass": mb / ml >= 0.90,
        "commit": prov["commit"], "dirty": prov["dirty"],
    }
    if out:
        res = write_result(out, res, config, command_line("bench train", bench_train, config), provenance=prov)
    return res


def bench_telemetry(model: str = "runs/base-tiny/model", batch: int = 8, seq: int = 256, reps: int = 12,
                    warmup: int = 2, out: Optional[str] = None) -> dict:
    """Recording overhead: a forward alone against the same forward under the routing recorder, alternated in one
    run.

    Each variant is the forward with the hooks attached plus turning the captured tensors into trace rows; the
    Parquet write is timed apart (I/O, once per batch, off the forward). `plain_control` repeats the plain forward:
    its gap to `plain` is this measurement's noise floor. Targets: ids and weights at most 3% of the forward's time,
    with hidden states at most 15%, at 8 x 256.

    Args:
        model: HF checkpoint; where the default is absent, the base-tiny recipe's shape with random weights
            (routing costs the same)
        batch: sequences per forward
        seq: tokens per sequence
        reps: alternations (each runs every variant once)
        warmup: alternations left untimed first
        out: also write the JSON here
    """
    config = dict(locals())
    import numpy as np

    from expertcache.telemetry.atomic import check_output
    from expertcache.telemetry.parquet_trace import TraceWriter
    from expertcache.telemetry.recorder import Recorder, rows_from_calls

    _counts(batch=batch, seq=seq, reps=reps, warmup=warmup)
    check_output(out)
    from expertcache.telemetry.hf import load_causal_lm

    from expertcache.recipes.cli import resolve_recipe

    if model != "runs/base-tiny/model" and not Path(model, "config.json").is_file():
        raise InputError(f"--model {model}: no checkpoint there (no config.json); leave --model out to time the "
                         f"base-tiny recipe's shape with random weights")
    if Path(model, "config.json").is_file():
        lm, source = load_causal_lm(model, dtype=torch.float32), model
    else:
        from expertcache.trainer.config import load_recipe
        from expertcache.trainer.pretrain import PretrainRecipe

        r = load_recipe(PretrainRecipe, resolve_recipe("base-tiny"))
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM

        lm, source = AutoModelForCausalLM.from_config(r.model.to_hf_config(8192, 0, 1)), "base-tiny shape, random"
    lm.eval()
    x = torch.randint(2, lm.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    seq_ids = np.repeat(np.arange(batch, dtype=np.int32), seq)
    pos = np.tile(np.arange(seq, dtype=np.int32), batch)

    def plain():
        t = time.perf_counter()
        lm(input_ids=x, use_cache=False)
        return time.perf_counter() - t, 0.0

    def recorded(hidden: bool):
        def run():
            with Recorder(lm, hidden=hidden) as rec:
                t = time.perf_counter()
                lm(input_ids=x, use_cache=False)
                rows = rows_from_calls(rec.take(), [(seq_ids, pos)], False, hidden)
                dt = time.perf_counter() - t
            w = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                with TraceWriter(Path(d) / "t.parquet", rec.meta("bench"), with_hidden=hidden) as tw:
                    tw.write(rows["seq_id"], rows["pos"], rows["layer"], "prefill", "bench",
                             np.zeros(len(rows["seq_id"]), np.int32), rows["ids"], rows["weights"],
                             hidden=rows.get("hidden"))
            return dt, time.perf_counter() - w
        return run

    # plain_control repeats the plain forward: its gap to plain is the noise floor of this measurement
    variants = {"plain": plain, "ids_weights": recorded(False), "plain_control": plain, "with_hidden": recorded(True)}
    prov = started()  # the code and the machine, before the work
    with torch.no_grad():  # the first --warmup rounds untimed
        runs = alternate(list(variants), reps + warmup, lambda k, rep: variants[k]())
    times = {k: [dt for dt, _ in v[warmup:]] for k, v in runs.items()}
    writes = {k: [wt for _, wt in v[warmup:]] for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    over = {k: med[k] / med["plain"] - 1 for k in ("ids_weights", "with_hidden", "plain_control")}
    res = {"benchmark": "telemetry_overhead", "model": source, "batch": [batch, seq], "reps": reps,
           "threads": torch.get_num_threads(),
           "forward_s_median": {k: round(v, 4) for k, v in med.items()},
           "overhead": {k: round(v, 4) for k, v in over.items()},
           "vs_plain": {k: compare(times[k], times["plain"]) for k in over},
           "parquet_write_s_median": {k: round(statistics.median(writes[k]), 4)
                                      for k in ("ids_weights", "with_hidden")},
           "targets": {"ids_weights": 0.03, "with_hidden": 0.15},
           "pass": over["ids_weights"] <= 0.03 and over["with_hidden"] <= 0.15,
           "commit": prov["commit"], "dirty": prov["dirty"]}
    if out:
        res = write_result(out, res, config, command_line("bench telemetry", bench_telemetry, config),
                           provenance=prov)
    return res
