"""Where a result came from: the commit the code runs from and whether tracked code differs from it. The one place
that asks git (`tests/test_architecture.py` holds every other file to it, scripts/ included), so every result
records its commit the same way."""

from __future__ import annotations

import subprocess
from pathlib import Path

# what a benchmark writes into the checkout itself: a result file or a regenerated table is not a code change
_NOT_CODE = (":(top,exclude)results", ":(top,exclude)docs", ":(top,exclude,glob)**/*.md")


def rev_parse(rev: str = "HEAD", here: str | Path | None = None) -> str:
    """`rev`'s short commit id in the checkout holding `here` (default: this package's folder); "" outside a
    checkout, or when git is missing or `rev` names nothing."""
    here = Path(here) if here is not None else Path(__file__).resolve().parent
    try:
        return subprocess.run(["git", "rev-parse", "--short", "--verify", "--quiet", f"{rev}^{{commit}}"],
                              capture_output=True, text=True, cwd=here, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def is_dirty(here: str | Path | None = None) -> bool | None:
    """Whether tracked code differs from HEAD (results, docs and markdown excluded: a benchmark writes its own
    results file); None when it cannot be told."""
    here = Path(here) if here is not None else Path(__file__).resolve().parent
    try:
        rc = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ":/", *_NOT_CODE], capture_output=True,
                            cwd=here, timeout=10).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: False, 1: True}.get(rc)


def git_commit(here: str | Path | None = None) -> str:
    """The commit the code runs from, with "+dirty" when tracked code differs from it. Taken before the work starts:
    edits made while a long benchmark runs are not its code. Empty outside a git checkout."""
    head = rev_parse("HEAD", here)
    if not head:
        return ""
    return head + ("+dirty" if is_dirty(here) else "")


def provenance(here: str | Path | None = None) -> dict:
    """What a result file records about its code: `{"commit": short id or None, "dirty": bool or None}`."""
    head = rev_parse("HEAD", here)
    return {"commit": head or None, "dirty": is_dirty(here) if head else None}


def last_commit(path: str | Path) -> str:
    """The short id of the last commit that changed `path` (a results file: the commit that wrote it, or a later
    one that rewrote it); "" when git has none. For provenance recovered from history (`scripts/check_results.py`),
    never for a run's own, which `provenance` takes when it starts."""
    path = Path(path).resolve()
    try:
        return subprocess.run(["git", "log", "-1", "--format=%h", "--", path.name], capture_output=True, text=True,
                              cwd=path.parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
