"""The offload runtime: the one cache state machine (slots and what stays), the store file, and lossless decoding
through the engine on every family's tiny model, with real stores on disk."""

import os
import time

import numpy as np
import pytest
import torch

from expertcache.runtime.engine.config import EngineConfig
from expertcache.runtime.engine.engine import offload
from expertcache.runtime.engine.predictors import make_predictor
from expertcache.runtime.storage.store import HEADER, read_store_meta, write_store
from expertcache.telemetry.cache import CacheState
from expertcache.telemetry.cachesim import simulate, simulate_scored
from expertcache.telemetry.errors import InputError
from helpers import greedy, wait_until
from tiny_models import FAMILIES, build_model, tiny_config


def _drive(steps, cap, k, policy, pinned=None, keep=None):
    cs = CacheState(cap, k, policy, pinned)
    hits = 0
    for s, r in enumerate(steps.tolist()):
        miss = [e for e in r if cs.lookup(e) is None]
        hits += len(r) - len(miss)
        staged = cs.stage(miss)
        slots = [cs.lookup(e) if e not in staged else staged[e] for e in r]
        assert len(set(slots)) == len(slots)  # a step's experts never share a slot
        cs.retain(r, staged, keep[s].tolist() if keep is not None else None)
        assert sorted(list(cs.res.values()) + cs.staging + cs.free) == list(range(cap + k))
    return hits


def _lru_by_hand(steps, cap):
    """Hits of an LRU cache written the obvious way (C >= k): after each step the C most recently used distinct
    keys stay, recency by step, then by position in the step."""
    last, hits = {}, 0
    for s, r in enumerate(steps.tolist()):
        resident = sorted(last, key=lambda e: last[e])[-cap:]
        hits += sum(e in resident for e in r)
        for j, e in enumerate(r):
            last[e] = (s, j)
    return hits


@pytest.mark.parametrize("seed", range(6))
def test_the_one_cache_keeps_its_slots_apart_and_counts_lru_as_written_by_hand(seed):
    rng = np.random.default_rng(seed)
    e, k = 8, int(rng.integers(1, 4))
    steps = np.stack([rng.choice(e, k, replace=False) for _ in range(120)])
    keep = rng.random((120, e))
    for cap in range(1, e):
        hits = {p: _drive(steps, cap, k, p, keep=keep if p == "scored" else None) for p in ("lru", "lfu", "scored")}
        # the simulator is a driver over the same state machine: the same counts, and slots stay consistent
        assert hits["lru"] == simulate(steps, cap, "lru").hits
        assert hits["lfu"] == simulate(steps, cap, "lfu").hits
        assert hits["scored"] == simulate_scored(steps, cap, keep=keep).hits
        if cap >= k:
            assert hits["lru"] == _lru_by_hand(steps, cap)
        pins = np.argsort(-np.bincount(steps.reshape(-1), minlength=e))[:cap].tolist()
        assert _drive(steps, cap, k, "static", pinned=pins) == simulate(steps, cap, "static").hits
        assert hits["lru"] <= simulate(steps, cap, "belady").hits


def test_a_step_larger_than_the_cache_keeps_its_hits_and_streams_the_rest():
    # C = 2 < k = 3: [0, 1, 2] fills 0 and 1 (2 streams); [0, 3, 4]: 0 hits and stays, 3 takes 1's place
    cs = CacheState(2, 3, "lru")
    for r in ([0, 1, 2], [0, 3, 4]):
        cs.retain(r, cs.stage([e for e in r if cs.lookup(e) is None]))
    assert list(cs.res) == [0, 3]
    assert simulate(np.array([[0, 1, 2], [0, 3, 4], [0, 3, 5]]), 2, "lru").hits == 1 + 2


def _drive_victims(steps, cap, k, policy, keep=None):
    """`_drive` with victims: a miss whose bytes a staging slot still holds is a hit, served from that slot."""
    cs = CacheState(cap, k, policy, victims=True)
    hits = 0
    for s, r in enumerate(steps.tolist()):
        miss = [e for e in r if cs.lookup(e) is None]
        reused = [e for e in miss if cs.victim(e) is not None]
        hits += len(r) - len(miss) + len(reused)
        staged = cs.stage(miss)
        assert all(staged[e] == cs.victim(e) for e in reused)  # served where it already is
        assert not set(staged.values()) & set(cs.res.values())
        cs.retain(r, staged, keep[s].tolist() if keep is not None else None)
        assert sorted(list(cs.res.values()) + cs.staging + cs.free) == list(range(cap + k))
        assert not set(cs.held) & set(cs.res.values())  # a resident slot is never also a victim's
    return hits


@pytest.mark.parametrize("seed", range(4))
def test_victims_make_lru_over_c_slots_hit_as_lru_over_c_plus_k(seed):
    rng = np.random.default_rng(seed)
    e, k = 24, int(rng.integers(1, 6))
    p = 1 / np.arange(1, e + 1)
    steps = np.stack([rng.choice(e, k, replace=False, p=p / p.sum()) for _ in range(300)])
    keep = rng.random((300, e))
    for cap in range(k, e - k):
        assert _drive_victims(steps, cap, k, "lru") == simulate(steps, cap + k, "lru").hits
        for pol in ("lfu", "scored"):  # no identity claimed: the slots stay consistent (`_drive_victims` checks)
            kp = keep if pol == "scored" else None
            assert _drive_victims(steps, cap, k, pol, kp) >= _drive(steps, cap, k, pol, keep=kp)


def test_a_slot_handed_out_for_a_read_is_never_a_victim_until_its_step_completes():
    cs = CacheState(2, 2, "lru", victims=True)
    for r in ([0, 1], [2, 3], [4, 5]):  # 2 and 3 leave at [4, 5] (over 0 and 1): their bytes stay in staging
        cs.retain(r, cs.stage([e for e in r if cs.lookup(e) is None]))
    assert cs.victim(0) is None and cs.victim(2) is not None and cs.victim(3) is not None
    staged = cs.stage([6, 7])  # a step whose reads fail: retain never runs
    assert set(staged.values()) == set(cs.staging)
    assert all(cs.victim(e) is None for e in (2, 3, 6, 7))


