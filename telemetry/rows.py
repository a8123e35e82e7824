"""Routing rows as they enter: every row names k distinct experts in [0, E). Checked wherever a trace enters
(import, write, read, the simulator), before anything counts a row."""

from __future__ import annotations

import numpy as np

from .errors import InputError


def check_distinct(ids, where: str) -> None:
    """Every routing row names k distinct experts (a router's top-k never picks one twice): a row like [3, 3, 5, 7]
    is refused where a trace enters (import, write, read), before any analysis or fit counts it."""
    ids = np.asarray(ids)
    if ids.ndim < 2 or ids.size == 0 or ids.shape[-1] < 2:
        return
    rows = ids.reshape(-1, ids.shape[-1])
    s = np.sort(rows, axis=1)
    dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
    if dup.any():
        i = int(np.argmax(dup))
        at = ", ".join(f"{n} {int(v)}" for n, v in zip(("layer", "token") if ids.ndim == 3 else ("row",),
                                                          np.unravel_index(i, ids.shape[:-1])))
        raise InputError(f"{where}: the routing of {at} repeats an expert ({rows[i].tolist()[:16]}); each row's "
                         f"top-{ids.shape[-1]} experts must be distinct ({int(dup.sum())} such row(s))")


def check_rows(ids: np.ndarray, num_experts: int | None = None, what: str = "steps") -> None:
    """Routing rows (`[..., k]`) hold distinct experts in [0, E): else one InputError naming the first bad row."""
    if not ids.size:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (num_experts is not None and hi >= num_experts):
        raise InputError(f"{what}: expert id {lo if lo < 0 else hi} outside [0, {num_experts or 'E'})")
    check_distinct(ids, what)
