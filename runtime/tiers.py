"""Where experts live (the slow tier) and the fast-tier slots they are copied into.

Tiers (every reported figure names its tier):
- ``disk``: reads from the store file with the page cache bypassed (O_DIRECT), straight into the slot.
- ``host``: the whole store in RAM; a transfer is a memory copy into the slot.
- ``throttled:<GB/s>``: host copies paced to a stated link bandwidth (one link shared by all transfers), to
  emulate PCIe / CXL / NVMe on a machine that has none.
- ``cuda``: slots in GPU memory, the store in pinned host memory, copies on a side stream.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

from expertcache.telemetry.errors import InputError

from .store import StoreMeta, aligned_buffer, open_direct


def block_views(raw: torch.Tensor, meta: StoreMeta, n_blocks: int, first: int) -> dict[str, torch.Tensor]:
    """`[n_blocks, *shape]` views, per expert tensor, of `n_blocks` store blocks laid out back to back in the
    bytes `raw` from byte `first` on (a slot pool, or the store itself in host memory): no copy."""
    out = {}
    for t in meta.tensors:
        es = torch.empty((), dtype=t.torch_dtype).element_size()
        inner = torch.empty(t.shape).stride() if t.shape else ()
        out[t.name] = raw.view(t.torch_dtype).as_strided([n_blocks, *t.shape], [meta.block_bytes // es, *inner],
                                                          (first + t.offset) // es)
    return out


def measure_bandwidth(tier: "Tier", meta: StoreMeta, executor, layers: int, n: int = 64, seed: int = 0) -> float:
    """Bytes/s `tier` sustains moving `n` random experts (of the first `layers` layers) with `executor`'s
    transfer threads: the roofline's link bandwidth, measured the way the engine and the replay load."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = SlotPool(meta, 4)
    jobs = [(int(rng.integers(layers)), int(rng.integers(meta.num_experts))) for _ in range(n)]
    t0 = time.perf_counter()
    for f in [executor.submit(tier.read, i, e, pool, j % 4) for j, (i, e) in enumerate(jobs)]:
        f.result()
    return n * meta.expert_bytes / (time.perf_counter() - t0)


class SlotPool:
    """`n_slots` expert blocks of one layer (or of a global cache) in one aligned buffer; `views[name]` is a
    `[n_slots, *shape]` tensor over it for each expert tensor, so a slot is written by one read and computed
    on in place."""

    def __init__(self, meta: StoreMeta, n_slots: int, device: str = "cpu"):
        self.meta, self.n_slots, self.device = meta, n_slots, device
        nbytes = n_slots * meta.block_bytes
        if device == "cpu":
            self.buf = aligned_buffer(nbytes)
            self.raw = torch.frombuffer(self.buf, dtype=torch.uint8)
        else:
            self.buf = None
            self.raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.views = block_views(self.raw, meta, n_slots, 0)

    def slot_bytes(self, slot: int) -> memoryview:
        b = self.meta.block_bytes
        return memoryview(self.buf)[slot * b:(slot + 1) * b]