@pytest.mark.parametrize("policy", ["lru", "lfu", "scored"])
def test_retain_keeps_a_resident_whose_load_is_in_flight(policy):
    """`protect`: a resident whose slot a prefetch is still writing stays, though the policy would drop it; the
    others share the capacity left, and the slots stay consistent."""
    cs = CacheState(2, 2, policy)
    scores = [0.0] * 8
    for r in ([0], [1]):
        cs.retain(r, cs.stage([r[0]]), scores if policy == "scored" else None)
    assert set(cs.res) == {0, 1}
    scores = [0.0, 0.0, 1.0, 1.0, 0, 0, 0, 0]  # scored: 2 and 3 outrank both residents
    step = [2, 3]
    staged = cs.stage(step)
    cs.retain(step, staged, scores if policy == "scored" else None, protect={0})
    assert 0 in cs.res and len(cs.res) == 2 and len(set(cs.res) & {2, 3}) == 1
    assert sorted(list(cs.res.values()) + cs.staging + cs.free) == list(range(4))


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for fam in FAMILIES:
        model = build_model(tiny_config(fam), seed=1).eval()
        path = root / f"{fam}.store"
        write_store(model, path)
        out[fam] = (model, path)
    return out


def _fresh(fam):
    return build_model(tiny_config(fam), seed=1).eval()


def _greedy(model, prompt, n=12):
    return greedy(model, prompt, n, pad_token_id=0)


def test_store_holds_each_expert_in_one_aligned_block(family_models):
    model, path = family_models["gpt_oss"]  # fused tensors and biases
    meta = read_store_meta(path)
    assert meta.block_bytes % 4096 == 0 and all(t.offset % 4096 == 0 for t in meta.tensors)
    assert {t.name for t in meta.tensors} == {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    exp = model.model.layers[1].mlp.experts
    raw = path.read_bytes()
    t = next(t for t in meta.tensors if t.name == "down_proj")
    off = meta.offset(1, 5) + t.offset
    got = torch.frombuffer(bytearray(raw[off:off + t.nbytes]), dtype=torch.float32).view(*t.shape)
    assert torch.equal(got, exp.down_proj[5].detach())
    assert meta.file_bytes() == HEADER + meta.num_layers * meta.num_experts * meta.block_bytes + meta.table_bytes() \
        == len(raw)
    assert meta.table_bytes() >= 8 * meta.num_layers * meta.num_experts  # the checksum table (version 2)


@pytest.mark.parametrize("fam", FAMILIES)
def test_blocking_decode_is_bit_identical_to_generate(family_models, fam):
    model, path = family_models[fam]
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    want = _greedy(model, prompt)
    m = _fresh(fam)
    eng = offload(m, path, EngineConfig(capacity=2, tier="disk", prefetch_guard=0),
                  predictor=make_predictor("probe:1", m))  # guard off: the prefetch path itself is under test
    try:
        got = _greedy(m, prompt)
        s = eng.stats
        assert s.demand_loads > 0 and s.hits > 0  # it really offloaded: 2 of 8 experts resident
        assert s.prefetch_loads > 0
    finally:
        eng.close()
    assert torch.equal(want, got)
    assert not any(p.shape[0] == 8 for n, p in m.named_parameters() if "experts" in n)  # experts left the model


def test_a_prefetch_keeps_the_expert_it_evicts_as_a_victim():
    """With victims, the resident a prefetch evicts keeps its bytes (its slot turns staging, as a miss's eviction
    does) and the prefetch lands in the staging slot whose victim is oldest. A prefetch used to overwrite the
    evicted expert's slot: on bench big's trace, an oracle that named only the experts each layer then used read
    1.4x what demand loading read."""
    def victims_2_and_3():  # 2 and 3 leave at the third step: victims in the staging slots
        cs = CacheState(2, 2, "lru", victims=True)
        for r in ([0, 1], [2, 3], [0, 1]):
            cs.retain(r, cs.stage([e for e in r if cs.lookup(e) is None]))  # a victim is staged in its own slot
        return cs

    cs = victims_2_and_3()
    assert set(cs.res) == {0, 1} and cs.victim(2) is not None and cs.victim(3) is not None
    oldest = cs.victim(2)
    slot_of_0 = cs.lookup(0)
    s = cs.prefetch_slot(5, {5})
    assert s == oldest and cs.lookup(5) == s  # written where the oldest victim was
    assert cs.victim(0) == slot_of_0 and cs.victim(2) is None and cs.victim(3) is not None  # 0 kept, 2 gone
    assert sorted(list(cs.res.values()) + cs.staging + cs.free) == list(range(4))
    assert not set(cs.held) & set(cs.res.values())
    cs.drop(5)  # a cancelled prefetch: its slot is free again, 0 still a victim
    assert cs.lookup(5) is None and cs.victim(0) == slot_of_0
    assert sorted(list(cs.res.values()) + cs.staging + cs.free) == list(range(4))
    cs = victims_2_and_3()
    held_3 = cs.victim(3)
    assert cs.prefetch_slot(5, {5, 2}) == held_3  # 2 is named by the same prediction: its victim stays
    assert cs.victim(2) is not None and cs.victim(3) is None


def test_an_oracle_over_a_replayed_trace_prefetches_only_what_is_used_and_keeps_the_victims(family_models):
    """bench big's limit row: a routing trace replayed through the routers (`TraceRouting`) and its own next
    experts prefetched one layer ahead (`TracePredictor` oracle, told each pass's token by the routing). Every
    prefetch is used, the experts prefetches evict are still served as victims, the reads are demand loading's,
    and the tokens are on-demand's under the same routing."""
    from expertcache.runtime.bench.bigbench import TraceRouting
    from expertcache.runtime.engine.trace_predictors import TracePredictor
    from expertcache.telemetry.adapters import adapter_for

    model, path = family_models["qwen3_moe"]
    n_l, e, k = model.config.num_hidden_layers, model.config.num_experts, model.config.num_experts_per_tok
    rng = np.random.default_rng(0)
    p = 1 / np.arange(1, e + 1)
    ids = np.stack([np.stack([rng.choice(e, k, replace=False, p=p / p.sum()) for _ in range(40)])
                    for _ in range(n_l)])
    prompt = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(5))
    got = {}
    for name in ("on-demand", "oracle"):
        m = _fresh("qwen3_moe")
        pred = TracePredictor("oracle", ids, None) if name == "oracle" else None
        eng = offload(m, path, EngineConfig(capacity=2, tier="disk", prefetch_guard=0.0), predictor=pred)
        TraceRouting([x.router for x in adapter_for(m).moe_layers(m)], ids, 0, pred)
        try:
            got[name] = (_greedy(m, prompt, 24), eng.stats)
        finally:
            eng.close()
    (want, od), (toks, s) = got["on-demand"], got["oracle"]
    assert torch.equal(want, toks)
    assert s.prefetch_loads > 0 and s.prefetch_hits == s.prefetch_loads  # named only what its layer then used
    assert s.victim_hits > 0
    # an oracle reads what demand loading reads, only earlier (it read 56 experts against 43 when a prefetch
    # overwrote the expert it evicted); layer 0 of each token is not predicted (nothing names it): demand loads
    assert s.demand_loads + s.prefetch_loads == od.demand_loads and s.victim_hits == od.victim_hits


