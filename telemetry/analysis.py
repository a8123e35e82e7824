"""Trace analysis (METRICS.md): reuse@lag1 vs chance, coverage, hit rate vs capacity against the Belady bound,
lookahead recall of the zero-parameter probe. Decode tokens only unless the trace has none.

`analyze()` writes `summary.json`, PNG plots and `summary.txt` (the one-screen text for people).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .atomic import write_figure, write_json, write_text
from .cachesim import POLICIES, CacheResult, capacity_count, global_steps, simulate
from .errors import InputError
from .parquet_trace import Trace, read_trace

CAPACITY_FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)
COVERAGE_LEVELS = (0.5, 0.9, 0.95)


# --- routing statistics ------------------------------------------------------------------------------------

def reuse_lag1(ids: np.ndarray, seq: np.ndarray, pos: np.ndarray, num_experts: int) -> dict:
    """One layer's `ids [tokens, k]` in (seq, pos) order: reuse@lag1, chance, their ratio."""
    t, k = ids.shape
    follows = (seq[1:] == seq[:-1]) & (pos[1:] == pos[:-1] + 1)  # token i+1 directly follows token i
    if not follows.any():
        return {"reuse": float("nan"), "chance": float("nan"), "ratio": float("nan")}
    cur, prev = ids[1:][follows], ids[:-1][follows]
    reused = (cur[:, :, None] == prev[:, None, :]).any(-1)  # [pairs, k]
    reuse = float(reused.mean())
    p = np.bincount(ids.reshape(-1).astype(np.int64), minlength=num_experts) / t  # share of tokens selecting e
    chance = float((p ** 2).sum() / p.sum())
    return {"reuse": reuse, "chance": chance, "ratio": reuse / chance if chance else float("nan")}


def coverage(ids: np.ndarray, num_experts: int, levels=COVERAGE_LEVELS) -> dict:
    """Smallest fraction of the layer's experts that serve x of its accesses, for each x in `levels`."""
    counts = np.sort(np.bincount(ids.reshape(-1).astype(np.int64), minlength=num_experts))[::-1]
    cum = np.cumsum(counts) / counts.sum()
    return {f"{x:g}": float((np.searchsorted(cum, x - 1e-12) + 1) / num_experts) for x in levels}


def capacities(num_experts: int, fractions=CAPACITY_FRACTIONS) -> list[int]:
    return sorted({capacity_count(f, num_experts) for f in fractions})


def hit_curves(ids: np.ndarray, num_experts: int, caps: list[int], policies=POLICIES, semantics: str = "token",
               fit_frac: float = 0.2, fit_ids: np.ndarray | None = None, progress=None, learned=None,
               probs: np.ndarray | None = None, learned_progress=None) -> list[dict]:
    """Hit rate against per-layer capacity for each policy, per-layer and global budgets.

    Static pins are fitted on `fit_ids` (another split's trace) if given; otherwise on the first `fit_frac` of
    tokens, and then *every* policy is scored on the remaining tokens only, so static never sees what it is
    scored on. A global budget of C per layer is one cache of C x layers slots shared by all layers.
    `learned` (a `LearnedPolicy`, token semantics): also rows with policy ``learned``, its state cold at the
    first scored token; `probs [L, T, k]`: the router probabilities of `ids`, for a policy fitted with them;
    `learned_progress(tokens done, tokens)` while it runs."""
    n_layers, n_tok, _ = ids.shape
    if fit_ids is None:
        cut = int(round(fit_frac * n_tok))
        if cut < 1 or cut >= n_tok:
            raise InputError(f"{n_tok} tokens cannot be split {fit_frac:g}/{1 - fit_frac:g} for the static fit")
        fit_ids, ids = ids[:, :cut], ids[:, cut:]
        probs = probs[:, cut:] if probs is not None else None
    out = []
    g_steps = global_steps(ids, num_experts)
    g_fit = global_steps(fit_ids, num_experts)
    for cap in caps:
        for pol in policies:
            per_layer = CacheResult.total([simulate(ids[layer], cap, pol, semantics,
                                                    fit=fit_ids[layer] if pol == "static" else None)
                                           for layer in range(n_layers)])
            g = simulate(g_steps, cap * n_layers, pol, semantics, fit=g_fit if pol == "static" else None)
            out.append({"policy": pol, "capacity": cap, "capacity_frac": cap / num_experts, "semantics": semantics,
                        "hit_rate_per_layer": per_layer.hit_rate, "hit_rate_global": g.hit_rate,
                        "accesses": per_layer.accesses})
            if progress:
                progress()
    if learned is not None and semantics == "token":
        out += _learned_rows(learned, ids, num_experts, caps, probs, learned_progress)
    for row in out:  # every result also as a fraction of the Belady bound at the same capacity
        bel = next(r for r in out if r["policy"] == "belady" and r["capacity"] == row["capacity"]) \
            if "belady" in policies else None
        if bel:  # None where Belady itself hits nothing (token semantics with C < k)
            for key in ("per_layer", "global"):
                b = bel[f"hit_rate_{key}"]
                row[f"of_belady_{key}"] = row[f"hit_rate_{key}"] / b if b > 0 else None
    return out