class Tier:
    name = "tier"
    bandwidth = None  # bytes/s the tier is paced to, when it is

    def read(self, layer: int, expert: int, pool: SlotPool, slot: int) -> int:
        """Copy one expert into `pool`'s slot (blocking, thread-safe); returns the bytes moved."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"tier": self.name}

    def close(self) -> None:
        pass


class DiskTier(Tier):
    name = "disk"

    def __init__(self, path, meta: StoreMeta):
        self.meta = meta
        self.fd, self.mode = open_direct(path)
        self._staging = threading.local()

    def read(self, layer, expert, pool, slot):
        b = self.meta.block_bytes
        off = self.meta.offset(layer, expert)
        if pool.device == "cpu":
            n = os.preadv(self.fd, [pool.slot_bytes(slot)], off)
        else:  # disk -> aligned host staging -> device
            st = getattr(self._staging, "buf", None)
            if st is None:
                st = self._staging.buf = aligned_buffer(b)
            n = os.preadv(self.fd, [st], off)
            pool.raw[slot * b:(slot + 1) * b].copy_(torch.frombuffer(st, dtype=torch.uint8)[:b])
        if n != b:
            raise InputError(f"short read from the expert store: {n} of {b} bytes at layer {layer} expert {expert}")
        if self.mode != "O_DIRECT":
            os.posix_fadvise(self.fd, off, b, os.POSIX_FADV_DONTNEED)
        return self.meta.expert_bytes

    def describe(self):
        return {"tier": self.name, "page_cache": "bypassed (" + self.mode + ")"}

    def close(self):
        os.close(self.fd)


class HostTier(Tier):
    name = "host"

    def __init__(self, path, meta: StoreMeta, pin: bool = False):
        self.meta = meta
        n = meta.file_bytes()
        self.host = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
        fd, _ = open_direct(path)
        try:
            buf = aligned_buffer(min(n, 64 << 20))
            pos = 0
            while pos < n:  # read in big aligned chunks
                got = os.preadv(fd, [buf], pos)
                take = min(got, n - pos)
                self.host[pos:pos + take].copy_(torch.frombuffer(buf, dtype=torch.uint8)[:take])
                pos += take
                if got == 0:
                    raise InputError("the expert store ended early while loading it into host memory")
        finally:
            os.close(fd)

    def _src(self, layer, expert):
        off = self.meta.offset(layer, expert)
        return self.host[off:off + self.meta.block_bytes]

    def read(self, layer, expert, pool, slot):
        b = self.meta.block_bytes
        pool.raw[slot * b:(slot + 1) * b].copy_(self._src(layer, expert))
        return self.meta.expert_bytes


class ThrottledTier(HostTier):
    """Host copies paced to `gbps` GB/s over one shared link: a transfer starts when the link is free and
    cannot finish before its bytes / bandwidth have passed."""

    def __init__(self, path, meta, gbps: float):
        super().__init__(path, meta)
        if gbps <= 0:
            raise InputError(f"throttled tier needs a positive GB/s, got {gbps}")
        self.bandwidth = gbps * 1e9
        self.name = f"throttled:{gbps:g}"
        self._lock = threading.Lock()
        self._free_at = 0.0

    def read(self, layer, expert, pool, slot):
        n = self.meta.expert_bytes
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = done = start + n / self.bandwidth
        super().read(layer, expert, pool, slot)
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return n

    def describe(self):
        return {"tier": self.name, "bandwidth_GBps": self.bandwidth / 1e9}


class CudaTier(HostTier):
    """Pinned host store -> GPU slots on a side stream (the slot pool must live on the GPU)."""

    name = "cuda"

    def __init__(self, path, meta):
        if not torch.cuda.is_available():
            raise InputError("tier cuda needs a CUDA GPU; this machine has none (use disk, host or throttled:<GB/s>)")
        super().__init__(path, meta, pin=True)
        self.stream = torch.cuda.Stream()

    def read(self, layer, expert, pool, slot):
        b = self.meta.block_bytes
        with torch.cuda.stream(self.stream):
            pool.raw[slot * b:(slot + 1) * b].copy_(self._src(layer, expert), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        ev.synchronize()
        return self.meta.expert_bytes


@dataclass
class TierSpec:
    kind: str
    gbps: float | None = None

    @classmethod
    def parse(cls, s: str) -> "TierSpec":
        if s in ("disk", "host", "cuda"):
            return cls(s)
        if s.startswith("throttled:"):
            try:
                return cls("throttled", float(s.split(":", 1)[1]))
            except ValueError:
                pass
        raise InputError(f"unknown tier {s!r}; expected disk, host, cuda or throttled:<GB/s> (e.g. throttled:16)")


def make_tier(spec: str, path, meta: StoreMeta) -> Tier:
    t = TierSpec.parse(spec)
    if t.kind == "disk":
        return DiskTier(path, meta)
    if t.kind == "host":
        return HostTier(path, meta)
    if t.kind == "cuda":
        return CudaTier(path, meta)
    return ThrottledTier(path, meta, t.gbps)


def available_memory() -> int:
    """Bytes of RAM available now (MemAvailable), the bound a fast-tier cache on this machine must fit."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
