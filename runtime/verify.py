"""`expertcache verify`: every routed expert's bytes against its checksum, and every weight's finiteness.

- A safetensors checkpoint directory: each expert's spans (`checkpoint.CheckpointExperts`) are hashed (xxh3_64,
  in `checkpoint.expert_order`) and compared with `<checkpoint>/.expertcache-checksums.json` where its entries are
  still valid (the file's name, size and mtime unchanged); the index is written (atomically) when there was none,
  when it was made for another layout, unreadable, or when files changed since. An index whose experts no longer
  match is kept: it is the reference that shows the corruption.
- A repacked store file (`store.write_store`): each block against the store's checksum table.

Either way every floating-point weight (experts and the rest) must be finite. The report says what was checked
and what failed; `ok` is False on any mismatch or non-finite weight. The same checksums are checked on every
read of an expert by the disk tier (`tiers.DiskTier.read`) when the source has them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from expertcache.telemetry.atomic import write_json
from expertcache.telemetry.errors import InputError

from .checkpoint import (CHECKSUM_INDEX, INDEX_FORMAT, INDEX_VERSION, CheckpointExperts, Span, expert_order)
from .store import CHECKSUM, checksum, hasher, read_store_meta

LIST_MAX = 100  # entries of each problem list in the report (the counts are complete)


def _finite(raw: bytearray, dtype: torch.dtype) -> bool:
    if not dtype.is_floating_point or not len(raw):
        return True
    return bool(torch.isfinite(torch.frombuffer(raw, dtype=torch.uint8).view(dtype)).all())


def _pread(fd: int, offset: int, n: int, what: str) -> bytearray:
    data = bytearray(n)  # writable: torch.frombuffer views it without a copy or a warning
    got = os.preadv(fd, [data], offset) if n else 0
    if got != n:
        raise InputError(f"short read of {what}: {got} of {n} bytes at byte {offset} (file truncated?)")
    return data


def _expert(fds: list[int], spans: list[Span], what: str) -> tuple[int, bool]:
    """(checksum, every float span finite) of one expert's bytes, read in checksum order."""
    h, finite = hasher(), True
    for s in expert_order(spans):
        data = _pread(fds[s.file], s.offset, s.nbytes, what)
        h.update(data)
        finite = finite and _finite(data, s.src_dtype)
    return h.intdigest(), finite


def _report(kind: str, path: Path, n: int, nbytes: int, mismatches: list, non_finite: list, t0: float,
            **extra) -> dict:
    return {"model": str(path), "kind": kind, "algorithm": CHECKSUM, "experts": n, "expert_bytes_checked": nbytes,
            **extra, "mismatches": len(mismatches), "mismatch_list": mismatches[:LIST_MAX],
            "non_finite": len(non_finite), "non_finite_list": non_finite[:LIST_MAX],
            "ok": not mismatches and not non_finite, "seconds": round(time.perf_counter() - t0, 3)}


def verify_store(path: str | Path, progress=None) -> dict:
    """Every block of a store file against its checksum table, and each float tensor in it finite."""
    t0 = time.perf_counter()
    path = Path(path)
    meta = read_store_meta(path)
    mismatches, non_finite, nbytes = [], [], 0
    fd = os.open(str(path), os.O_RDONLY)
    try:
        for i in range(meta.num_layers):
            for e in range(meta.num_experts):
                where = f"MoE layer {i} expert {e} in {path}"
                block = _pread(fd, meta.offset(i, e), meta.block_bytes, where)
                nbytes += len(block)
                if meta.checksums is not None:
                    got, want = checksum(block), int(meta.checksums[i, e])
                    if got != want:
                        mismatches.append({"layer": i, "expert": e, "where": where, "expected": f"{want:016x}",
                                           "got": f"{got:016x}"})
                bad = [t.name for t in meta.tensors if not _finite(block[t.offset:t.offset + t.nbytes], t.torch_dtype)]
                if bad:
                    non_finite.append({"layer": i, "expert": e, "where": where, "tensors": bad})
            if progress:
                progress()
    finally:
        os.close(fd)
    return _report("store", path, meta.num_layers * meta.num_experts, nbytes, mismatches, non_finite, t0,
                   store_version=meta.version, checksums=meta.checksums is not None,
                   index={"path": str(path), "before": "table" if meta.checksums is not None else
                          "none (version 1 store: rewrite it to get checksums)", "after": "unchanged"})


