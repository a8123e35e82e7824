"""The one child-process runner of the benchmarks: a run's configuration crosses to its process as a YAML file
(written once by the parent, parsed once by the child: `read_config`), and everything a fair comparison needs
around that process happens here, in one place:

- the page cache dropped before it starts (as root), so every system starts cold;
- the memory cgroup it joins before it allocates anything (`memcg.MemoryCgroup`, its peak zeroed first);
- its peak memory, read by the one reader (`telemetry/memory.py`): the child's own peak resident set from its
  rusage (`os.wait4`), and the cgroup's peak (resident memory and page cache);
- its result: the last line it prints on stdout, one JSON object; a failure comes back as `{"error": ...}` naming
  the exit status, the log and the log's last line (an out-of-memory kill leaves no other word).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

import yaml

from expertcache.telemetry.atomic import open_log, write_setting, write_text
from expertcache.telemetry.errors import InputError
from expertcache.telemetry.memory import child_peak_rss_bytes


def write_config(path: str | Path, config: dict) -> Path:
    """A run's configuration as the YAML file its process reads."""
    return write_text(path, yaml.safe_dump(config, sort_keys=False))


def read_config(path: str | Path) -> dict:
    """A run's configuration file: one YAML mapping (anything else is one line)."""
    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InputError(f"run configuration {path}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(cfg, dict):
        raise InputError(f"run configuration {path}: expected a mapping of keys, got {type(cfg).__name__}")
    return cfg


def drop_page_cache() -> bool:
    """Drop the page cache (root only): True when it was dropped."""
    try:
        os.sync()
        write_setting("/proc/sys/vm/drop_caches", "1\n")
        return True
    except OSError:
        return False


def last_line(log: Path) -> str:
    """The last line a failed run wrote to its log (its error, or what it said after loading), at most 300
    characters."""
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def cold_start(cgroup=None, drop_caches: bool = True) -> bool:
    """Before a run: the page cache dropped (`drop_caches`, as root) and the cgroup's peak zeroed; whether the
    cache was dropped. `run_child` calls it; a system that starts its own process (llama-bench) calls it itself."""
    dropped = drop_page_cache() if drop_caches else False
    if cgroup is not None:
        cgroup.reset_peak()
    return dropped


def run_child(program: str | Sequence[str], config: str | Path, log: Path, cgroup=None, timeout_s: float = 3600,
              drop_caches: bool = True) -> dict:
    """`python -m program CONFIG` (`program` a module; or a command line, `[python, script.py, --worker]`, that
    takes the configuration file as its last argument) in a process of its own, inside `cgroup` when given (a `memcg.MemoryCgroup`),
    after the page cache is dropped (`drop_caches`, as root), its stderr in `log`: the JSON object it printed last,
    with `peak_rss_bytes` (its own peak: the VmHWM it reported, else its rusage, which Linux inflates to the
    parent's peak at fork), `cgroup_peak_bytes` (None outside a cgroup) and
    `page_cache_dropped`; or `{"error": ..., "page_cache_dropped"}`."""
    dropped = cold_start(cgroup, drop_caches)
    cmd = ([sys.executable, "-m", program] if isinstance(program, str) else [*program]) + [str(config)]
    with open_log(log, fresh=True) as lf:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=lf, text=True,
                             preexec_fn=cgroup.preexec if cgroup is not None else None)
        late = threading.Event()
        timer = threading.Timer(timeout_s, lambda: (late.set(), p.kill()))
        timer.start()
        try:
            out = p.stdout.read()
            _, status, ru = os.wait4(p.pid, 0)  # this child's own rusage (Popen's wait would not give it)
        finally:
            timer.cancel()
            p.stdout.close()
        p.returncode = code = os.waitstatus_to_exitcode(status)
    lines = [x for x in out.strip().splitlines() if x.strip()]
    if code != 0 or not lines:
        killed = f" (no result within {timeout_s:.0f} s)" if late.is_set() else \
            " (killed: out of memory in the cgroup?)" if cgroup is not None and code in (-9, 137) else ""
        last = last_line(log)
        return {"error": f"exit {code}{killed}; see {log}" + (f": {last}" if last else ""),
                "page_cache_dropped": dropped}
    res = json.loads(lines[-1])
    # the child's own VmHWM where it reports one (bench big's children do): its rusage is an upper bound only, as
    # Linux carries the forking process's high-water mark across exec into the child's ru_maxrss (a child of a
    # 1 GiB test worker read 1.06 GiB for a 96 MiB allocation)
    return {**res, "peak_rss_bytes": res.get("peak_rss_bytes") or child_peak_rss_bytes(ru),
            "peak_rss_source": "child VmHWM" if res.get("peak_rss_bytes") else "rusage (includes the parent's at fork)",
            "cgroup_peak_bytes": cgroup.peak_bytes() if cgroup is not None else None,
            "page_cache_dropped": dropped}


def wait_serving(proc: subprocess.Popen, url: str, timeout_s: float = 300, poll_s: float = 0.2) -> bool:
    """Whether the server `proc` started answers `url`/health with 200 within `timeout_s`; False as soon as it
    exits, or when the time is up (the caller says why in its own words, with its log)."""
    import time

    import httpx

    t0 = time.time()
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() - t0 > timeout_s:
            return False
        time.sleep(poll_s)
