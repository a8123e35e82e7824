"""Model builders: transformers config classes only, never a hub download.

- `tiny_config(family)`: a 2-layer, 8-expert, 32-wide random model of each family the telemetry supports,
  for tests.
- `BaseModelSpec` / `base_config(...)`: the base we pretrain, a fine-grained `Qwen3MoeForCausalLM` so every
  checkpoint is a standard HF checkpoint that plain transformers loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertcache.telemetry.adapters import FAMILIES  # noqa: F401 (the one list of supported families)

from .config import opt



def tiny_config(family: str, vocab_size: int = 128, **overrides):
    """2 layers, 8 routed experts, hidden 32: small enough for a real forward pass in milliseconds."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  num_experts_per_tok=2, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=1)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, head_dim=8, num_experts=8, moe_intermediate_size=16, decoder_sparse_step=1,
                                norm_topk_prob=True)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, head_dim=8, num_local_experts=8)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**common, num_experts=8, norm_topk_prob=False)
    elif family == "gpt_oss":
        cfg = tf.GptOssConfig(**common, head_dim=8, num_local_experts=8, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family == "deepseek_v3":
        common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: one KV head per query head
        cfg = tf.DeepseekV3Config(**common, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=16,
                                  first_k_dense_replace=0, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                  kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                  v_head_dim=8, norm_topk_prob=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build_model(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised causal LM for `config`, deterministic in `seed`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


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
