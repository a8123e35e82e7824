"""Routing-locality losses on the backbone's own routers (softmax router probabilities).

Both act on `router_logits`, one `[B*T, E]` tensor per MoE layer as HF models return them with
`output_router_logits=True`, reshaped to `[B, T, E]` (tokens of one sequence adjacent).

- locality: adjacent-token routing consistency, averaged over the `T-1` adjacent pairs of each sequence, then
  over layers with per-layer weights. `dot`: `1 - <p_t, p_{t-1}>`; `l2`: `||p_t - p_{t-1}||^2`.
  Two cache-targeted kinds score token t against the experts an LRU cache of C experts holds before t (the C
  most recently used distinct experts of the sequence, from the router's own hard top-k; C = k: the previous
  token's experts): `resident`: `1 - sum_{e resident} q_t(e)`, the router mass off the cache; `miss`:
  `sum_{e in topk_t, not resident} q_t(e)`, the mass of the experts the token would load (hard selection,
  gradient through the probabilities: a straight-through form that pushes exactly the misses down).
  `q = softmax(z / temperature)`: a temperature for the loss only (routing itself is unchanged).
- margin: the native top-k pulled toward the experts the reroute miss policy would serve (`ServedRouting`): on
  each token whose served set differs from its own top-k, a hinge `relu(max_{e not served} z_e -
  min_{e served} z_e + margin)` on the router logits, so that the router learns to choose natively what a
  reroute would have swapped in (cheap swaps only: a reroute moves a token only within tau).
- domain: routing mass outside a domain's allowed expert set, `sum_{e not allowed} p_e`, averaged over tokens
  and layers; the allowed sets come from the base model's own usage (`allowed_experts`).
"""

from __future__ import annotations

import torch

from expertcache.telemetry.cache import lru_resident, served_routing
from expertcache.telemetry.errors import InputError

from .specs import LOCALITY_KINDS


def _probs(logits: torch.Tensor, batch: int, temperature: float = 1.0) -> torch.Tensor:
    p = (logits.float() / temperature).softmax(dim=-1)  # [B*T, E]
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


def locality_loss(router_logits, batch: int, kind: str = "dot", weights: torch.Tensor | None = None,
                  temperature: float = 1.0, top_k: int = 0, cache: int = 0) -> torch.Tensor:
    """Mean over layers (weighted) of the mean over tokens 1..T-1 of the routing change (`dot`, `l2`) or of the
    router mass off an LRU cache of `cache` experts (`resident`, `miss`; `cache` 0: `top_k`)."""
    if kind not in LOCALITY_KINDS:
        raise InputError(f"locality kind {kind!r}; expected one of {LOCALITY_KINDS}")
    if kind == "margin":
        raise InputError("locality kind 'margin' scores the served routing: use served_margin_loss")
    if kind in ("resident", "miss") and top_k < 1:
        raise InputError(f"locality kind {kind!r} needs the model's top_k")
    per_layer = []
    for logits in router_logits:
        p = _probs(logits, batch, temperature)
        prev, cur = p[:, :-1], p[:, 1:]  # [B, T-1, E]
        if kind == "dot":
            per_layer.append((1.0 - (prev * cur).sum(-1)).mean())
        elif kind == "l2":
            per_layer.append(((cur - prev) ** 2).sum(-1).mean())
        else:
            resident, chosen = lru_resident(logits, batch, top_k, cache or top_k)
            if kind == "resident":
                per_layer.append((1.0 - (cur * resident).sum(-1)).mean())
            else:
                per_layer.append((cur * (chosen & ~resident)).sum(-1).mean())
    losses = torch.stack(per_layer)  # [layers]
    if weights is not None:
        losses = losses * weights.to(losses.device)
    return losses.mean()


def served_margin_loss(router_logits, served: list[torch.Tensor], margin: float,
                       weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over layers (weighted) of the hinge that makes the router's own top-k the served set: per token
    whose served experts `served[i] [N, k]` differ from the top-k of its logits `[N, E]`, `relu(best logit
    outside the served set - worst logit inside it + margin)`; summed over those tokens, divided by all N."""
    per_layer = []
    for logits, s in zip(router_logits, served):
        z = logits.float()
        k = s.shape[-1]
        in_s = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, s.to(z.device), True)
        native = torch.zeros_like(in_s).scatter_(-1, z.detach().topk(k, dim=-1).indices, True)
        moved = (in_s != native).any(-1)  # [N]
        lo = z.masked_fill(~in_s, float("inf")).min(-1).values
        hi = z.masked_fill(in_s, float("-inf")).max(-1).values
        per_layer.append(((hi - lo + margin).relu() * moved).sum() / z.shape[0])
    losses = torch.stack(per_layer)
    if weights is not None:
        losses = losses * weights.to(losses.device)
    return losses.mean()


class ServedRouting:
    """Forward hooks on a model's routers that replay the reroute miss policy during training steps: with
    `apply`, the layers compute with the served experts (their weights re-derived from the logits by the
    family's rule, so the router learns through them: serving-aware fine-tuning); either way the served choice
    of each layer is kept for the margin loss. Off (`active = False`) outside training steps."""

    def __init__(self, moe_layers, adapter, capacity: int, tau: float, apply: bool):
        self.adapter, self.capacity, self.tau, self.apply = adapter, capacity, tau, apply
        self.active, self.batch = False, 1
        self.served: dict[int, torch.Tensor] = {}
        self.changed: dict[int, torch.Tensor] = {}
        self.handles = [layer.router.register_forward_hook(self._hook(i)) for i, layer in enumerate(moe_layers)]

    def _hook(self, i: int):
        def hook(module, args, output):
            if not self.active:
                return None
            if not (isinstance(output, tuple) and len(output) == 3):
                raise InputError(f"serving-aware training needs routers that return (logits, weights, ids); "
                                 f"{type(module).__name__} returns {type(output).__name__}")
            logits, weights, idx = output
            served, changed = served_routing(self.adapter.scores(logits.detach()), idx, self.batch,
                                             self.capacity, self.tau)
            self.served[i], self.changed[i] = served, changed
            if not self.apply:
                return None
            return logits, self.adapter.weights(logits, served).to(weights.dtype), served
        return hook

    def rerouted_fraction(self) -> float:
        return float(torch.stack([c.float().mean() for c in self.changed.values()]).mean()) if self.changed else 0.0

    def clear(self) -> None:
        self.served.clear()
        self.changed.clear()


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
    from expertcache.telemetry.cachesim import capacity_count

    a = adapter_for(model)
    m = max(a.top_k, capacity_count(float(frac), a.num_experts))  # the one fraction-of-E rule
    out = []
    for blocks in blocks_by_domain:
        res = model(input_ids=blocks, output_router_logits=True, use_cache=False)
        mass = torch.stack([a.scores(lg).sum(0) for lg in res.router_logits])  # [layers, E], the family's rule
        keep = torch.zeros_like(mass, dtype=torch.bool)
        keep.scatter_(1, mass.topk(m, dim=-1).indices, True)
        out.append(keep)
    return torch.stack(out)
