"""A trace's routing as arrays (`load_routing`): the one reader that the simulator, the replay, the learned policy
and the predictors' fits use, over a Parquet trace or a llama-moe-trace `.npz`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import InputError
from .llamacpp import read_npz
from .parquet_trace import read_trace
from .rows import check_rows


@dataclass
class Routing:
    """A trace's routing as arrays: what the simulator, the replay and the learned policy read."""
    ids: np.ndarray  # [layers, tokens, k] int64, token order
    probs: np.ndarray | None  # router probabilities of those ids [layers, tokens, k] (float64), None if not recorded
    num_experts: int
    meta: dict  # model, num_experts, top_k, num_layers (and the rest of the trace's metadata)


def load_routing(path: str | Path, phase: str | None = "decode") -> Routing:
    """The one trace reader for routing arrays: a Parquet trace (its `phase` tokens, or every token if it has
    none) or a llama-moe-trace `.npz` (which has no probabilities). Rows are checked: distinct experts below E."""
    path = Path(path)
    if path.suffix == ".npz":
        ids, meta = read_npz(path)
        e = meta.get("num_experts")
        if not isinstance(e, int) or e < 1:
            raise InputError(f"{path}: its meta has no num_experts (re-export it with the count of experts per "
                             f"layer, or import it with `expertcache trace import --num_experts N`)")
        ids = ids.astype(np.int64)
        meta = {**meta, "model": meta.get("model", path.stem), "num_experts": int(e), "top_k": int(ids.shape[2]),
                "num_layers": int(ids.shape[0])}
        probs = None
    else:
        tr = read_trace(path)
        if phase and phase in set(tr.table["phase"].to_pylist()):
            tr = tr.filter(phase=phase)
        if tr.num_rows == 0:
            raise InputError(f"trace {path} has no rows")
        order = tr._token_order()
        ids = tr.layer_matrix("ids", order).astype(np.int64)
        w = tr.layer_matrix("weights", order).astype(np.float64)
        probs = None if np.isnan(w).any() else w
        e = int(tr.meta.num_experts)
        meta = {**tr.meta.__dict__, "num_experts": e, "top_k": int(tr.meta.top_k), "num_layers": int(ids.shape[0])}
    check_rows(ids, int(e), str(path))
    return Routing(ids, probs, int(e), meta)
