"""The routing trace: one Parquet row per (sequence, token position, MoE layer).

Columns (plain Arrow types, so pandas, polars and duckdb read a trace without this package):
    seq_id int32, pos int32, layer int16 (decoder layer index), phase string ("prefill" | "decode"),
    domain string, token int32 (the input token id at `pos`),
    ids fixed_size_list<int16>[k], weights fixed_size_list<float16>[k],
    logits fixed_size_list<float16>[E]   (optional), hidden fixed_size_list<float16>[H]  (optional)
File metadata key `expertcache` holds a JSON object: model id, family, num_layers, moe_layers, num_experts,
top_k, hidden_size, dtype, tokenizer, corpus, split, format version.

Rows are written a row group at a time; `TraceWriter` closes the file (footer included) on Ctrl-C or SIGTERM,
so an interrupted recording leaves a valid file holding every finished row group.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import InputError

FORMAT_VERSION = 1
META_KEY = b"expertcache"
PHASES = ("prefill", "decode")


@dataclass
class TraceMeta:
    model: str
    family: str
    num_layers: int
    moe_layers: list[int]
    num_experts: int
    top_k: int
    hidden_size: int = 0
    dtype: str = "float32"
    tokenizer: str = ""
    corpus: str = ""
    split: str = ""
    source: str = "expertcache.telemetry.recorder"
    extra: dict = field(default_factory=dict)
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, s: str | bytes) -> "TraceMeta":
        d = json.loads(s)
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


def schema(meta: TraceMeta, with_logits: bool, with_hidden: bool) -> pa.Schema:
    k = meta.top_k
    fields = [pa.field("seq_id", pa.int32()), pa.field("pos", pa.int32()), pa.field("layer", pa.int16()),
              pa.field("phase", pa.string()), pa.field("domain", pa.string()), pa.field("token", pa.int32()),
              pa.field("ids", pa.list_(pa.int16(), k)), pa.field("weights", pa.list_(pa.float16(), k))]
    if with_logits:
        fields.append(pa.field("logits", pa.list_(pa.float16(), meta.num_experts)))
    if with_hidden:
        fields.append(pa.field("hidden", pa.list_(pa.float16(), meta.hidden_size)))
    return pa.schema(fields, metadata={META_KEY: meta.to_json().encode()})


def _fixed(values: np.ndarray, width: int, dtype) -> pa.FixedSizeListArray:
    flat = np.ascontiguousarray(values, dtype=dtype).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), width)


class TraceWriter:
    """Append batches of rows as row groups. Use as a context manager; SIGTERM is turned into KeyboardInterrupt
    while it is open, so the footer is written on either signal."""

    def __init__(self, path: str | Path, meta: TraceMeta, with_logits: bool = False, with_hidden: bool = False):
        self.path, self.meta = Path(path), meta
        self.with_logits, self.with_hidden = with_logits, with_hidden
        self.schema = schema(meta, with_logits, with_hidden)
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._old_term = None

    def __enter__(self) -> "TraceWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(str(self.path), self.schema, compression="zstd")
        try:
            self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        except ValueError:  # not the main thread: no signal handling
            self._old_term = None
        return self

    def write(self, seq_id, pos, layer, phase, domain, token, ids, weights, logits=None, hidden=None) -> None:
        """One row group. Per-row arrays of equal length n; ids/weights [n, k]; logits [n, E]; hidden [n, H]."""
        n = len(seq_id)
        k, e, h = self.meta.top_k, self.meta.num_experts, self.meta.hidden_size
        if ids.shape != (n, k):
            raise InputError(f"ids have shape {ids.shape}, expected ({n}, {k})")
        cols = [pa.array(np.asarray(seq_id, np.int32)), pa.array(np.asarray(pos, np.int32)),
                pa.array(np.asarray(layer, np.int16)), _strings(phase, n), _strings(domain, n),
                pa.array(np.asarray(token, np.int32)), _fixed(ids, k, np.int16), _fixed(weights, k, np.float16)]
        if self.with_logits:
            cols.append(_fixed(logits, e, np.float16))
        if self.with_hidden:
            cols.append(_fixed(hidden, h, np.float16))
        self._writer.write_table(pa.Table.from_arrays(cols, schema=self.schema))
        self.rows += n

    def __exit__(self, *exc) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _strings(v, n: int) -> pa.Array:
    if isinstance(v, str):
        return pa.array([v] * n, pa.string())
    return pa.array(list(v), pa.string())


# --- reading -----------------------------------------------------------------------------------------------

@dataclass
class Trace:
    meta: TraceMeta
    table: pa.Table
    path: str = ""

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    def filter(self, phase: str | None = None, domain: str | None = None) -> "Trace":
        import pyarrow.compute as pc

        t = self.table
        if phase is not None:
            t = t.filter(pc.equal(t["phase"], phase))
        if domain is not None:
            t = t.filter(pc.equal(t["domain"], domain))
        return Trace(self.meta, t, self.path)

    def column(self, name: str) -> np.ndarray:
        return self.table[name].to_numpy()

    def fixed(self, name: str) -> np.ndarray:
        """A fixed-size-list column as a 2-D array [rows, width]."""
        col = self.table[name].combine_chunks()
        width = col.type.list_size
        return col.values.to_numpy(zero_copy_only=False).reshape(-1, width)

    def _token_order(self) -> tuple[np.ndarray, int]:
        """Row order by (seq_id, pos, layer) and the number of MoE layers; every layer must hold the same tokens."""
        layer = self.column("layer")
        n_layers = len(set(layer.tolist()))
        order = np.lexsort((layer, self.column("pos"), self.column("seq_id")))
        if len(order) % n_layers:
            raise InputError(f"trace {self.path}: {len(order)} rows do not divide into {n_layers} layers")
        return order, n_layers

    def routing(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Experts per MoE layer in token order: (ids [layers, tokens, k], seq_id [tokens], pos [tokens])."""
        order, n_layers = self._token_order()
        tokens_first = order[::n_layers]
        return self.layer_matrix("ids", (order, n_layers)), self.column("seq_id")[tokens_first], \
            self.column("pos")[tokens_first]

    def layer_matrix(self, name: str, token_order: tuple[np.ndarray, int] | None = None) -> np.ndarray:
        """A per-row fixed column (`ids`, `hidden`, `logits`) as [layers, tokens, width] in `routing()` order."""
        order, n_layers = token_order or self._token_order()
        vals = self.fixed(name)[order]
        return np.ascontiguousarray(vals.reshape(-1, n_layers, vals.shape[1]).transpose(1, 0, 2))

    def domains(self) -> list[str]:
        return sorted(set(self.table["domain"].to_pylist()))


