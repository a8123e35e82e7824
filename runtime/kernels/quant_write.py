"""`expertcache quantize`'s writer: a checkpoint's experts (and optionally its linears) packed to int8 / int4, one
format for all or, `--by_usage`, each expert's format chosen by how often a trace uses it."""

from __future__ import annotations


from expertcache.telemetry.errors import InputError
from expertcache.runtime.storage.weight_checks import INTEGRITY_DEFAULT
from expertcache.runtime.kernels.qlinear import quantizable_linears
from expertcache.runtime.kernels.quant import (BITS, EXPERTS_FILE, MIXED, QUANT_METHOD, dequantize, nbytes, quantize,
                                              quantized_specs, read_config, relative_error)


def usage_counts(trace, model, num_layers: int, num_experts: int) -> tuple:
    """`(counts [layers, E], tokens)`: how often each expert of each MoE layer was chosen in a routing trace of this
    model (every token it holds, prefill and decode). A trace of another model's shape is one line."""
    import numpy as np

    from expertcache.telemetry.adapters import adapter_for
    from expertcache.telemetry.routing import load_routing

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
                    overwrite: bool = False, integrity: str = INTEGRITY_DEFAULT) -> dict:
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
    from pathlib import Path

    import numpy as np
    from safetensors.torch import save_file

    from expertcache.telemetry.atomic import atomic_dir

    from expertcache.runtime.storage.loader import build_offloaded, resolve
    from expertcache.runtime.storage.store import StoreMeta, _write, layout
    from expertcache.runtime.storage.tiers import DiskTier, SlotPool
    from expertcache.runtime.storage.verify import check_written
    from expertcache.runtime.storage.weight_checks import check_integrity

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

        from expertcache.runtime.storage.checkpoint import checkpoint_name

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
    with atomic_dir(out, command="quantize", overwrite=overwrite) as tmp:
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
        copy_beside_weights(path, tmp, {p.name for p in ckpt.files})
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


def copy_beside_weights(src, dst, weights: set[str]) -> list[str]:
    """Everything a checkpoint folder carries besides its weights and config.json (which a converted copy writes
    anew): aux routers, tokenizer files, generation config, chat templates (a file or a folder of them), a
    README. Hidden files (the checksum index, an output marker) are the source's own and stay behind."""
    from expertcache.telemetry.atomic import copy_file, copy_tree

    skip = weights | {"config.json", "model.safetensors.index.json"}
    copied = []
    for f in sorted(src.iterdir()):
        if f.name in skip or f.name.startswith("."):
            continue
        if f.is_dir():
            copy_tree(f, dst / f.name)
        else:
            copy_file(f, dst / f.name)
        copied.append(f.name)
    return copied
