"""The CPU kernels' prefetch distances, chosen per machine (`cpu_kernels.measure_prefetch`, `_apply_tuning`): a
setting changes a kernel's time, never its result; the choice is measured once, kept beside the build for this CPU,
read by later processes, and measured again for another CPU or on request; bad settings are refused."""

from __future__ import annotations

import json

import pytest
import torch

from expertcache.runtime.kernels import cpu_kernels as ck
from expertcache.runtime.bench.results import cpu_model
from expertcache.runtime.kernels import quant

pytestmark = pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.why_unavailable()}")


@pytest.fixture
def restore(monkeypatch):
    was = ck.set_tuning()
    monkeypatch.setattr(ck, "GEMM_PAIRS", dict(ck.GEMM_PAIRS))  # `_apply_tuning` sets this machine's thresholds
    yield was
    ck.set_tuning(**was)


@pytest.mark.parametrize("bits,group,sym", [(8, 32, False), (4, 32, False), (4, 32, True), (4, 128, False)])
def test_a_prefetch_setting_changes_no_result_bit(bits, group, sym, restore):
    g = torch.Generator().manual_seed(1)
    S, H, I = 6, 256, 128
    gu = quant.quantize((torch.randn(S, 2 * I, H, generator=g) * 0.05).bfloat16(), bits, group, sym)
    dn = quant.quantize((torch.randn(S, H, I, generator=g) * 0.05).bfloat16(), bits, group, sym)
    lin = quant.quantize((torch.randn(192, H, generator=g) * 0.05).bfloat16(), bits, group, sym)
    x = torch.randn(3, H, generator=g).bfloat16()
    slots, w = torch.tensor([[0, 5], [2, 3], [5, 1]]), torch.rand(3, 2, generator=g)
    outs = []
    for pf, rows in ((8192, 16), (0, 0), (2048, 16), (32768, 3)):
        ck.set_tuning(pf_int8=pf, pf_int4=pf, scale_rows=rows)
        outs.append((ck.swiglu_q(x, gu, dn, bits, group, slots, w),
                     ck.linear_q(x, lin["q"], lin["scales"], lin.get("mins"), bits, group)))
    for y, z in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(z, outs[0][1])
    assert ck.set_tuning()["pf_int8"] == 32768  # the settings did change


def test_set_tuning_refuses_distances_past_a_mebibyte(restore):
    with pytest.raises(RuntimeError, match="beyond 1 MiB"):
        ck.set_tuning(pf_int4=1 << 20)
    with pytest.raises(RuntimeError, match="beyond 1023"):
        ck.set_tuning(scale_rows=4096)
    assert ck.set_tuning() == restore  # nothing half-set


def _fake_measure(calls):
    def measure(**_):
        calls.append(1)
        best = {"distance": 2048, "scale_rows": 0}
        return {"int8": {"best": {"distance": 4096, "scale_rows": 16}}, "int4": {"best": best}}
    return measure


def _fake_gemm(**_):
    return {"int8": {"pairs": 20}, "int4": {"pairs": 40}}


def test_the_choice_is_measured_once_per_cpu_kept_beside_the_build_and_read_after(tmp_path, monkeypatch, restore):
    calls = []
    monkeypatch.setattr(ck, "measure_prefetch", _fake_measure(calls))
    monkeypatch.setattr(ck, "measure_gemm_pairs", _fake_gemm)
    monkeypatch.delenv("EXPERTCACHE_TUNE", raising=False)
    ck._apply_tuning(tmp_path)
    rec = json.loads((tmp_path / "tuning.json").read_text())
    assert calls == [1] and rec["cpu"] == cpu_model()
    assert rec["choice"] == {"pf_int8": 4096, "pf_int4": 2048, "scale_rows": 0}
    assert {k: ck.set_tuning()[k] for k in rec["choice"]} == rec["choice"]  # in force
    assert rec["gemm_pairs"] == {"int8": 20, "int4": 40} and ck.GEMM_PAIRS == {8: 20, 4: 40}
    ck.set_tuning(**restore)
    ck.GEMM_PAIRS.update({8: 16, 4: 32})
    ck._apply_tuning(tmp_path)  # a later process: reads, does not measure
    assert calls == [1] and ck.set_tuning()["pf_int4"] == 2048 and ck.GEMM_PAIRS == {8: 20, 4: 40}
    del rec["gemm_pairs"]  # a record from before the thresholds were measured: measured again
    (tmp_path / "tuning.json").write_text(json.dumps(rec))
    ck._apply_tuning(tmp_path)
    assert calls == [1, 1] and json.loads((tmp_path / "tuning.json").read_text())["gemm_pairs"]["int4"] == 40
    calls.pop()
    assert ck.tuning()["source"] == str(tmp_path / "tuning.json")
    rec["cpu"] = "another CPU"
    (tmp_path / "tuning.json").write_text(json.dumps(rec))
    ck._apply_tuning(tmp_path)  # another machine's record: measured again, for this one
    assert calls == [1, 1] and json.loads((tmp_path / "tuning.json").read_text())["cpu"] == cpu_model()
    monkeypatch.setenv("EXPERTCACHE_TUNE", "again")
    ck._apply_tuning(tmp_path)
    assert calls == [1, 1, 1]
    (tmp_path / "tuning.json").write_text("{not json")  # a damaged record: measured again, not an error
    monkeypatch.delenv("EXPERTCACHE_TUNE")
    ck._apply_tuning(tmp_path)
    assert calls == [1, 1, 1, 1]


