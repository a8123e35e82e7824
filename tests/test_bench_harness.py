"""The one benchmark tool (issue 43 item 3): the alternation harness and its claim rule on planted timings, the
result writer's provenance, the child-process runner (its cgroup, its stale cgroups, its peak memory) and the
registry of bench big's systems."""

import json
import os
import sys
import textwrap
from dataclasses import dataclass

import pytest

from expertcache.telemetry.errors import InputError


def test_the_harness_alternates_and_claims_only_apart_rounds():
    """Arms alternate A B C / C B A (the baseline may lead every round instead); a planted arm that is faster in
    every round is claimed against the baseline, one whose rounds straddle the baseline's is not, and neither is
    one with fewer than 3 rounds."""
    from expertcache.runtime.bench.harness import alternate, claimed, compare, order

    planted = {"base": [1.00, 1.02, 0.98, 1.01], "fast": [0.80, 0.82, 0.79, 0.81], "noisy": [0.95, 1.05, 0.97, 1.03]}
    calls = []

    def run(arm, r):
        calls.append(arm)
        return planted[arm][r]

    res = alternate(["base", "fast", "noisy"], 4, run)
    assert calls == ["base", "fast", "noisy", "noisy", "fast", "base"] * 2
    assert res == planted  # each arm's rounds in round order, whatever order they ran in
    calls.clear()
    alternate(["base", "fast", "noisy"], 2, run, keep_first=True)
    assert calls == ["base", "fast", "noisy", "base", "noisy", "fast"]
    assert order(["a", "b"], 1) == ["b", "a"] and order(["a", "b", "c"], 1, keep_first=True) == ["a", "c", "b"]
    assert claimed(res["fast"], res["base"]) and claimed(res["base"], res["fast"])
    assert not claimed(res["noisy"], res["base"])
    assert not claimed(res["fast"][:2], res["base"][:2])  # apart, but two rounds claim nothing
    c = compare(res["fast"], res["base"])
    assert c["claimed"] and c["ratio"] == pytest.approx(0.805 / 1.005) and c["a_rounds_s"] == [0.79, 0.82]
    with pytest.raises(ValueError, match="named twice"):
        alternate(["a", "a"], 1, run)


@dataclass
class _Cfg:
    tier: str = "disk"
    capacity: float = 0.25


def test_the_result_writer_always_records_provenance_and_configuration(tmp_path, monkeypatch):
    """Every result carries the commit it came from (this checkout's HEAD) with its dirty flag, the machine, the
    threads and torch, the resolved configuration (dataclasses and paths made plain) and the command."""
    import torch

    from expertcache.runtime.bench.results import write_result
    from expertcache.telemetry.provenance import rev_parse

    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["expertcache", "bench", "decode", "--out", str(out)])
    wrote = write_result(out, {"tpot_median_s": 0.25}, config={"engine": _Cfg(), "out": tmp_path, "rounds": 3})
    back = json.loads(out.read_text())
    assert back == json.loads(json.dumps(wrote, default=str))
    p = back["provenance"]
    assert p["commit"] == rev_parse("HEAD") != "" and isinstance(p["dirty"], bool)
    assert p["machine"]["cores"] == os.cpu_count() and p["machine"]["memory_bytes"] > 2**30
    assert p["threads"] == torch.get_num_threads() and p["torch"] == torch.__version__ and p["date"].endswith("Z")
    # no machine's folders in a result: a path outside the repository keeps only its last name
    assert back["config"] == {"engine": {"tier": "disk", "capacity": 0.25}, "out": f".../{tmp_path.name}", "rounds": 3}
    assert back["command"] == "expertcache bench decode --out .../r.json" and back["tpot_median_s"] == 0.25
    from helpers import REPO

    inside = write_result(tmp_path / "t.json", {}, config={"model": str(REPO / "runs" / "m")},
                          command=f"python {REPO}/scripts/x.py --model {REPO}/runs/m --n 2")
    assert inside["config"] == {"model": "runs/m"} and inside["command"] == "python scripts/x.py --model runs/m --n 2"
    r2 = write_result(tmp_path / "s.json", {}, command="python scripts/x.py", provenance=p, read_GBps=2.5)
    assert r2["provenance"]["machine"]["read_GBps"] == 2.5 and r2["command"] == "python scripts/x.py"
    assert p["machine"]["read_GBps"] is None  # the caller's provenance is not changed
    # nor in what the benchmark measured (load_test's model and server commands were): URLs and prose stay
    body = {"inputs": {"model": "/work/ckpt/q30-4l"}, "cmd": "serve --model /tmp/tput-x/model --port 1",
            "url": "/v1/chat/completions", "note": "a store on /tmp (tmpfs)", "tpot_s": [0.1]}
    got = write_result(tmp_path / "b.json", body, command="python scripts/x.py", provenance=p)
    assert got["inputs"] == {"model": ".../q30-4l"} and got["cmd"] == "serve --model .../model --port 1"
    assert got["url"] == body["url"] and got["note"] == body["note"] and got["tpot_s"] == [0.1]
    clash = {"per_model": {"/tmp/a/model": 1, "/tmp/b/model": 2}}  # would collide: written as it is, not lost
    assert write_result(tmp_path / "c.json", clash, command="x", provenance=p)["per_model"] == clash["per_model"]


