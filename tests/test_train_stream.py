"""Router training with the experts streamed from the checkpoint (train.memory_gb): the same losses and routers as
in memory, each touched expert read once per pass, gradients to the routers and hidden states only, a quantized
base trained packed, and the bad inputs refused in one line before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import REPO

CA_RECIPES = REPO / "recipes" / "cache-aware"


def _base(tiny_data, folder: Path, seed: int = 1) -> Path:
    """A tiny random Qwen3-MoE base in fp32 (2 layers, 8 experts, hidden 32, expert width 32: int8 group 32 fits),
    with the corpus's tokenizer beside it."""
    from tiny_models import build_model, tiny_config

    from expertcache.telemetry.hf import load_tokenizer

    tok = load_tokenizer(tiny_data["tokenizer"])
    model = build_model(tiny_config("qwen3_moe", vocab_size=len(tok), moe_intermediate_size=32), seed=seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def fp32_base(tiny_data, tmp_path_factory):
    return _base(tiny_data, tmp_path_factory.mktemp("stream-base"))


@pytest.fixture(autouse=True)
def _runtime_installed():
    from expertcache.runtime.engine import train_stream
    from expertcache.trainer.cache_aware.stream import set_streamed_runtime

    set_streamed_runtime(train_stream)
    yield
    set_streamed_runtime(None)


def _recipe(tiny_data, base, out, **extra):
    from expertcache.trainer.cache_aware import CacheAwareRecipe
    from expertcache.trainer.config import load_recipe

    o = {"base": str(base), "out_dir": str(out), "data.corpus": tiny_data["corpus"], "data.tokenizer": str(base),
         "data.seq_len": 32, "data.batch_size": 4, "data.val_batches": 1, "train.max_steps": 4,
         "train.warmup_steps": 1, "train.ckpt_every": 4, "train.val_every": 100, "train.log_every": 1,
         "train.wandb": False, "train.lr": 1e-2, "quality.trainable": "routers", "quality.distill": 1.0,
         "locality.weight": 0.5, "locality.kind": "dot", "eval.prompt_len": 8, "eval.decode_tokens": 4,
         "eval.max_seqs": 1, "eval.ppl_blocks": 1, "eval.seq_len": 32, "eval.capacities": "[0.25]"}
    o.update(extra)
    return load_recipe(CacheAwareRecipe, CA_RECIPES / "locality.yaml", [f"{k}={v}" for k, v in o.items()])


@pytest.mark.parametrize("chunk,swiglu", [(16, True), (3, True), (3, False)])
def test_streamed_layer_matches_memory_and_reads_each_touched_expert_once_per_pass(fp32_base, chunk, swiglu):
    """One forward and backward: the streamed model's logits, loss and router gradients equal the in-memory
    model's, whether a layer's experts come in one chunk or in chunks of 3 (read while the previous computes), with
    the SwiGLU families' own backward or the family's forward recomputed under autograd; the experts read are
    exactly each layer's distinct selected experts, once in the forward and once in the backward (the SwiGLU
    backward skips the first MoE layer's reads: its input needs no gradient, and its routing weights' gradient is
    the outputs the forward kept); no gradient reaches an expert."""
    from expertcache.runtime.engine.train_stream import StreamedExperts, open_streamed
    from expertcache.telemetry.hf import load_causal_lm

    ids = torch.randint(2, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = load_causal_lm(fp32_base, dtype=torch.float32)
    ref.requires_grad_(False)
    gates = [L.mlp.gate.weight for L in ref.model.layers]
    for g in gates:
        g.requires_grad_(True)
    out = ref(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    out.loss.backward()
    per_layer = [int(lg.float().softmax(-1).topk(2, dim=-1).indices.unique().numel()) for lg in out.router_logits]
    touched = sum(per_layer)

    base = open_streamed(fp32_base, "disk", chunk=chunk)
    try:
        m = base.model
        assert all(isinstance(L.mlp.experts, StreamedExperts) for L in m.model.layers)
        assert all(L.mlp.experts.swiglu for L in m.model.layers)  # qwen3_moe: the SwiGLU backward by default
        for L in m.model.layers:
            L.mlp.experts.swiglu = swiglu
        assert not any(p.is_meta for p in m.parameters())  # the experts hold no parameters at all
        sg = [L.mlp.gate.weight for L in m.model.layers]
        for g in sg:
            g.requires_grad_(True)
        so = m(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        assert base.counters()["reads"] == touched  # the forward: each layer's distinct experts, once
        so.loss.backward()
        c = base.counters()
        back = touched - per_layer[0] if swiglu else touched
        assert c["reads"] == touched + back  # and once more in the backward
        assert c["bytes_read"] == (touched + back) * base.reader.meta.expert_bytes
        assert base.reader.pool.n_slots == min(2 * chunk, 8)
        torch.testing.assert_close(so.logits, out.logits, rtol=1e-5, atol=1e-6)
        for a, b in zip(sg, gates):
            assert float(b.grad.abs().sum()) > 0
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7)
    finally:
        base.close()


@pytest.mark.slow  # two training runs, step by step (about 2 s)
def test_streamed_router_training_matches_in_memory_training(tiny_data, fp32_base, tmp_path):
    """The key claim: the same recipe (routers only, LM + distillation to the base + locality) trained with the
    experts streamed gives the in-memory run's loss at every step and its final routers (fp32, rtol 1e-4); the
    saved checkpoint differs from the base in the router tensors alone, and loads and serves through `load`."""
    from safetensors.torch import load_file

    from expertcache.trainer.cache_aware import run_cache_aware

    mem = run_cache_aware(_recipe(tiny_data, fp32_base, tmp_path / "mem"))
    st = run_cache_aware(_recipe(tiny_data, fp32_base, tmp_path / "st", **{"train.memory_gb": 8}))
    assert st["streamed"] and st["completed"] and st["steps"] == 4
    assert len(mem["losses"]) == len(st["losses"]) == 4
    np.testing.assert_allclose(st["losses"], mem["losses"], rtol=1e-4)
    assert len(set(st["losses"])) == 4  # four different steps (each its own batch), not one value repeated
    base = load_file(str(fp32_base / "model.safetensors"))
    a = load_file(str(tmp_path / "mem" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "st" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() == base.keys()
    moved = {k for k in base if not torch.equal(base[k], b[k])}
    assert moved == {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    # figures of the run: reads per step within one pass-count of every expert, a measured read bandwidth
    e_bytes, per_pass = st["experts_bytes"] / 16, st["experts_bytes"]
    assert 0 < st["bytes_read_per_step"] <= 3 * per_pass and st["bytes_read_per_step"] % e_bytes == 0
    assert st["disk_read_gbps"] > 0 and st["roofline_tokens_per_s"] > 0 and st["tokens_per_s"] > 0
    # each training step timed and its reads counted on its own (validation's reads are not a step's): the figures
    # are the steady steps' medians (the first left out), the whole fit's rate beside them
    assert len(st["step_s"]) == len(st["step_read_bytes"]) == 4
    assert all(b > 0 and b % e_bytes == 0 for b in st["step_read_bytes"])
    assert st["bytes_read_per_step"] == float(np.median(st["step_read_bytes"][1:]))
    tokens = st["tokens_per_step"]
    assert st["tokens_per_s"] == pytest.approx(tokens / np.median(st["step_s"][1:]))
    assert st["fit_tokens_per_s"] > 0  # (the whole fit's rate: no comparison of two wall-clock figures here)
    assert json.loads((tmp_path / "st" / "result.json").read_text())["loss_last"] == st["losses"][-1]

    from expertcache.runtime import load

    served = load(tmp_path / "st" / "model", capacity=1.0, tier="disk")
    ref = load(tmp_path / "mem" / "model", capacity=1.0, tier="disk")
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    served.expertcache.close()
    ref.expertcache.close()


@pytest.mark.slow  # three training runs (about 2 s)
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_streamed_run_resumes_from_checkpoints_that_hold_only_what_trains(tiny_data, fp32_base, tmp_path, lora_rank):
    """A streamed run's resumable checkpoints hold the routers (and the attention adapters, with quality.lora_rank)
    and the optimizer state, not the frozen weights; a run stopped at step 2 and resumed to 4 ends with the routers
    (and losses) of the in-memory run stopped and resumed the same way."""
    from safetensors.torch import load_file

    from expertcache.trainer.cache_aware import run_cache_aware

    def stop_and_resume(out, **kw):
        kw["quality.lora_rank"] = lora_rank
        run_cache_aware(_recipe(tiny_data, fp32_base, out, **kw, **{"train.ckpt_every": 2, "train.max_steps": 2}))
        return run_cache_aware(_recipe(tiny_data, fp32_base, out, **kw, **{"train.ckpt_every": 2}))

    st = stop_and_resume(tmp_path / "st", **{"train.memory_gb": 8})
    ck = torch.load(tmp_path / "st" / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    adapters = {k for k in ck["state_dict"] if ".lora_" in k}
    assert set(ck["state_dict"]) - adapters == {f"model.model.layers.{i}.mlp.gate.weight" for i in range(2)}
    assert len(adapters) == (16 if lora_rank else 0)  # A and B on q, k, v, o of both layers
    mem = stop_and_resume(tmp_path / "mem")
    assert st["resumed_from_step"] == mem["resumed_from_step"] == 2 and st["global_step"] == 4
    np.testing.assert_allclose(st["losses"], mem["losses"], rtol=1e-4)  # the resumed steps 3 and 4
    a = load_file(str(tmp_path / "st" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "mem" / "model" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_quantized_base_trains_its_routers_packed(tiny_data, fp32_base, tmp_path):
    """An int8 base: experts read packed and dequantized per use; the routers train, the store keeps its bytes and
    takes the new routers' fingerprint, so `load` opens the trained checkpoint."""
    from expertcache.runtime import load
    from expertcache.runtime.kernels import quant, quant_write
    from expertcache.telemetry.hf import load_tokenizer

    q = tmp_path / "int8"
    quant_write.write_quantized(fp32_base, q, 8, 32)
    load_tokenizer(str(fp32_base)).save_pretrained(q)
    st = __import__("expertcache.trainer.cache_aware", fromlist=["run_cache_aware"]).run_cache_aware(
        _recipe(tiny_data, q, tmp_path / "q", **{"train.memory_gb": 8, "train.max_steps": 2}))
    assert st["streamed"] and st["quant_bits"] == 8 and st["steps"] == 2
    assert st["bytes_read_per_step"] % (st["experts_bytes"] / 16) == 0
    before = (q / quant.EXPERTS_FILE).read_bytes()
    after = (tmp_path / "q" / "model" / quant.EXPERTS_FILE).read_bytes()
    assert before[65536:] == after[65536:] and before[:65536] != after[:65536]  # the header's fingerprint only
    m = load(tmp_path / "q" / "model", capacity=1.0, tier="disk")
    with torch.no_grad():
        assert torch.isfinite(m(input_ids=torch.arange(3, 11)[None]).logits).all()
    m.expertcache.close()


@pytest.mark.parametrize("extra, needle", [
    ({"train.memory_gb": 8, "quality.trainable": "all"}, "streamed experts are frozen; supported: "
                                                         "quality.trainable=routers"),
    ({"train.memory_gb": 0.001}, "is below the floor of"),
    ({"train.memory_gb": 8, "train.expert_tier": "floppy"}, "floppy"),
    ({"train.memory_gb": 8, "train.frozen_dtype": "fp16"}, "train.frozen_dtype='fp16'; expected fp32 or bf16"),
    ({"train.frozen_dtype": "bf16"}, "train.frozen_dtype=bf16 applies to streamed experts"),
])
def test_bad_streamed_recipes_are_one_line_before_any_work(tiny_data, fp32_base, tmp_path, capsys, extra, needle):
    from expertcache.recipes.cli import main

    o = {"base": str(fp32_base), "out_dir": str(tmp_path / "o"), "data.corpus": tiny_data["corpus"],
         "data.tokenizer": str(fp32_base), "quality.trainable": "routers", **extra}
    rc = main(["train-cache-aware", "--recipe", "locality", *[f"{k}={v}" for k, v in o.items()]])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()  # refused before the run folder was made
    if "floor" in needle:  # the floor is printed, and a budget just above it is accepted
        floor = float(err.split("floor of ")[1].split()[0])
        assert floor > 0.001


def test_quantized_base_asked_to_train_its_experts_is_one_line(tiny_data, fp32_base, tmp_path, capsys):
    from expertcache.recipes.cli import main
    from expertcache.runtime.kernels import quant_write

    q = tmp_path / "int8"
    quant_write.write_quantized(fp32_base, q, 8, 32)
    for trainable in ("moe", "all"):
        rc = main(["train-cache-aware", "--recipe", "locality", f"base={q}", f"out_dir={tmp_path}/o",
                   f"data.corpus={tiny_data['corpus']}", f"data.tokenizer={fp32_base}", "train.memory_gb=8",
                   f"quality.trainable={trainable}"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1, err
        assert "holds int8 experts" in err and "cannot train" in err and "quality.trainable=routers" in err


def test_the_floor_from_headers_and_the_resident_check_before_the_first_step(fp32_base):
    """The header-only floor adds up its parts and grows with the tokens per step; once the base is open, the
    second check counts what the process holds (measured) and refuses a budget below it in one line."""
    from expertcache.runtime.engine.train_stream import check_resident, floor_bytes, open_streamed, plan
    from expertcache.telemetry.errors import InputError

    p = plan(fp32_base, torch.float32, "disk")
    assert p.num_layers == 2 and p.num_experts == 8 and p.quant_bits is None
    assert p.experts_bytes == 2 * 8 * 3 * 32 * 32 * 4  # fp32 experts, gate_up [64, 32] + down [32, 32]
    small, big = floor_bytes(p, 64, False), floor_bytes(p, 64 * 1024, True)
    assert small["total"] == sum(v for k, v in small.items() if k != "total")
    assert big["activations"] == 1024 * small["activations"] and big["router_state"] > small["router_state"]
    base = open_streamed(fp32_base, "disk")
    try:
        need = check_resident(base, 100.0, small)
        assert need > small["activations"]
        with pytest.raises(InputError, match="this process holds") as e:
            check_resident(base, need / 1e9 * 0.99, small)
        assert len(str(e.value).splitlines()) == 1
    finally:
        base.close()


@pytest.mark.parametrize("bits", [4, 8])
def test_a_packed_chunk_is_dequantized_as_the_reference_into_one_reused_buffer(bits):
    """A chunk of packed experts, as the trainer computes them: each expert exactly `quant.dequantize`'s weights,
    and the second chunk written into the first one's buffer (no fresh tensor per chunk and layer)."""
    from expertcache.runtime.engine.train_stream import compute_weights
    from expertcache.runtime.kernels import quant

    torch.manual_seed(bits)
    views = {}
    for name, shape in (("gate_up_proj", (4, 128, 64)), ("down_proj", (4, 64, 64))):
        for part, v in quant.quantize(torch.randn(shape) * 0.1, bits, 32).items():
            views[f"{name}.{part}"] = v
    buffers = {}
    first = compute_weights(views, torch.bfloat16, buffers)
    for name, t in first.items():
        ref = torch.stack([quant.dequantize({k: v[i] for k, v in quant.parts(views, name).items()}, bits, 32,
                                            torch.bfloat16) for i in range(4)])
        assert torch.equal(t, ref), name
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    again = compute_weights({k: v[:2] for k, v in views.items()}, torch.bfloat16, buffers)
    from expertcache.runtime.kernels import cpu_kernels

    if cpu_kernels.available():
        assert {k: v.data_ptr() for k, v in again.items()} == ptrs
    assert all(v.shape[0] == 2 for v in again.values())


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_swiglu_backward_equals_the_family_forward_under_autograd_on_packed_experts(fp32_base, tmp_path, compute):
    """On an int8 base (experts dequantized one at a time for `_SwigluStreamed`, a chunk at a time for the family's
    forward), one forward and backward through both paths: the same loss and router gradients, to fp32 rounding
    when the experts compute in fp32, and within bf16's noise when they compute in bf16 (the default for packed
    experts: both paths then differ from fp32 by about as much as from each other)."""
    from expertcache.runtime.engine.train_stream import open_streamed
    from expertcache.runtime.kernels import quant_write

    q = tmp_path / "int8"
    quant_write.write_quantized(fp32_base, q, 8, 32)
    ids = torch.randint(2, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    base = open_streamed(q, "disk", chunk=3)
    try:
        base.reader.dtype = compute
        m = base.model
        gates = [L.mlp.gate.weight for L in m.model.layers]
        for g in gates:
            g.requires_grad_(True)
        got = {}
        for swiglu in (False, True):
            for L in m.model.layers:
                L.mlp.experts.swiglu = swiglu
                g = L.mlp.gate.weight
                g.grad = None
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            got[swiglu] = (loss.detach(), [g.grad.clone() for g in gates])
        (l0, g0), (l1, g1) = got[False], got[True]
        assert all(float(g.abs().sum()) > 0 for g in g0)
        if compute == torch.float32:
            torch.testing.assert_close(l1, l0, rtol=1e-6, atol=0)
            for a, b in zip(g1, g0):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
        else:
            torch.testing.assert_close(l1, l0, rtol=1e-3, atol=0)
            for a, b in zip(g1, g0):
                assert float((a - b).norm() / b.norm()) < 0.1
    finally:
        base.close()


def test_the_backward_reads_the_next_layers_first_chunk_ahead(tiny_data, tmp_path):
    """A 4-layer base in chunks of 3: each layer's backward starts reading the first chunk of the layer below
    while its own last chunk computes, and the layer below starts on it. No expert is read twice, gradients equal the
    in-memory model's; a pass that turns out different from the one read ahead waits for it (counted as read) and
    reads its own, and its experts are the right ones."""
    from tiny_models import build_model, tiny_config

    from expertcache.runtime.engine.train_stream import open_streamed
    from expertcache.telemetry.hf import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_data["tokenizer"])
    folder = tmp_path / "base4"
    build_model(tiny_config("qwen3_moe", vocab_size=len(tok), moe_intermediate_size=32, num_hidden_layers=4),
                seed=3).save_pretrained(folder)
    ids = torch.randint(2, 500, (2, 24), generator=torch.Generator().manual_seed(2))
    ref = load_causal_lm(folder, dtype=torch.float32)
    ref.requires_grad_(False)
    for L in ref.model.layers:
        L.mlp.gate.weight.requires_grad_(True)
    out = ref(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    out.loss.backward()
    per_layer = [int(lg.float().softmax(-1).topk(2, dim=-1).indices.unique().numel()) for lg in out.router_logits]
    base = open_streamed(folder, "disk", chunk=3)
    try:
        m, r = base.model, base.reader
        for L in m.model.layers:
            L.mlp.gate.weight.requires_grad_(True)
        m(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False).loss.backward()
        assert r.reads == sum(per_layer) + sum(per_layer[1:])  # forward, then backward of layers 3, 2, 1
        assert r.ahead_hits == 2  # layers 2 and 1 started on their first chunk, read during 3's and 2's last
        for a, b in zip(m.model.layers, ref.model.layers):
            torch.testing.assert_close(a.mlp.gate.weight.grad, b.mlp.gate.weight.grad, rtol=1e-4, atol=1e-7)
        # a read-ahead the next pass does not match: waited for, counted, and the pass reads its own experts
        want = {k: v.clone() for k, v in next(iter(r.chunks(2, [5, 6, 7])))[1].items()}
        before = r.reads
        for _ in r.chunks(1, [0, 1, 2], then=(3, [0, 1, 2, 3])):
            pass
        got = {k: v.clone() for k, v in next(iter(r.chunks(2, [5, 6, 7])))[1].items()}
        assert r.reads == before + 3 + 3 + 3 and r.ahead_hits == 2
        for k in want:
            assert torch.equal(got[k], want[k])
    finally:
        base.close()


def test_int4_experts_multiply_packed_on_the_tile_units_as_dequantized(tiny_data, tmp_path, monkeypatch):
    """An int4 base whose experts fit the tile kernel (hidden and expert width 64): on a CPU with AMX-BF16 the
    SwiGLU path multiplies them packed (`qmm_amx`, called for every product), and one forward and backward gives
    the loss and router gradients of the same path with each expert dequantized first, within bf16's noise."""
    from tiny_models import build_model, tiny_config

    from expertcache.runtime.engine.train_stream import open_streamed
    from expertcache.runtime.kernels import cpu_kernels, quant_write
    from expertcache.telemetry.hf import load_tokenizer

    if not (cpu_kernels.available() and cpu_kernels.amx_available()):
        pytest.skip("no AMX-BF16 tile units on this CPU")
    tok = load_tokenizer(tiny_data["tokenizer"])
    folder, q = tmp_path / "b64", tmp_path / "int4"
    build_model(tiny_config("qwen3_moe", vocab_size=len(tok), hidden_size=64, moe_intermediate_size=64,
                            num_hidden_layers=3), seed=4).save_pretrained(folder)
    quant_write.write_quantized(folder, q, 4, 32)
    ids = torch.randint(2, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    calls = []
    real = cpu_kernels.qmm_amx
    monkeypatch.setattr(cpu_kernels, "qmm_amx", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = {}
    for amx in (True, False):
        monkeypatch.setattr(cpu_kernels, "amx_available", lambda amx=amx: amx)
        base = open_streamed(q, "disk", chunk=3)
        try:
            m = base.model
            for L in m.model.layers:
                L.mlp.gate.weight.requires_grad_(True)
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            got[amx] = (float(loss), [L.mlp.gate.weight.grad.clone() for L in m.model.layers])
            if amx:
                # forward: 2 products per expert per layer; backward: 2 per expert for layers 1 and 2
                assert len(calls) == 2 * base.reader.reads
                calls.clear()
        finally:
            base.close()
    assert not calls  # the dequantized path never calls the tile kernel
    (l1, g1), (l0, g0) = got[True], got[False]
    assert abs(l1 - l0) <= 1e-3 * abs(l0)
    for a, b in zip(g1, g0):
        assert float(b.abs().sum()) > 0 and float((a - b).norm() / b.norm()) < 0.1


@pytest.mark.slow  # two training runs (about 1.5 s)
def test_frozen_bf16_weights_train_fp32_routers_to_the_fp32_run_within_bf16_noise(tiny_data, fp32_base, tmp_path):
    """`train.frozen_dtype=bf16`: the frozen non-expert weights and the activations in bf16, the routers (weights,
    gradients, Adam) in fp32. Its losses follow the fp32 streamed run within bf16's noise, step by step; the routers
    it saves are fp32 and differ from the base's (they trained), every other tensor is the base's bytes; the floor
    counts the frozen weights at 2 bytes each."""
    from safetensors.torch import load_file

    from expertcache.trainer.cache_aware import run_cache_aware

    fp = run_cache_aware(_recipe(tiny_data, fp32_base, tmp_path / "fp32", **{"train.memory_gb": 8}))
    bf = run_cache_aware(_recipe(tiny_data, fp32_base, tmp_path / "bf16",
                                 **{"train.memory_gb": 8, "train.frozen_dtype": "bf16"}))
    assert bf["completed"] and len(bf["losses"]) == len(fp["losses"]) == 4
    np.testing.assert_allclose(bf["losses"], fp["losses"], rtol=3e-2)
    assert bf["losses"] != fp["losses"]  # bf16 did run: not the fp32 numbers
    assert bf["floor_bytes"]["non_expert_weights"] * 2 == fp["floor_bytes"]["non_expert_weights"]
    base = load_file(str(fp32_base / "model.safetensors"))
    got = load_file(str(tmp_path / "bf16" / "model" / "model.safetensors"))
    routers = {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
    assert {k for k in base if not torch.equal(base[k], got[k])} == routers
    assert all(got[k].dtype == torch.float32 for k in routers)


def test_frozen_bf16_keeps_the_routers_and_their_gradients_in_fp32(tiny_data, fp32_base, tmp_path):
    """After `keep_routers_fp32`: the routers' weights fp32, every other weight bf16; a forward and backward runs
    (the routers take their bf16 input in fp32) and leaves fp32 gradients on the routers alone."""
    from expertcache.runtime.engine.train_stream import open_streamed
    from expertcache.trainer.cache_aware.stream import keep_routers_fp32

    recipe = _recipe(tiny_data, fp32_base, tmp_path / "x", **{"train.memory_gb": 8, "train.frozen_dtype": "bf16"})
    base = open_streamed(fp32_base, "disk", torch.bfloat16)
    try:
        m = base.model
        keep_routers_fp32(recipe, m)
        m.requires_grad_(False)
        routers = {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
        for n, p in m.named_parameters():
            assert p.dtype == (torch.float32 if n in routers else torch.bfloat16), n
            p.requires_grad_(n in routers)
        ids = torch.randint(2, 500, (2, 16), generator=torch.Generator().manual_seed(5))
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        for n, p in m.named_parameters():
            assert (p.grad is not None) == (n in routers), n
            if p.grad is not None:
                assert p.grad.dtype == torch.float32 and float(p.grad.abs().sum()) > 0
    finally:
        base.close()


@pytest.mark.slow  # two training runs and their evaluation (11.5 s alone, with its fixtures)
def test_attention_adapters_train_beside_the_routers_the_same_streamed_as_in_memory(tiny_data, fp32_base, tmp_path):
    """`quality.lora_rank` (#44: low-rank adapters on attention through peft, beside the routers): the streamed run
    gives the in-memory run's losses and saved tensors (fp32, rtol 1e-4); the checkpoint is a plain one (the
    adapters merged into q/k/v/o, no adapter tensor, the base's names and shapes) in which exactly the routers and
    the four attention projections of each layer moved; the distillation starts at 0 (the adapters start at B = 0
    and the base is read with them off) and the figures name what trained."""
    from safetensors.torch import load_file

    from expertcache.trainer.cache_aware import run_cache_aware

    lora = {"quality.lora_rank": 4, "quality.lora_alpha": 8}
    mem = run_cache_aware(_recipe(tiny_data, fp32_base, tmp_path / "mem", **lora))
    st = run_cache_aware(_recipe(tiny_data, fp32_base, tmp_path / "st", **lora, **{"train.memory_gb": 8}))
    np.testing.assert_allclose(st["losses"], mem["losses"], rtol=1e-4)
    assert mem["lora"] == st["lora"] and mem["lora"]["parameters"] > 0 and st["trainable"] == \
        "routers + attention adapters"
    base = load_file(str(fp32_base / "model.safetensors"))
    a = load_file(str(tmp_path / "mem" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "st" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() == base.keys()
    assert all(a[k].shape == base[k].shape and a[k].dtype == base[k].dtype for k in base)
    moved = {k for k in base if not torch.equal(base[k], b[k])}
    want = {f"model.layers.{i}.mlp.gate.weight" for i in range(2)} | \
        {f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert moved == want, sorted(moved ^ want)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    distill = [float(x) for x in _logged(tmp_path / "st", "train/distill")]
    assert distill[0] == pytest.approx(0, abs=1e-6) and distill[-1] > 0


def _logged(out, key):
    import csv

    rows = [r for f in sorted((out / "logs").glob("version_*/metrics.csv")) for r in csv.DictReader(f.open())]
    return [r[key] for r in rows if r.get(key)]


@pytest.mark.slow  # a training run
def test_adapters_on_bf16_frozen_weights_are_added_to_the_checkpoints_own_tensors(tiny_data, fp32_base, tmp_path):
    """With `train.frozen_dtype=bf16` the attention weights the run computes with are a bf16 copy of the fp32 base's;
    the saved checkpoint adds each adapter to the base's own fp32 tensor (the review found every saved attention
    weight rounded to bf16 when the merged copy was written back). Each saved projection moved, in fp32, and is not
    a bf16-rounded tensor."""
    from safetensors.torch import load_file

    from expertcache.trainer.cache_aware import run_cache_aware

    run_cache_aware(_recipe(tiny_data, fp32_base, tmp_path / "st", **{
        "train.memory_gb": 8, "train.frozen_dtype": "bf16", "train.max_steps": 2, "quality.lora_rank": 4}))
    base = load_file(str(fp32_base / "model.safetensors"))
    saved = load_file(str(tmp_path / "st" / "model" / "model.safetensors"))
    for k in [k for k in base if "self_attn" in k and k.endswith("proj.weight")]:
        w, s = base[k], saved[k]
        assert s.dtype == w.dtype == torch.float32 and not torch.equal(s, w), k  # trained
        assert not torch.equal(s, s.bfloat16().float()), k  # not a bf16 copy written back


@pytest.mark.slow
def test_bench_train_big_runs_bf16_then_packed_in_processes_of_their_own_and_resumes(tiny_data, fp32_base, tmp_path):
    """`expertcache bench train-big` (the runs of results/train_big.json) on the tiny base, no cgroup: the bf16 run,
    then the same checkpoint quantized (int8 here), each `train-cache-aware` with streamed experts in a process of its
    own; the issue's fields on each row, the trained copies dropped; asked again, it reuses both rows."""
    import json

    from expertcache.recipes.cli import main

    out, work = tmp_path / "train_big.json", tmp_path / "work"
    argv = ["bench", "train-big", "--model", str(fp32_base), "--corpus", tiny_data["corpus"], "--work", str(work),
            "--cgroup_gb", "0", "--memory_gb", "8", "--steps", "2", "--batch_size", "2", "--seq_len", "32",
            "--bits", "8", "--group", "32", "--out", str(out)]  # (int4 packs 64 inputs: the tiny base has 32)
    assert main(argv) == 0
    d = json.loads(out.read_text())
    assert [r["quant_bits"] for r in d["runs"]] == [None, 8] and all(r["completed"] for r in d["runs"])
    for r in d["runs"]:
        assert r["trainable"] == "routers" and r["steps"] == 2 and r["tokens_per_step"] == 64
        assert r["tokens_per_s"] > 0 and r["bytes_read_per_step"] > 0 and r["loss_first"] > 0
        assert r["memory_cgroup_bytes"] is None and r["exit"] == 0
    assert d["cgroup"] == "not asked" and d["command"].startswith("expertcache bench train-big --model")
    assert not (work / "bf16" / "model").exists() and not (work / "int8" / "model").exists()  # --drop_model
    first = d["runs"]
    assert main(argv) == 0  # both rows reused, as measured then
    assert json.loads(out.read_text())["runs"] == first
