"""The benchmarks' own logic, on tiny inputs (no timing: what a benchmark measures is asserted by counts and by
the rules it applies): bench big's systems, formats, claims, failures, roofline and memory cgroup, and bench
decode's claim rule. Moved out of tests/test_cpu_kernels.py, which tests the kernels."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from expertcache.runtime.kernels import quant, quant_write
from expertcache.telemetry.errors import InputError

_MMAP_ROW = {"runs": 1, "errors": [], "tpot_median_s": 0.3, "tpot_p90_s": 0.4, "tpot_mean_s": 0.3,
             "tokens_per_s": 3.3, "peak_rss_bytes": 1, "disk_read_bytes_per_token": 1.0}


def test_bench_big_serves_each_format_against_the_same_byte_budget(tmp_path):
    """`bench big --experts [bf16,int4]`: one expertcache system per format, the peers once; a quantized copy's
    slot is its store block (packed bytes), so the same budget buys about 3x the int4 slots."""
    from expertcache.runtime.bench import bigbench
    from tiny_models import build_model, tiny_config

    assert bigbench.system_names(["expertcache:on-demand", "mmap"], ("bf16", "int4")) == [
        "expertcache:on-demand", "expertcache:on-demand:int4", "mmap"]
    src = tmp_path / "src"
    build_model(tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64, intermediate_size=64),
                seed=7, dtype=torch.bfloat16).save_pretrained(src)
    q = bigbench.quantized_path(src, "int4")
    quant_write.write_quantized(src, q, 4, bigbench.QUANT_GROUP)
    from expertcache.runtime.storage.store import read_store_meta

    assert bigbench._slot_bytes(q) == read_store_meta(q / quant.EXPERTS_FILE).block_bytes
    assert bigbench._slot_bytes(src) == bigbench.expert_bytes() + bigbench.ALIGN  # the bf16 checkpoint's


def test_bench_big_systems_carry_engine_options_and_formats():
    """`expertcache:on-demand/victims=false`: that row serves with those options over --engine's (a value may be a
    path with slashes); the format goes before the options; a peer takes none; the packed-linears copy has its own
    folder."""
    from expertcache.runtime.bench import bigbench
    from expertcache.runtime.engine.engine import EngineConfig

    base = EngineConfig(tier="disk", policy="lfu")
    cfg = bigbench.system_engine("expertcache:on-demand/victims=false/policy=learned:/a/b=c/p.safetensors", base)
    assert (cfg.victims, cfg.policy, cfg.tier) == (False, "learned:/a/b=c/p.safetensors", "disk")
    assert bigbench.system_engine("expertcache:prefetch", base) is base
    assert bigbench.system_engine("expertcache:prefetch/predictor=persistence", base).predictor == "persistence"
    assert bigbench.system_names(["expertcache:on-demand/victims=false", "mmap"], ("bf16", "int4")) == [
        "expertcache:on-demand/victims=false", "expertcache:on-demand:int4/victims=false", "mmap"]
    assert bigbench.parse_system("expertcache:on-demand:int4/victims=false") == (
        "expertcache:on-demand", "int4", {"victims": "false"})
    for bad, why in [("expertcache:on-demand/victims=maybe", "true or false"), ("mmap/victims=false", "only"),
                     ("expertcache:on-demand/zzz=1", "not an engine option"),
                     ("expertcache:on-demand/victims", "not an engine option"),
                     ("expertcache:on-demand/capacity=4", "set by bench big"),
                     ("expertcache:on-demand/predictor=persistence", "set by bench big")]:
        with pytest.raises(InputError, match=why):
            bigbench.system_engine(bad, base)
    from pathlib import Path

    assert bigbench.quantized_path(Path("/x/ck"), "int4", True).name == "ck-int4-g32-linears"


def _bench_big_returns(monkeypatch, res):
    """`bench big`'s runs replaced by `res` (what the command does with a result is under test, not the runs)."""
    from expertcache.runtime.bench import bigbench

    monkeypatch.setattr(bigbench, "bench_big", lambda *a, **kw: res)
    monkeypatch.setattr(bigbench, "plot", lambda res, png: None)


