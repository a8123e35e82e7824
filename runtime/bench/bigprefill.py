"""bench big's prefill phase, from its runs to its figures (#47: prefill measured for every system).

Each system's rounds (`bigbench.run_prefill` or `run_llamacpp_prefill`: one cold prefill per prompt length, each in a
process of its own, the page cache dropped first, alternated with the other systems) become its `prefill` list:
per prompt length, the medians over the rounds of prompt tokens/s, time to first token and bytes read from storage.

The roofline of a prompt length is the prefill with reads and compute fully overlapped:
`N / max(bytes the prompt needs / the disk's measured bandwidth at queue depth, compute with every expert resident)`,
where the bytes it needs are the experts it routes to (each read once), and the compute is one prefill with every
expert in memory (capacity 1.0, host tier) when they fit in this machine's memory; else the expertcache rows' own
prefill less their stall (said in `roofline.compute_from`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from expertcache.runtime.bench.harness import claim_text, compare

FIGURES = ("tokens_per_s", "ttft_s", "disk_read_bytes")  # each prompt length's, medians over the rounds


def prefill_rows(rounds: list[list[dict]], lengths) -> list[dict]:
    """One system's `prefill` list from its rounds (each a list of one run per prompt length, or of errors):
    per length `{prompt_tokens, tokens_per_s, ttft_s, disk_read_bytes}` (medians over the rounds that ran), their
    round values, the errors, and the engine's figures where the system has them."""
    out = []
    for n in lengths:
        runs = [x for rs in rounds for x in rs if x.get("prompt_tokens") == n]
        ok = [x for x in runs if "error" not in x]
        row = {"prompt_tokens": n, "runs": len(runs), "errors": [x["error"] for x in runs if "error" in x]}
        if ok:
            row.update({k: float(np.median([x[k] for x in ok])) for k in FIGURES})
            row["tokens_per_s_rounds"] = [float(x["tokens_per_s"]) for x in ok]
            row["ttft_s_rounds"] = [float(x["ttft_s"]) for x in ok]
            row["experts_touched"] = ok[0].get("experts_touched")
            row["expert_bytes"] = ok[0].get("expert_bytes")
            row["peak_rss_bytes"] = max(x["peak_rss_bytes"] for x in ok)
            row["in_memory_cgroup"] = ok[0].get("cgroup_peak_bytes") is not None
            if row["in_memory_cgroup"]:
                row["cgroup_peak_bytes"] = max(x["cgroup_peak_bytes"] for x in ok)
            for k in ("engine_bytes_moved", "stall_s", "expert_compute_s"):
                if k in ok[0]:
                    row[k] = float(np.median([x[k] for x in ok]))
            if "engine" in ok[0]:  # the cache a prefill ran with (its budget keeps the prompt's memory beside it)
                row["capacity"] = ok[0]["engine"].get("capacity")
            if "read_bandwidth" in ok[0]:
                row["read_bandwidth_GBps"] = float(np.median([x["read_bandwidth"]["at_queue_depth_GBps"]
                                                              for x in ok]))
            for k in ("disk_read_includes_load", "llamacpp_build", "vllm_version", "cmd"):
                if k in ok[0]:
                    row[k] = ok[0][k]
        out.append(row)
    return out


def roofline(systems: dict, resident: dict, lengths) -> dict:
    """Per prompt length (a string key, as JSON keeps it): the bytes the prompt needs (the experts it routes to,
    each once), the disk's bandwidth at queue depth (the expertcache rows' measurement, median), the compute term
    (the resident run's prefill, else the expertcache rows' prefill less their stall), `t_transfer_s`, `t_compute_s`
    and `tokens_per_s` = N / the larger. `resident`: `{N: run}` of the resident prefills (a run may be an error,
    or `{"skipped": why}`)."""
    out = {}
    for n in lengths:
        ec = [p for s, r in systems.items() if s.startswith("expertcache") for p in r.get("prefill", [])
              if p["prompt_tokens"] == n and "tokens_per_s" in p]
        res = resident.get(n, {})
        gbps = [p["read_bandwidth_GBps"] for p in ec if p.get("read_bandwidth_GBps")]
        bw = float(np.median(gbps)) if gbps else None
        touched = res.get("experts_touched") or next((p["experts_touched"] for p in ec if p.get("experts_touched")),
                                                     None)
        eb = res.get("expert_bytes") or next((p["expert_bytes"] for p in ec if p.get("expert_bytes")), None)
        need = touched * eb if touched and eb else None
        if "ttft_s" in res:
            t_c, src = float(res["ttft_s"]), "resident"
        elif ec and all("stall_s" in p for p in ec):
            t_c, src = float(min(p["ttft_s"] - p["stall_s"] for p in ec)), "expertcache prefill less its stall"
        else:
            t_c, src = None, None
        t_t = need / (bw * 1e9) if need is not None and bw else None
        bound = max(t for t in (t_c, t_t) if t is not None) if (t_c, t_t) != (None, None) else None
        out[str(n)] = {"prompt_tokens": n, "bytes_needed": need, "experts_touched": touched, "disk_GBps": bw,
                       "t_transfer_s": t_t, "t_compute_s": t_c, "compute_from": src,
                       "resident": res.get("skipped") or res.get("error") or "ran",
                       "tokens_per_s": n / bound if bound else None}
    return out


