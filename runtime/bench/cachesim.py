"""Cache simulator speed: `expertcache bench cachesim`, on the real Qwen3-30B-A3B routing shipped in
telemetry/reference."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from expertcache.telemetry.errors import check_counts

from expertcache.runtime.bench.replay import REFERENCE_DIR as REF

TARGETS = {"lru": 2e6, "lfu": 2e6, "static": 2e6, "learned": 5e5}


def _time(fn, rounds: int) -> tuple[float, float, object]:
    """(first call's seconds, median of `rounds` further calls, the result)."""
    t = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return first, statistics.median(times), out


def _verify(ids, e: int, policy_file: Path) -> dict:
    """Hits of the compiled paths against CacheState driven step by step, on a slice (the definition)."""
    from expertcache.telemetry.cache import CacheState
    from expertcache.telemetry.cachesim import _pins, drive, global_steps, simulate
    from expertcache.telemetry.learned_policy import LearnedPolicy, simulate_learned

    sub = ids[:6, :300]
    out = {}
    for cap in (4, 16, 64):
        for pol in ("lru", "lfu", "static"):
            for name, steps, c in (("layer", sub[2], cap), ("global", global_steps(sub, e), cap * 6)):
                pins = _pins(steps, c) if pol == "static" else None
                want = drive(steps.tolist(), CacheState(c, 8, pol, pins))[0]
                got = simulate(steps, c, pol, "token").hits
                out[f"{pol}/{name}/{cap}"] = got == want
        pol = LearnedPolicy.load(policy_file, num_layers=6)
        got = simulate_learned(pol, sub, [cap], budget="layer")[cap]["hits"]
        scorer = LearnedPolicy.load(policy_file, num_layers=6)
        want = 0
        for i in range(6):
            st = CacheState(cap, 8, "scored")
            scorer.reset()
            for t in range(sub.shape[1]):
                for j in range(i + 1):  # the scorer of layer i needs layers < i of the same token first
                    scores = scorer(j, None, sub[j, t])
                step = sub[i, t].tolist()
                miss = [x for x in step if st.lookup(x) is None]
                want += len(step) - len(miss)
                st.retain(step, st.stage(miss), scores)
        out[f"learned/layer/{cap}"] = got == want
    return {"all_equal": all(out.values()), "checks": len(out), "slice": "6 layers x 300 tokens",
            "failed": [k for k, v in out.items() if not v]}


def bench_cachesim(rounds: int = 3, work: Optional[str] = None, out: Optional[str] = None) -> dict:
    """Cache simulator speed on the Qwen3-30B-A3B routing shipped in telemetry/reference, and `expertcache analyze`
    of that trace end to end.

    48 layers x 8,000 tokens x top-8 = 3.07 M accesses per pass. `accesses_per_s[policy]`: token semantics,
    capacity 1/8 of E, the slower of one cache per layer and one global budget; the median of `--rounds` rounds
    after a warm-up call (numba compiles once; the first call's time is reported apart). `learned` includes
    computing the policy's keep scores for the whole trace (one capacity from scratch); `learned_amortized` is what
    analyze pays per access when one pass of scores feeds its 5 capacities x 2 budgets. `analyze_reference_s`: the
    wall time of `expertcache analyze` in a fresh process (imports included) on the trace imported to Parquet;
    `analyze_reference_learned_s`: the same with a policy fitted on the general trace. `verified`: on a slice, every
    policy's hits equal the cache state driven step by step. Targets: LRU, LFU, static >= 2 M accesses/s; learned
    >= 0.5 M/s; Belady <= 1.5 s per 1 M accesses; analyze <= 30 s, <= 90 s with the learned policy. Run it alone.

    Args:
        rounds: timed rounds per figure (the median is reported)
        work: a folder of this command's own for the Parquet trace and the policy file, reused by the next run
            (default: a temporary one, removed at the end)
        out: also write the JSON here
    """
    config = dict(locals())
    import numpy as np

    from expertcache.telemetry.atomic import check_output, own_dir

    from expertcache.runtime.bench.results import command_line, started, write_result

    check_counts(rounds=rounds)
    check_output(out)
    # the command's own folder (new, empty or its earlier one), claimed before any work; else a temporary one
    folder = own_dir(work, "bench cachesim") if work else Path(tempfile.mkdtemp(prefix="bench_cachesim_"))
    prov = started()  # the code and the machine, before the work
    from expertcache.telemetry.cachesim import capacity_count, global_steps, simulate
    from expertcache.telemetry.learned_policy import LearnedPolicy, simulate_learned

    ids = np.load(REF / "code.npz", allow_pickle=False)["experts"].astype(np.int64)  # [48, 8000, 8]
    n_l, n_t, k = ids.shape
    e = 128
    cap = capacity_count(0.125, e)
    acc = int(ids.size)
    g = global_steps(ids, e)
    fit = ids[:, : n_t // 5]
    cli = [sys.executable, "-m", "expertcache.recipes.cli"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")

    trace, policy = folder / "code.parquet", folder / "general.policy"
    if not trace.is_file():
        subprocess.run(cli + ["trace", "import", "--src", str(REF / "code.npz"), "--out", str(trace), "--domain",
                              "code", "--model_name", "Qwen3-30B-A3B"], check=True, capture_output=True, env=env)
    fit_s = None
    if not policy.is_file():
        t = time.perf_counter()
        subprocess.run(cli + ["fit-policy", "--trace", f"[{REF / 'general.npz'}]", "--out", str(policy)], check=True,
                       capture_output=True, env=env)
        fit_s = round(time.perf_counter() - t, 1)

    res = {"benchmark": "cachesim", "commit": prov["commit"], "dirty": prov["dirty"],
           "input": f"telemetry/reference/{REF.name}/code.npz: {n_l} layers x {n_t} tokens x top-{k}, E={e}",
           "accesses_per_pass": acc, "capacity": {"per_layer": cap, "global": cap * n_l, "fraction_of_e": 0.125},
           "semantics": "token", "rounds": rounds,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "simulator_threads": 1, "blas_env": {k: v for k, v in os.environ.items()
                                                             if k.startswith(("OPENBLAS", "OMP", "MKL"))}},
           "details": {}}
    rates = {}
    for pol in ("lru", "lfu", "static", "belady"):
        for budget, steps, c, f in (("per_layer", None, cap, fit), ("global", g, cap * n_l, global_steps(fit, e))):
            if steps is None:
                def run(pol=pol, f=f):
                    return sum(simulate(ids[i], cap, pol, "token", fit=f[i] if pol == "static" else None).hits
                               for i in range(n_l))
            else:
                def run(pol=pol, steps=steps, c=c, f=f):
                    return simulate(steps, c, pol, "token", fit=f if pol == "static" else None).hits
            first, med, hits = _time(run, rounds)
            res["details"][f"{pol}/{budget}"] = {"first_call_s": round(first, 3), "seconds": round(med, 4),
                                                 "accesses_per_s": round(acc / med), "hit_rate": round(hits / acc, 4)}
        rates[pol] = min(res["details"][f"{pol}/{b}"]["accesses_per_s"] for b in ("per_layer", "global"))
    for pol in ("lru", "lfu"):
        first, med, hits = _time(lambda pol=pol: simulate(g, cap * n_l, pol, "reference").hits, rounds)
        res["details"][f"{pol}/global/reference"] = {"first_call_s": round(first, 3), "seconds": round(med, 4),
                                                     "accesses_per_s": round(acc / med),
                                                     "hit_rate": round(hits / acc, 4)}

    pol = LearnedPolicy.load(policy, num_experts=e, top_k=k, num_layers=n_l)
    first, med, r = _time(lambda: simulate_learned(pol, ids, [cap], None, "layer")[cap]["hits"], rounds)
    res["details"]["learned/per_layer"] = {"first_call_s": round(first, 3), "seconds": round(med, 3),
                                           "accesses_per_s": round(acc / med), "hit_rate": round(r / acc, 4),
                                           "includes": "keep scores for the whole trace + one capacity's simulation"}
    caps = sorted({capacity_count(f, e) for f in (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)})
    _, med_all, _ = _time(lambda: simulate_learned(pol, ids, caps, None, ("layer", "global")), max(1, rounds - 2))
    res["details"]["learned/analyze_set"] = {"seconds": round(med_all, 3), "capacities": caps,
                                             "budgets": ["per_layer", "global"],
                                             "accesses_per_s": round(acc * len(caps) * 2 / med_all)}
    rates["learned"] = res["details"]["learned/per_layer"]["accesses_per_s"]
    res["accesses_per_s"] = rates
    res["learned_amortized_accesses_per_s"] = res["details"]["learned/analyze_set"]["accesses_per_s"]
    res["belady_s_per_million"] = round(max(res["details"][f"belady/{b}"]["seconds"]
                                            for b in ("per_layer", "global")) * 1e6 / acc, 3)

    times = {}
    for key, extra in (("analyze_reference_s", []), ("analyze_reference_learned_s", ["--policy_file", str(policy)])):
        t = time.perf_counter()
        r = subprocess.run(cli + ["analyze", "--trace", str(trace), "--out", str(folder / key)] + extra,
                           capture_output=True, text=True, env=env)
        times[key] = round(time.perf_counter() - t, 1)
        if r.returncode != 0:
            raise RuntimeError(f"expertcache analyze failed on the reference trace:\n{r.stderr}")
    res |= times
    res["policy_fit_s"] = fit_s
    res["verified"] = _verify(ids, e, policy)
    if not work:  # a temporary folder of this run only
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    res["targets"] = {"accesses_per_s": TARGETS, "belady_s_per_million": 1.5, "analyze_reference_s": 30,
                      "analyze_reference_learned_s": 90}
    res["pass"] = (all(rates[p] >= v for p, v in TARGETS.items()) and res["belady_s_per_million"] <= 1.5
                   and times["analyze_reference_s"] <= 30 and times["analyze_reference_learned_s"] <= 90
                   and res["verified"]["all_equal"])
    if out:
        res = write_result(out, res, config, command_line("bench cachesim", bench_cachesim, config), provenance=prov)
    return res


