"""An output folder is never someone else's (#45): every command that writes a folder writes it only when it is
new, empty or its own earlier output (`telemetry/atomic.py: claim_dir`, the marker `.expertcache-output.json`);
`--overwrite true` replaces only that; an interrupted run's temporary folder is cleaned by the next run; quantize
keeps everything the checkpoint carries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from expertcache.telemetry.atomic import OUTPUT_MARKER, atomic_dir, claim_dir, output_marker
from expertcache.telemetry.errors import InputError


def _user_folder(root: Path) -> tuple[Path, dict]:
    """A folder of someone's files, and what it holds (path -> bytes)."""
    u = root / "userdir"
    (u / "notes").mkdir(parents=True)
    (u / "keep.txt").write_text("precious\n")
    (u / "notes" / "a.md").write_text("# mine\n")
    return u, _snapshot(u)


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# --- the rule --------------------------------------------------------------------------------------------------

def test_a_folder_of_user_files_is_refused_naming_what_is_there(tmp_path):
    u, before = _user_folder(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(InputError, match=r"not an output of `quantize` \(it holds keep\.txt, notes/\)"):
            claim_dir(u, "quantize", overwrite=overwrite)
        with pytest.raises(InputError, match="keep.txt"):
            with atomic_dir(u, command="quantize", overwrite=overwrite) as t:
                (t / "model.safetensors").write_bytes(b"x")
    assert _snapshot(u) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["userdir"]  # no temporary folder left beside it
    many = tmp_path / "many"
    many.mkdir()
    for i in range(9):
        (many / f"f{i}").write_text("x")
    with pytest.raises(InputError, match=r"f0, f1, f2, f3, \.\.\. \(9 entries\)"):
        claim_dir(many, "analyze")
    assert claim_dir(tmp_path / "new", "quantize") == "new"
    (tmp_path / "empty").mkdir()
    assert claim_dir(tmp_path / "empty", "quantize") == "empty"


def test_overwrite_replaces_only_the_commands_own_earlier_output(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out, command="quantize") as t:
        (t / "w").write_text("first")
    assert output_marker(out) == {"command": "quantize", "complete": True}
    with pytest.raises(InputError, match="holds a complete earlier `quantize` output; pass --overwrite true"):
        with atomic_dir(out, command="quantize") as t:
            (t / "w").write_text("second")
    assert (out / "w").read_text() == "first"
    with atomic_dir(out, command="quantize", overwrite=True) as t:
        (t / "w").write_text("second")
    assert (out / "w").read_text() == "second" and output_marker(out)["command"] == "quantize"
    for overwrite in (False, True):  # another command's output is not this one's to replace
        with pytest.raises(InputError, match="is the output of `quantize`, not of `analyze`"):
            claim_dir(out, "analyze", overwrite=overwrite)
    (out / OUTPUT_MARKER).write_text("not json")  # a marker we cannot read is not ours
    with pytest.raises(InputError, match="not an output of `quantize`"):
        claim_dir(out, "quantize", overwrite=True)


def test_a_folder_filled_while_the_block_ran_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(InputError, match="late.txt"):
        with atomic_dir(out, command="quantize") as t:
            (t / "w").write_text("new")
            out.mkdir()
            (out / "late.txt").write_text("a user's")
    assert _snapshot(out) == {"late.txt": b"a user's"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_refused_or_failed_write_leaves_no_folder_it_made_on_the_way(tmp_path):
    """`expertcache analyze --trace MISSING --out NEW/a/b` refused the trace but left NEW/a behind: a block that
    fails (or a claim refused) removes the parent folders atomic_dir made for it, not one that was there before;
    a block that succeeds keeps them."""
    (tmp_path / "mine").mkdir()
    with pytest.raises(InputError):
        with atomic_dir(tmp_path / "mine" / "new" / "deeper" / "out", command="analyze"):
            raise InputError("trace not found")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"] and not any((tmp_path / "mine").iterdir())
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("the user's")
    with pytest.raises(InputError):  # refused by the claim: a folder of someone else's files
        with atomic_dir(tmp_path / "taken", command="analyze"):
            pass
    assert (tmp_path / "taken" / "keep.txt").read_text() == "the user's"
    with atomic_dir(tmp_path / "made" / "out", command="analyze") as d:
        (d / "x.json").write_text("{}")
    assert (tmp_path / "made" / "out" / "x.json").is_file()
    # a parent another process makes while the block runs is theirs: not removed when this block fails
    with pytest.raises(InputError):
        with atomic_dir(tmp_path / "race" / "deep" / "out", command="analyze"):
            (tmp_path / "race" / "deep" / "theirs").mkdir()
            raise InputError("failed")
    assert (tmp_path / "race" / "deep" / "theirs").is_dir()


def test_resumable_commands_continue_their_own_folder_only(tmp_path):
    from expertcache.telemetry.atomic import mark_output, own_dir
    from expertcache.trainer.runfolder import is_run_folder

    run = tmp_path / "run"
    run.mkdir()
    mark_output(run, "pretrain", complete=False)  # an interrupted run
    (run / "checkpoints").mkdir()
    assert claim_dir(run, "pretrain", resume=True, legacy=is_run_folder) == "earlier"
    with pytest.raises(InputError, match="is the output of `pretrain`, not of `train-cache-aware`"):
        claim_dir(run, "train-cache-aware", resume=True, legacy=is_run_folder)
    old = tmp_path / "old-run"  # a run folder from before markers: its recipe.yaml says what it is
    old.mkdir()
    (old / "recipe.yaml").write_text("name: x\n")
    assert claim_dir(old, "pretrain", resume=True, legacy=is_run_folder) == "earlier"
    cache = own_dir(tmp_path / "stores", "bench decode")
    assert output_marker(cache) == {"command": "bench decode", "complete": False}
    assert own_dir(cache, "bench decode") == cache


# --- interrupted writes ----------------------------------------------------------------------------------------

_INTERRUPTED = """import sys, time
from expertcache.telemetry.atomic import atomic_dir
with atomic_dir(sys.argv[1], command="quantize", overwrite=True) as t:
    (t / "experts.ecstore").write_bytes(bytes(1 << 20))
    print("ready", flush=True)
    time.sleep(120)
"""


def test_a_killed_writes_temporary_folder_is_removed_by_the_next_run(tmp_path, capsys):
    out = tmp_path / "ckpt"
    with atomic_dir(out, command="quantize") as t:
        (t / "w").write_text("earlier")
    p = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        live = tmp_path / f".ckpt.tmp-{p.pid}"
        assert (live / "experts.ecstore").stat().st_size == 1 << 20
        capsys.readouterr()
        claim_dir(out, "quantize", overwrite=True)  # a running write's folder is left alone
        assert live.is_dir() and capsys.readouterr().err == ""
    finally:
        p.kill()
        p.wait()
    assert live.is_dir() and (out / "w").read_text() == "earlier"  # the kill left the earlier output as it was
    with atomic_dir(out, command="quantize", overwrite=True) as t:  # the next run that writes ckpt
        (t / "w").write_text("next")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"removed .ckpt.tmp-{p.pid}" in err[0] and "is gone" in err[0], err
    assert not live.exists() and (out / "w").read_text() == "next"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"]


def test_an_earlier_output_moved_aside_by_a_killed_swap_is_put_back(tmp_path, capsys):
    """A kill between atomic_dir's two renames leaves `.NAME.old-PID` (the earlier output) and no NAME."""
    pid = _dead_pid()
    out = tmp_path / "ckpt"
    aside = tmp_path / f".ckpt.old-{pid}"
    with atomic_dir(aside, command="quantize") as t:
        (t / "w").write_text("earlier")
    half = tmp_path / f".ckpt.tmp-{pid}"
    half.mkdir()
    (half / "w").write_text("half")
    capsys.readouterr()
    with pytest.raises(InputError, match="pass --overwrite true"):  # what was put back is the command's output
        claim_dir(out, "quantize")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "put back" in err[0] and f"removed .ckpt.tmp-{pid}" in err[1], err
    assert (out / "w").read_text() == "earlier" and not aside.exists() and not half.exists()


def test_a_stale_temporary_file_is_removed_by_the_next_write_of_the_file(tmp_path, capsys):
    from expertcache.telemetry.atomic import check_output

    pid = _dead_pid()
    stale = tmp_path / f".res.json.tmp-{pid}"
    stale.write_text('{"half": ')
    other = tmp_path / f".other.json.tmp-{pid}"  # another output's leftover: not this run's to judge
    other.write_text("x")
    check_output(tmp_path / "res.json")
    assert not stale.exists() and other.exists()
    assert "removed .res.json.tmp-" in capsys.readouterr().err


# --- every writing command, through the CLI ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny bf16 Qwen3-MoE checkpoint carrying everything a trained one does: aux routers, a tokenizer, a
    generation config, a chat template (a file and a folder of them), a README."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tiny_models import build_model, tiny_config
    from transformers import PreTrainedTokenizerFast

    from expertcache.trainer.aux_routers import AuxRouters, config_for

    d = tmp_path_factory.mktemp("src") / "model"
    model = build_model(tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64), seed=5, dtype=torch.bfloat16)
    model.generation_config.temperature = 0.3
    model.generation_config.do_sample = True
    model.save_pretrained(d)
    vocab = {f"w{i}": i for i in range(128)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w0", pad_token="w1", unk_token="w2").save_pretrained(d)
    aux = AuxRouters(config_for(model.float(), True, True, 4, 2, 0.5, 2, 0.5, 2))
    aux.save(d, model)
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool.jinja").write_text("{{ messages[0]['content'] }}")
    (d / "README.md").write_text("a tiny model\n")
    return d


def _cli(argv, capsys) -> tuple[int, list[str]]:
    from expertcache.recipes.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.slow  # every writing command in turn (about 1 s)
def test_a_folder_of_user_files_survives_every_writing_commands_out(ckpt, tmp_path, capsys, monkeypatch):
    import expertcache.runtime.storage.checkpoint as checkpoint

    u, before = _user_folder(tmp_path)
    dummy = tmp_path / "input.bin"
    dummy.write_bytes(b"0")
    smoke = Path(__file__).resolve().parents[1] / "recipes" / "smoke.yaml"
    cases = {
        "quantize": ["quantize", "--model", ckpt, "--bits", "8", "--out", u],
        "quantize --overwrite": ["quantize", "--model", ckpt, "--bits", "8", "--out", u, "--overwrite", "true"],
        "import-gguf": ["import-gguf", "--gguf", dummy, "--out", u, "--overwrite", "true"],
        "analyze": ["analyze", "--trace", dummy, "--out", u, "--overwrite", "true"],
        "bench big": ["bench", "big", "--out_dir", u, "--out", tmp_path / "bb.json"],
        "bench decode": ["bench", "decode", "--replay", "reference", "--store_dir", u, "--out", tmp_path / "bd.json"],
        "pretrain": ["pretrain", "--recipe", smoke, f"out_dir={u}"],
        "train-cache-aware": ["train-cache-aware", "--recipe", "smoke", f"out_dir={u}", f"base={ckpt}"],
        "train-cache-aware sweep": ["train-cache-aware", "--recipe", "sweep", f"out_dir={u}", f"base={ckpt}"],
        "train-cache-aware frontier": ["train-cache-aware", "--recipe", "frontier", f"out_dir={u}", f"base={ckpt}"],
        "serve --trace": ["serve", "--model", ckpt, "--trace", u],
        "trace record": ["trace", "record", "--model", ckpt, "--out", u],
    }
    for name, argv in cases.items():
        rc, err = _cli(argv, capsys)
        assert rc == 2 and len(err) == 1, (name, rc, err)
        assert ("keep.txt, notes/" in err[0]) if name != "trace record" else ("is a folder" in err[0]), (name, err)
        assert _snapshot(u) == before, name
    import shutil

    proj = tmp_path / "proj"  # data build rebuilds OUT/corpus and OUT/tokenizer whole
    shutil.copytree(u, proj / "tokenizer")
    rc, err = _cli(["data", "build", "--out", proj, "--tiny", "true", "--prose_sdist", dummy], capsys)
    assert rc == 2 and len(err) == 1 and "keep.txt, notes/" in err[0] and "`data build`" in err[0], err
    assert _snapshot(proj / "tokenizer") == before and sorted(x.name for x in proj.iterdir()) == ["tokenizer"]
        # verify's index goes to the user cache's folder when the checkpoint's own is read-only (as root nothing is:
    # the one thing stood in for is that permission answer)
    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path))
    monkeypatch.setattr(checkpoint, "_writable", lambda folder: Path(folder).resolve() != ckpt.resolve())
    u.rename(tmp_path / "checksums")
    rc, err = _cli(["verify", "--model", ckpt], capsys)
    assert rc == 2 and len(err) == 1 and "keep.txt, notes/" in err[0] and "`verify`" in err[0], err
    assert _snapshot(tmp_path / "checksums") == before
    (tmp_path / "checksums").rename(u)
    rc, err = _cli(["verify", "--model", ckpt], capsys)  # a cache folder of its own: written and marked
    assert rc == 0, err
    assert output_marker(tmp_path / "checksums")["command"] == "verify"
    assert len(list((tmp_path / "checksums").glob("model-*.json"))) == 1


