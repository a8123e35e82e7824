"""The CPU expert kernels (`runtime/kernels/csrc/experts_cpu.cpp`) and the integer formats (`runtime/kernels/quant.py`):
round trips, every kernel against a float reference for odd shapes and k = 1..8 (tolerances stated per test), the
engine's `kernel` option on every SwiGLU family, and the fallback when the extension cannot be built."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from expertcache.runtime.kernels import cpu_kernels as ck, patches
from expertcache.runtime.kernels import qlinear, quant, quant_write
from expertcache.runtime.kernels.triton_experts import swiglu_reference
from expertcache.telemetry.errors import InputError

needs_ext = pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.why_unavailable()}")


def _experts(S, H, I, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(S, 2 * I, H, generator=g) * scale).bfloat16(),
            (torch.randn(S, H, I, generator=g) * scale).bfloat16(), g)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _act_rounded(v):
    """The kernels' activation rounding: int8, one scale per 32 inputs (max |v| / 127), nearest-even."""
    b = v.float().reshape(*v.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(b * (127 / amax.clamp_min(1e-30))), torch.zeros(()))
    return (q * amax / 127).reshape(v.shape)


def _emulated(x, gu, dn, slots, w):
    """The integer kernels' arithmetic in float: dequantized weights, activations rounded as the kernel rounds."""
    T, K = slots.shape
    inter = dn.shape[-1]
    y = torch.zeros(T, x.shape[1])
    xq = _act_rounded(x)
    for t in range(T):
        for j in range(K):
            s = slots[t, j]
            h = gu[s] @ xq[t]
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            y[t] += w[t, j] * (dn[s] @ _act_rounded(a))
    return y


# --- formats -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,group,sym", [(8, 32, False), (8, 128, False), (4, 32, False), (4, 64, False),
                                            (4, 32, True), (4, 128, True)])
