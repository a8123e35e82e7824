"""Group-wise integer formats of routed experts: what `expertcache quantize` writes, what the slots hold and what
the CPU kernels (`runtime/csrc/experts_cpu.cpp`) multiply.

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

from .store import FMT
from .weight_checks import INTEGRITY_DEFAULT

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
    """The weights the integers stand for (exactly what the kernels multiply, before activation rounding)."""
    s = t["scales"].float().repeat_interleave(group, dim=-1)
    if bits == 8:
        return (t["q"].float() * s).to(dtype)
    if "mins" not in t:  # symmetric
        return ((unpack4(t["q"]).float() - 8) * s).to(dtype)
    return (unpack4(t["q"]).float() * s + t["mins"].float().repeat_interleave(group, dim=-1)).to(dtype)


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
    shapes (`kernel_fits`); else the slots that are used dequantized and computed in float (the same weights,
    exact activations)."""
    from . import cpu_kernels
    from .kernels import swiglu_reference

    if FMT in views:
        return _swiglu_mixed(x, views, slots, weights)
    bits, group = format_of(views)
    gu, dn = parts(views, "gate_up_proj"), parts(views, "down_proj")
    if x.is_cuda:
        from .kernels import HAVE_TRITON, swiglu_triton_q

        if HAVE_TRITON and all(t.stride(-1) == 1 for t in views.values()):  # dequantized inside the kernel
            return swiglu_triton_q(x, gu, dn, bits, group, slots, weights)
    elif cpu_kernels.available() and kernel_fits(views):
        return cpu_kernels.swiglu_q(x, gu, dn, bits, group, slots, weights)
    used, inv = slots.unique(return_inverse=True)
    g = dequantize({k: v[used] for k, v in gu.items()}, bits, group)
    d = dequantize({k: v[used] for k, v in dn.items()}, bits, group)
    return swiglu_reference(x.float(), g, d, inv.view_as(slots), weights).to(x.dtype)


def _swiglu_mixed(x, views: dict[str, torch.Tensor], slots, weights) -> torch.Tensor:
    """A mixed-precision pool: each format's (token, choice) pairs through that format's path (`swiglu`, its result
    in x's dtype), the formats' partial sums added in fp32. A row with fewer pairs of a format than the widest row
    is padded with a slot of that format at weight 0 (its bytes are that format's, so the padding adds exactly 0)."""
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
        y = swiglu(x, v, s, w).float()
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

        from .checkpoint import VERIFY_DEFAULT
        from .store import StoreMeta, read_store_meta

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
        from .checkpoint import Span

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

    from .checkpoint import StoreExperts
    from .store import read_store_meta

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


def usage_counts(trace, model, num_layers: int, num_experts: int) -> tuple:
    """`(counts [layers, E], tokens)`: how often each expert of each MoE layer was chosen in a routing trace of this
    model (every token it holds, prefill and decode). A trace of another model's shape is one line."""
    import numpy as np

    from expertcache.telemetry.adapters import adapter_for
    from expertcache.telemetry.parquet_trace import load_routing

    r = load_routing(trace, phase=None)
    a = adapter_for(model.config)
    got = (r.ids.shape[0], r.num_experts, r.ids.shape[2], int(r.meta.get("hidden_size") or a.hidden_size))
    want = (num_layers, num_experts, a.top_k, a.hidden_size)
    if got != want:
        raise InputError(f"--by_usage {trace} is a trace of another model: {got[0]} MoE layers x {got[1]} experts, "
                         f"top-{got[2]}, hidden size {got[3]}; this model has {want[0]} x {want[1]}, top-{want[2]}, "
                         f"hidden size {want[3]} (record one with `expertcache trace record --model` this checkpoint)")
    counts = np.stack([np.bincount(r.ids[i].ravel(), minlength=num_experts) for i in range(num_layers)])
    return counts, int(r.ids.shape[1])


