"""The routing trace: one Parquet row per (sequence, token position, MoE layer).

Columns (plain Arrow types, so pandas, polars and duckdb read a trace without this package):
    seq_id int32, pos int32, layer int16 (decoder layer index), phase string ("prefill" | "decode"),
    domain string, token int32 (the input token id at `pos`),
    ids fixed_size_list<int16>[k], weights fixed_size_list<float16>[k],
    logits fixed_size_list<float16>[E]   (optional), hidden fixed_size_list<float16>[H]  (optional)
File metadata key `expertcache` holds a JSON object: model id, family, num_layers, moe_layers, num_experts,
top_k, hidden_size, dtype, tokenizer, corpus, split, format version. Key `expertcache_status` (written into the
footer when the file is closed) says whether the trace is complete: `{"partial": false}` on a clean close,
`{"partial": true, "reason": ...}` when the recording stopped on an exception (Ctrl-C, SIGTERM, an error);
`read_meta(...).partial` exposes it (None for traces written before the key existed).

Rows are written a row group at a time, to a temporary name beside the target; `TraceWriter` closes the file
(footer included) on Ctrl-C or SIGTERM, so an interrupted recording leaves a valid file holding every finished
row group, marked partial, under its own name (`t.partial.parquet`, `partial_path`): only a complete recording
is renamed onto the target, so an interrupted one never replaces a complete trace, and a run that fails before
its first row group leaves nothing. Expert ids outside [0, num_experts) and rows that repeat an expert are
refused when written and when read.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import InputError
from .rows import check_distinct

FORMAT_VERSION = 1
META_KEY = b"expertcache"
STATUS_KEY = b"expertcache_status"
PHASES = ("prefill", "decode")
COLUMNS = ("seq_id", "pos", "layer", "phase", "domain", "token", "ids", "weights")
MAX_EXPERTS = 1 << 15  # ids are stored as int16


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
    partial: bool | None = None  # from the footer's status key when read (None: written before it existed)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if k != "partial"})

    def check(self, where: str = "trace") -> "TraceMeta":
        """Every field of the type and range a trace needs; an `InputError` naming the first that is not."""
        def bad(name, want):
            raise InputError(f"{where}: metadata {name} = {str(getattr(self, name))[:80]!r}, expected {want}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)
        for name in ("model", "family", "dtype", "tokenizer", "corpus", "split", "source"):
            if not isinstance(getattr(self, name), str):
                bad(name, "a string")
        if not is_int(self.num_experts) or not 1 <= self.num_experts <= MAX_EXPERTS:
            bad("num_experts", f"an integer in 1..{MAX_EXPERTS}")
        if not is_int(self.top_k) or not 1 <= self.top_k <= self.num_experts:
            bad("top_k", f"an integer in 1..num_experts ({self.num_experts})")
        if not is_int(self.num_layers) or self.num_layers < 1:
            bad("num_layers", "an integer >= 1")
        if (not isinstance(self.moe_layers, list) or not self.moe_layers
                or not all(is_int(x) and 0 <= x < MAX_EXPERTS for x in self.moe_layers)
                or len(set(self.moe_layers)) != len(self.moe_layers)):
            bad("moe_layers", "a non-empty list of distinct layer indices")
        if len(self.moe_layers) > self.num_layers:
            bad("num_layers", f"at least the {len(self.moe_layers)} MoE layers of moe_layers")
        if not is_int(self.hidden_size) or not 0 <= self.hidden_size < 1 << 24:
            bad("hidden_size", "an integer >= 0")
        if not isinstance(self.extra, dict):
            bad("extra", "an object")
        if not is_int(self.version) or self.version > FORMAT_VERSION or self.version < 1:
            bad("version", f"a trace format this build reads (1..{FORMAT_VERSION})")
        return self

    @classmethod
    def from_json(cls, s: str | bytes, where: str = "trace") -> "TraceMeta":
        try:
            d = json.loads(s)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise InputError(f"{where}: unreadable trace metadata ({str(e).splitlines()[0][:80]})") from None
        if not isinstance(d, dict):
            raise InputError(f"{where}: trace metadata is not a JSON object")
        missing = [k for k in ("model", "family", "num_layers", "moe_layers", "num_experts", "top_k") if k not in d]
        if missing:
            raise InputError(f"{where}: trace metadata lacks {', '.join(missing)}")
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "partial"}
        return cls(**known).check(where)


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


def _same_file(a: Path, b: str | Path) -> bool:
    try:
        return a.resolve() == Path(b).resolve() or (a.exists() and Path(b).exists() and a.samefile(b))
    except OSError:
        return False


class TraceWriter:
    """Append batches of rows as row groups. Use as a context manager; SIGTERM is turned into KeyboardInterrupt
    while it is open, so the footer is written on either signal. Rows go to a temporary name beside `path`,
    renamed into place on close (complete). An interrupted or failed recording never replaces `path` (a complete
    trace there stays as it was): when at least one row group was written, it is kept under its own name,
    `partial_path(path)` (`t.partial.parquet`), marked partial in its footer; otherwise the temporary file is
    removed. `inputs`: the files the trace is made from; `path` may not be one of them."""

    def __init__(self, path: str | Path, meta: TraceMeta, with_logits: bool = False, with_hidden: bool = False,
                 inputs=()):
        self.path, self.meta = Path(path), meta.check(f"trace {path}")
        for src in inputs:
            if src and _same_file(self.path, src):
                raise InputError(f"output {self.path} is also an input ({src}); write the trace to another file")
        self.with_logits, self.with_hidden = with_logits, with_hidden
        self.schema = schema(meta, with_logits, with_hidden)
        self.rows = 0
        self.row_groups = 0
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._writer: pq.ParquetWriter | None = None
        self._old_term = None

    def __enter__(self) -> "TraceWriter":
        if self.path.is_dir():
            raise InputError(f"output {self.path} is a directory; expected a .parquet file name")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # page checksums (CRC32 per data page): a flipped byte in any column is found when the page is read
        self._writer = pq.ParquetWriter(str(self.tmp), self.schema, compression="zstd", write_page_checksum=True)
        try:
            self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        except ValueError:  # not the main thread: no signal handling
            self._old_term = None
        return self

    def write(self, seq_id, pos, layer, phase, domain, token, ids, weights, logits=None, hidden=None) -> None:
        """One row group. Per-row arrays of equal length n; ids/weights [n, k]; logits [n, E]; hidden [n, H]."""
        n = len(seq_id)
        k, e, h = self.meta.top_k, self.meta.num_experts, self.meta.hidden_size
        ids = np.asarray(ids)
        if ids.shape != (n, k):
            raise InputError(f"ids have shape {ids.shape}, expected ({n}, {k})")
        if n and ids.dtype.kind not in "iu":
            raise InputError(f"expert ids are {ids.dtype}, expected integers")
        if n and (int(ids.min()) < 0 or int(ids.max()) >= e):
            raise InputError(f"expert ids span [{int(ids.min())}, {int(ids.max())}], outside [0, {e}) "
                             f"(num_experts={e}); refusing to store them (int16 would wrap)")
        check_distinct(ids, f"trace {self.path}")
        if np.shape(weights) != (n, k):
            raise InputError(f"weights have shape {np.shape(weights)}, expected ({n}, {k})")
        cols = [pa.array(np.asarray(seq_id, np.int32)), pa.array(np.asarray(pos, np.int32)),
                pa.array(np.asarray(layer, np.int16)), _strings(phase, n), _strings(domain, n),
                pa.array(np.asarray(token, np.int32)), _fixed(ids, k, np.int16), _fixed(weights, k, np.float16)]
        if self.with_logits:
            cols.append(_fixed(logits, e, np.float16))
        if self.with_hidden:
            cols.append(_fixed(hidden, h, np.float16))
        self._writer.write_table(pa.Table.from_arrays(cols, schema=self.schema))
        self.rows += n
        self.row_groups += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._writer is not None:
                status = {"partial": exc_type is not None, "rows": self.rows, "row_groups": self.row_groups}
                if exc_type is not None:
                    status["reason"] = f"{exc_type.__name__}: {exc}"[:200]
                keep = exc_type is None or self.rows > 0
                if keep:
                    self._writer.add_key_value_metadata({STATUS_KEY.decode(): json.dumps(status)})
                self._writer.close()
                self._writer = None
                if exc_type is None:
                    self.tmp.replace(self.path)
                elif keep:
                    part = partial_path(self.path)
                    self.tmp.replace(part)
                    print(f"trace: stopped after {self.rows} rows ({status['reason']}); the partial trace is kept "
                          f"as {part}" + (f", {self.path} is left as it was" if self.path.exists() else ""),
                          file=sys.stderr)
        finally:
            if self.tmp.exists():
                self.tmp.unlink()
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)
                self._old_term = None


def partial_path(path: str | Path) -> Path:
    """Where an interrupted recording of `path` is kept: `t.parquet` -> `t.partial.parquet`."""
    path = Path(path)
    return path.with_name(f"{path.stem}.partial{path.suffix or '.parquet'}")


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


def _unreadable(path, e: Exception) -> InputError:
    return InputError(f"{path} is not a readable Parquet trace ({type(e).__name__}: "
                      f"{(str(e).splitlines() or [''])[0][:120]})")


def read_meta(path: str | Path) -> TraceMeta:
    """The trace's metadata, checked, with `partial` from the footer's status (True: the recording stopped early)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"trace {path} not found")
    try:
        md = pq.read_metadata(str(path)).metadata or {}
    except (pa.ArrowException, OSError, ValueError, MemoryError) as e:
        raise _unreadable(path, e) from None
    if META_KEY not in md:
        raise InputError(f"{path} is Parquet but has no expertcache trace metadata")
    meta = TraceMeta.from_json(md[META_KEY], f"trace {path}")
    if STATUS_KEY in md:
        try:
            st = json.loads(md[STATUS_KEY])
        except (ValueError, UnicodeDecodeError, RecursionError):
            st = None
        if not isinstance(st, dict) or not isinstance(st.get("partial"), bool):
            raise InputError(f"trace {path}: unreadable status {md[STATUS_KEY][:80]!r}")
        meta.partial = st["partial"]
    return meta