def _probs(trace: Trace) -> np.ndarray | None:
    """Router probabilities of the chosen experts `[L, T, k]` in `routing()` order; None if not recorded."""
    w = trace.layer_matrix("weights").astype(np.float64)
    return None if np.isnan(w).any() else w


def _learned_rows(learned, ids, num_experts, caps, probs, progress=None) -> list[dict]:
    from .learned_policy import simulate_learned

    learned.check_shape(num_experts, ids.shape[2])
    both = simulate_learned(learned, ids, caps, probs, ("layer", "global"), progress)  # one pass of keep scores
    per_layer, glob = both["layer"], both["global"]
    return [{"policy": "learned", "capacity": c, "capacity_frac": c / num_experts, "semantics": "token",
             "hit_rate_per_layer": per_layer[c]["hit_rate"], "hit_rate_global": glob[c]["hit_rate"],
             "accesses": per_layer[c]["accesses"], "policy_file": learned.meta.get("path")} for c in caps]


def lookahead_recall(trace: Trace, model, distances=(1, 2, 3)) -> dict:
    """Zero-parameter probe: layer L's router applied to the hidden state entering layer L-d; recall@d =
    |predicted top-k ∩ true top-k| / k averaged over tokens and layers L >= d (MoE layer order)."""
    import torch

    from .adapters import adapter_for

    if "hidden" not in trace.table.column_names:
        raise InputError(f"trace {trace.path} has no hidden states; record it with --hidden for lookahead recall")
    adapter = adapter_for(model)
    layers = adapter.moe_layers(model)
    if [L.index for L in layers] != trace.meta.moe_layers:
        raise InputError(f"trace MoE layers {trace.meta.moe_layers} differ from the model's "
                         f"{[L.index for L in layers]}")
    ids, _, _ = trace.routing()
    hidden = trace.layer_matrix("hidden")  # [layers, tokens, H]
    out = {}
    with torch.no_grad():
        for d in distances:
            rec = []
            for i in range(d, len(layers)):
                h = torch.from_numpy(hidden[i - d].astype(np.float32))
                lg = adapter.router_logits(layers[i].router, h)
                pred, _ = adapter.route(lg, adapter.router_bias(layers[i].router))
                true = torch.from_numpy(ids[i].astype(np.int64))
                rec.append(float((pred[:, :, None] == true[:, None, :]).any(-1).float().mean()))
            out[str(d)] = {"mean": float(np.mean(rec)) if rec else float("nan"),
                           "per_layer": {str(layers[i].index): r for i, r in zip(range(d, len(layers)), rec)}}
    return out


# --- the whole analysis ------------------------------------------------------------------------------------