def test_victims_serve_misses_from_the_staging_slots_losslessly_and_hit_as_the_simulator_says(family_models):
    """One token per step (a one-token prompt): each layer's steps are the simulator's token steps, so the engine's
    LRU hits with victims are exactly the simulator's at C + k, and without them at C."""
    model, path = family_models["qwen3_moe"]
    prompt = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(5))
    want = _greedy(model, prompt, 24)
    got = {}
    for victims, overlap in ((True, False), (False, False), (True, True)):
        m = _fresh("qwen3_moe")
        eng = offload(m, path, EngineConfig(capacity=2, tier="disk", victims=victims))
        eng.loads.overlap = overlap  # as for experts >= 1 MiB: residents and victims compute while the misses load
        seen = {}
        run = eng._run_layer

        def spy(mod, hidden, idx, w, run=run, seen=seen):
            seen.setdefault(mod.pos, []).append(idx.reshape(-1).tolist())
            return run(mod, hidden, idx, w)
        eng._run_layer = spy
        try:
            assert torch.equal(want, _greedy(m, prompt, 24))
            s, k = eng.stats, m.config.num_experts_per_tok
            cap = 2 + k if victims else 2
            assert s.hits == sum(simulate(np.array(v), cap, "lru").hits for v in seen.values())
            got[victims, overlap] = (s.hits, s.victim_hits, s.demand_loads, s.bytes_moved)
        finally:
            eng.close()
    assert got[True, True] == got[True, False]
    got = {v: got[v, False] for v in (True, False)}
    assert got[True][1] > 0 and got[False][1] == 0
    assert got[True][0] > got[False][0] and got[True][2] < got[False][2]  # fewer reads for the same slots
    assert got[True][3] < got[False][3]


@pytest.mark.parametrize("what", ["read", "compute"])
def test_a_failed_step_leaves_no_other_load_of_its_step_writing(family_models, what):
    """One of a step's reads fails (or its compute does) while its other reads are still in flight: the error
    leaves the step only once they have finished (none still writes a slot the next step may hand out), and the
    engine serves on."""
    import threading
    import time as _time

    model, path = family_models["qwen3_moe"]
    m = _fresh("qwen3_moe")
    eng = offload(m, path, EngineConfig(capacity=2, tier="disk", workers=4))
    eng.loads.overlap = True  # loads in flight together, as for experts >= 1 MiB
    read, live, lock = eng.tier.read, [], threading.Lock()
    state = {"fail": True}

    def slow_read(pos, expert, pool, slot):
        with lock:
            live.append(expert)
            first = state["fail"] and len(live) == 1
        try:
            if first:
                _time.sleep(0.02)
                if what == "read":
                    raise OSError("injected read error")
            _time.sleep(0.15 if state["fail"] else 0.0)
            return read(pos, expert, pool, slot)
        finally:
            with lock:
                live.remove(expert)

    compute = eng.compute.timed

    def failing_compute(*a, **kw):
        if state["fail"] and what == "compute" and live:  # while other reads are in flight
            raise OSError("injected compute error")
        return compute(*a, **kw)

    eng.tier.read, eng.compute.timed = slow_read, failing_compute
    prompt = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(7))
    try:
        with pytest.raises(OSError, match="injected"):
            _greedy(m, prompt, 4)
        assert not live  # every other read of the failed step had finished before the error reached the caller
        state["fail"] = False
        want = _greedy(model, prompt, 8)
        assert torch.equal(want, _greedy(m, prompt, 8))  # and the engine serves on, losslessly
    finally:
        eng.close()


def test_a_layer_does_not_wait_for_a_prefetch_it_does_not_need(family_models):
    """A prefetch still loading when its layer runs without needing it is left in flight (the old engine waited for
    it): the step does not stall on it, its slot stays resident and protected until it lands, and decoding stays
    bit-identical to generate."""
    import threading

    model, path = family_models["qwen3_moe"]
    prompt = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(11))
    want = _greedy(model, prompt, 3)
    m = _fresh("qwen3_moe")
    eng = offload(m, path, EngineConfig(capacity=3, tier="disk", workers=2, victims=False))
    used = set()
    run = eng._run_layer

    def spy(mod, hidden, idx, w):
        if mod.pos == 0:
            used.update(idx.reshape(-1).tolist())
        return run(mod, hidden, idx, w)
    eng._run_layer = spy
    try:
        assert torch.equal(want, _greedy(m, prompt, 3))
        spare = sorted(set(range(m.config.num_experts)) - used)
        assert spare, used  # an expert layer 0 never uses in these steps
        eng.close()
        m = _fresh("qwen3_moe")
        eng = offload(m, path, EngineConfig(capacity=3, tier="disk", workers=2, victims=False))
        read = eng.tier.read

        started, release = threading.Event(), threading.Event()

        def slow(pos, expert, pool, slot):
            if pos == 0 and expert == spare[0]:
                started.set()
                release.wait(60)  # held until the steps are done: a step that waited for it would hang here
            return read(pos, expert, pool, slot)
        eng.tier.read = slow
        eng.loads.prefetch(0, [spare[0]])
        assert started.wait(5)  # reading (not merely queued, which the step would cancel)
        try:
            assert torch.equal(want, _greedy(m, prompt, 3))
            # the steps ran to the end while the read was still held: not waited for (ordered, not timed)
            assert not release.is_set() and eng.stats.prefetch_deferred >= 1, eng.stats
        finally:
            release.set()
        for f in list(eng.loads.pending[0].values()):
            f.result()
        assert eng.states[0].lookup(spare[0]) is not None  # landed and still resident: protected while loading
    finally:
        eng.close()


