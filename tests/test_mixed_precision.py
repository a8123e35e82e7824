"""Precision per expert from telemetry (`expertcache quantize --by_usage TRACE`): the allocation, the checkpoint it
writes (one store per format), the engine serving it (slots tagged with their format) and what it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from expertcache.runtime.kernels import quant, quant_write
from expertcache.telemetry.errors import InputError

HOT, COLD = (8, 32), (4, 64)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _src(tmp_path, **over):
    from tiny_models import build_model, tiny_config

    src = tmp_path / "src"  # sizes the int4 chunk takes: hidden 64, expert 64; 16 experts, top-2
    cfg = dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=64, num_experts=16)
    build_model(tiny_config("qwen3_moe", **{**cfg, **over}), seed=7, dtype=torch.bfloat16).save_pretrained(src)
    return src


def _trace(src, path, seed=0):
    """A real routing trace of the checkpoint at `src` (prefill and greedy decode of random blocks)."""
    from transformers import AutoModelForCausalLM

    from expertcache.telemetry.parquet_trace import TraceWriter
    from expertcache.telemetry.recorder import Recorder, record_blocks

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    blocks = np.random.default_rng(seed).integers(2, 128, (6, 16))
    with TraceWriter(path, Recorder(m).meta(str(src))) as w:
        record_blocks(m, blocks, w, "code", prompt_len=8, decode_tokens=4, batch_size=3)
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    src = _src(root)
    trace = _trace(src, root / "usage.parquet")
    q = root / "q"
    rep = quant_write.write_quantized(src, q, *COLD, by_usage=trace, hot=HOT, max_bytes_ratio=0.4)
    return src, trace, q, rep


def _logits(m):
    from transformers import DynamicCache

    out = []
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        r = m(input_ids=torch.tensor([[5, 9, 33, 2, 71, 100, 7, 12]]), past_key_values=cache, use_cache=True)
        out.append(r.logits[0, -1].float())
        for t in (3, 14, 15, 92):
            r = m(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            out.append(r.logits[0, -1].float())
    return torch.stack(out)


def _reference(src, q):
    """The original model with each routed expert replaced by what its own format's integers stand for."""
    from transformers import AutoModelForCausalLM

    from expertcache.runtime.storage.tiers import HostTier
    from expertcache.telemetry.adapters import adapter_for

    qc = quant.read_config(q)
    source = quant.MixedExperts(q, qc)
    tier = HostTier(source)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    for i, L in enumerate(adapter_for(ref).moe_layers(ref)):
        views = quant.format_views(tier.layer_views(i))
        for e in range(source.meta.num_experts):
            k = source.format_index(i, e)
            bits, group = source.formats[k]
            for name in ("gate_up_proj", "down_proj"):
                t = {p: v[e] for p, v in quant.parts(views[k], name).items()}
                getattr(L.experts, name).data[e].copy_(quant.dequantize(t, bits, group))
    return ref


def test_allocation_raises_the_most_used_experts_while_the_size_allows():
    rng = np.random.default_rng(0)
    for _ in range(50):
        counts = rng.integers(0, 100, (int(rng.integers(1, 5)), int(rng.integers(2, 20))))
        hi, lo = int(rng.integers(200, 400)), int(rng.integers(50, 199))
        budget = int(counts.size * lo + rng.integers(0, counts.size * (hi - lo) + 1))
        fmt = quant_write.allocate_by_usage(counts, hi, lo, budget)
        size = int((fmt == 0).sum()) * hi + int((fmt == 1).sum()) * lo
        assert size <= budget and (size + hi - lo > budget or (fmt == 0).all())  # fits; one more would not
        if (fmt == 0).any() and (fmt == 1).any():
            assert counts[fmt == 0].min() >= counts[fmt == 1].max()  # no colder expert outranks a hotter one
    with pytest.raises(InputError, match="below every expert at the smaller format"):
        quant_write.allocate_by_usage(np.ones((2, 4)), 300, 100, 799)


