"""One meaning per number (issue #24): capacity (a float in (0, 1] is a fraction of E, so 1.0 is all of them; an
integer >= 1 is a count; nothing else), the model's context on every decode path, and routing rows whose experts
are distinct at every entry."""

import numpy as np
import pytest
import torch

from expertcache.runtime.engine.config import EngineConfig
from expertcache.telemetry.cachesim import capacity_count
from expertcache.telemetry.errors import InputError


def test_capacity_a_float_is_a_fraction_an_int_a_count_and_nothing_else():
    assert capacity_count(1.0, 8) == 8  # all of E (it was one expert)
    assert capacity_count(0.25, 8) == 2 and capacity_count(0.01, 8) == 1
    assert capacity_count(1, 8) == 1 and capacity_count(8, 8) == 8 and capacity_count(np.int64(3), 8) == 3
    assert capacity_count(np.float32(0.5), 8) == 4
    for bad, why in ((16.0, "write 16"), (2.5, "a float in"), (0, "a float in"), (-1, "a float in"),
                     (float("nan"), "a float in"), (True, "a float in"), ("0.25", "a float in"),
                     (None, "a float in")):
        with pytest.raises(InputError, match=why):
            capacity_count(bad, 32)
    with pytest.raises(InputError, match="capacity 9 experts, but a layer has only 8"):
        capacity_count(9, 8)
    assert capacity_count(16, None) is None  # the form alone, before a model is known
    with pytest.raises(InputError, match="write 16"):
        EngineConfig(capacity=16.0).check()
    assert EngineConfig(capacity=1.0).slots(8, 2) == 8 and EngineConfig(capacity=1).slots(8, 2) == 1
    assert EngineConfig(capacity=1.0).label() != EngineConfig(capacity=1).label()


def test_capacity_one_point_zero_keeps_all_experts_resident(tmp_path):
    from expertcache.runtime.engine.engine import offload
    from expertcache.runtime.storage.store import write_store
    from tiny_models import build_model, tiny_config

    model = build_model(tiny_config("qwen3_moe"), seed=1).eval()
    write_store(model, tmp_path / "e.store")
    eng = offload(model, tmp_path / "e.store", EngineConfig(capacity=1.0, tier="host"))
    try:
        assert eng.capacity == eng.adapter.num_experts
    finally:
        eng.close()


def test_capacity_on_the_command_line_and_in_recipes_keeps_its_type():
    from expertcache.evals.lm import engine_from_args
    from expertcache.recipes.cli import build_parser
    from expertcache.trainer.cache_aware import CacheAwareRecipe
    from expertcache.trainer.config import RecipeError, load_recipe

    parsers: dict = {}
    build_parser(parsers, only="generate")
    _, p = parsers["generate", None]
    for text, want in (("16", 16), ("1", 1), ("1.0", 1.0), ("0.25", 0.25)):
        got = p.instantiate(p.parse_args(["--engine.capacity", text]))["engine"].capacity
        assert got == want and type(got) is type(want), (text, got)
    parsers = {}
    build_parser(parsers, only="bench")
    _, p = parsers["bench", "decode"]
    assert [type(c) for c in p.parse_args(["--capacities", "[16, 0.25, 1.0]"]).capacities] == [int, float, float]
    assert engine_from_args({"capacity": "16"}).capacity == 16
    assert type(engine_from_args({"capacity": "1.0"}).capacity) is float
    from expertcache.recipes.cli import RECIPE_DIR, resolve_recipe

    loc = resolve_recipe("locality", RECIPE_DIR / "cache-aware")
    r = load_recipe(CacheAwareRecipe, loc, ["serving.capacity=2", "eval.capacities=[0.125, 4, 1.0]"])
    assert type(r.serving.capacity) is int and [type(c) for c in r.eval.capacities] == [float, int, float]
    with pytest.raises(RecipeError, match="write 16"):
        load_recipe(CacheAwareRecipe, loc, ["serving.capacity=16.0"])
    with pytest.raises(RecipeError, match="eval.capacities has capacity 2.5"):
        load_recipe(CacheAwareRecipe, loc, ["eval.capacities=[2.5]"])


def _dup_routing(rng=None):
    from helpers import distinct_ids

    ids = distinct_ids(rng or np.random.default_rng(0), 16, (2, 20, 4)).astype(np.int16)
    ids[1, 5] = [3, 3, 5, 7]
    return ids


