"""Import routing recorded by llama.cpp's `llama-moe-trace` eval callback into our Parquet trace.

Two inputs:
- the binary stream: repeated little-endian records `int32 layer, int32 n_tokens, int32 k`, then
  `n_tokens * k` int32 expert ids; one record per MoE layer per decoded chunk, chunks in order;
- its NumPy form: `.npz` with `experts` int16 `[layers, tokens, k]` and `meta`, a JSON string with `num_experts`.
Every analysis then runs on the imported trace. Gate weights are not in either form: the `weights` column is NaN.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import numpy as np

from .errors import InputError
from .parquet_trace import TraceMeta, TraceWriter
from .rows import check_distinct

_HEADER = struct.Struct("<iii")
MAX_LAYERS = 1 << 15


def read_stream(path: str | Path) -> tuple[np.ndarray, list[int]]:
    """The binary stream as (`[layers, tokens, k]` int32 ids, as recorded: the range is checked on import, the
    layer indices in order)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"llama-moe-trace stream {path} not found")
    data = path.read_bytes()
    per_layer: dict[int, list[np.ndarray]] = {}
    off, k_seen = 0, None
    while off < len(data):
        if off + _HEADER.size > len(data):
            raise InputError(f"{path}: truncated record header at byte {off} of {len(data)}")
        layer, n, k = _HEADER.unpack_from(data, off)
        off += _HEADER.size
        if layer < 0 or layer >= MAX_LAYERS or n < 0 or k <= 0 or k > 1024:
            raise InputError(f"{path}: bad record at byte {off - _HEADER.size}: layer={layer} n_tokens={n} k={k}")
        if k_seen is not None and k != k_seen:
            raise InputError(f"{path}: record at byte {off - _HEADER.size} has k={k}, earlier records k={k_seen}")
        k_seen = k
        size = n * k * 4
        if off + size > len(data):
            raise InputError(f"{path}: truncated record at byte {off - _HEADER.size}: needs {size} bytes of ids, "
                             f"{len(data) - off} left")
        ids = np.frombuffer(data, dtype="<i4", count=n * k, offset=off).reshape(n, k)
        per_layer.setdefault(layer, []).append(ids)
        off += size
    if not per_layer:
        raise InputError(f"{path}: no records")
    for i, mats in per_layer.items():
        for m in mats:
            check_distinct(m, f"{path} (layer {i})")
    layers = sorted(per_layer)
    mats = [np.concatenate(per_layer[i]) for i in layers]
    counts = {i: len(m) for i, m in zip(layers, mats)}
    if len(set(counts.values())) != 1:
        raise InputError(f"{path}: layers hold different token counts {dict(list(counts.items())[:8])}")
    return np.stack(mats), layers


def read_npz(path: str | Path) -> tuple[np.ndarray, dict]:
    """`(experts [layers, tokens, k] as stored (integers), meta)`; nothing unpickled."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"NumPy trace {path} not found")
    try:
        with np.load(path, allow_pickle=False) as z:
            files = list(z.files)
            if "experts" not in files:
                raise InputError(f"{path}: no 'experts' array (has {files[:8]})")
            experts = z["experts"]
            raw_meta = z["meta"] if "meta" in files else None
    except InputError:
        raise
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError,
            RuntimeError, MemoryError, UnicodeDecodeError, TypeError) as e:
        raise InputError(f"{path}: not a readable .npz trace ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:100]})") from None
    meta = {}
    if raw_meta is not None:
        if raw_meta.dtype.kind not in "US" or raw_meta.ndim != 0:
            raise InputError(f"{path}: 'meta' must be one JSON string, got a {raw_meta.dtype} array of shape "
                             f"{raw_meta.shape}")
        try:
            meta = json.loads(str(raw_meta))
        except (ValueError, RecursionError) as e:
            raise InputError(f"{path}: 'meta' is not JSON ({str(e)[:80]})") from None
        if not isinstance(meta, dict):
            raise InputError(f"{path}: 'meta' must be a JSON object, got {type(meta).__name__}")
    if experts.ndim != 3:
        raise InputError(f"{path}: 'experts' must be [layers, tokens, k], got shape {experts.shape}")
    if experts.dtype.kind not in "iu":
        raise InputError(f"{path}: 'experts' must hold integer expert ids, got {experts.dtype}")
    if experts.size and int(experts.min()) < 0:
        raise InputError(f"{path}: expert id {int(experts.min())} is negative")
    e = meta.get("num_experts")
    if experts.size and isinstance(e, int) and not isinstance(e, bool) and int(experts.max()) >= e:
        raise InputError(f"{path}: expert ids span [{int(experts.min())}, {int(experts.max())}], outside 0..{e - 1} "
                         f"(meta num_experts={e})")
    check_distinct(experts, str(path))
    return experts, meta


def import_trace(src: str | Path, out: str | Path, num_experts: int | None = None, domain: str = "",
                 model: str = "", rows_per_group: int = 65536) -> dict:
    """Write `src` (.npz or binary stream) as an expertcache Parquet trace. One sequence, decode phase."""
    src = Path(src)
    if src.suffix == ".npz":
        experts, meta = read_npz(src)
        layers = list(range(experts.shape[0]))
        num_experts = num_experts or meta.get("num_experts")
        model = model or meta.get("model", "")
        extra = {"imported_from": str(src), "source_meta": meta}
    else:
        experts, layers = read_stream(src)
        extra = {"imported_from": str(src)}
    n_layers, n_tok, k = experts.shape
    if not n_layers or not n_tok or not k:
        raise InputError(f"{src}: no routing to import (experts of shape {list(experts.shape)})")
    if n_layers > MAX_LAYERS or k > 1024:
        raise InputError(f"{src}: {n_layers} layers of top-{k} routing is not a MoE trace")
    seen_max = int(experts.max()) + 1
    if num_experts is None:
        raise InputError(f"{src}: the number of experts per layer is not recorded; pass --num_experts "
                         f"(ids seen go up to {seen_max - 1})")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise InputError(f"{src}: num_experts = {str(num_experts)[:40]!r}, expected a positive integer")
    if seen_max > num_experts or int(experts.min()) < 0:
        raise InputError(f"{src}: expert ids span [{int(experts.min())}, {seen_max - 1}], outside 0..{num_experts - 1}")
    if not isinstance(model, str):
        model = str(model)
    meta = TraceMeta(model=model or src.stem, family="llama.cpp", num_layers=n_layers, moe_layers=layers,
                     num_experts=int(num_experts), top_k=k, source="llama-moe-trace", extra=extra)
    tokens_per_group = max(1, rows_per_group // n_layers)
    with TraceWriter(out, meta, inputs=(src,)) as w:
        for t0 in range(0, n_tok, tokens_per_group):
            t1 = min(n_tok, t0 + tokens_per_group)
            nt = t1 - t0
            ids = experts[:, t0:t1].transpose(1, 0, 2).reshape(nt * n_layers, k)  # rows by (pos, layer)
            w.write(seq_id=np.zeros(nt * n_layers, np.int32), pos=np.repeat(np.arange(t0, t1, dtype=np.int32), n_layers),
                    layer=np.tile(np.asarray(layers, np.int16), nt), phase="decode", domain=domain,
                    token=np.full(nt * n_layers, -1, np.int32), ids=ids,
                    weights=np.full((nt * n_layers, k), np.nan, np.float16))
        rows = w.rows
    return {"trace": str(out), "layers": n_layers, "tokens": n_tok, "top_k": k, "num_experts": int(num_experts),
            "rows": rows}
