"""A tiny random model of each MoE family the telemetry supports, for tests: transformers config classes only, never
a hub download. Importable as `tiny_models` (pytest's pythonpath includes tests/); scripts/gpu_check.py and
scripts/make_checkpoint.py put tests/ on their path for it."""

from __future__ import annotations

import torch

from expertcache.telemetry.adapters import FAMILIES  # the one list of supported families


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
