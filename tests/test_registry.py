"""The one registry of user-given names (telemetry/registry.py): each kind's unknown name gets one line listing what
exists, through the entry points users reach; `name:arg` kinds refuse a missing or extra argument; a name is
registered once."""

from __future__ import annotations

import re

import numpy as np
import pytest

from expertcache.runtime.engine.config import MISS_POLICIES, MISS_REGISTRY, EngineConfig
from expertcache.runtime.engine.predictors import (LIVE_PREDICTORS, PREDICTOR_REGISTRY, REPLAY_PREDICTORS,
                                            check_predictor_spec, make_predictor)
from expertcache.runtime.engine.trace_predictors import check_replay_predictor
from expertcache.runtime.storage.tiers import TIER_REGISTRY, TierSpec, make_tier
from expertcache.telemetry import cachesim
from expertcache.telemetry.cache import POLICIES, POLICY_REGISTRY, CacheState
from expertcache.telemetry.errors import InputError
from expertcache.telemetry.registry import Registry


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


# --- each kind, through its public entry points ----------------------------------------------------------------

@pytest.mark.parametrize("call,expected", [
    (lambda: EngineConfig(policy="psychic").check(),
     "unknown cache policy 'psychic'; expected one of: lru, lfu, static, scored, learned:<FILE>"),
    (lambda: cachesim.simulate(np.zeros((2, 2), int), 2, "fifo"),
     "unknown cache policy 'fifo'; expected one of: lru, lfu, static, belady"),
    (lambda: CacheState(2, 2, "belady"),
     "unknown cache policy 'belady'; expected one of: lru, lfu, static, scored"),
    (lambda: EngineConfig(miss="ignore").check(),
     "unknown miss policy 'ignore'; expected one of: blocking, reroute, speculative, host"),
    (lambda: make_predictor("bogus"),
     "unknown predictor 'bogus'; expected one of: none, probe[:<D>], lookahead[:<D>], persistence, estimator:<FILE>, spatio"),
    (lambda: check_predictor_spec("prob"),
     "unknown predictor 'prob'; expected one of: none, probe[:<D>], lookahead[:<D>], persistence, estimator:<FILE>, spatio"),
    (lambda: check_replay_predictor("bogus"),
     "unknown replay predictor 'bogus'; expected one of: none, persistence, cooccurrence, oracle[:<recall>]"),
    (lambda: make_tier("floppy", None),
     "unknown tier 'floppy'; expected one of: auto, disk, host, cuda, throttled:<GB/s>"),
    (lambda: EngineConfig(tier="nvme").check(),
     "unknown tier 'nvme'; expected one of: auto, disk, host, cuda, throttled:<GB/s>"),
], ids=["engine-policy", "simulate-policy", "cachestate-policy", "miss", "make_predictor", "check_predictor_spec",
        "replay-predictor", "make_tier", "engine-tier"])
def test_an_unknown_name_gets_one_line_listing_what_exists(call, expected):
    with pytest.raises(InputError) as e:
        call()
    assert one_line(e) == expected


@pytest.mark.parametrize("call,expected", [
    (lambda: EngineConfig(policy="learned").check(), "cache policy 'learned': expected learned:<FILE>"),
    (lambda: EngineConfig(policy="learned:").check(), "cache policy 'learned:': expected learned:<FILE>"),
    (lambda: EngineConfig(policy="lru:2").check(), "cache policy 'lru:2': lru takes no argument"),
    (lambda: EngineConfig(miss="blocking:1").check(), "miss policy 'blocking:1': blocking takes no argument"),
    (lambda: make_tier("throttled", None), "tier 'throttled': expected throttled:<GB/s>"),
    (lambda: make_tier("throttled:0", None), "tier 'throttled:0': expected throttled:<GB/s>"),
    (lambda: make_tier("throttled:nan", None), "tier 'throttled:nan': expected throttled:<GB/s>"),
    (lambda: make_tier("disk:fast", None), "tier 'disk:fast': disk takes no argument"),
    (lambda: make_predictor("estimator"), "predictor 'estimator': expected estimator:<FILE>"),
    (lambda: make_predictor("probe:0"), "predictor 'probe:0': expected probe:<D>"),
    (lambda: make_predictor("persistence:2"), "predictor 'persistence:2': persistence takes no argument"),
    (lambda: check_replay_predictor("oracle:1.5"), "replay predictor 'oracle:1.5': expected oracle:<recall>"),
])
def test_a_name_arg_kind_refuses_a_missing_or_extra_argument(call, expected):
    with pytest.raises(InputError) as e:
        call()
    assert one_line(e).startswith(expected)


