"""The engine as stages: `EngineConfig`'s flat keys (flags, YAML, the committed results' configs) split by one table
into the parts each stage is built from; the plan, loads and compute stages each built from its part alone and
driven on their own over a real store."""

from dataclasses import asdict, fields
from pathlib import Path

import pytest
import torch
import yaml

from expertcache.runtime.engine.config import LOSSY_MISS, PARTS, EngineConfig, EngineParts, LoadConfig, MissConfig
from expertcache.runtime.engine.engine import offload
from expertcache.runtime.engine.layer_view import LayerView
from expertcache.runtime.engine.loads import Loads
from expertcache.runtime.engine.plan import MISS_REGISTRY, Host, LowBit, MissPolicy, Plan, Reroute
from expertcache.runtime.engine.predictors import Predictor
from expertcache.runtime.engine.stats import Stats
from expertcache.runtime.storage.checkpoint import StoreExperts
from expertcache.runtime.storage.store import read_store_meta, write_store
from expertcache.runtime.storage.tiers import SlotPool, make_tier
from expertcache.telemetry.adapters import adapter_for
from expertcache.telemetry.cache import CacheState
from tiny_models import build_model, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_flat_key_is_in_exactly_one_part():
    keys = [k for part in PARTS.values() for k in part]
    assert sorted(keys) == sorted(f.name for f in fields(EngineConfig)) and len(keys) == len(set(keys))
    assert tuple(PARTS) == EngineParts._fields == ("cache", "load", "miss", "compute")


@pytest.mark.parametrize("path", sorted(ROOT.glob("results/*.config.yaml")), ids=lambda p: p.name)
def test_a_committed_flat_config_reads_through_the_cli_into_the_same_parts(path):
    """Each results/*.config.yaml that has an `engine:` section still parses through the generated CLI (the flat
    `--engine.*` keys), and its config round-trips through the parts unchanged."""
    from expertcache.recipes.cli import build_parser

    section = yaml.safe_load(path.read_text()).get("engine")
    if section is None:
        pytest.skip("no engine section")
    command = ("bench", "big") if path.name.startswith("bench_big") else ("bench", "decode")
    cfg = EngineConfig(**section)
    assert EngineConfig.from_parts(cfg.parts) == cfg
    for name, keys in PARTS.items():  # each part holds exactly its keys' values
        assert asdict(getattr(cfg.parts, name)) == {k: getattr(cfg, k) for k in keys}
    parsers = {}
    build_parser(parsers, only=command[0])
    _, parser = parsers[command]
    got = parser.instantiate_classes(parser.parse_args(["--config", str(path)])).engine
    assert got == cfg and got.parts == cfg.parts


def test_the_flat_flags_fill_the_parts():
    from expertcache.recipes.cli import build_parser

    parsers = {}
    build_parser(parsers, only="bench")
    _, parser = parsers["bench", "decode"]
    got = parser.instantiate_classes(parser.parse_args(["--engine.capacity", "3", "--engine.miss", "reroute",
                                                        "--engine.tau", "0.3", "--engine.workers", "2"])).engine
    assert got.parts.cache.capacity == 3 and got.parts.miss == MissConfig("reroute", 0.3, 0, "", 2)
    assert got.parts.load.workers == 2 and got.parts.compute.kernel == "auto"


