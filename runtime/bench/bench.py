"""`expertcache bench decode` on a live checkpoint: the unmodified model against the offload engine.

For every (capacity, predictor) configuration, on the same prompts, alternated pass by pass in one process:
- ``plain``: the unmodified model, every expert in memory (the reference TPOT; not for a quantized checkpoint,
  whose packed experts have no plain form);
- ``resident``: the engine with every expert resident (its overhead; the roofline's T_compute);
- ``on-demand``: the engine at that capacity, no predictor, blocking loads;
- the configuration itself (predictor + prefetch, the chosen miss policy).
Every pass is greedy through the decode loop of generate and serve (`generate.timed_greedy`); TPOT comes from the
time between successive tokens by its clock, prefill excluded.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.memory import peak_rss_bytes

from expertcache.runtime.engine.config import EngineConfig
from expertcache.runtime.engine.stats import Stats
from expertcache.runtime.engine.predictors import TemporalKeep, aux_routers_for, make_predictor
from expertcache.runtime.storage.tiers import available_memory, measure_bandwidth
from expertcache.runtime.bench.harness import alternate, claimed


def _pass(model, prompt, n_new, engine=None, warmup: int = 0) -> tuple[list[float], Stats | None, torch.Tensor]:
    """One timed greedy pass through the decode loop (`generate.timed_greedy`): the decode steps' TPOTs (all of
    them), the engine's counters over the steps after the first `warmup` and the output ids."""
    from expertcache.runtime.serve.generate import timed_greedy

    if engine is not None:
        engine.reset()
    times, out, stats = timed_greedy(model, prompt, n_new, engine, warmup)
    return np.diff(times).tolist(), stats, out  # [n_new - 1]: decode steps only


def overlap(bound_s: float, tpot_s: float) -> dict:
    """Overlap efficiency: the roofline bound (max of compute and transfer per token) over the measured TPOT,
    capped at 1 by definition (METRICS.md). Above 1 the bound itself was mismeasured (compute timed on another
    pass, noise), which `roofline_unreliable` says instead of a figure that cannot be."""
    eff = bound_s / tpot_s
    return {"overlap_efficiency": min(eff, 1.0), "roofline_unreliable": bool(eff > 1.0)}


