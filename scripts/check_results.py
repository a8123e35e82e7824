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
- `config` for a result that names only its command, `python scripts/X.py ARGS`: the arguments as X's own parser
  resolved them at the commit the result records (its defaults then; X's source from git, run up to its parse in a
  child process), marked `"config_recovered_from"`; not where that source no longer imports or a default came from
  a name that has moved.
- a frontier's list of rows (frontier*.json): each row's `commit`, `command` and `config` as the frontier recipe
  writes them today, from the recipe whose YAML, at the commit that wrote the rows (following renames and a
  file copied whole), names that output; each row marked `"config_recovered_from"`.
- paths of the machine that ran it (under /work, /root, /home, /tmp) made portable as `write_result` writes
  them: relative inside the repository, `.../<last name>` elsewhere. Only those strings change.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from expertcache.runtime.bench.results import machine_paths, portable_payload

ROOT = Path(__file__).resolve().parents[1]
# results written by a command that a file of the repository states for that output, with that file
DOCUMENTED = {"load_test.json": ("python scripts/load_test.py --seconds 40 --clients 6 --out results/load_test.json",
                                 "scripts/load_test.py"),
              "serve_load.json": ("python scripts/load_test.py --throughput --out results/serve_load.json",
                                  "scripts/load_test.py"),
              "bad_inputs.json": ("python scripts/bad_inputs.py", "scripts/bad_inputs.py"),
              "bench_decode_0.87gb.json": ("expertcache bench decode --model runs/ckpt-0.87gb --capacities "
                                           "[0.125,0.25] --predictors [probe:1,lookahead:3] --rounds 3 --prompts 2",
                                           "docs/benchmarks.md")}


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
    if isinstance(d, dict) and d and all(isinstance(v, dict) and v.get("config") for v in d.values()):
        return "config"  # one entry per target (make_times.json's), each with its own
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


# what runs a script's own source from a commit, up to its argument parser, and prints the arguments it resolved
_PARSE_ONLY = r"""
import argparse, builtins, json, sys, types
path, argv = sys.argv[1], sys.argv[2:]
class Moved(types.ModuleType):  # a project name that has moved since: the parser does not need it
    def __getattr__(self, name):
        return Moved(name)
    def __call__(self, *a, **k):
        return Moved("call")
    def __str__(self):  # a default made from a moved name (str(), an f-string) is not what that run read either
        raise ImportError("moved")
    __format__ = lambda self, spec: self.__str__()
real_import = builtins.__import__
def project_import(name, globals=None, locals=None, fromlist=(), level=0):
    try:
        m = real_import(name, globals, locals, fromlist, level)
    except ImportError:
        if name.startswith("expertcache"):
            return Moved(name)
        raise
    if name.startswith("expertcache") and any(not hasattr(m, f) for f in fromlist or ()):
        return Moved(name)
    return m
builtins.__import__ = project_import
class Parsed(BaseException):
    pass
real = argparse.ArgumentParser.parse_args
def parse(self, args=None, namespace=None):
    ns = vars(real(self, args, namespace))
    given = sorted({a.dest for a in self._actions for s in a.option_strings
                    for t in argv if t == s or t.startswith(s + "=")})
    raise Parsed(ns, given)
argparse.ArgumentParser.parse_args = parse
sys.argv = [path, *argv]
sys.path.insert(0, path.rsplit("/", 1)[0])
mod = types.ModuleType("recovered")
mod.__file__ = path
try:
    exec(compile(sys.stdin.read(), path, "exec"), mod.__dict__)
    main = mod.__dict__.get("main")
    if main is not None:
        try:
            main(argv)
        except TypeError:
            main()
except Parsed as p:
    if any(isinstance(v, Moved) for v in p.args[0].values()):
        sys.exit(1)  # a default came from a name that moved: not what that run read
    print(json.dumps({"all": p.args[0], "given": p.args[1]}, default=str))
    sys.exit(0)
sys.exit(1)
"""


