"""The trainer's and the recorder's own benchmarks, `expertcache bench train` and `expertcache bench telemetry`:
they build the model of a pretraining recipe, so they live with the recipes (the one area that may import the
trainer and the runtime's harness both)."""

from __future__ import annotations

import copy
import json as _json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from expertcache.telemetry.atomic import write_json
from expertcache.telemetry.errors import InputError, check_counts

from expertcache.runtime.bench.harness import alternate, compare
from expertcache.runtime.bench.results import command_line, started, write_result


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

    check_counts(("warmup", "threads"), steps=steps, warmup=warmup, rounds=rounds, threads=threads)
    if warmup >= steps:
        raise InputError(f"--warmup {warmup}: leaves none of --steps {steps} to time")
    check_output(out)
    recipe_name = recipe
    from expertcache.recipes.cli import resolve_recipe

    recipe_path = resolve_recipe(recipe_name)  # a name or file that is neither: one line before the imports below
    from transformers import AutoModelForCausalLM

    from expertcache.trainer.config import load_recipe

    from expertcache.recipes.cli import resolve_recipe
    from expertcache.trainer.pretrain import PretrainRecipe

    if threads:
        torch.set_num_threads(threads)
    recipe = load_recipe(PretrainRecipe, recipe_path)
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


def bench_telemetry(model: str = "runs/base-tiny/model", batch_size: int = 8, seq_len: int = 256, reps: int = 12,
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
        batch_size: sequences per forward
        seq_len: tokens per sequence
        reps: alternations (each runs every variant once)
        warmup: alternations left untimed first
        out: also write the JSON here
    """
    config = dict(locals())
    import numpy as np

    from expertcache.telemetry.atomic import check_output
    from expertcache.telemetry.parquet_trace import TraceWriter
    from expertcache.telemetry.recorder import Recorder, rows_from_calls

    check_counts(("warmup",), batch_size=batch_size, seq_len=seq_len, reps=reps, warmup=warmup)
    check_output(out, model)
    from expertcache.telemetry.hf import load_causal_lm

    from expertcache.recipes.cli import resolve_recipe

    if Path(model).resolve() != Path("runs/base-tiny/model").resolve() and not Path(model, "config.json").is_file():
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
    x = torch.randint(2, lm.config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    seq_ids = np.repeat(np.arange(batch_size, dtype=np.int32), seq_len)
    pos = np.tile(np.arange(seq_len, dtype=np.int32), batch_size)

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
    res = {"benchmark": "telemetry_overhead", "model": source, "batch": [batch_size, seq_len], "reps": reps,
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


FIELDS = ("checkpoint", "experts_bytes", "quant_bits", "trainable", "steps", "tokens_per_step", "tokens_per_s",
          "bytes_read_per_step", "disk_read_gbps", "roofline_tokens_per_s", "read_wait_s", "peak_rss_bytes",
          "loss_first", "loss_last", "completed", "floor_bytes", "memory_budget_bytes", "step_s", "step_read_bytes",
          "fit_tokens_per_s")


def _train_big_run(ckpt: Path, out: Path, a, cg) -> dict:
    """One run of bench train-big in a process of its own inside the cgroup `cg` (None: outside any), resumable:
    a run whose row was written is that row."""
    done = out / "run.json"
    if done.is_file():  # finished by an earlier invocation (its row as measured then): resumable, run by run
        return _json.loads(done.read_text())
    args = ["train-cache-aware", "--recipe", "locality", f"base={ckpt}", f"out_dir={out}", f"data.corpus={a.corpus}",
            f"data.tokenizer={ckpt}", f"data.batch_size={a.batch_size}", f"data.seq_len={a.seq_len}",
            "data.val_batches=1", f"train.max_steps={a.steps}", "train.warmup_steps=1", "train.log_every=1",
            f"train.val_every={a.steps + 1}", f"train.ckpt_every={a.steps}", "train.wandb=false",
            f"train.memory_gb={a.memory_gb}", f"train.expert_tier={a.tier}", f"train.frozen_dtype={a.frozen_dtype}",
            "quality.trainable=routers",
            f"quality.distill={a.distill}", "locality.weight=1.0", "--resume", "false"]
    cmd = [sys.executable, "-c", "import sys; from expertcache.recipes.cli import main; sys.exit(main())", *args]
    if cg is not None:
        cg.reset_peak()
    p = subprocess.run(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                       preexec_fn=cg.preexec if cg is not None else None)
    row = {"memory_cgroup_bytes": cg.limit_bytes if cg is not None else None,
           "cgroup_peak_bytes": cg.peak_bytes() if cg is not None else None, "exit": p.returncode}
    res = out / "result.json"
    if p.returncode != 0 or not res.is_file():
        last = [ln for ln in p.stderr.splitlines() if ln.strip()][-1:] or [""]
        return {"checkpoint": str(ckpt), "completed": False, **row,
                "error": f"exit {p.returncode}" + (" (killed: out of memory in the cgroup?)" if p.returncode in
                                                   (-9, 137) else "") + f": {last[0][:300]}"}
    r = _json.loads(res.read_text())
    out_row = {**{k: r.get(k) for k in FIELDS}, **row, "commit": a.commit}
    out_row["checkpoint"] = Path(out_row["checkpoint"]).name  # a folder name, not this machine's path
    write_json(done, out_row)
    trained = out / "model"  # the trained copy of a bigger-than-memory checkpoint: as large as the base; the
    if a.drop_model and trained.is_dir():  # figures are the run's, so it goes unless asked to keep it
        shutil.rmtree(trained)
    return out_row


def bench_train_big(model: str, corpus: str = "data/corpus", make_layers: int = 0, work: str = "runs/train-big",
                    memory_gb: float = 7.5, cgroup_gb: float = 8.0, tier: str = "disk", steps: int = 4,
                    batch_size: int = 1, seq_len: int = 256, distill: float = 0.0, bits: int = 0, group: int = 64,
                    frozen_dtype: str = "fp32", runs: Optional[list[str]] = None, drop_model: bool = True,
                    out: Optional[str] = None) -> dict:
    """Router post-training of a checkpoint bigger than memory, inside a memory cgroup: the runs of
    results/train_big.json.

    Each run is `expertcache train-cache-aware` with its experts streamed (`train.memory_gb`), in a process of its
    own inside the cgroup (as root; outside it otherwise, said in `cgroup`): the bf16 checkpoint first, then
    (`--bits 4`) the same checkpoint quantized by `expertcache quantize`'s writer. Resumable run by run: a run whose
    row was written in `--work` is reused. The JSON: `commit`, `host_ram_bytes`, `runs` (each: checkpoint,
    experts_bytes, memory_cgroup_bytes, trainable, steps, tokens_per_step, tokens_per_s, bytes_read_per_step,
    disk_read_gbps measured at the run's end, roofline_tokens_per_s, peak_rss_bytes, cgroup_peak_bytes, loss_first,
    loss_last, completed). Bench big's 27-layer Qwen3-30B-A3B-shaped checkpoint in 8 GiB:
    `expertcache bench train-big --model runs/big/ckpt --cgroup_gb 8 --memory_gb 7.5 --steps 6 --seq_len 128 --bits
    4 --out results/train_big.json`; `--make_layers 2` writes a 2-layer checkpoint of that shape at --model first.

    Args:
        model: checkpoint folder (bf16)
        corpus: the training text (`expertcache data build` or `make quickstart` builds one)
        make_layers: first write bench big's checkpoint with this many layers at --model (0: --model as it is)
        work: the runs' folders (and the quantized checkpoint)
        memory_gb: train.memory_gb (each run checks its floor before its first step)
        cgroup_gb: the memory cgroup, GiB (0: none)
        tier: train.expert_tier (disk, host, throttled:<GB/s>)
        steps: optimizer steps per run
        batch_size: sequences per step
        seq_len: tokens per sequence
        distill: quality.distill (a third read pass per step)
        bits: also the run on the checkpoint quantized to 4 or 8 bits (0: the bf16 run only)
        group: the quantization group
        frozen_dtype: train.frozen_dtype, the frozen non-expert weights in fp32 or bf16 (routers stay fp32)
        runs: which runs: bf16 and/or int4/int8 (default: bf16, and int{--bits} with --bits)
        drop_model: delete each run's trained checkpoint once measured (each is as large as the base)
        out: also write the JSON here (only when a run completed)
    """
    config = dict(locals())
    from types import SimpleNamespace

    from expertcache.telemetry.atomic import check_output

    if bits not in (0, 4, 8):
        raise InputError(f"--bits {bits}: expected 4 or 8 (0: the bf16 run only)")
    known = {"bf16", *([f"int{bits}"] if bits else [])}
    which = set(runs if runs is not None else ["bf16", *([f"int{bits}"] if bits else [])])
    if not which or which - known:
        raise InputError(f"--runs {runs}: expected a subset of [{','.join(sorted(known))}] (int4/int8 need --bits)")
    check_counts(steps=steps, batch_size=batch_size, seq_len=seq_len)
    for name, v, ok, want in (("memory_gb", memory_gb, memory_gb > 0, "> 0 (the streamed run's budget)"),
                              ("cgroup_gb", cgroup_gb, cgroup_gb >= 0, ">= 0 (0: no cgroup)"),
                              ("make_layers", make_layers, make_layers >= 0, ">= 0 (0: --model as it is)"),
                              ("distill", distill, distill >= 0, ">= 0 (0: no distillation)")):
        if not ok:
            raise InputError(f"--{name} {v:g}: expected {want}")
    from expertcache.runtime.storage.tiers import TierSpec

    TierSpec.parse(tier)  # a tier name the engine knows, before any run
    if bits:
        from expertcache.runtime.kernels.quant import check_group

        check_group(bits, group, 64 * group)  # the format itself (the checkpoint's dimensions: when it is written)
    if make_layers and any(Path(model).iterdir() if Path(model).is_dir() else []):
        have = Path(model) / "config.json"
        layers = _json.loads(have.read_text()).get("num_hidden_layers") if have.is_file() else None
        if layers != make_layers or not (Path(model) / "model.safetensors.index.json").is_file():
            raise InputError(f"--model {model} already holds other files; --make_layers {make_layers} writes bench "
                             f"big's checkpoint there: give a new or empty folder (or that checkpoint of "
                             f"{make_layers} layers, reused)")
    if frozen_dtype not in ("fp32", "bf16"):
        raise InputError(f"--frozen_dtype {frozen_dtype}: expected fp32 or bf16")
    if not make_layers and not (Path(model) / "config.json").is_file():
        raise InputError(f"--model {model}: no checkpoint there (no config.json); --make_layers N writes bench "
                         f"big's checkpoint of N layers there first")
    if not Path(corpus).is_dir():
        raise InputError(f"--corpus {corpus}: no such folder (`expertcache data build` or `make quickstart` builds "
                         f"one)")
    check_output(out, model, corpus)

    from expertcache.runtime.bench.memcg import MemoryCgroup

    prov = started()  # the code and the machine, before the work
    a = SimpleNamespace(**config, commit=prov["commit"])  # each row records the code it ran (a later run may reuse it)
    ckpt, folder = Path(model), Path(work)
    if make_layers:
        from expertcache.runtime.bench.bigckpt import write_checkpoint

        write_checkpoint(ckpt, make_layers)
    cg, why = MemoryCgroup.create(int(cgroup_gb * 2 ** 30)) if cgroup_gb else (None, "not asked")
    rows = []
    try:
        if "bf16" in which:
            rows.append(_train_big_run(ckpt, folder / "bf16", a, cg))
        if bits and which - {"bf16"}:
            from expertcache.runtime.kernels import quant_write

            q = folder / f"int{bits}-ckpt"
            if not (q / "config.json").is_file():  # written outside the cgroup, once
                quant_write.write_quantized(ckpt, q, bits, group)  # (the tokenizer files come along)
            rows.append(_train_big_run(q, folder / f"int{bits}", a, cg))
    finally:
        if cg is not None:
            cg.close()
    from expertcache.runtime.bench.bigckpt import physical_ram

    doc = {"commit": prov["commit"], "host_ram_bytes": physical_ram(), "cgroup": why or "memory cgroup",
           "runs": rows}
    failed = [r for r in rows if not r.get("completed")]
    for r in failed:
        print(f"bench train-big: the run on {r.get('checkpoint')} did not complete: "
              f"{r.get('error', 'stopped early')}", file=sys.stderr)
    if failed and len(failed) == len(rows):  # nothing measured: the last result stays as it was
        print("bench train-big: no run completed; nothing written" + (f" ({out} kept as it was)" if out else ""),
              file=sys.stderr)
        return {**doc, "ok": False}
    if out:
        doc = write_result(out, doc, config, command_line("bench train-big", bench_train_big, config),
                           provenance=prov)
    return {**doc, "ok": not failed}