def test_by_usage_writes_one_store_per_format_within_the_size(mixed):
    from expertcache.telemetry.routing import load_routing

    src, trace, q, rep = mixed
    qc = json.loads((q / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == quant.MIXED and [(f["bits"], f["group_size"]) for f in qc["formats"]] == [HOT, COLD]
    fmt = np.array([[int(c) for c in row] for row in qc["expert_formats"]])
    ids = load_routing(trace, phase=None).ids
    counts = np.stack([np.bincount(ids[i].ravel(), minlength=16) for i in range(ids.shape[0])])
    assert 0 < (fmt == 0).sum() < fmt.size
    assert counts[fmt == 0].min() >= counts[fmt == 1].max()
    assert rep["by_usage"]["hot_share_of_routing"] == pytest.approx(counts[fmt == 0].sum() / counts.sum(), abs=1e-6)
    assert rep["bf16_bytes_ratio"] <= 0.4 < rep["bf16_bytes_ratio"] + (13056 - 6912) / (24576 * fmt.size)
    source = quant.MixedExperts(q, qc)
    assert source.total_bytes() == rep["expert_bytes"] == (fmt == 0).sum() * 13056 + (fmt == 1).sum() * 6912
    for f, k in zip(qc["formats"], (0, 1)):  # each store holds its own experts only (4 KiB blocks)
        from expertcache.runtime.storage.store import read_store_meta

        m = read_store_meta(q / f["experts_file"])
        assert (m.num_layers, m.num_experts) == (1, int((fmt == k).sum())) and f["experts"] == m.num_experts
    assert all(0 < e < 0.15 for v in rep["relative_error"].values() for e in v)


@pytest.mark.parametrize("tier,capacity", [("host", 1.0), ("disk", 0.5)])
def test_a_mixed_checkpoint_decodes_like_its_dequantized_reference(mixed, tier, capacity):
    """Each slot computes with the format its expert was written in: logits within 5% of the original model holding
    every expert's dequantized integers (the kernels also round activations to int8); every read moves that
    expert's own bytes."""
    from expertcache.runtime import EngineConfig, load

    src, _, q, _ = mixed
    ref = _logits(_reference(src, q))
    m = load(q, engine=EngineConfig(capacity=capacity, tier=tier, kernel="auto"))
    eng = m.expertcache
    assert isinstance(eng.source, quant.MixedExperts)
    assert eng.meta.block_bytes == max(m.block_bytes for m in eng.source.stores)  # a slot: the larger block
    reads, read = [], eng.tier.read
    eng.tier.read = lambda i, e, pool, slot: reads.append((i, e, read(i, e, pool, slot))) or reads[-1][2]
    before = eng.stats.bytes_moved
    got = _logits(m)
    assert _rel(got, ref) < 5e-2
    assert all(n == eng.source.expert_nbytes(i, e) for i, e, n in reads)
    assert eng.stats.bytes_moved - before == sum(n for *_, n in reads)
    if capacity == 1.0:
        assert not reads  # every expert preloaded, each in its own format
    else:
        assert eng.stats.demand_loads > 0 and eng.stats.hits > 0
        assert {n for *_, n in reads} == {13056, 6912}  # both formats were read
    eng.close()


def test_mixed_slots_compute_each_pair_in_its_own_format(mixed):
    """Several tokens whose choices mix formats in different numbers per row (the padded path): each (token, choice)
    pair equals the dequantized reference of its own format."""
    from expertcache.runtime.kernels.triton_experts import swiglu_reference
    from expertcache.runtime.storage.tiers import DiskTier, SlotPool

    _, _, q, _ = mixed
    source = quant.MixedExperts(q, quant.read_config(q))
    pool = SlotPool(source.meta, 16)
    tier = DiskTier(source)
    for e in range(16):
        tier.read(0, e, pool, e)
    tier.close()
    fmt = pool.fmt.clone()
    assert set(fmt.tolist()) == {0, 1}
    g = torch.Generator().manual_seed(0)
    slots = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(5)])
    weights = torch.rand(5, 4, generator=g)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    got = quant.swiglu(x, pool.views, slots, weights)
    views = quant.format_views(pool.views)
    deq = {n: torch.stack([quant.dequantize({p: v[s] for p, v in quant.parts(views[int(fmt[s])], n).items()},
                                            *source.formats[int(fmt[s])]) for s in range(16)])
           for n in ("gate_up_proj", "down_proj")}
    ref = swiglu_reference(x.float(), deq["gate_up_proj"], deq["down_proj"], slots, weights)
    assert _rel(got, ref) < 5e-2
    one = quant.swiglu(x[:1], pool.views, slots[:1], weights[:1])  # one token: no padding
    assert _rel(one, ref[:1]) < 5e-2


def test_by_usage_refuses_in_one_line(mixed, tmp_path, capsys):
    from expertcache.recipes.cli import main

    src, trace, q, _ = mixed
    other = _trace(_src(tmp_path / "o", num_experts=8), tmp_path / "other.parquet")
    capsys.readouterr()
    base = ["quantize", "--model", str(src), "--out", str(tmp_path / "out"), "--bits", "4", "--group_size", "64"]
    cases = [(["--by_usage", str(other)], "is a trace of another model: 2 MoE layers x 8 experts"),
             (["--by_usage", str(trace), "--max_bytes_ratio", "0.2"], "below every expert at the smaller format"),
             (["--by_usage", str(trace), "--max_bytes_ratio", "1.5"], "--max_bytes_ratio 1.5"),
             (["--by_usage", str(trace), "--max_bytes_ratio", "0.95"], "no expert gets int4 (group 64)"),
             (["--by_usage", str(trace), "--hot_bits", "4", "--hot_group_size", "64"], "nothing to mix"),
             (["--by_usage", str(trace), "--bits", "8", "--group_size", "32", "--hot_bits", "4", "--hot_group_size",
               "64"], "hot experts get the more precise format"),
             (["--by_usage", str(trace), "--linears", "true"], "--by_usage with --linears true"),
             (["--by_usage", str(tmp_path / "nope.parquet")], "nope.parquet")]
    for extra, msg in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], (extra, err)
        assert not (tmp_path / "out").exists()


