"""The step-wise perplexity's two paths: whole blocks per forward (plain models, lossless policies) against one
token at a time through the KV cache (lossy policies), on a tiny random model of every family."""

import numpy as np
import pytest
from tiny_models import build_model, tiny_config

from expertcache.evals.stepwise import check_method, stepwise_perplexity
from expertcache.telemetry.adapters import FAMILIES
from expertcache.telemetry.errors import InputError


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_blocks_give_the_token_by_token_nll(family, monkeypatch):
    """Same NLL per block within 1e-4 relative (fp32; only the attention sums' order differs), on blocks longer
    than gpt_oss's sliding window (16) and split across forwards (a logits budget of two rows)."""
    import expertcache.evals.stepwise as sw

    model = build_model(tiny_config(family), seed=3)
    rng = np.random.default_rng(0)
    blocks = {"a": rng.integers(2, 128, (5, 40)), "b": rng.integers(2, 128, (2, 24))}
    monkeypatch.setattr(sw, "LOGITS_BYTES", 2 * 39 * 128 * 4)  # two rows of "a" per forward
    tok = stepwise_perplexity(model, blocks, method="token")
    bat = stepwise_perplexity(model, blocks, method="batched")
    assert bat["method"] == "batched" and tok["method"] == "token"
    assert bat["block_tokens"] == tok["block_tokens"] == {"a": [39] * 5, "b": [23] * 2}
    for d in blocks:
        np.testing.assert_allclose(bat["block_nll"][d], tok["block_nll"][d], rtol=1e-4)
    assert bat["ppl"]["overall"] == pytest.approx(tok["ppl"]["overall"], rel=1e-4)


def test_a_batched_forward_is_not_the_token_path_for_a_model_that_looks_ahead(monkeypatch):
    """The comparison above can fail: with the causal mask removed (every position sees the whole block) the
    batched NLLs differ from the token-by-token ones, which cannot see ahead."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as q

    model = build_model(tiny_config("qwen3_moe"), seed=3)
    blocks = {"a": np.random.default_rng(0).integers(2, 128, (2, 20))}
    tok = stepwise_perplexity(model, blocks, method="token")
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    monkeypatch.setattr(q, "create_causal_mask", lambda *a, **k: None)
    bat = stepwise_perplexity(model, blocks, method="batched")
    assert not np.allclose(bat["block_nll"]["a"], tok["block_nll"]["a"], rtol=1e-4)


def test_the_method_follows_the_policy():
    assert check_method("auto", lossy=False) == "batched"
    assert check_method("auto", lossy=True) == "token"
    assert check_method("token", lossy=False) == "token"
    with pytest.raises(InputError, match="lossy policy"):
        check_method("batched", lossy=True)
    with pytest.raises(InputError, match="expected one of auto, token, batched"):
        check_method("wide", lossy=False)
