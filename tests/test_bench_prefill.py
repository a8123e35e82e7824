"""bench big's prefill phase (#47: prefill measured for every system) on a tiny real checkpoint: each system's cold
prefill, the rows and roofline the JSON carries, llama.cpp's prompt test parsed from llama-bench's documented JSON
and skipped in one line when it is not built, and the bad --prefill lengths refused before anything is written."""

import json

import pytest
import torch

from expertcache.telemetry.errors import InputError


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from tiny_models import build_model, tiny_config

    src = tmp_path_factory.mktemp("prefill") / "ckpt"
    build_model(tiny_config("qwen3_moe"), seed=7, dtype=torch.bfloat16).save_pretrained(src)
    return src


def test_prefill_phase_rows_and_roofline_on_a_tiny_checkpoint(tiny_ckpt, tmp_path, capsys):
    """expertcache (a cache of 4 of 8 experts per layer, from disk) and mmap prefill the same 24-token prompt to the
    same first token; the cold cache reads each expert the prompt routes to once; the resident run reads nothing;
    the rows, roofline and table are what the JSON and docs carry. One run goes through the child's entry point
    (its run configuration, phase prefill)."""
    from expertcache.runtime.bench import bigbench, bigprefill

    slot = bigbench._slot_bytes(tiny_ckpt)  # the budget's accounting slot: 4 cached + 2 staging per layer, 6 stream
    layers = json.loads((tiny_ckpt / "config.json").read_text())["num_hidden_layers"]
    budget_gb = (bigbench.RAM_OTHER + bigbench.PROMPT_RESERVE * 24 * layers + 18.5 * slot) / 2**30
    cfg = bigbench.write_run_config(tmp_path / "ec.yaml", "expertcache:on-demand", {
        "ckpt": str(tiny_ckpt), "trace": None, "budget_gb": budget_gb, "tokens": 1, "warmup": 0, "prompt_len": 24,
        "start": 0, "routing": "native", "quant_linears": False}, bigbench.EngineConfig(tier="disk"), "prefill")
    assert bigbench.main([str(cfg)]) == 0
    ec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    mm = bigbench.run_prefill("mmap", tiny_ckpt, None, budget_gb, 24, 0, routing="native")
    res = bigbench.run_prefill("expertcache:on-demand", tiny_ckpt, None, budget_gb, 24, 0, routing="native",
                               resident=True)
    assert ec["engine"]["capacity"] == 4 and res["engine"]["capacity"] == 8
    # the prompt's working memory comes out of the budget: a longer prompt leaves fewer slots, a far longer none
    longer = 24 + int(2 * slot * layers / (bigbench.PROMPT_RESERVE * layers)) + 1
    _, eng, _ = bigbench._load_system("expertcache:on-demand", tiny_ckpt, int(budget_gb * 2**30), layers, None, 0,
                                      bigbench.EngineConfig(tier="disk"), prompt_len=longer)
    assert eng.describe()["capacity"] < 4
    eng.close()
    with pytest.raises(bigbench.InputError, match="leaves no cache slots .* and a 9999-token prompt"):
        bigbench._load_system("expertcache:on-demand", tiny_ckpt, int(budget_gb * 2**30), layers, None, 0,
                              bigbench.EngineConfig(tier="disk"), prompt_len=9999)
    assert ec["first_token"] == mm["first_token"] == res["first_token"]  # lossless: the same prefill
    assert ec["experts_touched"] == mm["experts_touched"] == res["experts_touched"] > 2 * 2
    assert ec["expert_bytes"] == 3 * 32 * 16 * 2
    assert ec["loads_in_timed"] == ec["experts_touched"]  # cold: every expert the prompt needs, read once
    assert ec["engine_bytes_moved"] == ec["experts_touched"] * ec["expert_bytes"]
    assert res["loads_in_timed"] == 0 and res["engine_bytes_moved"] == 0  # every expert resident
    for r in (ec, mm, res):
        assert r["tokens_per_s"] == pytest.approx(24 / r["ttft_s"]) and r["disk_read_bytes"] >= 0
    assert ec["read_bandwidth"]["at_queue_depth_GBps"] > 0

    runs = {"expertcache:on-demand": [[{**ec, "cgroup_peak_bytes": None}], [{"error": "exit -9", "prompt_tokens": 24}]],
            "mmap": [[{**mm, "cgroup_peak_bytes": None}], [{**mm, "cgroup_peak_bytes": None, "tokens_per_s": 1.0}]]}
    systems = {s: {"runs": 0, "errors": [], "prefill": bigprefill.prefill_rows(rs, [24])} for s, rs in runs.items()}
    systems["llama.cpp"] = {"runs": 0, "errors": [], "skipped": "llama.cpp build failed: not built"}
    row = systems["expertcache:on-demand"]["prefill"][0]
    assert {"prompt_tokens", "tokens_per_s", "ttft_s", "disk_read_bytes"} <= set(row)
    assert row["runs"] == 2 and row["errors"] == ["exit -9"] and row["tokens_per_s"] == ec["tokens_per_s"]
    m = systems["mmap"]["prefill"][0]
    assert m["tokens_per_s_rounds"] == [mm["tokens_per_s"], 1.0]
    assert m["tokens_per_s"] == pytest.approx((mm["tokens_per_s"] + 1.0) / 2)  # the median of two rounds
    roof = bigprefill.roofline(systems, {24: res}, [24])["24"]
    assert roof["bytes_needed"] == ec["experts_touched"] * ec["expert_bytes"]
    assert roof["t_compute_s"] == res["ttft_s"] and roof["compute_from"] == "resident"
    assert roof["t_transfer_s"] == pytest.approx(roof["bytes_needed"] / (roof["disk_GBps"] * 1e9))
    assert roof["tokens_per_s"] == pytest.approx(24 / max(roof["t_compute_s"], roof["t_transfer_s"]))
    no_res = bigprefill.roofline(systems, {24: {"skipped": "too big"}}, [24])["24"]
    assert no_res["resident"] == "too big" and no_res["t_compute_s"] == pytest.approx(ec["ttft_s"] - ec["stall_s"])
    comp = bigprefill.comparisons(systems, {"24": roof}, [24])
    assert comp["24: expertcache:on-demand vs mmap"]["ratio"] == pytest.approx(row["tokens_per_s"] / m["tokens_per_s"])
    assert comp["24: expertcache:on-demand vs roofline"]["of_roofline"] == pytest.approx(
        row["tokens_per_s"] / roof["tokens_per_s"])
    text = bigprefill.table({"systems": systems, "prefill_roofline": {"24": roof}, "prefill_comparisons": comp})
    assert f"| expertcache:on-demand | 24 | {row['tokens_per_s']:.1f} |" in text, text
    assert "| llama.cpp | skipped: llama.cpp build failed: not built |" in text, text


