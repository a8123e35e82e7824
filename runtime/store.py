"""The expert store: every routed expert of a checkpoint in one file, one aligned block per (MoE layer, expert).

Layout:
    [0, HEADER)      JSON header, NUL-padded to HEADER = 64 KiB: shapes, dtypes, fingerprint, block size
    HEADER + (i * E + e) * block    expert e of MoE layer i: its tensors back to back, each at a 4 KiB-aligned
                                    offset inside the block; the block is a multiple of 4 KiB

so any expert is one contiguous, aligned read that O_DIRECT can serve (the page cache bypassed: the disk tier
measures the disk, not RAM). The header's fingerprint ties the store to the checkpoint it came from; a
truncated file is refused when opened.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from expertcache.telemetry.errors import InputError

MAGIC = "expertcache-store"
VERSION = 1
HEADER = 64 << 10
ALIGN = 4096


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class TensorSpec:
    name: str  # the experts module's parameter name (e.g. gate_up_proj)
    shape: list[int]  # one expert's shape
    dtype: str  # torch dtype name (float32, bfloat16, ...)
    offset: int  # bytes from the block start

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.torch_dtype).element_size()


@dataclass
class StoreMeta:
    fingerprint: str
    num_layers: int  # MoE layers in the store
    num_experts: int
    tensors: list[TensorSpec]
    block_bytes: int
    source: str = ""  # checkpoint path, or "random" for replay stores

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (what a transfer moves, padding excluded)."""
        return sum(t.nbytes for t in self.tensors)

    def file_bytes(self) -> int:
        return HEADER + self.num_layers * self.num_experts * self.block_bytes

    def offset(self, layer: int, expert: int) -> int:
        return HEADER + (layer * self.num_experts + expert) * self.block_bytes

    def to_json(self) -> bytes:
        d = {"magic": MAGIC, "version": VERSION, "fingerprint": self.fingerprint, "num_layers": self.num_layers,
             "num_experts": self.num_experts, "block_bytes": self.block_bytes, "source": self.source,
             "tensors": [t.__dict__ for t in self.tensors]}
        raw = json.dumps(d).encode()
        if len(raw) >= HEADER:
            raise InputError(f"store header of {len(raw)} bytes does not fit {HEADER}")
        return raw + b"\0" * (HEADER - len(raw))


def layout(specs: list[tuple[str, list[int], str]]) -> tuple[list[TensorSpec], int]:
    """Place each tensor at an aligned offset; returns the specs and the block size."""
    out, off = [], 0
    for name, shape, dtype in specs:
        t = TensorSpec(name, list(shape), dtype, off)
        out.append(t)
        off = _align(off + t.nbytes)
    return out, max(off, ALIGN)


def model_fingerprint(model) -> str:
    from expertcache.telemetry.adapters import router_fingerprint

    return router_fingerprint(model)


def expert_tensors(experts: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The routed experts' fused parameters `[E, ...]` by name (gate_up_proj, down_proj, biases)."""
    return {n: p for n, p in experts.named_parameters(recurse=False)}


def _write(path: str | Path, meta: StoreMeta, expert, progress=None) -> StoreMeta:
    """The store file: header, then `expert(layer, e) -> {name: tensor}` for every block, written to a temp name,
    fsynced (on disk before anyone times a read of it) and moved into place."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    buf = bytearray(meta.block_bytes)
    with open(tmp, "wb") as f:
        f.write(meta.to_json())
        for layer in range(meta.num_layers):
            for e in range(meta.num_experts):
                buf[:] = bytes(meta.block_bytes)
                tensors = expert(layer, e)
                for t in meta.tensors:
                    raw = tensors[t.name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
                    buf[t.offset:t.offset + len(raw)] = raw
                f.write(buf)
            if progress:
                progress()
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return meta


def write_store(model, path: str | Path, progress=None) -> StoreMeta:
    """Write every routed expert of `model` into a store file."""
    from expertcache.telemetry.adapters import adapter_for

    a = adapter_for(model)
    layers = a.moe_layers(model)
    first = expert_tensors(layers[0].experts)
    specs, block = layout([(n, list(p.shape[1:]), str(p.dtype).removeprefix("torch.")) for n, p in first.items()])
    meta = StoreMeta(model_fingerprint(model), len(layers), a.num_experts, specs, block,
                     str(getattr(model, "name_or_path", "")))
    params = [expert_tensors(L.experts) for L in layers]
    return _write(path, meta, lambda i, e: {n: p[e] for n, p in params[i].items()}, progress)


def write_random_store(path: str | Path, num_layers: int, num_experts: int, specs: list[tuple[str, list[int], str]],
                       seed: int = 0, progress=None) -> StoreMeta:
    """A store of random experts of a given shape (replay at realistic sizes: the weights' values do not matter
    for transfer and compute time, only their size). One random draw per layer, rolled per expert (fast)."""
    tensors, block = layout(specs)
    meta = StoreMeta(f"random-{seed}-{num_layers}x{num_experts}", num_layers, num_experts, tensors, block, "random")
    g = torch.Generator().manual_seed(seed)
    draws: dict[int, dict] = {}

    def expert(i, e):
        if i not in draws:
            draws.clear()
            draws[i] = {t.name: (torch.randn(t.shape, generator=g) * 0.02).to(t.torch_dtype) for t in tensors}
        return {n: x.roll(e * 7919) for n, x in draws[i].items()}
    return _write(path, meta, expert, progress)


def read_store_meta(path: str | Path) -> StoreMeta:
    """The header, checked: magic, version and the file's size (a truncated store is refused here)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"expert store {path} not found")
    with open(path, "rb") as f:
        raw = f.read(HEADER)
    try:
        d = json.loads(raw.rstrip(b"\0").decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        d = {}
    if d.get("magic") != MAGIC:
        raise InputError(f"{path} is not an expertcache expert store")
    if d.get("version") != VERSION:
        raise InputError(f"{path} is store version {d.get('version')}; this build reads version {VERSION}")
    meta = StoreMeta(d["fingerprint"], d["num_layers"], d["num_experts"], [TensorSpec(**t) for t in d["tensors"]],
                     d["block_bytes"], d.get("source", ""))
    size = path.stat().st_size
    if size != meta.file_bytes():
        raise InputError(f"expert store {path} is {size} bytes, its header says {meta.file_bytes()}: the file is "
                         f"truncated or damaged (rewrite it)")
    return meta


def check_store(meta: StoreMeta, model) -> None:
    """A store must come from this checkpoint."""
    fp = model_fingerprint(model)
    if meta.fingerprint != fp:
        raise InputError(f"expert store comes from another checkpoint (fingerprint {meta.fingerprint}, this "
                         f"model's is {fp}; source {meta.source or 'unknown'}); write a store for this model")


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory (what O_DIRECT reads need)."""
    return mmap.mmap(-1, _align(max(nbytes, 1)))


def open_direct(path: str | Path) -> tuple[int, str]:
    """A read-only fd with the page cache bypassed, and how: O_DIRECT where the filesystem allows it, else a
    plain fd whose pages are dropped after each read (posix_fadvise DONTNEED)."""
    try:
        return os.open(str(path), os.O_RDONLY | os.O_DIRECT), "O_DIRECT"
    except OSError:
        return os.open(str(path), os.O_RDONLY), "fadvise-dontneed"
