"""Analysis figures on hand-made routing, the CLI end to end, and pinned numbers on the real Qwen3-30B-A3B traces."""

import json
import subprocess
import sys

import numpy as np
import pytest

from expertcache.telemetry.analysis import capacities, coverage, hit_curves, reuse_lag1
from expertcache.telemetry.cachesim import simulate
from expertcache.telemetry.llamacpp import import_trace
from expertcache.telemetry.parquet_trace import read_trace
from helpers import REPO

REF = REPO / "telemetry" / "reference" / "qwen3-30b-a3b-routing"


def test_reuse_and_chance_by_hand():
    ids = np.array([[0, 1], [1, 2], [2, 3], [0, 1]])
    seq = np.array([0, 0, 0, 1])  # the 4th token starts a new sequence: no pair with the 3rd
    pos = np.array([0, 1, 2, 0])
    r = reuse_lag1(ids, seq, pos, num_experts=4)
    assert r["reuse"] == pytest.approx(2 / 4)  # pairs (t1,t0): 1 of 2 reused; (t2,t1): 1 of 2
    p = np.array([2, 3, 2, 1]) / 4  # share of tokens selecting each expert
    assert r["chance"] == pytest.approx((p ** 2).sum() / p.sum())


def test_coverage_by_hand():
    ids = np.array([[0, 1]] * 9 + [[2, 3]])  # 20 accesses: experts 0, 1 take 45% each, 2 and 3 5% each
    c = coverage(ids, num_experts=8, levels=(0.5, 0.9, 0.95))
    assert c == {"0.5": 2 / 8, "0.9": 2 / 8, "0.95": 3 / 8}


def test_hit_curves_hold_out_the_static_fit_and_rank_belady_first():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.integers(0, 16, (400, 1)) for _ in range(2)])  # [layers, tokens, 1]
    ids = np.concatenate([ids, (ids + 1) % 16], axis=2)
    caps = capacities(16, (1 / 8, 1 / 4))
    rows = hit_curves(ids, 16, caps)
    for cap in caps:
        by = {r["policy"]: r for r in rows if r["capacity"] == cap}
        assert all(by[p]["hit_rate_per_layer"] <= by["belady"]["hit_rate_per_layer"] + 1e-12 for p in by)
        assert by["belady"]["of_belady_per_layer"] == 1.0
        assert by["lru"]["accesses"] == 2 * 320 * 2  # scored on the 80% after the fit part only


@pytest.mark.skipif(not (REF / "code.npz").is_file(), reason="the shipped reference traces are missing")
@pytest.mark.slow  # simulates the real Qwen3 traces (about 1.5 s)
def test_real_qwen3_traces_reproduce_published_numbers(tmp_path):
    import_trace(REF / "code.npz", tmp_path / "code.parquet", domain="code")
    ids, seq, pos = read_trace(tmp_path / "code.parquet").routing()
    assert ids.shape == (48, 8000, 8)
    layer = ids[24]
    published = {("lru", 17): 2.724375, ("lfu", 17): 3.195125, ("static", 17): 3.26475, ("belady", 17): 1.6705,
                 ("lru", 64): 0.284375, ("belady", 8): 3.548}
    for (pol, cap), miss in published.items():
        r = simulate(layer, cap, pol, "reference", fit=layer[:1600] if pol == "static" else None)
        assert r.misses_per_step == pytest.approx(miss, rel=0.02), (pol, cap, r.misses_per_step)
    # the README's headline: LRU 65.9%, Belady 79.1% hit rate at 17 experts (13.4%)
    assert simulate(layer, 17, "lru", "reference").hit_rate == pytest.approx(0.659, abs=0.002)
    assert simulate(layer, 17, "belady", "reference").hit_rate == pytest.approx(0.791, abs=0.002)
    # reuse@lag1 of layer 3 and experts for 90% coverage of layer 0, from stickiness.csv / working_set.csv
    assert reuse_lag1(ids[3], seq, pos, 128)["reuse"] == pytest.approx(0.3647018377297162, abs=1e-9)
    counts = np.sort(np.bincount(ids[0].reshape(-1), minlength=128))[::-1]
    assert int(np.searchsorted(np.cumsum(counts) / counts.sum(), 0.9) + 1) == 79


@pytest.mark.slow  # the whole CLI: simulate, summary and PNG plots (3-5 s)
def test_analyze_cli_writes_summary_and_plots(tmp_path):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 32, (3, 300, 1)).astype(np.int16)
    ids = np.concatenate([ids, (ids + 3) % 32], axis=2)
    np.savez(tmp_path / "t.npz", experts=ids, meta=json.dumps({"num_experts": 32, "model": "random"}))
    cli = [sys.executable, "-m", "expertcache.recipes.cli"]
    r = subprocess.run(cli + ["trace", "import", "--src", str(tmp_path / "t.npz"), "--out", str(tmp_path / "t.parquet"),
                              "--domain", "code"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(cli + ["analyze", "--trace", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "a")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "reuse@lag1" in r.stderr and "belady" in r.stderr  # the text summary; stdout is the JSON
    assert json.loads(r.stdout)["capacities"] == [1, 2, 4, 8, 16]
    assert (tmp_path / "a" / "config.yaml").is_file()  # the resolved configuration beside the outputs
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert s["capacities"] == [1, 2, 4, 8, 16] and s["routing"]["tokens"] == 300
    for png in ("hit_rate.png", "reuse_coverage.png"):
        assert (tmp_path / "a" / png).stat().st_size > 10_000
    r = subprocess.run(cli + ["analyze", "--trace", str(tmp_path / "missing.parquet"), "--out", str(tmp_path / "b")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_text_summary_leaves_out_lookahead_distances_a_model_cannot_have(tmp_path):
    """A 2-layer model has no lookahead at d=2: its NaN is left out of the text (it printed `d=2: nan`), and the
    recall is read against the k/E chance line; the plots still render."""
    from expertcache.telemetry.analysis import plot_summary, text_summary

    s = {"trace": "t.parquet", "model": "runs/x/model", "family": "qwen3_moe", "moe_layers": 2, "num_experts": 8,
         "top_k": 2, "phase": "decode", "semantics": "token", "static_fit": "held out", "capacities": [1, 2],
         "routing": {"tokens": 10, "reuse_lag1": {"reuse": 0.5, "chance": 0.25, "ratio": 2.0},
                     "coverage_mean": {"0.5": 0.25},
                     "per_layer": [{"layer": 0, "reuse": 0.5, "chance": 0.25, "coverage": {"0.5": 0.25}},
                                   {"layer": 1, "reuse": 0.6, "chance": 0.25, "coverage": {"0.5": 0.3}}]},
         "hit_curves": [{"policy": p, "capacity": c, "capacity_frac": c / 8, "hit_rate_per_layer": 0.5,
                         "hit_rate_global": 0.5} for p in ("lru", "lfu", "static", "belady") for c in (1, 2)],
         "lookahead_recall": {"1": {"mean": 0.7}, "2": {"mean": float("nan")}}}
    text = text_summary(s)
    assert "d=1: 0.700" in text and "d=2" not in text and "chance k/E = 0.250" in text
    plot_summary(s, tmp_path)
    assert all((tmp_path / f).stat().st_size > 10_000 for f in ("reuse_coverage.png", "hit_rate.png",
                                                                  "lookahead_recall.png"))