def comparisons(systems: dict, roof: dict, lengths) -> dict:
    """Per prompt length, each expertcache system's prompt tokens/s against each peer's (`harness.compare` over the
    rounds: ratio > 1 is expertcache faster; claimed only where the rounds are apart) and against the roofline
    (`of_roofline`: its median over the roofline's tokens/s)."""
    out = {}
    for n in lengths:
        tps = {s: p["tokens_per_s_rounds"] for s, r in systems.items() for p in r.get("prefill", [])
               if p["prompt_tokens"] == n and p.get("tokens_per_s_rounds")}
        for a, ra in tps.items():
            if not a.startswith("expertcache"):
                continue
            for b, rb in tps.items():
                if not b.startswith("expertcache"):
                    out[f"{n}: {a} vs {b}"] = compare(ra, rb)
            top = roof.get(str(n), {}).get("tokens_per_s")
            if top:
                out[f"{n}: {a} vs roofline"] = {"of_roofline": float(np.median(ra)) / top}
    return out


def table(res: dict) -> str:
    """The prefill phase as markdown: each system's figures per prompt length, then the roofline and the ratios."""
    rows = ["| system | prompt tokens | tokens/s (median) | round tokens/s | TTFT (s) | disk read (GB) | peak RSS "
            "(GiB) | in cgroup |", "|---|---|---|---|---|---|---|---|"]
    for s, r in res["systems"].items():
        if "skipped" in r:
            why = r["skipped"].replace("|", "/").replace(str(Path.home()), "~")  # no machine's home in the docs
            rows.append(f"| {s} | skipped: {why} | | | | | | |")
            continue
        for p in r.get("prefill", []):
            if "tokens_per_s" not in p:
                why = "; ".join(e[:160] for e in p["errors"]).replace("|", "/")
                rows.append(f"| {s} | {p['prompt_tokens']} | failed: {why} | | | | | |")
                continue
            load = " (with loading)" if p.get("disk_read_includes_load") else ""
            rows.append(f"| {s} | {p['prompt_tokens']} | {p['tokens_per_s']:.1f} | "
                        f"{', '.join(f'{x:.1f}' for x in p['tokens_per_s_rounds'])} | {p['ttft_s']:.2f} | "
                        f"{p['disk_read_bytes'] / 1e9:.2f}{load}"
                        f" | {p['peak_rss_bytes'] / 2**30:.2f} | {'yes' if p['in_memory_cgroup'] else 'no'} |")
    roof = res.get("prefill_roofline", {})
    if roof:
        def f(x, fmt):
            return "—" if x is None else format(x, fmt)

        rows += ["", "| prompt tokens | roofline tokens/s | compute (s) | from | bytes needed (GB) | disk GB/s | "
                 "reads (s) |", "|---|---|---|---|---|---|---|"]
        rows += [f"| {n} | {f(x['tokens_per_s'], '.1f')} | {f(x['t_compute_s'], '.2f')} | {x['compute_from'] or '—'} "
                 f"| {f(x['bytes_needed'] and x['bytes_needed'] / 1e9, '.2f')} | {f(x['disk_GBps'], '.2f')} | "
                 f"{f(x['t_transfer_s'], '.2f')} |" for n, x in roof.items()]
    comp = res.get("prefill_comparisons", {})
    if comp:
        rows += ["", "| comparison (prompt tokens/s) | ratio | claimed (rounds apart) |", "|---|---|---|"]
        rows += [f"| {k} | {v['ratio']:.2f} | {claim_text(v)} |"
                 if "ratio" in v else f"| {k} | {v['of_roofline']:.2f} of the roofline | |" for k, v in comp.items()]
    return "\n".join(rows)
