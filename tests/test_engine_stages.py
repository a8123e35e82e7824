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


def _engine_configs() -> list[Path]:
    """The results/*.config.yaml files that configure an engine (the others, of benchmarks without one, have no
    `engine:` section to check)."""
    return [p for p in sorted(ROOT.glob("results/*.config.yaml")) if "engine" in (yaml.safe_load(p.read_text()) or {})]


ENGINE_CONFIGS = _engine_configs()


def test_the_committed_engine_configs_are_there_to_check():
    assert len(ENGINE_CONFIGS) >= 8, ENGINE_CONFIGS


@pytest.mark.parametrize("path", ENGINE_CONFIGS, ids=lambda p: p.name)
def test_a_committed_flat_config_reads_through_the_cli_into_the_same_parts(path):
    """Each results/*.config.yaml that has an `engine:` section still parses through the generated CLI (the flat
    `--engine.*` keys), and its config round-trips through the parts unchanged."""
    from expertcache.recipes.cli import build_parser

    section = yaml.safe_load(path.read_text())["engine"]
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


def test_each_weight_format_is_one_registered_class(store, tmp_path):
    """One class per weight format in `WEIGHT_FORMAT_REGISTRY`, chosen once per pool by its `fits` rule in
    registration order: bf16 SwiGLU on CPU slots through the CPU kernel (`auto`, `cpu`), the family's own forward
    (`native`, or fp32 slots), triton where asked (CUDA slots), int8 / int4 for packed views; the engine's modules
    hold the chosen object and it computes as its class says."""
    from expertcache.runtime.engine import formats
    from expertcache.runtime.kernels import cpu_kernels, quant

    reg = formats.WEIGHT_FORMAT_REGISTRY
    assert reg.names() == ("mixed", "int8", "int4", "triton", "cpu_bf16", "native")
    classes = [reg.get(n) for n in reg.names()]
    assert len(set(classes)) == len(classes) and all(issubclass(c, formats.ExpertFormat) for c in classes)
    assert [c.name for c in classes] == list(reg.names())
    sizes = dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=64)  # packed: 64-input chunks
    model = build_model(tiny_config("qwen3_moe", **sizes), seed=0, dtype=torch.bfloat16)
    experts = adapter_for(model).moe_layers(model)[0].experts
    fwd = type(experts).forward
    bf16 = {"gate_up_proj": experts.gate_up_proj.data, "down_proj": experts.down_proj.data}
    fp32 = {k: v.float() for k, v in bf16.items()}

    def pick(views, kernel, device="cpu"):
        import copy

        tmpl = copy.copy(experts)
        tmpl._parameters = {}
        for n, v in views.items():
            setattr(tmpl, n, v)
        return type(formats.choose(views, tmpl, fwd, kernel, device))

    fast = formats.CpuBf16 if cpu_kernels.available() else formats.Native
    assert pick(bf16, "auto") is fast and pick(bf16, "cpu") is fast
    assert pick(bf16, "native") is formats.Native and pick(fp32, "auto") is formats.Native
    assert pick(bf16, "auto", "cuda") is formats.Native and pick(bf16, "triton", "cuda") is formats.Triton
    for bits, cls in ((8, formats.Int8), (4, formats.Int4)):
        packed = {f"{n}.{p}": t for n, w in bf16.items() for p, t in quant.quantize(w, bits, 32).items()}
        assert pick(packed, "native") is cls and pick(packed, "triton", "cuda") is cls
    # an engine's modules over a bf16 store: the format chosen once, computing as the class says (native: the
    # family's own forward, exactly; the CPU kernel: fp32 accumulation, equal up to rounding)
    path = tmp_path / "bf16.store"
    write_store(model, path)
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    idx, w = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2, dtype=torch.bfloat16)
    for kernel, cls in (("native", formats.Native), ("auto", fast)):
        m = build_model(tiny_config("qwen3_moe", **sizes), seed=0, dtype=torch.bfloat16)
        eng = offload(m, path, EngineConfig(capacity=1.0, tier="host", kernel=kernel))
        try:
            mod = eng.modules[0]
            assert all(type(md.fmt) is cls for md in eng.modules)
            full = dict(eng.tier.layer_views(0))  # [E, ...] views of the host copy
            want = fwd(mod.fmt.over(full), x, idx, w)
            got = mod.compute(x, idx, w, full)
            assert torch.equal(got, want) if cls is formats.Native else \
                (got.float() - want.float()).norm() < 2e-2 * want.float().norm()
            if cls is formats.CpuBf16:  # a prefill's rows (more than the decode kernels take) go through the
                xs = torch.randn(cpu_kernels.EXPERT_ROWS + 5, x.shape[1], dtype=torch.bfloat16)  # family's forward:
                ids = torch.randint(0, 4, (xs.shape[0], 2))  # exactly (torch's GEMMs reuse each expert's weights)
                ws = torch.rand(xs.shape[0], 2, dtype=torch.bfloat16)
                assert torch.equal(mod.compute(xs, ids, ws, full), fwd(mod.fmt.over(full), xs, ids, ws))
                calls, kernel = [], cpu_kernels.swiglu_bf16  # decode rows stay on the kernel with grad enabled (the
                cpu_kernels.swiglu_bf16 = lambda *a: calls.append(1) or kernel(*a)  # replay's case) unless autograd
                try:  # would record through them
                    with torch.enable_grad():
                        mod.compute(x, idx, w, full)
                        assert calls == [1]
                        mod.compute(x.clone().requires_grad_(True), idx, w, full)
                        assert calls == [1]
                    # a decode step of 16 sequences (past the linears' MAX_ROWS, within EXPERT_ROWS) stays on it
                    x16 = torch.randn(16, x.shape[1], dtype=torch.bfloat16)
                    i16, w16 = torch.randint(0, 4, (16, 2)), torch.rand(16, 2, dtype=torch.bfloat16)
                    got16 = mod.compute(x16, i16, w16, full)
                    assert calls == [1, 1] and cpu_kernels.MAX_ROWS < 16 <= cpu_kernels.EXPERT_ROWS
                    want16 = fwd(mod.fmt.over(full), x16, i16, w16).float()
                    assert (got16.float() - want16).norm() < 2e-2 * want16.norm()
                finally:
                    cpu_kernels.swiglu_bf16 = kernel
        finally:
            eng.close()


