"""The reports of cache-aware runs: one run's table row, the markdown table of runs (result.md, sweep.md), the
frontier's table (the README's post-training table) and the cache figure (cache.png)."""

from __future__ import annotations

import math
from pathlib import Path

from expertcache.telemetry.atomic import write_figure


def result_row(result: dict) -> dict:
    """The figures of one run that the table shows."""
    s = result["summary"]
    row = {"name": result["name"], "mode": result["mode"], "lambda": result["locality"]["weight"],
           "dppl_percent": s["dppl_percent"],
           "gate": s["gate"].get("verdict", "PASS" if s["gate"]["pass"] else "FAIL")}
    for cap, c in s["capacities"].items():
        row[f"C={cap}"] = {
            "capacity_frac": c["capacity_frac"], "lru_miss_reduction": c["lru_miss_reduction"],
            "lru_hit_rate": c["lru"]["hit_rate"], "base_lru_hit_rate": c["base_lru"]["hit_rate"],
            "best_router_policy": c.get("best_router_policy"),
            "router_adjusted_hit_rate": c[c["best_router_policy"]]["adjusted_hit_rate"] if "best_router_policy" in c else None,
            "router_hit_rate": c[c["best_router_policy"]]["hit_rate"] if "best_router_policy" in c else None,
            "router_adjusted_gain_points": c.get("router_adjusted_gain_points"),
            "lru_traffic_MB_per_token": c["lru"]["traffic_bytes_per_token"] / 1e6,
            "router_traffic_MB_per_token": c[c["best_router_policy"]]["traffic_bytes_per_token"] / 1e6
            if "best_router_policy" in c else None}
    return row


def _f(v, fmt):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def results_table(results: list[dict]) -> str:
    """Markdown: per run, per capacity, LRU miss reduction vs the base, the routers vs LRU, Δppl and the gate."""
    rows = [result_row(r) for r in results]
    caps = [k for k in rows[0] if k.startswith("C=")]
    head = ["run", "mode", "λ"]
    for c in caps:
        frac = rows[0][c]["capacity_frac"]
        head += [f"LRU miss red. @{frac:g}E", f"LRU hit @{frac:g}E", f"routers adj. hit @{frac:g}E (Δ pts)",
                 f"traffic MB/tok LRU→routers @{frac:g}E"]
    head += ["Δppl overall", "Δppl code", "Δppl prose", "Δppl math", "gate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], r["mode"], _f(r["lambda"], "g")]
        for c in caps:
            x = r[c]
            cells += [f"{100 * x['lru_miss_reduction']:+.1f}%",
                      f"{x['lru_hit_rate']:.3f} (base {x['base_lru_hit_rate']:.3f})",
                      f"{_f(x['router_adjusted_hit_rate'], '.3f')} ({_f(x['router_adjusted_gain_points'], '+.1f')})",
                      f"{x['lru_traffic_MB_per_token']:.2f}→{_f(x['router_traffic_MB_per_token'], '.2f')}"]
        d = r["dppl_percent"]
        cells += [f"{d.get(k, float('nan')):+.2f}%" for k in ("overall", "code", "prose", "math")] + [r["gate"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def frontier_table(rows: list[dict]) -> str:
    """Markdown of the frontier's rows (expertcache.recipes.frontier): one line per (variant, serving); the
    README's post-training table. Gate figures carry their 95% paired intervals where the row has them, with n: blocks
    per domain for Δppl, documents of the worst task for Δacc."""
    def pct(v, sign=False):
        return "—" if v is None else (f"{v:+.2f}%" if sign else f"{100 * v:.1f}%")

    def ci(iv, n=None):  # a 95% interval (rows gated before issue #23 have none)
        return "" if not iv else f" [{iv[0]:+.2f}, {iv[1]:+.2f}]" + ("" if n is None else f" n={n}")

    def worst_acc(r):  # the interval of the task with the lowest Δacc, and its documents
        if not r.get("dacc_ci95") or not r.get("dacc_points"):
            return None, None
        t = min(r["dacc_points"], key=r["dacc_points"].get)
        return r["dacc_ci95"][t], (r.get("n_documents") or {}).get(t)

    lines = ["| run | serving | LRU misses removed 1/8 E | 1/4 E | LRU hit 1/8 (Belady) | Δppl overall | worst domain | "
             "Δppl 64 blocks (vs λ=0 control) | Δacc worst (pts) | Temporal vs LRU 1/8 (traffic) | gate |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "—" if r["dacc_min_points"] is None else f"{r['dacc_min_points']:+.1f}"
        hit = "—" if r.get("lru_hit_1_8") is None else f"{r['lru_hit_1_8']:.3f} ({r['belady_hit_1_8']:.3f})"
        ctl = r.get("dppl_vs_control_pct", {}).get("overall")
        own = r.get("dppl_eval_blocks_pct", {}).get("overall")
        big = "—" if own is None else f"{pct(own, True)} ({pct(ctl, True)})"
        tg = r.get("temporal_adjusted_gain_points_1_8")
        tmp = "—" if tg is None else f"{tg:+.1f} pts ({r['temporal_traffic_ratio_1_8']:.2f}x)"
        serving = r["serving"] + (f" τ={r['tau']:g}" if r.get("tau") is not None else "")
        lines.append(f"| {r['name']} | {serving} | {pct(r['miss_reduction_1_8'])} | "
                     f"{pct(r.get('miss_reduction_1_4'))} | {hit} | "
                     f"{pct(r['dppl_overall_pct'], True)}{ci(r.get('dppl_overall_ci95'), r.get('n_blocks'))} | "
                     f"{pct(r['dppl_max_domain_pct'], True)}{ci(r.get('dppl_max_domain_ci95'))} | {big} | "
                     f"{acc}{ci(*worst_acc(r))} | {tmp} | {r['gate']} |")
    return "\n".join(lines)


def plot_cache(result: dict, out_png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = result["summary"]["capacities"]
    fig, axes = plt.subplots(1, len(caps), figsize=(5 * len(caps), 4), squeeze=False)
    for ax, (cap, c) in zip(axes[0], caps.items()):
        names = ["base_lru", "lru"] + [p for p in ("temporal", "spatio", "spatio_temporal") if p in c]
        hit = [c[n]["hit_rate"] for n in names]
        adj = [c[n]["adjusted_hit_rate"] for n in names]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], hit, 0.4, label="hit rate")
        ax.bar([i + 0.2 for i in x], adj, 0.4, label="adjusted hit rate")
        ax.axhline(c["lru"]["belady_hit_rate"], ls="--", c="k", lw=1, label="Belady (this model)")
        ax.set_xticks(list(x), ["base LRU", "LRU"] + names[2:], rotation=20)
        ax.set(title=f"C = {cap} experts ({c['capacity_frac']:.3g} of E)", ylim=(0, 1))
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['name']}: decode cache figures ({result['mode']})")
    fig.tight_layout()
    write_figure(fig, out_png)
    plt.close(fig)
