"""A memory cgroup that bounds a process's resident memory *and* its page cache, so that systems which cache
through the kernel (mmap, llama.cpp) and systems with their own cache (expertcache) are compared at equal memory.

As root, cgroup v1 (`/sys/fs/cgroup/memory/NAME`: `memory.limit_in_bytes`, `memory.max_usage_in_bytes`) or v2
(`/sys/fs/cgroup/NAME` with the memory controller: `memory.max`, `memory.peak`). A child joins it before it runs
(`preexec`), so everything it maps or reads is charged from its first page. Without root or a memory controller,
`MemoryCgroup.create` returns None and says why: the benchmark then runs unbounded and its JSON says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from expertcache.telemetry.atomic import write_setting

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


class MemoryCgroup:
    def __init__(self, path: Path, limit_bytes: int, v2: bool):
        self.path, self.limit_bytes, self.v2 = path, int(limit_bytes), v2
        self._limit, self._peak = ("memory.max", "memory.peak") if v2 else \
            ("memory.limit_in_bytes", "memory.max_usage_in_bytes")

    @classmethod
    def create(cls, limit_bytes: int, name: str | None = None) -> tuple["MemoryCgroup | None", str]:
        """(the cgroup, "") or (None, why not)."""
        name = name or f"expertcache-{os.getpid()}"
        if os.geteuid() != 0:
            return None, "not root: a memory cgroup needs root"
        controllers = V2 / "cgroup.controllers"
        if (V1 / "memory.limit_in_bytes").is_file():
            path, v2 = V1 / name, False
        elif controllers.is_file() and "memory" in controllers.read_text().split():
            path, v2 = V2 / name, True
        else:
            return None, "no cgroup memory controller here (v1 /sys/fs/cgroup/memory or v2 with memory)"
        try:
            path.mkdir(exist_ok=True)
            cg = cls(path, limit_bytes, v2)
            write_setting(path / cg._limit, str(int(limit_bytes)))
            if not v2:  # swap would let a process exceed the limit
                sw = path / "memory.memsw.limit_in_bytes"
                if sw.exists():
                    write_setting(sw, str(int(limit_bytes)))
        except OSError as e:
            return None, f"could not make a memory cgroup at {path}: {e.strerror or e}"
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
        try:
            return int((self.path / self._peak).read_text().split()[0])
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        """Remove the cgroup (its processes have exited)."""
        try:
            self.path.rmdir()
        except OSError:
            pass