def test_every_existing_spelling_is_still_accepted():
    for policy in ("lru", "lfu", "static", "scored", "learned:/any/file.safetensors"):
        EngineConfig(policy=policy).check()
    for miss in ("blocking", "reroute", "speculative"):
        EngineConfig(miss=miss).check()
    EngineConfig(miss="host", tier="host").check()
    for tier in ("auto", "disk", "host", "throttled:16", "throttled:0.5"):
        EngineConfig(tier=tier).check()
    assert TierSpec.parse("throttled:16") == TierSpec("throttled", 16.0)
    assert TierSpec.parse("cuda") == TierSpec("cuda")
    for spec in ("none", "", "probe", "probe:1", "probe:64", "persistence", "spatio"):
        check_predictor_spec(spec)
    assert make_predictor("").name == "none" and make_predictor("none").name == "none"
    assert make_predictor("persistence", num_experts=4).name == "persistence"
    for spec in ("none", "persistence", "cooccurrence", "oracle", "oracle:0", "oracle:0.25", "oracle:1"):
        check_replay_predictor(spec)
    assert REPLAY_PREDICTORS.parse("oracle").arg == 1.0 and LIVE_PREDICTORS.parse("probe").arg == 1
    for policy in cachesim.POLICIES:
        cachesim.simulate(np.array([[0, 1], [1, 2]]), 2, policy)


def test_a_replays_predictor_named_live_says_where_it_runs():
    for spec in ("oracle", "oracle:0.5", "cooccurrence"):
        with pytest.raises(InputError, match=re.escape(f"predictor {spec!r}: a replay's predictor")):
            make_predictor(spec)


def test_the_auto_tier_is_refused_where_nothing_chooses_it():
    with pytest.raises(InputError, match="tier auto is the engine's choice"):
        make_tier("auto", None)


def test_the_constants_others_import_are_the_registries_names():
    assert POLICIES == ("lru", "lfu", "static", "scored") == POLICY_REGISTRY.view("state").names()
    assert cachesim.POLICIES == ("lru", "lfu", "static", "belady")
    assert MISS_POLICIES == MISS_REGISTRY.names() == ("blocking", "reroute", "speculative", "host")
    assert set(LIVE_PREDICTORS.names()) | set(REPLAY_PREDICTORS.names()) == set(PREDICTOR_REGISTRY.names())
    assert TIER_REGISTRY.names() == ("auto", "disk", "host", "cuda", "throttled")


# --- the registry itself ---------------------------------------------------------------------------------------

def test_register_as_a_call_or_a_decorator_and_parse():
    r = Registry("widget")
    r.register("plain")
    assert r.register("boxed", 42) == 42

    @r.register("sized", takes_arg="N", convert=int, arg_help="a whole number")
    def sized(n):
        return n * 2

    @r.register("maybe", takes_arg="X", default="7", aliases=("perhaps",))
    def maybe(x):
        return x

    assert r.names() == ("plain", "boxed", "sized", "maybe")
    assert r.listing() == "plain, boxed, sized:<N>, maybe[:<X>]"
    assert r.parse("plain") == ("plain", None, None)
    assert r.get("boxed") == 42
    name, arg, obj = r.parse("sized:3")
    assert (name, arg, obj(arg)) == ("sized", 3, 6)
    assert r.parse("maybe").arg == "7" and r.parse("perhaps:1") == ("maybe", "1", maybe)
    assert "sized:3" in r and "sized:x" not in r and "sized" not in r and "nope" not in r
    with pytest.raises(InputError, match=r"^widget 'sized:x': expected sized:<N> \(a whole number\)$"):
        r.parse("sized:x")
    with pytest.raises(InputError, match=r"^unknown widget None; expected one of: plain, boxed, sized:<N>"):
        r.parse(None)


def test_a_duplicate_name_is_refused():
    r = Registry("widget")
    r.register("a", aliases=("alpha",))
    for name in ("a", "alpha"):
        with pytest.raises(ValueError, match=f"widget '{name}' is already registered"):
            r.register(name)
    with pytest.raises(ValueError, match="already registered"):
        r.register("b", aliases=("a",))
    assert r.names() == ("a",)
    with pytest.raises(ValueError, match="already registered"):  # the real registries too
        POLICY_REGISTRY.register("lru")
    with pytest.raises(ValueError, match="already registered"):
        TIER_REGISTRY.register("disk")
    for bad in ("", "a:b", None):
        with pytest.raises(ValueError):
            r.register(bad)


def test_a_view_filters_the_same_entries_and_is_read_only():
    r = Registry("widget")
    r.register("a", tags=("x",))
    r.register("b", tags=("y",))
    v = r.view("x", kind="x widget")
    assert v.names() == ("a",) and "b" not in v
    with pytest.raises(InputError, match=r"^unknown x widget 'b'; expected one of: a$"):
        v.parse("b")
    r.register("c", tags=("x", "y"))
    assert v.names() == ("a", "c")  # live, not a copy
    with pytest.raises(TypeError):
        v.register("d")


def test_a_converters_own_input_error_is_kept():
    def strict(s):
        raise InputError(f"no {s} here")
    r = Registry("widget")
    r.register("w", takes_arg="S", convert=strict)
    with pytest.raises(InputError, match="^no q here$"):
        r.parse("w:q")
