"""Group-wise integer formats of routed experts: what `expertcache quantize` writes, what the slots hold and what
the CPU kernels (`runtime/kernels/csrc/experts_cpu.cpp`) multiply.

For a weight matrix `[rows, n]` and a group size G (32 or a multiple of 64, dividing n), each row's inputs are cut into
groups of G:
- **int8** (symmetric): `q = round(w / s)` in [-127, 127], `s = max|w| / 127` per group; `w ~ s * q`.
  Stored: `q` int8 `[rows, n]`, `scales` fp16 `[rows, n / G]`.
- **int4** (asymmetric): `q = round((w - m) / s)` in [0, 15], starting from min-max (`s = (max - min) / 15`,
  `m = min` per group), then `REFINE` rounds of least squares for `s` and `m` given the codes (each group keeps
  whichever has the smaller error; a few percent less error than min-max); `w ~ s * q + m`. Stored: `q` uint8 `[rows, n / 2]`, two inputs per byte (in each 64-input chunk, byte b holds
  input b in its low nibble and input 32 + b in its high nibble, so one 32-byte load unpacks into 64 inputs in
  order), `scales` and `mins` fp16 `[rows, n / G]`. n must be a multiple of 64.
- **int4 symmetric** (`symmetric=True`, llama.cpp's Q4_0 at G = 32): `q = round(w / s) + 8` in [0, 15], where
  `s = -v / 8` for the group's input of largest magnitude v (its sign kept, so v itself is exact at code 0), then
  `REFINE` rounds of least squares for `s` given the codes; `w ~ s * (q - 8)`. Stored like int4 without `mins`:
  half a bit per weight less than min-max at G = 32, for a larger error (no minimum to fit lopsided groups).
Scales are rounded to fp16 before the integers are computed from them, so dequantizing is exact to what is stored.
Bytes per weight: int8 1 + 2/G; int4 0.5 + 4/G (G = 32: 0.625, against bf16's 2); int4 symmetric 0.5 + 2/G (0.5625).
A stored int4 tensor set without `mins` is symmetric: every reader (kernels, dequantize, the slots) tells the two
apart by that alone.
"""

from __future__ import annotations

import torch

from expertcache.telemetry.errors import InputError

from expertcache.runtime.storage.store import FMT

BITS = (8, 4)


def group_ok(group: int) -> bool:
    """The group sizes the kernels hold: 32 (two groups per 64-input chunk) or whole chunks, a multiple of 64."""
    return group == 32 or (group >= 64 and group % 64 == 0)


def check_group(bits: int, group: int, n: int, what: str = "input") -> None:
    """One line for a format the kernels cannot hold."""
    if bits not in BITS:
        raise InputError(f"bits={bits}: expected 8 or 4")
    if not group_ok(group):
        raise InputError(f"group_size={group}: expected 32 or a multiple of 64 (64, 128, ...)")
    if n % group:
        raise InputError(f"group_size={group} does not divide the {what} dimension {n}")
    if bits == 4 and n % 64:
        raise InputError(f"int4 packs 64 inputs per chunk: the {what} dimension {n} is not a multiple of 64")


def quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool = False) -> dict[str, torch.Tensor]:
    """`w [..., rows, n]` (any float dtype) -> `{"q", "scales"[, "mins"]}` with the same leading dims (`mins` for
    int4 unless `symmetric`; int8 is always symmetric)."""
    n = w.shape[-1]
    check_group(bits, group, n)
    g = w.float().reshape(*w.shape[:-1], n // group, group)
    if bits == 4 and symmetric:
        return _quantize4_symmetric(w, g)
    if bits == 8:
        s = (g.abs().amax(-1) / 127).half()
        sf = s.float().unsqueeze(-1)
        q = torch.where(sf > 0, torch.round(g / sf.clamp_min(torch.finfo(torch.float32).tiny)), torch.zeros(()))
        q = q.clamp(-127, 127).to(torch.int8).reshape(w.shape)
        return {"q": q.contiguous(), "scales": s.contiguous()}
    lo, hi = g.amin(-1), g.amax(-1)
    s, m = ((hi - lo) / 15).half(), lo.half()
    q, err = _codes4(g, s, m)
    for _ in range(REFINE):  # least-squares scale and minimum for the codes, re-rounded; a group keeps the better
        qm = q.mean(-1, keepdim=True)
        var = (q - qm).pow(2).sum(-1)
        s2 = torch.where(var > 0, ((q - qm) * (g - g.mean(-1, keepdim=True))).sum(-1) / var.clamp_min(1e-30),
                         s.float())
        m2 = (g.mean(-1) - s2 * qm.squeeze(-1))
        s2, m2 = s2.clamp_min(0).half(), m2.half()
        q2, err2 = _codes4(g, s2, m2)
        better = err2 < err
        s, m = torch.where(better, s2, s), torch.where(better, m2, m)
        q, err = torch.where(better.unsqueeze(-1), q2, q), torch.where(better, err2, err)
    return {"q": pack4(q.reshape(w.shape)), "scales": s.contiguous(), "mins": m.contiguous()}


REFINE = 3  # int4: rounds of least-squares refinement of each group's scale and minimum (0: plain min-max)


def _quantize4_symmetric(w: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """int4 symmetric (Q4_0's rule, then least-squares refinement of the scale): codes around 8, no minimum."""
    v = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
    s = (v / -8).half()
    q, err = _codes4s(g, s)
    for _ in range(REFINE):
        c = q - 8
        den = c.pow(2).sum(-1)
        s2 = torch.where(den > 0, (c * g).sum(-1) / den.clamp_min(1e-30), s.float()).half()
        q2, err2 = _codes4s(g, s2)
        better = err2 < err
        s = torch.where(better, s2, s)
        q, err = torch.where(better.unsqueeze(-1), q2, q), torch.where(better, err2, err)
    return {"q": pack4(q.reshape(w.shape)), "scales": s.contiguous()}


def _codes4s(g: torch.Tensor, s: torch.Tensor):
    """Symmetric int4 codes in [0, 15] (w ~ s (q - 8)) under fp16 scales `[...]`, and each group's squared error."""
    sf = s.float().unsqueeze(-1)
    safe = torch.where(sf != 0, sf, torch.ones(()))
    q = torch.where(sf != 0, torch.round(g / safe) + 8, torch.full((), 8.0)).clamp(0, 15)
    return q, ((q - 8) * sf - g).pow(2).sum(-1)


def _codes4(g: torch.Tensor, s: torch.Tensor, m: torch.Tensor):
    """Codes in [0, 15] for groups `g [..., G]` under fp16 scale/minimum `[...]`, and each group's squared error."""
    sf, mf = s.float().unsqueeze(-1), m.float().unsqueeze(-1)
    q = torch.where(sf > 0, torch.round((g - mf) / sf.clamp_min(torch.finfo(torch.float32).tiny)), torch.zeros(()))
    q = q.clamp(0, 15)
    return q, (q * sf + mf - g).pow(2).sum(-1)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """`[..., n]` codes in [0, 15], inputs in order -> `[..., n / 2]` uint8 (per 64 inputs, byte b holds input b low
    and 32 + b high): the inverse of `unpack4`."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 64, 2, 32)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*codes.shape[:-1], codes.shape[-1] // 2).contiguous()


def unpack4(q: torch.Tensor) -> torch.Tensor:
    """`[..., n / 2]` packed nibbles -> `[..., n]` uint8 in [0, 15], inputs in order."""
    c = q.reshape(*q.shape[:-1], q.shape[-1] // 32, 1, 32)
    return torch.cat([c & 0x0F, c >> 4], dim=-2).reshape(*q.shape[:-1], q.shape[-1] * 2)


def dequantize(t: dict[str, torch.Tensor], bits: int, group: int, dtype=torch.float32) -> torch.Tensor:
    """The weights the integers stand for (exactly what the kernels multiply, before activation rounding): in fp32,
    q x scale (+ minimum), each group's scale broadcast over its `group` inputs (no repeated copy of the scales),
    in place on the one fp32 tensor, then cast to `dtype`."""
    q = t["q"]
    v = (q if bits == 8 else unpack4(q)).float()
    shape = v.shape
    v = v.view(*shape[:-1], shape[-1] // group, group)
    if bits == 4 and "mins" not in t:  # symmetric: codes around 8
        v.sub_(8)
    v.mul_(t["scales"].float().unsqueeze(-1))
    if bits == 4 and "mins" in t:
        v.add_(t["mins"].float().unsqueeze(-1))
    return v.view(shape).to(dtype)


def nbytes(t: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in t.values())


def relative_error(w: torch.Tensor, t: dict[str, torch.Tensor], bits: int, group: int) -> float:
    """||w - dequantize(q)|| / ||w|| (Frobenius)."""
    d = dequantize(t, bits, group)
    return float((w.float() - d).norm() / w.float().norm().clamp_min(1e-30))


# --- quantized experts: the store's tensors, the checkpoint, the engine's compute --------------------------------

QUANT_METHOD = "expertcache"
EXPERTS_FILE = "experts.ecstore"
PARTS = {8: ("q", "scales"), 4: ("q", "scales", "mins")}


def quantized_specs(specs, bits: int, group: int, symmetric: bool = False) -> list[tuple[str, list[int], str]]:
    """The store tensors `(name, shape, dtype)` standing for bf16 expert tensors `specs` (`gate_up_proj [2I, H]`,
    `down_proj [H, I]`): `gate_up_proj.q`, `gate_up_proj.scales` (and `.mins` for int4 unless symmetric), ..."""
    out = []
    for name, shape, _ in specs:
        *rows, n = shape
        check_group(bits, group, n, f"{name} input")
        out.append((f"{name}.q", [*rows, n if bits == 8 else n // 2], "int8" if bits == 8 else "uint8"))
        out.append((f"{name}.scales", [*rows, n // group], "float16"))
        if bits == 4 and not symmetric:
            out.append((f"{name}.mins", [*rows, n // group], "float16"))
    return out


def quantize_expert(tensors: dict[str, torch.Tensor], bits: int, group: int,
                    symmetric: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in tensors.items():
        for part, v in quantize(w, bits, group, symmetric).items():
            out[f"{name}.{part}"] = v
    return out


def format_of(views: dict[str, torch.Tensor]) -> tuple[int, int] | None:
    """`(bits, group)` of a slot pool's (or store's) quantized views, None for plain ones (a mixed-precision pool's:
    its first format's)."""
    q, s = views.get("down_proj.q"), views.get("down_proj.scales")
    if q is None or s is None:
        return None
    bits = 8 if q.dtype == torch.int8 else 4
    n = q.shape[-1] * (1 if bits == 8 else 2)
    return bits, n // s.shape[-1]


def format_of_specs(specs) -> tuple[int, int] | None:
    """`format_of` a store's tensor specs (`store.TensorSpec`s: names, shapes, dtypes), with no bytes behind them."""
    return format_of({t.name: torch.empty(t.shape, dtype=t.torch_dtype, device="meta") for t in specs})


def format_views(views: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A mixed-precision pool's views split by format (`tiers.block_views`: format 0 plain names, format k
    `@k:name`); a one-format pool's views as the one entry."""
    if FMT not in views:
        return [views]
    out: dict[int, dict[str, torch.Tensor]] = {0: {}}
    for name, v in views.items():
        if name == FMT:
            continue
        if name.startswith("@"):
            k, _, rest = name[1:].partition(":")
            out.setdefault(int(k), {})[rest] = v
        else:
            out[0][name] = v
    return [out[k] for k in sorted(out)]


def parts(views: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {p: views[f"{name}.{p}"] for p in ("q", "scales", "mins") if f"{name}.{p}" in views}


def kernel_fits(views: dict[str, torch.Tensor]) -> bool:
    """Whether the integer kernel takes these experts' shapes (every format's, for a mixed pool): hidden and
    intermediate sizes multiples of 64 and of the group size (`I` from the down projection's scales: one per group
    of its input)."""
    for v in format_views(views):
        bits, group = format_of(v)
        dn_s = v["down_proj.scales"]
        h, i = dn_s.shape[1], dn_s.shape[2] * group
        if not (h % 64 == 0 and i % 64 == 0 and h % group == 0 and i % group == 0 and group_ok(group)):
            return False
    return True


def swiglu(x, views: dict[str, torch.Tensor], slots, weights) -> torch.Tensor:
    """Routed SwiGLU experts over quantized views (`[S, ...]` each): on CUDA the triton kernel that dequantizes
    inside (`kernels.swiglu_triton_q`); on the CPU the integer kernel where the extension is built and takes the
    shapes (`kernel_fits`), except the experts with many (token, choice) pairs in the call (a prompt's), which are
    dequantized and multiplied by torch's GEMM (`cpu_kernels.swiglu_q_split`); else the slots that are used
    dequantized and computed in float (the same weights, exact activations)."""
    from expertcache.runtime.kernels import cpu_kernels
    from expertcache.runtime.kernels.triton_experts import swiglu_reference

    if FMT in views:
        return swiglu_mixed(x, views, slots, weights)
    bits, group = format_of(views)
    gu, dn = parts(views, "gate_up_proj"), parts(views, "down_proj")
    if x.is_cuda:
        from expertcache.runtime.kernels.triton_experts import HAVE_TRITON, swiglu_triton_q

        if HAVE_TRITON and all(t.stride(-1) == 1 for t in views.values()):  # dequantized inside the kernel
            return swiglu_triton_q(x, gu, dn, bits, group, slots, weights)
    elif cpu_kernels.available() and kernel_fits(views):  # an expert with many pairs: dequantized + torch's GEMM
        return cpu_kernels.swiglu_q_split(x, gu, dn, bits, group, slots, weights)
    used, inv = slots.unique(return_inverse=True)
    g = dequantize({k: v[used] for k, v in gu.items()}, bits, group)
    d = dequantize({k: v[used] for k, v in dn.items()}, bits, group)
    return swiglu_reference(x.float(), g, d, inv.view_as(slots), weights).to(x.dtype)


def swiglu_mixed(x, views: dict[str, torch.Tensor], slots, weights, per_format=None) -> torch.Tensor:
    """A mixed-precision pool: each format's (token, choice) pairs through that format's path (`per_format[f](x,
    slots, weights, views)`, the engine's registered class for format f; by default `swiglu`; its result in x's
    dtype), the formats' partial sums added in fp32. A row with fewer pairs of a format than the widest row is
    padded with a slot of that format at weight 0 (its bytes are that format's, so the padding adds exactly 0)."""
    tag = views[FMT][slots]
    out = None
    for f, v in enumerate(format_views(views)):
        m = tag == f
        if not bool(m.any()):
            continue
        if bool(m.all()):
            s, w = slots, weights
        else:
            kf = int(m.sum(1).max())
            order = torch.argsort((~m).to(torch.uint8), dim=1, stable=True)[:, :kf]  # format f's choices first
            s, w, ok = slots.gather(1, order), weights.gather(1, order), m.gather(1, order)
            s = torch.where(ok, s, slots[m][0])
            w = torch.where(ok, w, torch.zeros((), dtype=w.dtype, device=w.device))
        y = (swiglu(x, v, s, w) if per_format is None else per_format[f](x, s, w, v)).float()
        out = y if out is None else out + y
    return torch.zeros_like(x) if out is None else out.to(x.dtype)


def read_config(path) -> dict | None:
    """A checkpoint's `quantization_config` when it is ours, checked; None when it has none. Another method, or
    ours with fields out of range, is one line."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader's own checks say what is wrong with config.json
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise InputError(f"{path}: quantization_config quant_method {method!r} is not one this runtime reads (it "
                         f"reads {QUANT_METHOD!r}, written by `expertcache quantize`); serve the unquantized checkpoint")
    if qc.get("bits") == MIXED:
        return _check_mixed(path, qc)
    bits, group, f = qc.get("bits"), qc.get("group_size"), qc.get("experts_file")
    if bits not in BITS or not isinstance(group, int) or isinstance(group, bool) or not group_ok(group):
        raise InputError(f"{path}: quantization_config bits={bits!r} group_size={group!r}: expected bits 8 or 4 and a "
                         f"group size of 32 or a multiple of 64 (damaged config.json)")
    if not _store_file(path, f):
        raise InputError(f"{path}: quantization_config names experts_file {f!r}, which is not a file beside config.json")
    _check_flag(path, qc)
    return qc


MIXED = "mixed"  # quantization_config bits of a checkpoint whose experts each have their own format (--by_usage)


def _store_file(path, f) -> bool:
    """Whether `f` names a file beside config.json (a bare name: no folder, not hidden)."""
    from pathlib import Path

    return isinstance(f, str) and "/" not in f and not f.startswith(".") and (Path(path) / f).is_file()


def _check_mixed(path, qc: dict) -> dict:
    """A mixed-precision `quantization_config` (`quantize --by_usage`), checked field by field: its formats (each
    with its store file) and one string per MoE layer naming each expert's format."""
    fm, table = qc.get("formats"), qc.get("expert_formats")
    if not isinstance(fm, list) or not 2 <= len(fm) <= 9 or not all(isinstance(f, dict) for f in fm):
        raise InputError(f"{path}: quantization_config formats {str(fm)[:80]} is not a list of 2-9 formats "
                         f"(damaged config.json)")
    for f in fm:
        b, g = f.get("bits"), f.get("group_size")
        if b not in BITS or not isinstance(g, int) or isinstance(g, bool) or not group_ok(g):
            raise InputError(f"{path}: quantization_config format bits={b!r} group_size={g!r}: expected bits 8 or 4 "
                             f"and a group size of 32 or a multiple of 64 (damaged config.json)")
        if not _store_file(path, f.get("experts_file")):
            raise InputError(f"{path}: quantization_config format names experts_file {f.get('experts_file')!r}, "
                             f"which is not a file beside config.json")
        _check_flag(path, f, "format ")
    digits = "".join(str(k) for k in range(len(fm)))
    if (not isinstance(table, list) or not table or not all(isinstance(r, str) and r for r in table)
            or len({len(r) for r in table}) != 1 or not all(set(r) <= set(digits) for r in table)):
        raise InputError(f"{path}: quantization_config expert_formats is not one string per MoE layer of one digit "
                         f"(0-{len(fm) - 1}) per expert (damaged config.json)")
    if qc.get("linears"):
        raise InputError(f"{path}: a mixed-precision checkpoint with packed linears is not one this build reads")
    return qc


class MixedExperts:
    """The experts of a mixed-precision checkpoint (`quantize --by_usage`): one store file per format, each holding
    only its experts (one aligned block each, in (layer, expert) order) with its checksum table. The engine's slots
    are the largest format's block; each slot is tagged with the format it holds (`store.FMT`)."""

    remedy = "the store file is corrupted: quantize again"

    def __init__(self, path, qc: dict, verify: bool | None = None):
        import numpy as np
        from pathlib import Path

        from expertcache.runtime.storage.checkpoint import VERIFY_DEFAULT
        from expertcache.runtime.storage.store import StoreMeta, read_store_meta

        path = Path(path)
        self.formats = [(f["bits"], f["group_size"]) for f in qc["formats"]]
        self.files = [path / f["experts_file"] for f in qc["formats"]]
        self.stores = [read_store_meta(p) for p in self.files]
        self.fmt = np.array([[int(c) for c in row] for row in qc["expert_formats"]], dtype=np.int8)
        n_l, n_e = self.fmt.shape
        self.index = np.zeros((n_l, n_e), dtype=np.int64)  # each expert's block in its format's store
        for k, (m, (bits, group), p) in enumerate(zip(self.stores, self.formats, self.files)):
            mine = self.fmt.ravel() == k
            self.index.ravel()[mine] = np.arange(int(mine.sum()))
            if (m.num_layers, m.num_experts) != (1, int(mine.sum())):
                raise InputError(f"{p} holds {m.num_layers} x {m.num_experts} blocks; config.json gives it "
                                 f"{int(mine.sum())} experts (damaged checkpoint: quantize again)")
            if format_of_specs(m.tensors) != (bits, group) or m.fingerprint != self.stores[0].fingerprint:
                raise InputError(f"{p} does not hold the {bits}-bit, group {group} experts config.json describes "
                                 f"(damaged checkpoint: quantize again)")
            _check_symmetric(p, qc["formats"][k], m.tensors)
        block = max(m.block_bytes for m in self.stores)
        first = self.stores[0]
        self.meta = StoreMeta(first.fingerprint, n_l, n_e, first.tensors, block, str(path),
                              alt_tensors=[m.tensors for m in self.stores[1:]])
        on = verify is True or (verify is None and VERIFY_DEFAULT)
        self.check = on and all(m.checksums is not None for m in self.stores)

    def format_index(self, layer: int, expert: int) -> int:
        return int(self.fmt[layer, expert])

    def expert_nbytes(self, layer: int, expert: int) -> int:
        return self.stores[self.fmt[layer, expert]].expert_bytes

    def block_nbytes(self, layer: int, expert: int) -> int:
        """The bytes of the expert's own block (its format's), what a copy between slots needs to move."""
        return self.stores[self.fmt[layer, expert]].block_bytes

    def total_bytes(self) -> int:
        """Every expert's bytes as stored (what the checkpoint's expert files hold, padding excluded)."""
        return sum(m.expert_bytes * m.num_experts for m in self.stores)

    def spans(self, layer: int, expert: int):
        from expertcache.runtime.storage.checkpoint import Span

        k = int(self.fmt[layer, expert])
        m = self.stores[k]
        dt = m.tensors[0].torch_dtype
        return [Span(k, m.offset(0, int(self.index[layer, expert])), m.block_bytes, 0, dt, dt)]

    def expected_checksum(self, layer: int, expert: int) -> int | None:
        if not self.check:
            return None
        k = int(self.fmt[layer, expert])
        return int(self.stores[k].checksums[0, self.index[layer, expert]])

    def integrity(self) -> str:
        return ("verified (every expert read is checked against its store's checksum table)" if self.check else
                "unverified (checksum checks turned off)")

    def where(self, layer: int, expert: int) -> str:
        k = int(self.fmt[layer, expert])
        return (f"MoE layer {layer} expert {expert} (int{self.formats[k][0]}, block {self.index[layer, expert]} of "
                f"{self.files[k]})")


def _check_flag(path, fmt: dict, what: str = "") -> None:
    """One line for a `symmetric` that is there and not a bool (absent: written before the flag existed)."""
    if not isinstance(fmt.get("symmetric", False), bool):
        raise InputError(f"{path}: quantization_config {what}symmetric={fmt['symmetric']!r}: expected true or false "
                         f"(damaged config.json)")


def _check_symmetric(where, fmt: dict, specs) -> None:
    """A format's `symmetric` flag against its store: symmetric int4 stores no minimums, min-max int4 does (int8 is
    symmetric either way). An absent flag (checkpoints written before it existed) says nothing."""
    if fmt.get("bits") != 4 or "symmetric" not in fmt:
        return
    has_mins = any(t.name.endswith(".mins") for t in specs)
    if fmt["symmetric"] == has_mins:
        raise InputError(f"{where}: quantization_config says symmetric={str(fmt['symmetric']).lower()}, but its "
                         f"expert store {'holds' if has_mins else 'has no'} minimums (damaged config.json)")


def open_source(path, qc: dict, verify: bool | None = None):
    """The expert source of an `expertcache quantize` checkpoint (its `read_config`): one store, or a mixed one."""
    from pathlib import Path

    from expertcache.runtime.storage.checkpoint import StoreExperts
    from expertcache.runtime.storage.store import read_store_meta

    if qc.get("bits") == MIXED:
        return MixedExperts(path, qc, verify)
    store = Path(path) / qc["experts_file"]
    meta = read_store_meta(store)
    _check_symmetric(path, qc, meta.tensors)
    return StoreExperts(store, meta, verify)


def copy_source(path, meta):
    """The packed experts of `path` (an `expertcache quantize` checkpoint) as an expert source standing beside a
    model whose own experts are described by `meta` (the same layers and experts, else one line): what
    `EngineConfig.miss_precision` reads a miss from."""
    qc = read_config(path)
    if qc is None:
        raise InputError(f"{path} is not an `expertcache quantize` checkpoint (no quantization_config)")
    if qc.get("bits") == MIXED:
        raise InputError(f"miss_copy {path} is a mixed-precision checkpoint; the copy a miss is served from has one "
                         f"format (`expertcache quantize --bits 4`)")
    source = open_source(path, qc)
    m = source.meta
    if (m.num_layers, m.num_experts) != (meta.num_layers, meta.num_experts):
        raise InputError(f"miss_copy {path} has {m.num_layers} layers x {m.num_experts} experts; the model has "
                         f"{meta.num_layers} x {meta.num_experts}: it is not a copy of this checkpoint")
    if not {"down_proj.q", "down_proj.scales"} <= {t.name for t in m.tensors}:
        raise InputError(f"miss_copy {path}: its experts are not packed integers")
    return source