def _routing_stats(trace: Trace, routing: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict:
    ids, seq, pos = routing  # trace.routing()
    e = trace.meta.num_experts
    per_layer = []
    for i, layer in enumerate(trace.meta.moe_layers):
        r = reuse_lag1(ids[i], seq, pos, e)
        per_layer.append({"layer": layer, **r, "coverage": coverage(ids[i], e)})
    mean = {key: float(np.nanmean([p[key] for p in per_layer])) for key in ("reuse", "chance")}
    mean["ratio"] = mean["reuse"] / mean["chance"]
    cov = {x: float(np.mean([p["coverage"][x] for p in per_layer])) for x in per_layer[0]["coverage"]}
    return {"tokens": int(ids.shape[1]), "reuse_lag1": mean, "coverage_mean": cov, "per_layer": per_layer}


def analyze(trace_path: str | Path, out_dir: str | Path, model_dir: str | None = None, phase: str | None = "decode",
            semantics: str = "token", fit_trace: str | None = None, by_domain: bool = True,
            fractions=CAPACITY_FRACTIONS, policy_file: str | None = None) -> dict:
    from expertcache.telemetry.progress import Progress

    trace = read_trace(trace_path)
    meta = trace.meta
    if phase and phase not in set(trace.table["phase"].to_pylist()):
        phase = None  # e.g. a prefill-only trace: analyse every token, and say so
    sel = trace.filter(phase=phase) if phase else trace
    if sel.num_rows == 0:
        raise InputError(f"trace {trace_path} has no rows to analyse")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    caps = capacities(meta.num_experts, fractions)
    fit_ids = None
    if fit_trace:
        ft = read_trace(fit_trace)
        if (ft.meta.num_experts, ft.meta.top_k, ft.meta.moe_layers) != (meta.num_experts, meta.top_k, meta.moe_layers):
            raise InputError(f"fit trace {fit_trace} routes {ft.meta.num_experts} experts top-{ft.meta.top_k}, "
                             f"trace routes {meta.num_experts} top-{meta.top_k}")
        fit_ids = (ft.filter(phase=phase) if phase else ft).routing()[0]
    summary = {"trace": str(trace_path), "model": meta.model, "family": meta.family, "num_experts": meta.num_experts,
               "top_k": meta.top_k, "moe_layers": len(meta.moe_layers), "phase": phase or "all",
               "semantics": semantics, "static_fit": fit_trace or "first 20% of tokens (all policies scored on the rest)",
               "capacities": caps, "partial": bool(meta.partial)}
    routing = sel.routing()
    summary["routing"] = _routing_stats(sel, routing)
    learned = probs = None
    if policy_file:  # the learned eviction policy beside the others (token semantics)
        from .learned_policy import LearnedPolicy

        learned = LearnedPolicy.load(policy_file)
        learned.check_shape(meta.num_experts, meta.top_k, f"trace {trace_path}")
        probs = _probs(sel) if learned.uses_probs else None
        summary["learned_policy"] = learned.describe()
    domains = [d for d in sel.domains() if d] if by_domain else []
    with Progress(transient=True) as prog:
        n = len(caps) * len(POLICIES) * (1 + len(domains))
        task = prog.add_task("cache simulation", total=n)
        ltask = prog.add_task("learned policy (tokens)", total=None) if learned is not None else None
        lprog = _token_progress(prog, ltask)
        summary["hit_curves"] = hit_curves(routing[0], meta.num_experts, caps, semantics=semantics, fit_ids=fit_ids,
                                           progress=lambda: prog.advance(task), learned=learned, probs=probs,
                                           learned_progress=lprog)
        if len(domains) > 1:
            summary["by_domain"] = {}
            for d in domains:
                dt = sel.filter(domain=d)
                dr = dt.routing()
                summary["by_domain"][d] = {
                    "routing": {k: v for k, v in _routing_stats(dt, dr).items() if k != "per_layer"},
                    "hit_curves": hit_curves(dr[0], meta.num_experts, caps, semantics=semantics,
                                             progress=lambda: prog.advance(task), learned=learned,
                                             probs=_probs(dt) if learned is not None and learned.uses_probs
                                             else None, learned_progress=_token_progress(prog, ltask, d))}
    if model_dir is not None and "hidden" not in sel.table.column_names:
        raise InputError(f"--model adds lookahead recall, which needs the hidden states; {trace_path} has none "
                         f"(record it with --hidden true)")
    if model_dir is not None:
        from .hf import load_causal_lm
        from .parquet_trace import check_compatible

        model = load_causal_lm(model_dir)
        check_compatible(meta, model)
        summary["lookahead_recall"] = lookahead_recall(sel, model)
    write_json(out / "summary.json", summary)
    plot_summary(summary, out)
    text = text_summary(summary)
    write_text(out / "summary.txt", text)
    return summary


def _token_progress(prog, task, label: str = ""):
    """A `(done, total)` callback that moves a rich progress task (None: no task)."""
    if task is None:
        return None

    def update(done: int, total: int) -> None:
        prog.update(task, completed=done, total=total,
                    description=f"learned policy{f' ({label})' if label else ''}: tokens")
    return update


# --- people: plots and a text summary ----------------------------------------------------------------------

def plot_summary(s: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    pl = s["routing"]["per_layer"]
    layers = [p["layer"] for p in pl]
    k_over_e = s["top_k"] / s["num_experts"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4))
    a.plot(layers, [p["reuse"] for p in pl], marker="o", label="reuse@lag1")
    a.plot(layers, [p["chance"] for p in pl], ls="--", marker="." if len(layers) == 1 else None,
           label="chance (independent tokens)")
    a.set(xlabel="MoE layer", ylabel="fraction of accesses", title="reuse of the previous token's experts",
          ylim=(0, 1.02))
    a.legend(loc="center right")
    for x in pl[0]["coverage"]:
        b.plot(layers, [p["coverage"][x] for p in pl], marker=".", label=f"{float(x):.0%} of accesses")
    b.axhline(k_over_e, color="grey", ls=":", label=f"k/E = {k_over_e:.1%} (the floor)")
    b.set(xlabel="MoE layer", ylabel="fraction of experts", title="experts needed for coverage", ylim=(0, 1.02))
    b.legend()
    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(layers) == 1:
            ax.set_xlim(layers[0] - 1, layers[0] + 1)
    fig.suptitle(_figure_title(s), fontsize=9)
    fig.tight_layout()
    write_figure(fig, out / "reuse_coverage.png")
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, key, title in ((axes[0], "hit_rate_per_layer", "per-layer budget"),
                           (axes[1], "hit_rate_global", "global budget")):
        for pol in _policies(s):
            rows = [r for r in s["hit_curves"] if r["policy"] == pol]
            ax.plot([r["capacity_frac"] for r in rows], [r[key] for r in rows], marker="o", label=pol,
                    ls="--" if pol == "belady" else "-")
        ax.set(xscale="log", xlabel="capacity: experts per layer (share of E)", title=f"hit rate, {title}",
               ylim=(0, 1))
        ax.set_xticks([c / s["num_experts"] for c in s["capacities"]],
                      [f"{c} ({c / s['num_experts']:.1%})" for c in s["capacities"]])
        ax.minorticks_off()
        ax.legend()
    axes[0].set_ylabel(f"hit rate ({s['semantics']} semantics)")
    fig.suptitle(_figure_title(s), fontsize=9)
    fig.tight_layout()
    write_figure(fig, out / "hit_rate.png")
    plt.close(fig)

    if "lookahead_recall" in s:
        fig, ax = plt.subplots(figsize=(6.5, 4.4))
        ds = [d for d in sorted(s["lookahead_recall"], key=int)
              if not math.isnan(s["lookahead_recall"][d]["mean"])]
        vals = [s["lookahead_recall"][d]["mean"] for d in ds]
        bars = ax.bar([f"{d} layer{'s' if int(d) > 1 else ''} ahead" for d in ds], vals, color="tab:blue")
        ax.bar_label(bars, fmt="%.2f")
        ax.axhline(k_over_e, color="grey", ls=":", label=f"chance: k/E = {k_over_e:.1%}")
        ax.set(ylim=(0, 1), ylabel="recall of the true top-k",
               title="lookahead probe: layer L's hidden state through layer L+d's router")
        ax.legend()
        fig.suptitle(_figure_title(s), fontsize=9)
        fig.tight_layout()
        write_figure(fig, out / "lookahead_recall.png")
        plt.close(fig)


def _figure_title(s: dict) -> str:
    """Which model, trace and how many tokens a figure shows."""
    m = Path(str(s.get("model") or "?"))
    return (f"{'/'.join(m.parts[-2:])} · {Path(str(s['trace'])).name} · "
            f"{s['routing']['tokens']} {s['phase']} tokens · {s['moe_layers']} MoE layers, E={s['num_experts']}, "
            f"top-{s['top_k']}")


def _policies(s: dict) -> tuple:
    """The policies of a summary's hit curves: the built-in ones, and ``learned`` where a policy file was given."""
    return POLICIES + (("learned",) if any(r["policy"] == "learned" for r in s["hit_curves"]) else ())


def partial_warning(trace: str) -> str:
    return (f"WARNING: {trace} is a partial trace (its recording was interrupted): the figures cover only the "
            f"row groups written before it stopped")


def text_summary(s: dict) -> str:
    r = s["routing"]
    lines = [partial_warning(s["trace"])] if s.get("partial") else []
    lines += [f"trace {s['trace']}  model {s['model']}  ({s['family']}, {s['moe_layers']} MoE layers, "
             f"E={s['num_experts']}, top-{s['top_k']}; {r['tokens']} {s['phase']} tokens)",
             f"reuse@lag1 {r['reuse_lag1']['reuse']:.3f} vs chance {r['reuse_lag1']['chance']:.3f} "
             f"(x{r['reuse_lag1']['ratio']:.2f})",
             "coverage: " + ", ".join(f"{float(x):.0%} of accesses on {v:.1%} of experts"
                                      for x, v in r["coverage_mean"].items()),
             f"hit rate ({s['semantics']} semantics; static fit: {s['static_fit']}):",
             f"  {'capacity':>14} " + " ".join(f"{p:>16}" for p in _policies(s))]
    for cap in s["capacities"]:
        rows = {x["policy"]: x for x in s["hit_curves"] if x["capacity"] == cap}
        cells = [f"{rows[p]['hit_rate_per_layer']:.3f}/{rows[p]['hit_rate_global']:.3f}" for p in _policies(s)]
        lines.append(f"  {cap:>4} ({cap / s['num_experts']:6.1%}) " + " ".join(f"{c:>16}" for c in cells))
    lines.append("  (each cell: per-layer budget / global budget; the runtime at capacity C also keeps the experts "
                 "that last left in its k staging slots (--engine.victims), so its per-layer LRU hit rate is this "
                 f"table's at C + {s['top_k']})")
    if "lookahead_recall" in s:
        shown = [(d, v) for d, v in sorted(s["lookahead_recall"].items(), key=lambda kv: int(kv[0]))
                 if not math.isnan(v["mean"])]  # d beyond the model's layers has nothing to measure
        if shown:
            lines.append("lookahead probe recall: " + ", ".join(f"d={d}: {v['mean']:.3f}" for d, v in shown)
                         + f" (chance k/E = {s['top_k'] / s['num_experts']:.3f})")
    if math.isnan(r["reuse_lag1"]["reuse"]):
        lines.append("(no consecutive tokens in this selection: reuse is undefined)")
    return "\n".join(lines)