def test_a_damaged_mixed_config_is_refused_in_one_line(mixed, tmp_path):
    import shutil

    from expertcache.runtime import load

    _, _, q, _ = mixed
    cfg_of = lambda d: json.loads((d / "config.json").read_text())  # noqa: E731
    for i, (edit, msg) in enumerate([
            (lambda qc: qc["expert_formats"].__setitem__(0, qc["expert_formats"][0][:-1]), "expert_formats is not"),
            (lambda qc: qc["expert_formats"].__setitem__(0, "2" * 16), "expert_formats is not"),
            (lambda qc: qc["formats"][1].__setitem__("group_size", 48), "group_size=48"),
            (lambda qc: qc["formats"][0].__setitem__("experts_file", "../x"), "is not a file beside"),
            (lambda qc: qc["formats"][0].update(bits=4, group_size=64), "does not hold the 4-bit, group 64")]):
        d = tmp_path / f"d{i}"
        shutil.copytree(q, d)
        cfg = cfg_of(d)
        edit(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(InputError, match=msg):
            load(d, capacity=0.5, tier="disk")
    d = tmp_path / "flip"  # two experts swap formats: the stores no longer hold the counts config.json gives
    shutil.copytree(q, d)
    cfg = cfg_of(d)
    row = cfg["quantization_config"]["expert_formats"][0]
    cfg["quantization_config"]["expert_formats"][0] = ("0" if row[0] == "1" else "1") + row[1:]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="blocks; config.json gives it"):
        load(d, capacity=0.5, tier="disk")


def test_verify_checks_every_store_of_a_quantized_checkpoint(mixed, tmp_path):
    """`expertcache verify` on a quantized checkpoint (one store, or one per format): OK when clean; a flipped byte
    in one format's store is a mismatch naming its layer and expert, also refused when the engine reads it."""
    import shutil

    from expertcache.recipes.cli import main
    from expertcache.runtime import load
    from expertcache.runtime.storage.verify import verify

    src, _, q, _ = mixed
    rep = verify(q)
    assert rep["verdict"] == "ok" and rep["experts"] == 2 * 16 and rep["checked_against_index"] == 32
    one = tmp_path / "q8"
    quant_write.write_quantized(src, one, 8, 32)
    assert verify(one)["verdict"] == "ok"
    d = tmp_path / "damaged"
    shutil.copytree(q, d)
    source = quant.MixedExperts(d, quant.read_config(d))
    layer, expert = map(int, np.argwhere(source.fmt == 1)[3])
    (span,) = source.spans(layer, expert)
    with open(source.files[span.file], "r+b") as f:
        f.seek(span.offset + 100)
        b = f.read(1)
        f.seek(span.offset + 100)
        f.write(bytes([b[0] ^ 0x10]))
    rep = verify(d)
    assert rep["verdict"] == "damaged" and rep["mismatches"] == 1
    assert (rep["mismatch_list"][0]["layer"], rep["mismatch_list"][0]["expert"]) == (layer, expert)
    assert "int4" in rep["mismatch_list"][0]["where"]
    assert main(["verify", "--model", str(d)]) == 1
    with pytest.raises(InputError, match=f"checksum mismatch: MoE layer {layer} expert {expert} \\(int4"):
        load(d, capacity=1.0, tier="host")


def test_traffic_of_a_mixed_checkpoint_counts_each_load_at_its_own_size(mixed):
    """Per-token traffic is the bytes the loads moved (hot experts' int8 blocks and the rest's int4), not every load
    at the larger format's size."""
    from expertcache.runtime import load

    _, _, q, _ = mixed
    m = load(q, capacity=0.25, tier="disk")
    eng = m.expertcache
    assert eng.traffic_expert_bytes is None
    _logits(m)
    d = eng.stats.per_token(eng.traffic_expert_bytes, tokens=5)
    assert d["traffic_bytes_per_token"] == pytest.approx(eng.stats.bytes_moved / 5)
    loads = eng.stats.demand_loads + eng.stats.prefetch_loads
    assert loads * 6912 <= eng.stats.bytes_moved < loads * 13056  # both sizes among the loads
    eng.close()