def test_an_unbuilt_llamacpp_is_skipped_in_one_line_without_building(tmp_path):
    """--llamacpp_build false: llama.cpp not built in its folder skips both its rows with one line saying so;
    nothing is downloaded or built (the folder stays empty)."""
    from expertcache.runtime.bench import bigbench

    empty = tmp_path / "llamacpp"
    empty.mkdir()
    bins, gguf, skipped = bigbench.prepare_llamacpp(["llama.cpp", "llama.cpp:unbounded", "mmap"], "native",
                                                    tmp_path / "ckpt", tmp_path, empty, build=False)
    assert bins is None and gguf is None and set(skipped) == {"llama.cpp", "llama.cpp:unbounded"}
    why = skipped["llama.cpp"]
    assert "\n" not in why and "not built" in why and str(empty) in why, why
    assert not any(empty.iterdir())


def test_llama_bench_prompt_test_is_read_from_its_json_lines():
    """llama-bench `-o jsonl` (the fields its README documents: n_prompt, n_gen, avg_ns, avg_ts, samples_ns): the
    `-p N -n 0` object gives prompt tokens/s and seconds; output without it is one line."""
    from expertcache.runtime.bench.llamacpp import LlamaCppError, prompt_row

    lines = [json.dumps({"build_commit": "abc123", "n_threads": 2, "n_prompt": 0, "n_gen": 16, "n_depth": 0,
                         "avg_ns": 4_000_000_000, "avg_ts": 4.0, "samples_ns": [4_000_000_000]}) + "\n",
             json.dumps({"build_commit": "abc123", "n_threads": 2, "n_prompt": 512, "n_gen": 0, "n_depth": 0,
                         "avg_ns": 12_800_000_000, "stddev_ns": 0, "avg_ts": 40.0, "stddev_ts": 0.0,
                         "samples_ns": [12_800_000_000], "samples_ts": [40.0]}) + "\n"]
    r = prompt_row(lines, 512)
    assert r == {"tokens_per_s": 40.0, "prompt_s": [12.8], "build": "abc123", "threads": 2}
    with pytest.raises(LlamaCppError) as e:
        prompt_row(lines, 2048)
    assert "\n" not in str(e.value) and "2048" in str(e.value)