def bench_decode(model_dir: str | Path, prompts: torch.Tensor, engine: EngineConfig = EngineConfig(tier="disk"),
                 capacities=(0.125, 0.25), predictors=("probe:1",), tokens: int = 64, warmup: int = 8,
                 rounds: int = 2, dtype=None, plain: bool | None = None, progress=None) -> dict:
    """The model is built once (`load`: experts stay in the checkpoint) and each configuration (`engine` at each
    of `capacities`: on demand, then with each of `predictors`) is attached to it in turn, pass by pass,
    alternated. `plain` (the unmodified model, every expert in memory, loaded with
    `from_pretrained`) is the reference when the checkpoint fits in half the available memory (None: decide so).
    The `spatio` predictor and the `scored` policy read the checkpoint's aux routers (`predictors.aux_routers_for`)."""
    from expertcache.runtime.storage.checkpoint import Checkpoint
    from expertcache.runtime.storage.loader import load, parse_device, parse_dtype, reattach, resolve

    tier, policy, miss, device = engine.tier, engine.policy, engine.miss, parse_device(engine.device)
    path = resolve(model_dir)
    ckpt_bytes = Checkpoint(path).bytes_on_disk()
    from expertcache.runtime.kernels.quant import read_config

    quantized = read_config(path) is not None  # packed experts: transformers has no plain form of them
    if plain and quantized:
        raise InputError(f"--plain true: {path} is a quantized checkpoint (its experts are packed), which has no "
                         f"plain transformers form; its reference is the checkpoint it was quantized from")
    if plain is None:
        plain = not quantized and ckpt_bytes < 0.5 * available_memory()
    rss_start = peak_rss_bytes()
    m = load(path, dtype=dtype, engine=replace(engine, capacity=capacities[0], device=device, predictor="none"))
    eng0 = m.expertcache
    e = eng0.adapter.num_experts
    rss_loaded = peak_rss_bytes()
    dt = parse_dtype(dtype) or (next(m.parameters()).dtype if quantized else getattr(torch, eng0.meta.tensors[0].dtype))
    n_new = warmup + tokens + 1
    from expertcache.telemetry.hf import check_context

    check_context(m, int(prompts.shape[1]), n_new - 1, "--prompt_len", "--warmup + --tokens")

    def attach(cap, pred="none", pol=policy, ms="blocking", tr=tier):
        aux = aux_routers_for(path, m) if pred == "spatio" or pol == "scored" else None
        keep = TemporalKeep(m, aux) if pol == "scored" and aux is not None else None
        cfg = replace(engine, capacity=cap, tier=tr, policy=pol, miss=ms, predictor=pred, device=device)
        return reattach(m, cfg, predictor=make_predictor(pred, m, aux, num_experts=e, hidden_size=m.config.hidden_size),
                        keep_scores=keep)

    configs = {}  # name -> () -> engine
    if e * eng0.meta.block_bytes * len(eng0.layers) < 0.4 * available_memory():
        configs["resident"] = lambda: attach(e, tr="disk", pol="lru")
    for cap in capacities:
        # on-demand: no predictor, blocking, LRU (the scored policy needs a predictor's scores)
        configs[f"on-demand@{cap:g}"] = lambda cap=cap: attach(cap, pol="lru" if policy == "scored" else policy)
        for p in predictors:
            if p != "none":
                configs[f"{p}+{miss}@{cap:g}"] = lambda cap=cap, p=p: attach(cap, p, policy, miss)
    plain_model = None
    if plain:
        from expertcache.telemetry.hf import load_causal_lm

        plain_model = load_causal_lm(path, dtype=dt).eval().to(device)
    names = (["plain"] if plain else []) + list(configs)
    # each configuration's timed TPOTs per round (its TPOT figures over all of them, its round medians per round)
    results = {name: {"rounds": [[] for _ in range(rounds)], "stats": [], "wall": [], "tokens_equal_plain": None}
               for name in names}
    plain_out = None
    bw = None

    def one_round(name: str, r: int) -> None:  # every prompt once, through `name` (the harness alternates names)
        nonlocal plain_out, bw
        if name == "plain":
            model, eng = plain_model, None
        else:
            model, eng = m, configs[name]()
            if bw is None and name.startswith("on-demand"):
                bw = measure_bandwidth(eng.tier, eng.meta, eng.pool_exec, eng.meta.num_layers)
        for b in range(prompts.shape[0]):
            tpot, stats, out = _pass(model, prompts[b:b + 1].to(device), n_new, eng, warmup)
            results[name]["rounds"][r].extend(tpot[warmup:])
            if stats is not None:
                results[name]["stats"].append(stats)
                results[name]["wall"].append(float(sum(tpot[warmup:])))  # the steps the stats cover
            if name == "plain":
                plain_out = out if b == 0 and r == 0 else plain_out
            elif b == 0 and plain_out is not None:
                same = bool(torch.equal(out, plain_out))
                prev = results[name]["tokens_equal_plain"]
                results[name]["tokens_equal_plain"] = same if prev is None else prev and same

    try:  # the first name (plain, or the first engine) leads every round; the others reverse every other round
        alternate(names, rounds, one_round, keep_first=True, after=(lambda *_: progress()) if progress else None)
    finally:
        if m.expertcache is not None:  # None when a configuration's engine failed to build (its error goes on)
            m.expertcache.close()
    eb, tb = eng0.meta.expert_bytes, eng0.traffic_expert_bytes  # tb None: experts of mixed sizes
    base = "plain" if plain else ("resident" if "resident" in results else None)
    def timed(name: str) -> np.ndarray:  # every timed TPOT of a configuration, all rounds
        return np.concatenate([np.asarray(x, dtype=float) for x in results[name]["rounds"]])

    t_base = float(np.median(timed(base))) if base else None
    t_res = float(np.median(timed("resident"))) if "resident" in results else None
    out = {"inputs": {"model": str(model_dir), "checkpoint_bytes": ckpt_bytes, "tier": tier, "budget": engine.budget,
                      "capacities": list(capacities), "predictors": list(predictors), "miss": miss, "policy": policy,
                      "tokens": tokens, "warmup": warmup, "rounds": rounds, "prompts": int(prompts.shape[0]),
                      "prompt_len": int(prompts.shape[1]), "torch_threads": torch.get_num_threads(),
                      "expert_bytes": eb, "dtype": str(dt).removeprefix("torch."), "expert_source": "checkpoint",
                      "device": device, "kernel": engine.kernel, "engine": asdict(engine),
                      "plain": bool(plain)},
           "tier_bandwidth_GBps": bw / 1e9 if bw else None, "t_compute_s": t_res,
           "peak_rss_bytes": {"start": rss_start, "after_load": rss_loaded, "end": peak_rss_bytes()},
           "configs": {}}
    for name, res in results.items():
        t = timed(name)
        row = {"tpot_median_s": float(np.median(t)), "tpot_p90_s": float(np.percentile(t, 90)),
               "tpot_round_medians_s": [float(np.median(x)) for x in res["rounds"] if x],
               "tokens_per_s": float(1 / np.median(t)), "greedy_tokens_equal_plain": res["tokens_equal_plain"]}
        if t_base:
            row[f"vs_{base}"] = float(np.median(t)) / t_base
            if name != base:  # the one claim rule of every ratio (`harness.claimed`)
                row[f"vs_{base}_claimed"] = claimed(row["tpot_round_medians_s"], [
                    float(np.median(x)) for x in results[base]["rounds"] if x])
        if res["stats"]:
            tot = sum(res["stats"], Stats())
            n_tok = len(res["stats"]) * (n_new - 1 - warmup)  # the timed steps (the TPOT figures' steps)
            tot.tokens = n_tok
            d = tot.to_dict(tb)
            d["prefetch_hits_per_token"] = tot.prefetch_hits / n_tok if n_tok else 0.0  # prefetches used
            d["time_budget_s"] = tot.time_budget(sum(res["wall"]), n_tok)
            if bw and t_res:
                t_transfer = d["traffic_bytes_per_token"] / bw
                d["t_transfer_s"] = t_transfer
                d.update(overlap(max(t_res, t_transfer), row["tpot_median_s"]))
            row.update(d)
        if "@" in name and not name.startswith("on-demand"):
            cap = name.split("@")[1]
            row["vs_on_demand"] = row["tpot_median_s"] / float(np.median(timed(f"on-demand@{cap}")))
            od = [float(np.median(x)) for x in results[f"on-demand@{cap}"]["rounds"] if x]
            row["vs_on_demand_claimed"] = claimed(row["tpot_round_medians_s"], od)
        out["configs"][name] = row
    return out


