"""`expertcache bench decode` on a live checkpoint: plain `model.generate` against the offload engine.

For every (capacity, predictor) configuration, on the same prompts, alternated pass by pass in one process:
- ``plain``: the unmodified model, every expert in memory (the reference TPOT);
- ``resident``: the engine with every expert resident (its overhead; the roofline's T_compute);
- ``on-demand``: the engine at that capacity, no predictor, blocking loads;
- the configuration itself (predictor + prefetch, the chosen miss policy).
TPOT comes from the time between successive generated tokens (a streamer timestamps each), prefill excluded.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import torch

from .engine import EngineConfig, OffloadEngine, Stats
from .predictors import TemporalKeep, make_predictor
from .store import model_fingerprint, read_store_meta, write_store
from .tiers import measure_bandwidth


class TokenClock:
    """A `generate` streamer that records when each new token arrives, and the engine's counters at the first."""

    def __init__(self, engine: OffloadEngine | None = None):
        self.engine, self.times, self.first_stats = engine, [], None
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # generate passes the prompt first
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        if self.engine is not None and self.first_stats is None:
            self.first_stats = copy.deepcopy(self.engine.stats)

    def end(self):
        pass


def _diff(after: Stats, before: Stats) -> Stats:
    out = Stats()
    for f in ("calls", "tokens", "accesses", "hits", "demand_loads", "prefetch_loads", "prefetch_dropped",
              "prefetch_hits", "rerouted", "stall_s", "bytes_moved"):
        setattr(out, f, getattr(after, f) - getattr(before, f))
    return out


def store_for(model, store_dir: str | Path) -> Path:
    """The checkpoint's expert store in `store_dir`, written once (named by the model's fingerprint)."""
    store_dir = Path(store_dir)
    store_dir.mkdir(parents=True, exist_ok=True)
    path = store_dir / f"{model_fingerprint(model)}.store"
    if path.is_file():
        read_store_meta(path)
        return path
    write_store(model, path)
    return path


def _pass(model, prompt, n_new, engine=None) -> tuple[list[float], Stats | None, torch.Tensor]:
    if engine is not None:
        engine.reset()
    clock = TokenClock(engine)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             attention_mask=torch.ones_like(prompt), streamer=clock,
                             pad_token_id=model.config.pad_token_id)
    tpot = np.diff(clock.times).tolist()  # [n_new - 1]: decode steps only
    stats = _diff(engine.stats, clock.first_stats) if engine is not None else None
    return tpot, stats, out


