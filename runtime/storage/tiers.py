"""Where experts live (the slow tier) and the fast-tier slots they are copied into.

Tiers (every reported figure names its tier):
- ``disk``: reads from the store file with the page cache bypassed (O_DIRECT), straight into the slot.
- ``host``: the whole store in RAM; a transfer is a memory copy into the slot.
- ``throttled:<GB/s>``: host copies paced to a stated link bandwidth (one link shared by all transfers), to
  emulate PCIe / CXL / NVMe on a machine that has none.
- ``cuda`` (= ``host`` with the slots on a GPU): the experts in pinned host memory, copies on a side stream.

Experts come from a source (`checkpoint.CheckpointExperts`: the checkpoint's own safetensors files, read by byte
range; or `checkpoint.StoreExperts`: a repacked store), so no tier needs a second copy of the model on disk.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.registry import Registry

from expertcache.runtime.storage.store import ALIGN, CHECKSUM, FMT, StoreMeta, aligned_buffer, hasher, open_direct

SPLIT, SPLIT_MIN = 4, 4 << 20  # reads of 4 MiB and more go as 4 concurrent pieces


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for a load thread. Between contiguous CPU tensors of one dtype it is a `memmove` on this
    thread alone, with the GIL released: torch's `copy_` would split a large copy over the intra-op (OpenMP)
    threads, which the decoding thread is using. (The slow loads once blamed on this copy were the slots' first-touch
    page faults: see `SlotPool`.)"""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)


