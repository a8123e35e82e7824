"""The cache-aware post-training frontier: named variants of one cache-aware recipe, each trained on the same base
and judged by the same gate, plain and (where asked) served with the reroute miss policy.

`train-cache-aware --recipe frontier` runs every variant into `out_dir/<name>/` (a finished variant is not
trained again; an interrupted one resumes from its last checkpoint), evaluates each with `expertcache eval`
(step-wise token perplexity + lm-eval accuracy, the same documents for every model), gates it against the base
with `expertcache.evals.gate`, and writes one JSON list of rows (`frontier.out`, e.g. results/frontier.json) and
the frontier plot beside it (miss reduction at 1/8 of E against Δppl, with the published reference's points).

Row fields: `name`, `serving` (plain | reroute), `miss_reduction_1_8` (fraction of the base's LRU misses at 1/8 of
E removed: plain from the run's decode-style cache figures, reroute from the demand loads of the served
step-wise evaluation against the base served with LRU on the same tokens), `dppl_overall_pct`,
`dppl_max_domain_pct`, `dacc_min_points` (gate figures against the base), their paired 95% intervals
`dppl_overall_ci95`, `dppl_max_domain_ci95` ([low, high] in %), `dacc_ci95` (task -> [low, high] in points), the
samples `n_blocks` (per domain) and `n_documents` (task -> n), and `gate` (PASS / FAIL / INCONCLUSIVE), plus the run's
other figures (1/4 of E, Belady, the λ = 0 control, the Temporal router) where they exist.
"""

from __future__ import annotations

import json
from pathlib import Path

from expertcache.telemetry.atomic import write_json
from expertcache.trainer.cache_aware import CacheAwareRecipe, frontier_table
from expertcache.trainer.config import RecipeError, apply_overrides, from_dict, to_dict

# "Cacheable by Design?" (137M multi-domain models), as issue #12 quotes it: LRU miss reduction at 1/8 of E
# against Δppl in %; post-training alone, and post-training served with rerouting.
REFERENCE_POINTS = {"plain": [(2.1, 0.59), (3.1, 0.60)], "reroute": [(3.4, 0.80)]}


def variant(recipe: CacheAwareRecipe, name: str) -> CacheAwareRecipe:
    """The recipe of one frontier variant: the recipe with `frontier.variants[name]` applied, run into
    out_dir/<name>/ (every variant's overrides are checked before anything runs)."""
    data = to_dict(recipe)
    data.pop("frontier")
    data["out_dir"] = str(Path(recipe.out_dir) / name)
    data["name"] = name
    try:
        return from_dict(CacheAwareRecipe, apply_overrides(data, list(recipe.frontier.variants[name])))
    except RecipeError as e:
        raise RecipeError(f"frontier variant {name}: {e}") from None


def _done(recipe: CacheAwareRecipe) -> dict | None:
    """The variant's result.json if it finished with exactly this recipe."""
    from expertcache.trainer.config import load_recipe

    out = Path(recipe.out_dir)
    res, saved = out / "result.json", out / "recipe.yaml"
    if not (res.is_file() and saved.is_file()):
        return None
    try:
        same = to_dict(load_recipe(CacheAwareRecipe, saved)) == to_dict(recipe)
    except RecipeError:
        return None
    r = json.loads(res.read_text())
    return r if same and r.get("global_step") == recipe.train.max_steps else None


def asked_blocks(r: dict) -> tuple[int, int] | None:
    """(blocks per domain, tokens per block) an eval was asked for: as the frontier recorded it, or, for an eval
    written before it did, the most blocks of any domain (a note names the number asked where the text had fewer)."""
    if isinstance(r.get("asked_blocks"), list):
        return tuple(r["asked_blocks"])
    shapes = list((r.get("stepwise_blocks") or {}).values())
    if not shapes:
        return None
    asked = [int(n.rsplit(", ", 1)[1].split()[0]) for n in r.get("sample_notes", []) if " blocks of " in n]
    return max([s[0] for s in shapes] + asked), shapes[0][1]


def with_blocks(r: dict, p: dict, blocks: int, seq: int) -> dict:
    """Eval `r` with its step-wise part replaced by ppl-only eval `p`'s (the same model and serving): the blocks,
    their figures and notes; the seconds of both recorded."""
    out = {**r, **{k: p[k] for k in ("stepwise", "stepwise_blocks", "n_blocks")}}
    out["sample_notes"] = [n for n in r.get("sample_notes", []) if " blocks of " not in n] + \
        [n for n in p.get("sample_notes", []) if " blocks of " in n]
    out["asked_blocks"] = [blocks, seq]
    out["stepwise_again"] = {"seconds": p.get("seconds"), "blocks_before": r.get("n_blocks"),
                             "documents_seconds": r.get("seconds")}
    out["seconds"] = round((r.get("seconds") or 0) + (p.get("seconds") or 0), 1)
    return out


