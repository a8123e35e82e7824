"""Every results/*.json, checked for what makes a figure traceable: the commit it came from, the configuration that
made it, the command that made it; and every ratio it claims, re-decided by the one claim rule
(`runtime/bench/harness.py: claimed`) from the round medians it holds. Prints one table (and `--json` the rows).

    python scripts/check_results.py            # the table; exit 0
    python scripts/check_results.py --write    # add what git history truthfully recovers, then the table

What `--write` adds, only where the file lacks it, never a figure:
- `provenance` {"commit": the last commit that changed the file (`git log -1`), "dirty": null,
  "recovered_from": "git log"}: the commit that wrote (or last rewrote) the file, so the code that made it is that
  commit or an earlier one;
- `config` from the CLI's `<stem>.config.yaml` beside it (the resolved arguments of the run that wrote it), and
  `command` from it (`expertcache bench big --config results/<stem>.config.yaml`), when git's last commit of
  the YAML is the JSON's (written by the same run), marked `"config_recovered_from"`.
- `command` where a file of the repository names the exact command that writes that exact file (`DOCUMENTED`;
  checked against that file's text, so it cannot drift), marked `"command_recovered_from"`.
A list (frontier*.json) has no place for a key without changing what its readers read: reported, left alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# results written by a command that a file of the repository states for that output, with that file
DOCUMENTED = {"load_test.json": ("python scripts/load_test.py --seconds 40 --clients 6 --out results/load_test.json",
                                 "scripts/load_test.py"),
              "serve_load.json": ("python scripts/load_test.py --throughput --out results/serve_load.json",
                                  "scripts/load_test.py"),
              "bad_inputs.json": ("python scripts/bad_inputs.py", "scripts/bad_inputs.py")}


def commit_of(d) -> str | None:
    """The commit a result records, wherever its writer put it (`provenance`, `commit`, `git_commit`, or one per
    entry as make_times.json's)."""
    if isinstance(d, list):  # a list of rows (the frontier's): each row records its own
        per = [r.get("commit") if isinstance(r, dict) else None for r in d]
        return ",".join(sorted(set(per))) if per and all(per) else None
    if not isinstance(d, dict):
        return None
    for k in ("provenance", "commit", "git_commit"):
        v = d.get(k)
        if isinstance(v, dict) and v.get("commit"):
            return v["commit"]
        if isinstance(v, str) and v:
            return v
    per = [v.get("commit") for v in d.values() if isinstance(v, dict)]
    return ",".join(sorted({c for c in per if c})) if per and all(per) else None


def config_of(d, path: Path) -> str | None:
    """Where a result's configuration is: `config` (written by `write_result`), `inputs` (the benchmark's own
    record of them), or the CLI's `<stem>.config.yaml` beside it; None when only a command line (or nothing)."""
    if isinstance(d, dict) and d.get("config"):
        return "config"
    if isinstance(d, list) and d and all(isinstance(r, dict) and r.get("config") for r in d):
        return "config"  # a list of rows, each with its own
    if isinstance(d, dict) and d.get("inputs"):
        return "inputs" + (" + .config.yaml" if _yaml(path).is_file() else "")
    return ".config.yaml beside" if _yaml(path).is_file() else None


def command_of(d) -> str | None:
    """The command a result names (one per entry, as make_times.json's, counts when every entry names one)."""
    if isinstance(d, list):  # a list of rows (the frontier's), each naming the command that made it
        per = {r.get("command") if isinstance(r, dict) else None for r in d}
        return per.pop() if len(per) == 1 and all(per) else None
    if not isinstance(d, dict):
        return None
    c = d.get("command")
    if isinstance(c, str) and c:
        return c
    per = [v.get("command") for v in d.values() if isinstance(v, dict)]
    return "; ".join(per) if per and all(isinstance(x, str) and x for x in per) else None


def _yaml(path: Path) -> Path:
    return path.with_name(path.stem + ".config.yaml")


def claims(d) -> tuple[int, int]:
    """(claims re-decided, of those the same) by `harness.claimed` from the round medians the file holds: bench
    big's comparisons, bench decode's `vs_*_claimed`."""
    from expertcache.runtime.bench.harness import claimed

    if not isinstance(d, dict):
        return 0, 0
    n = same = 0
    systems, comps = d.get("systems"), d.get("comparisons")
    if isinstance(systems, dict) and isinstance(comps, dict):
        for k, v in comps.items():
            a, b = k.split(" vs ")
            xa, xb = (systems.get(s, {}).get("tpot_round_medians_s") for s in (a, b))
            if xa and xb:
                n += 1
                same += claimed(xa, xb) == v.get("claimed")
    cfgs = d.get("configs")
    if isinstance(cfgs, dict):
        for name, row in cfgs.items():
            for key in [k for k in row if k.startswith("vs_") and k.endswith("_claimed")]:
                other = key[3:-8].replace("_", "-")
                if other == "on-demand":
                    other = "on-demand@" + name.split("@")[-1]
                theirs = cfgs.get(other, {}).get("tpot_round_medians_s")
                if theirs and row.get("tpot_round_medians_s"):
                    n += 1
                    same += claimed(row["tpot_round_medians_s"], theirs) == row[key]
    return n, same


def agrees(cfg: dict, d: dict) -> bool:
    """Whether a `.config.yaml` is the configuration of the run that wrote result `d`: at least 3 keys shared with
    its `inputs`, every one equal (a mapping, such as the engine's options, key for key), and bench big's systems
    expanded by its formats equal to the systems the result reports."""
    inputs = d.get("inputs")
    if not isinstance(inputs, dict):
        return False
    common = [k for k in cfg if k in inputs]
    if len(common) < 3 or any(cfg[k] != inputs[k] for k in common):
        return False
    if "systems" in cfg:
        from expertcache.runtime.bench.bigbench import system_names

        return set(system_names(cfg["systems"], cfg.get("experts", ["bf16"]))) == set(d.get("systems", {}))
    return True


def recover(d: dict, path: Path) -> list[str]:
    """What git history truthfully gives a result that lacks it (see the module's doc); what was added."""
    from expertcache.telemetry.provenance import last_commit

    added = []
    head = last_commit(path)
    if commit_of(d) is None and head:
        d["provenance"] = {"commit": head, "dirty": None, "recovered_from": "git log"}
        added.append("commit")
    y = _yaml(path)
    cfg = None
    if y.is_file() and not d.get("config"):
        import yaml

        cfg = yaml.safe_load(y.read_text())
    if cfg is not None and agrees(cfg, d):
        cmd = "bench big" if "systems" in cfg else "bench decode" if "capacities" in cfg else None
        d["config"], d["config_recovered_from"] = cfg, y.name
        added.append("config")
        if cmd and command_of(d) is None:
            d["command"] = f"expertcache {cmd} --config results/{y.name}"
            added.append("command")
    doc = DOCUMENTED.get(path.name)
    if doc and command_of(d) is None and doc[0] in (ROOT / doc[1]).read_text():
        d["command"], d["command_recovered_from"] = doc
        added.append("command")
    return added


def rows(results: Path, write: bool = False) -> list[dict]:
    out = []
    for p in sorted(results.glob("*.json")):
        d = json.loads(p.read_text())
        added = []
        if write and isinstance(d, dict):
            added = recover(d, p)
            if added:
                from expertcache.telemetry.atomic import write_json

                write_json(p, d)
        n, same = claims(d)
        out.append({"file": p.name, "commit": commit_of(d), "config": config_of(d, p), "command": command_of(d),
                    "claims_rechecked": n, "claims_same": same, "added": added,
                    "list": isinstance(d, list)})
    return out


def table(rs: list[dict]) -> str:
    lines = ["| file | commit | configuration | command named | claims re-decided (same) | added now |",
             "|---|---|---|---|---|---|"]
    for r in rs:
        rechecked = f"{r['claims_rechecked']} ({r['claims_same']})" if r["claims_rechecked"] else "—"
        lines.append(f"| {r['file']} | {r['commit'] or ('— (a list)' if r['list'] else '—')} | {r['config'] or '—'} | "
                     f"{'yes' if r['command'] else '—'} | "
                     f"{rechecked} | "
                     f"{', '.join(r['added']) or '—'} |")
    n = len(rs)
    lines.append(f"\n{n} files: commit {sum(bool(r['commit']) for r in rs)}, configuration "
                 f"{sum(bool(r['config']) for r in rs)}, command {sum(bool(r['command']) for r in rs)}, all three "
                 f"{sum(bool(r['commit'] and r['config'] and r['command']) for r in rs)}; claims re-decided "
                 f"{sum(r['claims_rechecked'] for r in rs)}, the same {sum(r['claims_same'] for r in rs)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(ROOT / "results"))
    ap.add_argument("--write", action="store_true", help="add the provenance git history recovers")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    a = ap.parse_args(argv)
    rs = rows(Path(a.results), a.write)
    print(json.dumps(rs, indent=2) if a.json else table(rs))
    return 0 if all(r["claims_rechecked"] == r["claims_same"] for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
