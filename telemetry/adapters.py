"""Find the MoE layers of a live HF model and reproduce each family's routing rule.

The recorder only hooks what these adapters find; nothing in the model is copied or changed. Routing rules,
from router logits `[tokens, E]` to `(ids [tokens, k], weights [tokens, k])`:

| family      | rule                                                                                |
| ----------- | ----------------------------------------------------------------------------------- |
| qwen3_moe   | softmax -> top-k -> renormalise if `norm_topk_prob`                                  |
| olmoe       | softmax -> top-k -> renormalise if `norm_topk_prob`                                  |
| mixtral     | softmax -> top-k -> renormalise (same as top-k -> softmax over the k)                |
| gpt_oss     | top-k on logits -> softmax over the k                                                |
| deepseek_v3 | sigmoid; top-k of (score + bias) inside the `topk_group` best of `n_group` groups;   |
|             | weights = sigmoid scores of the chosen, renormalised, x `routed_scaling_factor`     |

DeepSeek-V3's shared experts are always on and never appear as accesses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")


@dataclass
class MoELayer:
    index: int  # decoder layer index in the model
    block: torch.nn.Module  # the sparse MoE block
    router: torch.nn.Module  # its router (returns logits, weights, ids)
    experts: torch.nn.Module  # its routed experts (fused tensors)


@dataclass
class Adapter:
    family: str
    num_experts: int
    top_k: int
    num_layers: int  # decoder layers
    hidden_size: int
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def moe_layers(self, model) -> list[MoELayer]:
        out = []
        for i, layer in enumerate(_decoder_layers(model)):
            block = getattr(layer, "mlp", None)
            router = getattr(block, "gate", None) or getattr(block, "router", None)
            experts = getattr(block, "experts", None)
            if router is None or experts is None:
                continue  # a dense layer (e.g. DeepSeek's first_k_dense_replace)
            out.append(MoELayer(i, block, router, experts))
        if not out:
            raise InputError(f"no MoE layers found in {type(model).__name__}")
        return out

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-expert router probabilities `[tokens, E]` (float32): softmax, or DeepSeek-V3's sigmoid. What a
        reroute margin τ is measured on."""
        logits = logits.float()
        return logits.sigmoid() if self.family == "deepseek_v3" else logits.softmax(dim=-1)

    def weights(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This family's gate weights `[tokens, k]` (float32) for the experts `ids [tokens, k]`, whichever chose
        them (the router, or a reroute): the one place each family's weight rule is written."""
        logits = logits.float()
        if self.family == "gpt_oss":  # top-k logits -> softmax over the k
            return logits.gather(1, ids).softmax(dim=-1)
        w = self.scores(logits).gather(1, ids)
        if self.family == "deepseek_v3":
            if self.norm_topk_prob:
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            return w * self.routed_scaling_factor
        if self.norm_topk_prob or self.family == "mixtral":
            w = w / w.sum(dim=-1, keepdim=True)
        return w

    def route(self, logits: torch.Tensor, bias: torch.Tensor | None = None):
        """`logits [tokens, E]` -> `(ids [tokens, k] int64, weights [tokens, k] float32)` by this family's rule."""
        k = self.top_k
        logits = logits.float()
        if self.family in ("qwen3_moe", "olmoe", "mixtral"):
            ids = self.scores(logits).topk(k, dim=-1).indices
            return ids, self.weights(logits, ids)
        if self.family == "gpt_oss":
            ids = logits.topk(k, dim=-1).indices
            return ids, self.weights(logits, ids)
        if self.family == "deepseek_v3":
            choice = self.scores(logits) + (bias.float() if bias is not None else 0.0)
            t, e = choice.shape
            groups = choice.view(t, self.n_group, e // self.n_group).topk(2, dim=-1).values.sum(-1)  # [t, G]
            keep = torch.zeros_like(groups).scatter_(1, groups.topk(self.topk_group, dim=-1).indices, 1.0)
            mask = keep.unsqueeze(-1).expand(t, self.n_group, e // self.n_group).reshape(t, e)
            ids = choice.masked_fill(mask == 0, float("-inf")).topk(k, dim=-1).indices
            return ids, self.weights(logits, ids)
        raise InputError(f"no routing rule for family {self.family!r}")

    def router_bias(self, router: torch.nn.Module) -> torch.Tensor | None:
        return getattr(router, "e_score_correction_bias", None)

    def router_logits(self, router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The router's logits for `hidden [tokens, H]`, without firing hooks (used by the lookahead probe)."""
        return router_logits(router, hidden)

    def describe(self) -> dict:
        return {"family": self.family, "num_experts": self.num_experts, "top_k": self.top_k,
                "num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "norm_topk_prob": self.norm_topk_prob}


def router_logits(router: torch.nn.Module, hidden: torch.Tensor, detach: bool = False) -> torch.Tensor:
    """A router's logits for `hidden [tokens, H]` computed from its weight (and bias), without firing its hooks;
    `detach`: as a fixed prior, no gradient into the router (the auxiliary routers' zero start)."""
    w, b = router.weight, getattr(router, "bias", None)
    if detach:
        w, b = w.detach(), b.detach() if b is not None else None
    return torch.nn.functional.linear(hidden.to(w.dtype), w, b)


def router_fingerprint(model) -> str:
    """sha256 of the model's router weights: what was derived from one checkpoint (auxiliary routers, an
    expert store) is refused by another."""
    return weights_fingerprint(layer.router.weight for layer in adapter_for(model).moe_layers(model))


def weights_fingerprint(router_weights) -> str:
    """`router_fingerprint` of router weight tensors in MoE-layer order (as the model holds them: a checkpoint
    written from other sources, `import-gguf`, stamps its store with the fingerprint its model will have)."""
    import hashlib

    h = hashlib.sha256()
    for w in router_weights:
        h.update(w.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:20]


def _decoder_layers(model):
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise InputError(f"{type(model).__name__} has no `model.layers`; not a decoder-only HF model")
    return layers


def adapter_for(model_or_config) -> Adapter:
    """The adapter for a HF model (or its config), from `config.model_type`."""
    cfg = getattr(model_or_config, "config", model_or_config)
    mt = getattr(cfg, "model_type", None)
    if mt not in FAMILIES:
        raise InputError(f"model type {mt!r} is not supported; supported MoE families: {', '.join(FAMILIES)}")
    e = {"qwen3_moe": "num_experts", "olmoe": "num_experts", "mixtral": "num_local_experts",
         "gpt_oss": "num_local_experts", "deepseek_v3": "n_routed_experts"}[mt]
    return Adapter(
        family=mt, num_experts=int(getattr(cfg, e)), top_k=int(cfg.num_experts_per_tok),
        num_layers=int(cfg.num_hidden_layers), hidden_size=int(cfg.hidden_size),
        norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", True)), n_group=int(getattr(cfg, "n_group", 1) or 1),
        topk_group=int(getattr(cfg, "topk_group", 1) or 1),
        routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0))