def parsed_config(command: str, commit: str, root: Path = ROOT, given_only: bool = False) -> dict | None:
    """The arguments `python scripts/X.py ARGS` resolved, as X's own parser read them at `commit` (its defaults
    then, not today's): X's source from git, run only up to its parse, in a child process. `given_only`: only the
    options the command names (where `commit` is not certainly the run's own code, its defaults may not be what the
    run read). None when the command is not a script's, git lacks that commit's file, its source no longer imports
    or takes over 2 minutes to reach its parse."""
    import shlex
    import subprocess

    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    if len(argv) < 2 or argv[0] != "python" or not argv[1].startswith("scripts/") or not argv[1].endswith(".py"):
        return None
    commit = commit.split("+")[0].split(",")[0]
    src = subprocess.run(["git", "show", f"{commit}:{argv[1]}"], capture_output=True, text=True, cwd=root)
    if src.returncode:
        return None
    try:
        p = subprocess.run([sys.executable, "-c", _PARSE_ONLY, str(root / argv[1]), *argv[2:]], input=src.stdout,
                           capture_output=True, text=True, cwd=root, timeout=120)
    except subprocess.TimeoutExpired:
        return None
    if p.returncode:
        return None
    from expertcache.runtime.bench.results import portable

    got = json.loads(p.stdout.strip().splitlines()[-1])
    cfg = {k: v for k, v in got["all"].items() if not given_only or k in got["given"]}
    return portable(cfg)


def recover(d: dict, path: Path) -> list[str]:
    """What git history truthfully gives a result that lacks it (see the module's doc); what was added."""
    from expertcache.telemetry.provenance import last_commit

    added = []
    if machine_paths(d):
        clean = portable_payload(d)
        if clean is not d:  # (else left as it is: the table still counts its machine paths)
            d.clear()
            d.update(clean)
            added.append("portable paths")
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
    cmd, commit = command_of(d), commit_of(d)
    if not d.get("config") and config_of(d, path) is None and cmd and commit:
        prov = d.get("provenance") if isinstance(d.get("provenance"), dict) else {}
        # the run's own clean commit: its script's defaults are the run's; a commit git log gave (the one that added
        # the file: the run's code is it or an earlier one) or a dirty tree: only what the command itself names
        own = not prov.get("recovered_from") and "+" not in commit and prov.get("dirty") is not True
        cfg = parsed_config(cmd, commit, path.resolve().parents[1], given_only=not own)
        if cfg is not None:
            script = cmd.split()[1]
            c = commit.split("+")[0]
            d["config"] = cfg
            d["config_recovered_from"] = (
                f"the command, parsed by {script} as it was at {c} (the run's own commit; the last command that "
                f"wrote the file)" if own else
                f"the options the command names, parsed by {script} as it was at {c} (the last commit that changed the "
                f"file: the run's code is that commit's or an earlier one's, so its defaults are not recorded)")
            added.append("config")
    doc = DOCUMENTED.get(path.name)
    if doc and command_of(d) is None and doc[0] in " ".join((ROOT / doc[1]).read_text().split()):  # (lines wrap)
        d["command"], d["command_recovered_from"] = doc
        added.append("command")
    return added


def _git(root: Path, *args: str) -> str:
    import subprocess

    p = subprocess.run(["git", *args], capture_output=True, text=True, cwd=root)
    return p.stdout if p.returncode == 0 else ""


def _written_at(root: Path, name: str, rows: list) -> tuple[str, str] | None:
    """(commit, path) where git last wrote these rows: the last commit that added or changed `results/<name>`
    (following renames), or, for a copy added whole, the results file it equals in the parent commit and that
    file's own last change."""
    log = _git(root, "log", "--follow", "--diff-filter=AM", "--format=%h", "--name-only", "-1", "--", f"results/{name}")
    parts = log.split()
    if len(parts) != 2:
        return None
    c, path = parts
    if _git(root, "log", "-1", "--diff-filter=A", "--format=%h", c, "--", path).strip() == c:  # added whole: a copy?
        for other in _git(root, "ls-tree", "--name-only", f"{c}~1", "results/").split():
            if other.endswith(".json") and other != path:
                try:
                    if json.loads(_git(root, "show", f"{c}~1:{other}") or "null") == rows:
                        c = _git(root, "log", "-1", "--format=%h", f"{c}~1", "--", other).strip()
                        return (c, other) if c else None
                except json.JSONDecodeError:
                    continue
    return c, path


