"""Cache-aware post-training of a base whose experts do not fit in memory (`train.memory_gb > 0`, or any
`expertcache quantize`d base): the experts stay frozen in the checkpoint and are streamed layer by layer through
the runtime's tiers; the routers (and the aux routers) train. The trainer does not import the runtime: the entry
point installs it (`set_streamed_runtime(expertcache.runtime.engine.train_stream)`; `expertcache train-cache-aware` does).

Checks, each one line before any work: what trains (routers only: `trainable=all|moe` names what is supported; a
quantized base's packed experts cannot train), and the budget (`train.memory_gb` below the floor of non-expert
weights, one layer's experts, activations and this process: the floor printed)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional, Protocol

import torch

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.memory import peak_rss_bytes, reset_peak_rss


class StreamedRuntime(Protocol):
    """What the trainer needs of `expertcache.runtime.engine.train_stream`."""

    def plan(self, path, dtype: torch.dtype, tier: str = "disk"): ...

    def check_budget(self, plan, memory_gb: float, tokens: int, distill: bool, adapter_bytes: int = 0) -> dict: ...

    def open_streamed(self, path, tier: str = "disk", dtype: torch.dtype = torch.float32): ...

    def check_resident(self, base, memory_gb: float, parts: dict) -> int: ...


_RUNTIME: Optional[StreamedRuntime] = None


def set_streamed_runtime(rt: Optional[StreamedRuntime]) -> None:
    """Install the runtime's streamed-training module (None uninstalls it)."""
    global _RUNTIME
    _RUNTIME = rt