def verify_checkpoint(path: str | Path, write_index: bool = True, progress=None) -> dict:
    """Every expert of a safetensors checkpoint against its checksum index (where valid), every weight finite;
    the index written or refreshed when it had nothing to say about some experts and nothing failed."""
    from .loader import expert_source

    t0 = time.perf_counter()
    path = Path(path)
    src: CheckpointExperts = expert_source(path)
    stamps = src.file_stamps()  # before reading: a file changed during the pass is stale next time
    before, problem, expected, stale = "none", None, None, []
    try:
        index = src.read_index()
    except InputError as e:
        index, before, problem = None, "unreadable", str(e)
    if index is not None:
        expected, stale = src.indexed_checksums(index)
        before = "other layout" if expected is None else ("stale" if stale else "valid")
    n_layers, n_exp = len(src.prefixes), src.num_experts
    sums = [[0] * n_exp for _ in range(n_layers)]
    mismatches, non_finite, nbytes, compared = [], [], 0, 0
    fds = [os.open(str(p), os.O_RDONLY) for p in src.files]
    try:
        for i in range(n_layers):
            for e in range(n_exp):
                spans = src.spans(i, e)
                where = src.where(i, e)
                got, finite = _expert(fds, spans, where)
                sums[i][e] = got
                nbytes += sum(s.nbytes for s in spans)
                want = None if expected is None else expected[i][e]
                if want is not None:
                    compared += 1
                    if got != want:
                        mismatches.append({"layer": i, "expert": e, "where": where, "expected": f"{want:016x}",
                                           "got": f"{got:016x}"})
                if not finite:
                    non_finite.append({"layer": i, "expert": e, "where": where})
            if progress:
                progress()
        others = 0
        for name, info in sorted(src.ckpt.tensors.items()):
            if name in src.names:
                continue
            others += 1
            raw = _pread(fds[info.file], info.start, info.nbytes, name)
            if not _finite(raw, info.dtype):
                non_finite.append({"tensor": name, "where": f"{name} in {src.files[info.file].name} of {path}"})
    finally:
        for fd in fds:
            os.close(fd)
    after = "unchanged"
    if before != "valid":
        if not write_index:
            after = "not written (write_index=False)"
        elif mismatches or non_finite:
            after = "not written (problems found: fix the checkpoint first)"
        else:
            write_json(src.index_path, {"format": INDEX_FORMAT, "version": INDEX_VERSION, "algorithm": CHECKSUM,
                                        "layout_sha256": src.layout_sha256(), "files": stamps,
                                        "layers": src.prefixes, "experts": [[f"{x:016x}" for x in row]
                                                                             for row in sums]})
            after = "written"
    index_info = {"path": str(src.index_path), "before": before, "after": after, "stale_files": stale}
    if problem:
        index_info["problem"] = problem
    return _report("checkpoint", path, n_layers * n_exp, nbytes, mismatches, non_finite, t0,
                   checked_against_index=compared, non_expert_tensors=others, index=index_info)


def verify(model: str | Path, *, write_index: bool = True, progress=None) -> dict:
    """Check a checkpoint directory (safetensors, read in place) or a repacked store file: every routed expert
    against its checksum and every floating-point weight finite. Returns the report (`ok`: nothing failed);
    `write_index`: build/refresh `<checkpoint>/.expertcache-checksums.json` when it was missing or out of date.
    Unreadable input is an `InputError`; corruption is reported (ok False), not raised."""
    p = Path(model).expanduser()
    if p.is_file():
        return verify_store(p, progress)
    if p.is_dir():
        return verify_checkpoint(p, write_index, progress)
    raise InputError(f"{p}: no such checkpoint directory or store file")


__all__ = ["verify", "verify_checkpoint", "verify_store", "CHECKSUM_INDEX"]