def test_eval_never_builds_its_task_data_in_a_folder_of_user_files(ckpt, tmp_path, capsys):
    u, before = _user_folder(tmp_path)
    rc, err = _cli(["eval", "--model", ckpt, "--task_dir", u, "--out", tmp_path / "e.json", "--corpus",
                    tmp_path / "no-corpus"], capsys)
    assert rc == 2 and len(err) == 1 and "keep.txt, notes/" in err[0] and "`eval`" in err[0], err
    assert _snapshot(u) == before


def test_quantize_keeps_everything_the_checkpoint_carries(ckpt, tmp_path, capsys):
    from expertcache.runtime.kernels.quant import read_config
    from expertcache.trainer.aux_routers import load_aux_routers
    from expertcache.telemetry.hf import load_causal_lm

    q = tmp_path / "q8"
    rc, err = _cli(["quantize", "--model", ckpt, "--bits", "8", "--out", q], capsys)
    assert rc == 0, err
    src = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*")}
    got = {str(p.relative_to(q)) for p in q.rglob("*")}
    weights = {"model.safetensors"}  # rewritten (the non-expert tensors); experts go to the store
    assert src - got == set(), src - got  # nothing the source carries is missing
    assert got - src == {"experts.ecstore", OUTPUT_MARKER, "config.yaml"}, got - src
    for f in src - weights - {"config.json", "additional_chat_templates"}:
        assert (q / f).read_bytes() == (ckpt / f).read_bytes(), f
    assert read_config(q)["bits"] == 8
    assert json.loads((q / "generation_config.json").read_text())["temperature"] == 0.3
    aux = load_aux_routers(q, load_causal_lm(ckpt, dtype=torch.float32))  # the spatio predictor's routers
    assert aux.cfg.spatio and aux.cfg.temporal

    rc, err = _cli(["quantize", "--model", ckpt, "--bits", "4", "--out", q], capsys)  # its own output: asks first
    assert rc == 2 and len(err) == 1 and "pass --overwrite true" in err[0], err
    assert read_config(q)["bits"] == 8
    rc, err = _cli(["quantize", "--model", ckpt, "--bits", "4", "--out", q, "--overwrite", "true"], capsys)
    assert rc == 0 and read_config(q)["bits"] == 4, err
    assert (q / "aux_routers.safetensors").is_file() and output_marker(q)["command"] == "quantize"

    other = tmp_path / "analysis"  # another command's output, even with --overwrite
    with atomic_dir(other, command="analyze") as t:
        (t / "summary.json").write_text("{}")
    rc, err = _cli(["quantize", "--model", ckpt, "--bits", "8", "--out", other, "--overwrite", "true"], capsys)
    assert rc == 2 and len(err) == 1 and "is the output of `analyze`, not of `quantize`" in err[0], err
    assert (other / "summary.json").read_text() == "{}"

    holder = tmp_path / "holder"  # a folder holding quantize's own --by_usage trace
    holder.mkdir()
    (holder / "trace.parquet").write_bytes(b"PAR1")
    rc, err = _cli(["quantize", "--model", ckpt, "--bits", "4", "--out", holder, "--by_usage",
                    holder / "trace.parquet"], capsys)
    assert rc == 2 and len(err) == 1 and "holds the input" in err[0], err
    assert (holder / "trace.parquet").read_bytes() == b"PAR1"