@pytest.mark.parametrize("prefill,expect", [("[0]", "0 is not"), ("[512,4097]", "4097 is not"),
                                            ("[512,512]", "distinct")])
def test_bench_big_refuses_bad_prefill_lengths_before_writing_anything(tmp_path, capsys, prefill, expect):
    from expertcache.recipes.cli import main

    assert main(["bench", "big", "--out_dir", str(tmp_path / "d"), "--out", str(tmp_path / "b.json"),
                 "--prefill", prefill]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefill" in err[0] and expect in err[0] and "4096" in err[0], err
    assert not (tmp_path / "d").exists()


def test_bench_big_refuses_nothing_to_run_and_takes_the_longest_prompt(tmp_path, capsys):
    from expertcache.recipes.cli import main

    base = ["bench", "big", "--out_dir", str(tmp_path / "d"), "--out", str(tmp_path / "b.json")]
    assert main([*base, "--decode", "false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing to run" in err[0], err
    missing = tmp_path / "missing.npz"  # the trace, read after the lengths are checked: refused next
    assert main([*base, "--decode", "false", "--prefill", "[1,4096]", "--trace", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefill" not in err[0] and "missing.npz" in err[0], err
    assert not (tmp_path / "d").exists()


def test_bench_big_refuses_a_prefill_longer_than_its_trace_before_writing_anything(tmp_path, capsys):
    """--routing trace: a prompt's token p routes as the trace's token 2000 + p; a trace too short for the longest
    prompt is one line before the checkpoint is written; one long enough passes the check."""
    import numpy as np

    from expertcache.recipes.cli import main
    from expertcache.runtime.bench.bigbench import TRACE_START

    ids = np.tile(np.arange(8, dtype=np.int32), (2, TRACE_START + 600, 1))  # [layers, tokens, k]
    np.savez(tmp_path / "t.npz", experts=ids, meta=np.array(json.dumps({"num_experts": 128})))
    base = ["bench", "big", "--out_dir", str(tmp_path / "d"), "--out", str(tmp_path / "b.json"), "--trace",
            str(tmp_path / "t.npz"), "--decode", "false"]
    assert main([*base, "--prefill", "[512,2048]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefill" in err[0] and f"{TRACE_START + 600}" in err[0], err
    assert not (tmp_path / "d").exists()
    (tmp_path / "f").write_text("")  # fits: refused next, for its --out_dir (a file), checked after the trace
    assert main([*base, "--prefill", "[600]", "--out_dir", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefill" not in err[0] and "is a file" in err[0], err