def run_frontier(recipe: CacheAwareRecipe, resume: bool = True, log=print) -> list[dict]:
    """Every variant in turn: trained (or its finished run reused), evaluated and gated, and the rows so far
    written (JSON and plot) after each one, so an interrupted frontier keeps what it measured."""
    from expertcache.evals.commands import documents_to_grow
    from expertcache.evals.gate import EVAL_FORMAT_VERSION, gate, with_tasks
    from expertcache.evals.run import evaluate
    from expertcache.runtime.engine.config import EngineConfig
    from expertcache.trainer.cache_aware import run_cache_aware

    f = recipe.frontier
    points = {name: variant(recipe, name) for name in f.variants}  # every variant checked before anything runs
    for name, point in points.items():
        c = point.serving.capacity  # a count (an int) never equals the fraction frontier.capacity, even 1 and 1.0
        if point.serving.reroute and name in f.reroute and (isinstance(c, int) or c != f.capacity):
            raise RecipeError(f"frontier variant {name}: serving.capacity={point.serving.capacity} but its reroute "
                              f"row is compared with the base at frontier.capacity={f.capacity}")
    out = Path(recipe.out_dir)
    from expertcache.telemetry.provenance import git_commit
    from expertcache.trainer.runfolder import claim_runs_folder

    commit = git_commit()  # taken before the work: edits made while the frontier runs are not its code

    claim_runs_folder(out)  # never a folder of anything but this frontier's runs and evaluations
    evals = out / "evals"
    kw = dict(corpus=recipe.data.corpus, task_dir=evals / "task-data", split=f.split)

    def ev(model, name, engine=None, lossy=False, ppl_only=False, grown=None):
        # served rows count the cache's demand loads token by token, as decoding sees them (a lossless policy's
        # batched evaluation would count whole blocks: the base's LRU loads must be comparable to reroute's)
        method = "token" if engine is not None else "auto"
        accuracy = f.lossy_accuracy if engine is not None and engine.lossy else "token"
        tasks, limit = (f.lossy_tasks, f.lossy_limit) if lossy else (f.tasks, f.limit)
        if ppl_only:  # only the step-wise blocks' figures are read (the base's LRU demand loads)
            tasks, limit = [], None
        blocks, seq = (f.lossy_ppl_blocks, f.lossy_seq_len) if lossy else (f.ppl_blocks, f.seq_len)
        where = kw
        if grown is not None:  # (tasks, documents): those tasks alone, on more documents, no blocks; their task
            (tasks, limit), blocks = grown, 0  # data built apart, so the documents every other eval read stay
            where = {**kw, "task_dir": evals / f"task-data-{limit}"}
        label = "plain" if engine is None else engine.label()
        path = evals / f"{name}.json"
        if path.is_file():
            r = json.loads(path.read_text())
            # older evals lack the gate's fingerprints (and accuracy_method: token); one served otherwise is not
            # this row's
            if r.get("format_version") == EVAL_FORMAT_VERSION and r.get("policy") == label \
                    and (engine is None or r.get("stepwise", {}).get("method") == "token") \
                    and r.get("accuracy_method", "token") in (accuracy, "batched"):
                same_docs = list(r.get("tasks") or []) == list(tasks) and r.get("limit") == limit
                if same_docs and asked_blocks(r) == (blocks, seq):
                    return r
                if same_docs and tasks:
                    # the documents' part stands (the same tasks and limit; evaluate scores them apart from the
                    # blocks, with an engine of their own): only the step-wise blocks are evaluated again
                    log(f"[frontier] eval {name} [{label}]: the step-wise blocks again ({blocks} of {seq} tokens "
                        f"per domain; the documents' scores kept)")
                    p = evaluate(model, engine=engine, tasks=[], limit=None, ppl_blocks=blocks, seq_len=seq,
                                 stepwise=method, accuracy=accuracy, **where)
                    r = with_blocks(r, p, blocks, seq)
                    write_json(path, r)
                    return r
        log(f"[frontier] eval {name} [{label}]")
        r = evaluate(model, engine=engine, tasks=tasks, limit=limit, ppl_blocks=blocks, seq_len=seq, stepwise=method,
                     accuracy=accuracy, **where)
        r["asked_blocks"] = [blocks, seq]
        write_json(path, r)
        return r

    base = recipe.base
    base_plain = ev(base, "base-plain")
    served = EngineConfig(capacity=f.capacity, tier="host")
    reroute = EngineConfig(capacity=f.capacity, tier="host", miss="reroute", tau=f.tau)
    base_small = base_lru = None
    if f.reroute:
        base_small = ev(base, "base-lossy", lossy=True)
        # the base served with LRU: only its demand loads on the step-wise blocks are compared (no documents)
        base_lru = ev(base, "base-lru", served, lossy=True, ppl_only=True)["stepwise"]["engine"]["demand_loads"]
    rows: list[dict] = []

    def served_row(name, model, res, control, point=None):
        # a variant trained serving-aware is served as it was trained (its own capacity and tau)
        sv = point.serving if point is not None and point.serving.reroute else None
        engine = reroute if sv is None else EngineConfig(capacity=sv.capacity, tier="host", miss="reroute",
                                                         tau=sv.tau)
        r = ev(model, f"{name}-reroute", engine, lossy=True)
        e = r["stepwise"]["engine"]
        row = frontier_row(name, "reroute", res, gate(base_small, r), None, control)
        row.update(miss_reduction_1_8=1 - e["demand_loads"] / base_lru, demand_loads=e["demand_loads"],
                   base_lru_demand_loads=base_lru, rerouted=e.get("rerouted", 0), capacity=engine.capacity,
                   tau=engine.tau)
        return row

    def where(row):
        # each row says where it came from: the commit, and the recipe, variant and evaluation samples it ran with
        ev_sizes = ({"tasks": f.lossy_tasks, "limit": f.lossy_limit, "ppl_blocks": f.lossy_ppl_blocks,
                     "seq_len": f.lossy_seq_len, "accuracy": f.lossy_accuracy} if row["serving"] == "reroute" else
                    {"tasks": f.tasks, "limit": f.limit, "ppl_blocks": f.ppl_blocks, "seq_len": f.seq_len,
                     "grow_documents": f.grow_documents if row["name"] in f.grow else None})
        row.update(commit=commit, command=f"expertcache train-cache-aware --recipe {recipe.name}",
                   config={"recipe": recipe.name, "base": recipe.base, "split": f.split,
                           "variant": list(f.variants.get(row["name"], [])), "eval": ev_sizes})

    def publish():
        for r in rows:
            if "commit" not in r:
                where(r)
        write_json(f.out, rows)
        plot_frontier(rows, Path(f.out).with_suffix(".png"))

    if "base" in f.reroute:
        rows.append(served_row("base", base, None, None))
        publish()
    control = None
    for name, point in points.items():
        res = _done(point) if resume else None
        if res is None:
            log(f"[frontier] train {name}")
            res = run_cache_aware(point, resume)
        if "summary" not in res:  # a streamed variant: its cache figures measured on the saved model
            from expertcache.trainer.cache_aware.run import with_cache_summary

            log(f"[frontier] cache figures of {name}")
            res = with_cache_summary(point, res)
        if name == f.control:
            control = res
        model = str(Path(res["out_dir"]) / "model")
        cand = ev(model, f"{name}-plain")
        g = gate(base_plain, cand)
        grown = None
        if name in f.grow and g["gate"] == "INCONCLUSIVE":
            want, why = documents_to_grow(g, f.limit, f.grow_documents, "frontier.grow_documents")
            if want:  # one document count for the tasks grown (the most any asks), in one evaluation per model
                tasks, n = sorted(want), max(want.values())
                log(f"[frontier] {name} INCONCLUSIVE on accuracy ({', '.join(g['unresolved'])}): the base and "
                    f"{name} again on {n} documents of {', '.join(tasks)}")
                key = f"grown{n}-{'+'.join(tasks)}"
                g = gate(with_tasks(base_plain, ev(base, f"base-plain-{key}", grown=(tasks, n)), tasks),
                         with_tasks(cand, ev(model, f"{name}-plain-{key}", grown=(tasks, n)), tasks))
                grown = {t: g["n_documents"].get(t) for t in tasks}
            else:
                log(f"[frontier] {name} INCONCLUSIVE, not grown: {why}")
        row = frontier_row(name, "plain", res, g, res["summary"]["capacities"], control)
        if grown:
            row["grown_documents"] = grown  # tasks evaluated again on more documents (their counts in n_documents)
        rows.append(row)
        if name in f.reroute:
            rows.append(served_row(name, model, res, control, point))
        publish()
    log(frontier_table(rows))
    return rows