def test_a_routing_row_repeating_an_expert_is_refused_at_every_entry(tmp_path):
    import json
    import struct

    import pyarrow as pa
    import pyarrow.parquet as pq

    from expertcache.telemetry.llamacpp import import_trace, read_npz
    from expertcache.telemetry.parquet_trace import TraceMeta, TraceWriter, read_trace
    from expertcache.telemetry.routing import load_routing

    ids = _dup_routing()
    np.savez(tmp_path / "t.npz", experts=ids, meta=json.dumps({"num_experts": 16}))
    for call in (lambda: import_trace(tmp_path / "t.npz", tmp_path / "t.parquet"), lambda: read_npz(tmp_path / "t.npz"),
                 lambda: load_routing(tmp_path / "t.npz")):
        with pytest.raises(InputError, match=r"layer 1, token 5 repeats an expert \(\[3, 3, 5, 7\]\)"):
            call()
    with open(tmp_path / "s.bin", "wb") as f:
        for layer in range(2):
            f.write(struct.pack("<iii", layer, 20, 4) + ids[layer].astype("<i4").tobytes())
    with pytest.raises(InputError, match="repeats an expert"):
        import_trace(tmp_path / "s.bin", tmp_path / "t.parquet", num_experts=16)
    assert not (tmp_path / "t.parquet").exists()
    meta = TraceMeta(model="m", family="qwen3_moe", num_layers=2, moe_layers=[0, 1], num_experts=16, top_k=4)
    rows = ids.transpose(1, 0, 2).reshape(-1, 4)
    n = len(rows)
    cols = dict(seq_id=np.zeros(n, np.int32), pos=np.arange(n, dtype=np.int32) // 2,
                layer=np.tile(np.asarray([0, 1], np.int16), n // 2), phase="decode", domain="code",
                token=np.zeros(n, np.int32), weights=np.ones((n, 4), np.float16))
    with pytest.raises(InputError, match="repeats an expert"):
        with TraceWriter(tmp_path / "w.parquet", meta) as w:
            w.write(ids=rows, **cols)
    ok = rows.copy()
    ok[11] = [3, 4, 5, 7]
    with TraceWriter(tmp_path / "w.parquet", meta) as w:
        w.write(ids=ok, **cols)
    t = pq.read_table(tmp_path / "w.parquet")  # written by another tool: the same file, one row repeating
    t = t.set_column(t.column_names.index("ids"), "ids",
                     pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1).astype(np.int16)), 4))
    pq.write_table(t, tmp_path / "other.parquet")
    with pytest.raises(InputError, match="row 11 repeats an expert"):
        read_trace(tmp_path / "other.parquet")
    with pytest.raises(InputError, match="repeats an expert"):
        load_routing(tmp_path / "other.parquet")


def test_a_non_finite_estimator_or_policy_file_is_refused(tmp_path):
    import json

    from safetensors.numpy import save_file as save_np
    from safetensors.torch import save_file

    from expertcache.runtime.engine.predictors import EstimatorPredictor, make_predictor
    from expertcache.telemetry.learned_policy import KIND, LearnedPolicy
    from tiny_models import build_model, tiny_config

    model = build_model(tiny_config("qwen3_moe"), seed=1).eval()
    h, e, n_l = model.config.hidden_size, model.config.num_experts, model.config.num_hidden_layers
    meta = {"kind": "expertcache-estimator", "trace": "{}"}
    good = {"weights": torch.zeros(n_l - 1, h, e), "bias": torch.zeros(n_l - 1, e)}
    save_file(good, str(tmp_path / "ok.safetensors"), metadata=meta)
    assert make_predictor(f"estimator:{tmp_path / 'ok.safetensors'}", model, None, e, h).name == "estimator"
    for name in ("weights", "bias"):
        t = dict(good)
        t[name] = torch.full_like(good[name], float("nan"))
        save_file(t, str(tmp_path / f"{name}.safetensors"), metadata=meta)
        with pytest.raises(InputError, match=f"{name} holds .* non-finite"):
            make_predictor(f"estimator:{tmp_path / f'{name}.safetensors'}", model, None, e, h)
        with pytest.raises(InputError, match="non-finite"):
            EstimatorPredictor.load(tmp_path / f"{name}.safetensors", e, h)
    save_np({"w0": np.full((3, 3), np.inf)}, str(tmp_path / "p.safetensors"),
            metadata={"kind": KIND, "policy": json.dumps({})})
    with pytest.raises(InputError, match="w0 holds non-finite"):
        LearnedPolicy.load(tmp_path / "p.safetensors")
    for spec in ("probe:x", "probe:0", "probe:-1"):  # a malformed spec: one line, not a ValueError
        with pytest.raises(InputError, match="expected probe:<D>"):
            make_predictor(spec, model)
    with pytest.raises(InputError, match="unknown predictor 'probex'; expected one of: none, probe"):
        make_predictor("probex", model)


