"""llama.cpp as `bench big`'s peer: every step that fails is one line naming the step, and the systems it would
have run are skipped with that line in the JSON, never dropped. (Building llama.cpp takes tens of minutes, so these
tests break the steps on purpose; `scripts/llamacpp_peer.py` and `bench big --systems [llama.cpp,...]` run the real
thing.)"""

from __future__ import annotations

import json
import os
import stat

import pytest

from expertcache.runtime.bench import bigbench
from expertcache.runtime.bench import llamacpp
from expertcache.runtime.bench.llamacpp import LlamaCppError


def _one_line(e: Exception) -> str:
    s = str(e)
    assert "\n" not in s and "Traceback" not in s
    return s


def test_a_build_that_fails_is_one_line_naming_the_build(tmp_path):
    src = tmp_path / "llama.cpp"  # no CMakeLists.txt: cmake refuses it (or cmake itself is missing)
    src.mkdir()
    with pytest.raises(LlamaCppError) as e:
        llamacpp.build(src)
    assert e.value.step == "build" and _one_line(e.value).startswith("llama.cpp build failed: ")


def test_a_conversion_that_fails_is_one_line_and_leaves_no_partial_gguf(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(LlamaCppError, match=r"llama.cpp convert failed: .* has no tokenizer.json"):
        llamacpp.gguf(model, "bf16", tmp_path / "src", tmp_path / "bin", tmp_path / "out")
    (model / "tokenizer.json").write_text("{}")
    src = tmp_path / "src"  # a source tree without the converter: the converter's child fails
    src.mkdir()
    with pytest.raises(LlamaCppError) as e:
        llamacpp.gguf(model, "bf16", src, tmp_path / "bin", tmp_path / "out")
    assert e.value.step == "convert" and "exit 1" in _one_line(e.value)
    assert not list((tmp_path / "out").glob("*.gguf")) and not list((tmp_path / "out").glob("*.tmp"))
    assert (tmp_path / "out" / "convert.log").is_file()  # the converter's own words, kept


def _fake_bench(tmp_path, script: str):
    bins = tmp_path / "bin"
    bins.mkdir(exist_ok=True)
    exe = bins / "llama-bench"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bins


def test_a_llama_bench_that_fails_is_one_line_with_its_last_words(tmp_path):
    bins = _fake_bench(tmp_path, 'echo "main: error: failed to load model" >&2\nexit 1\n')
    with pytest.raises(LlamaCppError) as e:
        llamacpp.bench(bins, tmp_path / "m.gguf", 2, 8, log=tmp_path / "r.log")
    assert _one_line(e.value) == (f"llama.cpp bench failed: exit 1: main: error: failed to load model "
                                  f"(log: {tmp_path / 'r.log'})")


def test_llama_bench_output_is_read_per_test(tmp_path):
    """The timed test is the one with the asked token count (the warm-up test before it is not); its samples are
    whole-run nanoseconds, so seconds per token divide by the tokens. The child's own peak RSS and reads come from
    its rusage."""
    rows = [{"n_prompt": 0, "n_gen": 4, "n_depth": 8, "n_threads": 2, "avg_ns": 4e8, "samples_ns": [4e8],
             "build_commit": "abc"},
            {"n_prompt": 0, "n_gen": 16, "n_depth": 8, "n_threads": 2, "avg_ns": 3.2e9, "samples_ns": [3.2e9],
             "build_commit": "abc"}]
    bins = _fake_bench(tmp_path, "".join(f"echo '{json.dumps(r)}'\n" for r in rows))
    r = llamacpp.bench(bins, tmp_path / "m.gguf", 2, 16, warmup=4, depth=8)
    assert r["tpot_s"] == [pytest.approx(0.2)] and r["build"] == "abc" and r["n_depth"] == 8
    assert r["peak_rss_bytes"] > 0 and r["read_bytes"] >= 0 and r["read_bytes_timed"] is not None
    assert "-n 4,16 -d 8" in r["cmd"]
    bins = _fake_bench(tmp_path, "echo 'not json'\n")
    with pytest.raises(LlamaCppError, match="unreadable llama-bench output"):
        llamacpp.bench(bins, tmp_path / "m.gguf", 2, 16)


def test_bench_big_skips_llama_cpp_with_the_reason_not_silently(tmp_path):
    """Trace routing: llama.cpp cannot take a forced routing, so it is skipped saying so; native routing with a
    build that fails: skipped with the build's line. Other systems are untouched."""
    systems = ["expertcache:on-demand", "llama.cpp", "llama.cpp:unbounded"]
    bins, gguf, skipped = bigbench.prepare_llamacpp(systems, "trace", tmp_path, tmp_path)
    assert bins is None and set(skipped) == {"llama.cpp", "llama.cpp:unbounded"}
    assert "--routing native" in skipped["llama.cpp"]
    src = tmp_path / "cache" / "llama_cpp_python-0.0/vendor/llama.cpp"  # an unbuildable source tree
    src.mkdir(parents=True)
    bins, gguf, skipped = bigbench.prepare_llamacpp(systems, "native", tmp_path, tmp_path, tmp_path / "cache")
    assert gguf is None and set(skipped) == {"llama.cpp", "llama.cpp:unbounded"}
    assert skipped["llama.cpp"].startswith("llama.cpp build failed: ")
    assert bigbench.prepare_llamacpp(["mmap"], "native", tmp_path, tmp_path) == (None, None, {})
    assert os.listdir(tmp_path / "cache") == ["llama_cpp_python-0.0"]  # nothing downloaded: the tree was there