def test_the_expert_kernel_takes_calls_whose_experts_have_few_pairs_each():
    """The bf16 kernel reads an expert once for all its pairs but computes them one at a time; torch's GEMMs pay a
    fixed cost per expert. Calls up to EXPERT_ROWS rows, and larger ones with at most PAIRS_PER_EXPERT pairs per
    expert touched (a prompt chunk spread over most experts), take the kernel; a long prompt does not."""
    from expertcache.runtime.kernels import cpu_kernels as ck

    g = torch.Generator().manual_seed(0)

    def spread(rows):  # top-8 of 128 experts, each row its own random choice
        return torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(rows)])

    assert ck.expert_rows_fit(spread(100))  # 800 pairs over 128 experts: 6.25 each
    assert not ck.expert_rows_fit(spread(512))  # 32 each
    assert ck.expert_rows_fit(torch.randint(0, 4, (ck.EXPERT_ROWS, 2), generator=g))  # decode-sized: always
    assert not ck.expert_rows_fit(torch.randint(0, 4, (ck.EXPERT_ROWS + 1, 2), generator=g))  # 66 pairs over 4


def test_each_part_checks_its_own_fields_and_the_config_what_crosses_parts():
    """`EngineConfig.check` runs each part's `check` (a bad field is refused by its own part, with the message the
    flat config always gave), then the checks that read two parts (a part alone accepts them)."""
    from expertcache.telemetry.errors import InputError

    bad = {"budget": ("cache", "budget='row'; expected layer or global", "row"),
           "workers": ("load", "workers=0; expected >= 1", 0),
           "tau": ("miss", "tau=-1.0; expected a finite margin >= 0", -1.0),
           "miss_upgrade": ("miss", "miss_upgrade=0; expected >= 1", 0),
           "threads": ("compute", "threads=-1; expected >= 1, or 0 for one per core", -1),
           "kernel": ("compute", "kernel='fast'; expected one of native, cpu, auto, triton", "fast"),
           "device": ("compute", "device=3; expected a string", 3)}
    for key, (part, message, value) in bad.items():
        cfg = EngineConfig(**{key: value})
        for name, p in zip(EngineParts._fields, cfg.parts):
            if name == part:
                with pytest.raises(InputError) as e:
                    p.check()
                assert str(e.value) == message
            else:
                p.check()  # the other parts hold defaults
        with pytest.raises(InputError) as e:
            cfg.check()
        assert str(e.value) == message
    across = {dict(miss="host", tier="disk").__repr__(): (dict(miss="host", tier="disk"),
              "miss policy host computes experts where they live: it needs the host or a throttled tier, not disk"),
              "cpu kernel on cuda": (dict(kernel="cpu", device="cuda"), "kernel cpu computes on CPU slots: drop "
                                     "--engine.device cuda / --engine.tier cuda, or use --engine.kernel triton"),
              "triton on cpu": (dict(kernel="triton"), "kernel triton runs on CUDA slots only: add --engine.device "
                                "cuda (or --engine.tier cuda), or use --engine.kernel native")}
    for kw, message in across.values():
        cfg = EngineConfig(**kw)
        for p in cfg.parts:
            p.check()
        with pytest.raises(InputError) as e:
            cfg.check()
        assert str(e.value) == message