def read_meta(path: str | Path) -> TraceMeta:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"trace {path} not found")
    try:
        md = pq.read_schema(str(path)).metadata or {}
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path} is not a readable Parquet trace ({e})") from e
    if META_KEY not in md:
        raise InputError(f"{path} is Parquet but has no expertcache trace metadata")
    return TraceMeta.from_json(md[META_KEY])


def read_trace(path: str | Path, columns: list[str] | None = None) -> Trace:
    meta = read_meta(path)
    table = pq.read_table(str(path), columns=columns)
    return Trace(meta, table, str(path))


def check_compatible(meta: TraceMeta, model_or_config) -> None:
    """A trace used with a model must match its layers, experts and top-k."""
    from .adapters import adapter_for

    a = adapter_for(model_or_config)
    if meta.num_experts != a.num_experts:
        raise InputError(f"trace has {meta.num_experts} experts per layer, model has {a.num_experts}")
    if meta.top_k != a.top_k:
        raise InputError(f"trace has top-{meta.top_k} routing, model has top-{a.top_k}")
    if meta.num_layers != a.num_layers:
        raise InputError(f"trace has {meta.num_layers} layers, model has {a.num_layers}")


def info(path: str | Path) -> dict:
    """Metadata and counts without loading the heavy columns."""
    meta = read_meta(path)
    f = pq.ParquetFile(str(path))
    t = pq.read_table(str(path), columns=["seq_id", "layer", "phase", "domain"])
    import pyarrow.compute as pc

    phases = {p: int(pc.sum(pc.equal(t["phase"], p)).as_py() or 0) // max(1, len(meta.moe_layers)) for p in PHASES}
    doms = {}
    for d in sorted(set(t["domain"].to_pylist())):
        doms[d] = int(pc.sum(pc.equal(t["domain"], d)).as_py()) // max(1, len(meta.moe_layers))
    return {"path": str(path), "meta": meta.__dict__, "rows": f.metadata.num_rows,
            "row_groups": f.metadata.num_row_groups, "columns": f.schema_arrow.names,
            "sequences": len(set(t["seq_id"].to_pylist())), "tokens_by_phase": phases, "tokens_by_domain": doms}