def test_a_memory_cgroup_needs_root_and_stale_ones_are_removed_at_the_next_start(tmp_path, monkeypatch, capsys):
    """Without root there is no cgroup (and the run says why); a killed run's `expertcache-PID` cgroup whose
    process is gone is removed by the next start, with one line; a live process's is kept."""
    import subprocess

    from expertcache.runtime.bench import memcg

    root = tmp_path / "memory"
    root.mkdir()
    (root / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (root / f"expertcache-{dead}").mkdir()
    (root / f"expertcache-{os.getpid()}").mkdir()
    (root / "someone-else").mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert memcg.MemoryCgroup.create(1 << 30, v1=root, v2=tmp_path / "none") == (
        None, "not root: a memory cgroup needs root")
    assert (root / f"expertcache-{dead}").is_dir()  # nothing is touched without root
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    cg, why = memcg.MemoryCgroup.create(1 << 30, name="expertcache-new", v1=root, v2=tmp_path / "none")
    assert cg is None and "could not make a memory cgroup" in why  # a folder under /tmp is no cgroup file system
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted(
        [f"expertcache-{os.getpid()}", "expertcache-new", "someone-else"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"memory cgroup: removed 1 left by runs that are gone: expertcache-{dead}"]
    assert memcg.clean_stale(root) == [] and capsys.readouterr().err == ""


_CHILD = """
    import json, sys
    from expertcache.runtime.bench.runner import read_config
    cfg = read_config(sys.argv[1])
    block = bytearray(cfg["mib"] << 20)  # touched: resident
    print("a line before the result")
    own = {}
    if cfg.get("report"):  # the child's own peak, as bench big's children report it
        from expertcache.telemetry.memory import peak_rss_bytes
        own = {"peak_rss_bytes": peak_rss_bytes()}
    print(json.dumps({"mib": cfg["mib"], "system": cfg["system"], **own}))
    """


@pytest.mark.slow  # a child process that imports torch and allocates (5-7 s)
def test_the_runner_runs_a_config_file_in_a_child_and_reads_its_peak_memory(tmp_path, monkeypatch):
    """A configuration file crosses to a child process; its last stdout line is its result, with the child's own
    peak memory measured from its rusage (a 96 MiB allocation shows), and the cgroup's peak when one is made (as
    root, with a memory controller)."""
    from expertcache.runtime.bench.memcg import MemoryCgroup
    from expertcache.runtime.bench.runner import run_child, write_config

    (tmp_path / "childjob.py").write_text(textwrap.dedent(_CHILD))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = write_config(tmp_path / "job.yaml", {"system": "mmap", "mib": 96, "report": True})
    r = run_child("childjob", cfg, tmp_path / "job.log", drop_caches=False)
    assert r["mib"] == 96 and r["system"] == "mmap" and r["cgroup_peak_bytes"] is None
    assert 96 << 20 < r["peak_rss_bytes"] < 1 << 30 and r["page_cache_dropped"] is False
    assert r["peak_rss_source"] == "child VmHWM"
    # a child that reports nothing: its rusage, at least its allocation (and at least this process's peak: Linux
    # carries the parent's high-water mark across exec)
    quiet = write_config(tmp_path / "quiet.yaml", {"system": "mmap", "mib": 96})
    r = run_child("childjob", quiet, tmp_path / "quiet.log", drop_caches=False)
    assert r["peak_rss_bytes"] > 96 << 20 and r["peak_rss_source"].startswith("rusage")
    bad = write_config(tmp_path / "bad.yaml", {"system": "mmap"})  # no `mib`: the child fails
    r = run_child("childjob", bad, tmp_path / "bad.log", drop_caches=False)
    assert r["error"].startswith("exit 1; see ") and r["error"].endswith("KeyError: 'mib'")
    cg, why = MemoryCgroup.create(1 << 30, f"expertcache-test-{os.getpid()}")
    if cg is None:
        pytest.skip(why)
    try:
        r = run_child("childjob", cfg, tmp_path / "job.log", cg, drop_caches=False)
        assert 96 << 20 < r["cgroup_peak_bytes"] <= 1 << 30
    finally:
        cg.close()


def test_bench_big_refuses_a_system_nobody_registered_in_one_line(tmp_path, capsys):
    """Bench big's systems are registered runners: a name (or a variant) nobody registered is one line listing
    them all, before anything is written; every full name derives from the registry."""
    from expertcache.recipes.cli import main
    from expertcache.runtime.bench.bigbench import SYSTEM_REGISTRY, SYSTEMS, parse_system, system_entry

    listing = "expertcache:<config>, accelerate, mmap[:<unbounded>], llama.cpp[:<variant>], vllm[:<variant>]"
    for bad in ("sglang", "mmap:bounded", "vllm:offload", "expertcache:eager"):
        assert main(["bench", "big", "--systems", f"[{bad}]", "--out_dir", str(tmp_path / "d"),
                     "--out", str(tmp_path / "b.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"system {bad!r}" in err[0], err
        assert not (tmp_path / "d").exists()
    assert f"unknown system 'sglang'; expected one of: {listing}" in (
        pytest.raises(InputError, parse_system, "sglang").value.args[0])
    assert SYSTEM_REGISTRY.listing() == listing
    assert SYSTEMS == ("expertcache:on-demand", "expertcache:prefetch", "accelerate", "mmap", "mmap:unbounded",
                       "llama.cpp", "llama.cpp:unbounded", "llama.cpp:no-repack", "vllm", "vllm:unbounded")
    assert system_entry("llama.cpp:unbounded").native_only and not system_entry("llama.cpp").own_process
    assert system_entry("vllm:unbounded").native_only and not system_entry("vllm").own_process
    from expertcache.runtime.bench.bigbench import llamacpp_options

    assert llamacpp_options("llama.cpp:no-repack") == ("--repack", "0") and llamacpp_options("llama.cpp") == ()
    assert system_entry("expertcache:prefetch:int4/victims=false").own_process


def _check_results():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "check_results", Path(__file__).resolve().parents[1] / "scripts" / "check_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_check_results_recovers_only_what_git_history_and_the_configs_say(tmp_path, capsys):
    """`scripts/check_results.py --write` on a repository of its own: a result with no commit gets the commit that
    wrote it (`git log`, marked recovered); a `.config.yaml` whose values agree with the result's inputs and systems
    becomes its config and command, one that disagrees does not; every stored claim is re-decided by the one rule,
    and a planted wrong one fails the check."""
    import subprocess

    import yaml

    cr = _check_results()
    res = tmp_path / "results"
    res.mkdir()
    rounds = {"expertcache:on-demand": [0.20, 0.21, 0.22], "mmap": [0.90, 0.95, 1.00]}
    big = {"inputs": {"budget_gb": 8.0, "tokens": 48, "rounds": 3, "experts": ["bf16"]},
           "systems": {s: {"tpot_round_medians_s": r} for s, r in rounds.items()},
           "comparisons": {"expertcache:on-demand vs mmap": {"claimed": True}}, "git_commit": "abc1234"}
    cfg = {"budget_gb": 8.0, "tokens": 48, "rounds": 3, "systems": list(rounds), "experts": ["bf16"]}
    (res / "plain.json").write_text(json.dumps({"figure": 1.5}))
    (res / "big.json").write_text(json.dumps(big))
    (res / "big.config.yaml").write_text(yaml.safe_dump(cfg))
    (res / "other.json").write_text(json.dumps(big))
    (res / "other.config.yaml").write_text(yaml.safe_dump(dict(cfg, tokens=64)))  # not the run's
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "results"]):
        subprocess.run(git + cmd, cwd=tmp_path, check=True)
    head = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    assert cr.main(["--results", str(res), "--write"]) == 0
    plain = json.loads((res / "plain.json").read_text())
    assert plain == {"figure": 1.5, "provenance": {"commit": head, "dirty": None, "recovered_from": "git log"}}
    b, o = json.loads((res / "big.json").read_text()), json.loads((res / "other.json").read_text())
    assert b["config"] == cfg and b["config_recovered_from"] == "big.config.yaml"
    assert b["command"] == "expertcache bench big --config results/big.config.yaml" and "provenance" not in b
    assert "config" not in o and "command" not in o
    out = capsys.readouterr().out
    assert "| big.json | abc1234 | config | yes | — | 1 (1) | config, command |" in out, out
    assert ("3 files: commit 3, configuration 2, command 1, all three 1, with machine paths 0; claims re-decided 2, "
            "the same 2") in out
    # a list of rows (the frontier's) is traceable when every row records commit, command and config
    cmd = "expertcache train-cache-aware --recipe f"
    rows = [{"name": n, "commit": "abc1234", "command": cmd, "config": {"variant": []}} for n in "ab"]
    assert (cr.commit_of(rows), cr.command_of(rows), cr.config_of(rows, res / "f.json")) == ("abc1234", cmd, "config")
    assert cr.commit_of(rows + [{"name": "c"}]) is None and cr.config_of(rows + [{"name": "c"}], res / "f.json") is None
    o["comparisons"]["expertcache:on-demand vs mmap"]["claimed"] = False  # a claim the rounds do not give
    (res / "other.json").write_text(json.dumps(o))
    assert cr.main(["--results", str(res)]) == 1
    assert cr.main(["--results", str(res), "--write"]) == 1 and json.loads((res / "plain.json").read_text()) == plain


@pytest.mark.slow  # git history, and a child process that parses each script
def test_check_results_recovers_a_scripts_config_a_frontiers_rows_and_portable_paths(tmp_path, capsys):
    """`scripts/check_results.py --write` on a repository of its own: a result that names only `python
    scripts/x.py ARGS` gets the arguments x's own parser resolved at the commit the result records (a default
    changed since reads as it was then, and the script never runs past its parse); one whose default came from a
    project name that has moved gets none; a frontier's rows get commit, command and config from the recipe that
    named their output when they were written (a variant changed since reads as it was then); a path of the
    machine becomes portable, a URL path stays, and no number moves."""
    import subprocess

    cr = _check_results()
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]

    def commit(msg):
        for cmd in (["add", "-A"], ["commit", "-qm", msg]):
            subprocess.run(git + cmd, cwd=tmp_path, check=True)
        return subprocess.run(["git", "log", "-1", "--format=%h"], cwd=tmp_path, capture_output=True,
                              text=True).stdout.strip()

    subprocess.run(git + ["init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "scripts").mkdir()
    script = ("import argparse\n\ndef main(argv=None):\n    ap = argparse.ArgumentParser()\n"
              "    ap.add_argument('--rounds', type=int, default={d})\n    ap.add_argument('--out')\n"
              "    a = ap.parse_args(argv)\n    open('RAN', 'w').write('ran')\n")
    (tmp_path / "scripts" / "x.py").write_text(script.format(d=3))
    (tmp_path / "scripts" / "moved.py").write_text(
        "import argparse\nfrom expertcache.nowhere import ROUNDS\n\ndef main(argv=None):\n"
        "    ap = argparse.ArgumentParser()\n    ap.add_argument('--rounds', default=ROUNDS)\n    ap.parse_args(argv)\n")
    c1 = commit("scripts")
    res, rec = tmp_path / "results", tmp_path / "recipes" / "cache-aware"
    res.mkdir()
    rec.mkdir(parents=True)
    recipe = "name: fr\nbase: runs/b\nfrontier:\n  out: results/fr.json\n  control: control\n  variants:\n" \
             "    control: [x=0]\n    v1: [x={v}]\n  limit: 8\n  ppl_blocks: 4\n"
    (rec / "fr.yaml").write_text(recipe.format(v=1))
    a = {"command": "python scripts/x.py --out results/a.json", "provenance": {"commit": c1}, "figure": 2.5,
         "model": "/work/somewhere/ckpt", "url": "http://127.0.0.1:8000/v1/chat/completions"}
    (res / "a.json").write_text(json.dumps(a))
    (res / "b.json").write_text(json.dumps({"command": "python scripts/moved.py", "provenance": {"commit": c1}}))
    later = {"command": "python scripts/x.py --out results/c.json", "figure": 1.0,  # its commit from git log only
             "provenance": {"commit": c1, "dirty": None, "recovered_from": "git log"}}
    (res / "c.json").write_text(json.dumps(later))
    clash = {"command": "python scripts/nowhere.py", "provenance": {"commit": c1},
             "per_model": {"/work/a/model": 1, "/tmp/b/model": 2}, "note": "a store on /tmp (tmpfs)"}
    (res / "d.json").write_text(json.dumps(clash))
    rows = [{"name": "control", "serving": "plain", "miss_reduction_1_8": 0.1},
            {"name": "v1", "serving": "plain", "miss_reduction_1_8": 0.5}]
    (res / "fr.json").write_text(json.dumps(rows))
    c2 = commit("results")
    (tmp_path / "scripts" / "x.py").write_text(script.format(d=5))
    (rec / "fr.yaml").write_text(recipe.format(v=2))
    commit("later")
    assert cr.main(["--results", str(res), "--write"]) == 0
    got = json.loads((res / "a.json").read_text())
    assert got["config"] == {"rounds": 3, "out": "results/a.json"}, got["config"]  # the default at c1, not 5
    assert got["config_recovered_from"].startswith(f"the command, parsed by scripts/x.py as it was at {c1} (the run's")
    assert got["model"] == ".../ckpt" and got["url"] == a["url"] and got["figure"] == 2.5
    assert not (tmp_path / "RAN").exists()  # parsed, never run
    assert "config" not in json.loads((res / "b.json").read_text())
    c = json.loads((res / "c.json").read_text())  # the run's own defaults unknown: only what the command names
    assert c["config"] == {"out": "results/c.json"} and "defaults are not recorded" in c["config_recovered_from"]
    d = json.loads((res / "d.json").read_text())  # two keys would become one: left as it was, still counted
    assert d["per_model"] == clash["per_model"] and d["note"] == clash["note"] and cr.machine_paths(d) == 2
    fr = json.loads((res / "fr.json").read_text())
    assert [r["miss_reduction_1_8"] for r in fr] == [0.1, 0.5]
    assert all(r["commit"] == c2 and r["command"] == "expertcache train-cache-aware --recipe fr" for r in fr)
    assert [r["config"]["variant"] for r in fr] == [["x=0"], ["x=1"]]  # as the recipe was when they were written
    assert fr[1]["config"] == {"recipe": "fr", "base": "runs/b", "split": "test", "variant": ["x=1"],
                               "eval": {"limit": 8, "ppl_blocks": 4}}
    out = capsys.readouterr().out
    assert "| a.json | " + c1 + " | config | yes | — | — | portable paths, config |" in out, out
    assert "| fr.json | " + c2 + " | config | yes | — | — | commit, config, command |" in out, out
    assert cr.machine_paths({"p": ["/tmp/x/y"], "/root/k/v": 1}) == 2 and cr.machine_paths({"u": "/v1/models"}) == 0
    assert cr.machine_paths("a store on /tmp (tmpfs)") == 0
    mixed = [{"name": "control", "config": {"own": True}}, {"name": "v1", "commit": "0000000"}]
    assert cr.recover_rows(mixed, res / "fr.json") and mixed[0]["config"] == {"own": True} and "config" not in mixed[1]


def test_a_table_says_why_a_ratio_is_not_claimed():
    """Too few rounds and overlapping rounds are different reasons; a table printed the second for both (the
    48-layer run's 2,048-token prefill had one expertcache round)."""
    from expertcache.runtime.bench.harness import claim_text, compare

    assert claim_text(compare([1.0, 1.1, 1.2], [2.0, 2.1, 2.2])) == "yes"
    assert claim_text(compare([1.0, 2.1, 1.2], [2.0, 1.1, 2.2])) == "no: the rounds overlap"
    assert claim_text(compare([1.0], [2.0, 2.1, 2.2])) == "no: 1 round on one side, 3 needed"


def test_a_run_inside_a_longer_process_can_start_its_peak_memory_again():
    """`reset_peak_rss`: after 300 MB were written and freed, the process's peak still holds them; reset, the peak
    is the resident set of now (a frontier's streamed variant records its own peak, not the earlier variants')."""
    from expertcache.telemetry.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

    x = b"\1" * (300 << 20)  # written, so resident
    held = rss_bytes()
    del x
    assert peak_rss_bytes() > held - (16 << 20) and held > rss_bytes() + (200 << 20)  # freed; the peak remembers
    assert reset_peak_rss()
    assert peak_rss_bytes() < rss_bytes() + (100 << 20)
