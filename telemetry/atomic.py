"""Outputs that never read as complete when they are not: write to a temporary name beside the target, flush,
then rename into place (atomic on one filesystem). A failed or interrupted run leaves the old file untouched."""

from __future__ import annotations

import json
import os
import re
import sys
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
def atomic_dir(path: str | Path, command: str | None = None, overwrite: bool = False, legacy=None):
    """A folder written whole: the block fills a temporary folder beside `path` (yielded), which then replaces
    `path` (the old one renamed away first, removed after). A failed block leaves the previous folder as it was,
    so a half-written folder (a checkpoint, a tokenizer) never reads as complete. With `command` (a command's
    output folder): `path` is claimed by `claim_dir`'s rule before the block and again before the swap (it may
    have changed meanwhile; `overwrite`, `legacy` as there), and the marker naming `command` is the last file
    written into the new folder."""
    import shutil

    path = Path(path)
    made = []  # the parent folders this call made (innermost first): only those go if the block fails
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    done = False
    try:
        for p in reversed([p for p in (path.parent, *path.parent.parents) if not p.exists()]):
            try:
                p.mkdir()
            except FileExistsError:  # made meanwhile by someone else: theirs, never removed here
                continue
            made.insert(0, p)
        if command is not None:
            claim_dir(path, command, overwrite=overwrite, legacy=legacy)
        else:
            clean_stale(path)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        yield tmp
        if command is not None:
            claim_dir(path, command, overwrite=overwrite, legacy=legacy)
            mark_output(tmp, command)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
        for d in made if not done else ():  # a failed block leaves no folder it made on the way either
            try:
                d.rmdir()
            except OSError:
                break


# --- whose folder an output folder is ---------------------------------------------------------------------------
# A command writes a folder only when it is new, empty, or an earlier output of the same command: the marker file
# below, written by the command (last, for a folder written whole). Anything else is a folder someone else owns (a
# user's files, the corpus, another command's output) and is refused before any work, with what it holds named.

OUTPUT_MARKER = ".expertcache-output.json"


def output_marker(path: str | Path) -> dict | None:
    """The marker a command left in folder `path`: {"command", "complete"}; None when there is none (or it is not
    one of ours: unreadable, not a mapping naming a command)."""
    try:
        d = json.loads((Path(path) / OUTPUT_MARKER).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) and isinstance(d.get("command"), str) else None


def mark_output(path: str | Path, command: str, complete: bool = True) -> None:
    """Mark folder `path` as `command`'s output (complete: written whole; False: a run or a cache that goes on)."""
    write_json(Path(path) / OUTPUT_MARKER, {"command": command, "complete": complete})


def _entries(p: Path, shown: int = 4) -> str:
    """A few of a folder's entries (`keep.txt, data/, ... (12 entries)`), for a refusal that says what is there."""
    names = sorted(e.name + ("/" if e.is_dir() else "") for e in p.iterdir())
    more = f", ... ({len(names)} entries)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def claim_dir(path: str | Path, command: str, overwrite: bool = False, resume: bool = False,
              legacy=None) -> str:
    """The one rule for a folder `command` writes, before any work: "new" (absent), "empty", or "earlier" (the
    command's own earlier output: replaced only with `overwrite`, or continued when the command resumes or reuses
    its folder, `resume`). A folder of anything else is refused (InputError, one line naming a few entries), and
    so is another command's output, with or without `overwrite`. `legacy(path)`: recognises the command's output
    from before markers existed (a run folder's recipe.yaml). Leftovers of an interrupted run are cleaned first."""
    from .errors import InputError

    p = Path(path)
    clean_stale(p)
    if not p.exists():
        return "new"
    if not p.is_dir():
        raise InputError(f"output folder {p} is a file")
    if not any(p.iterdir()):
        return "empty"
    mark = output_marker(p)
    if mark is None and legacy is not None and legacy(p):
        mark = {"command": command, "complete": True}
    if mark is None:
        raise InputError(f"{p} is not empty and not an output of `{command}` (it holds {_entries(p)}); nothing "
                         f"there is replaced: choose a new or empty folder")
    if mark["command"] != command:
        raise InputError(f"{p} is the output of `{mark['command']}`, not of `{command}` (it holds {_entries(p)}); "
                         f"choose another folder")
    if not (resume or overwrite):
        state = "a complete" if mark.get("complete") else "an incomplete"
        raise InputError(f"{p} holds {state} earlier `{command}` output; pass --overwrite true to replace it, or "
                         f"choose another folder")
    return "earlier"


