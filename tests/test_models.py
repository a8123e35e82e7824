import pytest
import torch

from expertcache.trainer.models import BaseModelSpec, count_parameters
from tiny_models import FAMILIES, build_model, tiny_config


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_of_each_family_runs_and_generates(family):
    m = build_model(tiny_config(family), seed=0)
    x = torch.randint(0, 128, (2, 9))
    out = m(x)
    assert out.logits.shape == (2, 9, 128)
    g = m.generate(x[:1], max_new_tokens=4, do_sample=False)
    assert g.shape == (1, 13)
    # seeded: the same seed builds the same weights
    m2 = build_model(tiny_config(family), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))


def test_base_spec_meets_the_realism_bar():
    spec = BaseModelSpec()
    cfg = spec.to_hf_config(vocab_size=8192, eos_token_id=0, pad_token_id=1)
    assert cfg.num_hidden_layers >= 8 and cfg.num_experts >= 32 and cfg.num_experts_per_tok >= 4
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_config(cfg)
    n = count_parameters(m)
    assert 20e6 <= n["total"] <= 40e6, n
    assert type(m).__name__ == "Qwen3MoeForCausalLM"


def test_top_k_above_experts_is_rejected():
    with pytest.raises(ValueError, match="top_k=9 exceeds model.num_experts=8"):
        BaseModelSpec(num_experts=8, top_k=9).to_hf_config(512, 0, 1)


def test_per_layer_balance_loss_sees_imbalance_that_pooling_hides():
    """Two layers that each send every token to one expert, but different ones: pooled over layers the experts
    look perfectly balanced; per layer the loss is at its maximum (E, for k = 1)."""
    from expertcache.trainer.lm_module import per_layer_balance_loss

    big = 20.0
    l0 = torch.full((10, 2), -big)
    l0[:, 0] = big  # layer 0: expert 0 only
    l1 = torch.full((10, 2), -big)
    l1[:, 1] = big  # layer 1: expert 1 only
    per_layer = per_layer_balance_loss([l0, l1], top_k=1)
    pooled = per_layer_balance_loss([torch.cat([l0, l1])], top_k=1)
    assert per_layer.item() == pytest.approx(2.0, abs=1e-4)  # E = 2: worst case
    assert pooled.item() == pytest.approx(1.0, abs=1e-4)  # looks perfectly balanced
    uniform = per_layer_balance_loss([torch.zeros(10, 4)], top_k=2)
    assert uniform.item() == pytest.approx(2.0, abs=1e-4)  # = k at perfect balance
