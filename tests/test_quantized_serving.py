"""An `expertcache quantize` checkpoint is served wherever a model is served, at every capacity and with no engine
option (#46 item 5: `eval` of one failed with "its weights do not fit its config (8 missing keys)" until
`--engine.capacity 1.0` was added). Its experts are packed in its own store, so it is always served by the engine;
an explicit plain path is refused in one line. The tiny model has 8 experts, top-2: capacity 0.125 is one resident
expert per layer, fewer than a token routes to."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_lm import make_tiny_checkpoint, one_torch_thread  # noqa: F401 - autouse fixture

from expertcache.recipes.cli import main

TEXT = ("thou art the sun and the moon and the stars\n\n"
        "the king is dead long live the king and all his men\n\n"
        "what light through yonder window breaks it is the east\n")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(int8 copy, its float32 source, a text file) on disk."""
    from expertcache.runtime.kernels.quant_write import write_quantized

    root = tmp_path_factory.mktemp("qserve")
    src = make_tiny_checkpoint(root / "fp32", moe_intermediate_size=32, max_positions=256)
    write_quantized(src, root / "q8", 8, 32)
    (root / "text.txt").write_text(TEXT)
    return root / "q8", src, root / "text.txt"


def _eval(q, text, out, *engine):
    assert main(["eval", "--model", str(q), "--tasks", "[]", "--ppl_file", str(text), "--seq_len", "8",
                 "--ppl_blocks", "3", "--out", str(out), *engine]) == 0
    return json.loads(out.read_text())


def test_eval_serves_a_quantized_checkpoint_at_every_capacity_and_with_no_engine_option(quantized, tmp_path):
    q, src, text = quantized
    bare = _eval(q, text, tmp_path / "none.json")
    assert bare["engine"]["capacity"] == 1.0 and bare["policy"] != "plain"  # said as served, not as plain
    assert bare["stepwise"]["engine"]["hit_rate"] == 1.0
    ppl = bare["stepwise"]["ppl"]["overall"]
    assert math.isfinite(ppl) and ppl > 1
    for cap in ("0.125", "0.25", "1.0"):
        r = _eval(q, text, tmp_path / f"{cap}.json", "--engine.capacity", cap)
        assert r["engine"]["capacity"] == float(cap)
        # the default miss policy loads what a token routes to: the same model at every capacity
        assert r["stepwise"]["ppl"]["overall"] == pytest.approx(ppl, rel=1e-5)
        assert (r["stepwise"]["engine"]["hit_rate"] < 1.0) == (cap != "1.0")
    plain_src = _eval(src, text, tmp_path / "src.json")  # its fp32 source is still the plain model
    assert plain_src["engine"] is None
    assert plain_src["stepwise"]["ppl"]["overall"] == pytest.approx(ppl, rel=0.05)  # int8: near, not equal
    assert plain_src["stepwise"]["ppl"]["overall"] != ppl


def test_the_lm_eval_model_serves_a_quantized_checkpoint_at_every_capacity(quantized):
    from expertcache.evals.lm import ExpertCacheLM

    q, _, _ = quantized
    ids = torch.tensor([[5, 9, 17, 3, 44, 12, 8, 30]])
    logits = {}
    for args in ({}, {"capacity": "0.125"}, {"capacity": "0.25"}, {"capacity": "1.0"}):
        lm = ExpertCacheLM(str(q), batch_size=1, **args)
        assert lm.engine is not None and lm.engine.cfg.capacity == float(args.get("capacity", 1.0))
        with torch.no_grad():
            logits[args.get("capacity")] = lm._model_call(ids).float()
        assert lm.model.config.quantization_config is not None  # handed back after lm-eval's wrapper was built
        lm.engine.close()
    ref = logits[None]
    assert ref.shape == (1, 8, lm.model.config.vocab_size) and torch.isfinite(ref).all()
    for cap, x in logits.items():
        torch.testing.assert_close(x, ref, rtol=1e-4, atol=1e-4, msg=f"capacity {cap}")


