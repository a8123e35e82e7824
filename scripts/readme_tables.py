"""Print the README's result tables from the committed results (so every figure there can be regenerated).

    python scripts/readme_tables.py            # all of them, markdown, in README order
"""

import json
from pathlib import Path

from expertcache.runtime.bench import bench
from expertcache.runtime.bench import bigbench
from expertcache.runtime.bench import replay
from expertcache.trainer.cache_aware import frontier_table

RESULTS = Path(__file__).resolve().parents[1] / "results"
TABLES = [("bench_big.json", bigbench.table), ("bench_big_native.json", bigbench.table),
          ("bench_big_16gb.json", bigbench.table),
          ("bench_decode_0.87gb.json", bench.table), ("replay_bf16.json", replay.table)]



def cachesim_table(d: dict) -> str:
    """results/bench_cachesim.json -> the simulator's speed on the reference trace, against the targets."""
    t = d["targets"]
    rows = ["| figure | measured | target |", "|---|---|---|"]
    for pol, v in d["accesses_per_s"].items():
        tgt = t["accesses_per_s"].get(pol)
        rows.append(f"| {pol}: accesses/s | {v / 1e6:.2f} M | {f'>= {tgt / 1e6:g} M' if tgt else '—'} |")
    rows.append(f"| learned, amortised over analyze's 10 caches: accesses/s | "
                f"{d['learned_amortized_accesses_per_s'] / 1e6:.2f} M | — |")
    rows.append(f"| Belady: s per 1 M accesses | {d['belady_s_per_million']} | <= {t['belady_s_per_million']} |")
    rows.append(f"| `analyze` of the reference trace (48 x 8,000 tokens) | {d['analyze_reference_s']} s | "
                f"<= {t['analyze_reference_s']} s |")
    rows.append(f"| the same with `--policy_file` | {d['analyze_reference_learned_s']} s | "
                f"<= {t['analyze_reference_learned_s']} s |")
    return "\n".join(rows)


def kernels_table(d: dict, pairs_only: bool = False) -> str:
    """results/kernels.json -> expert kernels against memory bandwidth, and decode against llama.cpp (each pair's
    per-round figures beside its medians: the 2-thread rounds swing on this host)."""
    rows = []
    if not pairs_only:
        rows = ["| format | threads | one token through | time | GB/s | memory read GB/s | fraction (target >= 0.7 at "
                "1 thread, experts) |", "|---|---|---|---|---|---|---|"]
        for k in d["kernels"]:
            g = f" (group {k['group']})" if k["group"] else ""
            what = k.get("kind", "8 experts of 2048x768")
            rows.append(f"| {k['format']}{g} | {k['threads']} | {what} | {k['ms']:.2f} ms | {k['gbps']:.1f} | "
                        f"{k['read_bandwidth_gbps']:.1f} | {k['fraction_of_read_bandwidth']:.2f} |")
    if d.get("pairs"):
        depth = d.get("depth") or 0
        ctx = f", {depth} tokens of context" if depth else ""
        rows += [""] if rows else []
        bw = any(x is not None for p in d["pairs"] for x in p.get("expertcache_read_bandwidth_gbps") or [])
        rows += [f"| decode, all experts resident{ctx} | threads | expertcache | llama.cpp | ratio (target <= 1.25) | "
                 "rounds: expertcache / llama.cpp (ms) |" + (" our process's memory read GB/s, by round |" if bw else ""),
                 "|---|---|---|---|---|---|" + ("---|" if bw else "")]
        order = ("bf16", "int8", "q8_0-file", "int4", "int4-sym", "q4_0-file", "int4-g128")
        for p in sorted(d["pairs"], key=lambda p: (p["threads"], order.index(p["format"]))):
            lin = " (+ linears)" if p.get("expertcache_linears_packed") else ""
            rr = " ".join(f"{x * 1e3:.1f}" for x in p["expertcache_rounds_s"])
            pr = " ".join(f"{x * 1e3:.1f}" for x in p["llamacpp_rounds_s"])
            extra = ""
            if bw:
                extra = " " + " ".join("—" if x is None else f"{x:.0f}"
                                       for x in p.get("expertcache_read_bandwidth_gbps") or []) + " |"
            rows.append(f"| {p['format']}{lin} vs {p['llamacpp_format']} | {p['threads']} | "
                        f"{p['expertcache_tpot_s'] * 1e3:.1f} ms | {p['llamacpp_tpot_s'] * 1e3:.1f} ms | "
                        f"{p['ratio']:.2f} | {rr} / {pr} |{extra}")
    return "\n".join(rows)


