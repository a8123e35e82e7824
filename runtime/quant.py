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
Scales are rounded to fp16 before the integers are computed from them, so dequantizing is exact to what is stored.
Bytes per weight: int8 1 + 2/G; int4 0.5 + 4/G (G = 32: 0.625, against bf16's 2).
"""

from __future__ import annotations

import torch

from expertcache.telemetry.errors import InputError

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
    q = q.to(torch.uint8).reshape(*w.shape[:-1], n // 64, 2, 32)
    packed = q[..., 0, :] | (q[..., 1, :] << 4)
    return {"q": packed.reshape(*w.shape[:-1], n // 2).contiguous(), "scales": s.contiguous(), "mins": m.contiguous()}


REFINE = 3  # int4: rounds of least-squares refinement of each group's scale and minimum (0: plain min-max)


def _codes4(g: torch.Tensor, s: torch.Tensor, m: torch.Tensor):
    """Codes in [0, 15] for groups `g [..., G]` under fp16 scale/minimum `[...]`, and each group's squared error."""
    sf, mf = s.float().unsqueeze(-1), m.float().unsqueeze(-1)
    q = torch.where(sf > 0, torch.round((g - mf) / sf.clamp_min(torch.finfo(torch.float32).tiny)), torch.zeros(()))
    q = q.clamp(0, 15)
    return q, (q * sf + mf - g).pow(2).sum(-1)


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


# --- quantized experts: the store's tensors, the checkpoint, the engine's compute --------------------------------

QUANT_METHOD = "expertcache"
EXPERTS_FILE = "experts.ecstore"
PARTS = {8: ("q", "scales"), 4: ("q", "scales", "mins")}


def quantized_specs(specs, bits: int, group: int) -> list[tuple[str, list[int], str]]:
    """The store tensors `(name, shape, dtype)` standing for bf16 expert tensors `specs` (`gate_up_proj [2I, H]`,
    `down_proj [H, I]`): `gate_up_proj.q`, `gate_up_proj.scales` (and `.mins` for int4), ..."""
    out = []
    for name, shape, _ in specs:
        *rows, n = shape
        check_group(bits, group, n, f"{name} input")
        out.append((f"{name}.q", [*rows, n if bits == 8 else n // 2], "int8" if bits == 8 else "uint8"))
        out.append((f"{name}.scales", [*rows, n // group], "float16"))
        if bits == 4:
            out.append((f"{name}.mins", [*rows, n // group], "float16"))
    return out


def quantize_expert(tensors: dict[str, torch.Tensor], bits: int, group: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in tensors.items():
        for part, v in quantize(w, bits, group).items():
            out[f"{name}.{part}"] = v
    return out


def format_of(views: dict[str, torch.Tensor]) -> tuple[int, int] | None:
    """`(bits, group)` of a slot pool's (or store's) quantized views, None for plain ones."""
    q, s = views.get("down_proj.q"), views.get("down_proj.scales")
    if q is None or s is None:
        return None
    bits = 8 if q.dtype == torch.int8 else 4
    n = q.shape[-1] * (1 if bits == 8 else 2)
    return bits, n // s.shape[-1]


def parts(views: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {p: views[f"{name}.{p}"] for p in ("q", "scales", "mins") if f"{name}.{p}" in views}


def kernel_fits(views: dict[str, torch.Tensor]) -> bool:
    """Whether the integer kernel takes these experts' shapes: hidden and intermediate sizes multiples of 64 and of
    the group size (`I` from the down projection's scales: one per group of its input)."""
    bits, group = format_of(views)
    dn_s = views["down_proj.scales"]
    h, i = dn_s.shape[1], dn_s.shape[2] * group
    return h % 64 == 0 and i % 64 == 0 and h % group == 0 and i % group == 0 and group_ok(group)


def swiglu(x, views: dict[str, torch.Tensor], slots, weights) -> torch.Tensor:
    """Routed SwiGLU experts over quantized views (`[S, ...]` each): on CUDA the triton kernel that dequantizes
    inside (`kernels.swiglu_triton_q`); on the CPU the integer kernel where the extension is built and takes the
    shapes (`kernel_fits`); else the slots that are used dequantized and computed in float (the same weights,
    exact activations)."""
    from . import cpu_kernels
    from .kernels import swiglu_reference

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
    bits, group, f = qc.get("bits"), qc.get("group_size"), qc.get("experts_file")
    if bits not in BITS or not isinstance(group, int) or isinstance(group, bool) or not group_ok(group):
        raise InputError(f"{path}: quantization_config bits={bits!r} group_size={group!r}: expected bits 8 or 4 and a "
                         f"group size of 32 or a multiple of 64 (damaged config.json)")
    if not isinstance(f, str) or "/" in f or f.startswith(".") or not (Path(path) / f).is_file():
        raise InputError(f"{path}: quantization_config names experts_file {f!r}, which is not a file beside config.json")
    return qc


def copy_source(path, meta):
    """The packed experts of `path` (an `expertcache quantize` checkpoint) as an expert source standing beside a
    model whose own experts are described by `meta` (the same layers and experts, else one line): what
    `EngineConfig.miss_precision` reads a miss from."""
    from pathlib import Path

    from .checkpoint import StoreExperts
    from .store import read_store_meta

    qc = read_config(path)
    if qc is None:
        raise InputError(f"{path} is not an `expertcache quantize` checkpoint (no quantization_config)")
    m = read_store_meta(Path(path) / qc["experts_file"])
    if (m.num_layers, m.num_experts) != (meta.num_layers, meta.num_experts):
        raise InputError(f"miss_copy {path} has {m.num_layers} layers x {m.num_experts} experts; the model has "
                         f"{meta.num_layers} x {meta.num_experts}: it is not a copy of this checkpoint")
    if not {"down_proj.q", "down_proj.scales"} <= {t.name for t in m.tensors}:
        raise InputError(f"miss_copy {path}: its experts are not packed integers")
    return StoreExperts(Path(path) / qc["experts_file"], m)


def write_quantized(model, out, bits: int, group: int, progress=None, linears: bool = False) -> dict:
    """`expertcache quantize`: a checkpoint at `out` whose routed experts are `bits`-bit integers with fp16 group
    scales, in one expert store file (each expert one contiguous 4 KiB-aligned block with its checksum), beside the
    non-expert tensors unchanged (`model.safetensors`) and `config.json` with a `quantization_config`. `linears`:
    the non-expert linear layers too (`quantizable_linears`: attention, dense and shared MLPs, the untied output
    head; not the routers), packed in the same format inside `model.safetensors`. Returns the report: bytes, and
    each MoE layer's (and packed linear's) relative weight error."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from expertcache.telemetry.atomic import atomic_dir

    from .loader import build_offloaded, resolve
    from .store import StoreMeta, _write, layout
    from .tiers import DiskTier, SlotPool

    if bits not in BITS:
        raise InputError(f"--bits {bits}: expected 8 or 4")
    path = resolve(model)
    if read_config(path) is not None or "quantization_config" in json.loads((path / "config.json").read_text()):
        raise InputError(f"{path} is already quantized: quantize its unquantized original")
    out = Path(out)
    if out.resolve() == path.resolve():
        raise InputError(f"--out {out} is the model's own folder; write the quantized checkpoint elsewhere")
    m, source = build_offloaded(path, verify=False)
    meta = source.meta
    names = [t.name for t in meta.tensors]
    if sorted(names) != ["down_proj", "gate_up_proj"]:
        raise InputError(f"quantize handles SwiGLU experts without biases (gate_up_proj, down_proj); this model's "
                         f"experts hold {', '.join(names)}")
    if meta.tensors[0].dtype not in ("bfloat16", "float16", "float32"):
        raise InputError(f"{path}: experts in {meta.tensors[0].dtype}; expected float weights")
    specs, block = layout(quantized_specs([(t.name, t.shape, t.dtype) for t in meta.tensors], bits, group))
    qmeta = StoreMeta(meta.fingerprint, meta.num_layers, meta.num_experts, specs, block, str(path))
    disk, pool = DiskTier(source), SlotPool(meta, 1)
    err = {n: [[0.0, 0.0] for _ in range(meta.num_layers)] for n in names}  # per layer: sum d^2, sum w^2

    def expert(i, e):
        disk.read(i, e, pool, 0)
        q = {}
        for n in names:
            w = pool.views[n][0].float()
            t = quantize(w, bits, group)
            d = dequantize(t, bits, group)
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
            t = quantize(w, bits, group)
            lin_err[name] = round(relative_error(w, t, bits, group), 6)
            ck = checkpoint_name(f"{name}.weight", source.family)
            if ck not in keep:
                raise InputError(f"{path}: linear {name} has no tensor {ck} in the checkpoint to quantize")
            keep.remove(ck)
            packed.update({f"{ck}_{part}": v.contiguous() for part, v in t.items()})
    with atomic_dir(out) as tmp:
        try:
            _write(tmp / EXPERTS_FILE, qmeta, expert, progress)
        finally:
            disk.close()
        save_file({**{n: ckpt.read(n).contiguous() for n in keep}, **packed}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        cfg = json.loads((path / "config.json").read_text())
        layer_err = {n: [round((a / b) ** 0.5, 6) if b else 0.0 for a, b in err[n]] for n in names}
        cfg["quantization_config"] = {
            "quant_method": QUANT_METHOD, "bits": bits, "group_size": group, "experts_file": EXPERTS_FILE,
            "scheme": "int8 symmetric, fp16 scale per group" if bits == 8 else
                      "int4 min-max, fp16 scale and minimum per group",
            "source_dtype": meta.tensors[0].dtype, "relative_error": layer_err}
        if lin_names:
            cfg["quantization_config"]["linears"] = {"modules": lin_names, "relative_error": lin_err}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in path.iterdir():  # tokenizer, generation config, chat template
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json" and not f.name.startswith(".") \
                    and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
    del m
    expert_bytes = qmeta.expert_bytes * meta.num_layers * meta.num_experts
    return {"out": str(out), "bits": bits, "group_size": group, "experts": meta.num_layers * meta.num_experts,
            "expert_bytes": expert_bytes, "source_expert_bytes": meta.expert_bytes * meta.num_layers * meta.num_experts,
            "bytes_ratio": expert_bytes / (meta.expert_bytes * meta.num_layers * meta.num_experts),
            "relative_error": layer_err, "linears": {"modules": lin_names, "relative_error": lin_err,
                                                     "skipped": lin_skipped, "bytes": nbytes(packed)}}


# --- quantized non-expert linears (`expertcache quantize --linears true`) ---------------------------------------

LINEAR_PARTS = {"q": "weight_q", "scales": "weight_scales", "mins": "weight_mins"}  # part -> buffer name


class QuantLinear(torch.nn.Module):
    """An `nn.Linear` whose weight is packed group-wise integers (the format above, for one `[out, in]` matrix).
    Decode-sized inputs (at most `cpu_kernels.MAX_ROWS` rows, CPU) go through the integer kernel, which reads the
    packed bytes once; larger inputs (a prefill, a batched evaluation), GPUs and machines without the extension
    compute with the weight dequantized for the call, in the input's dtype (the same weights)."""

    def __init__(self, in_features: int, out_features: int, bits: int, group: int, bias: bool,
                 dtype: torch.dtype = torch.bfloat16, device="meta"):
        super().__init__()
        check_group(bits, group, in_features)
        self.in_features, self.out_features, self.bits, self.group = in_features, out_features, bits, group
        qshape = [out_features, in_features if bits == 8 else in_features // 2]
        self.register_buffer("weight_q", torch.empty(qshape, dtype=torch.int8 if bits == 8 else torch.uint8,
                                                     device=device))
        sshape = [out_features, in_features // group]
        self.register_buffer("weight_scales", torch.empty(sshape, dtype=torch.float16, device=device))
        if bits == 4:
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
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, "
                f"group={self.group}, bias={self.bias is not None}")


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


def install_linears(model, names: list[str], bits: int, group: int) -> None:
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
        setattr(owner, attr, QuantLinear(old.in_features, old.out_features, bits, group, old.bias is not None, dtype))