def recover_rows(d: list, path: Path) -> list[str]:
    """A frontier's list of rows without commit or configuration: each row gets them as the frontier recipe
    writes them today (`commit`, `command`, `config`: recipe, base, split, variant, evaluation sizes), from the
    recipe whose YAML, at the commit that wrote the rows, names that output (`frontier.out`; failing that, its text
    names the file); only when exactly one recipe does and every row is that recipe's base, control or a variant of
    it. A row with a config of its own, or with another commit, is left as it is."""
    import yaml

    added = []
    if machine_paths(d):
        clean = portable_payload(d)
        if clean is not d:
            d[:] = clean
            added.append("portable paths")
    if not d or not all(isinstance(r, dict) and r.get("name") for r in d) or all(r.get("config") for r in d):
        return added
    root = path.resolve().parents[1]
    at = _written_at(root, path.name, d)
    if at is None:
        return added
    c, written = at
    found = []
    for f in _git(root, "ls-tree", "--name-only", c, "recipes/cache-aware/").split():
        if not f.endswith(".yaml"):
            continue
        text = _git(root, "show", f"{c}:{f}")
        try:
            y = yaml.safe_load(text) or {}
        except yaml.YAMLError:
            continue
        fr = y.get("frontier") if isinstance(y, dict) else None
        if isinstance(fr, dict) and (fr.get("out") == written or written in text):
            found.append((f, y, fr))
    exact = [x for x in found if x[2].get("out") == written]
    if len(exact) == 1:
        found = exact
    if len(found) != 1:
        return added
    f, y, fr = found[0]
    variants = fr.get("variants") or {}
    if not all(r["name"] in ("base", fr.get("control", "control"), *variants) for r in d):
        return added
    for r in d:
        if r.get("config") or r.get("commit", c) != c:  # a row's own record, or one from another commit: left
            continue
        lossy = r.get("serving") == "reroute"
        keys = ("tasks", "limit", "ppl_blocks", "seq_len", "accuracy")
        sizes = {k: fr[("lossy_" if lossy else "") + k] for k in keys if ("lossy_" if lossy else "") + k in fr}
        r.setdefault("commit", c)
        r.setdefault("command", f"expertcache train-cache-aware --recipe {y.get('name')}")
        r["config"] = {"recipe": y.get("name"), "base": y.get("base"), "split": fr.get("split", "test"),
                       "variant": list(variants.get(r["name"], [])), "eval": sizes}
        r["config_recovered_from"] = (f"{f} at {c}, the last commit that changed the rows (then {written}): the "
                                      f"run's recipe is that commit's or an earlier one's")
    return added + ["commit", "config", "command"]


def rows(results: Path, write: bool = False) -> list[dict]:
    out = []
    for p in sorted(results.glob("*.json")):
        d = json.loads(p.read_text())
        added = []
        if write and isinstance(d, (dict, list)):
            added = recover(d, p) if isinstance(d, dict) else recover_rows(d, p)
            if added:
                from expertcache.telemetry.atomic import write_json

                write_json(p, d)
        n, same = claims(d)
        out.append({"file": p.name, "commit": commit_of(d), "config": config_of(d, p), "command": command_of(d),
                    "machine_paths": machine_paths(d),
                    "claims_rechecked": n, "claims_same": same, "added": added,
                    "list": isinstance(d, list)})
    return out


def table(rs: list[dict]) -> str:
    lines = ["| file | commit | configuration | command named | machine paths | claims re-decided (same) | added now |",
             "|---|---|---|---|---|---|---|"]
    for r in rs:
        rechecked = f"{r['claims_rechecked']} ({r['claims_same']})" if r["claims_rechecked"] else "—"
        lines.append(f"| {r['file']} | {r['commit'] or ('— (a list)' if r['list'] else '—')} | {r['config'] or '—'} | "
                     f"{'yes' if r['command'] else '—'} | {r['machine_paths'] or '—'} | "
                     f"{rechecked} | "
                     f"{', '.join(r['added']) or '—'} |")
    n = len(rs)
    lines.append(f"\n{n} files: commit {sum(bool(r['commit']) for r in rs)}, configuration "
                 f"{sum(bool(r['config']) for r in rs)}, command {sum(bool(r['command']) for r in rs)}, all three "
                 f"{sum(bool(r['commit'] and r['config'] and r['command']) for r in rs)}, with machine paths "
                 f"{sum(bool(r['machine_paths']) for r in rs)}; claims re-decided "
                 f"{sum(r['claims_rechecked'] for r in rs)}, the same {sum(r['claims_same'] for r in rs)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(ROOT / "results"))
    ap.add_argument("--write", action="store_true", help="add the provenance git history recovers")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    a = ap.parse_args(argv)
    if not Path(a.results).is_dir():
        from expertcache.telemetry.errors import InputError

        raise InputError(f"--results {a.results}: no such folder")
    rs = rows(Path(a.results), a.write)
    print(json.dumps(rs, indent=2) if a.json else table(rs))
    return 0 if all(r["claims_rechecked"] == r["claims_same"] for r in rs) else 1


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