def frontier_row(name: str, serving: str, res: dict | None, g: dict, caps: dict | None, control: dict | None) -> dict:
    d = g["dppl_percent"]
    row = {"name": name, "serving": serving, "miss_reduction_1_8": None,
           "dppl_overall_pct": d.get("overall"),
           "dppl_max_domain_pct": max(v for k, v in d.items() if k != "overall"),
           "dacc_min_points": min(g["dacc_points"].values()) if g["dacc_points"] else None,
           # the gate's paired intervals (in %, in points), the samples they rest on, and the three-way verdict
           "dppl_overall_ci95": g["dppl_overall_ci95"], "dppl_max_domain_ci95": g["dppl_max_domain_ci95"],
           "dacc_ci95": g["dacc_ci95"], "dacc_method": g.get("dacc_method"), "n_blocks": g["n_blocks"],
           "n_documents": g["n_documents"], "gate": g["gate"], "failures": g["failures"],
           "unresolved": g["unresolved"], "resolve": g["resolve"],
           "dppl_percent": d, "dacc_points": g["dacc_points"]}
    if res is None:
        return row
    row.update(steps=res["global_step"], mode=res["mode"], locality=res["locality"])
    if caps:
        # the recipe's capacities (1/8 and 1/4 of E); on a model with few experts both can round to one cache
        c8, c4 = (sorted(caps.values(), key=lambda c: c["capacity_frac"]) * 2)[:2]
        row.update(miss_reduction_1_8=c8["lru_miss_reduction"], miss_reduction_1_4=c4["lru_miss_reduction"],
                   capacity_frac_1_8=c8["capacity_frac"], capacity_frac_1_4=c4["capacity_frac"],
                   lru_hit_1_8=c8["lru"]["hit_rate"], belady_hit_1_8=c8["lru"]["belady_hit_rate"],
                   lru_hit_1_4=c4["lru"]["hit_rate"], belady_hit_1_4=c4["lru"]["belady_hit_rate"],
                   base_lru_hit_1_8=c8["base_lru"]["hit_rate"])
        if "best_router_policy" in c8:
            row.update(temporal_adjusted_gain_points_1_8=c8["router_adjusted_gain_points"],
                       temporal_traffic_ratio_1_8=c8["router_traffic_ratio"], router_policy=c8["best_router_policy"])
        # the run's own 64-block perplexity figures (teacher-forced), against the base and the λ = 0 control
        row["dppl_eval_blocks_pct"] = res["summary"]["dppl_percent"]
        if control is not None:
            row["dppl_vs_control_pct"] = {k: 100 * (res["candidate"]["ppl"][k] / control["candidate"]["ppl"][k] - 1)
                                          for k in res["candidate"]["ppl"]}
    return row


