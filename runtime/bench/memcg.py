"""A memory cgroup that bounds a process's resident memory *and* its page cache, so that systems which cache
through the kernel (mmap, llama.cpp) and systems with their own cache (expertcache) are compared at equal memory.

As root, cgroup v1 (`/sys/fs/cgroup/memory/NAME`: `memory.limit_in_bytes`, `memory.max_usage_in_bytes`) or v2
(`/sys/fs/cgroup/NAME` with the memory controller: `memory.max`, `memory.peak`). A child joins it before it runs
(`preexec`), so everything it maps or reads is charged from its first page. Without root or a memory controller,
`MemoryCgroup.create` returns None and says why: the benchmark then runs unbounded and its JSON says so.
A run killed before it removed its cgroup leaves `expertcache-PID` behind: `clean_stale`, called by every
`create`, removes those whose process is gone, with one line on stderr.
"""

from __future__ import annotations

import os
from pathlib import Path

from expertcache.telemetry.atomic import _alive, write_setting  # _alive: the one "is that process gone"
from expertcache.telemetry.memory import cgroup_peak_bytes

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


class MemoryCgroup:
    def __init__(self, path: Path, limit_bytes: int, v2: bool):
        self.path, self.limit_bytes, self.v2 = path, int(limit_bytes), v2
        self._limit, self._peak = ("memory.max", "memory.peak") if v2 else \
            ("memory.limit_in_bytes", "memory.max_usage_in_bytes")

    @classmethod
    def create(cls, limit_bytes: int, name: str | None = None, v1: Path = V1,
               v2: Path = V2) -> tuple["MemoryCgroup | None", str]:
        """(the cgroup, "") or (None, why not). `v1`, `v2`: the cgroup file systems' roots (a test's folders)."""
        name = name or f"expertcache-{os.getpid()}"
        if os.geteuid() != 0:
            return None, "not root: a memory cgroup needs root"
        controllers = v2 / "cgroup.controllers"
        if (v1 / "memory.limit_in_bytes").is_file():
            root, is_v2 = v1, False
        elif controllers.is_file() and "memory" in controllers.read_text().split():
            root, is_v2 = v2, True
        else:
            return None, "no cgroup memory controller here (v1 /sys/fs/cgroup/memory or v2 with memory)"
        clean_stale(root)
        path = root / name
        try:
            path.mkdir(exist_ok=True)
            cg = cls(path, limit_bytes, is_v2)
            write_setting(path / cg._limit, str(int(limit_bytes)))
            if not is_v2:  # swap would let a process exceed the limit
                sw = path / "memory.memsw.limit_in_bytes"
                if sw.exists():
                    write_setting(sw, str(int(limit_bytes)))
        except (OSError, ValueError) as e:  # ValueError: a root that is not under /sys (a test's folder)
            return None, f"could not make a memory cgroup at {path}: {getattr(e, 'strerror', None) or e}"
        return cg, ""

    def preexec(self) -> None:
        """Run in the child between fork and exec: the child joins the cgroup before it allocates anything."""
        write_setting(self.path / "cgroup.procs", str(os.getpid()))

    def reset_peak(self) -> None:
        """Zero the peak before a run (v1: max_usage_in_bytes; v2's memory.peak resets per open file, kernel
        >= 6.12, so there it is the peak since the cgroup was made) and drop what earlier runs left charged."""
        if not self.v2:
            write_setting(self.path / self._peak, "0")
            try:
                write_setting(self.path / "memory.force_empty", "0")
            except OSError:
                pass

    def peak_bytes(self) -> int | None:
        return cgroup_peak_bytes(self.path / self._peak)

    def close(self) -> None:
        """Remove the cgroup (its processes have exited)."""
        try:
            self.path.rmdir()
        except OSError:
            pass


def clean_stale(root: Path) -> list[str]:
    """Remove the `expertcache-PID` cgroups under `root` whose process is gone (a run killed before its `close`),
    saying so in one line on stderr; the names removed. A cgroup with a process still in it stays (rmdir fails)."""
    import sys

    gone = []
    for d in sorted(root.glob("expertcache-*")):
        pid = d.name.rsplit("-", 1)[1]
        if not d.is_dir() or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            d.rmdir()
            gone.append(d.name)
        except OSError:
            pass
    if gone:
        print(f"memory cgroup: removed {len(gone)} left by runs that are gone: {', '.join(gone)}", file=sys.stderr)
    return gone