def test_representable_weights_round_trip_exactly(bits, group, sym):
    """Weights that are exactly s * q (+ m) with fp16 s, m (symmetric int4: s * (q - 8)) come back bit for bit; the
    packing keeps inputs in order."""
    g = torch.Generator().manual_seed(bits + group)
    rows, n = 6, 256
    if sym:
        q = torch.randint(0, 16, (rows, n), generator=g)
        q[:, ::group] = 0  # every group holds -8 s, its largest magnitude: the scale is recovered exactly
        s = (torch.rand(rows, n // group, generator=g) * 0.01 + 1e-3).half().float()
        w = (q - 8) * s.repeat_interleave(group, -1)
    elif bits == 8:
        q = torch.randint(-127, 128, (rows, n), generator=g)
        q[:, ::group] = 127  # every group reaches the full range: the scale is recovered exactly
        s = (torch.rand(rows, n // group, generator=g) * 0.01 + 1e-3).half().float()
        w = q * s.repeat_interleave(group, -1)
    else:
        q = torch.randint(0, 16, (rows, n), generator=g)
        q[:, ::group], q[:, 1::group] = 0, 15
        s = (torch.rand(rows, n // group, generator=g) * 0.01 + 1e-3).half().float()
        m = (-torch.rand(rows, n // group, generator=g) * 0.05).half().float()
        w = q * s.repeat_interleave(group, -1) + m.repeat_interleave(group, -1)
    t = quant.quantize(w, bits, group, symmetric=sym)
    assert ("mins" in t) == (bits == 4 and not sym)
    if bits == 4:
        assert torch.equal(quant.unpack4(t["q"]).long(), q)
        assert t["q"].shape == (rows, n // 2) and t["q"].dtype == torch.uint8
    else:
        assert torch.equal(t["q"].long(), q)
    assert torch.allclose(quant.dequantize(t, bits, group), w, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("bits,group,sym", [(8, 32, False), (4, 32, False), (4, 64, True), (4, 128, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_bit_for_bit_the_scales_repeated_arithmetic(bits, group, sym, dtype):
    """`dequantize` broadcasts each group's scale (and minimum) in place on one fp32 tensor; its weights are bit for
    bit those of the plain formula with the scales repeated over their groups (the kernels' reference), for a
    stack of experts `[n, rows, cols]` too."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 40, 256, generator=g) * 0.05
    t = quant.quantize(w, bits, group, symmetric=sym)
    s = t["scales"].float().repeat_interleave(group, dim=-1)
    if bits == 8:
        ref = t["q"].float() * s
    elif sym:
        ref = (quant.unpack4(t["q"]).float() - 8) * s
    else:
        ref = quant.unpack4(t["q"]).float() * s + t["mins"].float().repeat_interleave(group, dim=-1)
    got = quant.dequantize(t, bits, group, dtype)
    assert got.dtype == dtype and got.shape == w.shape
    assert torch.equal(got, ref.to(dtype))
    assert torch.equal(quant.dequantize({k: v[1] for k, v in t.items()}, bits, group, dtype), ref[1].to(dtype))


@pytest.mark.parametrize("bits,group,sym,bound", [(8, 32, False, 0.01), (8, 128, False, 0.01), (4, 32, False, 0.10),
                                                  (4, 128, False, 0.12), (4, 32, True, 0.12), (4, 128, True, 0.14)])
def test_gaussian_weights_lose_what_the_format_predicts(bits, group, sym, bound):
    """Relative Frobenius error of N(0, 1) weights: int8 ~0.5%, int4 min-max ~8-10% (uniform rounding), symmetric
    int4 a little more (no minimum: half a bit per weight fewer at group 32)."""
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    t = quant.quantize(w, bits, group, symmetric=sym)
    err = quant.relative_error(w, t, bits, group)
    assert 0 < err < bound
    assert quant.nbytes(t) == w.numel() * bits // 8 + w.numel() // group * 2 * (1 if bits == 8 or sym else 2)
    if sym:  # more error than min-max, never less than a tenth more here
        assert err > quant.relative_error(w, quant.quantize(w, bits, group), bits, group)


@pytest.mark.parametrize("bits,group,n,msg", [(3, 32, 256, "expected 8 or 4"), (8, 48, 192, "32 or a multiple of 64"),
                                              (8, 96, 192, "32 or a multiple of 64"), (4, 160, 320, "multiple of 64"),
                                              (8, 64, 96, "does not divide"), (4, 32, 96, "multiple of 64")])
def test_formats_the_kernels_cannot_hold_are_one_line_errors(bits, group, n, msg):
    with pytest.raises(InputError, match=msg):
        quant.quantize(torch.zeros(2, n), bits, group)


# --- kernels -----------------------------------------------------------------------------------------------------

@needs_ext
@pytest.mark.parametrize("K", range(1, 9))
def test_bf16_kernel_matches_the_float_reference_for_odd_shapes(K):
    """H = 200, I = 72 (neither a multiple of 32), tokens sharing experts: within 1% of the fp32 reference (the
    kernel rounds the intermediate activation and the output to bf16, as torch's bf16 path does)."""
    S, H, I, T = 9, 200, 72, 3
    gu, dn, g = _experts(S, H, I, seed=K)
    x = torch.randn(T, H, generator=g).bfloat16()
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    ref = swiglu_reference(x.float(), gu.float(), dn.float(), slots, w)
    got = ck.swiglu_bf16(x, gu, dn, slots, w)
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    assert _rel(got, ref) < 1e-2


@needs_ext
def test_bf16_kernel_reads_strided_slot_views():
    """The slot pool's views sit a block apart: the kernel must follow stride(0), not assume packed slots."""
    S, H, I = 4, 64, 32
    gu, dn, g = _experts(S, H, I)
    big_gu = torch.zeros(S, 2 * I + 5, H, dtype=torch.bfloat16)
    big_gu[:, :2 * I] = gu
    big_dn = torch.zeros(S, H + 3, I, dtype=torch.bfloat16)
    big_dn[:, :H] = dn
    vgu, vdn = big_gu[:, :2 * I], big_dn[:, :H]
    assert not vgu.is_contiguous()
    x, slots, w = torch.randn(2, H, generator=g), torch.tensor([[3, 1], [0, 3]]), torch.rand(2, 2, generator=g)
    assert torch.equal(ck.swiglu_bf16(x, vgu, vdn, slots, w), ck.swiglu_bf16(x, gu, dn, slots, w))


@needs_ext
@pytest.mark.parametrize("bits,group,sym", [(8, 32, False), (8, 64, False), (8, 128, False), (4, 32, False),
                                            (4, 64, False), (4, 128, False), (4, 32, True), (4, 64, True),
                                            (4, 128, True)])
@pytest.mark.parametrize("K", [1, 3, 8])
# the larger shape (several tiles per row, ~1 s a case) runs in `make test`; every format, group and K stays fast
@pytest.mark.parametrize("H,I", [(256, 128), pytest.param(768, 512, marks=pytest.mark.slow)])
def test_integer_kernels_equal_their_arithmetic_and_stay_near_the_dequantized_weights(bits, group, sym, K, H, I):
    """Against the same arithmetic in float (dequantized weights, activations rounded as the kernel rounds them):
    5e-4 relative (an activation at a rounding tie may round the other way in float32: ~1e-4 per flip; a wrong
    layout or scale is ~1); against the dequantized weights with exact activations: 4% (the int8 activations'
    rounding)."""
    S, T = 10, 3
    gu, dn, g = _experts(S, H, I, seed=bits * group + K)
    x = torch.randn(T, H, generator=g)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    qg, qd = quant.quantize(gu, bits, group, symmetric=sym), quant.quantize(dn, bits, group, symmetric=sym)
    dg, dd = quant.dequantize(qg, bits, group), quant.dequantize(qd, bits, group)
    got = ck.swiglu_q(x, qg, qd, bits, group, slots, w)
    assert _rel(got, _emulated(x, dg, dd, slots, w)) < 5e-4
    assert _rel(got, swiglu_reference(x, dg, dd, slots, w)) < 4e-2


@needs_ext
@pytest.mark.parametrize("bits,group,sym", [(8, 32, False), (4, 32, False), (4, 64, True)])
def test_a_prompts_many_pair_experts_take_the_gemm_and_the_rest_the_integer_kernel(bits, group, sym):
    """`swiglu_q_split`: an expert with at least `min_pairs` pairs is dequantized and multiplied in x's dtype, so in
    fp32 it equals the dequantized weights with exact activations (1e-5, where the integer kernel is 4% off); the
    other pairs go through the kernel, so a token none of whose choices is such an expert gets the kernel's own row
    (up to the order of its k sums, 1e-5); with no such expert the call is the kernel's, bit for bit."""
    S, T, K, H, I = 6, 12, 2, 256, 128
    gu, dn, g = _experts(S, H, I, seed=bits + group)
    x = torch.randn(T, H, generator=g)
    slots = torch.stack([torch.tensor([0, 1 + t % (S - 1)]) if t < 9 else torch.tensor([1 + t % (S - 1), 2 + t % 4])
                         for t in range(T)])  # expert 0: 9 pairs; the others 3 or 4 each
    w = torch.rand(T, K, generator=g)
    qg, qd = quant.quantize(gu, bits, group, symmetric=sym), quant.quantize(dn, bits, group, symmetric=sym)
    dg, dd = quant.dequantize(qg, bits, group), quant.dequantize(qd, bits, group)
    exact = swiglu_reference(x, dg, dd, slots, w)
    kernel = ck.swiglu_q(x, qg, qd, bits, group, slots, w)
    assert _rel(kernel, exact) > 1e-3  # the kernel's rounding of activations is visible at this size
    assert _rel(ck.swiglu_q_split(x, qg, qd, bits, group, slots, w, min_pairs=1), exact) < 1e-5
    part = ck.swiglu_q_split(x, qg, qd, bits, group, slots, w, min_pairs=9)  # expert 0 alone takes the GEMM
    assert _rel(part[:9], exact[:9]) < 4e-2 and _rel(part[:9], kernel[:9]) > 1e-4
    assert torch.allclose(part[9:], kernel[9:], rtol=1e-5, atol=1e-6)
    assert torch.equal(ck.swiglu_q_split(x, qg, qd, bits, group, slots, w, min_pairs=10), kernel)
    xb = x.bfloat16()  # bf16 in, bf16 out: the GEMM in bf16, within bf16's rounding of the exact result
    got = ck.swiglu_q_split(xb, qg, qd, bits, group, slots, w, min_pairs=1)
    assert got.dtype == torch.bfloat16 and _rel(got, swiglu_reference(xb.float(), dg, dd, slots, w)) < 1e-2


@needs_ext
def test_the_gemm_path_refuses_what_the_kernel_refuses_and_a_reused_buffer_cannot_feed_a_backward():
    """A call all through the GEMM still checks its slots (the kernel's own check, which it skips); and a buffer
    `dequant_q` writes again is seen by autograd: a graph that kept the earlier weights raises, never computes a
    gradient from the new ones."""
    S, H, I = 3, 128, 64
    gu, dn, g = _experts(S, H, I, seed=2)
    qg, qd = quant.quantize(gu, 4, 32), quant.quantize(dn, 4, 32)
    x = torch.randn(4, H, generator=g)
    with pytest.raises(ValueError, match="indices in"):
        ck.swiglu_q_split(x, qg, qd, 4, 32, torch.tensor([[0], [1], [-1], [2]]), torch.ones(4, 1), min_pairs=1)
    with pytest.raises(ValueError, match="rows of x"):
        ck.swiglu_q_split(x[:3], qg, qd, 4, 32, torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1), min_pairs=1)
    buf = torch.empty(2 * I * H)
    w = ck.dequant_q({p: v[0] for p, v in qg.items()}, 4, 32, torch.float32, buf)
    xg = torch.randn(2, H, requires_grad=True)
    y = torch.nn.functional.linear(xg, w)
    ck.dequant_q({p: v[1] for p, v in qg.items()}, 4, 32, torch.float32, buf)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@needs_ext
def test_the_packed_experts_of_a_long_prompt_reach_the_gemm_through_quant_swiglu(monkeypatch):
    """`quant.swiglu` on the CPU (the int8/int4 pools' path) goes through `swiglu_q_split`: an expert with
    `GEMM_PAIRS` pairs is computed from its dequantized weights, one with fewer by the kernel."""
    S, H, I, T = 4, 256, 128, 16
    gu, dn, g = _experts(S, H, I, seed=5)
    q = {}
    for name, w_ in (("gate_up_proj", gu), ("down_proj", dn)):
        q.update({f"{name}.{p}": v for p, v in quant.quantize(w_, 4, 32).items()})
    x = torch.randn(T, H, generator=g)
    slots, w = torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1)
    dg = quant.dequantize(quant.parts(q, "gate_up_proj"), 4, 32)
    dd = quant.dequantize(quant.parts(q, "down_proj"), 4, 32)
    exact = swiglu_reference(x, dg, dd, slots, w)
    monkeypatch.setitem(ck.GEMM_PAIRS, 4, T)
    assert _rel(quant.swiglu(x, q, slots, w), exact) < 1e-5
    monkeypatch.setitem(ck.GEMM_PAIRS, 4, T + 1)
    assert _rel(quant.swiglu(x, q, slots, w), exact) > 1e-3


@needs_ext
@pytest.mark.parametrize("bits,group,sym", [(8, 32, False), (4, 32, False), (4, 64, False), (4, 32, True)])
def test_integer_kernels_take_an_odd_number_of_64_input_chunks(bits, group, sym):
    """int4 reads two 64-input chunks per load; an odd count leaves the last chunk to the one-chunk loop (H 320:
    five chunks, I 192: three)."""
    S, T, K, H, I = 6, 2, 3, 320, 192
    gu, dn, g = _experts(S, H, I, seed=group + bits)
    x = torch.randn(T, H, generator=g)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    qg, qd = quant.quantize(gu, bits, group, symmetric=sym), quant.quantize(dn, bits, group, symmetric=sym)
    dg, dd = quant.dequantize(qg, bits, group), quant.dequantize(qd, bits, group)
    assert _rel(ck.swiglu_q(x, qg, qd, bits, group, slots, w), _emulated(x, dg, dd, slots, w)) < 5e-4
    t = quant.quantize(gu[0], bits, group, symmetric=sym)
    ref = torch.nn.functional.linear(x, quant.dequantize(t, bits, group))
    assert _rel(ck.linear_q(x, t["q"], t["scales"], t.get("mins"), bits, group), ref) < 2e-2


@needs_ext
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group,n", [(32, 512), (32, 320), (64, 768), (64, 320), (128, 512), (192, 576)])
def test_packed_linear_equals_its_integer_arithmetic(sym, group, n):
    """One packed matrix against the dequantized weights times the activations rounded as the kernel rounds them,
    in float64: 1e-5 relative (the sums are exact in int32; only the fp32 scaling differs). n = 320 and 576 hold an
    odd number of 64-input chunks (the int4 loop reads two per 64-byte load, the last one alone); group 192 is
    three chunks."""
    g = torch.Generator().manual_seed(n + group)
    w, x = torch.randn(37, n, generator=g) * 0.05, torch.randn(2, n, generator=g)
    t = quant.quantize(w, 4, group, symmetric=sym)
    ref = _act_rounded(x).double() @ quant.dequantize(t, 4, group).double().T
    got = ck.linear_q(x, t["q"], t["scales"], t.get("mins"), 4, group)
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@needs_ext
@pytest.mark.parametrize("rows,n,out,bias", [(1, 2048, 130, False), (3, 100, 7, True), (8, 33, 64, True)])
def test_linear_kernel_matches_torch(rows, n, out, bias):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(rows, n, generator=g).bfloat16()
    lin = torch.nn.Linear(n, out, bias=bias).bfloat16()
    ref = torch.nn.functional.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    got = ck.linear_bf16(x, lin.weight, lin.bias)
    assert got.dtype == torch.bfloat16 and _rel(got, ref) < 1e-2


@needs_ext
@pytest.mark.parametrize("rows", [2, 3, 5, 8, 11])
def test_a_few_tokens_through_the_linear_kernel_equal_each_token_alone(rows):
    """linear_bf16 loads each weight row once for up to 8 tokens (and in groups of 8 past that); every token's
    output is bit for bit the one-token call's, so a batched decode step keeps each stream's greedy tokens. Widths
    with a masked tail (100, 33) and an odd number of 64-input steps (2080) included."""
    g = torch.Generator().manual_seed(rows)
    for n in (2048, 2080, 100, 33):
        w = torch.randn(70, n, generator=g).bfloat16()
        b = torch.randn(70, generator=g).bfloat16()
        x = torch.randn(rows, n, generator=g).bfloat16()
        got = ck.linear_bf16(x, w, b)
        for t in range(rows):
            assert torch.equal(got[t], ck.linear_bf16(x[t:t + 1], w, b)[0]), (n, t)


@needs_ext
@pytest.mark.parametrize("bits,group,sym", [(8, 32, False), (8, 128, False), (4, 32, False), (4, 64, False),
                                            (4, 32, True)])
@pytest.mark.parametrize("rows,out,bias", [(1, 130, False), (3, 7, True), (8, 64, True)])
def test_packed_linear_kernel_stays_near_the_dequantized_weights(bits, group, sym, rows, out, bias):
    """`linear_q` (every output row, a tail of out % 4 rows included) within 2% of the dequantized weights with
    exact activations (its int8 activations' rounding), and `QuantLinear` takes the same path for a few rows and
    the dequantized one for many (a prefill), agreeing with both."""
    g = torch.Generator().manual_seed(rows * out + bits)
    n = 256
    w = torch.randn(out, n, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    t = quant.quantize(w, bits, group, symmetric=sym)
    x = torch.randn(rows, n, generator=g)
    ref = torch.nn.functional.linear(x, quant.dequantize(t, bits, group), b)
    got = ck.linear_q(x, t["q"], t["scales"], t.get("mins"), bits, group, b)
    assert got.shape == (rows, out) and _rel(got, ref) < 2e-2
    lin = qlinear.QuantLinear(n, out, bits, group, bias, torch.float32, device="cpu", symmetric=sym)
    assert set(lin.packed()) == set(t)
    for part, v in t.items():
        getattr(lin, qlinear.LINEAR_PARTS[part]).copy_(v)
    if bias:
        lin.bias.data.copy_(b)
    with torch.no_grad():
        assert torch.equal(lin(x), got)  # a few rows: the kernel
        many = torch.cat([x] * 4)  # 4 x rows > MAX_ROWS for rows 3 and 8: the dequantized weight
        assert _rel(lin(many), torch.cat([ref] * 4)) < (2e-2 if len(many) <= ck.MAX_ROWS else 1e-5)


@needs_ext
def test_a_prefills_packed_linears_share_one_buffer_and_a_backward_keeps_its_own_weight():
    """Many rows: two `QuantLinear`s one after the other give exactly `F.linear` over `quant.dequantize`'s weights
    (the C++ pass writes the same values into one reused buffer); with autograd recording, the weight is a tensor
    of its own, so a gradient taken after the other layer ran is still the first layer's."""
    g = torch.Generator().manual_seed(3)
    lins, refs = [], []
    for out in (96, 64):
        t = quant.quantize(torch.randn(out, 128, generator=g), 4, 32)
        lin = qlinear.QuantLinear(128, out, 4, 32, False, torch.float32, device="cpu")
        for part, v in t.items():
            getattr(lin, qlinear.LINEAR_PARTS[part]).copy_(v)
        lins.append(lin)
        refs.append(quant.dequantize(t, 4, 32))
    x = torch.randn(16, 128, generator=g)
    with torch.no_grad():
        a, b = lins[0](x), lins[1](x)
        assert torch.equal(a, torch.nn.functional.linear(x, refs[0]))
        assert torch.equal(b, torch.nn.functional.linear(x, refs[1]))
    xg = x.clone().requires_grad_(True)
    y = lins[0](xg)
    lins[1](x)  # writes the shared buffer
    y.sum().backward()
    assert torch.allclose(xg.grad, refs[0].sum(0).expand(16, -1), rtol=1e-5, atol=1e-5)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hk,L,D", [(1, 32, 4, 40, 128), (2, 8, 8, 1, 64), (3, 12, 4, 77, 8),
                                         (1, 16, 1, 300, 256), (2, 6, 2, 33, 72)])
def test_one_token_attention_matches_sdpa(dtype, B, Hq, Hk, L, D):
    """`attend_one` against torch's attention in fp32 on the same (rounded) inputs: grouped heads, a padding mask
    (each row's first keys masked), and keys/values read as strided views of a longer cache; a row whose keys are
    all masked reads zeros."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(B * L + D)
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    cache_k = torch.randn(B, Hk, L + 5, D, generator=g).to(dtype)
    cache_v = torch.randn(B, Hk, L + 5, D, generator=g).to(dtype)
    k, v = cache_k[:, :, :L], cache_v[:, :, :L]  # rows contiguous, the key axis strided past the cache's end
    keep = torch.ones(B, L, dtype=torch.bool)
    for b in range(B):
        keep[b, : min(b, L - 1)] = False  # row b's first b keys are padding
    mask = torch.zeros(B, L).masked_fill(~keep, float("-inf"))
    scale = 0.3 / D ** 0.5
    ref = F.scaled_dot_product_attention(q.float()[:, :, None], k.float(), v.float(), attn_mask=keep[:, None, None],
                                         scale=scale, enable_gqa=True)[:, :, 0]
    got = ck.attend_one(q, k, v, mask, scale)
    assert got.dtype == dtype and got.shape == (B, Hq, D)
    assert (got.float() - ref).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(ck.attend_one(q, k, v, None, scale), ck.attend_one(q, k, v, torch.zeros(B, L), scale))
    dead = mask.clone()
    dead[0] = float("-inf")
    assert not ck.attend_one(q, k, v, dead, scale)[0].any()
    if B > 1 and L > 1:  # a masked key weighs exactly 0: its values (here huge) never reach the output
        v2 = v.clone()
        v2[1, :, 0] = 1e30
        assert torch.equal(ck.attend_one(q, k, v2, mask, scale)[1], got[1])
    with pytest.raises(RuntimeError, match="additive floating"):
        ck.attend_one(q, k, v, keep, scale)


@needs_ext
def test_the_attention_function_takes_one_token_steps_and_hands_the_rest_to_sdpa():
    """The interface function: a one-token step with transformers' boolean padding mask goes through `attend_one`;
    a prefill, a step under grad and per-query masks go to transformers' sdpa function; both agree."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal, training = 4, True, False

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, n, 64, generator=g) for s, n in ((8, 1), (2, 9), (2, 9)))
    q = q.transpose(1, 2).reshape(2, 8, 1, 64)
    keep = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keep[1, ..., :3] = False
    calls = []
    real = ck.attend_one
    try:
        ck.attend_one = lambda *a: calls.append(1) or real(*a)
        with torch.no_grad():
            out, w = patches.attention(Attn(), q, k, v, keep, scaling=0.125)
        assert calls and w is None and out.shape == (2, 1, 8, 64)
        ref, _ = sdpa_attention_forward(Attn(), q, k, v, keep, scaling=0.125)
        assert (out - ref).abs().max().item() < 1e-5
        calls.clear()
        with torch.no_grad():  # a prefill: sdpa
            q3 = torch.randn(2, 8, 3, 64, generator=g)
            patches.attention(Attn(), q3, k, v, None, scaling=0.125)
        patches.attention(Attn(), q, k, v, keep, scaling=0.125)  # grad enabled (training): sdpa
        with torch.no_grad():  # a one-row query against two rows of keys (sdpa broadcasts it): sdpa
            out1, _ = patches.attention(Attn(), q[:1], k, v, None, scaling=0.125)
        assert out1.shape == (2, 1, 8, 64) and not calls
    finally:
        ck.attend_one = real


@needs_ext
def test_the_decode_steps_small_ops_equal_the_modules_they_replace_bit_for_bit():
    """`rms_norm`, `qk_norm_rope` and `route_topk` against transformers' Qwen3-MoE RMSNorm, q/k norm + rotary
    embedding, and top-k router (its F.linear through `linear_bf16`, as the engine ran it before): equal outputs,
    bit for bit, over shapes, scales, batch rows and positions (the means of squares go through the modules' own ATen
    reduction, so even fp32 norms agree exactly)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i in range(40):
            n = (2048, 128, 96, 64)[i % 4]
            for dt in (torch.bfloat16, torch.float32):
                m = qm.Qwen3MoeRMSNorm(n, eps=1e-6).to(dt)
                m.weight.data = (torch.randn(n, generator=g) * 0.3 + 1).to(dt)
                x = (torch.randn(3, n, generator=g) * (1 + i)).to(dt)
                assert torch.equal(qm.Qwen3MoeRMSNorm.forward(m, x), ck.rms_norm(x, m.weight, 1e-6)), (n, dt)
            B, Hq, Hk, D = 1 + i % 3, 8, 2, 128
            qn, kn = qm.Qwen3MoeRMSNorm(D).bfloat16(), qm.Qwen3MoeRMSNorm(D, eps=1e-5).bfloat16()
            for nm in (qn, kn):
                nm.weight.data = (torch.randn(D, generator=g) * 0.3 + 1).bfloat16()
            q, k = torch.randn(B, 1, Hq, D, generator=g).bfloat16(), torch.randn(B, 1, Hk, D, generator=g).bfloat16()
            pos = torch.randint(0, 4000, (B, 1), generator=g).float()
            f = pos[..., None] / (1e6 ** (torch.arange(0, D, 2).float() / D))
            emb = torch.cat((f, f), -1)
            cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
            rq, rk = qm.apply_rotary_pos_emb(qn(q).transpose(1, 2), kn(k).transpose(1, 2), cos, sin)
            fq, fk = torch.ops.expertcache_cpu.qk_norm_rope(q, k, qn.weight, kn.weight, 1e-6, 1e-5, cos, sin)
            assert torch.equal(rq, fq) and torch.equal(rk, fk), i
        cfg = Qwen3MoeConfig(hidden_size=256, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True)
        r = qm.Qwen3MoeTopKRouter(cfg).bfloat16()
        torch.nn.init.normal_(r.weight, std=0.05, generator=g)
        for i in range(60):  # bf16 logits tie often: the experts must come in torch.topk's order
            x = torch.randn(1 + i % 4, 256, generator=g).bfloat16()
            want, got = patches._own_router(r, x), ck.route_topk(x, r.weight, 8, True)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), i
        r.norm_topk_prob = False
        assert all(torch.equal(a, b) for a, b in zip(patches._own_router(r, x), ck.route_topk(x, r.weight, 8, False)))


@needs_ext
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_fused_projections_give_each_module_its_own_rows_bit_for_bit(bits):
    """q, k and v projections (bf16 or packed) fused into one matrix: one call gives, row for row, exactly the three
    modules' own outputs; the modules' weights become views of the fused rows (nothing held twice) and still
    compute alone; modules that differ (a bias, another format) are not fused."""
    g = torch.Generator().manual_seed(3)
    mods = []
    for out in (256, 64, 64):
        lin = torch.nn.Linear(128, out, bias=False).bfloat16().requires_grad_(False)
        lin.weight.copy_((torch.randn(out, 128, generator=g) * 0.05).bfloat16())
        if bits is not None:
            q = quant.quantize(lin.weight, bits, 32)
            ql = qlinear.QuantLinear(128, out, bits, 32, False, device="cpu")
            ql.weight_q, ql.weight_scales = q["q"], q["scales"]
            if bits == 4:
                ql.weight_mins = q["mins"]
            lin = ql
        mods.append(lin)
    x = torch.randn(2, 1, 128, generator=g).bfloat16()
    with torch.no_grad():
        own = [m(x) if bits is not None else ck.linear_bf16(x, m.weight) for m in mods]
        f = patches._FusedProjections.make(mods)
        assert f is not None and f.sizes == [256, 64, 64]
        for got, want in zip(f(x).split(f.sizes, -1), own):
            assert torch.equal(got, want)
        part = mods[1].weight_q if bits is not None else mods[1].weight
        big = f.parts["weight_q" if bits is not None else "weight"]
        assert part.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()  # a view, not a copy
        again = [m(x) if bits is not None else ck.linear_bf16(x, m.weight) for m in mods]
        assert all(torch.equal(a, b) for a, b in zip(again, own))
        assert f.current(mods)
        if bits is None:  # a weight replaced (not written in place): the fused rows are stale, and say so
            mods[2].weight = torch.nn.Parameter(mods[2].weight.clone(), requires_grad=False)
        else:
            mods[2].weight_q = mods[2].weight_q.clone()
        assert not f.current(mods)
    odd = torch.nn.Linear(128, 64, bias=True).bfloat16()
    assert patches._FusedProjections.make([torch.nn.Linear(128, 64, bias=False).bfloat16().requires_grad_(False), odd]) \
        is None


@needs_ext
def test_only_norms_and_routers_that_compute_the_kernels_formula_are_patched():
    """A norm named like one but computing something else (Gemma's `(1 + w)`) and a router without the expected
    fields keep their own forward; the real ones are patched and go back on `unpatch_linears`."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

    class OffsetRMSNorm(qm.Qwen3MoeRMSNorm):
        def forward(self, x):
            v = x.float().pow(2).mean(-1, keepdim=True)
            return ((1 + self.weight.float()) * (x.float() * torch.rsqrt(v + self.variance_epsilon))).to(x.dtype)

    class OneRoundingRMSNorm(qm.Qwen3MoeRMSNorm):  # GPT-OSS's order: the weight multiplies in fp32, one rounding
        def forward(self, x):
            v = x.float().pow(2).mean(-1, keepdim=True)
            return (self.weight.float() * (x.float() * torch.rsqrt(v + self.variance_epsilon))).to(x.dtype)

    model = torch.nn.ModuleDict({"a": qm.Qwen3MoeRMSNorm(64).bfloat16(), "b": OffsetRMSNorm(64).bfloat16(),
                                 "c": OneRoundingRMSNorm(64).bfloat16()})
    with torch.no_grad():
        model["c"].weight.copy_((torch.randn(64, generator=torch.Generator().manual_seed(0)) * 0.3 + 1).bfloat16())
    done = patches.patch_norms(model)
    assert done == [model["a"]] and "forward" not in model["b"].__dict__ and "forward" not in model["c"].__dict__
    cfg = Qwen3MoeConfig(hidden_size=128, num_experts=16, num_experts_per_tok=4)
    good, odd = qm.Qwen3MoeTopKRouter(cfg).bfloat16(), qm.Qwen3MoeTopKRouter(cfg).bfloat16()
    del odd.hidden_dim  # not the layout route_topk takes
    patched, rest = patches.patch_routers([good, odd])
    assert patched == [good] and rest == [odd]
    patches.unpatch_linears(done + patched)
    assert "forward" not in model["a"].__dict__ and "forward" not in good.__dict__


# --- the engine --------------------------------------------------------------------------------------------------

SWIGLU = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3")


@pytest.fixture(scope="module")
def saved(family_checkpoints):
    return family_checkpoints


def _logits(m, steps=4):
    """Prefill 8 tokens, then `steps` decode steps of fixed tokens (not argmax: a near-tie flipped by rounding
    would feed the two models different inputs): every step's logits."""
    from transformers import DynamicCache

    ids = torch.tensor([[5, 9, 33, 2, 71, 100, 7, 12]])
    out = []
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        r = m(input_ids=ids, past_key_values=cache, use_cache=True)
        out.append(r.logits[0, -1].float())
        for t in (3, 14, 15, 92)[:steps]:
            r = m(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            out.append(r.logits[0, -1].float())
    return torch.stack(out)


@needs_ext
@pytest.mark.parametrize("fam", SWIGLU)
def test_engine_kernel_cpu_agrees_with_the_family_forward(saved, fam):
    """Same checkpoint, native vs cpu kernel (experts, attention projections, routers, lm head): logits within 2%
    at every step; the kernel path really ran (its linears are patched while the engine lives, restored after)."""
    from expertcache.runtime import EngineConfig, load

    ref_m = load(saved / fam, engine=EngineConfig(capacity=1.0, tier="host", kernel="native"))
    ref = _logits(ref_m)
    ref_m.expertcache.close()
    m = load(saved / fam, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    eng = m.expertcache
    assert eng.compute.linears and all(mod.fmt.name == "cpu_bf16" for mod in eng.modules)
    assert m.config._attn_implementation == patches.ATTENTION  # the decode steps' attention: attend_one
    calls, real = [], ck.attend_one
    ck.attend_one = lambda *a: calls.append(1) or real(*a)
    try:
        got = _logits(m)
    finally:
        ck.attend_one = real
    assert len(calls) == 4 * m.config.num_hidden_layers or fam == "deepseek_v3", (fam, len(calls))  # MLA: sdpa
    assert _rel(got, ref) < 2e-2, fam
    eng.close()
    assert not any("forward" in mod.__dict__ for mod in m.modules())  # linears, norms, routers, attention
    assert m.config._attn_implementation == "sdpa"
    # with misses: a step's resident experts and victims in one call, each load in its own as it lands (overlap,
    # as for experts >= 1 MiB), their sums added in fp32
    m = load(saved / fam, engine=EngineConfig(capacity=0.25, tier="disk", kernel="cpu"))
    m.expertcache.loads.overlap = True
    got = _logits(m)
    s = m.expertcache.stats
    assert s.demand_loads > 0 and s.hits > 0 and s.victim_hits > 0
    assert _rel(got, ref) < 2e-2, fam
    m.expertcache.close()


@needs_ext
def test_the_fused_norms_router_and_attention_change_no_logit(saved):
    """Qwen3-MoE with kernel cpu: its RMSNorms, routers and attention modules take the one-call decode ops
    (`rms_norm`, `route_topk`, `qk_norm_rope`); every decode step's logits equal, bit for bit, those of the same
    engine with those modules on their own forward again."""
    from expertcache.runtime import EngineConfig, load

    m = load(saved / "qwen3_moe", engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    eng = m.expertcache
    kinds = [type(mod).__name__ for mod in eng.compute.linears if type(mod) is not torch.nn.Linear]
    n_l = m.config.num_hidden_layers
    assert kinds.count("Qwen3MoeRMSNorm") == 4 * n_l + 1 and kinds.count("Qwen3MoeAttention") == n_l, kinds
    assert kinds.count("Qwen3MoeTopKRouter") == n_l
    assert all("_ec_qkv" in mod.__dict__ for mod in eng.compute.linears if type(mod).__name__ == "Qwen3MoeAttention")
    calls = {"rms_norm": 0, "qk_norm_rope": 0, "route_topk": 0}
    real = {n: getattr(ck, n) for n in calls}

    def counted(name):
        def f(*a):
            calls[name] += 1
            return real[name](*a)
        return f

    try:
        for n in calls:
            setattr(ck, n, counted(n))
        fused = _logits(m)  # a prefill of 8 tokens (decode-sized: norms and routers fused) and 4 decode steps
    finally:
        for n in calls:
            setattr(ck, n, real[n])
    assert calls == {"rms_norm": 5 * (2 * n_l + 1), "qk_norm_rope": 4 * n_l, "route_topk": 5 * n_l}, calls
    mods = [mod for mod in eng.compute.linears if type(mod).__name__ in ("Qwen3MoeRMSNorm", "Qwen3MoeAttention")]
    routers = [mod for mod in eng.compute.linears if type(mod).__name__ == "Qwen3MoeTopKRouter"]
    saved_fwd = {id(mod): mod.__dict__.pop("forward") for mod in mods + [m]}  # (m: the whole-step function)
    for r in routers:  # the router as the engine ran it before: F.linear through linear_bf16
        saved_fwd[id(r)] = r.__dict__.pop("forward")
    patches.patch_calls(routers)
    try:
        plain = _logits(m)
    finally:
        for mod in mods + routers + [m]:
            mod.forward = saved_fwd[id(mod)]
    assert torch.equal(fused, plain)  # (plain: the attention's own forward, q, k and v one call each)
    eng.close()
    assert not any("forward" in mod.__dict__ or "_ec_qkv" in mod.__dict__ for mod in m.modules())


@needs_ext
def test_left_padded_batched_decode_attends_through_the_padding_mask(saved):
    """Two left-padded rows decoded together (transformers' own mask for the padding): each step's attention goes
    through `attend_one` with the mask, and the logits equal those of sdpa on the same engine within rounding."""
    from transformers import DynamicCache

    from expertcache.runtime import EngineConfig, load

    m = load(saved / "qwen3_moe", engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    eng = m.expertcache
    ids = torch.tensor([[0, 0, 0, 5, 9, 33], [7, 12, 71, 100, 2, 8]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    real, masks = ck.attend_one, []

    def run(impl):
        for c in eng.compute.attention:
            c._attn_implementation_internal = impl
        out, am = [], mask.clone()
        with torch.no_grad():
            cache = DynamicCache(config=m.config)
            r = m(input_ids=ids, attention_mask=am, past_key_values=cache, use_cache=True)
            out.append(r.logits[:, -1].float())
            for t in ([3, 4], [14, 15], [92, 1]):
                am = torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1)
                r = m(input_ids=torch.tensor([t]).T, attention_mask=am, past_key_values=cache, use_cache=True)
                out.append(r.logits[:, -1].float())
        return torch.stack(out)

    try:
        ck.attend_one = lambda q, k, v, mk=None, sc=None: masks.append(mk) or real(q, k, v, mk, sc)
        got = run(patches.ATTENTION)
        ref = run("sdpa")
    finally:
        ck.attend_one = real
        eng.close()
    assert len(masks) == 3 * m.config.num_hidden_layers
    assert all(mk is not None and torch.isinf(mk[0, :3]).all() and not torch.isinf(mk[1]).any() for mk in masks)
    assert _rel(got, ref) < 2e-2


@needs_ext
def test_kernel_cpu_refuses_what_it_cannot_compute_and_auto_falls_back(saved, tmp_path):
    from expertcache.runtime import EngineConfig, load
    from tiny_models import build_model, tiny_config

    with pytest.raises(InputError, match="kernel cpu computes bf16 SwiGLU experts"):  # biases, another activation
        load(saved / "gpt_oss", engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    build_model(tiny_config("qwen3_moe"), seed=5, dtype=torch.float32).save_pretrained(tmp_path / "f32")
    with pytest.raises(InputError, match="in torch.float32"):
        load(tmp_path / "f32", engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    a = load(tmp_path / "f32", engine=EngineConfig(capacity=1.0, tier="host", kernel="auto"))
    n = load(tmp_path / "f32", engine=EngineConfig(capacity=1.0, tier="host", kernel="native"))
    assert torch.equal(_logits(a), _logits(n))  # auto where it does not apply is the native path, bit for bit


FALLBACK = textwrap.dedent("""
    import sys, warnings, torch
    from expertcache.runtime import EngineConfig, load
    from expertcache.runtime.kernels import cpu_kernels as ck
    from expertcache.telemetry.errors import InputError
    if sys.argv[1] == "broken":
        ck._SRC = ck.Path(sys.argv[2])
    warnings.simplefilter("default")
    print("available", ck.available(), ck.available())
    m = load(sys.argv[3], engine=EngineConfig(capacity=1.0, tier="host", kernel="auto"))
    with torch.no_grad():
        m(input_ids=torch.tensor([[1, 2, 3]]))
    print("auto ran")
    try:
        load(sys.argv[3], engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    except InputError as e:
        print("cpu refused:", e)
""")


@pytest.mark.slow  # a subprocess each (a killed recorder; a compiler run)
@pytest.mark.parametrize("how", ["disabled", "broken"])
def test_an_unbuildable_extension_falls_back_with_one_warning_line(saved, tmp_path, how):
    """No extension (switched off, or a source that does not compile): `auto` computes with torch, `cpu` is refused
    in one line, and the only trace is one warning line, never an import error."""
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    env = dict(os.environ, EXPERTCACHE_CACHE=str(tmp_path / "cache"))
    if how == "disabled":
        env["EXPERTCACHE_NO_EXT"] = "1"
    r = subprocess.run([sys.executable, "-c", FALLBACK, how, str(bad), str(saved / "qwen3_moe")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "available False False" in r.stdout and "auto ran" in r.stdout
    assert "cpu refused: kernel cpu: the CPU expert kernels are unavailable here" in r.stdout
    warn = [ln for ln in r.stderr.splitlines() if "CPU expert kernels unavailable" in ln]
    assert len(warn) == 1, r.stderr
    assert ("EXPERTCACHE_NO_EXT" in warn[0]) if how == "disabled" else ("the build failed" in warn[0])
    assert "Traceback" not in r.stderr


# --- quantized checkpoints ---------------------------------------------------------------------------------------

def _dequantized_reference(src, qdir, bits, group):
    """The original model with every routed expert replaced by what the quantized store's integers stand for."""
    from transformers import AutoModelForCausalLM

    from expertcache.runtime.storage.checkpoint import StoreExperts
    from expertcache.runtime.storage.store import read_store_meta
    from expertcache.runtime.storage.tiers import HostTier
    from expertcache.telemetry.adapters import adapter_for

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    store = qdir / quant.EXPERTS_FILE
    tier = HostTier(StoreExperts(store, read_store_meta(store)))
    for i, L in enumerate(adapter_for(ref).moe_layers(ref)):
        v = tier.layer_views(i)
        for name in ("gate_up_proj", "down_proj"):
            getattr(L.experts, name).data.copy_(quant.dequantize(quant.parts(v, name), bits, group))
    return ref


@pytest.mark.parametrize("fam", SWIGLU)
@pytest.mark.parametrize("bits,sym", [(8, False), (4, False), (4, True)])
def test_a_quantized_checkpoint_decodes_like_its_dequantized_reference(saved, tmp_path, fam, bits, sym):
    """`expertcache quantize`, then `load`: every step's logits within 5% of the original model whose experts hold
    the dequantized integers (the integer kernels also round activations to int8; without the extension the
    dequantized path runs and the bound still holds). The slots hold packed bytes: a quarter or an eighth of the
    float block, padding aside."""
    from transformers import AutoModelForCausalLM

    from expertcache.runtime import EngineConfig, load
    from tiny_models import build_model, tiny_config

    src = tmp_path / "src"  # inputs that are multiples of 64 (the int4 chunk): hidden 64, expert 64
    build_model(tiny_config(fam, hidden_size=64, moe_intermediate_size=64, intermediate_size=64),
                seed=7, dtype=torch.bfloat16).save_pretrained(src)
    q = tmp_path / "q"
    rep = quant_write.write_quantized(src, q, bits, 32, symmetric=sym)
    assert rep["bytes_ratio"] < (0.6 if bits == 8 else 0.35)
    assert all(0 < e < (0.02 if bits == 8 else 0.15) for v in rep["relative_error"].values() for e in v)
    assert json.loads((q / "config.json").read_text())["quantization_config"]["symmetric"] == (bits == 8 or sym)
    ref = _logits(_dequantized_reference(src, q, bits, 32))
    m = load(q, engine=EngineConfig(capacity=0.5, tier="disk", kernel="auto"))
    eng = m.expertcache
    assert (eng.modules[0].fmt.name, eng.modules[0].fmt.group) == (f"int{bits}", 32)
    assert {t.name for t in eng.meta.tensors} >= {"gate_up_proj.q", "down_proj.scales"}
    assert ("down_proj.mins" in {t.name for t in eng.meta.tensors}) == (bits == 4 and not sym)
    got = _logits(m)
    assert _rel(got, ref) < 5e-2, (fam, bits)
    assert eng.stats.demand_loads > 0 and eng.stats.hits > 0  # misses were read from the store and computed
    assert eng.stats.bytes_moved == eng.stats.demand_loads * eng.meta.expert_bytes  # packed bytes moved
    plain = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    e0 = plain.model.layers[0].mlp.experts
    fbytes = (e0.gate_up_proj[0].numel() + e0.down_proj[0].numel()) * 2
    assert eng.meta.expert_bytes == fbytes * (1 if bits == 8 else 0.5) / 2 + fbytes // 2 // 32 * 2 * (
        1 if bits == 8 or sym else 2)
    eng.close()


@needs_ext
@pytest.mark.parametrize("bits", [8, 4])
def test_a_prompts_packed_experts_through_the_gemm_give_the_dequantized_models_logits(saved, tmp_path, monkeypatch,
                                                                                      bits):
    """Through the engine (cache of half the experts, disk tier), with every expert of a call taking the GEMM
    (`GEMM_PAIRS` 1): the prefill's logits are the model holding the dequantized integers up to bf16's rounding
    (1e-2, where the integer kernel's int8 activations are allowed 5%), and the GEMM really ran (the prefill
    alone: no decode step)."""
    from expertcache.runtime import EngineConfig, load
    from tiny_models import build_model, tiny_config

    src = tmp_path / "src"
    build_model(tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64, intermediate_size=64),
                seed=7, dtype=torch.bfloat16).save_pretrained(src)
    q = tmp_path / "q"
    quant_write.write_quantized(src, q, bits, 32)
    ref = _logits(_dequantized_reference(src, q, bits, 32), steps=0)
    calls = []
    real = ck.dequant_q
    monkeypatch.setattr(ck, "dequant_q", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setitem(ck.GEMM_PAIRS, bits, 1)
    m = load(q, engine=EngineConfig(capacity=0.5, tier="disk", kernel="auto"))
    got = _logits(m, steps=0)
    m.expertcache.close()
    assert calls and _rel(got, ref) < 1e-2, _rel(got, ref)


@pytest.mark.parametrize("fam", SWIGLU)
@pytest.mark.parametrize("bits,sym", [(8, False), (4, False), (4, True)])
def test_quantized_linears_decode_like_their_dequantized_reference(saved, tmp_path, fam, bits, sym):
    """`quantize --linears true`: the attention projections and the untied output head are packed too (never the
    routers; a layer whose input size the kernel cannot take is kept, with why). Loaded, those modules are
    `QuantLinear`s and every step's logits are within 5% of the original model holding the dequantized integers in
    its experts and in those linears; the model file shrinks by what was packed."""
    from safetensors.torch import load_file

    from expertcache.runtime import EngineConfig, load
    from tiny_models import build_model, tiny_config

    src = tmp_path / "src"
    build_model(tiny_config(fam, hidden_size=64, moe_intermediate_size=64, intermediate_size=64,
                            tie_word_embeddings=False), seed=7, dtype=torch.bfloat16).save_pretrained(src)
    q = tmp_path / "q"
    rep = quant_write.write_quantized(src, q, bits, 32, linears=True, symmetric=sym)
    lin = rep["linears"]
    assert any(n.endswith("q_proj") for n in lin["modules"]) and "lm_head" in lin["modules"], lin
    assert not any(n.endswith((".gate", "router")) for n in lin["modules"])  # routers stay exact
    assert all(0 < e < (0.02 if bits == 8 else 0.15) for e in lin["relative_error"].values())
    assert all("not a multiple of 64" in why for why in lin["skipped"])
    ref = _dequantized_reference(src, q, bits, 32)
    tensors = load_file(str(q / "model.safetensors"))
    for name in lin["modules"]:
        ck = checkpoint_name(f"{name}.weight", adapter_family(ref))
        t = {part: tensors[f"{ck}_{part}"] for part in ("q", "scales", "mins") if f"{ck}_{part}" in tensors}
        assert f"{ck}" not in tensors  # the float weight is gone: only its packed form is stored
        ref.get_submodule(name).weight.data.copy_(quant.dequantize(t, bits, 32))
    m = load(q, engine=EngineConfig(capacity=1.0, tier="host", kernel="auto"))
    for name in lin["modules"]:
        assert isinstance(m.get_submodule(name), qlinear.QuantLinear)
        assert hasattr(m.get_submodule(name), "weight_mins") == (bits == 4 and not sym)
    assert _rel(_logits(m), _logits(ref)) < 5e-2, (fam, bits)
    # the batched step-wise evaluation sizes its forwards from the output head, packed here
    import numpy as np

    from expertcache.evals.stepwise import batched_nll

    rows = np.random.default_rng(0).integers(2, 100, size=(3, 16))
    got, want = np.array(list(batched_nll(m, rows))), np.array(list(batched_nll(ref, rows)))
    assert np.all(np.abs(got - want) <= 5e-2 * np.abs(want)), (got, want)
    m.expertcache.close()


def adapter_family(model) -> str:
    from expertcache.telemetry.adapters import adapter_for

    return adapter_for(model).family


def checkpoint_name(name, family):
    from expertcache.runtime.storage.checkpoint import checkpoint_name as cn

    return cn(name, family)


def test_a_damaged_linears_list_is_one_line(saved, tmp_path):
    import json
    import shutil

    from expertcache.runtime import load
    from tiny_models import build_model, tiny_config

    src = tmp_path / "src"
    build_model(tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64, intermediate_size=64,
                            tie_word_embeddings=False), seed=7, dtype=torch.bfloat16).save_pretrained(src)
    quant_write.write_quantized(src, tmp_path / "q", 8, 32, linears=True)
    for bad, msg in ((["model.norm"], "does not have as a linear"), ("lm_head", "not a list of module names"),
                     (["model.layers.0.self_attn.q_proj", "no.such.module"], "'no.such.module'")):
        d = tmp_path / f"bad{len(msg)}"
        shutil.copytree(tmp_path / "q", d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["linears"]["modules"] = bad
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(InputError, match=msg):
            load(d, capacity=1.0, tier="host")


def test_a_symmetric_flag_that_contradicts_the_packed_linears_is_one_line(tmp_path):
    """The stored minimums decide the format as much as config.json does: `symmetric` false over packed linears or
    experts stored without minimums, or true over ones that have them, is refused at load in one line (for the
    linears the one would have left meta buffers behind, the other computed min-max codes as if symmetric; the
    experts compute from what is stored either way, but config.json would describe them wrongly)."""
    import json
    import shutil

    from expertcache.runtime import load
    from tiny_models import build_model, tiny_config

    src = tmp_path / "src"
    build_model(tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64, intermediate_size=64,
                            tie_word_embeddings=False), seed=7, dtype=torch.bfloat16).save_pretrained(src)
    cases = [(True, True, "says min-max int4, not symmetric"), (False, True, "says symmetric, but packed linear"),
             (True, False, "says symmetric=false, but its expert store has no minimums"),
             (False, False, "says symmetric=true, but its expert store holds minimums")]
    for sym, linears, msg in cases:
        q = tmp_path / f"q{sym}{linears}"
        quant_write.write_quantized(src, q, 4, 32, linears=linears, symmetric=sym)
        load(q, capacity=1.0, tier="host").expertcache.close()  # as written: loads
        d = tmp_path / f"flipped{sym}{linears}"
        shutil.copytree(q, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["symmetric"] = not sym
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(InputError, match=msg):
            load(d, capacity=1.0, tier="host")


@pytest.fixture(scope="module")
def with_int4_copy(tmp_path_factory):
    """A bf16 qwen3_moe checkpoint (dimensions the int4 chunk takes) and its `expertcache quantize --bits 4` copy."""
    from tiny_models import build_model, tiny_config

    root = tmp_path_factory.mktemp("miss-precision")
    src, q = root / "src", root / "q4"
    build_model(tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64, intermediate_size=64),
                seed=7, dtype=torch.bfloat16).save_pretrained(src)
    quant_write.write_quantized(src, q, 4, 32)
    return src, q


def test_a_miss_is_served_from_the_packed_copy_and_hot_experts_are_upgraded(with_int4_copy):
    """`miss_precision=4`: a miss reads the 4-bit copy's packed bytes (nothing at full precision) and is not
    admitted. Never upgraded, every expert is served from the copy, so the model is its dequantized reference (within
    the integer kernels' 5%); upgraded after one serve, hot experts are admitted at full precision in the background
    and later tokens hit them."""
    from expertcache.runtime import EngineConfig, load

    src, q = with_int4_copy
    ref = _logits(_dequantized_reference(src, q, 4, 32), steps=6)
    m = load(src, engine=EngineConfig(capacity=0.5, tier="disk", miss_precision=4, miss_copy=str(q),
                                      miss_upgrade=10**6))
    eng = m.expertcache
    got = _logits(m, steps=6)
    st, low_bytes = eng.stats, eng.low_tier.meta.expert_bytes
    eng.close()
    assert _rel(got, ref) < 5e-2
    assert st.hits == 0 and st.demand_loads == 0 and st.upgrade_loads == 0 and st.lowbit_served > 0
    assert st.lowbit_bytes == st.bytes_moved == st.lowbit_served * low_bytes  # packed bytes, and only those
    assert low_bytes < 0.35 * eng.meta.expert_bytes
    m = load(src, engine=EngineConfig(capacity=0.5, tier="disk", miss_precision=4, miss_copy=str(q), miss_upgrade=1))
    eng = m.expertcache
    _logits(m, steps=6)
    st, pending = eng.stats, sum(len(u) for u in eng.loads.upgrading)  # upgrades counted when their layer next runs
    eng.close()
    assert st.upgrade_loads > 0 and st.hits > 0  # upgraded experts came back at full precision and hit
    full, eb = st.bytes_moved - st.lowbit_bytes, eng.meta.expert_bytes
    assert full % eb == 0 and st.upgrade_loads * eb <= full <= (st.upgrade_loads + pending) * eb


def test_miss_precision_refuses_what_it_cannot_serve_in_one_line(with_int4_copy, tmp_path):
    from expertcache.runtime import load
    from expertcache.runtime.engine.config import EngineConfig

    src, q = with_int4_copy
    for cfg, msg in ((dict(miss_precision=3), "miss_precision=3; expected 0 \\(off\\), 4 or 8 bits"),
                     (dict(miss_precision=4), "needs --engine.miss_copy DIR"),
                     (dict(miss_precision=8, miss_copy=str(q)), "packed at 4 bits; miss_precision is 8"),
                     (dict(miss_precision=4, miss_copy=str(src)), "not an `expertcache quantize` checkpoint"),
                     (dict(miss_precision=4, miss_copy=str(q), miss="reroute"), "replaces the miss policy"),
                     (dict(miss_copy=str(q)), "give that too, or drop it"),
                     (dict(miss_precision=4, miss_copy=str(q), miss_upgrade=0), "miss_upgrade=0")):
        with pytest.raises(InputError, match=msg):
            EngineConfig(**cfg).check()
    from tiny_models import build_model, tiny_config

    other = tmp_path / "other"  # another model's copy: 3 layers, not 2
    build_model(tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64, intermediate_size=64,
                            num_hidden_layers=3), seed=7, dtype=torch.bfloat16).save_pretrained(other)
    quant_write.write_quantized(other, tmp_path / "other-q4", 4, 32)
    with pytest.raises(InputError, match="has 3 layers x .* experts; the model has 2 x .*: it is not a copy"):
        load(src, engine=EngineConfig(capacity=0.5, tier="disk", miss_precision=4,
                                      miss_copy=str(tmp_path / "other-q4")))


def test_quantize_refuses_what_it_cannot_write_in_one_line(saved, tmp_path, capsys):
    from expertcache.recipes.cli import main
    from tiny_models import build_model, tiny_config

    src = tmp_path / "src"
    build_model(tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64, intermediate_size=64),
                seed=7, dtype=torch.bfloat16).save_pretrained(src)
    capsys.readouterr()
    cases = [(["--bits", "3"], "--bits 3: expected 8 or 4"),
             (["--bits", "8", "--group_size", "48"], "32 or a multiple of 64"),
             (["--bits", "8", "--group_size", "96"], "32 or a multiple of 64"),
             (["--bits", "8", "--group_size", "128"], "does not divide"),
             (["--bits", "4", "--model", str(saved / "gpt_oss")], "SwiGLU experts without biases"),
             (["--bits", "8", "--symmetric", "true"], "--symmetric true is an int4 option")]
    for extra, msg in cases:
        argv = ["quantize", "--model", str(src), "--out", str(tmp_path / "o")] + extra
        assert main(argv) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], (extra, err)
        assert not (tmp_path / "o").exists()  # nothing half-written
    assert main(["quantize", "--model", str(src), "--out", str(tmp_path / "q8"), "--bits", "8"]) == 0
    capsys.readouterr()
    assert main(["quantize", "--model", str(tmp_path / "q8"), "--out", str(tmp_path / "qq"), "--bits", "4"]) == 2
    assert "already quantized" in capsys.readouterr().err
    cfg = (tmp_path / "q8" / "config.json")
    raw = cfg.read_text()
    cfg.write_text(raw.replace('"quant_method": "expertcache"', '"quant_method": "gptq"'))
    from expertcache.runtime import load

    with pytest.raises(InputError, match="quant_method 'gptq' is not one this runtime reads"):
        load(tmp_path / "q8")
    cfg.write_text(raw.replace('"symmetric": true', '"symmetric": "yes"'))
    with pytest.raises(InputError, match="symmetric='yes': expected true or false"):
        load(tmp_path / "q8")


def test_shapes_the_integer_kernels_do_not_take_are_dequantized_or_refused(tmp_path):
    """Hidden 32 (not a multiple of 64): `kernel auto` computes the quantized experts dequantized (it used to
    raise the extension's RuntimeError from inside the forward); `kernel cpu` is refused in one line naming the
    sizes, before anything decodes."""
    from expertcache.runtime import EngineConfig, load
    from tiny_models import build_model, tiny_config

    src = tmp_path / "src"
    build_model(tiny_config("qwen3_moe", moe_intermediate_size=32), seed=3, dtype=torch.bfloat16).save_pretrained(src)
    q = tmp_path / "q"
    quant_write.write_quantized(src, q, 8, 32)
    ref = _logits(_dequantized_reference(src, q, 8, 32))
    m = load(q, engine=EngineConfig(capacity=0.5, tier="disk", kernel="auto"))
    assert not quant.kernel_fits(m.expertcache.modules[0].fmt.views)
    assert _rel(_logits(m), ref) < 5e-2
    m.expertcache.close()
    with pytest.raises(InputError, match="multiples of 64 and of the group size .32.; this model's are 32 and 32"):
        load(q, engine=EngineConfig(capacity=0.5, tier="disk", kernel="cpu"))


@needs_ext
def test_the_extension_builds_from_a_copy_in_its_cache_so_checkouts_share_it():
    """ninja's build file names the source by path: built from the package's own file, a clean clone's `make test`
    and the working tree rebuilt each other's extension (the cache folder is keyed by the source's content, so they
    share it), and inside bench big's cgroup such a rebuild crawled for over ten minutes. The build reads a copy
    kept in the cache folder, the same path from every checkout."""
    from expertcache.runtime.kernels import cpu_kernels

    d = cpu_kernels.cache_dir()
    ninja = (d / "build.ninja").read_text()
    assert str(d / cpu_kernels._SRC.name) in ninja and str(cpu_kernels._SRC) not in ninja
    assert (d / cpu_kernels._SRC.name).read_bytes() == cpu_kernels._SRC.read_bytes()


def test_each_torch_install_builds_the_extension_in_a_folder_of_its_own(monkeypatch):
    """The build file also names torch's headers by path: a second environment with the same torch version (the
    clean clone's venv) gets a folder of its own instead of rebuilding the working tree's."""
    from expertcache.runtime.kernels import cpu_kernels

    here = cpu_kernels.cache_dir()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/torch/__init__.py")
    there = cpu_kernels.cache_dir()
    assert there != here and there.parent == here.parent and there.name.startswith(here.name.split("-")[0])


@needs_ext
@pytest.mark.slow  # a fresh process that imports torch and loads the extension (12 s of the fast suite's 110 s)
def test_a_build_killed_midway_does_not_hang_the_next_process(tmp_path):
    """torch's build lock is a plain file: a build killed midway (Ctrl-C, the OOM killer) left it behind, and every
    later process waited on it forever without a word (found when a killed benchmark hung the test suite). The
    loader now builds under an flock of its own and removes such a file, saying so."""
    import shutil

    from expertcache.runtime.kernels import cpu_kernels

    d = tmp_path / "ext" / cpu_kernels.cache_dir().name
    shutil.copytree(cpu_kernels.cache_dir(), d)  # the built extension (the fixture built it), mtimes kept
    (d / "lock").write_text("")
    (d / ".build.flock").unlink(missing_ok=True)
    p = subprocess.run([sys.executable, "-c", "from expertcache.runtime.kernels import cpu_kernels; "
                        "print(cpu_kernels.load(), cpu_kernels.why_unavailable())"],
                       env={**os.environ, "EXPERTCACHE_CACHE": str(tmp_path)}, capture_output=True, text=True,
                       timeout=300)
    assert p.stdout.split() == ["True", "None"], (p.stdout, p.stderr)
    assert "left by a build of the CPU kernels that was killed" in p.stderr and not (d / "lock").exists()




@needs_ext
@pytest.mark.parametrize("bits, group, symmetric", [(4, 32, False), (4, 64, False), (4, 128, False), (4, 64, True),
                                                    (8, 32, False), (8, 128, False)])
def test_dequant_kernel_is_the_reference_bit_for_bit(bits, group, symmetric):
    """Streamed training multiplies packed experts as float weights: the one-pass kernel writes exactly what
    `quant.dequantize` computes (its multiply and add rounded apart, as torch's in-place ops), in bf16 and fp32, for
    a chunk of experts at once, into a reused buffer or a fresh one; a buffer too small or of another dtype is
    refused."""
    torch.manual_seed(bits * 1000 + group)
    w = torch.randn(3, 96, 256, dtype=torch.bfloat16) * 0.05
    w[0, 0, :group] = 0  # a group of zeros: scale 0 (and int4's minimum 0)
    t = quant.quantize(w, bits, group, symmetric=symmetric)
    buf = torch.empty(3 * 96 * 256 + 7, dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        ref = quant.dequantize(t, bits, group, dtype)
        assert torch.equal(ck.dequant_q(t, bits, group, dtype), ref)
        one = ck.dequant_q({k: v[1] for k, v in t.items()}, bits, group, dtype)  # one expert, 2-D
        assert torch.equal(one, ref[1])
    got = ck.dequant_q(t, bits, group, torch.bfloat16, out=buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, quant.dequantize(t, bits, group, torch.bfloat16))
    for bad in (torch.empty(10, dtype=torch.bfloat16), torch.empty(buf.numel(), dtype=torch.float16)):
        with pytest.raises(ValueError):
            ck.dequant_q(t, bits, group, torch.bfloat16, out=bad)


@needs_ext
@pytest.mark.skipif(not (ck.available() and ck.amx_available()), reason="no AMX-BF16 tile units on this CPU")
@pytest.mark.parametrize("group,symmetric", [(64, False), (32, False), (128, True)])
def test_packed_int4_times_tokens_on_the_tile_units_equals_the_dequantized_product(group, symmetric):
    """`qmm_amx` (streamed training's int4 expert products): x W^T and x W with W dequantized in registers equal the
    same products with W dequantized by `quant.dequantize` (fp32 product of the same bf16 values), to bf16's
    rounding of the result, for token counts that fill no tile, one, several and more than one pass of six (100),
    and for the shapes of a Qwen3-30B-A3B expert and a small one."""
    g = torch.Generator().manual_seed(group)
    for n, k in ((1536, 2048), (2048, 768), (64, 128)):
        if k % group:
            continue
        t = quant.quantize(torch.randn(n, k, generator=g) * 0.05, 4, group, symmetric=symmetric)
        w = quant.dequantize(t, 4, group, torch.bfloat16).float()
        for m in (1, 17, 48, 100):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            xt = torch.randn(m, n, generator=g).to(torch.bfloat16)
            for got, ref in ((ck.qmm_amx(x, t, group), x.float() @ w.t()),
                             (ck.qmm_amx(xt, t, group, trans=True), xt.float() @ w)):
                assert got.dtype == torch.bfloat16 and got.shape == ref.shape
                torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=ref.abs().max().item() * 4e-3)
    assert ck.qmm_fits(t, 4, group) and not ck.qmm_fits(t, 8, group)
    assert not ck.qmm_fits({"q": torch.zeros(48, 64, dtype=torch.uint8)}, 4, group)  # rows not a multiple of 32


@needs_ext
def test_bench_attention_times_both_arms_and_they_decode_the_same_tokens(saved, tmp_path):
    """`expertcache bench attention` (once scripts/ab_attention.py): our decode attention and sdpa alternated on one
    loaded model, each round timing both; the two arms decode the same greedy tokens; the result file carries the
    command that reruns it."""
    import json

    from expertcache.recipes.cli import main

    out = tmp_path / "attention.json"
    assert main(["bench", "attention", "--model", str(saved / "qwen3_moe"), "--context", "8", "--tokens", "3",
                 "--rounds", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["same_tokens"] is True
    assert len(r["kernel"]["rounds_ms"]) == len(r["sdpa"]["rounds_ms"]) == 2
    assert all(x > 0 for arm in ("kernel", "sdpa") for x in r[arm]["rounds_ms"])
    assert r["command"].startswith("expertcache bench attention --model")
    assert main(["bench", "attention", "--model", str(saved / "qwen3_moe"), "--rounds", "0"]) == 2
