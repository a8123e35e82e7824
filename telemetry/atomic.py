"""Outputs that never read as complete when they are not: write to a temporary name beside the target, flush,
then rename into place (atomic on one filesystem). A failed or interrupted run leaves the old file untouched."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_open(path: str | Path):
    """A binary file to write `path` through: it is a temporary name beside it until the block ends without an
    exception, then fsynced (on disk before anyone times a read of it) and renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_open(path) as f:
        f.write(data)
    return Path(path)


def write_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """A matplotlib figure as a PNG, atomically (rendered in memory, then written and renamed)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return write_bytes(path, buf.getvalue())


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path: str | Path, obj) -> Path:
    return write_text(path, json.dumps(obj, indent=2, default=str) + "\n")