def test_a_prefetch_that_fails_after_its_layer_ran_is_raised_once_by_reset(family_models):
    """A deferred prefetch (its layer ran without it) that fails in the background: `reset()` waits for every
    load, comes back clean and cold, raises that error once; the next reset and decoding go on."""
    import time as _time

    model, path = family_models["qwen3_moe"]
    m = _fresh("qwen3_moe")
    eng = offload(m, path, EngineConfig(capacity=3, tier="disk", workers=2, victims=False))
    read = eng.tier.read
    first = {}

    import threading

    began = threading.Event()

    def slow_fail(pos, expert, pool, slot):
        if pos == 0 and first.pop("armed", False):
            began.set()
            _time.sleep(0.3)
            raise OSError("injected late failure")
        return read(pos, expert, pool, slot)
    eng.tier.read = slow_fail
    prompt = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(11))
    try:
        _greedy(m, prompt, 1)  # one forward pass: layer 0 runs now, never again before reset
        free = [e for e in range(m.config.num_experts) if eng.states[0].lookup(e) is None]
        first["armed"] = True  # the next read of layer 0, this prefetch's, fails late
        eng.loads.prefetch(0, [free[0]])
        # it has failed in the background: the read began and its future is done (a fixed 0.5 s sleep here assumed
        # the load thread had picked it up by then; a load not yet started is cancelled by reset, not waited for)
        assert began.wait(30)
        assert wait_until(lambda: all(f.done() for fs in eng.loads.pending for f in fs.values()))
        with pytest.raises(OSError, match="late failure"):
            eng.reset()
        assert not any(eng.loads.pending) and eng.loads.inflight == 0
        eng.reset()  # raised once: the engine is clean
        assert torch.equal(_greedy(model, prompt, 6), _greedy(m, prompt, 6))
    finally:
        eng.close()


@pytest.mark.parametrize("tier,policy", [("host", "lfu"), ("throttled:2", "lru")])
def test_other_tiers_and_policies_stay_lossless(family_models, tier, policy):
    model, path = family_models["qwen3_moe"]
    prompt = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))  # batch 2
    want = _greedy(model, prompt)
    m = _fresh("qwen3_moe")
    eng = offload(m, path, EngineConfig(capacity=0.25, tier=tier, policy=policy))
    try:
        assert torch.equal(want, _greedy(m, prompt))
        if tier.startswith("throttled"):  # paced: the bytes moved cannot have taken less than bytes / 2 GB/s
            assert eng.stats.bytes_moved > 0
    finally:
        eng.close()


def test_reroute_trades_misses_for_a_stated_change(family_models):
    model, path = family_models["qwen3_moe"]
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(5))
    runs = {}
    for miss in ("blocking", "reroute"):
        m = _fresh("qwen3_moe")
        eng = offload(m, path, EngineConfig(capacity=3, tier="host", miss=miss, tau=1.0))
        out = _greedy(m, prompt, 16)
        runs[miss] = (out, eng.stats)
        eng.close()
    assert runs["reroute"][1].rerouted > 0
    assert runs["reroute"][1].demand_loads < runs["blocking"][1].demand_loads


def test_bad_stores_and_capacities_are_refused(family_models, tmp_path, monkeypatch):
    model, path = family_models["qwen3_moe"]
    cut = tmp_path / "cut.store"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(InputError, match="truncated"):
        offload(_fresh("qwen3_moe"), cut)
    other_model, other = family_models["olmoe"]
    with pytest.raises(InputError, match="another checkpoint|layers x"):
        offload(_fresh("qwen3_moe"), other)
    retrained = build_model(tiny_config("qwen3_moe"), seed=2)
    with pytest.raises(InputError, match="another checkpoint"):
        offload(retrained, path)
    with pytest.raises(InputError, match="capacity 9 experts, but a layer has only 8"):
        offload(_fresh("qwen3_moe"), path, EngineConfig(capacity=9))
    with pytest.raises(InputError, match="a fraction of E is a float in"):
        offload(_fresh("qwen3_moe"), path, EngineConfig(capacity=2.5))
    with pytest.raises(InputError, match="unknown tier"):
        offload(_fresh("qwen3_moe"), path, EngineConfig(tier="nvme"))
    import expertcache.runtime.engine.loads as loads_mod

    monkeypatch.setattr(loads_mod, "available_memory", lambda: 1 << 16)
    with pytest.raises(InputError, match="GiB is available"):
        offload(_fresh("qwen3_moe"), path, EngineConfig(capacity=8))
    (tmp_path / "junk.store").write_bytes(b"x" * 5000)
    with pytest.raises(InputError, match="not an expertcache expert store"):
        read_store_meta(tmp_path / "junk.store")


def test_host_compute_moves_nothing_and_matches_plain(family_models):
    model, path = family_models["qwen3_moe"]
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(prompt).logits
    m = _fresh("qwen3_moe")
    eng = offload(m, path, EngineConfig(capacity=2, tier="host", miss="host", prefetch_guard=0),
                 predictor=make_predictor("probe:1", m))
    try:
        with torch.no_grad():
            got = m(prompt).logits
            out = _greedy(m, prompt)
        s = eng.stats
        assert s.host_computed > 0 and s.demand_loads == 0  # misses computed in place, never loaded
        assert s.bytes_moved == s.prefetch_loads * eng.meta.expert_bytes  # only prefetches move bytes
    finally:
        eng.close()
    assert torch.allclose(want, got, atol=1e-5)  # the same sum, in another order
    assert out.shape[1] > prompt.shape[1]  # it decodes
    with pytest.raises(InputError, match="host or a throttled tier"):
        offload(_fresh("qwen3_moe"), path, EngineConfig(tier="disk", miss="host"))


def test_speculative_runs_the_prediction_in_place_of_a_miss(family_models):
    model, path = family_models["qwen3_moe"]
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(7))
    runs = {}
    for miss in ("blocking", "speculative"):
        m = _fresh("qwen3_moe")
        eng = offload(m, path, EngineConfig(capacity=3, tier="host", miss=miss, prefetch_guard=0),
                     predictor=make_predictor("probe:1", m))
        _greedy(m, prompt, 16)
        runs[miss] = eng.stats
        eng.close()
    assert runs["speculative"].rerouted > 0
    assert runs["speculative"].demand_loads < runs["blocking"].demand_loads