def _check_table(path, meta: TraceMeta, table: pa.Table, columns) -> None:
    """The columns a trace has, of the types it writes; ids in [0, num_experts); layers among moe_layers."""
    import pyarrow.compute as pc

    want = COLUMNS if columns is None else columns
    missing = [c for c in want if c not in table.column_names]
    if missing:
        raise InputError(f"trace {path} lacks column(s) {', '.join(missing)}")
    types = {"seq_id": pa.int32(), "pos": pa.int32(), "layer": pa.int16(), "phase": pa.string(),
             "domain": pa.string(), "token": pa.int32(), "ids": pa.list_(pa.int16(), meta.top_k),
             "weights": pa.list_(pa.float16(), meta.top_k),
             "logits": pa.list_(pa.float16(), meta.num_experts), "hidden": pa.list_(pa.float16(), meta.hidden_size)}
    for c in table.column_names:
        if c in types and table.schema.field(c).type != types[c]:
            raise InputError(f"trace {path}: column {c} is {table.schema.field(c).type}, expected {types[c]}")
    for c in ("seq_id", "pos", "layer", "ids"):
        if c in table.column_names and table[c].null_count:
            raise InputError(f"trace {path}: column {c} has {table[c].null_count} nulls")
    if "ids" in table.column_names and table.num_rows:
        flat = pc.list_flatten(table["ids"])
        if flat.null_count:
            raise InputError(f"trace {path}: expert ids have nulls")
        mm = pc.min_max(flat).as_py()
        if mm["min"] is not None and (mm["min"] < 0 or mm["max"] >= meta.num_experts):
            bad = mm["max"] if mm["max"] >= meta.num_experts else mm["min"]
            raise InputError(f"trace {path}: expert id {bad} outside [0, {meta.num_experts}) "
                             f"(num_experts={meta.num_experts})")
        check_distinct(flat.to_numpy(zero_copy_only=False).reshape(-1, meta.top_k), f"trace {path}")
    if "layer" in table.column_names and table.num_rows:
        held = set(pc.unique(table["layer"]).to_pylist())
        seen = held - set(meta.moe_layers)
        if seen:
            raise InputError(f"trace {path}: rows of layer(s) {sorted(seen)[:8]} not among its MoE layers "
                             f"{meta.moe_layers[:16]}")
        if columns is None and held != set(meta.moe_layers):  # the metadata disagrees with the data
            missing = sorted(set(meta.moe_layers) - held)
            raise InputError(f"trace {path}: its metadata names MoE layers {meta.moe_layers[:16]}, but no row holds "
                             f"layer(s) {missing[:8]}")