def _generated(capsys, q, *args) -> str:
    capsys.readouterr()
    assert main(["generate", "--model", str(q), "--prompt", "thou art", "--max_tokens", "6", "--raw", "true", "--temperature", "0",
                 *args]) == 0
    return capsys.readouterr().out


def test_generate_serves_a_quantized_checkpoint_at_every_capacity_and_refuses_plain(quantized, capsys):
    q, _, _ = quantized
    bare = _generated(capsys, q)
    assert bare.strip()
    for cap in ("0.125", "0.25", "1.0"):
        assert _generated(capsys, q, "--engine.capacity", cap) == bare  # greedy and lossless: the same tokens
    assert main(["generate", "--model", str(q), "--prompt", "hi", "--max_tokens", "2", "--plain", "true"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "quantized checkpoint" in err[0] and "leave --plain out" in err[0], err


def test_serve_answers_from_a_quantized_checkpoint_at_every_capacity(quantized):
    from fastapi.testclient import TestClient

    from expertcache.runtime.commands import _talk_model
    from expertcache.runtime.engine.config import EngineConfig
    from expertcache.runtime.serve.serve import create_app

    q, _, _ = quantized
    texts = {}
    for cap in (None, 0.125, 0.25):  # None: serve's own default engine, as with no --engine option
        m, tok, _ = _talk_model(str(q), EngineConfig() if cap is None else EngineConfig(capacity=cap), None, False)
        assert m.expertcache is not None
        with TestClient(create_app(m, tok, "q8", torch_threads=1)) as c:
            r = c.post("/v1/completions", json={"prompt": "thou art", "max_tokens": 5, "temperature": 0})
            assert r.status_code == 200, r.text
            texts[cap] = r.json()["choices"][0]["text"]
        m.expertcache.close()
    assert texts[None] and texts[0.125] == texts[None] == texts[0.25]


@pytest.mark.slow  # a benchmark at three capacities (2-5 s)
def test_bench_decode_runs_a_quantized_checkpoint_at_every_capacity(quantized, tmp_path, capsys):
    q, _, _ = quantized
    base = ["bench", "decode", "--model", str(q), "--corpus", str(tmp_path / "none"), "--prompt_len", "4",
            "--tokens", "2", "--warmup", "0", "--rounds", "1", "--prompts", "1"]
    assert main([*base, "--capacities", "[0.125,0.25,1.0]", "--out", str(tmp_path / "b.json")]) == 0
    written = json.loads((tmp_path / "b.json").read_text())
    configs = written["configs"]
    # the one result writer: provenance taken before the run, the command's resolved configuration, the command
    assert written["provenance"]["commit"] == written["git_commit"].removesuffix("+dirty")
    assert written["config"]["capacities"] == [0.125, 0.25, 1.0] and written["config"]["engine"]["tier"] == "disk"
    assert written["config"]["model"] == f".../{q.name}" and written["command"] == (  # no machine's folders
        f"expertcache bench decode --model .../{q.name} --capacities [0.125,0.25,1.0] --tokens 2 --warmup 0 "
        f"--rounds 1 --prompts 1 --prompt_len 4 --corpus .../none --out .../b.json")
    assert "plain" not in configs  # a quantized checkpoint has no plain reference (not run by default)
    hits = {cap: configs[f"on-demand@{cap}"]["hits"] / configs[f"on-demand@{cap}"]["accesses"]
            for cap in ("0.125", "0.25", "1")}
    assert configs["resident"]["hits"] == configs["resident"]["accesses"] > 0
    assert hits["0.125"] <= hits["0.25"] < hits["1"] == 1.0  # fewer resident experts, fewer hits
    assert all(c["tokens"] == 2 and c["tpot_median_s"] > 0 for c in configs.values())
    capsys.readouterr()
    assert main([*base, "--plain", "true"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "quantized checkpoint" in err[0], err
