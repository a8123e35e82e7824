"""A few representative rows of the bad-input table (scripts/bad_inputs.py builds the whole table): each is one
line on stderr, exit status 2, no traceback, and the files it was pointed at are left as they were."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, distinct_ids

pytestmark = pytest.mark.slow  # end-to-end: trains, evaluates or runs the CLI in subprocesses (`make test-fast` skips)


def _one_line(r, *needles):
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and lines and ": error: " in lines[-1], r.stderr[-2000:]
    assert all(n in lines[-1] for n in needles), lines[-1]


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture
def npz(tmp_path):
    p = tmp_path / "routing.npz"
    ids = distinct_ids(np.random.default_rng(0), 16, (4, 64, 4)).astype(np.int16)
    np.savez(p, experts=ids, meta=np.array(json.dumps({"num_experts": 16})))
    return p


def test_an_output_equal_to_an_input_is_refused_before_any_work(npz, tmp_path):
    before = _digest(npz)
    r = cli("bench", "decode", "--replay", npz, "--out", npz, "--store_dir", tmp_path / "st", "--tokens", 2)
    _one_line(r, "also an input")
    r = cli("fit-predictor", "--trace", npz, "--out", npz)
    _one_line(r, "also an input")
    assert _digest(npz) == before and not (tmp_path / "st").exists()


def test_bench_big_reads_its_trace_before_writing_a_checkpoint(tmp_path):
    r = cli("bench", "big", "--out_dir", tmp_path / "big", "--trace", tmp_path / "none.npz",
             "--out", tmp_path / "big.json")
    _one_line(r, "none.npz")
    assert not list((tmp_path / "big").glob("**/*.safetensors"))  # no checkpoint written (none, if no folder)
    _one_line(cli("bench", "big", "--out_dir", tmp_path / "big", "--layers", 0), "--layers 0")


def test_a_replay_store_that_does_not_fit_is_refused_before_it_is_written(tmp_path):
    from expertcache.runtime.bench.replay import check_replay_fits
    from expertcache.telemetry.errors import InputError

    with pytest.raises(InputError, match="does not fit the free disk"):
        check_replay_fits(tmp_path, 4, 16, 200_000, 200_000, "bfloat16", 3 * 200_000 ** 2 * 2, "disk", 0.25)
    with pytest.raises(InputError, match="in RAM"):  # on disk already: the host tier would hold it all in RAM
        (tmp_path / "replay-4x16-200000x200000-bfloat16.store").write_bytes(b"")
        check_replay_fits(tmp_path, 4, 16, 200_000, 200_000, "bfloat16", 3 * 200_000 ** 2 * 2, "host", 0.25)
    assert not [p for p in tmp_path.iterdir() if p.stat().st_size]


@pytest.mark.parametrize("override, needle", [("train.lr=nan", "train.lr=nan"),
                                              ("data.batch_size=0", "data.batch_size=0"),
                                              ("routers.rank=0", "routers.rank=0")])
def test_recipe_ranges_are_one_line(tmp_path, override, needle):
    cmd = "train-cache-aware" if override.startswith("routers") else "pretrain"
    _one_line(cli(cmd, "--recipe", "smoke", override, f"out_dir={tmp_path}/o"), needle)
    assert not (tmp_path / "o").exists()


def test_a_yaml_tag_never_runs(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text(f"!!python/object/apply:os.system ['touch {tmp_path}/PWNED']\n")
    _one_line(cli("pretrain", "--recipe", bad), "r.yaml")
    _one_line(cli("trace-info", "--config", bad))
    assert not (tmp_path / "PWNED").exists()


def test_gate_inputs_that_are_not_eval_results(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text('{"stepwise": ')
    _one_line(cli("gate", "--baseline", tmp_path / "list.json", "--candidate", tmp_path / "bad.json"), "list.json")
    _one_line(cli("gate", "--baseline", tmp_path / "none.json", "--candidate", tmp_path / "bad.json"), "none.json")


def test_a_damaged_checkpoint_is_one_input_error(tmp_path):
    from tiny_lm import make_tiny_checkpoint

    from expertcache.telemetry.errors import InputError
    from expertcache.telemetry.hf import load_causal_lm

    ck = make_tiny_checkpoint(tmp_path / "m")
    load_causal_lm(ck)
    w = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(w[: len(w) // 2])
    with pytest.raises(InputError, match="does not load"):
        load_causal_lm(ck)
    (ck / "config.json").write_text("{")
    with pytest.raises(InputError, match="does not load"):
        load_causal_lm(ck)
    (ck / "config.json").unlink()
    with pytest.raises(InputError, match="no HF checkpoint"):
        load_causal_lm(ck)


def test_check_output_refuses_inputs_and_their_files(tmp_path):
    from expertcache.telemetry.atomic import check_output
    from expertcache.telemetry.errors import InputError

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "t.parquet").write_bytes(b"x")
    with pytest.raises(InputError, match="also an input"):
        check_output(tmp_path / "t.parquet", [tmp_path / "t.parquet"])
    with pytest.raises(InputError, match="input folder"):
        check_output(tmp_path / "m" / "model.safetensors", tmp_path / "m")
    with pytest.raises(InputError, match="is a folder"):
        check_output(tmp_path / "m", None)
    with pytest.raises(InputError, match="is a file"):
        check_output(tmp_path / "t.parquet", None, folder=True)
    check_output(tmp_path / "m" / "new.json", tmp_path / "m")  # a new file beside the checkpoint: fine
    check_output(tmp_path / "new" / "deeper" / "out.json", tmp_path / "t.parquet")


def test_a_list_option_given_one_bare_value_says_how_a_list_is_written(tmp_path):
    """`--tasks ec_cloze_code` printed jsonargparse's "Does not validate against any of the Union subtypes ..."."""
    r = cli("eval", "--model", tmp_path / "m", "--tasks", "ec_cloze_code")
    _one_line(r, "--tasks takes a list, written [a,b]", "got ec_cloze_code")
    assert "Union" not in r.stderr


@pytest.mark.parametrize("argv, needle", [
    (["analyze", "--trace", "t.parquet", "--out", "a", "--phase", "middle"],
     "expertcache analyze: error: --phase: expected one of decode, prefill, all; got middle"),
    (["eval", "--model", "m", "--limit", "abc"],
     "expertcache eval: error: --limit: expected an integer or nothing; got abc"),
    (["serve", "--model", "m", "--port", "http"], "expertcache serve: error: --port: expected an integer; got http"),
    (["trace", "record", "--corpus", "c"], "expertcache trace record: error: --model is required"),
])
def test_a_value_of_the_wrong_type_is_one_line_in_the_options_own_spelling(argv, needle, capsys):
    """jsonargparse's own wording (`Parser key "port": Expected a <class 'int'>. Got value: http`, `the following
    arguments are required: bench.checksum.model`, a `typing.Literal[...]`) under the command's name with its action
    (`bench checksum`, not `bench`) becomes one line naming the option as it is typed."""
    from expertcache.recipes.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [needle], err