def bench_decode(model_dir: str | Path, prompts: torch.Tensor, tier: str = "disk", capacities=(0.125, 0.25),
                 predictors=("probe:1",), miss: str = "blocking", policy: str = "lru", tokens: int = 64,
                 warmup: int = 8, rounds: int = 2, store_dir: str | Path = "runs/stores", tau: float = 0.1,
                 load_aux=None, budget: str = "layer", progress=None) -> dict:
    """`load_aux(model) -> AuxRouters`: the checkpoint's auxiliary routers, for the `spatio` predictor and the
    `scored` policy (passed in by the caller: the runtime does not depend on the trainer)."""
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    plain = load()
    store = store_for(plain, store_dir)
    from expertcache.telemetry.adapters import adapter_for

    e = adapter_for(plain).num_experts
    n_new = warmup + tokens + 1
    runners = {"plain": (plain, None)}
    m = load()
    runners["resident"] = (m, OffloadEngine(m, store, EngineConfig(capacity=e, tier="host")))
    for cap in capacities:
        m = load()
        # on-demand: no predictor, blocking, LRU (the scored policy needs a predictor's scores)
        runners[f"on-demand@{cap:g}"] = (m, OffloadEngine(m, store, EngineConfig(
            capacity=cap, tier=tier, policy="lru" if policy == "scored" else policy, budget=budget)))
        for p in predictors:
            m = load()
            aux = load_aux(m) if (p == "spatio" or policy == "scored") and load_aux is not None else None
            keep = TemporalKeep(m, aux) if policy == "scored" and aux is not None else None
            runners[f"{p}+{miss}@{cap:g}"] = (m, OffloadEngine(
                m, store, EngineConfig(capacity=cap, tier=tier, policy=policy, miss=miss, tau=tau, budget=budget),
                predictor=make_predictor(p, m, aux, num_experts=e, hidden_size=m.config.hidden_size),
                keep_scores=keep))
    results = {name: {"tpot": [], "stats": [], "tokens_equal_plain": True} for name in runners}
    plain_out = None
    try:
        eng = next((r[1] for n, r in runners.items() if n.startswith("on-demand")), runners["resident"][1])
        bw = measure_bandwidth(eng.tier, eng.meta, eng.pool_exec, eng.meta.num_layers)
        for r in range(rounds):
            names = list(runners) if r % 2 == 0 else list(runners)[:1] + list(runners)[:0:-1]
            for name in names:
                model, eng = runners[name]
                for b in range(prompts.shape[0]):
                    tpot, stats, out = _pass(model, prompts[b:b + 1], n_new, eng)
                    results[name]["tpot"].extend(tpot[warmup:])
                    if stats is not None:
                        results[name]["stats"].append(stats)
                    if name == "plain":
                        plain_out = out if b == 0 and r == 0 else plain_out
                    elif b == 0 and plain_out is not None:
                        results[name]["tokens_equal_plain"] &= bool(torch.equal(out, plain_out))
                if progress:
                    progress()
    finally:
        for _, eng in runners.values():
            if eng is not None:
                eng.close()
    eb = read_store_meta(store).expert_bytes
    t_plain = float(np.median(results["plain"]["tpot"]))
    t_res = float(np.median(results["resident"]["tpot"]))
    out = {"inputs": {"model": str(model_dir), "tier": tier, "budget": budget, "capacities": list(capacities),
                      "predictors": list(predictors), "miss": miss, "policy": policy, "tokens": tokens,
                      "warmup": warmup, "rounds": rounds, "prompts": int(prompts.shape[0]),
                      "prompt_len": int(prompts.shape[1]), "torch_threads": torch.get_num_threads(),
                      "expert_bytes": eb, "store": str(store)},
           "tier_bandwidth_GBps": bw / 1e9, "t_compute_s": t_res, "configs": {}}
    for name, res in results.items():
        t = np.asarray(res["tpot"])
        row = {"tpot_median_s": float(np.median(t)), "tpot_p90_s": float(np.percentile(t, 90)),
               "tokens_per_s": float(1 / np.median(t)), "vs_plain": float(np.median(t)) / t_plain,
               "greedy_tokens_equal_plain": res["tokens_equal_plain"]}
        if res["stats"]:
            tot = Stats()
            for s in res["stats"]:
                for f in ("tokens", "accesses", "hits", "demand_loads", "prefetch_loads", "prefetch_dropped",
                          "prefetch_hits", "rerouted", "stall_s", "bytes_moved"):
                    setattr(tot, f, getattr(tot, f) + getattr(s, f))
            n_tok = len(res["stats"]) * (n_new - 1)
            tot.tokens = n_tok
            d = tot.to_dict(eb)
            d["stall_per_token_s"] = tot.stall_s / n_tok
            t_transfer = d["traffic_bytes_per_token"] / bw
            d["t_transfer_s"] = t_transfer
            d["overlap_efficiency"] = max(t_res, t_transfer) / row["tpot_median_s"]
            row.update(d)
        if "@" in name and not name.startswith("on-demand"):
            cap = name.split("@")[1]
            row["vs_on_demand"] = row["tpot_median_s"] / float(np.median(results[f"on-demand@{cap}"]["tpot"]))
        out["configs"][name] = row
    return out


def table(res: dict) -> str:
    rows = ["| config | TPOT med (ms) | p90 (ms) | tok/s | × plain | × on-demand | hit | adj. hit | MB/tok | "
            "stall ms/tok | overlap eff. | tokens = plain |", "|" + "---|" * 12]
    for name, s in res["configs"].items():
        f = lambda k, fmt, scale=1.0: format(s[k] * scale, fmt) if k in s else "—"  # noqa: E731
        rows.append(f"| {name} | {f('tpot_median_s', '.2f', 1e3)} | {f('tpot_p90_s', '.2f', 1e3)} | "
                    f"{f('tokens_per_s', '.1f')} | {f('vs_plain', '.3f')} | {f('vs_on_demand', '.3f')} | "
                    f"{f('hit_rate', '.3f')} | {f('adjusted_hit_rate', '.3f')} | "
                    f"{f('traffic_bytes_per_token', '.2f', 1e-6)} | {f('stall_per_token_s', '.2f', 1e3)} | "
                    f"{f('overlap_efficiency', '.2f')} | {s['greedy_tokens_equal_plain']} |")
    return "\n".join(rows)