def test_data_build_rebuilds_its_own_folders(tmp_path, capsys):
    """`data build` replaces its own corpus and tokenizer (an earlier build's, marked or from before markers)."""
    from helpers import make_fake_sdist

    sdist = make_fake_sdist(tmp_path / "s.tar.gz", works=2)
    argv = ["data", "build", "--out", tmp_path / "data", "--tiny", "true", "--prose_sdist", sdist, "--vocab_size",
            "300", "--stdlib_dir", Path(json.__file__).parent]
    for _ in range(2):
        rc, err = _cli(argv, capsys)
        assert rc == 0, err
        for sub in ("corpus", "tokenizer"):
            assert output_marker(tmp_path / "data" / sub) == {"command": "data build", "complete": True}
    (tmp_path / "data" / "corpus" / OUTPUT_MARKER).unlink()  # built before markers: its corpus.json says what it is
    rc, err = _cli(argv, capsys)
    assert rc == 0 and output_marker(tmp_path / "data" / "corpus")["command"] == "data build", err


@pytest.mark.slow  # the analyze CLI twice with plots (about 1.5 s)
def test_analyze_replaces_only_its_own_analysis(tmp_path, capsys):
    """A re-run asks for --overwrite; an analysis from before markers (summary.json and plots) counts as analyze's
    own; the quickstart's re-run passes --overwrite true."""
    import numpy as np
    from helpers import distinct_ids

    from expertcache.telemetry.llamacpp import import_trace

    np.savez(tmp_path / "r.npz", experts=distinct_ids(np.random.default_rng(0), 16, (2, 40, 2)),
             meta=json.dumps({"num_experts": 16}))
    import_trace(tmp_path / "r.npz", tmp_path / "t.parquet")
    out = tmp_path / "an"
    argv = ["analyze", "--trace", tmp_path / "t.parquet", "--out", out, "--domains", "false"]
    rc, err = _cli(argv, capsys)
    assert rc == 0 and output_marker(out) == {"command": "analyze", "complete": True}, err
    assert {"summary.json", "summary.txt", "hit_rate.png", "config.yaml"} <= {f.name for f in out.iterdir()}
    first = (out / "summary.json").read_bytes()
    rc, err = _cli(argv, capsys)
    assert rc == 2 and len(err) == 1 and "pass --overwrite true" in err[0], err
    (out / OUTPUT_MARKER).unlink()  # an analysis written before markers
    (out / "summary.json").write_text('{"stale": true}')
    rc, err = _cli(argv + ["--overwrite", "true"], capsys)
    assert rc == 0 and (out / "summary.json").read_bytes() == first, err
    assert output_marker(out)["command"] == "analyze"
    (out / "mine.csv").write_text("a user's file")  # no longer only what analyze writes: not analyze's to replace
    (out / OUTPUT_MARKER).unlink()
    rc, err = _cli(argv + ["--overwrite", "true"], capsys)
    assert rc == 2 and len(err) == 1 and "mine.csv" in err[0], err
    assert (out / "mine.csv").read_text() == "a user's file"