def test_the_host_tier_copies_each_expert_at_its_own_block(mixed):
    """A host-tier copy into a slot moves the expert's own format block, not the larger format's."""
    from expertcache.runtime.storage.tiers import HostTier, SlotPool

    _, _, q, _ = mixed
    source = quant.MixedExperts(q, quant.read_config(q))
    tier = HostTier(source)
    pool = SlotPool(source.meta, 2)
    pool.raw.fill_(0xAB)
    k = int(np.argmin([m.block_bytes for m in source.stores]))  # the smaller block (4 KiB alignment decides here)
    layer, expert = map(int, np.argwhere(source.fmt == k)[0])
    assert tier.read(layer, expert, pool, 0) == source.expert_nbytes(layer, expert)
    n = source.block_nbytes(layer, expert)
    assert n < source.meta.block_bytes
    assert bool((pool.raw[n:source.meta.block_bytes] == 0xAB).all())  # the rest of the slot untouched
    assert int(pool.fmt[0]) == k


def test_quantize_never_writes_over_the_model_it_reads(mixed, tmp_path, capsys):
    import shutil

    from expertcache.recipes.cli import main

    src, _, _, _ = mixed
    m = tmp_path / "a" / "model"
    shutil.copytree(src, m)
    capsys.readouterr()
    assert main(["quantize", "--model", str(m), "--out", str(tmp_path / "a"), "--bits", "8"]) == 2
    assert "writing it would delete the" in capsys.readouterr().err
    assert (m / "config.json").is_file()


def test_a_mixed_checkpoint_with_symmetric_int4_decodes_like_its_dequantized_reference(mixed, tmp_path):
    """`--symmetric true` with `--by_usage`: the int4 experts are written without minimums (their store holds no
    `mins`; 4.5 bits per weight at group 32), the hot int8 ones as before, and the model decodes from disk within 5%
    of the original holding every expert's dequantized integers."""
    from expertcache.runtime import EngineConfig, load

    src, trace, _, _ = mixed
    q = tmp_path / "qs"
    rep = quant_write.write_quantized(src, q, 4, 32, by_usage=trace, hot=HOT, max_bytes_ratio=0.4, symmetric=True)
    qc = quant.read_config(q)
    assert [f["symmetric"] for f in qc["formats"]] == [True, True]  # int8 is symmetric by construction
    source = quant.MixedExperts(q, qc)
    names = [{t.name for t in s.tensors} for s in source.stores]
    assert not any(n.endswith(".mins") for n in names[1]) and source.formats[1] == (4, 32)
    assert rep["formats"][1]["experts"] > 0
    import shutil

    for bad, msg in (("yes", "symmetric='yes': expected true or false"),
                     (False, "says symmetric=false, but its expert store has no minimums")):
        d = tmp_path / f"bad{bad}"
        shutil.copytree(q, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["formats"][1]["symmetric"] = bad
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(InputError, match=msg):
            load(d, capacity=0.5, tier="disk")
    ref = _logits(_reference(src, q))
    m = load(q, engine=EngineConfig(capacity=0.5, tier="disk", kernel="auto"))
    assert _rel(_logits(m), ref) < 5e-2
    assert m.expertcache.stats.demand_loads > 0
    m.expertcache.close()


def test_a_mixed_pool_computes_each_format_through_its_registered_class(mixed):
    """The engine chooses the `mixed` format once per pool, holding one registered class per store format (int8 for
    the hot experts, int4 for the cold); decoding calls both, each on its own format's views only, and the logits
    stay within 5% of the dequantized reference."""
    from expertcache.runtime import EngineConfig, load
    from expertcache.runtime.engine.formats import Int4, Int8, Mixed

    src, _, q, _ = mixed
    ref = _logits(_reference(src, q))
    m = load(q, engine=EngineConfig(capacity=0.5, tier="host", kernel="auto"))
    eng = m.expertcache
    fmt = eng.modules[0].fmt
    assert type(fmt) is Mixed and [type(f) for f in fmt.formats] == [Int8, Int4]
    assert [(f.bits, f.group) for f in fmt.formats] == [HOT, COLD]
    calls = {8: 0, 4: 0}
    for mod in eng.modules:
        for f in mod.fmt.formats:
            def spy(x, s, w, t=None, f=f, real=f.compute):
                assert quant.format_of(t if t is not None else f.views) == (f.bits, f.group)
                calls[f.bits] += 1
                return real(x, s, w, t)
            f.compute = spy
    got = _logits(m)
    eng.close()
    assert calls[8] > 0 and calls[4] > 0
    assert _rel(got, ref) < 5e-2
