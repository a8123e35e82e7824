"""`expertcache verify`: every routed expert's bytes against its checksum, and every weight's finiteness.

- A safetensors checkpoint directory: each expert's spans (`checkpoint.CheckpointExperts`) are hashed (xxh3_64,
  in `checkpoint.expert_order`) and compared with the checkpoint's checksum index (`.expertcache-checksums.json`
  beside it, or in the user cache folder when the checkpoint's folder is not writable: read-only storage works).
  The index is the reference: a file that changed since (size, mtime) is compared with it like any other, so
  damage written in place is reported as damage and the index is left as it was. The index is written only
  when there was none and the checks below found nothing, or on `rebless=True` (the user says the current bytes
  are the new reference: a re-saved checkpoint, another layout, a lost index).
- Checks that need no reference, on every run: every floating-point weight finite, and each tensor's largest
  magnitude against its siblings' (the same tensor of the other experts and layers): an exponent flip makes a
  weight 10^4-10^5 times its siblings, so a tensor above `OUTLIER_RATIO` times its group's lower quartile is
  reported as an outlier. A fresh checkpoint with no index is thus still checked.
- A repacked store file (`store.write_store`): each block against the store's checksum table.
- An `expertcache quantize` checkpoint (one store, or one per format): each expert's block against its store's
  table, every float tensor (scales, minimums, non-expert weights) finite and no magnitude outlier.

The report says what was checked, what failed, and a `verdict`: ok (checked against the reference), unverified
(no usable reference; the reference-free checks passed), damaged. `ok` is False on any mismatch, non-finite
weight or outlier, or when an index exists that cannot be used without `rebless`. The same checksums are checked
on every read of an expert by the disk tier (`tiers.DiskTier.read`) when the source has them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from expertcache.telemetry.atomic import claim_dir, own_dir, write_json
from expertcache.telemetry.errors import InputError

from expertcache.runtime.storage.checkpoint import (CHECKSUM_INDEX, INDEX_FORMAT, INDEX_VERSION, CheckpointExperts, Span, expert_order)
from expertcache.runtime.storage.store import CHECKSUM, checksum, hasher, read_store_meta
from expertcache.runtime.storage.weight_checks import OUTLIER_RATIO, outliers  # noqa: F401 - the one sibling-magnitude rule (load, engine too)

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


def _max_abs(raw: bytearray, dtype: torch.dtype) -> float | None:
    """Largest |w| of a finite float span (None: not floats, empty, or not finite)."""
    if not dtype.is_floating_point or not len(raw):
        return None
    t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
    m = float(t.abs().max())
    return m if m == m and m != float("inf") else None


def _expert(fds: list[int], spans: list[Span], what: str) -> tuple[int, bool, list[float | None]]:
    """(checksum, every float span finite, each span's max |w| in `spans` order) of one expert's bytes, read in
    checksum order."""
    h, finite = hasher(), True
    mags: dict[int, float | None] = {}
    for s in expert_order(spans):
        data = _pread(fds[s.file], s.offset, s.nbytes, what)
        h.update(data)
        ok = _finite(data, s.src_dtype)
        finite = finite and ok
        mags[id(s)] = _max_abs(data, s.src_dtype) if ok else None
    return h.intdigest(), finite, [mags[id(s)] for s in spans]


def _report(kind: str, path: Path, n: int, nbytes: int, mismatches: list, non_finite: list, t0: float,
            outlier_list: list = (), reference: bool = True, blocked: str = "", accepted: bool = False,
            **extra) -> dict:
    """`reference`: something to compare with existed; `blocked`: why an existing index could not be used (ok is
    False until `rebless`); `accepted`: mismatches were re-blessed as the new reference."""
    damaged = bool(non_finite or outlier_list or (mismatches and not accepted))
    ok = not damaged and not blocked
    verdict = "damaged" if damaged else ("unverified" if blocked or not reference else "ok")
    return {"model": str(path), "kind": kind, "algorithm": CHECKSUM, "experts": n, "expert_bytes_checked": nbytes,
            **extra, "mismatches": len(mismatches), "mismatch_list": mismatches[:LIST_MAX],
            "non_finite": len(non_finite), "non_finite_list": non_finite[:LIST_MAX],
            "outliers": len(outlier_list), "outlier_list": list(outlier_list)[:LIST_MAX],
            "verdict": verdict, "ok": ok, "seconds": round(time.perf_counter() - t0, 3)}


def verdict_line(rep: dict) -> str:
    """One line for people (stderr): the verdict and why."""
    idx = rep.get("index", {})
    if rep["verdict"] == "damaged":
        parts = []
        if rep["mismatches"] and rep["verdict"] == "damaged":
            m = rep["mismatch_list"][0]
            parts.append(f"{rep['mismatches']} expert(s) differ from the checksum reference (first: {m['where']})")
        if rep["non_finite"]:
            parts.append(f"{rep['non_finite']} tensor(s) hold NaN/inf (first: {rep['non_finite_list'][0]['where']})")
        if rep["outliers"]:
            o = rep["outlier_list"][0]
            parts.append(f"{rep['outliers']} tensor(s) {o['ratio']:g}x larger than their siblings (first: "
                         f"{o['where']}: an exponent flip?)")
        return f"verify: DAMAGED: {'; '.join(parts)}; index {idx.get('after', 'unchanged')}"
    if rep["verdict"] == "unverified":
        why = idx.get("blocked") or "no checksum reference existed"
        return (f"verify: UNVERIFIED: {why}; finiteness and magnitude checks passed; index "
                f"{idx.get('after', 'unchanged')}")
    return (f"verify: OK: {rep['experts']} experts match the checksum reference, every weight finite, no "
            f"magnitude outliers" + (f"; index {idx['after']}" if idx.get("after", "unchanged") != "unchanged" else ""))


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
                   reference=meta.checksums is not None, store_version=meta.version,
                   checksums=meta.checksums is not None,
                   index={"path": str(path), "before": "table" if meta.checksums is not None else
                          "none (version 1 store: rewrite it to get checksums)", "after": "unchanged"})


def _group(name: str) -> str:
    """A tensor's sibling group: its name with every layer or expert number as `#`."""
    import re

    return re.sub(r"\.\d+(?=\.|$)", ".#", name)


def _check_tensors(fds: list[int], files: list[Path], tensors, path, non_finite: list, groups: dict,
                   floats_only: bool = False) -> None:
    """Each `(name, TensorInfo)` of a checkpoint read once: a non-finite one is listed in `non_finite`, the others'
    largest magnitude joins their sibling group in `groups` (for `outliers`; with `floats_only`, floating-point
    tensors only: a quantized checkpoint's packed integers are codes, not magnitudes)."""
    for name, info in tensors:
        raw = _pread(fds[info.file], info.start, info.nbytes, name)
        where = f"{name} in {files[info.file].name} of {path}"
        if not _finite(raw, info.dtype):
            non_finite.append({"tensor": name, "where": where})
        elif info.dtype.is_floating_point or not floats_only:
            groups.setdefault(_group(name), []).append((_max_abs(raw, info.dtype), {"tensor": name, "where": where}))


def verify_checkpoint(path: str | Path, write_index: bool = True, progress=None, rebless: bool = False) -> dict:
    """Every expert of a safetensors checkpoint against its checksum index, every weight finite and no tensor a
    magnitude outlier among its siblings. The index is written when there was none and nothing failed, or on
    `rebless` (the current bytes become the reference; non-finite weights and outliers are still refused); a
    changed file never rewrites it silently."""
    from expertcache.runtime.storage.loader import expert_source

    t0 = time.perf_counter()
    path = Path(path)
    src: CheckpointExperts = expert_source(path)
    stamps = src.file_stamps()  # before reading: a file changed during the pass is seen next time
    if write_index and not _beside(src, src.index_write_path()):  # the user cache's folder of indexes: before
        claim_dir(src.index_write_path().parent, "verify", resume=True, legacy=_index_folder)  # the pass, verify's
    read_from = src.index_path
    before, problem, expected, changed = "none", None, None, []
    try:
        index = src.read_index()
    except InputError as e:
        index, before, problem = None, "unreadable", str(e)
    if index is not None:
        expected, changed = src.indexed_checksums(index)
        before = "other layout" if expected is None else ("changed" if changed else "valid")
    n_layers, n_exp = len(src.prefixes), src.num_experts
    sums = [[0] * n_exp for _ in range(n_layers)]
    mismatches, non_finite, nbytes, compared = [], [], 0, 0
    groups: dict[str, list] = {}
    fds = [os.open(str(p), os.O_RDONLY) for p in src.files]
    try:
        for i in range(n_layers):
            for e in range(n_exp):
                spans = src.spans(i, e)
                where = src.where(i, e)
                got, finite, mags = _expert(fds, spans, where)
                for j, m in enumerate(mags):  # span j of every expert is the same tensor: siblings
                    groups.setdefault(f"expert part {j}", []).append(
                        (m, {"layer": i, "expert": e, "where": where}))
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
        others = [(n, info) for n, info in sorted(src.ckpt.tensors.items()) if n not in src.names]
        _check_tensors(fds, src.files, others, path, non_finite, groups)
    finally:
        for fd in fds:
            os.close(fd)
    outlier_list = outliers(groups)
    blocked = {"unreadable": "the checksum index is unreadable (the reference is lost)",
               "other layout": "the checksum index was made for another layout of this checkpoint"}.get(before, "")
    if blocked:
        blocked += "; `--rebless true` records the current bytes as the new reference"
    after = "unchanged"
    target = src.index_write_path()
    found = bool(mismatches or non_finite or outlier_list)
    if before in ("valid", "changed") and not rebless:
        if before == "changed" and not found and write_index:  # same bytes, new stamps (a copy, a touch)
            after = _write_index(src, target, stamps, sums, "stamps refreshed (the bytes match the reference)")
    elif not write_index:
        after = "not written (write_index=False)"
    elif non_finite or outlier_list:
        after = "not written (problems found: fix the checkpoint first)"
    elif before == "none" or rebless:
        after = _write_index(src, target, stamps, sums, "re-blessed: the current bytes are the reference"
                             if rebless and before != "none" else "written")
    else:
        after = "not written (" + blocked.split(";")[0] + ")"
    if mismatches and not rebless:
        after = "unchanged (it is the reference that shows the damage; `--rebless true` only if the change is yours)"
    index_info = {"path": str(read_from if before != "none" else target), "before": before, "after": after,
                  "changed_files": changed}
    if blocked and not rebless:
        index_info["blocked"] = blocked
    if problem:
        index_info["problem"] = problem
    return _report("checkpoint", path, n_layers * n_exp, nbytes, mismatches, non_finite, t0, outlier_list,
                   reference=expected is not None, blocked="" if rebless else blocked,
                   accepted=rebless and after.startswith("re-blessed"), checked_against_index=compared,
                   non_expert_tensors=len(others), index=index_info)


def _write_index(src: CheckpointExperts, target: Path, stamps: dict, sums: list, done: str) -> str:
    try:
        if not _beside(src, target):  # the user cache's folder of indexes: verify's alone
            own_dir(target.parent, "verify", legacy=_index_folder)
        write_json(target, {"format": INDEX_FORMAT, "version": INDEX_VERSION, "algorithm": CHECKSUM,
                            "layout_sha256": src.layout_sha256(), "files": stamps, "layers": src.prefixes,
                            "checkpoint": str(src.ckpt.dir.absolute()),
                            "experts": [[f"{x:016x}" for x in row] for row in sums]})
    except OSError as e:
        return f"not written ({target}: {e.strerror or e})"
    beside = target.parent == src.ckpt.dir.absolute()  # index_locations' paths are absolute (#46: a relative
    # --model wrote beside the checkpoint and said its folder was not writable)
    return done + ("" if beside else f" to {target} (the checkpoint's folder is not writable)")


def _beside(src: CheckpointExperts, target: Path) -> bool:
    """Whether the index goes beside the checkpoint (its own folder, however either path is spelled: `verify
    --model ck` gives a relative one) rather than into the user cache's folder of indexes."""
    return Path(target).parent.resolve() == Path(src.ckpt.dir).resolve()


def _index_folder(p: Path) -> bool:
    """The user cache's checksum indexes from before output markers: nothing but `NAME-KEY.json` files."""
    return all(f.is_file() and f.suffix == ".json" for f in p.iterdir())


def verify_quantized(path: Path, qc: dict, progress=None) -> dict:
    """An `expertcache quantize` checkpoint: every expert block of its store file(s) against the store's checksum
    table, every float tensor (the experts' fp16 scales and minimums, the non-expert weights) finite and no
    magnitude outlier among its siblings. Its stores carry their own reference: nothing is written."""
    from expertcache.runtime.storage.checkpoint import Checkpoint
    from expertcache.runtime.kernels.quant import open_source

    t0 = time.perf_counter()
    src = open_source(path, qc, verify=True)
    meta = src.meta
    stores = getattr(src, "stores", [meta])  # each format's tensors (a one-format checkpoint: the store's own)
    fmt = getattr(src, "format_index", lambda i, e: 0)
    mismatches, non_finite, nbytes, compared = [], [], 0, 0
    groups: dict[str, list] = {}
    fds: list[int] = []
    try:
        for p in src.files:
            fds.append(os.open(str(p), os.O_RDONLY))
        for i in range(meta.num_layers):
            for e in range(meta.num_experts):
                (span,) = src.spans(i, e)
                where = src.where(i, e)
                block = _pread(fds[span.file], span.offset, span.nbytes, where)
                nbytes += len(block)
                want = src.expected_checksum(i, e)
                if want is not None:
                    compared += 1
                    got = checksum(block)
                    if got != want:
                        mismatches.append({"layer": i, "expert": e, "where": where, "expected": f"{want:016x}",
                                           "got": f"{got:016x}"})
                k = fmt(i, e)
                bad = []
                for t in stores[k].tensors:
                    raw = block[t.offset:t.offset + t.nbytes]
                    if not _finite(raw, t.torch_dtype):
                        bad.append(t.name)
                    elif t.torch_dtype.is_floating_point:
                        groups.setdefault(f"format {k} {t.name}", []).append(
                            (_max_abs(raw, t.torch_dtype), {"layer": i, "expert": e, "where": where}))
                if bad:
                    non_finite.append({"layer": i, "expert": e, "where": where, "tensors": bad})
            if progress:
                progress()
    finally:
        for fd in fds:
            os.close(fd)
    ck = Checkpoint(path)
    fds = []
    try:
        for p in ck.files:
            fds.append(os.open(str(p), os.O_RDONLY))
        _check_tensors(fds, ck.files, sorted(ck.tensors.items()), path, non_finite, groups, floats_only=True)
    finally:
        for fd in fds:
            os.close(fd)
    return _report("quantized checkpoint", path, meta.num_layers * meta.num_experts, nbytes, mismatches, non_finite,
                   t0, outliers(groups), reference=compared > 0, checked_against_index=compared,
                   non_expert_tensors=len(ck.tensors),
                   index={"path": ", ".join(str(p) for p in src.files),
                          "before": "table" if compared else "none (stores without checksums: quantize again)",
                          "after": "unchanged"})


def verify(model: str | Path, *, write_index: bool = True, progress=None, rebless: bool = False) -> dict:
    """Check a checkpoint directory (safetensors, read in place) or a repacked store file: every routed expert
    against its checksum, every floating-point weight finite, no tensor a magnitude outlier among its siblings.
    Returns the report (`ok`: nothing failed; `verdict`: ok | unverified | damaged); `write_index`: record the
    checkpoint's first checksum index when it has none; `rebless`: record the current bytes as the reference
    in place of an index that disagrees, is unreadable or is for another layout. Unreadable input is an
    `InputError`; corruption is reported (ok False), not raised."""
    p = Path(model).expanduser()
    if p.is_file():
        return verify_store(p, progress)
    if p.is_dir():
        from expertcache.runtime.kernels.quant import read_config

        qc = read_config(p)
        if qc is not None:  # packed experts in store files, which carry their own checksum tables
            if rebless:
                raise InputError(f"{p} is a quantized checkpoint: its store files carry their own checksums, set "
                                 f"when it was written (there is no index to re-bless; quantize again)")
            return verify_quantized(p, qc, progress)
        return verify_checkpoint(p, write_index, progress, rebless)
    raise InputError(f"{p}: no such checkpoint directory or store file")


__all__ = ["verify", "verify_checkpoint", "verify_quantized", "verify_store", "CHECKSUM_INDEX"]


def check_written(folder, what: str) -> None:
    """A folder `quantize` or `import-gguf` wrote, before it is published: every float weight finite and no
    magnitude outlier among its siblings (`verify.verify`, no index written). The first problem is refused, naming
    the tensor."""
    rep = verify(folder, write_index=False)
    if rep["non_finite"]:
        x = rep["non_finite_list"][0]
        raise InputError(f"{_entry(x)} of the {what} output holds NaN/inf (from its input); nothing was published "
                         f"(--integrity off writes it anyway)")
    if rep["outliers"]:
        x = rep["outlier_list"][0]
        raise InputError(f"{_entry(x)} of the {what} output has max |w| {x['max_abs']:g}, {x['ratio']:g}x its "
                         f"siblings' {x['siblings_q25_max_abs']:g} (damaged input: an exponent flip?); nothing was "
                         f"published (--integrity off writes it anyway)")


def _entry(x: dict) -> str:
    """A verify report entry as the tensor it names."""
    if "tensor" in x:
        return f"tensor {x['tensor']}"
    at = f"MoE layer {x['layer']} expert {x['expert']}"
    if x.get("tensors"):
        return f"{at} {', '.join(x['tensors'])}"
    return f"{at} ({x['group']})" if "group" in x else at