def read_trace(path: str | Path, columns: list[str] | None = None) -> Trace:
    """A trace, checked: its metadata, columns and types, expert ids in [0, num_experts). An `InputError` for
    anything that is not a readable trace."""
    meta = read_meta(path)
    try:
        table = pq.read_table(str(path), columns=columns, page_checksum_verification=True)
    except (pa.ArrowException, OSError, ValueError, KeyError, MemoryError) as e:
        raise _unreadable(path, e) from None
    _check_table(path, meta, table, columns)
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
    """Metadata and counts (`partial` True when the recording stopped early), every data page read once against
    its checksum (traces written before page checksums: decoded, not checksummed)."""
    meta = read_meta(path)
    f = pq.ParquetFile(str(path), page_checksum_verification=True)
    try:  # every page of every column once, one column at a time: damaged data is found here, not later
        for name in f.schema_arrow.names:
            f.read(columns=[name])
    except (pa.ArrowException, OSError, ValueError, MemoryError) as e:
        raise _unreadable(path, e) from None
    t = read_trace(path, columns=["seq_id", "layer", "phase", "domain"]).table
    import pyarrow.compute as pc

    phases = {p: int(pc.sum(pc.equal(t["phase"], p)).as_py() or 0) // max(1, len(meta.moe_layers)) for p in PHASES}
    doms = {}
    for d in sorted(set(t["domain"].to_pylist())):
        doms[d] = int(pc.sum(pc.equal(t["domain"], d)).as_py()) // max(1, len(meta.moe_layers))
    return {"path": str(path), "meta": meta.__dict__, "partial": meta.partial, "rows": f.metadata.num_rows,
            "row_groups": f.metadata.num_row_groups, "columns": f.schema_arrow.names,
            "sequences": len(set(t["seq_id"].to_pylist())), "tokens_by_phase": phases, "tokens_by_domain": doms}
