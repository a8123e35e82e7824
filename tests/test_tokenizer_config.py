import pytest

from expertcache.trainer.config import RecipeError, describe, load_recipe
from expertcache.trainer.pretrain import PretrainRecipe


def test_tokenizer_loads_with_plain_autotokenizer(tiny_data):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_data["tokenizer"])
    assert len(tok) == 512
    text = "def f(x):\n    return x * 2  # thou art\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id


def test_recipe_rejects_unknown_keys_with_the_key_and_the_choices(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  max_step: 10\n")
    with pytest.raises(RecipeError, match=r"unknown recipe key train\.max_step.*max_steps"):
        load_recipe(PretrainRecipe, p)
    with pytest.raises(RecipeError, match=r"unknown recipe key modle"):
        load_recipe(PretrainRecipe, None, ["modle.top_k=2"])


def test_recipe_type_errors_and_overrides(tmp_path):
    with pytest.raises(RecipeError, match=r"train\.balance='pooled'; expected one of per_layer, hf"):
        load_recipe(PretrainRecipe, None, ["train.balance=pooled"])
    with pytest.raises(RecipeError, match=r"train\.max_steps: expected an integer"):
        load_recipe(PretrainRecipe, None, ["train.max_steps=ten"])
    r = load_recipe(PretrainRecipe, None, ["train.lr=1e-4", "model.top_k=2", "train.wandb=false"])
    assert r.train.lr == 1e-4 and r.model.top_k == 2 and r.train.wandb is False
    assert r.model.num_experts == 32  # untouched defaults stay


def test_every_shipped_recipe_loads_and_every_key_is_documented():
    from expertcache.recipes.cli import RECIPE_DIR

    for name in ("smoke", "base-tiny"):
        load_recipe(PretrainRecipe, RECIPE_DIR / f"{name}.yaml")
    lines = describe(PretrainRecipe)
    assert any("train.max_steps" in ln for ln in lines)
    assert all(not ln.rstrip().endswith(":") for ln in lines if ln.startswith("  ")), "a key without help"
