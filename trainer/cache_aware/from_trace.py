"""`mode: aux-only` from a recorded trace (`routers.trace`): the auxiliary routers learn from the hidden states and
routing a trace holds (`expertcache trace record --hidden true`, through the offload engine for a checkpoint bigger
than memory), so no forward of the model runs and no expert is read. The base is opened as in streamed training
(non-expert weights only: the routers give the heads their native prior and the saved file its fingerprint); the
run folder gets `model/` (the base's files, unchanged, plus aux_routers.safetensors), recipe.yaml and result.json.

Refused in one line before any training: a trace without hidden states, a trace of another model's shape (layers,
experts, top-k, hidden size), a trace too short for a batch."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from expertcache.telemetry.errors import InputError

COMMAND = "train-cache-aware"


def read_trace_for(trace: str | Path, base: Path):
    """`(meta, ids [L, N, k], hidden [L, N, H], seq_id [N], pos [N])` of `trace`, checked against the base's config
    (read alone: no weight)."""
    from expertcache.telemetry.adapters import adapter_for
    from expertcache.telemetry.hf import load_config
    from expertcache.telemetry.parquet_trace import check_compatible, read_meta, read_trace

    trace = Path(trace)
    if not trace.is_file():
        raise InputError(f"routers.trace {trace}: no such file (record one: expertcache trace record --hidden true)")
    meta = read_meta(trace)
    config = load_config(base)
    a = adapter_for(config)
    try:
        check_compatible(meta, config)
    except InputError as e:
        raise InputError(f"routers.trace {trace} is not a trace of the base {base}: {e}") from None
    if meta.hidden_size != a.hidden_size:
        raise InputError(f"routers.trace {trace} is not a trace of the base {base}: its hidden states have "
                         f"{meta.hidden_size} values, the model's {a.hidden_size}")
    t = read_trace(trace, columns=None)
    if "hidden" not in t.table.column_names:
        raise InputError(f"routers.trace {trace} holds no hidden states; record it with --hidden true "
                         f"(expertcache trace record --hidden true [--offload true])")
    order = t._token_order()
    ids, seq, pos = t.routing()
    hidden = t.layer_matrix("hidden", order)
    return meta, ids, hidden, seq, pos


def batches(seq: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Token indices `[B, T]` per batch: whole sequences (tokens in position order), sequences of one length
    together."""
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    ends = np.r_[starts[1:], len(seq)]
    by_len: dict[int, list[np.ndarray]] = {}
    for s, e in zip(starts, ends):
        if e - s >= 2:  # a single token teaches neither head (no next token, no pair of layers in time)
            by_len.setdefault(int(e - s), []).append(np.arange(s, e))
    out = []
    for n in sorted(by_len):
        rows = by_len[n]
        for i in range(0, len(rows), batch_size):
            out.append(np.stack(rows[i:i + batch_size]))
    return out