def test_bench_big_exits_1_when_a_system_it_ran_failed(tmp_path, monkeypatch, capsys):
    """A system asked for that failed is not a success: exit 1, one stderr line naming it, the reason in the JSON."""
    from expertcache.recipes.cli import main

    _bench_big_returns(monkeypatch, {"inputs": {}, "systems": {
        "expertcache:on-demand": {"runs": 1, "errors": ["exit 1; see x.log"]}, "mmap": _MMAP_ROW}})
    out = tmp_path / "b.json"
    assert main(["bench", "big", "--out_dir", str(tmp_path / "d"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "1 system(s) failed: expertcache:on-demand: exit 1; see x.log" in err
    written = json.loads(out.read_text())
    assert written["ok"] is False
    # the one result writer: provenance, the command's resolved configuration, the line that re-runs it
    assert written["provenance"]["commit"] and written["provenance"]["machine"]["cores"] == os.cpu_count()
    assert written["config"]["systems"][:2] == ["expertcache:on-demand", "expertcache:prefetch"]
    # (no machine's folders in a result: a path outside the repository keeps its last name)
    assert written["config"]["engine"]["tier"] == "disk" and written["config"]["out"] == f".../{out.name}"
    assert written["command"] == f"expertcache bench big --out_dir .../d --out .../{out.name}"


def test_bench_big_exits_1_when_a_prefill_it_ran_failed(tmp_path, monkeypatch, capsys):
    """#47: a prefill killed in the cgroup is a failure too, even when every decode round ran (the 48-layer run's
    2,048-token prefills were killed and its JSON said ok)."""
    from expertcache.recipes.cli import main

    row = {**_MMAP_ROW, "prefill": [{"prompt_tokens": 2048, "runs": 1, "errors": ["exit -9 (killed)"]}]}
    _bench_big_returns(monkeypatch, {"inputs": {}, "systems": {"mmap": row}})
    out = tmp_path / "b.json"
    assert main(["bench", "big", "--systems", "[mmap]", "--out_dir", str(tmp_path / "d"), "--out", str(out)]) == 1
    assert "1 system(s) failed: mmap: prefill 2048: exit -9 (killed)" in capsys.readouterr().err
    assert json.loads(out.read_text())["ok"] is False


def test_bench_big_says_which_systems_it_skipped_and_exits_1(tmp_path, monkeypatch, capsys):
    """A skipped system (llama.cpp whose build failed) is not a success either: one stderr line each, exit 1, the
    reason in the JSON."""
    from expertcache.recipes.cli import main

    why = "llama.cpp build failed: exit 1: CMake Error: no CMakeLists.txt"
    _bench_big_returns(monkeypatch, {"inputs": {}, "skipped": {"llama.cpp": why}, "systems": {
        "llama.cpp": {"runs": 0, "errors": [], "skipped": why}, "mmap": _MMAP_ROW}})
    out = tmp_path / "b.json"
    assert main(["bench", "big", "--routing", "native", "--systems", "[llama.cpp,mmap]", "--out_dir",
                 str(tmp_path / "d"), "--out", str(out)]) == 1
    assert f"bench big: skipped llama.cpp: {why}" in capsys.readouterr().err.splitlines()
    res = json.loads(out.read_text())
    assert res["ok"] is False and res["systems"]["llama.cpp"]["skipped"] == why


def test_bench_big_claims_a_ratio_only_where_the_rounds_do_not_overlap():
    from expertcache.runtime.bench.bigbench import comparisons

    rows = {"expertcache:on-demand": {"tpot_round_medians_s": [0.50, 0.52, 0.55]},
            "expertcache:prefetch": {"tpot_round_medians_s": [0.49, 0.56, 0.51]},
            "mmap": {"tpot_round_medians_s": [1.4, 1.5, 1.6]},
            "mmap:unbounded": {"tpot_round_medians_s": [0.45, 0.60, 0.70]},
            "accelerate": {"errors": ["exit 1"]}}  # a failed system is compared with nothing
    c = comparisons(rows)
    assert set(c) == {"expertcache:on-demand vs mmap", "expertcache:on-demand vs mmap:unbounded",
                      "expertcache:prefetch vs mmap", "expertcache:prefetch vs mmap:unbounded",
                      "expertcache:prefetch vs expertcache:on-demand"}
    assert c["expertcache:on-demand vs mmap"]["claimed"] and abs(c["expertcache:on-demand vs mmap"]["ratio"] -
                                                                 0.52 / 1.5) < 1e-12
    assert not c["expertcache:on-demand vs mmap:unbounded"]["claimed"]  # 0.45..0.70 overlaps 0.50..0.55
    assert not c["expertcache:prefetch vs expertcache:on-demand"]["claimed"]
    two = comparisons({"expertcache:on-demand": {"tpot_round_medians_s": [0.5, 0.5]},
                       "mmap": {"tpot_round_medians_s": [1.0, 1.0]}})
    assert not two["expertcache:on-demand vs mmap"]["claimed"]  # apart, but 2 rounds claim nothing


def test_bench_big_checks_a_prefetch_rows_predictor_before_anything_runs(tmp_path, capsys):
    """A trace's own predictor (cooccurrence, oracle[:recall]) serves the trace-routing rows only; a live one is
    checked as everywhere; either is one line and exit 2 before the checkpoint is written."""
    from expertcache.recipes.cli import main
    from expertcache.runtime.bench.bigbench import check_system
    from expertcache.runtime.engine.engine import EngineConfig
    from expertcache.telemetry.errors import InputError

    base = EngineConfig(tier="disk")
    for ok in ("expertcache:prefetch/predictor=oracle", "expertcache:prefetch/predictor=oracle:0.5",
               "expertcache:prefetch/predictor=cooccurrence", "expertcache:prefetch/predictor=probe:2",
               "expertcache:on-demand"):
        check_system(ok, base, "trace")
    check_system("expertcache:prefetch/predictor=probe:2", base, "native")
    with pytest.raises(InputError, match="reads the routing trace; with --routing native there is none"):
        check_system("expertcache:prefetch/predictor=oracle", base, "native")
    with pytest.raises(InputError):
        check_system("expertcache:prefetch/predictor=orakel", base, "trace")
    assert main(["bench", "big", "--routing", "native", "--systems", "[expertcache:prefetch/predictor=oracle]",
                 "--out_dir", str(tmp_path / "d"), "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "predictor oracle reads the routing trace" in err[0]
    assert not (tmp_path / "d").exists()


def test_bench_big_refuses_an_unknown_routing_before_writing_anything(tmp_path, capsys):
    from expertcache.recipes.cli import main

    assert main(["bench", "big", "--routing", "forced", "--out_dir", str(tmp_path / "d"),
                 "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--routing 'forced'; expected one of: trace, native" in err[0]
    assert not (tmp_path / "d").exists()


def test_bench_big_refuses_a_prompt_beyond_the_checkpoints_context_before_writing_anything(tmp_path, capsys):
    """#47: a prompt longer than the checkpoint's 4,096 positions is one line before the checkpoint is written; the
    longest that fits runs past the check (refused later, here, only by its empty systems list)."""
    from expertcache.recipes.cli import main

    base = ["bench", "big", "--out_dir", str(tmp_path / "d"), "--out", str(tmp_path / "b.json"), "--tokens", "8",
            "--warmup", "0", "--accelerate_tokens", "8", "--accelerate_warmup", "0"]
    assert main([*base, "--prompt_len", "4089"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prompt_len 4089" in err[0] and "4097 positions" in err[0] and "4096" in err[0], err
    assert not (tmp_path / "d").exists()
    assert main([*base, "--prompt_len", "4088", "--systems", "[]"]) == 2
    err = capsys.readouterr().err
    assert "prompt_len" not in err and "no system to run" in err, err


def test_a_memory_cgroup_bounds_a_childs_page_cache(tmp_path):
    """What `bench big` relies on for equal memory: a child in the cgroup reads 3x the limit through mmap and the
    cgroup's peak (its resident memory and page cache) stays at the limit. Needs root and a memory controller."""
    from expertcache.runtime.bench.memcg import MemoryCgroup

    cg, why = MemoryCgroup.create(48 << 20, f"expertcache-test-{os.getpid()}")
    if cg is None:
        pytest.skip(why)
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(144):
            f.write(os.urandom(1 << 20))
    code = ("import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
            "print(sum(m[i] for i in range(0, len(m), 4096)))")
    try:
        cg.reset_peak()
        r = subprocess.run([sys.executable, "-c", code, str(big)], preexec_fn=cg.preexec, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        assert 0 < cg.peak_bytes() <= (48 << 20) + (1 << 20)
    finally:
        cg.close()


def test_bench_decode_marks_a_ratio_to_on_demand_its_rounds_cannot_carry():
    """The quickstart's decode table printed probe:1 at 1.17x on-demand with the guard paused the whole run (no
    prefetch read: identical work); three re-runs of 10 rounds read 1.19x, 0.82x and 1.02x. A ratio whose round
    medians overlap on-demand's is printed as noise, and only apart rounds (>= 3) claim one."""
    from expertcache.runtime.bench.bench import table
    from expertcache.runtime.bench.harness import claimed as rounds_apart

    assert rounds_apart([1.0, 1.1, 1.2], [1.3, 1.4, 1.5]) and not rounds_apart([1.0, 1.4, 1.2], [1.3, 1.5, 1.6])
    assert not rounds_apart([1.0, 1.1], [2.0, 2.1])  # two rounds claim nothing
    row = {"tpot_median_s": 0.0027, "tpot_p90_s": 0.0035, "tokens_per_s": 370.0, "greedy_tokens_equal_plain": True}
    res = {"configs": {"on-demand@0.25": dict(row, tpot_median_s=0.0023),
                       "probe:1+blocking@0.25": dict(row, vs_on_demand=1.171, vs_on_demand_claimed=False),
                       "lookahead:3+blocking@0.25": dict(row, vs_on_demand=0.700, vs_on_demand_claimed=True)}}
    lines = table(res).splitlines()
    assert "| 1.171 (rounds overlap: noise) |" in lines[3] and "| 0.700 |" in lines[4], lines


def test_bench_decode_table_shows_prefetches_beside_ratios_and_flags_x_plain_by_the_same_rule():
    """Issue 46: `lookahead:2` ran 1.12x on-demand having issued no prefetch, which only the JSON showed. Every row
    shows the prefetches issued and used per token beside its ratios, and "× plain" carries the noise flag of
    "× on-demand" (one rule: `harness.claimed`)."""
    from expertcache.runtime.bench.bench import table
    from expertcache.runtime.bench.harness import claimed as rounds_apart

    row = {"tpot_median_s": 0.011, "tpot_p90_s": 0.012, "tokens_per_s": 90.0, "greedy_tokens_equal_plain": True}
    plain_r, od_r, la_r = [0.0100, 0.0102, 0.0101], [0.0130, 0.0135, 0.0128], [0.0131, 0.0125, 0.0140]
    od = dict(row, vs_plain=1.3, vs_plain_claimed=rounds_apart(od_r, plain_r), prefetch_loads_per_token=0.0,
              prefetch_hits_per_token=0.0)
    la = dict(row, vs_plain=1.31, vs_plain_claimed=rounds_apart(la_r, plain_r), vs_on_demand=1.008,
              vs_on_demand_claimed=rounds_apart(la_r, od_r), prefetch_loads_per_token=1.5,
              prefetch_hits_per_token=0.75)
    noisy = dict(la, vs_plain=1.02, vs_plain_claimed=rounds_apart([0.0099, 0.0105, 0.0103], plain_r))
    res = {"configs": {"plain": dict(row, vs_plain=1.0), "on-demand@0.0625": od, "lookahead:2+blocking@0.0625": la,
                       "x@0.0625": noisy}}
    lines = table(res).splitlines()
    head = [c.strip() for c in lines[0].split("|")]
    assert head.index("prefetched/tok (used)") == head.index("× on-demand") + 1
    cells = [[c.strip() for c in line.split("|")] for line in lines[2:]]
    col = lambda name: head.index(name)  # noqa: E731
    assert [c[col("× plain")] for c in cells] == ["1.000", "1.300", "1.310", "1.020 (rounds overlap: noise)"]
    assert [c[col("× on-demand")] for c in cells] == ["—", "—", "1.008 (rounds overlap: noise)",
                                                      "1.008 (rounds overlap: noise)"]
    assert [c[col("prefetched/tok (used)")] for c in cells] == ["—", "0.00 (0.00)", "1.50 (0.75)", "1.50 (0.75)"]


@pytest.mark.slow  # a bench big child process (2-5 s)
def test_a_bench_big_process_that_fails_returns_its_last_line_not_a_traceback(tmp_path):
    """`run_process` (the runner's child process, which runs every round of a system of bench big's own): a run
    that fails in its own process comes back as one error naming its exit status, its log and the log's last
    line. Its run configuration crosses as a YAML file, read back and checked once (a key nothing reads is one
    line)."""
    from expertcache.runtime.bench.bigbench import load_run_config, run_process, write_run_config
    from expertcache.runtime.engine.engine import EngineConfig

    job = {"ckpt": str(tmp_path / "absent"), "trace": "x.npz", "budget_gb": 8.0, "tokens": 1, "warmup": 0,
           "prompt_len": 1, "start": 2000}
    cfg = write_run_config(tmp_path / "one.run.yaml", "expertcache:on-demand/victims=false", job,
                           EngineConfig(tier="disk", policy="lfu"))
    back = load_run_config(cfg)
    assert back["engine"] == EngineConfig(tier="disk", policy="lfu", victims=False)  # the name's options resolved
    assert {k: back[k] for k in job} == job and back["system"] == "expertcache:on-demand/victims=false"
    r = run_process(cfg, tmp_path / "one.log")
    assert set(r) == {"error", "page_cache_dropped"} and r["error"].startswith("exit 1; see ")
    assert str(tmp_path / "one.log") in r["error"]
    last = (tmp_path / "one.log").read_text().strip().splitlines()[-1]
    assert r["error"].endswith(last[:300]) and "absent" in last
    (tmp_path / "bad.run.yaml").write_text(cfg.read_text() + "tokenz: 3\n")
    with pytest.raises(InputError, match=r"unknown keys \['tokenz'\]"):
        load_run_config(tmp_path / "bad.run.yaml")


def test_a_failed_bench_big_run_says_why_in_its_error(tmp_path):
    """An out-of-memory kill leaves no message of its own: a failed run's error quotes the last line its log holds
    (the run writes what loading left resident and the cache's size there first); the progress line names the run
    and its TPOT or error."""
    from expertcache.runtime.bench import bigbench

    log = tmp_path / "expertcache-on-demand-round0.log"
    log.write_text("expertcache:on-demand: resident after loading 2.08 GiB + cache slots 5.93 GiB (streaming buffers "
                   "and activations come on top), budget 8.00 GiB (over the budget: a cgroup of this size will kill "
                   "the run as its cache fills)\n\n")
    from expertcache.runtime.bench.runner import last_line

    assert last_line(log).startswith("expertcache:on-demand: resident after loading 2.08 GiB")
    assert last_line(tmp_path / "absent.log") == ""
    log.write_text("x" * 1000)
    assert len(last_line(log)) == 300
    assert bigbench._done("mmap", 0, 3, {"tpot_median_s": 0.2871}) == "mmap round 1/3: 0.287 s/token"
    assert bigbench._done("mmap", 2, 3, {"error": "exit -9"}) == "mmap round 3/3: exit -9"
    from expertcache.telemetry.memory import rss_bytes

    before = rss_bytes()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert rss_bytes() - before > 48 << 20
    del block


def test_bench_big_roofline_bounds_a_token_by_its_compute_and_its_reads():
    """The physical limit of a `bench big` configuration: compute is the time budget without its stall, reads the
    bytes moved over the disk's measured queue-depth bandwidth; the bound is the larger, overlap efficiency the
    bound over TPOT (METRICS.md), and a bound above TPOT is flagged, not reported as an efficiency over 1."""
    from expertcache.runtime.bench.bigbench import roofline, table

    budget = {"expert_compute": 0.05, "stall": 0.10, "other_compute": 0.04, "overhead": 0.01, "tpot": 0.20}
    r = roofline(budget, 400e6, 4.0)
    assert r["t_compute_s"] == pytest.approx(0.10) and r["t_transfer_s"] == pytest.approx(0.10)
    assert r["bound_s"] == pytest.approx(0.10) and r["no_overlap_s"] == pytest.approx(0.20)
    assert r["overlap_efficiency"] == pytest.approx(0.5) and not r["roofline_unreliable"]
    fast = roofline(dict(budget, stall=0.0, tpot=0.09), 800e6, 4.0)  # reads alone (0.2 s) exceed the TPOT
    assert fast["overlap_efficiency"] == 1.0 and fast["roofline_unreliable"]
    row = {"tpot_median_s": 0.2, "tpot_round_medians_s": [0.2], "tpot_p90_s": 0.3, "peak_rss_bytes": 2**30,
           "cgroup_peak_bytes": None, "disk_read_bytes_per_token": 4e8, "hit_rate": 0.8, "time_budget_s": budget,
           "read_bandwidth": {"in_flight_GBps": 3.5, "read_busy_per_token_s": 0.11, "one_at_a_time_GBps": 1.5,
                              "at_queue_depth_GBps": 4.0, "queue_depth": 16.0}, "roofline": r}
    text = table({"systems": {"expertcache:on-demand": row}})
    assert "| 3.50 / 1.50 / 4.00 (depth 16) |" in text and "| 0.100 | 0.100 | 0.100 | 0.200 | 0.50 | — |" in text, text
    oracle = dict(row, realisable=False, demand_loads_per_token=2.0, prefetch_loads_per_token=40.0,
                  prefetch_hits_per_token=39.5)
    text = table({"systems": {"expertcache:prefetch/predictor=oracle": oracle}})
    assert "| expertcache:prefetch/predictor=oracle (a limit: reads the trace's future) | 0.200 |" in text, text
    assert "| 0.50 | 2.0 / 40.0 (39.5) |" in text, text
    # issue 46: each comparison's ratio has its system's prefetches issued (used) per token beside it
    comp = {"expertcache:prefetch vs llama.cpp": {"ratio": 0.8, "claimed": True},
            "expertcache:prefetch vs expertcache:on-demand": {"ratio": 1.02, "claimed": False},
            "expertcache:on-demand vs llama.cpp": {"ratio": 0.78, "claimed": True}}
    pre = dict(row, demand_loads_per_token=1.0, prefetch_loads_per_token=3.25, prefetch_hits_per_token=2.5)
    text = table({"systems": {"expertcache:prefetch": pre, "expertcache:on-demand": row}, "comparisons": comp})
    assert "| expertcache:prefetch vs llama.cpp | 0.80 | yes | 3.25 (2.50) |" in text, text
    assert "| expertcache:prefetch vs expertcache:on-demand | 1.02 | no: the rounds overlap | 3.25 (2.50) |" in text
    assert "| expertcache:on-demand vs llama.cpp | 0.78 | yes | — |" in text, text


def test_bench_big_skips_accelerate_with_its_reason_when_the_disk_cannot_hold_its_copy(tmp_path, monkeypatch):
    """accelerate writes a converted copy of what the budget leaves out (26.6 GB beside a 33.9 GB checkpoint): where
    the disk cannot hold it, the row is skipped with the figures in its reason, before anything is written; a copy
    already there (it is rewritten in place) counts as room."""
    from expertcache.runtime.bench import bigbench

    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"\0" * 4096)
    monkeypatch.setattr(bigbench, "have_ckpt", lambda c: 30 * 2**30)
    monkeypatch.setattr(bigbench, "free_disk", lambda d: 10 * 2**30)
    why = bigbench.accelerate_disk(ckpt, 8.0, tmp_path, beside_gguf=True)
    assert why == ("its offload copy needs about 25.8 GB of disk and 10.7 GB are free beside the checkpoint and "
                   "the GGUF"), why
    monkeypatch.setattr(bigbench, "free_disk", lambda d: 25 * 2**30)
    assert bigbench.accelerate_disk(ckpt, 8.0, tmp_path) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the contended condition needs two cores")
def test_the_memory_contended_condition_streams_on_the_other_core_and_restores_this_process(capsys):
    """`bench kernels --conditions [memory-contended]`: inside the condition a second process streams memory on the
    second core and this process (with what it starts) is pinned to the first; afterwards the streamer is gone and
    the affinity is what it was. A name outside the two conditions is one line, exit 2."""
    from expertcache.recipes.cli import main
    from expertcache.runtime.bench import kernels as bench_kernels

    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    with bench_kernels.Condition("memory-contended", elements=1 << 20) as c:
        assert os.sched_getaffinity(0) == {cpus[0]}
        assert c.proc.poll() is None  # streaming
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == str([cpus[0]])  # what it starts inherits the pin
    assert c.proc.poll() is not None and os.sched_getaffinity(0) == before
    with bench_kernels.Condition("alone") as c:
        assert c.proc is None and os.sched_getaffinity(0) == before
    capsys.readouterr()
    assert main(["bench", "kernels", "--conditions", "[busy]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--conditions ['busy']: expected a subset of alone,memory-contended" in err


def test_kernel_ab_refuses_an_unknown_format_and_revision_in_one_line_with_exit_2(capsys):
    """scripts/kernel_ab.py: a format outside its table was a KeyError traceback after the first format's rounds, and
    a revision git does not know exited 0; both are one line and exit 2 before anything is built."""
    import importlib.util

    from helpers import REPO

    spec = importlib.util.spec_from_file_location("kernel_ab", REPO / "scripts" / "kernel_ab.py")
    kab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kab)
    for argv, want in ((["--formats", "int4-g32,int8"], "kernel_ab: --formats int4-g32,int8: expected a subset of"),
                       (["--base", "no-such-revision", "--formats", "int8-g32"],
                        "kernel_ab: 'no-such-revision' names no commit")):
        capsys.readouterr()
        assert kab.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(want), err


def test_bench_prompt_cache_names_a_missing_or_empty_checkpoint_in_one_line_with_exit_2(capsys, tmp_path):
    """`bench prompt-cache` (once scripts/serve_prompt_cache.py) on a fresh clone (no quickstart yet, so no default
    model) was a traceback from inside transformers ("Repo id must be in the form ..."); a missing folder and one
    without config.json are one line each, exit 2, before any server starts; the default's line says what makes
    it."""
    from expertcache.recipes.cli import main

    (tmp_path / "empty").mkdir()
    for model, needle in ((tmp_path / "nope", "no such folder"), (tmp_path / "empty", "config.json")):
        code = main(["bench", "prompt-cache", "--model", str(model), "--out", str(tmp_path / "out.json")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
        assert "--model:" in err and "make quickstart" not in err, err
    assert main(["bench", "prompt-cache", "--rounds", "0"]) == 2
    assert "--rounds 0: counts must be >= 1" in capsys.readouterr().err
    assert main(["bench", "prompt-cache", "--capacities", "[0]"]) == 2
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("script, argv, needle", [
    ("check_results", ["--results", "{nx}"], "--results {nx}: no such folder"),
    ("load_test", ["--clients", "0"], "argument --clients: invalid integer >= 1 value: '0'"),
    ("load_test", ["--seconds", "-1"], "argument --seconds: invalid number > 0 value: '-1'"),
    ("make_checkpoint", ["--out", "{tmp}/c", "--top-k", "8", "--experts", "4"], "cannot choose more experts"),
    ("make_checkpoint", ["--out", "{tmp}/c", "--dtype", "float33"], "argument --dtype: invalid choice"),
    ("predictor_recall", ["--model", "{nx}", "--trace", "{nx}"], "no HF checkpoint at {nx}: no such folder"),
    ("timed", None, "No such file or directory"),
    ("miss_predictability", ["--trace", "{nx}", "--fit", "abc"], "expected START:END token windows"),
    ("learned_policy_eval", ["--base-fit", "{nx}", "--base-test", "{nx}"], "--base-fit {nx}: no such trace"),
    ("quantized_table", ["--base", "{nx}", "--work", "{tmp}/work"], "no HF checkpoint at {nx}: no such folder"),
    ("gate_table", ["--base", "{nx}", "--candidates", "{nx}", "--out", "{tmp}/gates"], "no HF checkpoint at {nx}"),
    ("llamacpp_peer", ["--model", "{nx}"], "no HF checkpoint at {nx}: no such folder"),
])
def test_scripts_refuse_bad_input_in_one_line_with_exit_2_before_any_work(script, argv, needle, tmp_path,
                                                                           monkeypatch, capsys):
    """A hostile user's bad input to scripts/ (found by trying each): each is one line (argparse's usage line
    before it at most) and exit 2, through `run_script` as every script's entry, before anything is written. Before,
    train_big.py (now `bench train-big`) on a missing checkpoint exited 0 and overwrote results/train_big.json with a
    run that did not complete; load_test.py --clients 0 wrote a result that said pass with no request; make_checkpoint.py wrote a
    checkpoint whose tokens choose more experts than it has; predictor_recall.py said "Repo id must be in the form"
    from inside transformers; bench_telemetry.py timed a random model for a --model that is not there."""
    import importlib.util

    from helpers import REPO

    from expertcache.telemetry.errors import run_script

    nx = str(tmp_path / "nope")
    path = next(p for p in (REPO / "scripts" / f"{script}.py", REPO / "experiments" / f"{script}.py") if p.is_file())
    spec = importlib.util.spec_from_file_location(script, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before = sorted(p.name for p in tmp_path.iterdir())
    if argv is None:  # timed.py: the command it times is not there
        monkeypatch.setattr(sys, "argv", ["scripts/timed.py"])
        monkeypatch.setattr(mod, "OUT", tmp_path / "make_times.json")
        call = (mod.main, ["x", "--", nx])
    else:
        monkeypatch.setattr(sys, "argv", [f"scripts/{script}.py", *[a.format(nx=nx, tmp=tmp_path) for a in argv]])
        call = (mod.main,)
    try:
        rc = run_script(*call)
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err and "Traceback" not in "\n".join(err), (rc, err)
    assert needle.format(nx=nx) in err[-1], err
    assert len(err) == 1 or err[0].startswith("usage:"), err
    if not err[0].startswith("usage:"):
        assert err[0].startswith(f"{script}:"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written



def test_a_checkpoint_path_with_a_tilde_is_read_from_home(tmp_path, monkeypatch):
    """`~/models/x` (from a YAML file, or `--model=~/x`, which the shell does not expand) names a folder under home:
    read there, not refused as a folder that is not there; one that is not there says so."""
    from tiny_lm import make_tiny_checkpoint

    from expertcache.telemetry.errors import InputError
    from expertcache.telemetry.hf import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    make_tiny_checkpoint(tmp_path / "models" / "m")
    assert load_config("~/models/m").model_type
    with pytest.raises(InputError, match="no such folder"):
        load_config("~/models/none")


TINY_SHAPE = dict(HIDDEN=128, INTER=128, EXPERTS=8, TOP_K=2, HEADS=4, KV_HEADS=2, HEAD_DIM=32)


def test_the_q4_0_gguf_is_write_checkpoints_draws_and_imports_with_the_same_codes(tmp_path, monkeypatch):
    """#47 item 5: bench big's 48-layer checkpoint exists only as a Q4_0 GGUF (its bf16 experts would be 58 GB). On a
    tiny shape: the GGUF holds `write_checkpoint`'s routers exactly and its experts within Q4_0's error; `import-gguf`
    gives expertcache the file's own codes and scales (its dequantized experts equal gguf's dequantization of the
    file's bytes); the model decodes; a second call reuses the file; nothing half-written is left beside it."""
    import gguf
    from gguf import quants

    from expertcache.runtime.bench import bigckpt
    from expertcache.runtime.kernels.gguf_import import import_gguf
    from expertcache.runtime.storage.loader import load
    from expertcache.telemetry.adapters import adapter_for

    for k, v in TINY_SHAPE.items():
        monkeypatch.setattr(bigckpt, k, v)
    f = bigckpt.write_gguf_q4_0(tmp_path / "m.gguf", 2, vocab=512)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    mtime = f.stat().st_mtime_ns
    assert bigckpt.write_gguf_q4_0(f, 2, vocab=512).stat().st_mtime_ns == mtime  # reused
    other = tmp_path / "other.gguf"  # another depth, a damaged file and a dead run's temporary: written again
    bigckpt.write_gguf_q4_0(other, 3, vocab=512)
    (tmp_path / ".other.gguf.tmp-999999999").write_bytes(b"half")
    bigckpt.write_gguf_q4_0(other, 2, vocab=512)
    assert int(gguf.GGUFReader(str(other)).fields["qwen3moe.block_count"].contents()) == 2
    other.write_bytes(other.read_bytes()[:4096])
    bigckpt.write_gguf_q4_0(other, 2, vocab=512)
    assert other.stat().st_size == f.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "other.gguf"]
    other.unlink()
    ref = bigckpt.write_checkpoint(tmp_path / "bf16", 2, vocab=512)
    r = gguf.GGUFReader(str(f))
    t = {x.name: x for x in r.tensors}
    assert t["blk.1.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    from safetensors import safe_open

    with safe_open(str(next(ref.glob("model-00001-*.safetensors"))), "pt") as s:
        router = s.get_tensor("model.layers.1.mlp.gate.weight").float()
        expert = s.get_tensor("model.layers.1.mlp.experts.5.up_proj.weight").float()
    assert torch.equal(torch.from_numpy(np.array(t["blk.1.ffn_gate_inp.weight"].data)).reshape(router.shape), router)
    up = torch.from_numpy(quants.dequantize(t["blk.1.ffn_up_exps.weight"].data, gguf.GGMLQuantizationType.Q4_0))
    up = up.reshape(8, 128, 128)
    err = float((up[5] - expert).norm() / expert.norm())
    assert 0.02 < err < 0.2, err  # quantized (not the bf16 values), within 4 bits' error
    out = tmp_path / "int4"
    import_gguf(f, out)
    m = load(out)
    layer = adapter_for(m).moe_layers(m)[1]
    assert torch.equal(layer.router.weight.float(), router)
    from expertcache.runtime.kernels import quant

    from expertcache.runtime.storage.tiers import SlotPool

    eng = m.expertcache  # expert 5 of layer 1 read through the engine's own tier into a slot of its own
    slots = SlotPool(eng.meta, 1)
    eng.tier.read(1, 5, slots, 0)
    views = {n: v[0] for n, v in slots.views.items()}
    gate_up = quant.dequantize({"q": views["gate_up_proj.q"], "scales": views["gate_up_proj.scales"]}, 4, 32)
    assert torch.equal(gate_up[128:], up[5])  # the file's own codes and scales, repacked without rounding
    with torch.no_grad():
        ids = m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, pad_token_id=1)
    assert ids.shape == (1, 6)


@pytest.mark.parametrize("argv, needle", [
    (["--checkpoint", "fp8"], "--checkpoint 'fp8': expected bf16 or q4_0"),
    (["--checkpoint", "q4_0", "--quant_linears", "true"], "give --experts [int4] --quant_linears true"),
    (["--checkpoint", "q4_0", "--experts", "[int4]"], "give --experts [int4] --quant_linears true"),
    (["--checkpoint", "q4_0", "--experts", "[int4]", "--quant_linears", "true", "--systems",
      "[expertcache:on-demand,mmap]"], "--checkpoint q4_0: mmap reads the bf16 checkpoint"),
])
def test_bench_big_refuses_a_q4_0_checkpoint_it_cannot_serve_before_writing_anything(tmp_path, capsys, argv, needle):
    from expertcache.recipes.cli import main

    assert main(["bench", "big", "--out_dir", str(tmp_path / "d"), "--out", str(tmp_path / "b.json"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("argv, needle", [
    (["bench", "integrity", "--capacity", "-1"], "--capacity -1.0: a fraction of the experts in (0, 1]"),
    (["bench", "integrity", "--rounds", "0"], "--rounds 0: counts must be >= 1"),
    (["bench", "integrity", "--layers", "4000"], "--layers 4000: the trace has"),
    (["bench", "checksum", "--model", "{nx}"], "{nx}"),
    (["bench", "cachesim", "--rounds", "0"], "--rounds 0: counts must be >= 1"),
    (["bench", "kernels", "--threads", "[0]", "--model", "{nx}"], "--threads [0]: expected thread counts >= 1"),
    (["bench", "kernels", "--formats", "[int3]"], "--formats ['int3']: expected a subset of bf16,int8"),
    (["bench", "kernels", "--depth", "-1", "--model", "{nx}"], "--depth -1: counts must be >= 1 (--depth >= 0)"),
    (["bench", "serve", "--levels", "[0,8]"], "--levels [0, 8]: expected client counts >= 1"),
    (["bench", "serve", "--passes", "0", "--seed", "-1"], "--passes 0, --seed -1: counts must be >= 1 (--seed >= 0)"),
    (["bench", "kernels", "--model", "{nx}"], "{nx}"),
    (["bench", "kernels", "--kernels", "false"], "nothing to measure: --kernels false and no --model"),
    (["bench", "kernels", "--conditions", "[memory-contended]", "--threads", "[2]"], "has no 1"),
    (["bench", "integrity", "--expert_shape=-5x768"], "--expert_shape '-5x768': expected sizes >= 1"),
    (["bench", "integrity", "--tokens", "7000"], "the trace has 8000 tokens and the replay times from token 1600"),
    (["bench", "train-big", "--model", "{nx}", "--make_layers", "2", "--tier", "gpu"], "unknown tier 'gpu'"),
    (["bench", "train-big", "--model", "{nx}", "--make_layers", "2", "--bits", "4", "--group", "0"],
     "group_size=0: expected 32 or a multiple of 64"),
    (["bench", "train-big", "--model", "{nx}", "--make_layers", "2", "--distill", "-1"], "--distill -1: expected >= 0"),
    (["bench", "train-big", "--model", "{docs}", "--make_layers", "2"], "already holds other files"),
    (["bench", "cachesim", "--work", "{docs}"], "not an output of `bench cachesim`"),
    (["bench", "checksum", "--model", "{nx}", "--threads", "abc"], "--threads: expected an integer; got abc"),
    (["bench", "checksum"], "--model is required"),
    (["bench", "kernels", "--linears", "maybe"], "--linears: expected true or false; got maybe"),
    (["bench", "telemetry", "--model", "{nx}"], "--model {nx}: no checkpoint there"),
    (["bench", "train", "--steps", "2", "--warmup", "2"], "--warmup 2: leaves none of --steps 2 to time"),
    (["bench", "train", "--recipe", "{nx}"], "neither a file nor a shipped recipe"),
    (["bench", "train-big", "--model", "{nx}", "--corpus", "{nx}"], "--model {nx}: no checkpoint there"),
    (["bench", "train-big", "--model", "{nx}", "--corpus", "{nx}", "--bits", "4", "--steps", "0"],
     "--steps 0: counts must be >= 1"),
    (["bench", "train-big", "--model", "{nx}", "--bits", "5"], "--bits 5: expected 4 or 8"),
    (["bench", "train-big", "--model", "{nx}", "--runs", "[int4]"], "--runs ['int4']: expected a subset of [bf16]"),
])
def test_bench_subcommands_refuse_bad_input_in_one_line_with_exit_2(argv, needle, tmp_path, capsys):
    """The benchmarks that were scripts, now `expertcache bench checksum|integrity|cachesim|telemetry|train`: bad
    input is one line and exit 2 before any work (nothing written). (bench telemetry on a --model that is not there
    timed a random model before.)"""
    from expertcache.recipes.cli import main

    nx = str(tmp_path / "nope")
    docs = tmp_path / "docs"  # a folder of someone else's files
    docs.mkdir()
    (docs / "notes.md").write_text("mine")
    out = tmp_path / "r.json"
    assert main([*[a.format(nx=nx, docs=docs) for a in argv], "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle.format(nx=nx) in err[0], err
    assert err[0].startswith(f"expertcache bench {argv[1]}: error: "), err  # the subcommand named, not just "bench"
    assert not out.exists() and [p.name for p in docs.iterdir()] == ["notes.md"]


@pytest.mark.slow  # a benchmark run end to end (3 s alone: the edit loop's longest test)
def test_bench_integrity_alternates_its_three_modes_and_writes_a_result_with_its_command(tmp_path, capsys):
    """`expertcache bench integrity` on a small replay: every mode timed each round, the shares of TPOT computed from
    them, and the JSON written with its commit, configuration and the command that reruns it."""
    from expertcache.recipes.cli import main

    out = tmp_path / "integrity.json"
    argv = ["bench", "integrity", "--expert_shape", "64x32", "--layers", "1", "--tokens", "4", "--warmup", "1",
            "--rounds", "2", "--store_dir", str(tmp_path / "stores"), "--out", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert set(r["tpot_round_medians_s"]) == {"off", "on_cold", "on_warm"}
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in r["tpot_round_medians_s"].values())
    med = r["tpot_median_s"]
    assert r["share_of_tpot"]["on_cold_ab"] == pytest.approx(med["on_cold"] / med["off"] - 1)
    assert r["inputs"]["expert_shape"] == [64, 32] and r["experts_read_per_token"] > 0
    assert r["command"].startswith("expertcache bench integrity --expert_shape 64x32 --layers 1 --tokens 4")
    assert r["config"]["rounds"] == 2 and "commit" in r


@pytest.mark.slow
def test_bench_train_and_bench_telemetry_time_both_arms_of_each_round(tmp_path):
    """`expertcache bench train` (Lightning against a bare loop) and `bench telemetry` (a forward with and without
    the recorder) on the smoke recipe's shape: each arm timed in every round, the ratio computed from the medians,
    the result written with the command that reruns it."""
    from expertcache.recipes.cli import main

    out = tmp_path / "train.json"
    rc = main(["bench", "train", "--recipe", "smoke", "--steps", "3", "--warmup", "1", "--rounds", "2",
               "--threads", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == (0 if r["pass"] else 1)  # a missed target is a result (exit 1), not bad input
    assert r["lightning"]["steps"] == r["bare"]["steps"] == 2 * 2
    assert r["lightning_over_bare_tokens_per_s"] == pytest.approx(
        r["bare"]["median_step_s"] / r["lightning"]["median_step_s"], rel=1e-2)
    assert r["command"].startswith("expertcache bench train --recipe smoke --steps 3 --warmup 1 --rounds 2 --threads 1")
    out = tmp_path / "telemetry.json"
    assert main(["bench", "telemetry", "--model", str(tmp_path / "absent-default"), "--out", str(out)]) == 2
    rc = main(["bench", "telemetry", "--batch_size", "1", "--seq_len", "16", "--reps", "2", "--warmup", "0",
               "--out", str(out)])
    t = json.loads(out.read_text())
    assert rc == (0 if t["pass"] else 1)
    assert set(t["forward_s_median"]) == {"plain", "ids_weights", "plain_control", "with_hidden"}
    assert t["batch"] == [1, 16] and all(v > 0 for v in t["forward_s_median"].values())
