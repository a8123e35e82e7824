"""The triton SwiGLU expert kernel against its torch reference, run by triton's interpreter on CPU tensors."""

import os
import subprocess
import sys

import pytest
import torch

from expertcache.runtime.kernels.triton_experts import swiglu_reference

CHECK = r"""
import torch
from expertcache.runtime.kernels.triton_experts import HAVE_TRITON, swiglu_reference, swiglu_triton
from expertcache.runtime.storage.store import layout
from expertcache.runtime.storage.tiers import SlotPool
from expertcache.runtime.storage.store import StoreMeta
assert HAVE_TRITON
g = torch.Generator().manual_seed(0)
H, I, S, T, K = 48, 40, 5, 3, 2
specs, block = layout([("gate_up_proj", [2 * I, H], "float32"), ("down_proj", [H, I], "float32")])
pool = SlotPool(StoreMeta("t", 1, S, specs, block), S)  # strided slot views, as the engine has them
pool.views["gate_up_proj"].copy_(torch.randn(S, 2 * I, H, generator=g) * 0.1)
pool.views["down_proj"].copy_(torch.randn(S, H, I, generator=g) * 0.1)
x = torch.randn(T, H, generator=g)
slots = torch.tensor([[0, 3], [4, 3], [1, 2]])
w = torch.rand(T, K, generator=g)
ref = swiglu_reference(x, pool.views["gate_up_proj"], pool.views["down_proj"], slots, w)
got = swiglu_triton(x, pool.views["gate_up_proj"], pool.views["down_proj"], slots, w, block=16)
err = (ref - got).abs().max().item()
assert err < 1e-4, err
print("max abs err", err)
"""


CHECK_Q = r"""
import torch
from expertcache.runtime.kernels import quant
from expertcache.runtime.kernels.triton_experts import HAVE_TRITON, swiglu_reference, swiglu_triton_q
assert HAVE_TRITON
g = torch.Generator().manual_seed(0)
# each format and group once, at the smallest sizes its groups take (the interpreter runs every block in Python)
for bits, group, H, I, sym in ((8, 32, 64, 32, False), (8, 128, 128, 128, False), (4, 32, 64, 64, False),
                               (4, 64, 128, 64, False), (4, 32, 64, 64, True)):  # int4 packs 64 inputs a chunk
    S, T, K = 4, 2, 2
    gu = quant.quantize(torch.randn(S, 2 * I, H, generator=g) * 0.1, bits, group, symmetric=sym)
    dn = quant.quantize(torch.randn(S, H, I, generator=g) * 0.1, bits, group, symmetric=sym)
    assert ("mins" in gu) == (bits == 4 and not sym)
    def spread(t):  # each slot a block apart, as in the slot pool: rows contiguous, slots strided
        out = {}
        for k, v in t.items():
            big = torch.zeros(S, 2, *v.shape[1:], dtype=v.dtype)
            big[:, 0] = v
            out[k] = big[:, 0]
        return out
    x = torch.randn(T, H, generator=g)
    slots = torch.tensor([[0, 3], [2, 3]])  # a slot shared by both tokens
    w = torch.rand(T, K, generator=g)
    ref = swiglu_reference(x, quant.dequantize(gu, bits, group), quant.dequantize(dn, bits, group), slots, w)
    got = swiglu_triton_q(x, spread(gu), spread(dn), bits, group, slots, w, block=16)
    err = (ref - got).abs().max().item() / ref.abs().max().item()
    assert err < 1e-5, (bits, group, err)
print("packed ok")
"""


def test_reference_matches_a_dense_swiglu():
    g = torch.Generator().manual_seed(1)
    gu, dn = torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    x, w = torch.randn(2, 8, generator=g), torch.rand(2, 2, generator=g)
    slots = torch.tensor([[1, 3], [3, 0]])
    want = torch.zeros(2, 8)
    for t in range(2):
        for j in range(2):
            s = slots[t, j]
            h = gu[s] @ x[t]
            want[t] += w[t, j] * (dn[s] @ (torch.nn.functional.silu(h[:6]) * h[6:]))
    assert torch.allclose(swiglu_reference(x, gu, dn, slots, w), want, atol=1e-5)


@pytest.mark.slow  # a subprocess running triton's interpreter (3-10 s)
def test_triton_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")  # must be set before triton is imported: a fresh process
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "max abs err" in r.stdout


@pytest.mark.slow  # a subprocess running triton's interpreter (3-10 s)
def test_packed_triton_kernel_matches_the_dequantized_reference_in_the_interpreter():
    """int8, int4 (groups 32 to 128) and symmetric int4 experts dequantized inside the triton kernel, over slot
    views a block apart: equal to the torch reference over `quant.dequantize`'s weights up to summation order."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", CHECK_Q], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "packed ok" in r.stdout
