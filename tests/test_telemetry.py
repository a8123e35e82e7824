"""Recorder exactness on every family, the trace format, interruption safety, llama.cpp import."""

import json
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from helpers import REPO, distinct_ids
from tiny_models import FAMILIES, build_model, tiny_config

from expertcache.telemetry.adapters import adapter_for
from expertcache.telemetry.errors import InputError
from expertcache.telemetry.llamacpp import import_trace, read_stream
from expertcache.telemetry.parquet_trace import TraceWriter, check_compatible, info, read_trace
from expertcache.telemetry.recorder import Recorder, record_blocks


def record_with_truth(family, tmp_path, hidden=False):
    """Record a tiny model while an independent hook captures what its experts modules actually received."""
    model = build_model(tiny_config(family), seed=1)
    truth = {}
    handles = [L.experts.register_forward_hook(
        lambda mod, args, out, i=L.index: truth.setdefault(i, []).append((args[1].clone(), args[2].clone())))
        for L in adapter_for(model).moe_layers(model)]
    blocks = np.random.default_rng(0).integers(2, 128, (5, 12))
    path = tmp_path / f"{family}.parquet"
    with TraceWriter(path, Recorder(model).meta("tiny"), with_hidden=hidden, with_logits=hidden) as w:
        record_blocks(model, blocks, w, "code", prompt_len=7, decode_tokens=5, batch_size=2)
    for h in handles:
        h.remove()
    return model, truth, read_trace(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_ids_equal_the_models_own_routing_on_every_row(family, tmp_path):
    model, truth, tr = record_with_truth(family, tmp_path)
    ids, seq, pos = tr.routing()
    n_seq, prompt, dec = 5, 7, 5
    assert ids.shape[1] == n_seq * (prompt + dec)
    assert info(tr.path)["tokens_by_phase"] == {"prefill": n_seq * prompt, "decode": n_seq * dec}
    weights = tr.fixed("weights")
    for li, layer in enumerate(tr.meta.moe_layers):
        # Rebuild (seq, pos) -> ids from the experts' own inputs: per batch, one prefill call then decode calls.
        expected = {}
        calls = iter(truth[layer])
        for b0 in range(0, n_seq, 2):
            b = min(2, n_seq - b0)
            got, _ = next(calls)
            for r in range(b * prompt):
                expected[(b0 + r // prompt, r % prompt)] = sorted(got[r].tolist())
            for j in range(dec):
                got, _ = next(calls)
                for r in range(b):
                    expected[(b0 + r, prompt + j)] = sorted(got[r].tolist())
        rows = [sorted(ids[li, t].tolist()) == expected[(int(seq[t]), int(pos[t]))] for t in range(ids.shape[1])]
        assert all(rows), f"{family} layer {layer}: {rows.count(False)} of {len(rows)} rows differ"
    assert np.isfinite(weights.astype(np.float32)).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_rule_reproduces_the_recorded_routing(family, tmp_path):
    model, _, tr = record_with_truth(family, tmp_path, hidden=True)
    a = adapter_for(model)
    ids, _, _ = tr.routing()
    hidden = tr.layer_matrix("hidden")
    layers = a.moe_layers(model)
    agree = []
    for i, L in enumerate(layers):
        with torch.no_grad():
            pred, w = a.route(a.router_logits(L.router, torch.from_numpy(hidden[i].astype(np.float32))),
                              a.router_bias(L.router))
        agree.append((np.sort(pred.numpy(), 1) == np.sort(ids[i], 1)).all(1).mean())
    # hidden states are stored in float16, so a near-tie can flip; the rule itself is exact (test_adapters)
    assert min(agree) > 0.97, agree


@pytest.mark.parametrize("family", FAMILIES)
def test_route_rule_is_exact_on_the_router_itself(family):
    model = build_model(tiny_config(family), seed=2)
    a = adapter_for(model)
    h = torch.randn(64, 32)
    for L in a.moe_layers(model):
        with torch.no_grad():
            logits, w, ids = L.router(h)
            ids2, w2 = a.route(a.router_logits(L.router, h), a.router_bias(L.router))
        order1, order2 = ids.sort(-1), ids2.sort(-1)
        assert torch.equal(order1.values, order2.values)
        assert torch.allclose(w.float().gather(1, order1.indices), w2.gather(1, order2.indices), atol=1e-6)


def test_trace_is_readable_without_this_package(tmp_path):
    _, _, tr = record_with_truth("qwen3_moe", tmp_path)
    import duckdb
    import pandas as pd
    import polars as pl

    df = pd.read_parquet(tr.path)
    assert len(df) == tr.num_rows and set(df["phase"]) == {"prefill", "decode"}
    assert pl.read_parquet(tr.path).height == tr.num_rows
    n = duckdb.sql(f"select count(*) from '{tr.path}' where phase = 'decode'").fetchall()[0][0]
    assert n == 5 * 5 * 2  # sequences x decode tokens x MoE layers
    meta = json.loads(pq.read_schema(tr.path).metadata[b"expertcache"])
    assert meta["num_experts"] == 8 and meta["top_k"] == 2 and meta["family"] == "qwen3_moe"


def test_trace_from_another_model_is_rejected(tmp_path):
    _, _, tr = record_with_truth("qwen3_moe", tmp_path)
    other = build_model(tiny_config("qwen3_moe", num_experts=16))
    with pytest.raises(InputError, match="trace has 8 experts per layer, model has 16"):
        check_compatible(tr.meta, other)
    with pytest.raises(InputError, match="trace has top-2 routing, model has top-4"):
        check_compatible(tr.meta, build_model(tiny_config("qwen3_moe", num_experts_per_tok=4)))
    with pytest.raises(InputError, match="not found"):
        read_trace(tmp_path / "missing.parquet")
    (tmp_path / "junk.parquet").write_text("junk")
    with pytest.raises(InputError, match="not a readable Parquet trace"):
        read_trace(tmp_path / "junk.parquet")


RECORD_FOREVER = """
import sys, numpy as np
sys.path.insert(0, sys.argv[2])  # tests/, for tiny_models
from tiny_models import build_model, tiny_config
from expertcache.telemetry.parquet_trace import TraceWriter
from expertcache.telemetry.recorder import Recorder, record_blocks
m = build_model(tiny_config("qwen3_moe"))
with TraceWriter(sys.argv[1], Recorder(m).meta("tiny")) as w:
    for i in range(100000):
        record_blocks(m, np.random.default_rng(i).integers(2, 128, (2, 16)), w, "code", 8, 4, 2, seq_offset=2 * i)
"""


@pytest.mark.slow  # a subprocess each (a killed recorder; a compiler run)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_recording_keeps_the_complete_trace_and_a_valid_partial_one(sig, tmp_path):
    """#24 finding 3: an interrupted recording to the path of a complete trace used to replace it."""
    from expertcache.telemetry.parquet_trace import partial_path

    path = tmp_path / "t.parquet"
    with TraceWriter(path, _meta()) as w:  # an earlier, complete trace at the same path
        _rows(w, distinct_ids(np.random.default_rng(0), 16, (40, 2)))
    complete = path.read_bytes()
    p = subprocess.Popen([sys.executable, "-c", RECORD_FOREVER, str(path), str(REPO / "tests")], stderr=subprocess.PIPE,
                         text=True)
    deadline = time.time() + 120

    def tmp_size():  # rows go to a temporary name beside the target until the file is closed
        return sum(f.stat().st_size for f in tmp_path.glob(".t.parquet.tmp-*"))
    while tmp_size() < 20_000 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(sig)
    assert p.wait(timeout=60) != 0
    part = partial_path(path)
    assert part.name == "t.partial.parquet" and f"the partial trace is kept as {part}" in p.stderr.read()
    assert path.read_bytes() == complete and read_trace(path).meta.partial is False  # left as it was
    f = pq.ParquetFile(part)  # footer present, kept under its own name
    assert f.metadata.num_row_groups >= 2
    t = f.read()
    assert t.num_rows == f.metadata.num_row_groups * 2 * 12 * 2  # whole row groups: 2 seqs x 12 tokens x 2 layers
    assert read_trace(part).routing()[0].shape[0] == 2
    assert read_trace(part).meta.partial is True and info(part)["partial"] is True
    assert not list(tmp_path.glob(".t.parquet.tmp-*"))


def write_stream(path, ids_by_layer, chunk):
    """The llama-moe-trace binary layout: per chunk, one record per layer."""
    n_layers, n_tok, k = ids_by_layer.shape
    with open(path, "wb") as f:
        for t0 in range(0, n_tok, chunk):
            for layer in range(n_layers):
                part = ids_by_layer[layer, t0:t0 + chunk]
                f.write(struct.pack("<iii", layer, len(part), k))
                f.write(part.astype("<i4").tobytes())


def test_llamacpp_stream_import_round_trips(tmp_path):
    ids = distinct_ids(np.random.default_rng(0), 64, (3, 50, 4)).astype(np.int16)
    write_stream(tmp_path / "s.bin", ids, chunk=7)
    got, layers = read_stream(tmp_path / "s.bin")
    assert layers == [0, 1, 2] and np.array_equal(got, ids)
    r = import_trace(tmp_path / "s.bin", tmp_path / "s.parquet", num_experts=64, domain="code")
    assert r["tokens"] == 50
    assert np.array_equal(read_trace(tmp_path / "s.parquet").routing()[0], ids)
    with pytest.raises(InputError, match="pass --num_experts"):
        import_trace(tmp_path / "s.bin", tmp_path / "x.parquet")
    data = (tmp_path / "s.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-6])
    with pytest.raises(InputError, match="truncated record"):
        read_stream(tmp_path / "cut.bin")


def test_npz_import_checks_expert_range(tmp_path):
    np.savez(tmp_path / "t.npz", experts=np.full((2, 5, 2), 9, np.int16), meta=json.dumps({"num_experts": 8}))
    with pytest.raises(InputError, match=r"outside 0..7"):
        import_trace(tmp_path / "t.npz", tmp_path / "t.parquet")


def _meta(num_experts=16, top_k=2):
    from expertcache.telemetry.parquet_trace import TraceMeta

    return TraceMeta(model="m", family="qwen3_moe", num_layers=2, moe_layers=[0, 1], num_experts=num_experts,
                     top_k=top_k)


def _rows(w, ids, seq=0):
    n = len(ids)
    w.write(seq_id=np.full(n, seq, np.int32), pos=np.arange(n, dtype=np.int32) // 2,
            layer=np.tile(np.asarray([0, 1], np.int16), n // 2), phase="decode", domain="code",
            token=np.zeros(n, np.int32), ids=np.asarray(ids), weights=np.ones((n, 2), np.float16))


@pytest.mark.slow  # records twice, one killed (about 1 s)
def test_a_clean_trace_says_complete_and_an_interrupted_one_says_partial(tmp_path):
    from expertcache.telemetry.analysis import analyze, text_summary
    from expertcache.telemetry.parquet_trace import read_meta

    good = tmp_path / "good.parquet"
    with TraceWriter(good, _meta()) as w:
        _rows(w, distinct_ids(np.random.default_rng(0), 16, (40, 2)))
    assert read_meta(good).partial is False and info(good)["partial"] is False
    with pytest.raises(RuntimeError, match="boom"):
        with TraceWriter(tmp_path / "part.parquet", _meta()) as w:
            _rows(w, distinct_ids(np.random.default_rng(0), 16, (40, 2)))
            _rows(w, distinct_ids(np.random.default_rng(1), 16, (40, 2)), seq=1)
            raise RuntimeError("boom")
    assert not (tmp_path / "part.parquet").exists()  # a partial recording never takes the trace's own name
    part = tmp_path / "part.partial.parquet"
    assert read_meta(part).partial is True
    assert info(part)["rows"] == 80 and info(part)["partial"] is True
    s = analyze(part, tmp_path / "an", by_domain=False)
    assert s["partial"] is True
    first = text_summary(s).splitlines()[0]
    assert first.startswith("WARNING:") and "partial trace" in first
    assert not text_summary(analyze(good, tmp_path / "an2", by_domain=False)).startswith("WARNING")
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_a_run_failing_before_its_first_rows_leaves_the_old_file(tmp_path):
    path = tmp_path / "t.parquet"
    with TraceWriter(path, _meta()) as w:
        _rows(w, distinct_ids(np.random.default_rng(0), 16, (40, 2)))
    before = path.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        with TraceWriter(path, _meta()):
            raise KeyboardInterrupt
    with pytest.raises(InputError, match="outside"):
        with TraceWriter(path, _meta()) as w:
            _rows(w, np.full((4, 2), 16))
    assert path.read_bytes() == before and read_trace(path).meta.partial is False
    assert not list(tmp_path.glob(".*.tmp-*"))


@pytest.mark.parametrize("bad", [16, 65539, -1, 32768])
def test_expert_ids_outside_the_range_are_refused_when_written(tmp_path, bad):
    ids = np.zeros((4, 2), np.int64)
    ids[2, 1] = bad
    with pytest.raises(InputError, match=r"outside \[0, 16\)"):
        with TraceWriter(tmp_path / "t.parquet", _meta()) as w:
            _rows(w, ids)
    assert not (tmp_path / "t.parquet").exists()


def test_imports_refuse_ids_that_int16_would_wrap(tmp_path):
    ids = distinct_ids(np.random.default_rng(0), 16, (2, 10, 2)).astype(np.int32)
    ids[1, 3, 0] = 65539  # 65539 % 65536 = 3: it used to be stored as expert 3
    write_stream(tmp_path / "s.bin", ids, chunk=4)
    with pytest.raises(InputError, match="outside 0..15"):
        import_trace(tmp_path / "s.bin", tmp_path / "s.parquet", num_experts=16)
    np.savez(tmp_path / "t.npz", experts=ids, meta=json.dumps({"num_experts": 16}))
    with pytest.raises(InputError, match="outside 0..15"):
        import_trace(tmp_path / "t.npz", tmp_path / "t.parquet")
    np.savez(tmp_path / "f.npz", experts=ids.astype(np.float32), meta=json.dumps({"num_experts": 16}))
    with pytest.raises(InputError, match="integer expert ids"):
        import_trace(tmp_path / "f.npz", tmp_path / "t.parquet")
    assert not (tmp_path / "s.parquet").exists() and not (tmp_path / "t.parquet").exists()


def test_a_trace_holding_an_id_outside_its_experts_is_refused_on_read(tmp_path):
    import pyarrow as pa

    from expertcache.telemetry.parquet_trace import schema

    meta = _meta()
    sch = schema(meta, False, False)
    n = 4
    ids = np.array([[1, 2], [3, 99], [0, 1], [5, 6]], np.int16)
    cols = [pa.array(np.zeros(n, np.int32)), pa.array(np.arange(n, dtype=np.int32) // 2),
            pa.array(np.tile(np.array([0, 1], np.int16), 2)), pa.array(["decode"] * n), pa.array(["code"] * n),
            pa.array(np.zeros(n, np.int32)), pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), 2),
            pa.FixedSizeListArray.from_arrays(pa.array(np.ones(2 * n, np.float16)), 2)]
    pq.write_table(pa.Table.from_arrays(cols, schema=sch), tmp_path / "bad.parquet")
    with pytest.raises(InputError, match=r"expert id 99 outside \[0, 16\)"):
        read_trace(tmp_path / "bad.parquet")
    with pytest.raises(InputError, match="expert id 99"):
        read_trace(tmp_path / "bad.parquet", columns=["ids"])


def test_an_output_that_is_an_input_is_refused(tmp_path):
    ids = distinct_ids(np.random.default_rng(0), 16, (2, 10, 2)).astype(np.int32)
    np.savez(tmp_path / "t.npz", experts=ids, meta=json.dumps({"num_experts": 16}))
    before = (tmp_path / "t.npz").read_bytes()
    with pytest.raises(InputError, match="is also an input"):
        import_trace(tmp_path / "t.npz", tmp_path / "t.npz")
    with pytest.raises(InputError, match="is also an input"):
        import_trace(tmp_path / "t.npz", tmp_path / "." / "t.npz")
    assert (tmp_path / "t.npz").read_bytes() == before


def test_a_traces_figures_go_beside_qwens_from_two_analyze_summaries(tmp_path):
    """scripts/reference_check.py --ours TOKEN REFERENCE: the figures docs/telemetry.md's generated table sets
    beside Qwen3-30B-A3B's come from `analyze` summaries of one trace, token semantics first; the order, or a file
    that is no summary, is one line."""
    import importlib.util

    from expertcache.telemetry.analysis import analyze
    from expertcache.telemetry.errors import InputError
    from helpers import REPO

    spec = importlib.util.spec_from_file_location("reference_check", REPO / "scripts" / "reference_check.py")
    rc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rc)
    trace = tmp_path / "t.parquet"
    with TraceWriter(trace, _meta()) as w:
        _rows(w, distinct_ids(np.random.default_rng(0), 16, (40, 2)))
    tok = analyze(trace, tmp_path / "tok", by_domain=False)
    ref = analyze(trace, tmp_path / "ref", by_domain=False, semantics="reference")
    got = rc.mine(tmp_path / "tok" / "summary.json", tmp_path / "ref" / "summary.json")
    at = [h for h in tok["hit_curves"] if h["capacity"] == 2]  # 1/8 of 16 experts
    assert got["hit_rate_token"] == {h["policy"]: h["hit_rate_per_layer"] for h in at}
    assert got["hit_rate_reference"]["belady"] == next(h["hit_rate_per_layer"] for h in ref["hit_curves"]
                                                       if h["capacity"] == 2 and h["policy"] == "belady")
    assert got["reuse_lag1"] == tok["routing"]["reuse_lag1"] and got["lookahead_recall_2"] is None
    with pytest.raises(InputError, match="--semantics reference; expected token"):
        rc.mine(tmp_path / "ref" / "summary.json", tmp_path / "tok" / "summary.json")
    with pytest.raises(InputError, match="not an `expertcache analyze` summary.json"):
        rc.mine(trace, tmp_path / "ref" / "summary.json")