def block_views(raw: torch.Tensor, meta: StoreMeta, n_blocks: int, first: int) -> dict[str, torch.Tensor]:
    """`[n_blocks, *shape]` views, per expert tensor, of `n_blocks` store blocks laid out back to back in the
    bytes `raw` from byte `first` on (a slot pool, or the store itself in host memory): no copy. A mixed-precision
    meta (`alt_tensors`) adds format k's views as `@k:name` over the same blocks (which one a block holds is the
    pool's `fmt` tag, `@fmt` in a pool's views)."""
    out = {}
    for k, tensors in enumerate([meta.tensors, *meta.alt_tensors]):
        for t in tensors:
            es = torch.empty((), dtype=t.torch_dtype).element_size()
            inner = torch.empty(t.shape).stride() if t.shape else ()
            out[f"@{k}:{t.name}" if k else t.name] = raw.view(t.torch_dtype).as_strided(
                [n_blocks, *t.shape], [meta.block_bytes // es, *inner], (first + t.offset) // es)
    return out


def measure_bandwidth(tier: "Tier", meta: StoreMeta, executor, layers: int, n: int = 64, seed: int = 0) -> float:
    """Bytes/s `tier` sustains moving `n` random experts (of the first `layers` layers) with `executor`'s
    transfer threads: the roofline's link bandwidth, measured the way the engine and the replay load."""
    import numpy as np

    import queue

    rng = np.random.default_rng(seed)
    width = getattr(executor, "_max_workers", 4)
    pool = SlotPool(meta, width)
    free: queue.Queue = queue.Queue()
    for s in range(width):
        free.put(s)

    def job(i, e):  # a slot of its own while it reads: two reads never write one slot at once
        s = free.get()
        try:
            return tier.read(i, e, pool, s)
        finally:
            free.put(s)

    jobs = [(int(rng.integers(layers)), int(rng.integers(meta.num_experts))) for _ in range(n)]
    t0 = time.perf_counter()
    for f in [executor.submit(job, i, e) for i, e in jobs]:
        f.result()
    return n * meta.expert_bytes / (time.perf_counter() - t0)


def read_limits(tier: "Tier", meta: StoreMeta, layers: int, workers: int, n: int = 48, seed: int = 0) -> dict:
    """This tier's measured read limits for random experts of the first `layers` layers, read as the engine reads
    them: one expert at a time, and `workers` at a time (the engine's load threads). Each expert read of
    `SPLIT_MIN` bytes or more goes as `SPLIT` concurrent pieces, so `queue_depth` counts pieces in flight. The
    engine's achieved bandwidth (`Stats.read_busy_s`) is read against these."""
    from concurrent.futures import ThreadPoolExecutor

    pieces = SPLIT if tier.name == "disk" and meta.expert_bytes >= SPLIT_MIN else 1
    out = {"expert_bytes": meta.expert_bytes}
    for key, width in (("one_at_a_time", 1), ("at_queue_depth", max(1, workers))):
        with ThreadPoolExecutor(max_workers=width) as ex:
            gbps = measure_bandwidth(tier, meta, ex, layers, n, seed) / 1e9
        out[key] = {"GBps": gbps, "queue_depth": width * pieces}
    return out


class SlotPool:
    """`n_slots` expert blocks of one layer (or of a global cache) in one aligned buffer; `views[name]` is a
    `[n_slots, *shape]` tensor over it for each expert tensor, so a slot is written by one read and computed
    on in place."""

    def __init__(self, meta: StoreMeta, n_slots: int, device: str = "cpu", pin: bool = False, touch: bool = False):
        """`touch`: fault every page in now (the engine's cache slots). A slot's first write otherwise takes its
        page faults (huge pages, compacted on demand) inside the load, on the decode's time: a lone 9.4 MB miss
        into a fresh slot loaded at 0.4-0.6 GB/s beside a decode step, against 2.4 GB/s into touched slots (the
        disk's 2.5), and a checkpoint whose misses are rare touches fresh slots for hundreds of tokens."""
        self.meta, self.n_slots, self.device = meta, n_slots, device
        nbytes = n_slots * meta.block_bytes
        if device == "cpu":
            self.buf = aligned_buffer(nbytes)
            self.raw = torch.frombuffer(self.buf, dtype=torch.uint8)
            if touch:
                self.raw.zero_()
            if pin and torch.cuda.is_available():  # page-locked in place: async copies to the GPU
                torch.cuda.cudart().cudaHostRegister(self.raw.data_ptr(), nbytes, 0)
        else:
            self.buf = None
            self.raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.views = block_views(self.raw, meta, n_slots, 0)
        self.fmt = None  # mixed precision: the format index of the expert each slot holds (written by `Tier.read`)
        if meta.alt_tensors:
            self.fmt = torch.zeros(n_slots, dtype=torch.int8, device=device)
            self.views[FMT] = self.fmt

    def slot_bytes(self, slot: int) -> memoryview:
        b = self.meta.block_bytes
        return memoryview(self.buf)[slot * b:(slot + 1) * b]


class Tier:
    """Where experts live. `source` says where each expert's bytes lie in which files (`checkpoint.Span`s):
    the checkpoint's own safetensors files, or a repacked store file."""

    name = "tier"
    bandwidth = None  # bytes/s the tier is paced to, when it is

    def __init__(self, source):
        self.source, self.meta = source, source.meta
        # a mixed-precision source's experts differ in size and format (`quant.MixedExperts`); decided once
        self._expert_nbytes = getattr(source, "expert_nbytes", None)
        self._block_nbytes = getattr(source, "block_nbytes", None)

    def read(self, layer: int, expert: int, pool: SlotPool, slot: int) -> int:
        """Copy one expert into `pool`'s slot (blocking, thread-safe); returns the bytes moved. A failed read
        raises (never swallowed: the caller surfaces it)."""
        raise NotImplementedError

    def _nbytes(self, layer: int, expert: int) -> int:
        """The expert's bytes as stored (a mixed-precision source's experts differ in size)."""
        return self.meta.expert_bytes if self._expert_nbytes is None else self._expert_nbytes(layer, expert)

    def _block(self, layer: int, expert: int) -> int:
        """Bytes of a slot a copy must move: the expert's own block (a mixed-precision source's smaller formats
        fill only the front of the larger slot), else the whole block."""
        return self.meta.block_bytes if self._block_nbytes is None else self._block_nbytes(layer, expert)

    def _tag(self, pool: SlotPool, slot: int, layer: int, expert: int) -> None:
        """A mixed-precision pool records which format the slot now holds (before its bytes are computed on)."""
        if pool.fmt is not None:
            pool.fmt[slot] = self.source.format_index(layer, expert)

    def describe(self) -> dict:
        return {"tier": self.name}

    def close(self) -> None:
        pass


def _runs(spans, gap: int = 64 << 10):
    """Spans grouped into contiguous reads of one file (a gap under `gap` bytes is read through)."""
    out = []
    for s in sorted(spans, key=lambda s: (s.file, s.offset)):
        if out and out[-1][0] == s.file and s.offset - out[-1][2] <= gap:
            out[-1][2] = max(out[-1][2], s.offset + s.nbytes)
            out[-1][3].append(s)
        else:
            out.append([s.file, s.offset, s.offset + s.nbytes, [s]])
    return out


class DiskTier(Tier):
    """Reads with the page cache bypassed (O_DIRECT): the aligned range around each contiguous run of an expert's
    bytes into a per-thread aligned staging buffer, then into the slot (converted if the cache's dtype differs).
    A block that is itself aligned (a repacked store) is read straight into its slot."""

    name = "disk"

    def __init__(self, source):
        super().__init__(source)
        opened = [open_direct(p) for p in source.files]
        self.fds = [fd for fd, _ in opened]
        self.mode = opened[0][1] if opened else "O_DIRECT"
        self._local = threading.local()
        self._split = ThreadPoolExecutor(max_workers=8, thread_name_prefix="read-piece")

    def _staging(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            self._local.mm = aligned_buffer(nbytes)
            self._local.buf = buf = memoryview(self._local.mm)
            self._local.t = torch.frombuffer(self._local.mm, dtype=torch.uint8)
        return self._local.t

    def _pread(self, fd: int, view, offset: int, need: int, what: str) -> None:
        """`need` bytes at `offset` into `view` (aligned). A large read is split into `SPLIT` aligned pieces read
        concurrently: one 9.4 MB O_DIRECT read ran at 1.25 GB/s here, four concurrent pieces at about 1.8."""
        piece = -(-len(view) // SPLIT // ALIGN) * ALIGN
        if len(view) < SPLIT_MIN or piece >= len(view):
            return self._pread_one(fd, view, offset, need, what)
        cuts = list(range(0, len(view), piece))
        futs = [self._split.submit(self._pread_one, fd, view[c:c + piece], offset + c,
                                   max(0, min(piece, need - c)), what) for c in cuts[1:]]
        self._pread_one(fd, view[:piece], offset, min(piece, need), what)
        for f in futs:
            f.result()

    def _pread_one(self, fd: int, view, offset: int, need: int, what: str) -> None:
        try:
            n = os.preadv(fd, [view], offset)
        except OSError as e:
            raise InputError(f"reading {what} failed at byte {offset}: {e}") from None
        if n < need:
            raise InputError(f"short read of {what}: {n} of {need} bytes at byte {offset} (file truncated?)")
        if self.mode != "O_DIRECT":
            os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)

    def read(self, layer, expert, pool, slot):
        """One expert into the slot; when the source has its checksum, the bytes read (as they lie in the file,
        before any dtype conversion) are checked against it and a mismatch is an `InputError` naming the layer,
        expert and file."""
        b = self.meta.block_bytes
        base = slot * b
        what = f"layer {layer} expert {expert}"
        self._tag(pool, slot, layer, expert)
        want = getattr(self.source, "expected_checksum", lambda i, e: None)(layer, expert)
        h = hasher() if want is not None else None
        for file, start, end, spans in _runs(self.source.spans(layer, expert)):
            s0 = spans[0]
            n = (end - start + ALIGN - 1) // ALIGN * ALIGN
            if (pool.device == "cpu" and start % ALIGN == 0 and s0.dst % ALIGN == 0 and s0.dst + n <= b
                    and all(s.src_dtype == s.dst_dtype and s.offset - start == s.dst - s0.dst for s in spans)):
                # the run lies in the file exactly as in the block (a repacked store, or an aligned checkpoint
                # whose experts' tensors sit back to back): one read straight into the slot, no staging copy
                view = pool.slot_bytes(slot)[s0.dst:s0.dst + n]
                self._pread(self.fds[file], view, start, end - start, what)
                if h is not None:
                    for s in spans:
                        h.update(view[s.offset - start:s.offset - start + s.nbytes])
                continue
            a0 = start // ALIGN * ALIGN
            n = (end - a0 + ALIGN - 1) // ALIGN * ALIGN
            st = self._staging(n)
            self._pread(self.fds[file], self._local.buf[:n], a0, end - a0, what)
            for s in spans:
                src = st[s.offset - a0:s.offset - a0 + s.nbytes]
                if s.src_dtype != s.dst_dtype:
                    src = src.view(s.src_dtype).to(s.dst_dtype).view(torch.uint8)
                copy_bytes(pool.raw[base + s.dst:base + s.dst + src.numel()], src)
            if h is not None:  # after the copy: the staged bytes are in cache then (hashing them cold costs 2-3x)
                for s in spans:
                    h.update(self._local.buf[s.offset - a0:s.offset - a0 + s.nbytes])
        if h is not None and h.intdigest() != want:
            raise InputError(f"checksum mismatch: {self.source.where(layer, expert)}: its bytes hash to "
                             f"{h.intdigest():016x}, the recorded {CHECKSUM} is {want:016x}; "
                             f"{getattr(self.source, 'remedy', 'the file is corrupted')}")
        return self._nbytes(layer, expert)

    def describe(self):
        return {"tier": self.name, "page_cache": "bypassed (" + self.mode + ")"}

    def close(self):
        self._split.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class HostTier(Tier):
    """Every expert in host RAM (read once, page cache bypassed), one block each; a transfer is a memory copy."""

    name = "host"

    def __init__(self, source, pin: bool = False, progress=None):
        super().__init__(source)
        m = self.meta
        self.store = SlotPool(m, m.num_layers * m.num_experts, "cpu", pin=pin)
        self.host = self.store.raw
        disk = DiskTier(source)
        try:
            for i in range(m.num_layers):
                for e in range(m.num_experts):
                    disk.read(i, e, self.store, i * m.num_experts + e)
                if progress:
                    progress()
        finally:
            disk.close()

    def layer_views(self, layer: int) -> dict[str, torch.Tensor]:
        """`[E, ...]` views of one layer's experts inside the host copy (no copy)."""
        e = self.meta.num_experts
        v = block_views(self.host, self.meta, e, layer * e * self.meta.block_bytes)
        if self.store.fmt is not None:
            v[FMT] = self.store.fmt[layer * e:(layer + 1) * e]
        return v

    def _src(self, layer, expert):
        b = self.meta.block_bytes
        off = (layer * self.meta.num_experts + expert) * b
        return self.host[off:off + self._block(layer, expert)]

    def read(self, layer, expert, pool, slot):
        b = self.meta.block_bytes
        self._tag(pool, slot, layer, expert)
        src = self._src(layer, expert)
        copy_bytes(pool.raw[slot * b:slot * b + src.numel()], src)
        return self._nbytes(layer, expert)


class ThrottledTier(HostTier):
    """Host copies paced to `gbps` GB/s over one shared link: a transfer starts when the link is free and
    cannot finish before its bytes / bandwidth have passed."""

    def __init__(self, source, gbps: float):
        if not gbps > 0 or gbps == float("inf"):
            raise InputError(f"throttled tier needs a positive, finite GB/s, got {gbps}")
        super().__init__(source)
        self.bandwidth = gbps * 1e9
        self.name = f"throttled:{gbps:g}"
        self._lock = threading.Lock()
        self._free_at = 0.0

    def read(self, layer, expert, pool, slot):
        n = self._nbytes(layer, expert)
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
    """Pinned host copy -> GPU slots on a side stream (the slot pool lives on the GPU)."""

    name = "host->cuda"

    def __init__(self, source):
        if not torch.cuda.is_available():
            raise InputError("tier cuda needs a CUDA GPU; this machine has none (use --engine.tier host or disk "
                             "and --engine.device cpu)")
        super().__init__(source, pin=True)
        self.stream = torch.cuda.Stream()

    def read(self, layer, expert, pool, slot):
        b = self.meta.block_bytes
        self._tag(pool, slot, layer, expert)
        with torch.cuda.stream(self.stream):
            src = self._src(layer, expert)
            pool.raw[slot * b:slot * b + src.numel()].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        ev.synchronize()
        return self._nbytes(layer, expert)


def _gbps(s: str) -> float:
    g = float(s)
    if not (g > 0 and g != float("inf")):
        raise ValueError(s)
    return g


# Every tier name, once: each builds its tier as `factory(arg, source, device)` (`make_tier`).
TIER_REGISTRY = Registry("tier")


@TIER_REGISTRY.register("auto")
def _auto(arg, source, device):
    raise InputError("tier auto is the engine's choice, by the memory available (OffloadEngine); here name the tier: "
                     "disk or host (or cuda, throttled:<GB/s>)")


@TIER_REGISTRY.register("disk")
def _disk(arg, source, device):
    return DiskTier(source)


@TIER_REGISTRY.register("host")
def _host(arg, source, device):  # slots on a GPU: the host copy is pinned and copied on a side stream
    return CudaTier(source) if device == "cuda" else HostTier(source)


@TIER_REGISTRY.register("cuda")
def _cuda(arg, source, device):
    return CudaTier(source)


@TIER_REGISTRY.register("throttled", takes_arg="GB/s", convert=_gbps, arg_help="a positive, finite GB/s, e.g. "
                        "throttled:16")
def _throttled(gbps, source, device):
    return ThrottledTier(source, gbps)


@dataclass
class TierSpec:
    kind: str
    gbps: float | None = None

    @classmethod
    def parse(cls, s: str) -> "TierSpec":
        t = TIER_REGISTRY.parse(s)
        return cls(t.name, t.arg)


def make_tier(spec: str, source, device: str = "cpu") -> Tier:
    """The slow tier for `source` (a `checkpoint.CheckpointExperts` or `StoreExperts`). With slots on a GPU the
    host tier holds pinned memory and copies on a side stream; the disk tier stages through host memory."""
    t = TIER_REGISTRY.parse(spec)
    return t.obj(t.arg, source, device)


def choose_tier(meta: StoreMeta, fast_bytes: int, workers: int, share: float = 0.5) -> tuple[str, str]:
    """`auto`: (tier, why). host when a RAM copy of every expert and the slots take at most `share` of the memory
    available now (a copy is the fastest slow tier and leaves room for the rest), else disk."""
    need = tier_host_bytes("host", meta, workers) + fast_bytes
    avail = available_memory()

    def size(n: float) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    if need <= share * avail:
        return "host", (f"auto: every expert in RAM ({size(need)} with the slots) fits in {share:.0%} of the "
                        f"{size(avail)} available")
    return "disk", (f"auto: every expert in RAM would take {size(need)}, more than {share:.0%} of the "
                    f"{size(avail)} available: read from disk")


def tier_host_bytes(spec: str, meta: StoreMeta, workers: int) -> int:
    """Host memory a tier holds besides the slots: the whole expert set for host/throttled/cuda, per-thread
    staging buffers for disk."""
    kind = TierSpec.parse(spec).kind
    if kind == "disk":
        return workers * (meta.block_bytes + 2 * ALIGN)
    return meta.num_layers * meta.num_experts * meta.block_bytes


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else every core the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory() -> int:
    """Bytes of RAM available now (MemAvailable), the bound a fast-tier cache on this machine must fit."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