@pytest.mark.parametrize("fam", ["qwen3_moe", "gpt_oss"])
def test_global_budget_is_lossless_and_shares_one_pool(family_models, fam):
    model, path = family_models[fam]
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(8))
    want = _greedy(model, prompt, 16)
    m = _fresh(fam)
    eng = offload(m, path, EngineConfig(capacity=2, tier="disk", budget="global", prefetch_guard=0),
                  predictor=make_predictor("probe:1", m))
    try:
        got = _greedy(m, prompt, 16)
        assert len({id(p) for p in eng.pools}) == 1 and eng.pools[0].n_slots == 2 * 2 + 2  # C x layers + k
        assert eng.stats.demand_loads > 0 and eng.stats.prefetch_loads > 0
    finally:
        eng.close()
    assert torch.equal(want, got)


def test_the_time_budget_adds_up_and_puts_the_time_where_it_went(family_models):
    """Per token: expert compute, stall, other compute and overhead, each from its own clock (the kernels, the
    waits, the model's forward, run_layer, the decode loop's clock), none negative, summing to TPOT within 5%. All
    resident: not one wait, compute on both sides. A paced link at 1 MB/s with 2 of 8 experts resident: the steps
    wait. Only what load cannot change is asserted: counts, and clocks that are zero or not. The link's pace is
    `test_read_limits_measure_the_tier_as_the_engine_reads_it`'s, counted on a clock only its sleeps move; how much
    of TPOT the wait takes is a benchmark's figure (`bench decode` prints the budget), not a test's."""
    from expertcache.runtime.serve.generate import timed_greedy

    model, path = family_models["qwen3_moe"]
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(9))
    for cfg, slow in ((EngineConfig(capacity=1.0, tier="host"), False),
                      (EngineConfig(capacity=2, tier="throttled:0.001", victims=False), True)):
        m = _fresh("qwen3_moe")
        eng = offload(m, path, cfg)
        try:
            times, _, st = timed_greedy(m, prompt, 10, eng)  # the decode loop's own clock
            b = st.time_budget(times[-1] - times[0], len(times) - 1)
            # the benchmarks' figures: the counters over the steps after a warmup (here 3 of 11), and their time
            eng.reset()
            marks = []  # a benchmark's own counters are read at the mark: once, where the timed steps begin
            t2, _, st2 = timed_greedy(m, prompt, 12, eng, warmup=3, at_mark=lambda: marks.append(time.perf_counter()))
            b2 = st2.time_budget(t2[-1] - t2[3], len(t2) - 1 - 3)
            assert len(marks) == 1 and t2[3] <= marks[0] <= t2[4], (marks, t2[:5])
        finally:
            eng.close()
        assert all(v >= 0 for v in b.values()), b
        assert abs(b["sum"] - b["tpot"]) <= 0.05 * b["tpot"], b
        assert all(v >= 0 for v in b2.values()) and abs(b2["sum"] - b2["tpot"]) <= 0.05 * b2["tpot"], b2
        assert st2.accesses == (12 - 1 - 3) * 2 * 2, st2  # 8 timed steps x 2 MoE layers x top-2, not the warmup's
        assert b["expert_compute"] > 0 and b["other_compute"] > 0 and b["overhead"] > 0
        if slow:
            assert st.demand_loads > 0 and st.stall_s > 0 and st.read_busy_s > 0, st
            assert st.per_token(None)["read_GBps_in_flight"] > 0  # the link's pace is counted, not timed: below
        else:
            assert st.stall_s == 0 and st.demand_loads == 0, st  # nothing was read, so nothing was waited for
            assert st.read_busy_s == 0 and st.per_token(None)["read_GBps_in_flight"] is None


def test_read_limits_measure_the_tier_as_the_engine_reads_it(family_models, monkeypatch):
    """`read_limits`: one expert at a time and `workers` at a time, each at the pace the tier really moves (a
    1 MB/s link moves 1 MB/s however many read at once), with the queue depth counted in reads in flight. The pace
    is counted, not timed: the tiers' clock is one that only the link's sleeps move, so the bytes and the sleeps
    give the GB/s exactly, whatever else the machine is doing."""
    import threading

    from expertcache.runtime.engine.engine import _as_source
    from expertcache.runtime.storage import tiers
    from expertcache.runtime.storage.tiers import make_tier, read_limits

    class LinkClock:  # time.perf_counter/time.sleep for the tiers module: only a sleep moves it, to its end
        def __init__(self):
            self.now, self.sleeps, self.lock, self.seen = 0.0, 0, threading.Lock(), threading.local()

        def perf_counter(self):
            with self.lock:
                self.seen.t = self.now  # the reading this thread's next sleep is measured from
                return self.now

        def sleep(self, s):
            with self.lock:
                self.sleeps += 1
                self.now = max(self.now, self.seen.t + s)

    _, path = family_models["qwen3_moe"]
    src = _as_source(path)
    clock = LinkClock()
    monkeypatch.setattr(tiers, "time", clock)
    tier = make_tier("throttled:0.002", src)
    lim = read_limits(tier, src.meta, src.meta.num_layers, workers=3, n=6)
    assert lim["one_at_a_time"]["queue_depth"] == 1 and lim["at_queue_depth"]["queue_depth"] == 3
    for k in ("one_at_a_time", "at_queue_depth"):
        assert lim[k]["GBps"] == pytest.approx(0.002, rel=1e-9), lim  # 3 readers share the one link
    # the reads went back to back on the link: 12 reads took 12 x bytes / bandwidth of link time, each reader
    # slept until its read's end (one at a time: all 6; three at once: at least the last of them)
    assert clock.now == pytest.approx(12 * src.meta.expert_bytes / 2e6, rel=1e-9), clock.now
    assert 7 <= clock.sleeps <= 12, clock.sleeps
    monkeypatch.undo()
    disk = make_tier("disk", src)
    try:
        d = read_limits(disk, src.meta, src.meta.num_layers, workers=4, n=8)
    finally:
        disk.close()
    assert d["at_queue_depth"]["queue_depth"] == 4 and d["one_at_a_time"]["GBps"] > 0, d  # small experts: whole