def serve_load_table(d: dict) -> str:
    """results/serve_load.json -> batched serving against one client, at 1/4 of the experts and all resident."""
    rows = ["| experts resident | clients | tokens/s | x one client | TPOT p50 / p99 | TTFT p50 / p99 | mean batch | "
            "hit rate | KiB moved/token | equal to alone |", "|---|---|---|---|---|---|---|---|---|---|"]
    names = {"quarter": "1/4 (tier auto: host)", "quarter_disk": "1/4 (tier disk)", "all_resident": "all"}
    for sys_, v in d["systems"].items():
        for r in v["rounds"]:
            hr = "—" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
            kib = "—" if r["bytes_moved_per_token"] is None else f"{r['bytes_moved_per_token'] / 1024:.1f}"
            rows.append(f"| {names.get(sys_, sys_)} | {r['clients']} | {r['tokens_per_s']:.0f} | "
                        f"{r['speedup_vs_1']:.2f} | {r['tpot_p50_s'] * 1e3:.1f} / {r['tpot_p99_s'] * 1e3:.1f} ms | "
                        f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p99_s'] * 1e3:.0f} ms | {r['mean_batch']:.1f} | {hr} | "
                        f"{kib} | {r['equal_to_alone']}/{r['requests']} |")
    return "\n".join(rows)


def calibration_table(d: dict) -> str:
    """results/gate_calibration.json -> the gate's verdicts on a real model against itself, a harmless change and a
    +3% degradation, at eval's default sample and on the whole pool."""
    n, pool = d["sample_blocks_per_domain"], d["pool_blocks_per_domain"]
    rows = [f"| candidate against the base | Δppl overall on the pool (per seed) | verdicts at {n} blocks per domain | "
            f"verdicts at {pool} blocks per domain |", "|---|---|---|---|"]
    names = {"null_exact": "itself, evaluated again by the other step-wise path",
             "null_harmless": f"weights + noise set to {d['harmless_pct']:+g}% on the pool (a harmless change)",
             "degraded": f"weights + noise set to {d['target_pct']:+g}% on {d['calib_blocks_per_domain']} blocks per "
                         f"domain (a real degradation)"}
    for k, c in d["conditions"].items():
        lo, hi = c["dppl_pct_pool_range"]
        fmt = lambda v: ", ".join(f"{x} {v[x]}" for x in ("PASS", "INCONCLUSIVE", "FAIL") if v.get(x))  # noqa: E731
        rows.append(f"| {names.get(k, k)} | {lo:+.3f}% .. {hi:+.3f}% | {fmt(c['verdicts_sample'])} | "
                    f"{fmt(c['verdicts_pool'])} |")
    s = d["stepwise_paths"]
    rows += ["", f"Step-wise paths on the same {s['blocks']} blocks of {d['seq_len']} tokens ({d['threads']} threads): "
                 f"batched {s['batched_s']:.1f} s, token by token {s['token_s']:.1f} s ({s['speedup']:.1f}x); largest "
                 f"relative difference of a block's NLL {s['max_rel_diff_block_nll']:.1e}."]
    return "\n".join(rows)


