"""Low-rank adapters on attention (peft's LoRA), trained beside the routers (`quality.lora_rank`).

Router-only post-training moves where tokens go, not what attention computes; an adapter of rank r on attention's
projections (q/k/v/o by default) lets the backbone follow the new routing at a few parameters per layer, while the
experts, the embeddings and the rest stay frozen. It works the same in memory and with streamed experts (attention
is never streamed). The base the run distils to is the same weights with the adapters off and the original routers
(`adapters_off`): no second copy. The checkpoint a run saves is a plain one: each adapter merged into its
projection's weight (`merge_into`), so transformers, `expertcache load` and llama.cpp's converter read it as they
read the base.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .config import RecipeError


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name is an adapter's (peft names them `...lora_A.<adapter>.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


def targeted(model: torch.nn.Module, targets) -> list[torch.nn.Linear]:
    """The Linear modules an adapter goes on: those whose last name is one of `targets`."""
    return [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets]


def adapter_params(model: torch.nn.Module, rank: int, targets) -> int:
    """Parameters the adapters add: rank x (in + out) per targeted Linear (the model may be on the meta device)."""
    return sum(rank * (m.in_features + m.out_features) for m in targeted(model, targets))


def adapter_bytes(model: torch.nn.Module, rank: int, targets, tokens: int) -> int:
    """Memory the adapters add to a training step on `tokens` tokens: their fp32 weights, gradients and two Adam
    moments (16 bytes a parameter), and what each keeps for its backward per token: its input in fp32 (peft casts
    it to the adapter's dtype) and the rank-wide product."""
    return sum(16 * rank * (m.in_features + m.out_features) + tokens * 4 * (m.in_features + rank)
               for m in targeted(model, targets))


def add_lora(model: torch.nn.Module, rank: int, alpha: float, targets) -> int:
    """Adapters of rank `rank` (scale alpha / rank; B starts at 0, so the model starts as the base) on every
    targeted projection, in place; returns how many parameters they add. A target list that names no Linear of the
    model is refused in one line, naming the projections it has."""
    from peft import LoraConfig, inject_adapter_in_model

    if not targeted(model, targets):
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                        and "attn" in n})
        raise RecipeError(f"quality.lora_targets={list(targets)} names no Linear of this model; its attention has "
                          f"{', '.join(names) or 'none'}")
    n = adapter_params(model, rank, targets)
    frozen = {id(p): p.requires_grad for p in model.parameters()}
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                                       bias="none"), model)
    for name, p in model.named_parameters():
        if id(p) in frozen:  # peft freezes everything but its adapters: what trained before still trains
            p.requires_grad_(frozen[id(p)])
        elif is_adapter_param(name) and p.dtype != torch.float32:  # peft makes them in the base's dtype: they
            p.data = p.data.float()  # train in fp32, as the routers do (an Adam step in bf16 rounds away)
    return n


def _layers(model: torch.nn.Module) -> list:
    import sys

    if "peft" not in sys.modules:  # no adapter was ever added in this process: nothing to import to know it
        return []
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextmanager
def adapters_off(model: torch.nn.Module):
    """The base's forward: every adapter skipped, their parameters untouched (peft's own `enable_adapters` would
    flip `requires_grad`, mid-step, on the parameters the optimizer steps)."""
    layers = _layers(model)
    was = [m._disable_adapters for m in layers]
    try:
        for m in layers:
            m._disable_adapters = True
        yield
    finally:
        for m, w in zip(layers, was):
            m._disable_adapters = w


@torch.no_grad()
def deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{the projection's weight name, as in the base: alpha/r * B A in fp32} for every adapted projection: what a
    streamed run adds to the checkpoint's own tensors (`StreamedBase.save_into`), so the saved weights are the
    base's, not a bf16 copy of them (`train.frozen_dtype=bf16`), plus the adapters."""
    from peft.tuners.lora import LoraLayer

    return {f"{name}.weight": sum(m.get_delta_weight(a).float() for a in m.active_adapters)
            for name, m in model.named_modules() if isinstance(m, LoraLayer)}  # (merge_into adds the same)


@torch.no_grad()
def merge_into(model: torch.nn.Module) -> list[str]:
    """Each adapter merged into its projection (W + alpha/r * B A, in W's dtype) and the projection put back as the
    plain Linear it was, so the model saves under the base's tensor names; returns the merged weights' parameter
    names. For the end of training: the adapters are gone after it."""
    add = deltas(model)
    for weight, delta in add.items():
        name = weight.removesuffix(".weight")
        base = model.get_submodule(name).get_base_layer()
        base.weight.copy_((base.weight.float() + delta).to(base.weight.dtype))
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, base)
    return list(add)
