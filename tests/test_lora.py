"""Attention adapters (peft LoRA) for router post-training (`quality.lora_rank`, trainer/lora.py): added beside
what already trains, merged into a plain checkpoint with the same outputs, skipped for the distillation base
without touching what trains, and bad settings refused in one line."""

from __future__ import annotations

import pytest
import torch


def _model(seed: int = 0):
    from tiny_models import build_model, tiny_config

    return build_model(tiny_config("qwen3_moe"), seed=seed).eval()


def _ids(model):
    return torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


def _perturb(model) -> None:
    """Non-zero adapters (peft starts B at 0, where every check below would hold trivially)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def test_adapters_add_to_what_trains_and_merge_into_a_plain_model_with_the_same_outputs():
    from expertcache.trainer.lora import add_lora, adapters_off, is_adapter_param, merge_into

    model = _model()
    names = {n: p.shape for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith("mlp.gate.weight"))  # routers only, as quality.trainable=routers leaves it
    ids = _ids(model)
    with torch.no_grad():
        base = model(input_ids=ids).logits
    n = add_lora(model, 4, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    trains = {k for k, p in model.named_parameters() if p.requires_grad}
    adapters = {k for k in trains if is_adapter_param(k)}
    assert trains - adapters == {k for k in names if k.endswith("mlp.gate.weight")}  # the routers still train
    assert len(adapters) == 2 * 4 * model.config.num_hidden_layers  # A and B on q, k, v, o of every layer
    assert n == sum(p.numel() for k, p in model.named_parameters() if k in adapters)
    _perturb(model)
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with adapters_off(model):
            off = model(input_ids=ids).logits
    assert not torch.allclose(adapted, base, atol=1e-3)  # the adapters change the outputs
    torch.testing.assert_close(off, base)  # off: the base, exactly
    assert {k for k, p in model.named_parameters() if p.requires_grad} == trains  # and nothing was flipped
    merged = merge_into(model)
    assert len(merged) == 4 * model.config.num_hidden_layers
    assert {k: p.shape for k, p in model.named_parameters()} == names  # the base's names and shapes again
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-5)


def test_targets_that_name_no_projection_are_refused_naming_the_ones_there():
    from expertcache.trainer.config import RecipeError
    from expertcache.trainer.lora import add_lora

    with pytest.raises(RecipeError, match=r"names no Linear of this model; its attention has k_proj, o_proj, q_proj"):
        add_lora(_model(), 4, 8.0, ["query_key_value"])


@pytest.mark.parametrize("over, needle", [
    (["quality.trainable=all", "quality.lora_rank=4"], "quality.lora_rank applies to quality.trainable=routers or moe"),
    (["quality.trainable=routers", "quality.lora_rank=-1"], "quality.lora_rank=-1; expected an integer >= 0"),
    (["quality.trainable=routers", "quality.lora_rank=4", "quality.lora_alpha=0"], "quality.lora_alpha=0"),
    (["quality.trainable=routers", "quality.lora_rank=4", "quality.lora_targets=[]"], "quality.lora_targets=[]"),
])
def test_bad_adapter_settings_are_one_line_and_exit_2_before_any_work(tmp_path, capsys, over, needle):
    from expertcache.recipes.cli import main

    assert main(["train-cache-aware", "--recipe", "smoke", f"out_dir={tmp_path / 'o'}", *over]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_adapters_train_in_fp32_on_a_bf16_model():
    """peft makes the adapters in the base layer's dtype; on bf16 frozen weights they would train in bf16 (an
    Adam step below bf16's resolution rounds away): they are fp32, as the routers are, and the forward still runs."""
    from expertcache.trainer.lora import add_lora, is_adapter_param

    model = _model().to(torch.bfloat16)
    add_lora(model, 4, 8.0, ["q_proj", "v_proj"])
    dtypes = {p.dtype for n, p in model.named_parameters() if is_adapter_param(n)}
    assert dtypes == {torch.float32}
    _perturb(model)
    with torch.no_grad():
        out = model(input_ids=_ids(model)).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_adapters_with_a_frozen_backbone_are_refused_with_the_recipe(tmp_path, capsys):
    """`mode=aux-only` (the backbone frozen; from a trace it never runs the model) with `quality.lora_rank` was
    dropped without a word from a trace, and refused only after the run folder was made otherwise: refused in one
    line when the recipe is read."""
    from expertcache.recipes.cli import main

    for extra in ([], ["routers.trace=nowhere.parquet"]):
        assert main(["train-cache-aware", "--recipe", "aux-only", f"out_dir={tmp_path / 'o'}",
                     "quality.trainable=routers", "quality.lora_rank=8", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "mode aux-only keeps the backbone frozen" in err, err
        assert not (tmp_path / "o").exists()