def quantized_bits(base: Path) -> int | str | None:
    """The bits of an `expertcache quantize`d base (its config's quantization_config), None for a plain one."""
    try:
        qc = json.loads((base / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return qc.get("bits", "?") if isinstance(qc, dict) else None


def wants_stream(recipe, base: Path) -> bool:
    """Whether the run streams its experts; the recipe is refused (one line) where streamed experts cannot do what
    it asks."""
    bits = quantized_bits(base)
    streamed = recipe.train.memory_gb > 0 or bits is not None
    if not streamed and recipe.train.frozen_dtype != "fp32":
        raise InputError(f"train.frozen_dtype={recipe.train.frozen_dtype} applies to streamed experts "
                         f"(train.memory_gb > 0); in memory the whole model is fp32 (train.precision sets it)")
    if streamed and recipe.train.frozen_dtype == "bf16" and recipe.mode != "locality-only":
        raise InputError(f"train.frozen_dtype=bf16 trains the routers of locality-only recipes; this recipe's mode "
                         f"{recipe.mode} trains aux routers, which take fp32 hidden states: use train.frozen_dtype=fp32")
    trains = recipe.quality.trainable if recipe.mode != "aux-only" else "routers"  # aux-only: the backbone frozen
    if bits is not None and trains != "routers":
        raise InputError(f"quality.trainable={trains}: the base {base} holds int{bits} experts (expertcache "
                         f"quantize), which cannot train; supported on a quantized base: quality.trainable=routers "
                         f"(routers and aux routers, experts read packed)")
    if streamed and trains != "routers":
        raise InputError(f"quality.trainable={trains} with streamed experts (train.memory_gb="
                         f"{recipe.train.memory_gb:g}): streamed experts are frozen; supported: "
                         f"quality.trainable=routers (routers and aux routers), or train.memory_gb=0 to load the "
                         f"whole model")
    if bits is not None and recipe.train.memory_gb <= 0:
        raise InputError(f"the base {base} holds int{bits} experts (expertcache quantize), which are only read "
                         f"streamed: set train.memory_gb to the memory the run may use")
    return streamed


def compute_dtype(recipe) -> torch.dtype:
    """The non-expert weights' dtype: bf16 under `train.precision=bf16-true` or `train.frozen_dtype=bf16`, else
    fp32 (what the in-memory path loads); the experts are converted to it per use."""
    t = recipe.train
    return torch.bfloat16 if t.precision == "bf16-true" or t.frozen_dtype == "bf16" else torch.float32


def keep_routers_fp32(recipe, model) -> None:
    """`train.frozen_dtype=bf16` (the frozen weights loaded in bf16): the routers, which train, go back to fp32 (their
    weights, gradients and Adam's state), and each takes its bf16 input in fp32 (a forward pre-hook), so that the
    routing is computed in fp32 as before; what follows the router (the experts, the residual stream) stays bf16."""
    if recipe.train.frozen_dtype != "bf16" or recipe.train.precision == "bf16-true":
        return
    from expertcache.telemetry.adapters import adapter_for

    def up(_module, args):
        return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    for L in adapter_for(model).moe_layers(model):
        L.router.float()
        L.router.register_forward_pre_hook(up)


_PEAK_SCOPE = "the process's life"  # what `peak_rss_bytes` covers: this run once `open_base` reset the peak


def open_base(recipe, base: Path):
    """`(StreamedBase, floor parts)`: the budget checked from the checkpoint's headers, then the base opened."""
    if _RUNTIME is None:
        raise InputError("streamed training (train.memory_gb > 0) needs the runtime's expert tiers, and none is "
                         "installed: call expertcache.trainer.cache_aware.stream.set_streamed_runtime("
                         "expertcache.runtime.engine.train_stream) first (the expertcache CLI does)")
    dtype = compute_dtype(recipe)
    plan = _RUNTIME.plan(base, dtype, recipe.train.expert_tier)
    tokens = recipe.data.batch_size * recipe.data.seq_len
    q = recipe.quality
    adapters = 0
    if q.lora_rank:  # counted on the config's shapes (a model on the meta device: nothing allocated)
        from transformers import AutoModelForCausalLM

        from expertcache.telemetry.hf import load_config

        from ..lora import adapter_bytes

        with torch.device("meta"):
            adapters = adapter_bytes(AutoModelForCausalLM.from_config(load_config(base)), q.lora_rank,
                                     q.lora_targets, tokens)
    parts = _RUNTIME.check_budget(plan, recipe.train.memory_gb, tokens, bool(recipe.quality.distill), adapters)
    global _PEAK_SCOPE
    _PEAK_SCOPE = "this run" if reset_peak_rss() else "the process's life"  # the budget is the run's, not the process's
    return plan, parts


def save_model(streamed, model, tok, model_dir: Path, aux=None, add=None) -> None:
    """The trained checkpoint: the base's files copied, router tensors rewritten and `add` ({tensor name: delta}:
    the attention adapters) added to the base's own tensors (`StreamedBase.save_into`), the tokenizer and the aux
    routers beside them; swapped into place whole."""
    from expertcache.telemetry.atomic import atomic_dir

    with atomic_dir(model_dir) as tmp:
        streamed.save_into(tmp, model, add)
        tok.save_pretrained(str(tmp))
        if aux is not None:
            aux.save(tmp, model)


def stream_result(recipe, streamed, parts: dict, module, trainer, train_s: float, start_step: int) -> dict:
    """The run's figures (the fields of results/train_big.json's runs): tokens per second against the read
    roofline (a step's bytes over the tier's measured bandwidth), bytes read per step, peak memory, first and last
    loss.

    A step is timed from its batch's start to its optimizer step's end (`module.step_seconds`), and its bytes are
    the ones it read (`module.step_read_bytes`): validation passes and checkpoint writes fall outside both.
    `tokens_per_s` and `bytes_read_per_step` are medians over the steady steps (the first step, which warms the
    allocator and the reads' threads, is left out once there are three or more); `fit_tokens_per_s` is the whole
    fit's wall time, validation and checkpoints included."""
    import statistics

    c = streamed.counters()
    steps = trainer.global_step - start_step
    tokens = recipe.data.batch_size * recipe.data.seq_len
    p = streamed.plan
    bw = _RUNTIME.measure_read_gbps(streamed) if hasattr(_RUNTIME, "measure_read_gbps") else None
    secs, reads = list(module.step_seconds), list(module.step_read_bytes)
    steady = slice(1, None) if len(secs) >= 3 else slice(None)
    step_s = statistics.median(secs[steady]) if secs else None
    if reads:
        per_step = statistics.median(reads[steady])
    else:
        per_step = c["bytes_read"] / steps if steps else None
    losses = module.step_losses
    return {"checkpoint": p.path, "experts_bytes": p.experts_bytes, "quant_bits": p.quant_bits, "tier": p.tier,
            "memory_budget_bytes": int(recipe.train.memory_gb * 1e9), "floor_bytes": parts,
            "trainable": "routers" if recipe.mode != "aux-only" else "aux routers", "mode": recipe.mode,
            "steps": steps, "tokens_per_step": tokens,
            "tokens_per_s": tokens / step_s if step_s else None,
            "step_s": secs, "step_read_bytes": reads,
            "fit_tokens_per_s": steps * tokens / train_s if train_s > 0 else None,
            "expert_reads": c["reads"], "bytes_read_per_step": per_step,
            "read_wait_s": c["read_wait_s"],  # compute waiting on reads (what the overlap did not hide)
            "disk_read_gbps": bw, "roofline_tokens_per_s": tokens / (per_step / (bw * 1e9)) if bw and per_step
            else None, "peak_rss_bytes": peak_rss_bytes(), "peak_rss_scope": _PEAK_SCOPE,
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "losses": losses, "completed": trainer.global_step == recipe.train.max_steps,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