def _ratio(s: dict, key: str) -> str:
    """A ratio cell with its noise flag: the same rule (`harness.claimed`, `{key}_claimed`) for every ratio column."""
    if key not in s:
        return "—"
    return f"{s[key]:.3f}" + (" (rounds overlap: noise)" if s.get(f"{key}_claimed") is False else "")


def table(res: dict) -> str:
    """One row per configuration; beside its ratios, the prefetches it issued and used per token (a ratio off 1
    with none issued is the predictor's own compute, or noise)."""
    rows = ["| config | TPOT med (ms) | p90 (ms) | tok/s | × plain | × on-demand | prefetched/tok (used) | hit | "
            "adj. hit | MB/tok | stall ms/tok | overlap eff. | tokens = plain |", "|" + "---|" * 13]
    for name, s in res["configs"].items():
        f = lambda k, fmt, scale=1.0: format(s[k] * scale, fmt) if k in s else "—"  # noqa: E731
        pre = (f"{s['prefetch_loads_per_token']:.2f} ({s['prefetch_hits_per_token']:.2f})"
               if "prefetch_hits_per_token" in s else "—")
        rows.append(f"| {name} | {f('tpot_median_s', '.2f', 1e3)} | {f('tpot_p90_s', '.2f', 1e3)} | "
                    f"{f('tokens_per_s', '.1f')} | {_ratio(s, 'vs_plain')} | {_ratio(s, 'vs_on_demand')} | {pre} | "
                    f"{f('hit_rate', '.3f')} | {f('adjusted_hit_rate', '.3f')} | "
                    f"{f('traffic_bytes_per_token', '.2f', 1e-6)} | {f('stall_per_token_s', '.2f', 1e3)} | "
                    f"{f('overlap_efficiency', '.2f')} | {s['greedy_tokens_equal_plain']} |")
    return "\n".join(rows)