def test_a_budget_in_gib_buys_as_many_slots_as_fit(family_models):
    """`budget_gb`: the slots (k staging per pool included) fit the GiB given, per layer or in one global cache;
    a budget too small for one expert per layer is one line; decoding under it stays lossless."""
    model, path = family_models["qwen3_moe"]
    meta = read_store_meta(path)
    k, n_l = 2, meta.num_layers
    gib = (n_l * (3 + k) * meta.block_bytes + meta.block_bytes // 2) / 2**30  # 3 experts + 2 staging per layer
    m = _fresh("qwen3_moe")
    eng = offload(m, path, EngineConfig(budget_gb=gib, tier="host", kernel="native"))
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    try:
        assert eng.capacity == 3 and eng.fast_bytes <= gib * 2**30
        assert torch.equal(_greedy(m, prompt), _greedy(model, prompt))
    finally:
        eng.close()
    m = _fresh("qwen3_moe")
    eng = offload(m, path, EngineConfig(budget_gb=gib, budget="global", tier="host"))
    assert eng.capacity == (n_l * (3 + k) - k) // n_l and eng.fast_bytes <= gib * 2**30
    eng.close()
    with pytest.raises(InputError, match="budget_gb=.* holds 1 slots"):
        offload(_fresh("qwen3_moe"), path, EngineConfig(budget_gb=meta.block_bytes * 1.5 / 2**30, tier="host"))
    with pytest.raises(InputError, match="budget_gb=-1"):
        EngineConfig(budget_gb=-1).check()


def test_the_prefetch_guard_stops_a_predictor_that_does_not_pay_and_keeps_one_that_does(family_models):
    """A predictor starts in shadow (predicting, reading nothing) and prefetches only once its measured precision
    pays: a wrong one (it names experts the layer will not use) never reads an expert and ends paused; a right one
    (an oracle of the next layer's true choice) goes on and prefetches. Tokens are the same either way."""
    from expertcache.runtime.engine.stats import PrefetchGuard
    from expertcache.runtime.engine.predictors import Predictor

    g = PrefetchGuard(0.5, window=4, pause=3, first=4)
    assert g.step() == "shadow"
    g.outcome(1, 3)  # 25% in shadow: paused, then shadow again after the pause
    assert [g.step() for _ in range(4)] == ["paused", "paused", "paused", "shadow"] and g.pauses == 1
    g.outcome(4, 0)
    assert g.step() == "on"
    g.outcome(0, 4)
    assert g.step() == "paused" and g.paused_for == 2 and g.backoff == 2  # (a verdict that paid reset the backoff)
    g2 = PrefetchGuard(0.5, window=4, pause=3, first=4)
    for _ in range(2):  # failing again and again: each pause longer
        g2.outcome(0, 4)
        while g2.step() == "paused":
            pass
    assert g2.pauses == 2 and g2.backoff == 4
    assert PrefetchGuard(0).step() == "on"  # 0: no guard

    model, path = family_models["qwen3_moe"]
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))

    class Named(Predictor):  # names experts for layer + 1: the true ones (from a reference pass) or the others
        name = "named"

        def __init__(self, truth, right):
            self.truth, self.right, self.t = truth, right, {}

        def predict(self, layer, hidden, history):
            t = layer + 1
            if t not in self.truth or hidden.shape[0] != 1:
                return None
            i = self.t.get(t, 0)
            self.t[t] = i + 1
            true = self.truth[t][min(i, len(self.truth[t]) - 1)]
            s = torch.zeros(1, 8)
            s[0, [e for e in range(8) if (e in true) == self.right][:2]] = 1.0
            return s

    m = _fresh("qwen3_moe")
    eng = offload(m, path, EngineConfig(capacity=2, tier="host", prefetch_guard=0))
    truth = {}
    hook = [L.router.register_forward_hook(lambda mod, a, out, i=i: truth.setdefault(i, []).append(
        set(out[2][-1].tolist()))) for i, L in enumerate(eng.layers)]
    from expertcache.runtime.serve.generate import timed_greedy

    _, ref, _ = timed_greedy(m, prompt, 40, eng)
    for h in hook:
        h.remove()
    eng.close()
    truth = {i: v[1:] for i, v in truth.items()}  # decode steps only (the first entry is the prefill)
    for right in (False, True):
        m = _fresh("qwen3_moe")
        eng = offload(m, path, EngineConfig(capacity=2, tier="host"), predictor=Named(truth, right))
        # shadow at every token: Named answers by its own call count, and 40 tokens of sampled shadow (1 in 8) score
        # fewer experts than a verdict needs; the sampling is tested below
        eng.loads.guard = PrefetchGuard(0.5, shadow_every=1)
        _, out, st = timed_greedy(m, prompt, 40, eng)
        eng.close()
        assert torch.equal(out, ref)
        if right:
            assert eng.guard.state == "on" and st.prefetch_loads > 0 and st.prefetch_hits > 0, eng.guard.describe()
        else:
            assert st.prefetch_loads == 0 and st.prefetch_paused > 0, eng.guard.describe()


