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


@contextmanager
def atomic_dir(path: str | Path):
    """A folder written whole: the block fills a temporary folder beside `path` (yielded), which then replaces
    `path` (the old one renamed away first, removed after). A failed block leaves the previous folder as it was,
    so a half-written folder (a checkpoint, a tokenizer) never reads as complete."""
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            path.rename(old)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_npy(path: str | Path, array) -> Path:
    """A NumPy array as .npy (never pickled)."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return write_bytes(path, buf.getvalue())


def write_jsonl(path: str | Path, rows) -> Path:
    return write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def open_log(path: str | Path, fresh: bool = False):
    """A log file written as a run goes (read while it grows; not a result): appended to, or started anew."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w" if fresh else "a")


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


def copy_file(src: str | Path, dst: str | Path) -> Path:
    """A file copied whole: its bytes streamed through a temporary name beside `dst` (fsynced, renamed), then its
    permission bits and times (as `shutil.copy2`). An interrupted copy leaves `dst` as it was."""
    import shutil

    with open(src, "rb") as r, atomic_open(dst) as w:
        shutil.copyfileobj(r, w, 1 << 20)
    shutil.copystat(src, dst)
    return Path(dst)


def copy_tree(src: str | Path, dst: str | Path) -> Path:
    """A folder copied whole (`atomic_dir`: a failed copy leaves the previous `dst`, or none)."""
    import shutil

    with atomic_dir(dst) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
    return Path(dst)


def write_setting(path: str | Path, value: str) -> None:
    """A kernel setting (a file under /proc or /sys: drop_caches, a cgroup's limit or its member list), written
    in place: it is not a file that can be half-written, and a temporary name beside it cannot exist."""
    p = Path(path)
    if not str(p).startswith(("/proc/", "/sys/")):
        raise ValueError(f"{p} is not a kernel setting (under /proc or /sys); write files with write_text")
    with open(p, "w") as f:
        f.write(value)


def check_output(out: str | Path | None, *inputs, folder: bool = False) -> None:
    """Before any work: refuse an output that cannot be written (a folder where a file goes, or the reverse; a
    parent folder that is not writable) or that is one of the command's inputs (its result would replace it)."""
    from .errors import InputError

    if out is None:
        return
    p = Path(out)
    if folder and p.exists() and not p.is_dir():
        raise InputError(f"output folder {out} is a file")
    if not folder and p.is_dir():
        raise InputError(f"output {out} is a folder; expected a file path")
    for i in inputs:
        for one in (i if isinstance(i, (list, tuple)) else [i]):
            if one is not None and Path(one).exists() and p.resolve() == Path(one).resolve():
                raise InputError(f"output {out} is also an input of this command; write the result elsewhere")
            if one is not None and Path(one).is_dir() and p.exists() and Path(one).resolve() in p.resolve().parents:
                raise InputError(f"output {out} would replace a file of the input folder {one}")
    parent = p if folder and p.is_dir() else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"output {out}: folder {parent} is not writable")
