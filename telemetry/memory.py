"""The one reader of memory figures a result records: this process's resident set now and at its peak, a waited-for
child's peak (from its rusage), and a memory cgroup's peak (resident memory and page cache). Measured, never
estimated; bench decode, bench big (its runner), llama.cpp's runs and the streamed trainer all read here."""

from __future__ import annotations

from pathlib import Path


def _status_bytes(field: str, pid: int | str = "self") -> int:
    """A `kB` figure of a process's `/proc/PID/status` in bytes (0 where there is none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (VmHWM)."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Start this process's peak resident set again from its resident set now (writing 5 to /proc/self/clear_refs,
    Linux 4.0 on), so that a run inside a longer process (a frontier's streamed variant after others trained in
    memory) records its own peak; False where the kernel refuses, and the peak then covers the process's life."""
    from expertcache.telemetry.atomic import write_setting

    try:
        write_setting("/proc/self/clear_refs", "5")
        return True
    except OSError:
        return False


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set now (VmRSS): this one's, or another's (a server under load)."""
    return _status_bytes("VmRSS", pid)


def child_peak_rss_bytes(rusage) -> int:
    """A waited-for child's own peak resident set, from the rusage `os.wait4` returned for it (ru_maxrss: KiB on
    Linux). Not RUSAGE_CHILDREN, which is the largest of every child waited for so far. An upper bound: Linux keeps
    the forking process's high-water mark through exec in the child's ru_maxrss, so a child of a large process
    reads at least that; a child's own VmHWM (`peak_rss_bytes`, reported by the child) is the exact figure."""
    return int(rusage.ru_maxrss) * 1024


def cgroup_peak_bytes(peak_file: str | Path) -> int | None:
    """A memory cgroup's peak (v1 `memory.max_usage_in_bytes`, v2 `memory.peak`): None when it cannot be read."""
    try:
        return int(Path(peak_file).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
