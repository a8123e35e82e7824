"""The learned eviction policy: reaches Belady where the future is predictable, is refused on another model's
shape, loads without executing code, and the simulator counts what the cache state machine does with it."""

import json
import pickle

import numpy as np
import pytest

from expertcache.runtime.engine.layer_view import LayerView
from expertcache.telemetry.cache import CacheState
from expertcache.telemetry.cachesim import simulate
from expertcache.telemetry.errors import InputError
from expertcache.telemetry.learned_policy import FEATURES, LearnedPolicy, fit, simulate_learned


def periodic(n_layers=2, tokens=1200, e=12, k=2, period=6, phase=0, seed=0):
    """Every layer cycles through `period` disjoint sets of k experts (a per-layer permutation of the ids)."""
    rng = np.random.default_rng(seed)
    ids = np.empty((n_layers, tokens, k), np.int16)
    for layer in range(n_layers):
        perm = rng.permutation(e)
        for t in range(tokens):
            j = (t + phase) % period
            ids[layer, t] = perm[j * k:(j + 1) * k]
    return ids


def save_npz(path, ids, e, model="toy"):
    np.savez(path, experts=ids, meta=json.dumps({"model": model, "num_experts": e}))
    return path


def random_trace(n_layers=3, tokens=300, e=16, k=4, seed=1):
    rng = np.random.default_rng(seed)
    ids = np.empty((n_layers, tokens, k), np.int16)
    for layer in range(n_layers):
        prev = rng.choice(e, k, replace=False)
        for t in range(tokens):
            keep = [x for x in prev if rng.random() < 0.5]
            rest = rng.choice([x for x in range(e) if x not in keep], k - len(keep), replace=False)
            prev = np.array(keep + list(rest))
            ids[layer, t] = prev
    return ids


@pytest.fixture(scope="module")
def toy_policy(tmp_path_factory):
    d = tmp_path_factory.mktemp("lp")
    ids = random_trace()
    pol = fit([save_npz(d / "fit.npz", ids, 16)], epochs=2, rows_per_step=6, max_rank=12)
    pol.save(d / "toy.safetensors")
    return d / "toy.safetensors"


@pytest.mark.slow  # fits a policy on a periodic trace (2-4 s)
def test_periodic_routing_reaches_belady(tmp_path):
    """A loop of 3 disjoint expert sets per layer with room for 2 of them: LRU always evicts the set needed next
    (0 hits); Belady keeps the two used soonest and hits 2 steps of 3.
    Fitted on one permutation of the ids, scored on others."""
    for e, k, cap in ((8, 2, 4), (12, 3, 6)):
        fit_on = save_npz(tmp_path / f"fit{e}.npz", periodic(e=e, k=k, period=3, seed=0), e)
        fit([fit_on], epochs=3).save(tmp_path / f"p{e}.safetensors")
        pol = LearnedPolicy.load(tmp_path / f"p{e}.safetensors", num_experts=e, top_k=k)
        test = periodic(e=e, k=k, period=3, seed=5, phase=1, tokens=600)
        got = simulate_learned(pol, test.astype(np.int64), [cap])[cap]["hits"]
        lru = sum(simulate(test[i], cap, "lru").hits for i in range(test.shape[0]))
        bel = sum(simulate(test[i], cap, "belady").hits for i in range(test.shape[0]))
        assert lru == 0 and bel > 0.6 * test.size  # 2 of every 3 steps (the third streams through)
        assert got == bel


def test_other_shape_is_refused(toy_policy, tmp_path):
    with pytest.raises(InputError, match="fitted on 16 experts top-4"):
        LearnedPolicy.load(toy_policy, num_experts=128, top_k=8)
    pol = LearnedPolicy.load(toy_policy)
    with pytest.raises(InputError, match="routes 16 experts top-2"):
        pol.check_shape(16, 2)
    from expertcache.telemetry.analysis import analyze
    from expertcache.telemetry.llamacpp import import_trace

    import_trace(save_npz(tmp_path / "other.npz", periodic(e=12, k=2, tokens=50), 12), tmp_path / "other.parquet")
    with pytest.raises(InputError, match="fitted on 16 experts top-4.*routes 12 experts top-2"):
        analyze(tmp_path / "other.parquet", tmp_path / "an", policy_file=str(toy_policy), by_domain=False)
    with pytest.raises(InputError, match="one policy fits one model"):
        fit([tmp_path / "other.npz", save_npz(tmp_path / "r.npz", random_trace(), 16)])


def test_loading_executes_no_code(toy_policy, tmp_path, monkeypatch):
    raw = toy_policy.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])  # safetensors: a JSON header, then raw tensor bytes
    md = header["__metadata__"]
    assert md["kind"] == "expertcache-learned-policy"
    meta = json.loads(md["policy"])
    assert (meta["num_experts"], meta["top_k"], meta["features"]) == (16, 4, list(FEATURES))
    assert meta["traces"][0]["path"].endswith("fit.npz")

    def refuse(*a, **kw):
        raise AssertionError("unpickling while loading a policy")
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    LearnedPolicy.load(toy_policy)
    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(InputError):
        LearnedPolicy.load(evil)


