"""Group-wise integer formats of routed experts: what `expertcache quantize` writes, what the slots hold and what
the CPU kernels (`runtime/csrc/experts_cpu.cpp`) multiply.

For a weight matrix `[rows, n]` and a group size G (a multiple of 32 dividing n), each row's inputs are cut into
groups of G:
- **int8** (symmetric): `q = round(w / s)` in [-127, 127], `s = max|w| / 127` per group; `w ~ s * q`.
  Stored: `q` int8 `[rows, n]`, `scales` fp16 `[rows, n / G]`.
- **int4** (asymmetric, min-max): `q = round((w - m) / s)` in [0, 15], `s = (max - min) / 15`, `m = min` per group;
  `w ~ s * q + m`. Stored: `q` uint8 `[rows, n / 2]`, two inputs per byte (in each 64-input chunk, byte b holds
  input b in its low nibble and input 32 + b in its high nibble, so one 32-byte load unpacks into 64 inputs in
  order), `scales` and `mins` fp16 `[rows, n / G]`. n must be a multiple of 64.
Scales are rounded to fp16 before the integers are computed from them, so dequantizing is exact to what is stored.
Bytes per weight: int8 1 + 2/G; int4 0.5 + 4/G (G = 32: 0.625, against bf16's 2).
"""

from __future__ import annotations

import torch

from expertcache.telemetry.errors import InputError

BITS = (8, 4)


def check_group(bits: int, group: int, n: int, what: str = "input") -> None:
    """One line for a format the kernels cannot hold."""
    if bits not in BITS:
        raise InputError(f"bits={bits}: expected 8 or 4")
    if group < 32 or group % 32:
        raise InputError(f"group_size={group}: expected a multiple of 32 (32, 64, 128, ...)")
    if n % group:
        raise InputError(f"group_size={group} does not divide the {what} dimension {n}")
    if bits == 4 and n % 64:
        raise InputError(f"int4 packs 64 inputs per chunk: the {what} dimension {n} is not a multiple of 64")


def quantize(w: torch.Tensor, bits: int, group: int) -> dict[str, torch.Tensor]:
    """`w [..., rows, n]` (any float dtype) -> `{"q", "scales"[, "mins"]}` with the same leading dims."""
    n = w.shape[-1]
    check_group(bits, group, n)
    g = w.float().reshape(*w.shape[:-1], n // group, group)
    if bits == 8:
        s = (g.abs().amax(-1) / 127).half()
        sf = s.float().unsqueeze(-1)
        q = torch.where(sf > 0, torch.round(g / sf.clamp_min(torch.finfo(torch.float32).tiny)), torch.zeros(()))
        q = q.clamp(-127, 127).to(torch.int8).reshape(w.shape)
        return {"q": q.contiguous(), "scales": s.contiguous()}
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).half()
    m = lo.half()
    sf, mf = s.float().unsqueeze(-1), m.float().unsqueeze(-1)
    q = torch.where(sf > 0, torch.round((g - mf) / sf.clamp_min(torch.finfo(torch.float32).tiny)), torch.zeros(()))
    q = q.clamp(0, 15).to(torch.uint8).reshape(*w.shape[:-1], n // 64, 2, 32)
    packed = q[..., 0, :] | (q[..., 1, :] << 4)
    return {"q": packed.reshape(*w.shape[:-1], n // 2).contiguous(), "scales": s.contiguous(), "mins": m.contiguous()}


def unpack4(q: torch.Tensor) -> torch.Tensor:
    """`[..., n / 2]` packed nibbles -> `[..., n]` uint8 in [0, 15], inputs in order."""
    c = q.reshape(*q.shape[:-1], q.shape[-1] // 32, 1, 32)
    return torch.cat([c & 0x0F, c >> 4], dim=-2).reshape(*q.shape[:-1], q.shape[-1] * 2)


def dequantize(t: dict[str, torch.Tensor], bits: int, group: int, dtype=torch.float32) -> torch.Tensor:
    """The weights the integers stand for (exactly what the kernels multiply, before activation rounding)."""
    s = t["scales"].float().repeat_interleave(group, dim=-1)
    if bits == 8:
        return (t["q"].float() * s).to(dtype)
    return (unpack4(t["q"]).float() * s + t["mins"].float().repeat_interleave(group, dim=-1)).to(dtype)


def nbytes(t: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in t.values())


def relative_error(w: torch.Tensor, t: dict[str, torch.Tensor], bits: int, group: int) -> float:
    """||w - dequantize(q)|| / ||w|| (Frobenius)."""
    d = dequantize(t, bits, group)
    return float((w.float() - d).norm() / w.float().norm().clamp_min(1e-30))