def allocate_by_usage(counts, hi_bytes: int, lo_bytes: int, budget: int):
    """Each expert's format, 0 (the larger, `hi_bytes`) or 1 (`lo_bytes`), within `budget` bytes in all: every
    expert starts at format 1 and the most used (`counts [layers, E]`; ties by position) are raised to format 0
    while the total fits. A budget below every expert at format 1 is one line."""
    import numpy as np

    n = counts.size
    floor = n * lo_bytes
    if budget < floor:
        raise InputError(f"the size allowed ({budget / 2**20:.1f} MiB) is below every expert at the smaller format "
                         f"({floor / 2**20:.1f} MiB): raise --max_bytes_ratio or choose a smaller --bits/--group_size")
    n_hi = min(n, int((budget - floor) // max(hi_bytes - lo_bytes, 1)))
    order = np.lexsort((np.arange(n), -counts.ravel()))
    fmt = np.ones(n, dtype=np.int8)
    fmt[order[:n_hi]] = 0
    return fmt.reshape(counts.shape)


def write_quantized(model, out, bits: int, group: int, progress=None, linears: bool = False, by_usage=None,
                    hot: tuple[int, int] = (8, 32), max_bytes_ratio: float = 0.35, symmetric: bool = False,
                    integrity: str = INTEGRITY_DEFAULT) -> dict:
    """`expertcache quantize`: a checkpoint at `out` whose routed experts are `bits`-bit integers with fp16 group
    scales, in one expert store file (each expert one contiguous 4 KiB-aligned block with its checksum), beside the
    non-expert tensors unchanged (`model.safetensors`) and `config.json` with a `quantization_config`. `linears`:
    the non-expert linear layers too (`quantizable_linears`: attention, dense and shared MLPs, the untied output
    head; not the routers), packed in the same format inside `model.safetensors`. Returns the report: bytes, and
    each MoE layer's (and packed linear's) relative weight error.

    `by_usage` (a routing trace of this model): precision per expert from telemetry. The most used experts are
    written at `hot` = (bits, group) and the rest at (`bits`, `group`), as many hot as fit `max_bytes_ratio` of the
    experts' bytes in bf16 (`allocate_by_usage`); one store file per format, holding only its experts.

    `symmetric`: the int4 format(s) without minimums (Q4_0's layout at group 32: 0.5625 bytes per weight, not
    0.625), at a larger weight error.

    `integrity` on: the weights read and the folder written pass `verify`'s reference-free checks before it is
    published (`weight_checks`); off: written as computed."""
    import json
    import shutil
    from pathlib import Path

    import numpy as np
    from safetensors.torch import save_file

    from expertcache.telemetry.atomic import atomic_dir

    from .loader import build_offloaded, resolve
    from .store import StoreMeta, _write, layout
    from .tiers import DiskTier, SlotPool
    from .weight_checks import check_integrity, check_written

    checks = check_integrity(integrity)

    if bits not in BITS:
        raise InputError(f"--bits {bits}: expected 8 or 4")
    if symmetric and bits != 4 and (by_usage is None or hot[0] != 4):
        raise InputError("--symmetric true is an int4 option (int8 is always symmetric): use it with --bits 4")
    if by_usage is not None:
        if hot[0] not in BITS:
            raise InputError(f"--hot_bits {hot[0]}: expected 8 or 4")
        if linears:
            raise InputError("--by_usage with --linears true is not supported: pack the linears in a one-format "
                             "checkpoint")
        if not 0 < max_bytes_ratio < 1:
            raise InputError(f"--max_bytes_ratio {max_bytes_ratio}: expected a fraction of the bf16 expert bytes in "
                             f"(0, 1)")
    path = resolve(model)
    if read_config(path) is not None or "quantization_config" in json.loads((path / "config.json").read_text()):
        raise InputError(f"{path} is already quantized: quantize its unquantized original")
    out = Path(out)
    if out.resolve() == path.resolve() or out.resolve() in path.resolve().parents:
        raise InputError(f"--out {out} is the model's own folder or holds it (writing it would delete the model); "
                         f"write the quantized checkpoint elsewhere")
    m, source = build_offloaded(path, verify=False, integrity=integrity, off="--integrity off")
    meta = source.meta
    names = [t.name for t in meta.tensors]
    if sorted(names) != ["down_proj", "gate_up_proj"]:
        raise InputError(f"quantize handles SwiGLU experts without biases (gate_up_proj, down_proj); this model's "
                         f"experts hold {', '.join(names)}")
    if meta.tensors[0].dtype not in ("bfloat16", "float16", "float32"):
        raise InputError(f"{path}: experts in {meta.tensors[0].dtype}; expected float weights")
    n_l, n_e = meta.num_layers, meta.num_experts
    if by_usage is not None:  # the trace is checked where it enters, before any format is laid out
        counts, tokens = usage_counts(by_usage, m, n_l, n_e)
    formats = [(bits, group)] if by_usage is None else [tuple(hot), (bits, group)]
    if len(formats) == 2 and formats[0] == formats[1]:
        raise InputError(f"--hot_bits {hot[0]} --hot_group_size {hot[1]} is the same format as --bits {bits} "
                         f"--group_size {group}: nothing to mix")
    def sym(b: int) -> bool:  # whether format `b` is written without minimums (int8 has none either way)
        return symmetric and b == 4

    fspecs = [layout(quantized_specs([(t.name, t.shape, t.dtype) for t in meta.tensors], b, g, sym(b)))
              for b, g in formats]
    fbytes = [sum(t.nbytes for t in sp) for sp, _ in fspecs]
    bf16_bytes = sum(2 * int(np.prod(t.shape)) for t in meta.tensors) * n_l * n_e
    usage = None
    if by_usage is None:
        fmt = np.zeros((n_l, n_e), dtype=np.int8)
    else:
        if fbytes[0] <= fbytes[1]:
            raise InputError(f"the hot format (int{hot[0]}, group {hot[1]}) is not larger than the others (int{bits}, "
                             f"group {group}): hot experts get the more precise format")
        fmt = allocate_by_usage(counts, fbytes[0], fbytes[1], int(max_bytes_ratio * bf16_bytes))
        for k, (b, g) in enumerate(formats):  # before anything is written
            if not (fmt == k).any():
                raise InputError(f"no expert gets int{b} (group {g}) at --max_bytes_ratio {max_bytes_ratio}: use a "
                                 f"one-format checkpoint (`quantize` without --by_usage)")
        total = counts.sum()
        usage = {"trace": str(by_usage), "tokens": tokens, "max_bytes_ratio": max_bytes_ratio,
                 "hot_experts": int((fmt == 0).sum()),
                 "hot_share_of_routing": round(float(counts[fmt == 0].sum() / total), 6) if total else 0.0}
    disk, pool = DiskTier(source), SlotPool(meta, 1)
    err = {n: [[0.0, 0.0] for _ in range(n_l)] for n in names}  # per layer: sum d^2, sum w^2

    def expert(i, e):
        disk.read(i, e, pool, 0)
        b, g = formats[fmt[i, e]]
        q = {}
        for n in names:
            w = pool.views[n][0].float()
            t = quantize(w, b, g, sym(b))
            d = dequantize(t, b, g)
            err[n][i][0] += float((w - d).pow(2).sum())
            err[n][i][1] += float(w.pow(2).sum())
            q.update({f"{n}.{p}": v for p, v in t.items()})
        return q

    ckpt = source.ckpt
    keep = sorted(set(ckpt.tensors) - source.names)
    lin_names, lin_skipped, lin_err, packed = [], [], {}, {}
    if linears:
        from expertcache.telemetry.adapters import adapter_for

        from .checkpoint import checkpoint_name

        routers = [L.router for L in adapter_for(m.config).moe_layers(m)]
        lin_names, lin_skipped = quantizable_linears(m, source.prefixes, routers, bits, group)
        for name in lin_names:
            w = m.get_submodule(name).weight.detach()
            t = quantize(w, bits, group, sym(bits))
            lin_err[name] = round(relative_error(w, t, bits, group), 6)
            ck = checkpoint_name(f"{name}.weight", source.family)
            if ck not in keep:
                raise InputError(f"{path}: linear {name} has no tensor {ck} in the checkpoint to quantize")
            keep.remove(ck)
            packed.update({f"{ck}_{part}": v.contiguous() for part, v in t.items()})
    files = [EXPERTS_FILE] if by_usage is None else [f"experts-int{b}-g{g}.ecstore" for b, g in formats]
    with atomic_dir(out) as tmp:
        try:
            if by_usage is None:
                specs, block = fspecs[0]
                _write(tmp / EXPERTS_FILE, StoreMeta(meta.fingerprint, n_l, n_e, specs, block, str(path)), expert,
                       progress)
            else:  # one store per format, its experts in (layer, expert) order as one row of blocks
                for k, ((specs, block), f) in enumerate(zip(fspecs, files)):
                    pairs = [(int(i), int(e)) for i, e in zip(*np.nonzero(fmt == k))]
                    done = [0]

                    def one(_, j, pairs=pairs):
                        done[0] += 1
                        if progress and done[0] % n_e == 0:  # one tick per layer's worth of experts
                            progress()
                        return expert(*pairs[j])
                    _write(tmp / f, StoreMeta(meta.fingerprint, 1, len(pairs), specs, block, str(path)), one)
        finally:
            disk.close()
        save_file({**{n: ckpt.read(n).contiguous() for n in keep}, **packed}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        cfg = json.loads((path / "config.json").read_text())
        layer_err = {n: [round((a / b) ** 0.5, 6) if b else 0.0 for a, b in err[n]] for n in names}
        scheme = {8: "int8 symmetric, fp16 scale per group",
                  4: "int4 symmetric, fp16 scale per group, w = s (q - 8) (GGUF Q4_0's layout at group 32)"
                  if symmetric else "int4 min-max, fp16 scale and minimum per group"}
        if by_usage is None:
            qc = {"quant_method": QUANT_METHOD, "bits": bits, "group_size": group, "experts_file": EXPERTS_FILE,
                  "scheme": scheme[bits], "symmetric": bits == 8 or sym(bits)}
        else:
            qc = {"quant_method": QUANT_METHOD, "bits": MIXED,
                  "formats": [{"bits": b, "group_size": g, "experts_file": f, "scheme": scheme[b],
                               "symmetric": b == 8 or sym(b), "experts": int((fmt == k).sum())}
                              for k, ((b, g), f) in enumerate(zip(formats, files))],
                  "expert_formats": ["".join(str(int(v)) for v in row) for row in fmt], "by_usage": usage}
        qc.update({"source_dtype": meta.tensors[0].dtype, "relative_error": layer_err})
        cfg["quantization_config"] = qc
        if lin_names:
            cfg["quantization_config"]["linears"] = {"modules": lin_names, "relative_error": lin_err}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in path.iterdir():  # tokenizer, generation config, chat template
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json" and not f.name.startswith(".") \
                    and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        if checks:  # before it is published: a NaN or exponent-flipped input makes damaged scales
            check_written(tmp, "quantize")
    del m
    expert_bytes = sum(fbytes[k] * int((fmt == k).sum()) for k in range(len(formats)))
    source_bytes = meta.expert_bytes * n_l * n_e
    return {"out": str(out), "bits": bits if by_usage is None else MIXED, "group_size": group,
            "symmetric": bits == 8 or sym(bits),
            "formats": [{"bits": b, "group_size": g, "experts": int((fmt == k).sum())}
                        for k, (b, g) in enumerate(formats)],
            "experts": n_l * n_e, "expert_bytes": expert_bytes, "source_expert_bytes": source_bytes,
            "bytes_ratio": expert_bytes / source_bytes, "bf16_bytes_ratio": expert_bytes / bf16_bytes,
            "by_usage": usage, "relative_error": layer_err,
            "linears": {"modules": lin_names, "relative_error": lin_err, "skipped": lin_skipped,
                        "bytes": nbytes(packed)}}


# --- quantized non-expert linears (`expertcache quantize --linears true`) ---------------------------------------

LINEAR_PARTS = {"q": "weight_q", "scales": "weight_scales", "mins": "weight_mins"}  # part -> buffer name


class QuantLinear(torch.nn.Module):
    """An `nn.Linear` whose weight is packed group-wise integers (the format above, for one `[out, in]` matrix).
    Decode-sized inputs (at most `cpu_kernels.MAX_ROWS` rows, CPU) go through the integer kernel, which reads the
    packed bytes once; larger inputs (a prefill, a batched evaluation), GPUs and machines without the extension
    compute with the weight dequantized for the call, in the input's dtype (the same weights)."""

    def __init__(self, in_features: int, out_features: int, bits: int, group: int, bias: bool,
                 dtype: torch.dtype = torch.bfloat16, device="meta", symmetric: bool = False):
        super().__init__()
        check_group(bits, group, in_features)
        self.in_features, self.out_features, self.bits, self.group = in_features, out_features, bits, group
        self.symmetric = bits == 8 or symmetric  # int4 without minimums (`quantize(symmetric=True)`)
        qshape = [out_features, in_features if bits == 8 else in_features // 2]
        self.register_buffer("weight_q", torch.empty(qshape, dtype=torch.int8 if bits == 8 else torch.uint8,
                                                     device=device))
        sshape = [out_features, in_features // group]
        self.register_buffer("weight_scales", torch.empty(sshape, dtype=torch.float16, device=device))
        if not self.symmetric:
            self.register_buffer("weight_mins", torch.empty(sshape, dtype=torch.float16, device=device))
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                       requires_grad=False) if bias else None

    def packed(self) -> dict[str, torch.Tensor]:
        return {p: getattr(self, b) for p, b in LINEAR_PARTS.items() if hasattr(self, b)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from . import cpu_kernels

        if cpu_kernels.decode_input(x) and self.in_features % 64 == 0 and cpu_kernels.available():
            return cpu_kernels.linear_q(x, self.weight_q, self.weight_scales, getattr(self, "weight_mins", None),
                                        self.bits, self.group, self.bias)
        w = dequantize(self.packed(), self.bits, self.group, x.dtype)
        return torch.nn.functional.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}"
                f"{' symmetric' if self.bits == 4 and self.symmetric else ''}, group={self.group}, "
                f"bias={self.bias is not None}")


def quantizable_linears(model, expert_prefixes, routers, bits: int, group: int) -> tuple[list[str], list[str]]:
    """(names, skipped with why) of the non-expert `nn.Linear`s `--linears true` packs: every one outside the
    routed experts whose input size the kernel takes (a multiple of 64 and of the group), except the routers (their
    top-k decides which experts run: kept exact) and an output head tied to the input embeddings."""
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    out_emb = model.get_output_embeddings()
    router_ids = {id(r) for r in routers}
    names, skipped = [], []
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear or name.startswith(tuple(expert_prefixes)):
            continue
        if id(mod) in router_ids:
            continue
        if tied and mod is out_emb:
            skipped.append(f"{name}: tied to the input embeddings")
        elif mod.in_features % group or mod.in_features % 64:
            skipped.append(f"{name}: input size {mod.in_features} is not a multiple of 64 and of group {group}")
        else:
            names.append(name)
    return names, skipped


def install_linears(model, names: list[str], bits: int, group: int, symmetric: bool = False) -> None:
    """Replace the named `nn.Linear`s of a (meta) model by `QuantLinear`s of the same shape (their buffers on meta,
    filled by the loader from the checkpoint)."""
    for name in names:
        parent, _, attr = name.rpartition(".")
        try:
            owner = model.get_submodule(parent) if parent else model
        except AttributeError:
            owner = None
        old = getattr(owner, attr, None)
        if type(old) is not torch.nn.Linear:
            raise InputError(f"quantization_config lists linear {name!r}, which this model does not have as a linear "
                             f"layer (damaged config.json)")
        dtype = old.weight.dtype
        setattr(owner, attr, QuantLinear(old.in_features, old.out_features, bits, group, old.bias is not None, dtype,
                                         symmetric=symmetric))
