"""The expert store: every routed expert of a checkpoint in one file, one aligned block per (MoE layer, expert).

Layout:
    [0, HEADER)      JSON header, NUL-padded to HEADER = 64 KiB: shapes, dtypes, fingerprint, block size, and
                     (version 2) where the checksum table lies
    HEADER + (i * E + e) * block    expert e of MoE layer i: its tensors back to back, each at a 4 KiB-aligned
                                    offset inside the block; the block is a multiple of 4 KiB
    checksum table   (version 2) one little-endian uint64 xxh3_64 digest per block, in block order, padded to
                     4 KiB: 8 bytes x L x E do not fit 64 KiB for a large model (48 x 128 experts: 48 KiB)

so any expert is one contiguous, aligned read that O_DIRECT can serve (the page cache bypassed: the disk tier
measures the disk, not RAM). The header's fingerprint ties the store to the checkpoint it came from; a
truncated file is refused when opened; a block whose bytes changed is refused when read (`tiers.DiskTier`
checks each block against its digest) or by `verify.verify`. Version 1 stores (no table) are still read.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from expertcache.telemetry.errors import InputError

MAGIC = "expertcache-store"
VERSION = 2
READS = (1, 2)  # versions this build reads (1: no checksum table)
CHECKSUM = "xxh3_64"  # the per-expert digest of stores and checkpoint indexes (about 10 GB/s on one core)


def hasher():
    """A fresh incremental digest of the checksum algorithm (`update(buffer)`, `intdigest()`)."""
    return xxhash.xxh3_64()


def checksum(data) -> int:
    """The digest of one buffer (bytes, bytearray, memoryview)."""
    return xxhash.xxh3_64_intdigest(data)
HEADER = 64 << 10
ALIGN = 4096
FMT = "@fmt"  # a mixed-precision slot pool's view: the format each slot holds (`tiers.SlotPool`)
STORE_DIR = "runs/stores"  # where repacked stores (the replay's, `bench decode --replay`) are written by default


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
    version: int = VERSION
    # [num_layers, num_experts] uint64 digests of each block (version 2; not part of the header's JSON)
    checksums: np.ndarray | None = field(default=None, compare=False, repr=False)
    # a mixed-precision source (`quant.MixedExperts`, never a file's header): the other formats' tensors, each laid
    # out inside the same block size; slot pools then view every format (`tiers.block_views`) and tag each slot
    alt_tensors: list[list[TensorSpec]] = field(default_factory=list, compare=False, repr=False)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (what a transfer moves, padding excluded)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def table_offset(self) -> int:
        """Where the checksum table starts (version 2): right after the last block."""
        return HEADER + self.num_layers * self.num_experts * self.block_bytes

    def table_bytes(self) -> int:
        return _align(8 * self.num_layers * self.num_experts) if self.version >= 2 else 0

    def file_bytes(self) -> int:
        return self.table_offset + self.table_bytes()

    def offset(self, layer: int, expert: int) -> int:
        return HEADER + (layer * self.num_experts + expert) * self.block_bytes

    def to_json(self) -> bytes:
        d = {"magic": MAGIC, "version": self.version, "fingerprint": self.fingerprint, "num_layers": self.num_layers,
             "num_experts": self.num_experts, "block_bytes": self.block_bytes, "source": self.source,
             "tensors": [t.__dict__ for t in self.tensors]}
        if self.version >= 2:
            d["checksum"] = {"algorithm": CHECKSUM, "offset": self.table_offset, "count": self.num_layers *
                             self.num_experts}
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
    """The store file: header, then `expert(layer, e) -> {name: tensor}` for every block, then the blocks'
    checksum table, written to a temp name, fsynced (on disk before anyone times a read of it) and moved into
    place."""
    from expertcache.telemetry.atomic import atomic_open

    buf = bytearray(meta.block_bytes)
    meta.version = VERSION
    sums = np.zeros((meta.num_layers, meta.num_experts), dtype="<u8")
    with atomic_open(path) as f:
        f.write(meta.to_json())
        for layer in range(meta.num_layers):
            for e in range(meta.num_experts):
                buf[:] = bytes(meta.block_bytes)
                tensors = expert(layer, e)
                for t in meta.tensors:
                    raw = tensors[t.name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
                    if len(raw) != t.nbytes:  # a tensor of another shape would shift or truncate the block
                        raise InputError(f"store {path}: layer {layer} expert {e} {t.name} holds {len(raw)} bytes; "
                                         f"its spec {t.shape} {t.dtype} takes {t.nbytes}")
                    buf[t.offset:t.offset + len(raw)] = raw
                sums[layer, e] = checksum(buf)
                f.write(buf)
            if progress:
                progress()
        table = sums.tobytes()
        f.write(table + b"\0" * (meta.table_bytes() - len(table)))
    meta.checksums = sums
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
    """The header, checked: magic, version, every field's type, the file's size (a truncated store is refused
    here) and, for version 2, the checksum table (read into `meta.checksums`)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"expert store {path} not found")
    with open(path, "rb") as f:
        raw = f.read(HEADER)
    try:
        d = json.loads(raw.rstrip(b"\0").decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        d = {}
    if not isinstance(d, dict) or d.get("magic") != MAGIC:
        raise InputError(f"{path} is not an expertcache expert store")
    if d.get("version") not in READS:
        raise InputError(f"{path} is store version {d.get('version')}; this build reads versions "
                         f"{', '.join(map(str, READS))}")
    meta = _meta_from_header(path, d)
    size = path.stat().st_size
    if size != meta.file_bytes():
        raise InputError(f"expert store {path} is {size} bytes, its header says {meta.file_bytes()}: the file is "
                         f"truncated or damaged (rewrite it)")
    if meta.version >= 2:
        c = d.get("checksum")
        n = meta.num_layers * meta.num_experts
        if (not isinstance(c, dict) or c.get("algorithm") != CHECKSUM or c.get("offset") != meta.table_offset
                or c.get("count") != n):
            raise InputError(f"{path}: store header's checksum entry {c!r} is not the {CHECKSUM} table of {n} blocks "
                             f"at byte {meta.table_offset} (damaged header: rewrite the store)")
        with open(path, "rb") as f:
            f.seek(meta.table_offset)
            table = f.read(8 * n)
        meta.checksums = np.frombuffer(table, dtype="<u8").reshape(meta.num_layers, meta.num_experts).copy()
    return meta


def _int(d: dict, key: str, path, lo: int = 1) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise InputError(f"{path}: store header field {key} = {v!r}, expected an integer >= {lo} (damaged header)")
    return v


def _meta_from_header(path, d: dict) -> StoreMeta:
    """A `StoreMeta` from a parsed header, every field checked (a damaged header is an `InputError`, never a
    KeyError or a nonsensical layout)."""
    dtypes = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
    tensors = d.get("tensors")
    if not isinstance(tensors, list) or not tensors:
        raise InputError(f"{path}: store header has no tensor list (damaged header)")
    specs = []
    block = _int(d, "block_bytes", path)
    if block % ALIGN:
        raise InputError(f"{path}: store block size {block} is not a multiple of {ALIGN} (damaged header)")
    for t in tensors:
        if (not isinstance(t, dict) or set(t) != {"name", "shape", "dtype", "offset"} or not isinstance(t["name"], str)
                or t["dtype"] not in dtypes or not isinstance(t["shape"], list)
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 40 for x in t["shape"])
                or not isinstance(t["offset"], int) or isinstance(t["offset"], bool) or t["offset"] < 0):
            raise InputError(f"{path}: store header tensor entry {str(t)[:120]} is not a tensor spec (damaged header)")
        spec = TensorSpec(**t)
        if spec.offset + spec.nbytes > block:
            raise InputError(f"{path}: store tensor {spec.name} ends at byte {spec.offset + spec.nbytes} of a "
                             f"{block}-byte block (damaged header)")
        specs.append(spec)
    fp, src = d.get("fingerprint"), d.get("source", "")
    if not isinstance(fp, str) or not isinstance(src, str):
        raise InputError(f"{path}: store header fingerprint/source are not strings (damaged header)")
    return StoreMeta(fp, _int(d, "num_layers", path), _int(d, "num_experts", path), specs, block, src,
                     version=d["version"])


def check_store(meta: StoreMeta, model) -> None:
    """A store must come from this checkpoint."""
    fp = model_fingerprint(model)
    if meta.fingerprint != fp:
        raise InputError(f"expert store comes from another checkpoint (fingerprint {meta.fingerprint}, this "
                         f"model's is {fp}; source {meta.source or 'unknown'}); write a store for this model")


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory (what O_DIRECT reads need), in transparent huge pages where the kernel gives
    them (`madvise`: the kernels stream hundreds of MB per token; 4 KiB pages cost TLB misses on every one)."""
    m = mmap.mmap(-1, _align(max(nbytes, 1)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= 1 << 21 and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # not offered here: 4 KiB pages
            pass
    return m


def open_direct(path: str | Path) -> tuple[int, str]:
    """A read-only fd with the page cache bypassed, and how: O_DIRECT where the filesystem allows it, else a
    plain fd whose pages are dropped after each read (posix_fadvise DONTNEED)."""
    try:
        return os.open(str(path), os.O_RDONLY | os.O_DIRECT), "O_DIRECT"
    except OSError:
        return os.open(str(path), os.O_RDONLY), "fadvise-dontneed"
