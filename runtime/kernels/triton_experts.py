"""The fused SwiGLU expert MLP over gathered cache slots: `y[t] = sum_j w[t, j] * down[s] @ (silu(gate[s] @ x[t])
* (up[s] @ x[t]))`, s = slot[t, j], with `gate_up [S, 2I, H]` (gate rows first) and `down [S, H, I]`.

Two paths with one signature: `swiglu_reference` (torch, any device; the CPU path) and `swiglu_triton` (one
program per (token, choice, output block); used on CUDA). They are compared under `TRITON_INTERPRET=1` in the
tests. `swiglu_experts` picks the triton path for CUDA tensors when triton is importable.
"""

from __future__ import annotations

import torch


def swiglu_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, slots: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], gate_up [S, 2I, H], down [S, H, I], slots [T, k] long, weights [T, k] -> y [T, H] (x's dtype;
    accumulated in fp32)."""
    t_, k = slots.shape
    inter = down.shape[-1]
    y = torch.zeros(t_, x.shape[-1], dtype=torch.float32, device=x.device)
    for s in slots.unique().tolist():  # each slot once, over the tokens that chose it
        tok, j = (slots == s).nonzero(as_tuple=True)
        xs = x[tok].to(gate_up.dtype)
        h = torch.nn.functional.linear(xs, gate_up[s])  # [n, 2I]
        a = torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()  # [n, I]
        o = torch.nn.functional.linear(a.to(down.dtype), down[s]).float()  # [n, H]
        y.index_add_(0, tok, o * weights[tok, j, None].float())
    return y.to(x.dtype)


try:  # triton is optional (the `triton` extra); the reference path never needs it
    import triton
    import triton.language as tl

    @triton.jit
    def _w(q_ptr, s_ptr, m_ptr, rows, cols, mask, QS1, SS1, G, BITS: tl.constexpr, SYM: tl.constexpr):
        # the weights [rows, cols] of one slot (rows and cols as index vectors) in fp32: BITS 16 reads them as they
        # are (bf16 / fp32); 8 and 4 dequantize exactly as `runtime.quant.dequantize` does: int8 w = s * q; int4
        # w = s * q + m (SYM, symmetric int4: w = s * (q - 8)), where byte b of each 64-input chunk holds input b in
        # its low nibble and input 32 + b in its high one
        if BITS == 16:
            w = tl.load(q_ptr + rows[:, None] * QS1 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            if BITS == 8:
                q = tl.load(q_ptr + rows[:, None] * QS1 + cols[None, :], mask=mask, other=0).to(tl.float32)
            else:
                byte = (cols // 64) * 32 + (cols % 64) % 32
                shift = ((cols % 64) >= 32).to(tl.int32) * 4
                b = tl.load(q_ptr + rows[:, None] * QS1 + byte[None, :], mask=mask, other=0).to(tl.int32)
                q = ((b >> shift[None, :]) & 15).to(tl.float32)
                if SYM:
                    q -= 8.0
            g = cols // G
            w = q * tl.load(s_ptr + rows[:, None] * SS1 + g[None, :], mask=mask, other=0.0).to(tl.float32)
            if BITS == 4 and not SYM:
                w += tl.load(m_ptr + rows[:, None] * SS1 + g[None, :], mask=mask, other=0.0).to(tl.float32)
        return w

    @triton.jit
    def _up_kernel(x_ptr, q_ptr, s_ptr, m_ptr, slot_ptr, a_ptr, H, I, K, G, QS0, QS1, SS0, SS1,
                   BITS: tl.constexpr, SYM: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
        # program (t*K + j, i-block): a[t, j, i] = silu(gate[s, i] . x[t]) * (up[s, i] . x[t]); slots QS0 apart
        pid = tl.program_id(0)
        pib = tl.program_id(1)
        t = pid // K
        s = tl.load(slot_ptr + pid).to(tl.int64)
        offs_i = pib * BLOCK_I + tl.arange(0, BLOCK_I)
        mask_i = offs_i < I
        acc_g = tl.zeros((BLOCK_I,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_I,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < H
            xv = tl.load(x_ptr + t * H + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            m = mask_i[:, None] & mask_h[None, :]
            g = _w(q_ptr + s * QS0, s_ptr + s * SS0, m_ptr + s * SS0, offs_i, offs_h, m, QS1, SS1, G, BITS, SYM)
            u = _w(q_ptr + s * QS0, s_ptr + s * SS0, m_ptr + s * SS0, offs_i + I, offs_h, m, QS1, SS1, G, BITS, SYM)
            acc_g += tl.sum(g * xv[None, :], axis=1)
            acc_u += tl.sum(u * xv[None, :], axis=1)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(a_ptr + pid * I + offs_i, act, mask=mask_i)

    @triton.jit
    def _down_kernel(a_ptr, q_ptr, s_ptr, m_ptr, slot_ptr, w_ptr, y_ptr, H, I, K, G, QS0, QS1, SS0, SS1,
                     BITS: tl.constexpr, SYM: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
        # program (t, o-block): y[t, o] = sum_j w[t, j] * down[s_j, o] . a[t, j]
        t = tl.program_id(0)
        pob = tl.program_id(1)
        offs_o = pob * BLOCK_O + tl.arange(0, BLOCK_O)
        mask_o = offs_o < H
        acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
        for j in range(0, K):
            s = tl.load(slot_ptr + t * K + j).to(tl.int64)
            w = tl.load(w_ptr + t * K + j).to(tl.float32)
            part = tl.zeros((BLOCK_O,), dtype=tl.float32)
            for i0 in range(0, I, BLOCK_I):
                offs_i = i0 + tl.arange(0, BLOCK_I)
                mask_i = offs_i < I
                av = tl.load(a_ptr + (t * K + j) * I + offs_i, mask=mask_i, other=0.0)
                m = mask_o[:, None] & mask_i[None, :]
                dv = _w(q_ptr + s * QS0, s_ptr + s * SS0, m_ptr + s * SS0, offs_o, offs_i, m, QS1, SS1, G, BITS, SYM)
                part += tl.sum(dv * av[None, :], axis=1)
            acc += w * part
        tl.store(y_ptr + t * H + offs_o, acc, mask=mask_o)

    def _launch(x, gu: dict, dn: dict, bits: int, group: int, slots, weights, inter: int, block: int):
        """Both kernels over `gu`/`dn` ({"q", "scales"[, "mins"]}; for bits 16 only "q", the weights)."""
        t_, k = slots.shape
        h = x.shape[-1]
        sl = slots.to(torch.int32).contiguous()
        a = torch.empty(t_ * k, inter, dtype=torch.float32, device=x.device)
        y = torch.empty(t_, h, dtype=torch.float32, device=x.device)

        def args(p):  # pointers and strides (scales and mins stand in for each other where a format has none)
            s = p.get("scales", p["q"])
            return (p["q"], s, p.get("mins", s), p["q"].stride(0), p["q"].stride(1), s.stride(0), s.stride(1))

        (gq, gs, gm, q0, q1, s0, s1), (dq, ds, dm, r0, r1, t0, t1) = args(gu), args(dn)
        if (bits == 4) and (("mins" in gu) != ("mins" in dn)):
            raise ValueError("swiglu_triton_q: gate_up and down must both be symmetric int4 or both not")
        sym = bits == 4 and "mins" not in gu  # symmetric int4: no minimums
        _up_kernel[(t_ * k, triton.cdiv(inter, block))](x.contiguous(), gq, gs, gm, sl, a, h, inter, k, group,
                                                        q0, q1, s0, s1, BITS=bits, SYM=sym, BLOCK_I=block,
                                                        BLOCK_H=block)
        _down_kernel[(t_, triton.cdiv(h, block))](a, dq, ds, dm, sl, weights.float().contiguous(), y, h, inter, k,
                                                  group, r0, r1, t0, t1, BITS=bits, SYM=sym, BLOCK_O=block,
                                                  BLOCK_I=block)
        return y.to(x.dtype)

    def swiglu_triton(x, gate_up, down, slots, weights, block: int = 32):
        """Same contract as `swiglu_reference`. Each slot's matrices must be contiguous; the slots themselves
        may be any stride apart (the slot pool's views are)."""
        gu = gate_up if gate_up[0].is_contiguous() else gate_up.contiguous()
        dn = down if down[0].is_contiguous() else down.contiguous()
        return _launch(x, {"q": gu}, {"q": dn}, 16, 1, slots, weights, down.shape[-1], block)

    def swiglu_triton_q(x, gu: dict, dn: dict, bits: int, group: int, slots, weights, block: int = 32):
        """`swiglu_triton` over packed experts (`runtime.quant`'s int8 / int4 slots: `q`, fp16 `scales`, and int4
        `mins` unless symmetric, each `[S, rows, ...]` with contiguous rows, the slots any stride apart),
        dequantized in the kernel, fp32 activations: equal to `swiglu_reference` over `quant.dequantize`'s weights
        up to summation order. The GPU path of a quantized checkpoint (the CPU has `cpu_kernels.swiglu_q`)."""
        for part in (gu, dn):
            if part["q"].stride(-1) != 1 or part["scales"].stride(-1) != 1:
                raise ValueError("swiglu_triton_q: each packed row must be contiguous")
        return _launch(x, gu, dn, bits, group, slots, weights, dn["scales"].shape[-1] * group, block)

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is in the test extra
    HAVE_TRITON = False


def swiglu_experts(x, gate_up, down, slots, weights):
    """The triton kernel on CUDA tensors (when triton is installed), else the torch reference."""
    if HAVE_TRITON and x.is_cuda:
        return swiglu_triton(x, gate_up, down, slots, weights)
    return swiglu_reference(x, gate_up, down, slots, weights)