def run_from_trace(recipe, base: Path, resume: bool = True) -> dict:
    """Train the aux routers of `recipe` (mode aux-only) from `recipe.routers.trace`; returns result.json's dict."""
    import yaml

    from expertcache.telemetry.adapters import adapter_for
    from expertcache.telemetry.atomic import claim_dir, mark_output, output_marker, write_json, write_text
    from expertcache.telemetry.hf import load_tokenizer

    from ..aux_routers import AuxRouters, config_for
    from ..config import RecipeError, to_dict
    from ..runfolder import deterministic_algorithms, finish_run, is_run_folder
    from . import stream

    r = recipe.routers
    _, ids, hidden, seq, _ = read_trace_for(r.trace, base)
    groups = batches(seq, recipe.data.batch_size)
    if not groups:
        raise InputError(f"routers.trace {r.trace} holds no sequence of 2 tokens or more")
    out = Path(recipe.out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"out_dir {out} is a file; expected a run folder")
    claim_dir(out, COMMAND, resume=True, legacy=is_run_folder)
    recipe_text = yaml.safe_dump(to_dict(recipe), sort_keys=False)
    if resume and (out / "result.json").is_file() and (out / "model" / "config.json").is_file() and \
            (out / "recipe.yaml").is_file() and (out / "recipe.yaml").read_text() == recipe_text:
        import json

        print(f"{out}: finished with this recipe; nothing to do (pass --resume false to start over)", file=sys.stderr)
        return {**json.loads((out / "result.json").read_text()), "nothing_to_do": True}
    own = (base / "tokenizer.json").is_file() or (base / "tokenizer_config.json").is_file()
    tok = load_tokenizer(str(base) if own else recipe.data.tokenizer)
    if stream._RUNTIME is None:
        raise InputError("aux-only from a trace opens the base through the runtime (non-expert weights only), and "
                         "none is installed: call expertcache.trainer.cache_aware.stream.set_streamed_runtime("
                         "expertcache.runtime.engine.train_stream) first (the expertcache CLI does)")
    out.mkdir(parents=True, exist_ok=True)
    if output_marker(out) is None:
        mark_output(out, COMMAND, complete=False)
    write_text(out / "recipe.yaml", recipe_text)
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    torch.manual_seed(recipe.train.seed)
    streamed = stream._RUNTIME.open_streamed(base, recipe.train.expert_tier, stream.compute_dtype(recipe))
    try:
        model = streamed.model.requires_grad_(False)
        routers = [L.router for L in adapter_for(model).moe_layers(model)]
        aux = AuxRouters(config_for(model, r.temporal, r.spatio, r.rank, r.refine_budget, r.prefetch_threshold,
                                    r.horizon, r.horizon_decay, r.history))
        n_aux, n_backbone = aux.num_parameters(), streamed.num_parameters
        if n_aux > 0.01 * n_backbone:
            raise RecipeError(f"auxiliary routers have {n_aux} parameters, over 1% of the backbone's {n_backbone}; "
                              f"lower routers.rank ({r.rank})")
        dtype = next(aux.parameters()).dtype
        lr = r.lr or recipe.train.lr
        opt = torch.optim.AdamW(aux.parameters(), lr=lr, weight_decay=recipe.train.weight_decay)
        warm = recipe.train.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        rng = np.random.default_rng(recipe.train.seed)
        order: list[int] = []
        losses: list[float] = []
        t0 = time.perf_counter()
        aux.train()
        with deterministic_algorithms(recipe.train.deterministic):  # a repeated run: the same routers
            for step in range(recipe.train.max_steps):
                if not order:
                    order = list(rng.permutation(len(groups)))
                idx = groups[order.pop()]  # [B, T] token indices
                b = idx.shape[0]
                flat = idx.reshape(-1)
                h = [torch.from_numpy(hidden[i, flat]).to(dtype) for i in range(len(routers))]
                k = [torch.from_numpy(ids[i, flat].astype(np.int64)) for i in range(len(routers))]
                parts = aux.loss(h, k, routers, b)
                loss = sum(parts.values())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                losses.append(float(loss.detach()))
                if not math.isfinite(losses[-1]):
                    raise InputError(f"routers.trace {r.trace}: the aux loss became {losses[-1]} at step {step} "
                                     f"(non-finite hidden states in the trace?)")
                if recipe.train.log_every and (step + 1) % recipe.train.log_every == 0:
                    print(f"step {step + 1}/{recipe.train.max_steps} aux loss {losses[-1]:.4f}", file=sys.stderr)
        train_s = time.perf_counter() - t0
        stream.save_model(streamed, model, tok, out / "model", aux.eval())
    finally:
        streamed.close()
    result = {"name": recipe.name, "mode": recipe.mode, "base": str(base), "out_dir": str(out), "streamed": True,
              "from_trace": str(r.trace), "trace_tokens": int(len(seq)), "trace_sequences": int(len(set(seq.tolist()))),
              "global_step": recipe.train.max_steps, "train_seconds_this_run": round(train_s, 2),
              "trainable": "aux routers", "parameters": {"backbone": n_backbone, "aux_routers": n_aux},
              "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
              "losses": losses, "model": str(out / "model"), "completed": True}
    write_json(out / "result.json", result)
    finish_run(out, COMMAND)
    return result