def quantized_table(d: dict) -> str:
    """results/quantized.json -> each expert format's quality cost (gate on paired intervals) beside its bytes."""
    rows = ["| experts | Δppl overall [95%] | worst domain [95%] | Δacc (points) | gate | bytes vs bf16 | "
            "worst layer rel. error | TPOT at 1/4 (ms) | KiB moved/token |", "|---|---|---|---|---|---|---|---|---|"]
    on_miss = [r for r in d["rows"] if "capacity" in r]
    for r in d["rows"]:
        if r in on_miss:
            continue
        lo, hi = r["dppl_overall_ci95"]
        dlo, dhi = r["dppl_max_domain_ci95"]
        acc = ", ".join(f"{t.removeprefix('ec_')} {v:+.1f}" for t, v in r["dacc_points"].items())
        err = "—" if r.get("relative_error_max") is None else f"{r['relative_error_max']:.4f}"
        tpot = f"{r['tpot_s'] * 1e3:.2f}" if r.get("tpot_s") else "—"
        kib = f"{r['traffic_bytes_per_token'] / 1024:.0f}" if r.get("traffic_bytes_per_token") is not None else "—"
        rows.append(f"| {r['name']} | {r['dppl_overall_pct']:+.3f}% [{lo:+.3f}, {hi:+.3f}] | "
                    f"{r['dppl_max_domain_pct']:+.3f}% [{dlo:+.3f}, {dhi:+.3f}] | {acc} | {r['gate']} | "
                    f"{r['expert_bytes_ratio']:.3f} | {err} | {tpot} | {kib} |")
    if on_miss:  # 4-bit on miss: a cache policy, priced against blocking at the same capacity
        rows += ["", "| policy | capacity (of E) | Δppl overall [95%] | worst domain [95%] | Δacc (points) | gate | "
                     "KiB moved/token (blocking) | TPOT ms (blocking) |", "|---|---|---|---|---|---|---|---|"]
        for r in on_miss:
            lo, hi = r["dppl_overall_ci95"]
            dlo, dhi = r["dppl_max_domain_ci95"]
            acc = ", ".join(f"{t.removeprefix('ec_')} {v:+.1f}" for t, v in r["dacc_points"].items())
            mv, bmv = r.get("bytes_moved_per_token"), r.get("blocking_bytes_moved_per_token")
            tp, btp = r.get("tpot_s"), r.get("blocking_tpot_s")
            rows.append(f"| {r['name'].split('@')[0]} | {r['capacity']:g} | {r['dppl_overall_pct']:+.3f}% "
                        f"[{lo:+.3f}, {hi:+.3f}] | {r['dppl_max_domain_pct']:+.3f}% [{dlo:+.3f}, {dhi:+.3f}] | {acc} | "
                        f"{r['gate']} | " + (f"{mv / 1024:.0f} ({bmv / 1024:.0f})" if mv is not None and bmv else "—")
                        + " | " + (f"{tp * 1e3:.2f} ({btp * 1e3:.2f})" if tp and btp else "—") + " |")
    return "\n".join(rows)


if (RESULTS / "quantized.json").is_file():
    d = json.loads((RESULTS / "quantized.json").read_text())
    print(f"<!-- results/quantized.json ({d['command']}) -->")
    print(quantized_table(d), end="\n\n")

if (RESULTS / "gate_calibration.json").is_file():
    d = json.loads((RESULTS / "gate_calibration.json").read_text())
    print(f"<!-- results/gate_calibration.json ({d['command']}; git {d.get('commit') or d.get('git_commit', '?')}) -->")
    print(calibration_table(d), end="\n\n")

if (RESULTS / "serve_load.json").is_file():
    d = json.loads((RESULTS / "serve_load.json").read_text())
    print(f"<!-- results/serve_load.json (python scripts/load_test.py --throughput; git {d.get('commit', '?')}) -->")
    print(serve_load_table(d), end="\n\n")

# the kernels and every decode against llama.cpp (the first with its kernel rows, the others pairs only)
for name in ("kernels.json", "kernels_file.json", "kernels_int4_2t.json", "kernels_depth1024.json"):
    if (RESULTS / name).is_file():
        d = json.loads((RESULTS / name).read_text())
        print(f"<!-- results/{name} ({d['command']}) -->")
        print(kernels_table(d, pairs_only=name != "kernels.json"), end="\n\n")

if (RESULTS / "bench_cachesim.json").is_file():
    d = json.loads((RESULTS / "bench_cachesim.json").read_text())
    print(f"<!-- results/bench_cachesim.json (python scripts/bench_cachesim.py; git {(d.get('commit') or '?')[:7]}) -->")
    print(cachesim_table(d), end="\n\n")

for name, fn in TABLES:
    p = RESULTS / name
    if p.is_file():
        print(f"<!-- results/{name} (git {json.loads(p.read_text()).get('git_commit', '?')}) -->")
        print(fn(json.loads(p.read_text())), end="\n\n")
# the post-training frontier and the first losses re-gated the same way (lists of rows)
for name, recipe in (("frontier.json", "frontier"), ("frontier_earlier.json", "frontier-earlier")):
    if (RESULTS / name).is_file():
        print(f"<!-- results/{name} (train-cache-aware --recipe {recipe}) -->")
        print(frontier_table(json.loads((RESULTS / name).read_text())), end="\n\n")