def test_a_predictor_in_shadow_runs_on_one_decode_token_in_shadow_every(family_models):
    """Issue 46: `lookahead:2` kept in shadow for a whole run (its predictions all resident, so never scored) ran
    1.12x on-demand from its own compute. In shadow it runs on every layer of one decode token in `shadow_every`,
    never in the prefill; a predictor whose predictions are scored (they name experts not resident) then runs on
    every decode token until its verdict (`hot`), so a good one is not kept waiting `shadow_every` times as long;
    on (guard 0), at every step."""
    from expertcache.runtime.engine.predictors import Predictor
    from expertcache.runtime.serve.generate import timed_greedy

    model, path = family_models["qwen3_moe"]
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))

    class Counted(Predictor):  # names experts 0..3 of the layer, or (`resident`) the ones it used last; records the
        name = "counted"  # engine's pass of each call

        def __init__(self, resident: bool = False):
            self.calls, self.resident = [], resident

        def predict(self, layer, hidden, history):
            self.calls.append((self.eng.loads.passes, layer, hidden.shape[0]))
            s = torch.zeros(hidden.shape[0], 8)
            if self.resident:
                s[:, list(history.get(layer + 1, []))] = 1.0  # the next layer's last choice (its cache)
            else:
                s[:, :4] = 1.0
            return s

    n_new, runs = 40, {}
    for guard, resident in ((0.5, True), (0.5, False), (0.0, False)):
        m = _fresh("qwen3_moe")
        pred = Counted(resident)
        eng = pred.eng = offload(m, path, EngineConfig(capacity=2, tier="host", prefetch_guard=guard), predictor=pred)
        eng.guard.first = 10**9  # no verdict: shadow the whole run (the case)
        _, out, st = timed_greedy(m, prompt, n_new, eng)
        eng.close()
        runs[guard, resident] = (pred.calls, eng.guard, out)
    layers = len(eng.layers)
    decode_passes = n_new - 1  # pass 1 is the prefill
    calls, g, out = runs[0.5, True]  # every prediction resident: never scored, sampled 1 in 8 the whole run
    assert g.state == "shadow" and g.shadow_every == 8 and g.judged == 0
    assert all(rows == 1 and p % 8 == 0 for p, _, rows in calls), calls  # decode tokens only, the sampled ones
    sampled = {p for p, _, _ in calls}
    assert len(calls) == len(sampled) * layers <= -(-decode_passes // 8) * layers and len(sampled) >= 4
    calls, g, out_scored = runs[0.5, False]  # scored: it also runs on the tokens right after a scored one
    assert g.state == "shadow" and g.judged > 0
    passes = sorted({p for p, _, _ in calls})
    assert all(rows == 1 for _, _, rows in calls) and passes[0] % 8 == 0
    assert all(p % 8 == 0 or p - 1 in passes for p in passes), passes  # sampled, or following a token that ran
    assert sum(p % 8 != 0 for p in passes) >= 2, passes  # and it did: more than one token in 8
    on_calls, g_on, out_on = runs[0.0, False]
    assert g_on.state == "on" and len(on_calls) == (decode_passes + 1) * layers  # on: every step, prefill too
    assert torch.equal(out, out_on) and torch.equal(out_scored, out_on)  # tokens are the same either way


def test_a_good_predictor_leaves_shadow_in_first_scored_experts_not_shadow_every_times_as_many_tokens():
    """The guard on its own: a predictor whose sampled predictions are scored keeps running on every decode token
    (its verdict after `first` scored experts); one whose predictions score nothing stays at one token in 8."""
    from expertcache.runtime.engine.stats import PrefetchGuard

    for scored, expect in ((True, "on"), (False, "shadow")):
        g = PrefetchGuard(0.5, first=32, shadow_every=8)
        ran = []
        for tok in range(1, 60):
            g.new_token()
            mode = g.step()
            if g.predicts(mode, tok, True):
                ran.append(tok)
                if mode == "shadow" and scored:
                    g.outcome(4, 1)  # 5 scored experts a token, 80% used
        assert g.state == expect
        if scored:  # sampled at token 8, then every token: 32 scored experts by token 14, on from there
            assert ran[:8] == list(range(8, 16)) and ran == list(range(8, 60))
        else:
            assert ran == list(range(8, 60, 8))


def test_per_token_figures_come_from_one_place():
    """`Stats.per_token` (what generate, serve, bench decode and bench big print) is `CacheResult.per_step` of
    the engine's counters, plus bytes moved and stall, over the tokens given."""
    from expertcache.runtime.engine.stats import Stats

    s = Stats(tokens=10, accesses=80, hits=60, demand_loads=20, prefetch_loads=5, stall_s=0.5, bytes_moved=2500,
              read_busy_s=0.625)
    d = s.per_token(expert_bytes=100)
    assert d["read_busy_per_token_s"] == 0.0625 and d["read_GBps_in_flight"] == 2500 / 0.625 / 1e9
    assert d["hit_rate"] == 0.75 and d["adjusted_hit_rate"] == 1 - 25 / 80
    assert d["demand_loads_per_token"] == 2.0 and d["prefetch_loads_per_token"] == 0.5
    assert d["misses_per_token"] == 2.0 and d["traffic_bytes_per_token"] == 250.0
    assert d["bytes_moved_per_token"] == 250.0 and d["stall_per_token_s"] == 0.05
    half = s.per_token(expert_bytes=100, tokens=20)  # the same counts over twice the tokens
    assert half["traffic_bytes_per_token"] == 125.0 and half["hit_rate"] == d["hit_rate"]
    assert s.to_dict(100)["stall_per_token_s"] == 0.05 and s.counters().per_step(100, "token") == \
        {k: d[k] for k in d if k not in ("bytes_moved_per_token", "stall_per_token_s", "read_busy_per_token_s",
                                         "read_GBps_in_flight")}
    assert Stats().per_token(100)["traffic_bytes_per_token"] == 0.0  # no tokens: zeros, not a division error


def test_probe_scores_by_the_familys_own_rule():
    """The probe predictor scores the next layer's experts as that family's router does: DeepSeek-V3's sigmoid,
    not a softmax (summed over a batch's rows, the two rank experts differently)."""
    from expertcache.telemetry.adapters import adapter_for

    m = _fresh("deepseek_v3")
    p = make_predictor("probe:1", m)
    a = adapter_for(m)
    h = torch.randn(3, m.config.hidden_size)
    layers = a.moe_layers(m)
    want = a.router_logits(layers[1].router, h).float().sigmoid()
    assert torch.allclose(p.predict(0, h, {}), want)


def test_a_probe_past_the_last_moe_layer_is_refused():
    """#21: a prefetch distance beyond the model's layers is one line, not a predictor that never predicts."""
    m = _fresh("qwen3_moe")  # 2 MoE layers
    assert make_predictor("probe:1", m).distance == 1
    with pytest.raises(InputError, match=r"probe:2 looks 2 MoE layers ahead; this model has 2, so at most probe:1"):
        make_predictor("probe:2", m)


def test_the_load_queue_runs_demand_loads_first_then_nearer_layers_and_never_a_cancelled_load():
    """Loads leave the queue lowest priority first (demand loads, URGENT, before any prefetch; a nearer layer's
    prefetch before a farther one's; first come first served among equals), and a load cancelled while queued never
    runs."""
    import threading

    from expertcache.runtime.storage.loadqueue import URGENT, LoadQueue

    q, ran, gate = LoadQueue(1), [], threading.Event()
    q.submit(gate.wait)  # holds the one worker while the rest queue up
    futs = {name: q.submit(ran.append, name, priority=p)
            for name, p in (("far", 9), ("near", 3), ("demand", URGENT), ("mid", 5), ("near2", 3), ("gone", 4))}
    assert futs["gone"].cancel()
    gate.set()
    q.shutdown(wait=True)
    assert ran == ["demand", "near", "near2", "mid", "far"]
    assert futs["gone"].cancelled() and all(f.done() for f in futs.values())
    with pytest.raises(RuntimeError, match="after shutdown"):
        q.submit(print)


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """A 4-MoE-layer qwen3_moe model and its store: room to look several layers ahead."""
    model = build_model(tiny_config("qwen3_moe", num_hidden_layers=4), seed=1).eval()
    path = tmp_path_factory.mktemp("deep") / "deep.store"
    write_store(model, path)
    return model, path


@pytest.mark.parametrize("budget", ["layer", "global"])
def test_lookahead_prefetches_several_layers_ahead_in_layer_order_each_expert_once(deep_model, budget):
    """`lookahead:3` predicts layers L+1..L+3 at each layer: each prefetch is queued behind the nearer layers' and
    a nearer prediction replaces a farther one. Every load a prefetch queued is counted once (loaded, dropped or
    cancelled), no expert of a layer is read twice in one forward pass, and the tokens are plain decode's; with a
    per-layer cache and with one global budget (where a prefetch's victim may be another layer's)."""
    model, path = deep_model
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    ref = _greedy(model, prompt, 16)
    m = build_model(tiny_config("qwen3_moe", num_hidden_layers=4), seed=1).eval()
    if budget == "layer":
        cfg = EngineConfig(capacity=3, tier="host", workers=1, prefetch_guard=0)
    else:
        b = read_store_meta(path).block_bytes
        cfg = EngineConfig(budget_gb=(4 * 5 * b + b // 2) / 2**30, budget="global", tier="host", workers=1,
                           prefetch_guard=0)
    eng = offload(m, path, cfg, predictor=make_predictor("lookahead:3", m))
    loads, queued, order = [], [], []
    load, submit = eng.loads.load, eng.pool_exec.submit

    def counted_load(pos, e, slot, pool=None):
        loads.append((eng.loads.passes, pos, e))
        return load(pos, e, slot, pool)

    def recorded_submit(fn, *args, priority=float("-inf")):
        if priority != float("-inf"):
            queued.append((eng.loads.passes, args[0]))
            order.append(priority)
        return submit(fn, *args, priority=priority)
    eng.loads.load, eng.pool_exec.submit = counted_load, recorded_submit
    try:
        out = _greedy(m, prompt, 16)
        st = eng.stats
    finally:
        eng.close()
    assert torch.equal(out, ref)
    assert len(loads) == len(set(loads)), "an expert was read twice for one layer in one pass"
    assert st.prefetch_loads + st.prefetch_dropped + st.prefetch_cancelled == len(queued)
    assert st.prefetch_loads > 0 and st.prefetch_hits > 0
    # loads were queued for layers up to 3 ahead, and their priority is their layer's place in the pass order
    assert any(t == 3 for _, t in queued)
    assert all(p == ps * 4 + t for p, (ps, t) in zip(order, queued))


def test_a_cancelled_prefetch_leaves_no_readable_slot(deep_model):
    """A prefetch that a nearer prediction no longer names is cancelled while queued: its slot is free again and
    nothing maps the expert to it; what was kept loads whole, and decode afterwards is plain decode's."""
    import threading

    model, path = deep_model
    m = build_model(tiny_config("qwen3_moe", num_hidden_layers=4), seed=1).eval()
    eng = offload(m, path, EngineConfig(capacity=4, tier="host", workers=1, prefetch_guard=0))
    gate = threading.Event()
    eng.pool_exec.submit(gate.wait)  # the one load thread is busy: the prefetches below stay queued
    try:
        eng.loads.prefetch(2, [0, 1, 2])
        slots = {e: eng.states[2].lookup(e) for e in (0, 1, 2)}
        assert None not in slots.values()
        eng.loads.prefetch(2, [1], supersede=True)  # the nearer prediction names only expert 1
        assert eng.stats.prefetch_cancelled == 2
        assert eng.states[2].lookup(0) is None and eng.states[2].lookup(2) is None
        assert set(eng.loads.pending[2]) == {1}
        gate.set()
        eng.loads.pending[2][1].result()
        got = eng.pools[2].views["down_proj"][slots[1]]  # the kept prefetch, whole
        assert torch.equal(got, model.model.layers[2].mlp.experts.down_proj[1].detach().to(got.dtype))
        prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(6))
        assert torch.equal(_greedy(m, prompt, 8), _greedy(model, prompt, 8))
    finally:
        gate.set()
        eng.close()


def test_a_lookahead_beyond_the_models_layers_is_refused():
    m = build_model(tiny_config("qwen3_moe", num_hidden_layers=4), seed=1).eval()
    with pytest.raises(InputError, match=r"lookahead:4 looks 4 MoE layers ahead; this model has 4, so at most "
                                         r"lookahead:3"):
        make_predictor("lookahead:4", m)
    with pytest.raises(InputError, match="lookahead"):
        make_predictor("lookahead:0", m)


def test_the_engines_slots_are_resident_before_the_first_load(family_models):
    """A slot's first write used to take its page faults inside the load, on the decode's time (a lone 9.4 MB miss
    into a fresh slot loaded at 0.4-0.6 GB/s beside a decode step, 2.4 GB/s into a touched one): the engine's pools
    are touched when they are made, so the memory is resident (and counted) from the start."""
    from expertcache.runtime.storage.store import read_store_meta
    from expertcache.runtime.storage.tiers import SlotPool

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    _, path = family_models["qwen3_moe"]
    meta = read_store_meta(path)
    n = max(1, (64 << 20) // meta.block_bytes)
    before = rss()
    cold = SlotPool(meta, n)
    mid = rss()
    hot = SlotPool(meta, n, touch=True)
    after = rss()
    size = n * meta.block_bytes
    assert mid - before < 0.1 * size and after - mid > 0.9 * size, (before, mid, after, size)
    m = _fresh("qwen3_moe")
    eng = offload(m, path, EngineConfig(capacity=2, tier="disk"))
    try:
        r0 = rss()
        eng.pools[0].raw.fill_(0)  # already resident: writing it faults nothing in
        assert rss() - r0 < 0.1 * eng.pools[0].raw.numel() + (1 << 20)
    finally:
        eng.close()
    del cold, hot