def own_dir(path: str | Path, command: str, legacy=None) -> Path:
    """A folder `command` keeps adding to (a cache of stores, a checkpoint reused across runs, rotating traces):
    claimed by `claim_dir`'s rule (its own earlier folder is reused, never one of anything else), created, and
    marked as `command`'s."""
    p = Path(path)
    claim_dir(p, command, resume=True, legacy=legacy)
    p.mkdir(parents=True, exist_ok=True)
    if output_marker(p) is None:
        mark_output(p, command, complete=False)
    return p


_LEFTOVER = re.compile(r"\.(tmp|old)-(\d+)$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_stale(path: str | Path) -> list[str]:
    """Leftovers of an interrupted write of `path` whose process is gone: a temporary `.NAME.tmp-PID` (a file of
    atomic_open, a folder of atomic_dir; gigabytes for a checkpoint) is removed; a `.NAME.old-PID` is put back
    when `path` is missing (the kill fell between atomic_dir's two renames: it is the earlier output), else
    removed. One line each on stderr; returns those lines."""
    import glob
    import shutil

    p = Path(path)
    if not p.parent.is_dir():
        return []
    said = []
    for f in sorted(p.parent.glob(f".{glob.escape(p.name)}.*-*"), key=lambda f: ".old-" not in f.name):
        m = _LEFTOVER.search(f.name)
        if m is None or f.name != f".{p.name}.{m.group(1)}-{m.group(2)}" or _alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not p.exists() and not p.is_symlink():
            f.rename(p)
            said.append(f"{p}: put back the earlier output that an interrupted run (process {m.group(2)}, gone) had "
                        f"moved to {f.name}")
        else:
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)
            said.append(f"{p}: removed {f.name}, left by an interrupted run (process {m.group(2)} is gone)")
    for line in said:
        print(line, file=sys.stderr)
    return said


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


def check_output(out: str | Path | None, *inputs, folder: bool = False, command: str | None = None,
                 overwrite: bool = False, resume: bool = False, legacy=None) -> str | None:
    """Before any work: refuse an output that cannot be written (a folder where a file goes, or the reverse; a
    parent folder that is not writable) or that is one of the command's inputs (its result would replace it), or
    a folder that holds one. A folder `command` writes must be its own (`claim_dir`: new, empty, or its earlier
    output; `overwrite`, `resume` and `legacy` as there); returns claim_dir's answer. Leftovers of an interrupted
    write of `out` are cleaned."""
    from .errors import InputError

    if out is None:
        return None
    p = Path(out)
    for i in inputs:
        for one in (i if isinstance(i, (list, tuple)) else [i]):
            if one is not None and Path(one).exists() and p.resolve() == Path(one).resolve():
                raise InputError(f"output {out} is also an input of this command; write the result elsewhere")
            if one is not None and Path(one).is_dir() and p.exists() and Path(one).resolve() in p.resolve().parents:
                raise InputError(f"output {out} would replace a file of the input folder {one}")
            if folder and one is not None and Path(one).exists() and p.resolve() in Path(one).resolve().parents:
                raise InputError(f"output folder {out} holds the input {one} (writing it would delete the input); "
                                 f"write the result elsewhere")
    if folder and p.exists() and not p.is_dir():
        raise InputError(f"output folder {out} is a file")
    if not folder and p.is_dir():
        raise InputError(f"output {out} is a folder; expected a file path")
    parent = p if folder and p.is_dir() and (resume or command is None) else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"output {out}: folder {parent} is not writable")
    if folder and command is not None:
        return claim_dir(p, command, overwrite=overwrite, resume=resume, legacy=legacy)
    clean_stale(p)
    return None
