"""Pretraining on the tiny corpus: real Lightning runs, real checkpoints, a real kill and resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from expertcache.trainer.config import load_recipe
from expertcache.trainer.pretrain import PretrainRecipe, read_metrics, run_pretrain
from helpers import smoke_overrides


def _recipe(tiny_data, out, **extra):
    return load_recipe(PretrainRecipe, "recipes/smoke.yaml" if Path("recipes/smoke.yaml").is_file() else None,
                       smoke_overrides(tiny_data, out, **extra))


@pytest.fixture(scope="module")
def straight_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    metrics = run_pretrain(_recipe(tiny_data, out))
    return out, metrics


def test_smoke_run_writes_a_plain_hf_checkpoint(straight_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, metrics = straight_run
    assert metrics["global_step"] == 30 and metrics["resumed_from_step"] == 0
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (out / "model" / "model.safetensors").is_file()
    assert model.config.vocab_size == len(tok)
    val = metrics["validation"]
    assert set(val["ppl"]) == {"code", "prose", "math", "overall"}
    # trained for 30 steps: far better than a uniform guess over the vocabulary
    assert val["ppl"]["overall"] < 0.5 * len(tok), val["ppl"]
    assert len(val["expert_entropy"]) == model.config.num_hidden_layers
    assert all(0 < e <= val["max_entropy"] + 1e-6 for e in val["expert_entropy"])
    assert (out / "training_curve.png").stat().st_size > 5000
    assert (out / "recipe.yaml").is_file() and (out / "logs" / "version_0" / "metrics.csv").is_file()


def test_killed_run_resumes_to_the_same_weights(tiny_data, straight_run, tmp_path):
    """SIGKILL a run after its first checkpoints, re-run the same command: same final weights as straight through."""
    ref_dir, _ = straight_run
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "expertcache.recipes.cli", "pretrain", "--recipe", "smoke",
           *smoke_overrides(tiny_data, out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = out / "checkpoints" / "step10.ckpt"
    deadline = time.time() + 180
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt.exists(), "the run never reached its step-10 checkpoint"
    assert not (out / "metrics.json").exists(), "the run finished before it was killed; nothing was tested"

    metrics = run_pretrain(_recipe(tiny_data, out))
    assert 10 <= metrics["resumed_from_step"] < 30
    # the first run's log survives the second: the curve has steps from both
    steps = {int(r["step"]) for r in read_metrics(out / "logs") if r.get("train/loss")}
    assert min(steps) < 10 and max(steps) >= 25, sorted(steps)
    assert metrics["global_step"] == 30
    # Same batches in the same order with the same optimizer state: the logged losses of the resumed run equal
    # the straight run's at every step (a skipped or repeated batch moves them at the 1e-2 level).
    def losses(d):
        return {int(r["step"]): float(r["train/loss"]) for r in read_metrics(d / "logs") if r.get("train/loss")}
    ref_l, got_l = losses(ref_dir), losses(out)
    # Lightning logs a step's loss after its checkpoint callback, so a kill can drop that one step's row.
    assert set(got_l) <= set(ref_l) and len(set(ref_l) - set(got_l)) <= 1, (sorted(ref_l), sorted(got_l))
    assert {s for s in ref_l if s >= metrics["resumed_from_step"]} <= set(got_l)
    for step in got_l:
        assert got_l[step] == pytest.approx(ref_l[step], rel=1e-4), (step, ref_l[step], got_l[step])
    # Weights agree up to float reordering noise (two straight runs differ by ~3e-6; Adam amplifies it).
    ref = torch.load(ref_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    got = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert ref.keys() == got.keys()
    worst = max(float((ref[k] - got[k]).abs().max()) for k in ref)
    assert worst < 2e-3, f"resumed weights differ from the straight run by up to {worst}"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "expertcache.recipes.cli", *args], capture_output=True, text=True)


def test_cli_rejects_unknown_recipe_key_in_one_line(tiny_data, tmp_path):
    r = _cli("pretrain", "--recipe", "smoke", "train.max_step=3", f"out_dir={tmp_path}")
    assert r.returncode == 2
    assert "unknown recipe key train.max_step" in r.stderr and "Traceback" not in r.stderr


def test_cli_rejects_missing_data_dir(tmp_path):
    r = _cli("pretrain", "--recipe", "smoke", f"data.corpus={tmp_path}/nodata", f"out_dir={tmp_path}/o")
    assert r.returncode == 2
    assert f"no corpus at {tmp_path}/nodata" in r.stderr and "Traceback" not in r.stderr


def test_tokenizer_model_vocab_mismatch_is_rejected(tiny_data, straight_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.telemetry.errors import InputError
    from expertcache.trainer.evaluate import check_vocab

    out, _ = straight_run
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    big = AutoTokenizer.from_pretrained(tiny_data["tokenizer"])
    big.add_tokens([f"<extra_{i}>" for i in range(10)])
    with pytest.raises(InputError, match=r"tokenizer has 522 tokens but the model's vocabulary is 512"):
        check_vocab(big, model.config)


def test_cli_data_build_reports_missing_source(tmp_path):
    r = _cli("data", "build", "--out", str(tmp_path), "--prose_sdist", str(tmp_path / "x.tar.gz"), "--tiny", "true")
    assert r.returncode == 2 and "x.tar.gz not found" in r.stderr and "Traceback" not in r.stderr
