"""Run a command and record its wall time in results/make_times.json (`make quickstart`, `make test`, `make test-fast`
call it, so the times the README quotes are the last ones measured, with the machine and the commit), then rewrite
the README's and docs' generated tables from it (`scripts/readme_tables.py --write`).

    python scripts/timed.py NAME -- CMD [ARGS ...]

Exits with the command's status; the time is recorded whatever the status, marked with it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from expertcache.telemetry.atomic import write_json
from expertcache.telemetry.provenance import rev_parse

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "make_times.json"
ENV = ("OMP_NUM_THREADS", "PYTEST_ADDOPTS", "PYTEST_XDIST_AUTO_NUM_WORKERS", "CI")  # and every EXPERTCACHE_*


def steal_s() -> float | None:
    """CPU seconds the hypervisor has taken from this machine's CPUs since boot (/proc/stat's steal), or None: on a
    shared host the same command's wall time moves with it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python scripts/timed.py NAME -- CMD [ARGS ...]", file=sys.stderr)
        return 2
    name, cmd = argv[0], argv[2:]
    head = rev_parse("HEAD", ROOT)  # the code that runs, taken before it starts
    st0, t0 = steal_s(), time.perf_counter()
    rc = subprocess.call(cmd)
    wall, st1 = time.perf_counter() - t0, steal_s()
    try:
        times = json.loads(OUT.read_text())
    except (OSError, ValueError):
        times = {}
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    times[name] = {"wall_s": round(wall, 1), "exit": rc, "command": " ".join(cmd), "commit": head,
                   "cpus": os.cpu_count(), "machine": platform.machine(), "load_after_1min": load1,
                   "cpu_steal_s": None if st0 is None or st1 is None else round(st1 - st0, 1),
                   "ci": bool(os.environ.get("CI")),
                   # what the time depends on beyond the commit: the target, its command, the settings it inherits
                   "config": {"target": name, "argv": cmd,
                              "env": {k: v for k, v in sorted(os.environ.items())
                                      if k.startswith("EXPERTCACHE_") or k in ENV}},
                   "when": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    write_json(OUT, times)  # silently: the command's own last line (pytest's summary) stays the last line
    # the README's and docs' tables follow the file at once (else the docs-tables test of the next `make test`
    # finds them stale); silently too
    subprocess.call([sys.executable, str(ROOT / "scripts" / "readme_tables.py"), "--write"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return rc


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main, sys.argv[1:]))
