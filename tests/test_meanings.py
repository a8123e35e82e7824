"""One meaning per number (issue #24): capacity (a float in (0, 1] is a fraction of E, so 1.0 is all of them; an
integer >= 1 is a count; nothing else), the model's context on every decode path, and routing rows whose experts
are distinct at every entry."""

import numpy as np
import pytest
import torch

from expertcache.runtime.engine import EngineConfig
from expertcache.telemetry.cachesim import capacity_count
from expertcache.telemetry.errors import InputError


def test_capacity_a_float_is_a_fraction_an_int_a_count_and_nothing_else():
    assert capacity_count(1.0, 8) == 8  # all of E (it was one expert)
    assert capacity_count(0.25, 8) == 2 and capacity_count(0.01, 8) == 1
    assert capacity_count(1, 8) == 1 and capacity_count(8, 8) == 8 and capacity_count(np.int64(3), 8) == 3
    assert capacity_count(np.float32(0.5), 8) == 4
    for bad, why in ((16.0, "write 16"), (2.5, "a float in"), (0, "a float in"), (-1, "a float in"),
                     (float("nan"), "a float in"), (True, "a float in"), ("0.25", "a float in"),
                     (None, "a float in")):
        with pytest.raises(InputError, match=why):
            capacity_count(bad, 32)
    with pytest.raises(InputError, match="capacity 9 experts, but a layer has only 8"):
        capacity_count(9, 8)
    assert capacity_count(16, None) is None  # the form alone, before a model is known
    with pytest.raises(InputError, match="write 16"):
        EngineConfig(capacity=16.0).check()
    assert EngineConfig(capacity=1.0).slots(8, 2) == 8 and EngineConfig(capacity=1).slots(8, 2) == 1
    assert EngineConfig(capacity=1.0).label() != EngineConfig(capacity=1).label()


def test_capacity_one_point_zero_keeps_all_experts_resident(tmp_path):
    from expertcache.runtime.engine import offload
    from expertcache.runtime.store import write_store
    from expertcache.trainer.models import build_model, tiny_config

    model = build_model(tiny_config("qwen3_moe"), seed=1).eval()
    write_store(model, tmp_path / "e.store")
    eng = offload(model, tmp_path / "e.store", EngineConfig(capacity=1.0, tier="host"))
    try:
        assert eng.capacity == eng.adapter.num_experts
    finally:
        eng.close()


def test_capacity_on_the_command_line_and_in_recipes_keeps_its_type():
    from expertcache.evals.lm import engine_from_args
    from expertcache.recipes.cli import build_parser
    from expertcache.trainer.cache_aware import CacheAwareRecipe
    from expertcache.trainer.config import RecipeError, load_recipe

    parsers: dict = {}
    build_parser(parsers, only="generate")
    _, p = parsers["generate", None]
    for text, want in (("16", 16), ("1", 1), ("1.0", 1.0), ("0.25", 0.25)):
        got = p.instantiate(p.parse_args(["--engine.capacity", text]))["engine"].capacity
        assert got == want and type(got) is type(want), (text, got)
    parsers = {}
    build_parser(parsers, only="bench")
    _, p = parsers["bench", "decode"]
    assert [type(c) for c in p.parse_args(["--capacities", "[16, 0.25, 1.0]"]).capacities] == [int, float, float]
    assert engine_from_args({"capacity": "16"}).capacity == 16
    assert type(engine_from_args({"capacity": "1.0"}).capacity) is float
    from expertcache.recipes.cli import RECIPE_DIR, resolve_recipe

    loc = resolve_recipe("locality", RECIPE_DIR / "cache-aware")
    r = load_recipe(CacheAwareRecipe, loc, ["serving.capacity=2", "eval.capacities=[0.125, 4, 1.0]"])
    assert type(r.serving.capacity) is int and [type(c) for c in r.eval.capacities] == [float, int, float]
    with pytest.raises(RecipeError, match="write 16"):
        load_recipe(CacheAwareRecipe, loc, ["serving.capacity=16.0"])
    with pytest.raises(RecipeError, match="eval.capacities has capacity 2.5"):
        load_recipe(CacheAwareRecipe, loc, ["eval.capacities=[2.5]"])