def plot_frontier(rows: list[dict], out_png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    x_max = 30.0  # the region the targets live in; a point beyond it is drawn at the edge with its value
    for serving, marker in (("plain", "o"), ("reroute", "s")):
        pts = [r for r in rows if r["serving"] == serving and r["miss_reduction_1_8"] is not None]
        xs = [min(r["dppl_overall_pct"], x_max) for r in pts]
        ax.scatter(xs, [100 * r["miss_reduction_1_8"] for r in pts],
                   marker=marker, label=f"expertcache ({serving})", zorder=3,
                   c=[{"PASS": "tab:green", "INCONCLUSIVE": "tab:orange"}.get(r["gate"], "tab:red") for r in pts])
        for x, r in zip(xs, pts):
            label = r["name"] if x == r["dppl_overall_pct"] else f"{r['name']} (→ {r['dppl_overall_pct']:+.0f}%)"
            ax.annotate(label, (x, 100 * r["miss_reduction_1_8"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points", ha="right" if x == x_max else "left")
        ref = REFERENCE_POINTS[serving]
        ax.scatter([x for x, _ in ref], [100 * y for _, y in ref], marker=marker, facecolors="none",
                   edgecolors="k", label=f"Cacheable by Design? ({serving}, published)")
    ax.axvline(1.0, ls="--", c="grey", lw=1)
    ax.axhline(50, ls=":", c="tab:blue", lw=1)
    ax.axhline(80, ls=":", c="tab:purple", lw=1)
    ax.set(xlabel="Δppl overall vs the base (%)", ylabel="LRU misses removed at 1/8 of E (%)",
           title="Cache-aware post-training frontier (gate: green PASS, orange INCONCLUSIVE, red FAIL)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    from expertcache.telemetry.atomic import write_figure

    write_figure(fig, out_png)
    plt.close(fig)
