"""The one result writer of every benchmark (the CLI's bench commands and scripts/): `write_result` adds to the
payload what any figure needs to be traced back and compared (METRICS.md, Reporting):

- `provenance`: the commit and its dirty flag (`telemetry/provenance.py`, the one lookup, taken before the work
  starts: `started()`), the machine (CPU model, cores, usable cores, physical memory, the read bandwidth when the
  run measured one), torch's threads and version, the date;
- `config`: the resolved configuration the run used (dataclasses and paths made plain);
- `command`: the command that made it (given, or this process's own command line).

Written through `telemetry/atomic.py` (`write_json`): a failed run never leaves a half-written result.
"""

from __future__ import annotations

import dataclasses
import re
import os
import sys
import time
from pathlib import Path

from expertcache.telemetry.atomic import write_json
from expertcache.telemetry.provenance import provenance as code_provenance

ROOT = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), "" where there is none."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine(read_GBps: float | None = None) -> dict:
    """This host, as a result records it: cores (all, and those this process may use), physical memory (bytes),
    and the storage read bandwidth (GB/s) when the run measured one (None: not measured here)."""
    from expertcache.runtime.storage.tiers import usable_cores

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": usable_cores(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "read_GBps": read_GBps}


def started(here: str | Path | None = None) -> dict:
    """The provenance of a run, taken when it starts (edits made while a long benchmark runs are not its code):
    `{"commit", "dirty", "machine", "threads", "torch", "date"}`."""
    import torch

    return {**code_provenance(here), "machine": machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def plain(value):
    """A configuration as JSON holds it: dataclasses as dicts, paths and other objects as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


_ABS = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)*[\w.+-]+")


def portable(value):
    """A configuration or command line with no machine's absolute paths: a path inside the repository becomes
    relative to it, any other `.../<its last name>` (the machine's folders are not the result's)."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    if not isinstance(value, str) or "/" not in value:
        return value

    def one(m: re.Match) -> str:
        p = Path(m.group(0))
        try:
            return p.relative_to(ROOT).as_posix() or "."
        except ValueError:
            return f".../{p.name}"
    return _ABS.sub(one, value)


MACHINE_ROOTS = ("work", "root", "home", "tmp")  # where a run's own files lie on a machine: its paths, not the result's


def machine_paths(d) -> int:
    """How many strings in `d` (keys and values, at any depth) name a path under one of MACHINE_ROOTS."""
    if isinstance(d, dict):
        return sum(machine_paths(k) + machine_paths(v) for k, v in d.items())
    if isinstance(d, list):
        return sum(machine_paths(v) for v in d)
    return int(isinstance(d, str) and any(_machine(m.group(0)) for m in _ABS.finditer(d)))


def _machine(path: str) -> bool:
    """A path under one of MACHINE_ROOTS, below it (`/tmp/x`; `/tmp` alone, as prose names it, is not a run's
    file)."""
    parts = path.split("/")
    return len(parts) >= 3 and parts[1] in MACHINE_ROOTS


def without_machine_paths(d):
    """`d` with each path under MACHINE_ROOTS made portable as `write_result` writes it (relative inside the
    repository, `.../<last name>` elsewhere); every other string, and every number, as it was."""
    if isinstance(d, dict):
        out = {without_machine_paths(k): without_machine_paths(v) for k, v in d.items()}
        if len(out) != len(d):  # two keys that differ only by their machine's folders: neither is dropped
            raise ValueError("keys collide once made portable")
        return out
    if isinstance(d, list):
        return [without_machine_paths(v) for v in d]
    if not isinstance(d, str):
        return d
    return _ABS.sub(lambda m: portable(m.group(0)) if _machine(m.group(0)) else m.group(0), d)


def portable_payload(d):
    """`without_machine_paths(d)`, or `d` itself (the same object) where two keys would collide once made
    portable: a result is never lost or merged for its paths' sake (`write_result`, scripts/check_results.py)."""
    try:
        return without_machine_paths(d)
    except ValueError:
        return d


def own_command() -> str:
    """This process's command line as a user would type it: `expertcache ...` or `python scripts/x.py ...`."""
    argv = list(sys.argv)
    prog = Path(argv[0]) if argv else Path("python")
    if prog.name == "expertcache":
        head = "expertcache"
    else:
        try:
            head = "python " + prog.resolve().relative_to(ROOT).as_posix()
        except ValueError:
            head = "python " + str(prog)
    return " ".join([head, *argv[1:]])


def _arg(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_arg(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def command_line(name: str, fn, config: dict) -> str:
    """The `expertcache NAME ...` line that runs command function `fn` with `config` (its arguments): every argument
    that differs from `fn`'s default, a dataclass's fields as `--arg.field` (the CLI's own spelling, jsonargparse)."""
    import inspect

    parts = [f"expertcache {name}"]
    for k, p in inspect.signature(fn).parameters.items():
        if k not in config or config[k] == p.default:
            continue
        v = config[k]
        if dataclasses.is_dataclass(v) and dataclasses.is_dataclass(p.default):
            parts += [f"--{k}.{f} {_arg(x)}" for f, x in dataclasses.asdict(v).items()
                      if x != getattr(p.default, f)]
        else:
            parts.append(f"--{k} {_arg(v)}")
    return " ".join(parts)


def write_result(path: str | Path, payload: dict, config=None, command: str | None = None,
                 provenance: dict | None = None, read_GBps: float | None = None) -> dict:
    """`payload` with `provenance` (`provenance`: what `started()` took when the run began; else taken now),
    `config` (the resolved configuration) and `command` (default: this process's), written to `path` as JSON
    through the atomic writer, with no path of this machine in any of them (the payload's made portable as
    `without_machine_paths` does; URLs and prose stay; a payload whose keys would collide is written as it is).
    Returns what was written."""
    prov = dict(provenance) if provenance is not None else started()
    if read_GBps is not None:
        prov["machine"] = {**prov.get("machine", {}), "read_GBps": read_GBps}
    out = {**portable_payload(payload), "provenance": prov, "config": portable(plain(config)),
           "command": portable(command or own_command())}
    write_json(path, out)
    return out
