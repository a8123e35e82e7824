"""Model builders: transformers config classes only, never a hub download.

`BaseModelSpec` (`to_hf_config`): the base we pretrain, a fine-grained `Qwen3MoeForCausalLM` so every checkpoint is
a standard HF checkpoint that plain transformers loads; `count_parameters`; `save_model_dir` (the HF checkpoint
folder, written whole). The tests' tiny random model of each family is in tests/tiny_models.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import opt


@dataclass
class BaseModelSpec:
    """The pretrained base: fine-grained experts like Qwen3/DeepSeek (many small experts, top-k >= 4)."""

    hidden_size: int = opt(256, "model width")
    num_layers: int = opt(8, "decoder layers, every one a MoE layer")
    num_experts: int = opt(32, "routed experts per layer (E)")
    top_k: int = opt(4, "experts selected per token and layer (k)")
    moe_intermediate_size: int = opt(128, "hidden size of one expert's SwiGLU MLP")
    num_heads: int = opt(4, "attention query heads")
    num_kv_heads: int = opt(2, "attention key/value heads (GQA)")
    head_dim: int = opt(64, "attention head width")
    max_position_embeddings: int = opt(1024, "longest sequence the RoPE tables cover")
    router_aux_loss_coef: float = opt(0.01, "load-balancing loss weight (HF's default 0.001 leaves experts idle here)")
    norm_topk_prob: bool = opt(True, "renormalise the top-k gate weights to sum to 1 (Qwen3-MoE rule)")
    tie_embeddings: bool = opt(True, "share input embedding and LM head")

    def __post_init__(self):
        import math

        from .config import RecipeError

        for name in ("hidden_size", "num_layers", "num_experts", "top_k", "moe_intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise RecipeError(f"model.{name}={getattr(self, name)}; expected an integer >= 1")
        if self.top_k > self.num_experts:
            raise RecipeError(f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise RecipeError(f"model.num_heads={self.num_heads} is not a multiple of "
                              f"model.num_kv_heads={self.num_kv_heads}")
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise RecipeError(f"model.router_aux_loss_coef={self.router_aux_loss_coef}; expected a finite number >= 0")

    def to_hf_config(self, vocab_size: int, eos_token_id: int, pad_token_id: int):
        from transformers import Qwen3MoeConfig

        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        return Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=2 * self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            num_experts=self.num_experts, num_experts_per_tok=self.top_k, decoder_sparse_step=1, mlp_only_layers=[],
            max_position_embeddings=self.max_position_embeddings, router_aux_loss_coef=self.router_aux_loss_coef,
            output_router_logits=False, norm_topk_prob=self.norm_topk_prob, tie_word_embeddings=self.tie_embeddings,
            bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def count_parameters(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"total": total, "experts": experts, "non_expert": total - experts}


def save_model_dir(model, tokenizer, model_dir, aux=None) -> None:
    """The HF checkpoint folder (weights, config, tokenizer and, if given, the auxiliary routers) written whole
    into a temporary folder beside it and swapped into place, so a half-written `model/` never reads as a
    checkpoint and a failed save leaves the previous one as it was."""
    from expertcache.telemetry.atomic import atomic_dir

    with atomic_dir(model_dir) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if aux is not None:
            aux.save(tmp, model)