@pytest.mark.slow  # simulates every policy step (about 1 s)
def test_simulator_equals_cache_state(toy_policy):
    ids = random_trace(seed=7).astype(np.int64)
    n_l, n_t, k = ids.shape
    pol = LearnedPolicy.load(toy_policy, num_layers=n_l)
    for cap in (4, 6):
        sim = simulate_learned(pol, ids, [cap])[cap]["hits"]
        sim_g = simulate_learned(pol, ids, [cap], budget="global")[cap]["hits"]
        scorer = LearnedPolicy.load(toy_policy, num_experts=16, top_k=k, num_layers=n_l)  # what the runtime holds
        states = [CacheState(cap, k, "scored") for _ in range(n_l)]
        g = CacheState(cap * n_l, k, "scored")
        views = [LayerView(g, i * 16, n_l * 16) for i in range(n_l)]
        hits = hits_g = 0
        for t in range(n_t):
            for i in range(n_l):
                step = ids[i, t].tolist()
                scores = scorer(i, None, step)  # the engine's keep_scores(pos, hidden, ids)
                for st, v in ((states[i], None), (None, views[i])):
                    c = st or v
                    misses = [e for e in step if c.lookup(e) is None]
                    if st is not None:
                        hits += len(step) - len(misses)
                    else:
                        hits_g += len(step) - len(misses)
                    c.retain(step, c.stage(misses), scores)
        assert (hits, hits_g) == (sim, sim_g)
        scorer.reset()
        assert scorer._states == {}


@pytest.mark.slow  # the fit and analyze CLI end to end (about 2 s)
def test_cli_fit_and_analyze_rows(tmp_path, capsys):
    from expertcache.recipes.cli import main
    from expertcache.telemetry.cachesim import simulate_scored
    from expertcache.telemetry.llamacpp import import_trace

    ids = random_trace(seed=3)
    import_trace(save_npz(tmp_path / "t.npz", ids, 16), tmp_path / "t.parquet")
    u = save_npz(tmp_path / "u.npz", random_trace(seed=4), 16)
    assert main(["fit-policy", "--trace", json.dumps([str(tmp_path / "t.parquet"), str(u)]), "--out",
                 str(tmp_path / "p.safetensors"), "--epochs", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["num_experts"] == 16
    assert main(["analyze", "--trace", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "an"), "--domains",
                 "false", "--policy_file", str(tmp_path / "p.safetensors")]) == 0
    s = json.loads((tmp_path / "an" / "summary.json").read_text())
    rows = [r for r in s["hit_curves"] if r["policy"] == "learned"]
    assert [r["capacity"] for r in rows] == s["capacities"]
    for r in rows:
        bel = next(x for x in s["hit_curves"] if x["policy"] == "belady" and x["capacity"] == r["capacity"])
        assert r["hit_rate_per_layer"] <= bel["hit_rate_per_layer"] + 1e-12
        assert r["of_belady_per_layer"] == pytest.approx(r["hit_rate_per_layer"] / bel["hit_rate_per_layer"])
        assert r["of_belady_global"] is not None
    assert "learned" in (tmp_path / "an" / "summary.txt").read_text()
    assert main(["analyze", "--trace", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "an2"), "--domains",
                 "false", "--policy_file", str(tmp_path / "missing.safetensors")]) == 2
    # the scored path reads keep scores from an array or one row at a time alike
    pol = LearnedPolicy.load(tmp_path / "p.safetensors")
    keep = np.asarray(list(pol.keep_stream(ids.astype(np.int64), 1)))
    a = simulate_scored(ids[1], 5, keep)
    b = simulate_scored(ids[1], 5, pol.keep_stream(ids.astype(np.int64), 1))
    assert (a.hits, a.loads) == (b.hits, b.loads)


@pytest.mark.parametrize("with_probs", [False, True])
def test_batched_keep_scores_equal_the_step_by_step_scorer(toy_policy, with_probs):
    """keep_chunks (all layers at once, MLP in batches) gives the scores the runtime's per-step scorer gives."""
    ids = random_trace(seed=9).astype(np.int64)
    n_l, n_t, k = ids.shape
    probs = np.random.default_rng(2).random(ids.shape) if with_probs else None
    pol = LearnedPolicy.load(toy_policy, num_layers=n_l)
    pol.uses_probs = with_probs
    batched = np.concatenate([s for _, s in pol.keep_chunks(ids, probs, chunk=37)])  # [T, L, E]
    scorer = LearnedPolicy.load(toy_policy, num_layers=n_l)
    scorer.uses_probs = with_probs
    for t in range(n_t):
        for i in range(n_l):
            row = scorer(i, None, ids[i, t], None if probs is None else probs[i, t])
            np.testing.assert_allclose(batched[t, i], row, rtol=0, atol=1e-12)
