"""Routing-locality losses on the backbone's own routers (softmax router probabilities).

Both act on `router_logits`, one `[B*T, E]` tensor per MoE layer as HF models return them with
`output_router_logits=True`, reshaped to `[B, T, E]` (tokens of one sequence adjacent).

- locality: adjacent-token routing consistency, averaged over the `T-1` adjacent pairs of each sequence, then
  over layers with per-layer weights. `dot`: `1 - <p_t, p_{t-1}>`; `l2`: `||p_t - p_{t-1}||^2`.
- domain: routing mass outside a domain's allowed expert set, `sum_{e not allowed} p_e`, averaged over tokens
  and layers; the allowed sets come from the base model's own usage (`allowed_experts`).
"""

from __future__ import annotations

import torch

from expertcache.telemetry.errors import InputError

LOCALITY_KINDS = ("dot", "l2")


def _probs(logits: torch.Tensor, batch: int) -> torch.Tensor:
    p = logits.float().softmax(dim=-1)  # [B*T, E]
    return p.view(batch, -1, p.shape[-1])  # [B, T, E]


def layer_weights(spec: list[float], n_layers: int) -> torch.Tensor:
    """Per-layer loss weights: `[]` = all 1; one value per MoE layer otherwise. Normalised to mean 1."""
    if not spec:
        w = torch.ones(n_layers)
    elif len(spec) != n_layers:
        raise InputError(f"locality layer_weights has {len(spec)} values; the model has {n_layers} MoE layers")
    else:
        w = torch.tensor(spec, dtype=torch.float32)
    if (w < 0).any() or w.sum() <= 0:
        raise InputError(f"locality layer_weights must be >= 0 and not all 0, got {spec}")
    return w * (n_layers / w.sum())


def locality_loss(router_logits, batch: int, kind: str = "dot", weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over layers (weighted) of the mean over adjacent token pairs of the routing change."""
    if kind not in LOCALITY_KINDS:
        raise InputError(f"locality kind {kind!r}; expected one of {LOCALITY_KINDS}")
    per_layer = []
    for logits in router_logits:
        p = _probs(logits, batch)
        prev, cur = p[:, :-1], p[:, 1:]  # [B, T-1, E]
        if kind == "dot":
            per_layer.append((1.0 - (prev * cur).sum(-1)).mean())
        else:
            per_layer.append(((cur - prev) ** 2).sum(-1).mean())
    losses = torch.stack(per_layer)  # [layers]
    if weights is not None:
        losses = losses * weights.to(losses.device)
    return losses.mean()


def domain_loss(router_logits, batch: int, domain: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Routing mass outside the allowed experts. `domain [B]` ids, `allowed [D, layers, E]` bool."""
    per_layer = []
    for i, logits in enumerate(router_logits):
        p = _probs(logits, batch)  # [B, T, E]
        outside = (~allowed[domain.to(allowed.device), i]).to(p.dtype)  # [B, E]
        per_layer.append((p * outside[:, None, :]).sum(-1).mean())
    return torch.stack(per_layer).mean()


@torch.no_grad()
def allowed_experts(model, blocks_by_domain: list[torch.Tensor], frac: float) -> torch.Tensor:
    """`[D, layers, E]` bool: per domain and layer, the `round(frac * E)` experts with the most routing mass of
    the model on that domain's blocks (the base model's own specialisation, sharpened by the domain loss)."""
    from expertcache.telemetry.adapters import adapter_for

    a = adapter_for(model)
    m = max(a.top_k, round(frac * a.num_experts))
    out = []
    for blocks in blocks_by_domain:
        res = model(input_ids=blocks, output_router_logits=True, use_cache=False)
        mass = torch.stack([lg.float().softmax(-1).sum(0) for lg in res.router_logits])  # [layers, E]
        keep = torch.zeros_like(mass, dtype=torch.bool)
        keep.scatter_(1, mass.topk(m, dim=-1).indices, True)
        out.append(keep)
    return torch.stack(out)
