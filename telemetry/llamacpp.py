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
from pathlib import Path

import numpy as np

from .errors import InputError
from .parquet_trace import TraceMeta, TraceWriter

_HEADER = struct.Struct("<iii")


def read_stream(path: str | Path) -> tuple[np.ndarray, list[int]]:
    """The binary stream as (`[layers, tokens, k]` int16, the layer indices in order)."""
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
        if layer < 0 or n < 0 or k <= 0 or k > 1024:
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
    layers = sorted(per_layer)
    mats = [np.concatenate(per_layer[i]) for i in layers]
    counts = {i: len(m) for i, m in zip(layers, mats)}
    if len(set(counts.values())) != 1:
        raise InputError(f"{path}: layers hold different token counts {counts}")
    return np.stack(mats).astype(np.int16), layers


def read_npz(path: str | Path) -> tuple[np.ndarray, dict]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"NumPy trace {path} not found")
    with np.load(path, allow_pickle=False) as z:
        if "experts" not in z.files:
            raise InputError(f"{path}: no 'experts' array (has {z.files})")
        experts = z["experts"]
        meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
    if experts.ndim != 3:
        raise InputError(f"{path}: 'experts' must be [layers, tokens, k], got shape {experts.shape}")
    return experts.astype(np.int16), meta


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
    seen_max = int(experts.max()) + 1
    if num_experts is None:
        raise InputError(f"{src}: the number of experts per layer is not recorded; pass --num-experts "
                         f"(ids seen go up to {seen_max - 1})")
    if seen_max > num_experts or int(experts.min()) < 0:
        raise InputError(f"{src}: expert ids span [{int(experts.min())}, {seen_max - 1}], outside 0..{num_experts - 1}")
    meta = TraceMeta(model=model or src.stem, family="llama.cpp", num_layers=n_layers, moe_layers=layers,
                     num_experts=int(num_experts), top_k=k, source="llama-moe-trace", extra=extra)
    tokens_per_group = max(1, rows_per_group // n_layers)
    with TraceWriter(out, meta) as w:
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