def test_each_miss_policy_is_one_registered_class():
    assert MISS_REGISTRY.names() == ("blocking", "reroute", "speculative", "host")
    for name in MISS_REGISTRY.names():
        assert issubclass(MISS_REGISTRY.parse(name).obj, MissPolicy)
    assert set(LOSSY_MISS.names()) == {"reroute", "speculative"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    model = build_model(tiny_config("qwen3_moe"), seed=1).eval()
    path = tmp_path_factory.mktemp("stages") / "m.store"
    write_store(model, path)
    return model, path


def _cache(cap=2, k=2, victims=False):
    return [LayerView(CacheState(cap, k, "lru", victims=victims)) for _ in range(2)]


def test_the_plan_stage_from_its_part_alone(store):
    """Hits, misses and victims by the cache's state; the serve by the policy from its part (`miss`,
    `miss_precision`); everything resident and not eager: the family's one call over the slots."""
    model, _ = store
    adapter = adapter_for(model)
    part = EngineConfig(miss="reroute", tau=0.3).parts.miss
    plan = Plan(part, adapter, 2, victims=True)
    assert isinstance(plan.policy, Reroute) and plan.policy.part.tau == 0.3
    plan.states = _cache(victims=True)
    st = plan.states[0]
    st.retain([0, 1], st.stage([0, 1]))
    p = plan.serve(0, [0, 1, 5], eager=False)
    assert (p.hits, p.misses, p.reused, p.serve) == ([0, 1], [5], [], "load")
    assert plan.serve(0, [0, 1], eager=False).serve == "slots" and plan.serve(0, [0, 1], eager=True).serve == "load"
    st.retain([2, 3], st.stage([2, 3]))  # 0 and 1 leave the cache; their staging slots still hold them
    p = plan.serve(0, [0, 2], eager=False)
    assert (p.hits, p.misses, p.reused) == ([2], [], [0])
    assert isinstance(Plan(MissConfig("host", 0.1, 0, "", 2), adapter, 2, False).policy, Host)
    low = Plan(MissConfig("blocking", 0.1, 4, "copy", 2), adapter, 2, False)
    assert isinstance(low.policy, LowBit) and low.policy.serve == "low" and not low.policy.admits


def test_the_loads_stage_from_its_part_alone_reads_whole_experts_and_counts_them(store):
    """A prefetch and a demand load over the stage's own queue land the store's bytes in the slots the cache
    gives; the prefetch is counted when its read finishes, bytes as they move."""
    _, path = store
    meta = read_store_meta(path)
    part = LoadConfig(tier="host", workers=1, max_inflight_bytes=1 << 30, predictor="none", prefetch_budget=0,
                      prefetch_guard=0.0, integrity="on")
    tier = make_tier("host", StoreExperts(path, meta))
    pools = [SlotPool(meta, 4) for _ in range(2)]
    loads = Loads(part, tier, None, meta, pools, "cpu", 8, 2, Predictor(), overlap=False)
    loads.stats, loads.states = Stats(), _cache()
    raw = path.read_bytes()
    try:
        loads.prefetch(1, [3])
        assert set(loads.pending[1]) == {3} and loads.in_flight(1) == {3}
        assert loads.settle(1, {3}) >= 0 and not loads.pending[1]
        slot = loads.states[1].lookup(3)
        assert bytes(pools[1].slot_bytes(slot)) == raw[meta.offset(1, 3):meta.offset(1, 3) + meta.block_bytes]
        assert loads.stats.bytes_moved == meta.expert_bytes
        d = loads.demand(0, [5], [])  # small experts (overlap off): read in this thread
        events = list(d.events())
        assert events == [("started", True), ("staged", {5: d.staged[5]})] and d.transient == []
        assert bytes(pools[0].slot_bytes(d.staged[5])) == raw[meta.offset(0, 5):meta.offset(0, 5) + meta.block_bytes]
        assert loads.stats.bytes_moved == 2 * meta.expert_bytes
    finally:
        loads.queue.shutdown(wait=True)
        tier.close()
    # a prefetch is counted by its done-callback in the load thread (after its result is out): once the queue is done
    assert loads.stats.prefetch_loads == 1 and loads.inflight == 0


def test_the_engine_hands_each_stage_only_its_part(store):
    model, path = store
    m = build_model(tiny_config("qwen3_moe"), seed=1).eval()
    cfg = EngineConfig(capacity=3, tier="host", miss="reroute", tau=0.2, workers=2, kernel="native")
    eng = offload(m, path, cfg)
    try:
        parts = eng.cfg.parts
        assert (eng.plan.part, eng.loads.part, eng.compute.part) == (parts.miss, parts.load, parts.compute)
        assert parts.load.tier == "host" and parts.miss.tau == 0.2 and parts.compute.kernel == "native"
        prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            m.generate(prompt, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(prompt),
                       pad_token_id=0)
        s = eng.stats
        assert s.calls == 2 * 4 and s.hits + s.demand_loads == s.accesses and s.rerouted > 0
        assert s.bytes_moved == s.demand_loads * eng.meta.expert_bytes  # counted once, by the loads stage
    finally:
        eng.close()