def test_eval_blocks_longer_than_the_models_positions_are_refused(tiny_data, tmp_path, capsys):
    """The step-wise evaluation scores each block one position per token: a --seq_len past the model's context is
    refused in check_context's words, before any block is read."""
    from tiny_lm import make_tiny_checkpoint

    from expertcache.recipes.cli import main

    ckpt = make_tiny_checkpoint(tmp_path / "m", max_positions=64)
    capsys.readouterr()
    rc = main(["eval", "--model", str(ckpt), "--corpus", tiny_data["corpus"], "--tasks", "[]", "--ppl_blocks", "1",
               "--seq_len", "100", "--out", str(tmp_path / "e.json")])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert rc == 2 and len(err) == 1 and "this model's context is 64 positions: --seq_len 100 has 100 tokens" in err[0]
    assert not (tmp_path / "e.json").exists()


def test_every_decode_path_checks_prompt_and_new_tokens_against_the_models_positions(tmp_path, capsys):
    """#24 finding 6: `generate --max_tokens 100000` decoded past a 1,024-position model; serve refused it."""
    from tiny_lm import make_tiny_checkpoint

    from expertcache.recipes.cli import main
    from expertcache.runtime.serve.generate import Generation
    from expertcache.runtime.storage.loader import load_model
    from expertcache.runtime.serve.request import SamplingParams
    from expertcache.telemetry.recorder import record_blocks

    ckpt = make_tiny_checkpoint(tmp_path / "m", max_positions=64)
    capsys.readouterr()
    rc = main(["generate", "--model", str(ckpt), "--prompt", "thou art", "--max_tokens", "100000",
               "--engine.tier", "host"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "this model's context is 64 positions" in err[0], err
    assert main(["generate", "--model", str(ckpt), "--prompt", "thou " * 80, "--max_tokens", "1", "--plain",
                 "true"]) == 2
    assert "shorten the prompt" in capsys.readouterr().err
    model, tok = load_model(ckpt, plain=True)
    with pytest.raises(InputError, match="at most 54 new tokens fit"):
        Generation(model, tok, list(range(10)), SamplingParams(max_tokens=55))
    Generation(model, tok, list(range(10)), SamplingParams(max_tokens=54))  # exactly the context: fine
    with pytest.raises(InputError, match="prompt_len has 60 tokens and decode_tokens=8"):
        record_blocks(model, np.zeros((1, 60), np.int64), None, "code", 60, 8, 1)


def test_names_are_checked_before_work_and_the_cli_reads_what_it_documents(tmp_path, capsys):
    from tiny_lm import make_tiny_checkpoint

    from expertcache.recipes.cli import _rewrite, main
    from expertcache.runtime.engine.predictors import check_predictor_spec

    with pytest.raises(InputError, match="kernel triton runs on CUDA slots only"):
        EngineConfig(kernel="triton").check()  # on a CPU it used to run the native path without a word
    for spec in ("probe:1", "persistence", "spatio", "none"):
        check_predictor_spec(spec)
    for spec, why in (("probe:x", "expected probe:<D>"), ("oracle", "a replay's predictor"),
                      ("estimator:/nope.safetensors", "not found"), ("prob", "unknown predictor")):
        with pytest.raises(InputError, match=why):
            check_predictor_spec(spec)
    ckpt = make_tiny_checkpoint(tmp_path / "m", max_positions=64)
    capsys.readouterr()
    rc = main(["bench", "decode", "--model", str(ckpt), "--corpus", str(tmp_path / "none"), "--prompt_len", "4",
               "--tokens", "2", "--warmup", "0", "--rounds", "1", "--prompts", "1",
               "--predictors", "[probe:1,persistence,bogus]"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown predictor 'bogus'" in err and "decode passes" not in err  # before any pass
    argv = _rewrite(["train-cache-aware", "--table", "[runs/a,runs/b]"])
    assert '--table=["runs/a", "runs/b"]' in argv  # the brackets are a list, not part of a folder name
    assert '--table=["runs/a", "runs/b"]' in _rewrite(["train-cache-aware", "--table", "runs/a", "runs/b"])


def test_the_last_raw_tracebacks_are_one_line(tmp_path, monkeypatch, capsys):
    """#24 finding 11: trace metadata that disagrees with its data, a full disk, Python API arguments of the wrong
    type: each one InputError (one line, exit 2 from the CLI), not a traceback."""
    import errno
    import json
    import os

    import pyarrow.parquet as pq
    from helpers import distinct_ids

    import expertcache.telemetry.atomic as atomic
    from expertcache.recipes.cli import main
    from expertcache.runtime import load
    from expertcache.telemetry.llamacpp import import_trace
    from expertcache.telemetry.parquet_trace import META_KEY, TraceWriter, read_trace

    np.savez(tmp_path / "r.npz", experts=distinct_ids(np.random.default_rng(0), 16, (2, 30, 4)).astype(np.int16),
             meta=json.dumps({"num_experts": 16}))
    import_trace(tmp_path / "r.npz", tmp_path / "t.parquet")
    t = pq.read_table(tmp_path / "t.parquet")
    md = dict(t.schema.metadata)
    for change, why in (({"moe_layers": [0, 1, 2], "num_layers": 3}, r"no row holds layer\(s\) \[2\]"),
                        ({"num_layers": 1}, "at least the 2 MoE layers")):
        meta = json.loads(md[META_KEY]) | change
        pq.write_table(t.replace_schema_metadata(md | {META_KEY: json.dumps(meta).encode()}), tmp_path / "m.parquet")
        with pytest.raises(InputError, match=why):  # analyze used to die with an IndexError
            read_trace(tmp_path / "m.parquet")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "out"))
    monkeypatch.setattr(TraceWriter, "write", full)
    capsys.readouterr()
    assert main(["trace", "import", "--src", str(tmp_path / "r.npz"), "--out", str(tmp_path / "full.parquet")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert not (tmp_path / "full.parquet").exists() and not list(tmp_path.glob(".full.parquet.tmp-*"))
    monkeypatch.setattr(atomic, "write_bytes", full)
    assert main(["analyze", "--trace", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "an")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    monkeypatch.undo()
    for kw, why in ((dict(model=123), "expected a checkpoint folder"), (dict(predictor=5), "predictor name"),
                    (dict(engine=EngineConfig(workers="4")), "workers='4'; expected an integer"),
                    (dict(verify="yes"), "verify='yes'"), (dict(tier=None), "tier=None; expected a string"),
                    (dict(engine=EngineConfig(tau="x")), "tau='x'"),
                    (dict(tau=0.2), r"engine=EngineConfig\(tau=0.2\)")):
        with pytest.raises(InputError, match=why):
            load(**({"model": str(tmp_path / "nothing")} | kw))
    for kw in (dict(policy=3), dict(max_inflight_bytes=None), dict(workers=2.5), dict(tau=True)):
        with pytest.raises(InputError, match="expected"):
            EngineConfig(**kw).check()


def test_an_analysis_that_fails_midway_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    """#24 'same for every command that writes': analyze writes its files into a folder of its own and moves them
    in once all are written; a failure after summary.json used to leave it beside an older run's plots."""
    import json

    import expertcache.telemetry.analysis as analysis
    from expertcache.recipes.cli import main
    from expertcache.telemetry.llamacpp import import_trace
    from helpers import distinct_ids

    for seed in (0, 1):
        np.savez(tmp_path / f"r{seed}.npz", experts=distinct_ids(np.random.default_rng(seed), 16, (2, 40, 2)),
                 meta=json.dumps({"num_experts": 16}))
        import_trace(tmp_path / f"r{seed}.npz", tmp_path / f"t{seed}.parquet")
    out = tmp_path / "an"
    assert main(["analyze", "--trace", str(tmp_path / "t0.parquet"), "--out", str(out), "--domains", "false"]) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}

    def boom(*a, **k):
        raise InputError("disk went away")
    monkeypatch.setattr(analysis, "plot_summary", boom)  # after summary.json is written
    assert main(["analyze", "--trace", str(tmp_path / "t1.parquet"), "--out", str(out), "--domains", "false"]) == 2
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # no temporary folder left either