def test_off_keeps_the_defaults_and_an_unknown_mode_is_one_warning(tmp_path, monkeypatch, restore):
    calls = []
    monkeypatch.setattr(ck, "measure_prefetch", _fake_measure(calls))
    monkeypatch.setattr(ck, "measure_gemm_pairs", _fake_gemm)
    monkeypatch.setenv("EXPERTCACHE_TUNE", "off")
    ck.set_tuning(pf_int8=1024)
    ck._apply_tuning(tmp_path)
    assert calls == [] and not (tmp_path / "tuning.json").exists() and ck.set_tuning()["pf_int8"] == 1024
    monkeypatch.setenv("EXPERTCACHE_TUNE", "sometimes")
    with pytest.warns(RuntimeWarning, match="EXPERTCACHE_TUNE='sometimes' is not one of on, off, again"):
        ck._apply_tuning(tmp_path)
    assert calls == [1]


def test_the_measurement_times_every_candidate_and_keeps_the_default_unless_another_is_faster(restore):
    m = ck.measure_prefetch(rounds=2, calls=2, pool=8)
    assert ck.set_tuning() == restore  # the settings it tried are undone
    for fmt in ("int8", "int4"):
        r = m[fmt]
        cands = {(c["distance"], c["scale_rows"]): c["s"] for c in r["candidates"]}
        assert {d for d, _ in cands} == set(ck.TUNE_DISTANCES) and all(s > 0 for s in cands.values())
        best = (r["best"]["distance"], r["best"]["scale_rows"])
        assert cands[best] == r["best_s"] and r["best_s"] <= r["default_s"]
        if best != (ck.TUNE_DEFAULTS[f"pf_{fmt}"], ck.TUNE_DEFAULTS["scale_rows"] if fmt == "int4" else best[1]):
            won = {(c["distance"], c["scale_rows"]): c["rounds_beating_default"] for c in r["candidates"]}
            assert r["best_s"] <= (1 - ck.TUNE_MARGIN) * r["default_s"] and won[best] >= ck.TUNE_WINS * r["rounds"]


def test_a_candidate_replaces_the_default_only_when_clearly_faster_in_the_median_and_round_by_round():
    d = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    lucky = [0.5, 0.5, 0.5, 1.1, 1.1, 1.1, 1.1][::-1]  # median 1.1: slower, though far faster in three rounds
    noisy = [0.8, 0.8, 0.8, 0.8, 1.1, 1.1, 1.1]  # median 0.8, but beats the default in 4 rounds of 7
    close = [0.97] * 7  # faster every round, by less than the margin
    clear = [0.85, 0.9, 0.88, 0.86, 0.9, 0.87, 1.01]  # 6 rounds of 7, median 0.88
    faster = [0.6, 0.65, 0.62, 0.7, 0.61, 0.63, 0.64]
    assert ck.choose({"d": d, "lucky": lucky, "noisy": noisy, "close": close}, "d")[0] == "d"
    assert ck.choose({"d": d, "noisy": noisy, "clear": clear}, "d")[0] == "clear"
    best, med, wins = ck.choose({"d": d, "clear": clear, "faster": faster}, "d")
    assert best == "faster" and wins == {"d": 0, "clear": 6, "faster": 7} and med["clear"] == 0.88


def test_the_gemm_threshold_is_where_the_gemm_wins_from_then_on():
    """`measure_gemm_pairs` times both paths at every candidate count of pairs, and keeps the smallest count from
    which the GEMM is within `GEMM_SLACK` of the kernel at every larger one (never, if not at the largest)."""
    m = ck.measure_gemm_pairs(rounds=1, experts=2)
    for fmt in ("int8", "int4"):
        c = m[fmt]["candidates"]
        assert [r["pairs"] for r in c] == list(ck.GEMM_CANDIDATES)
        assert all(r["kernel_s"] > 0 and r["gemm_s"] > 0 for r in c)
        wins = [r["gemm_s"] <= ck.GEMM_SLACK * r["kernel_s"] for r in c]
        expect = next((r["pairs"] for i, r in enumerate(c) if all(wins[i:])), ck.GEMM_NEVER)
        assert m[fmt]["pairs"] == expect
