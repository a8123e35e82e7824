"""The one reader of memory figures a result records: this process's resident set now and at its peak, a waited-for
child's peak (from its rusage), and a memory cgroup's peak (resident memory and page cache). Measured, never
estimated; bench decode, bench big (its runner), llama.cpp's runs and the streamed trainer all read here."""

from __future__ import annotations

from pathlib import Path


def _status_bytes(field: str) -> int:
    """A `kB` figure of this process's `/proc/self/status` in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (VmHWM)."""
    return _status_bytes("VmHWM")


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    return _status_bytes("VmRSS")


def child_peak_rss_bytes(rusage) -> int:
    """A waited-for child's own peak resident set, from the rusage `os.wait4` returned for it (ru_maxrss: KiB on
    Linux). Not RUSAGE_CHILDREN, which is the largest of every child waited for so far."""
    return int(rusage.ru_maxrss) * 1024


def cgroup_peak_bytes(peak_file: str | Path) -> int | None:
    """A memory cgroup's peak (v1 `memory.max_usage_in_bytes`, v2 `memory.peak`): None when it cannot be read."""
    try:
        return int(Path(peak_file).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
