"""The result tables of README.md and docs/*.md, generated from the committed results (so no figure there is typed
by hand and none can drift from its JSON).

    python scripts/readme_tables.py            # print every table, markdown
    python scripts/readme_tables.py --write    # rewrite each table between its markers in README.md and docs/*.md
    python scripts/readme_tables.py --check    # exit 1 naming each file whose tables differ from the generator's

A table NAME lives between `<!-- table:NAME -->` and `<!-- /table:NAME -->`; everything between the two markers is
the generator's (a provenance comment naming the results file and the command that made it, then the table).
"""

import json
import re
import sys
from pathlib import Path

from expertcache.runtime.bench import bench
from expertcache.runtime.bench import bigbench
from expertcache.runtime.bench import bigprefill
from expertcache.runtime.bench import replay
from expertcache.runtime.bench.harness import claim_text
from expertcache.trainer.cache_aware import frontier_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"



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


def _cond(row: dict) -> str:
    """A kernels row's condition beside its threads, where it is not `alone` (a second process streaming memory)."""
    c = row.get("condition", "alone")
    return "" if c == "alone" else f", {c}"


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
            rows.append(f"| {k['format']}{g} | {k['threads']}{_cond(k)} | {what} | {k['ms']:.2f} ms | {k['gbps']:.1f} | "
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
        for p in sorted(d["pairs"], key=lambda p: (p.get("condition", "alone") != "alone", p["threads"],
                                                   order.index(p["format"]))):
            lin = " (+ linears)" if p.get("expertcache_linears_packed") else ""
            rr = " ".join(f"{x * 1e3:.1f}" for x in p["expertcache_rounds_s"])
            pr = " ".join(f"{x * 1e3:.1f}" for x in p["llamacpp_rounds_s"])
            extra = ""
            if bw:
                extra = " " + " ".join("—" if x is None else f"{x:.0f}"
                                       for x in p.get("expertcache_read_bandwidth_gbps") or []) + " |"
            rows.append(f"| {p['format']}{lin} vs {p['llamacpp_format']} | {p['threads']}{_cond(p)} | "
                        f"{p['expertcache_tpot_s'] * 1e3:.1f} ms | {p['llamacpp_tpot_s'] * 1e3:.1f} ms | "
                        f"{p['ratio']:.2f} | {rr} / {pr} |{extra}")
    return "\n".join(rows)


def prefetch_sweep_table(d: dict) -> str:
    """results/prefetch_sweep.json -> the int8 and int4 kernels' time under each prefetch distance the first-use
    tuning chooses from, per condition, the default and the choice marked."""
    dists = sorted({c["distance"] for fmts in d["prefetch_sweep"].values() for m in fmts.values()
                    for c in m["candidates"]})
    rows = ["| condition | format | " + " | ".join(f"{x // 1024} KiB" if x else "off" for x in dists) + " | chosen |",
            "|---|---|" + "---|" * (len(dists) + 1)]
    for cond, fmts in d["prefetch_sweep"].items():
        for fmt, m in fmts.items():
            for sr in sorted({c["scale_rows"] for c in m["candidates"]}):
                cells = {c["distance"]: c["s"] for c in m["candidates"] if c["scale_rows"] == sr}
                best = m["best"]["distance"] if m["best"]["scale_rows"] == sr else None
                what = fmt + (f", scales {sr} rows ahead" if fmt == "int4" else "")
                rows.append(f"| {cond} | {what} | " + " | ".join(
                    (f"**{cells[x] * 1e3:.2f} ms**" if x == best else f"{cells[x] * 1e3:.2f} ms") if x in cells else "—"
                    for x in dists) + f" | {'yes' if best is not None else ''} |")
    return "\n".join(rows)


def serve_load_table(d: dict) -> str:
    """results/serve_load.json (or serve_batching.json) -> each system's rounds against one client: ours at 1/4 of
    the experts and all resident, and vLLM's CPU build beside them where it ran (a skipped system: its reason)."""
    rows = ["| system | clients | tokens/s | x one client | TPOT p50 / p99 | TTFT p50 / p99 | mean batch | "
            "hit rate | KiB moved/token | equal to alone |", "|---|---|---|---|---|---|---|---|---|---|"]
    names = {"quarter": "ours, 1/4 of the experts (tier auto: host)", "quarter_disk": "ours, 1/4 (tier disk)",
             "all_resident": "ours, all resident", "vllm": "vLLM (CPU), all resident"}
    for sys_, v in d["systems"].items():
        if "skipped" in v:
            rows.append(f"| {names.get(sys_, sys_)} | skipped: {v['skipped']} |||||||||")
            continue
        for r in v["rounds"]:
            hr = "—" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
            kib = "—" if r["bytes_moved_per_token"] is None else f"{r['bytes_moved_per_token'] / 1024:.1f}"
            mb = "—" if r["mean_batch"] is None else f"{r['mean_batch']:.1f}"
            rows.append(f"| {names.get(sys_, sys_)} | {r['clients']} | {r['tokens_per_s']:.1f} | "
                        f"{r['speedup_vs_1']:.2f} | {r['tpot_p50_s'] * 1e3:.1f} / {r['tpot_p99_s'] * 1e3:.1f} ms | "
                        f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p99_s'] * 1e3:.0f} ms | {mb} | {hr} | "
                        f"{kib} | {r['equal_to_alone']}/{r['requests']} |")
    return "\n".join(rows)


def serve_vllm_table(d: dict) -> str:
    """results/serve_load.json -> ours (all resident) against vLLM's CPU build: independent requests per client
    count, and the multi-turn chat load (tokens/s and TTFT), each ratio with its target."""
    v = d.get("versus_vllm")
    if not v:
        return "vLLM did not run: " + str(d["systems"].get("vllm", {}).get("skipped", "not among the systems"))
    ours, peer = d["systems"]["all_resident"], d["systems"]["vllm"]
    mine = {r["clients"]: r for r in ours["rounds"]}
    theirs = {r["clients"]: r for r in peer["rounds"]}
    rows = ["| load | ours tokens/s | vLLM tokens/s | ratio (target) | ours TTFT p50 | vLLM TTFT p50 |",
            "|---|---|---|---|---|---|"]
    for c in v["independent"]:  # the ratios load_test decided, read, not computed again
        r, p = mine[c["clients"]], theirs[c["clients"]]
        rows.append(f"| {c['clients']} client{'s' if c['clients'] > 1 else ''}, independent | "
                    f"{r['tokens_per_s']:.1f} | {p['tokens_per_s']:.1f} | "
                    f"{c['tokens_per_s_ratio']:.2f} (>= {c['target']}) | {r['ttft_p50_s'] * 1e3:.0f} ms | "
                    f"{p['ttft_p50_s'] * 1e3:.0f} ms |")
    c = d.get("chat", {})
    if "all_resident" in c and "vllm" in c:
        o, p, cv = c["all_resident"], c["vllm"], v["chat"]
        rows.append(f"| chat: {d['inputs']['chat']['conversations']} conversations x {d['inputs']['chat']['turns']} "
                    f"turns | {o['tokens_per_s']:.1f} | {p['tokens_per_s']:.1f} | {cv['tokens_per_s_ratio']:.2f} "
                    f"(>= {cv['tokens_per_s_target']}); TTFT {cv['ttft_p50_ratio']:.2f} "
                    f"(<= {cv['ttft_p50_target']}) | {o['ttft_p50_s'] * 1e3:.0f} ms | "
                    f"{p['ttft_p50_s'] * 1e3:.0f} ms |")
    return "\n".join(rows)


def prompt_cache_table(d: dict) -> str:
    """results/serve_prompt_cache.json -> a follow-up turn's TTFT with and without prompt reuse, per capacity, and
    running streams' inter-token latency while a long prompt is prefilled in chunks."""
    rows = ["| experts resident | TTFT, reuse | TTFT, no reuse | ratio (target <= 0.2) | greedy tokens equal |",
            "|---|---|---|---|---|"]
    for r in d["rows"]:
        rows.append(f"| {r['capacity']:g} of E | {r['ttft_reuse_s'] * 1e3:.1f} ms | {r['ttft_no_reuse_s'] * 1e3:.1f} ms"
                    f" | {r['ratio']:.3f} | {r['equal_tokens']} |")
    n = d["inputs"].get("long_prompt_tokens")
    rows += ["", f"Running streams' inter-token latency: median {d['itl_p50_s'] * 1e3:.2f} ms without a long prompt, "
             f"p99 {d['itl_p99_during_prefill_s'] * 1e3:.2f} ms while a {n}-token prompt is prefilled "
             f"({d['itl_p99_during_prefill_s'] / d['itl_p50_s']:.1f}x; target <= 3x)."]
    return "\n".join(rows)


def train_big_table(d: dict) -> str:
    """results/train_big.json -> router post-training of a checkpoint bigger than memory, per expert format: a
    training step against the read roofline (a step's bytes at the disk's measured bandwidth)."""
    ram = d.get("host_ram_bytes")
    rows = ["| experts | bytes (x RAM) | memory cgroup | steps x tokens | tokens/s (steady step) | roofline tokens/s | "
            "of roofline (target >= 0.7) | read per step | disk GB/s | peak RSS | loss first -> last | completed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["runs"]:
        fmt = f"int{r['quant_bits']}" if r.get("quant_bits") else "bf16"
        if not r.get("completed"):
            rows.append(f"| {fmt} | | | | | | | | | | | no: {r.get('error', '?')} |")
            continue
        share = f" ({r['experts_bytes'] / ram:.2f}x)" if ram else ""
        cg = f"{r['memory_cgroup_bytes'] / 2**30:g} GiB" if r.get("memory_cgroup_bytes") else "none"
        of = r["tokens_per_s"] / r["roofline_tokens_per_s"] if r.get("roofline_tokens_per_s") else None
        rows.append(f"| {fmt} | {r['experts_bytes'] / 1e9:.1f} GB{share} | {cg} | {r['steps']} x {r['tokens_per_step']} | "
                    f"{r['tokens_per_s']:.2f} | {r['roofline_tokens_per_s']:.2f} | "
                    f"{'' if of is None else f'{of:.2f}'} | {r['bytes_read_per_step'] / 1e9:.2f} GB | "
                    f"{r['disk_read_gbps']:.2f} | {r['peak_rss_bytes'] / 1e9:.2f} GB | "
                    f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} | yes |")
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
    for r in d["rows"]:
        if "capacity" in r:  # a 4-bit-on-miss row: `on_miss_table`'s
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
    return "\n".join(rows)


def on_miss_table(d: dict) -> str:
    """results/quantized.json's 4-bit-on-miss rows: a cache policy (lossy), its quality cost beside the bytes and
    time it saves against blocking at the same capacity."""
    rows = ["| policy | capacity (of E) | Δppl overall [95%] | worst domain [95%] | Δacc (points) | gate | "
            "KiB moved/token (blocking) | TPOT ms (blocking) |", "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in d["rows"] if "capacity" in r):
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


def routing_table(d: dict) -> str:
    """results/routing_vs_qwen.json (scripts/reference_check.py --ours) -> a trace's routing beside the real
    Qwen3-30B-A3B's (code domain): reuse, coverage and hit rates at about 1/8 of E (Qwen's figures from our
    simulator on its published traces, which reproduces the paper's table), and lookahead recall."""
    o, q = d["ours"], d["domains"]["code"]
    at = {r["policy"]: r for r in q["layer24_cache_table"] if r["capacity"] == 17}  # 13.3% of 128: the paper's row
    pols = ("lru", "lfu", "static", "belady")

    def hits(h: dict) -> str:
        return " / ".join(f"{100 * h[p]:.1f}" for p in pols) + "%"

    r, qr = o["reuse_lag1"], q["reuse_lag1"]
    recall = "—" if o.get("lookahead_recall_2") is None else f"{100 * o['lookahead_recall_2']:.1f}%"
    return "\n".join([
        f"| figure | {o['model']} (E={o['num_experts']}, top-{o['top_k']}; {o['tokens']} {o['phase']} tokens) | "
        f"Qwen3-30B-A3B (E=128, top-8; code, {q['tokens']} tokens) |", "| --- | --- | --- |",
        f"| reuse@lag1 vs chance (mean of layers) | {r['reuse']:.3f} vs {r['chance']:.3f} (x{r['ratio']:.2f}) | "
        f"{qr['ours_mean']:.3f} vs {qr['chance_ours_mean']:.3f} (x{qr['ours_mean'] / qr['chance_ours_mean']:.2f}) |",
        f"| experts serving 95% of accesses | {100 * o['coverage_95']:.1f}% | "
        f"{100 * q['coverage_experts_needed']['mean_frac_of_experts']['0.95']:.1f}% |",
        f"| hit rate at 1/8 of E (Qwen: 17 of 128, layer 24), reference semantics: LRU / LFU / static / Belady | "
        f"{hits(o['hit_rate_reference'])} | {hits({p: at[p]['ours_hit_rate_reference'] for p in pols})} |",
        f"| same, token semantics | {hits(o['hit_rate_token'])} | "
        f"{hits({p: at[p]['ours_hit_rate_token'] for p in pols})} |",
        f"| lookahead probe recall@2 | {recall} | (96.4% claimed for a 671B model) |"])


NOT_MEASURED = "not measured yet"
_PLACEHOLDER = {"--model": "CKPT", "--base": "CKPT", "--work": "WORKDIR"}


def provenance(command: str, out: str) -> str:
    """A command as it is recorded in a results file, with no machine's absolute paths: `--out /abs/x.json` becomes
    the results file it was copied to, `--model /abs/ckpt` the placeholder CKPT, any other absolute path PATH."""
    toks, prev = [], ""
    for t in command.split():
        if t.startswith("/"):
            t = f"results/{out}" if prev == "--out" else _PLACEHOLDER.get(prev, "PATH")
        toks.append(t)
        prev = t
    return " ".join(toks)


def _load(name: str) -> dict | list | None:
    p = RESULTS / name
    return json.loads(p.read_text()) if p.is_file() else None


def _block(name: str, how: str, table: str) -> str:
    return f"<!-- results/{name} ({how}) -->\n{table}"


def _git(d: dict, key: str = "git_commit") -> str:
    return str(d.get(key) or d.get("commit") or "?")[:7]


def make_times_table(d: dict | None) -> str:
    """results/make_times.json (scripts/timed.py) -> the wall times of `make quickstart`, `make test-fast`,
    `make test` as last measured, with the machine they were measured on."""
    rows = ["| command | wall time | exit | machine | 1-min load after | CPU time the host took | commit | when |",
            "|---|---|---|---|---|---|---|---|"]
    for key, cmd in (("make-quickstart", "make quickstart"), ("make-test-fast", "make test-fast"),
                     ("make-test", "make test")):
        r = (d or {}).get(key)
        if not r:
            rows.append(f"| `{cmd}` | {NOT_MEASURED} | | | | | | |")
            continue
        m, s = divmod(round(r["wall_s"]), 60)
        load = "—" if r.get("load_after_1min") is None else f"{r['load_after_1min']:.1f}"
        where = f"{r.get('cpus', '?')} CPUs {r.get('machine', '')}" + (" (CI)" if r.get("ci") else "")
        steal = "—" if r.get("cpu_steal_s") is None else f"{r['cpu_steal_s']:.1f} s"
        rows.append(f"| `{cmd}` | {m} min {s:02d} s | {r.get('exit', '?')} | {where} | {load} | {steal} | "
                    f"{r.get('commit', '?')} | {r.get('when', '?')} |")
    return "\n".join(rows)


def headline_table() -> str:
    """The README's one table of headline figures, each a ratio of times (per output token, or to the first token of
    a cold prompt) with whether its rounds are apart (the benchmarks' one claim rule), drawn from the results files
    that docs/benchmarks.md prints whole."""
    rows = ["| what | expertcache | against | time ratio (ours / theirs) | claimed | from |",
            "|---|---|---|---|---|---|"]
    for name, what, system, peers in (
            ("bench_big.json", "34 GB bf16 Qwen3-30B-A3B-shaped checkpoint, 8 GiB memory, experts from disk",
             "expertcache:on-demand", ("accelerate", "mmap", "mmap:unbounded")),
            ("bench_big_native.json", "the same, with the checkpoint's own routing", "expertcache:prefetch",
             ("llama.cpp", "llama.cpp:unbounded")),
            ("bench_big_48l.json", None, "expertcache:on-demand:int4",
             ("llama.cpp:no-repack", "llama.cpp:unbounded"))):
        d = _load(name)
        if d and what is None:  # the full-depth run: its depth and size as it ran
            i = d["inputs"]
            what = (f"{i['layers']}-layer Qwen3-30B-A3B shape, int4 against llama.cpp's Q4_0 of the same weights "
                    f"({i['expert_bytes_total'] / 1e9:.1f} GB of experts), {i['budget_gb']:g} GiB memory, own routing")
        for peer in peers if d else ():
            c = d["comparisons"].get(f"{system} vs {peer}")
            if c:
                rows.append(f"| {what} | {' '.join(system.split(':')[1:])}, "
                            f"{d['systems'][system]['tpot_median_s']:.3f} s/tok | "
                            f"{peer}, {d['systems'][peer]['tpot_median_s']:.3f} s/tok | {c['ratio']:.2f} | "
                            f"{claim_text(c)} | results/{name} |")
    d = _load("bench_big_48l.json")  # its cold prompts: time to the first token, the inverse of prompt tokens/s
    system = "expertcache:on-demand:int4"
    for row in (d["systems"].get(system, {}).get("prefill") or []) if d else ():
        n = row["prompt_tokens"]
        for peer in ("llama.cpp:no-repack", "llama.cpp:unbounded"):
            c = d.get("prefill_comparisons", {}).get(f"{n}: {system} vs {peer}")
            theirs = {r["prompt_tokens"]: r for r in d["systems"].get(peer, {}).get("prefill") or []}.get(n)
            if c and theirs and row.get("tokens_per_s") and theirs.get("tokens_per_s"):
                rows.append(f"| the 48-layer int4 run, a cold {n:,}-token prompt (time to first token) | "
                            f"{row['tokens_per_s']:.1f} prompt tokens/s | {peer}, {theirs['tokens_per_s']:.1f} | "
                            f"{1 / c['ratio']:.2f} | {claim_text(c)} | results/bench_big_48l.json |")
    sl = _load("serve_load.json")
    if sl and sl.get("versus_vllm"):
        ours = {r["clients"]: r for r in sl["systems"]["all_resident"]["rounds"]}
        for r in sl["systems"]["vllm"]["rounds"]:
            o = ours.get(r["clients"])
            if o and r["clients"] in (1, 16):  # time per output token of the whole load: its tokens/s inverted
                apart = (max(o["per_pass"]["tokens_per_s"]) < min(r["per_pass"]["tokens_per_s"])
                         or min(o["per_pass"]["tokens_per_s"]) > max(r["per_pass"]["tokens_per_s"]))
                rows.append(f"| serving {r['clients']} client{'s' if r['clients'] > 1 else ''}, all experts "
                            f"resident, 1 thread | {o['tokens_per_s']:.1f} tokens/s | vLLM (CPU), "
                            f"{r['tokens_per_s']:.1f} tokens/s | {r['tokens_per_s'] / o['tokens_per_s']:.2f} | "
                            f"{'yes' if apart else 'no: passes overlap'}; target <= 0.8 | results/serve_load.json |")
    k = _load("kernels.json")
    if k:
        for p in sorted(k.get("pairs") or [], key=lambda p: p["threads"]):
            if p["threads"] == 1 and p["format"] in ("bf16", "int4") and p.get("condition", "alone") == "alone":
                rows.append(f"| decode, all experts resident, 1 thread | {p['format']}, "
                            f"{p['expertcache_tpot_s'] * 1e3:.1f} ms/tok | llama.cpp {p['llamacpp_format']}, "
                            f"{p['llamacpp_tpot_s'] * 1e3:.1f} ms/tok | {p['ratio']:.2f} | target <= 1.25 | "
                            f"results/kernels.json |")
    return "\n".join(rows)


def tables() -> dict[str, str]:
    """NAME -> what lies between that table's markers, for every table whose results file is committed (and the
    make times, which read "not measured yet" until results/make_times.json exists)."""
    out = {"headline": headline_table(),
           "make_times": _block("make_times.json", "make quickstart / test-fast / test through scripts/timed.py",
                                make_times_table(_load("make_times.json")))}
    if (d := _load("quantized.json")):
        out["quantized"] = _block("quantized.json", provenance(d["command"], "quantized.json"), quantized_table(d))
        if any("capacity" in r for r in d["rows"]):
            out["quantized_on_miss"] = _block("quantized.json", provenance(d["command"], "quantized.json"),
                                              on_miss_table(d))
    if (d := _load("gate_calibration.json")):
        out["gate_calibration"] = _block("gate_calibration.json", f"{provenance(d['command'], 'gate_calibration.json')}"
                                         f"; git {_git(d)}", calibration_table(d))
    if (d := _load("train_big.json")):
        how = provenance(d.get("command") or "expertcache bench train-big", "train_big.json")
        out["train_big"] = _block("train_big.json", f"{how}; git {_git(d, 'commit')}", train_big_table(d))
    for name in ("serve_load", "serve_batching"):
        if (d := _load(f"{name}.json")):
            how = provenance(d.get("command") or "expertcache bench serve", f"{name}.json")
            out[name] = _block(f"{name}.json", f"{how}; git {_git(d, 'commit')}", serve_load_table(d))
            if name == "serve_load":
                out["serve_vllm"] = _block(f"{name}.json", f"{how}; git {_git(d, 'commit')}", serve_vllm_table(d))
    if (d := _load("serve_prompt_cache.json")):
        out["serve_prompt_cache"] = _block("serve_prompt_cache.json", f"{provenance(d['command'], 'serve_prompt_cache.json')}"
                                           f"; git {_git(d, 'commit')}", prompt_cache_table(d))
    # the kernels and every decode against llama.cpp (the first with its kernel rows, the others pairs only)
    for name in ("kernels", "kernels_amd_epyc", "kernels_file", "kernels_int4_2t", "kernels_depth1024"):
        if (d := _load(f"{name}.json")):
            out[name] = _block(f"{name}.json", provenance(d["command"], f"{name}.json"),
                               kernels_table(d, pairs_only=name not in ("kernels", "kernels_amd_epyc")))
    if (d := _load("prefetch_sweep.json")):
        out["prefetch_sweep"] = _block("prefetch_sweep.json", f"{provenance(d['command'], 'prefetch_sweep.json')}"
                                       f"; git {_git(d.get('provenance', d), 'commit')}", prefetch_sweep_table(d))
    if (d := _load("routing_vs_qwen.json")) and "ours" in d:
        out["routing_vs_qwen"] = _block("routing_vs_qwen.json", f"{provenance(d['command'], 'routing_vs_qwen.json')}"
                                        f"; git {_git(d.get('provenance', d), 'commit')}", routing_table(d))
    if (d := _load("bench_cachesim.json")):
        out["bench_cachesim"] = _block("bench_cachesim.json",
                                       f"{provenance(d['command'], 'bench_cachesim.json')}; git {_git(d, 'commit')}",
                                       cachesim_table(d))
    # (table, its results file, the function that draws it): the 48-layer run's file holds a decode and a prefill
    for name, src, fn in (("bench_big", "bench_big", bigbench.table),
                          ("bench_big_native", "bench_big_native", bigbench.table),
                          ("bench_decode_0.87gb", "bench_decode_0.87gb", bench.table),
                          ("replay_bf16", "replay_bf16", replay.table),
                          ("bench_big_prefill", "bench_big_prefill", bigprefill.table),
                          ("bench_big_48l", "bench_big_48l", bigbench.table),
                          ("bench_big_48l_prefill", "bench_big_48l", bigprefill.table)):
        if (d := _load(f"{src}.json")):
            cfg = f"results/{src}.config.yaml"
            how = (f"expertcache {'bench big' if 'big' in name else 'bench decode'} --config {cfg}; "
                   if (ROOT / cfg).is_file() else "") + f"git {_git(d)}"
            out[name] = _block(f"{src}.json", how, fn(d).rstrip())
    # the post-training frontier and the first losses re-gated the same way (lists of rows)
    for name, recipe in (("frontier", "frontier-grown"), ("frontier_small_samples", "frontier"),
                         ("frontier_earlier", "frontier-earlier")):
        if (d := _load(f"{name}.json")) is not None:
            out[name] = _block(f"{name}.json", f"expertcache train-cache-aware --recipe {recipe}", frontier_table(d))
    return out


MARKED = re.compile(r"(<!-- table:(?P<name>[\w.-]+) -->)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def rendered(text: str, generated: dict[str, str]) -> str:
    """`text` with the body between each pair of table markers replaced by the generator's; a marker naming a
    table the generator does not know says so in its body (so the check fails on it)."""
    def body(m: re.Match) -> str:
        name = m.group("name")
        return f"{m.group(1)}\n{generated.get(name, f'no table named {name!r}')}\n{m.group(4)}"
    return MARKED.sub(body, text)


def stale(generated: dict[str, str] | None = None) -> list[str]:
    """The documents (repository-relative) whose marked tables differ from the generator's output."""
    generated = tables() if generated is None else generated
    return [str(p.relative_to(ROOT)) for p in documents() if rendered(p.read_text(), generated) != p.read_text()]


def main(argv: list[str]) -> int:
    generated = tables()
    if not argv:
        for name, body in generated.items():
            print(f"<!-- table:{name} -->\n{body}\n<!-- /table:{name} -->\n")
        return 0
    if argv == ["--write"]:
        from expertcache.telemetry.atomic import write_text
        for p in documents():
            new = rendered(p.read_text(), generated)
            if new != p.read_text():
                write_text(p, new)
                print(f"wrote {p.relative_to(ROOT)}", file=sys.stderr)
        return 0
    if argv == ["--check"]:
        bad = stale(generated)
        for f in bad:
            print(f"{f}: its tables differ from `python scripts/readme_tables.py --write`", file=sys.stderr)
        return 1 if bad else 0
    print("usage: python scripts/readme_tables.py [--write | --check]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main, sys.argv[1:]))
