"""Replay at realistic sizes: random-weight experts of a real model's shape in a real store on disk, driven by the
routing of a real trace (default: Qwen3-30B-A3B, 128 experts, top-8, shipped in telemetry/reference), with the real
reads (page cache bypassed) and the real expert compute (`kernels.swiglu_experts`) of one decode token at a time.

Per token and MoE layer i: the predictor names layer i+1's experts (from the trace itself: persistence, a
co-occurrence estimator fitted on the first part of the trace, or the oracle degraded to a stated recall); those
not resident are prefetched asynchronously while layer i computes; then layer i's misses are loaded and its
experts compute. With prefetching the resident experts compute while the missing ones load; on-demand loads the
misses, waits, then computes. A pass starts from an empty cache; configurations are alternated pass by pass on
the same tokens (METRICS.md: speedups are ratios within one run).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from expertcache.telemetry.cachesim import capacity_count
from expertcache.telemetry.errors import InputError

from expertcache.telemetry.routing import load_routing

from expertcache.runtime.storage.checkpoint import StoreExperts
from expertcache.runtime.engine.config import ENGINE_POLICIES, EngineConfig
from expertcache.runtime.engine.engine import OffloadEngine
from expertcache.runtime.engine.predictors import Predictor
from expertcache.runtime.engine.trace_predictors import (REPLAY_DEFAULTS, CooccurrenceEstimator, TracePredictor, check_replay_predictor,
                               next_use_scores, predicted)
from expertcache.runtime.storage.store import STORE_DIR, read_store_meta, write_random_store
from expertcache.runtime.storage.tiers import make_tier, measure_bandwidth
from expertcache.runtime.bench.harness import alternate, claimed

# the reference Qwen3-30B-A3B traces ship with the package (MIT; telemetry/reference/README.md)
REFERENCE_DIR = Path(__file__).resolve().parents[2] / "telemetry" / "reference" / "qwen3-30b-a3b-routing"
REFERENCE_TRACE = str(REFERENCE_DIR / "code.npz")


def parse_shape(s: str) -> tuple[int, int]:
    try:
        h, i = (int(x) for x in s.lower().split("x"))
    except ValueError:
        raise InputError(f"--expert_shape {s!r}: expected HIDDENxINTERMEDIATE, e.g. 2048x768") from None
    if h < 1 or i < 1:
        raise InputError(f"--expert_shape {s!r}: expected sizes >= 1, e.g. 2048x768")
    return h, i


def check_replay_fits(store_dir, layers: int, num_experts: int, hidden: int, inter: int, dtype: str,
                      per_expert: int, tier: str, capacity: int | float) -> None:
    """Before a store is written: it fits on the disk (unless already there), and what the tier and the cache hold
    in RAM fits in the memory available."""
    import shutil

    from expertcache.runtime.storage.tiers import TierSpec, available_memory

    total = layers * num_experts * per_expert
    path = Path(store_dir) / f"replay-{layers}x{num_experts}-{hidden}x{inter}-{dtype}.store"
    folder = next((p for p in [Path(store_dir), *Path(store_dir).absolute().parents] if p.exists()), Path("."))
    if not path.is_file() and total > shutil.disk_usage(folder).free - (1 << 30):
        raise InputError(f"a replay store of {total / 1e9:.1f} GB does not fit the free disk at {folder} "
                         f"({shutil.disk_usage(folder).free / 1e9:.1f} GB); lower --disk_budget_gb or --expert_shape")
    held = layers * capacity_count(capacity, num_experts) * per_expert
    if TierSpec.parse(tier).kind != "disk":
        held += total
    if held > 0.9 * available_memory():
        raise InputError(f"the cache ({capacity} of {num_experts} experts per layer) and tier {tier} hold "
                         f"{held / 2**30:.1f} GiB in RAM; only {available_memory() / 2**30:.1f} GiB is available")


def ensure_store(folder: str | Path, layers: int, num_experts: int, hidden: int, inter: int, dtype: str,
                 progress=None) -> Path:
    """A random store of this shape in `folder`, written once and reused (its name says its shape)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"replay-{layers}x{num_experts}-{hidden}x{inter}-{dtype}.store"
    if path.is_file():
        try:
            read_store_meta(path)
            return path
        except InputError as e:  # a store of random experts: rebuilt, and said so
            import sys

            print(f"replay: {path} is damaged ({e}); writing it again", file=sys.stderr)
            path.unlink()
    write_random_store(path, layers, num_experts, [("gate_up_proj", [2 * inter, hidden], dtype),
                                                   ("down_proj", [hidden, inter], dtype)], progress=progress)
    return path


@dataclass
class ReplayConfig:
    name: str
    predictor: str = "none"  # one of predictors.REPLAY_PREDICTORS: none, persistence, cooccurrence, oracle[:<recall>]
    prefetch: bool = False
    belady: bool = False  # evict by the trace's next use (the offline bound), instead of LRU
    policy: str | None = None  # another cache policy (e.g. learned:FILE); default LRU (Belady when `belady`)


def replay_model(layers: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype):
    """A Qwen3-MoE skeleton of the replayed shape on the meta device: only its experts modules are used (the
    engine replaces them); nothing else is ever materialised."""
    from transformers import Qwen3MoeConfig

    from expertcache.runtime.storage.loader import _meta_model

    cfg = Qwen3MoeConfig(vocab_size=16, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                         num_experts=num_experts, num_experts_per_tok=top_k, decoder_sparse_step=1,
                         norm_topk_prob=True)
    return _meta_model(cfg, dtype)


class Replayer:
    """Drives the engine's own decode step (`OffloadEngine.run_layer`) token by token, layer by layer, with the
    trace's routing in place of a router's and a fixed random hidden state: the loads, the overlap, the cache
    and the compute are exactly serving's."""

    def __init__(self, store: Path, ids: np.ndarray, engine: EngineConfig = EngineConfig(tier="disk"), seed: int = 0):
        """`engine`: the engine's options (capacity, tier, workers, prefetch guard, ...); each configuration
        replayed sets its own predictor and, for the Belady bound or a learned policy, its policy."""
        self.cfg = engine
        self.source = StoreExperts(store, read_store_meta(store))
        self.meta = self.source.meta
        self.ids = ids
        n_l, _, self.k = ids.shape
        self.e = self.meta.num_experts
        if ids.max() >= self.e:
            raise InputError(f"trace uses expert {ids.max()}, the store has {self.e} per layer")
        self.capacity = capacity_count(engine.capacity, self.e)
        gu = self.meta.tensors[0]
        self.dtype = gu.torch_dtype
        hidden, inter = gu.shape[1], gu.shape[0] // 2
        self.model = replay_model(n_l, self.e, self.k, hidden, inter, self.dtype)
        self.tier = make_tier(engine.tier, self.source)
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(1, hidden, generator=g).to(self.dtype)
        self.w = torch.full((1, self.k), 1.0 / self.k, dtype=self.dtype)
        self.engine = None

    def _engine(self, cfg: ReplayConfig, est, policy: str | None = None) -> OffloadEngine:
        if self.engine is not None:
            self.engine.detach()
        keep = None
        if cfg.belady:
            if not hasattr(self, "_nu"):
                self._nu = next_use_scores(self.ids, self.e)
            keep = lambda pos, hidden, needed: self._nu[pos, self.pred.t].tolist()  # noqa: E731
        self.pred = TracePredictor(cfg.predictor, self.ids, est) if cfg.prefetch else Predictor()
        self.pred.t = 0
        ecfg = replace(self.cfg, capacity=self.capacity, predictor=self.pred.name,
                       policy=policy or ("scored" if cfg.belady else self.cfg.policy))
        self.engine = OffloadEngine(self.model, self.source, ecfg, predictor=self.pred, keep_scores=keep,
                                    tier=self.tier)
        return self.engine

    def compute_only(self, tokens: range) -> list[float]:
        """TPOT with every needed expert resident: the all-hits call of the step over k slots, no loads (the
        roofline's T_compute)."""
        times = []
        slots = torch.arange(self.k)[None, :]
        for _ in tokens:
            t0 = time.perf_counter()
            for mod in self.engine.modules:
                mod.compute(self.x, slots, self.w)
            times.append(time.perf_counter() - t0)
        return times

    def run(self, cfg: ReplayConfig, tokens: range, est=None, policy: str | None = None) -> dict:
        eng = self._engine(cfg, est, policy or cfg.policy)
        n_l = self.ids.shape[0]
        ids = torch.as_tensor(self.ids)
        times = []
        for t in tokens:
            self.pred.t = t
            t0 = time.perf_counter()
            for i in range(n_l):
                eng.run_layer(eng.modules[i], self.x, ids[i, t][None, :], self.w)
            eng.end_step()  # the token leaves once its experts' first-read checks passed (timed: they are its cost)
            times.append(time.perf_counter() - t0)
        st = eng.stats
        eng.reset()  # waits for what is still in flight: the next configuration starts quiet
        return {"times": times, "hits": st.hits, "demand": st.demand_loads, "prefetch": st.prefetch_loads,
                "dropped": st.prefetch_dropped, "stall": st.stall_s, "acc": st.accesses}

    def close(self):
        if self.engine is not None:
            self.engine.detach()
        self.tier.close()


def _summary(runs: list[dict], warmup: int, expert_bytes: int) -> dict:
    from expertcache.telemetry.cachesim import CacheResult

    t = np.concatenate([np.asarray(r["times"][warmup:]) for r in runs])
    tokens = sum(len(r["times"]) for r in runs)
    c = CacheResult("replay", 0, "token", tokens, sum(r["acc"] for r in runs), sum(r["hits"] for r in runs),
                    sum(r["demand"] for r in runs), sum(r["prefetch"] for r in runs))
    d = c.per_step(expert_bytes, "token")
    return {"tpot_median_s": float(np.median(t)), "tpot_p90_s": float(np.percentile(t, 90)),
            "tokens_per_s": float(1 / np.median(t)),
            **{k: d[k] for k in ("hit_rate", "adjusted_hit_rate", "demand_loads_per_token",
                                 "prefetch_loads_per_token")},
            "prefetch_dropped": sum(r["dropped"] for r in runs),
            "traffic_bytes_per_token": d["traffic_bytes_per_token"],
            "stall_per_token_s": sum(r["stall"] for r in runs) / tokens}


def replay_benchmark(trace: str | Path = REFERENCE_TRACE, expert_shape: str = "2048x768", dtype: str = "bfloat16",
                     engine: EngineConfig = EngineConfig(tier="disk"), predictors=REPLAY_DEFAULTS,
                     tokens: int = 64, warmup: int = 8, rounds: int = 2, disk_budget_gb: float = 8.0,
                     store_dir: str | Path = STORE_DIR, first_layer: int | None = None,
                     fit_frac: float = 0.2, belady_bound: bool = True, progress=None) -> dict:
    """On-demand vs each prefetching predictor, alternated pass by pass on the same tokens; JSON-ready.
    `engine`: the engine's options (capacity, tier, workers, the prefetch guard: 0 prefetches whatever a
    predictor names). Its policy is every row's eviction; a `learned:FILE` policy adds an on-demand row with it
    beside on-demand LRU (the learned policy's comparison), and `scored` needs a Temporal router a replay has none
    of (its Belady bound scores by the trace's next use)."""
    engine.check()
    policy = ENGINE_POLICIES.parse(engine.policy)
    if policy.name == "scored":
        raise InputError("a replay has no Temporal router for policy scored (its oracle+belady row is the scored "
                         "policy under the trace's next use); use lru, lfu, static or learned:FILE")
    policy_file = policy.arg if policy.name == "learned" else None
    if policy_file is not None:
        engine = replace(engine, policy="lru")
    r = load_routing(trace)
    ids_all, e, tmeta = r.ids, r.num_experts, r.meta
    hidden, inter = parse_shape(expert_shape)
    from expertcache.telemetry.hf import parse_dtype

    tdt = parse_dtype(dtype, "--dtype") or torch.bfloat16
    dt = str(tdt).removeprefix("torch.")  # the store's name for it (bf16 -> bfloat16)
    per_expert = 3 * hidden * inter * torch.empty((), dtype=tdt).element_size()
    n_layers = int(min(ids_all.shape[0], disk_budget_gb * 1e9 // (per_expert * e)))
    if n_layers < 2:
        raise InputError(f"a disk budget of {disk_budget_gb} GB holds {n_layers} layer(s) of {e} experts of "
                         f"{per_expert / 1e6:.1f} MB; need at least 2")
    start = first_layer if first_layer is not None else max(0, min(ids_all.shape[0] // 2 - n_layers // 2,
                                                                   ids_all.shape[0] - n_layers))
    cut = int(fit_frac * ids_all.shape[1])
    if cut + warmup + tokens > ids_all.shape[1]:
        raise InputError(f"trace has {ids_all.shape[1]} tokens; need {cut + warmup + tokens}")
    ids = ids_all[start:start + n_layers]
    check_replay_fits(store_dir, n_layers, e, hidden, inter, dt, per_expert, engine.tier, engine.capacity)
    est = CooccurrenceEstimator(ids[:, :cut], e)
    store = ensure_store(store_dir, n_layers, e, hidden, inter, dt, progress=progress)
    rp = Replayer(store, ids, engine)
    cap = rp.capacity
    span = range(cut, cut + warmup + tokens)
    for p in predictors:
        check_replay_predictor(p)
    configs = [ReplayConfig("on-demand")] + [ReplayConfig(p, p, True) for p in predictors]
    if policy_file is not None:  # the learned eviction policy, on-demand (lossless: only what stays changes)
        configs.append(ReplayConfig("on-demand+learned", policy=f"learned:{policy_file}"))
    if belady_bound:  # the offline bound: oracle prefetch and Belady eviction (not realizable; lossless)
        configs.append(ReplayConfig("oracle+belady", "oracle", True, belady=True))
    by_name = {c.name: c for c in configs}
    compute, bws = [], []
    base = {}  # round -> on-demand's median (it leads every round): the paired per-round ratios

    def probe(r: int) -> None:  # each round; the best is the tier's bandwidth (a conservative T_transfer, so
        bws.append(measure_bandwidth(rp.tier, rp.meta, rp.engine.pool_exec, ids.shape[0], 128, r))  # overlap
        compute.append(rp.compute_only(span))  # efficiency is not flattered)

    def one(name: str, r: int) -> dict:
        res = rp.run(by_name[name], span, est)
        res["median"] = float(np.median(res["times"][warmup:]))
        base.setdefault(r, res["median"])
        return res

    try:
        rp.run(configs[-1], range(cut, cut + warmup), est)  # untimed: threads, allocator, file handles warm
        runs = alternate([c.name for c in configs], rounds, one, keep_first=True, before_round=probe,
                         after=(lambda *_: progress()) if progress else None)
    finally:
        rp.close()
    t_compute = float(np.median(np.concatenate([np.asarray(c[warmup:]) for c in compute])))
    bw = max(bws)
    out = {"inputs": {"trace": str(trace), "trace_model": tmeta.get("model", ""), "layers": [start, start + n_layers],
                      "num_experts": e, "top_k": ids.shape[2], "expert_shape": [hidden, inter], "dtype": dt,
                      "compute_dtype": str(rp.dtype).removeprefix("torch."), "expert_bytes": rp.meta.expert_bytes,
                      "tier": engine.tier, "page_cache": rp.tier.describe().get("page_cache"), "capacity": cap,
                      "capacity_frac": cap / e, "tokens": tokens, "warmup": warmup, "rounds": rounds,
                      "workers": engine.workers, "engine": asdict(engine), "torch_threads": torch.get_num_threads(), "estimator_fit_tokens": cut,
                      "store": str(store)},
           "tier_bandwidth_GBps": bw / 1e9, "tier_bandwidth_per_round_GBps": [b / 1e9 for b in bws],
           "t_compute_s": t_compute, "configs": {}}
    def runs_medians(name: str) -> list[float]:
        return [x["median"] for x in runs[name]]

    for c in configs:
        s = _summary(runs[c.name], warmup, rp.meta.expert_bytes)
        if c.predictor in ("persistence", "cooccurrence"):  # recall of layer i+1's experts, as predicted at layer i
            rng = np.random.default_rng(0)
            rec = [len(set(predicted(c.predictor, ids, est, rng, i, t, ids.shape[2], e)) & set(ids[i + 1, t].tolist()))
                   / ids.shape[2] for t in span for i in range(n_layers - 1)]
            s["recall"] = float(np.mean(rec))
        t_transfer = s["traffic_bytes_per_token"] / bw
        s["t_transfer_s"] = t_transfer
        s["roofline_s"] = max(t_compute, t_transfer)
        from expertcache.runtime.bench.bench import overlap

        s.update(overlap(max(t_compute, t_transfer), s["tpot_median_s"]))
        s["tpot_round_medians_s"] = [x["median"] for x in runs[c.name]]
        if c.name != "on-demand":
            ratios = [x["median"] / base[r] for r, x in enumerate(runs[c.name])]
            s["tpot_vs_on_demand"] = ratios
            s["tpot_ratio_median"] = float(np.median(ratios))
            # the one claim rule (`harness.claimed`): the rounds apart from on-demand's (until 2026-12-06 the
            # paired ratios all on one side of 1, which apart rounds imply and which this replaces)
            s["tpot_ratio_claimed"] = claimed(s["tpot_round_medians_s"], runs_medians("on-demand"))
        out["configs"][c.name] = s
    return out


def table(res: dict) -> str:
    rows = ["| config | TPOT med (ms) | p90 (ms) | tok/s | hit | adj. hit | traffic MB/tok | prefetched/tok | "
            "stall ms/tok | roofline ms | overlap eff. | TPOT / on-demand (median of the rounds' ratios) |",
            "|" + "---|" * 12]
    for name, s in res["configs"].items():
        ratio = f"{s.get('tpot_ratio_median', 1.0):.3f}"
        if "tpot_ratio_claimed" in s and not s["tpot_ratio_claimed"]:
            ratio += " (rounds overlap: noise)"
        pre = f"{s['prefetch_loads_per_token']:.2f}" if "prefetch_loads_per_token" in s else "—"
        rows.append(f"| {name} | {1e3 * s['tpot_median_s']:.1f} | {1e3 * s['tpot_p90_s']:.1f} | "
                    f"{s['tokens_per_s']:.2f} | {s['hit_rate']:.3f} | {s['adjusted_hit_rate']:.3f} | "
                    f"{s['traffic_bytes_per_token'] / 1e6:.1f} | {pre} | {1e3 * s['stall_per_token_s']:.1f} | "
                    f"{1e3 * s['roofline_s']:.1f} | {s['overlap_efficiency']:.2f} | {ratio} |")
    return "\n".join(rows)


def plot_recall(res: dict, png: str | Path) -> None:
    """TPOT against predictor recall: the oracle degraded to each stated recall, with on-demand and the
    realizable predictors (at their measured recall of the next layer's experts) marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = res["configs"]
    pts = sorted((float(n.split(":")[1]) if ":" in n else 1.0, s["tpot_median_s"] * 1e3)
                 for n, s in cfg.items() if n == "oracle" or n.startswith("oracle:"))
    fig, ax = plt.subplots(figsize=(6, 4))
    if pts:
        ax.plot(*zip(*pts), marker="o", label="oracle at a stated recall")
    ax.axhline(cfg["on-demand"]["tpot_median_s"] * 1e3, ls="--", c="k", label="on-demand")
    for n, s in cfg.items():
        if n in ("persistence", "cooccurrence") and "recall" in s:
            ax.scatter([s["recall"]], [s["tpot_median_s"] * 1e3], marker="x", s=60, label=n, zorder=3)
    if "oracle+belady" in cfg:
        ax.scatter([1.0], [cfg["oracle+belady"]["tpot_median_s"] * 1e3], marker="*", s=90, c="k",
                   label="oracle + Belady eviction (bound)", zorder=3)
    ax.axhline(res["t_compute_s"] * 1e3, ls=":", c="gray", label="all resident (T_compute)")
    i = res["inputs"]
    ax.set(xlabel="recall of layer L+1's experts", ylabel="TPOT median (ms)", ylim=(0, None),
           title=f"replay {i['trace_model']} layers {i['layers'][0]}-{i['layers'][1] - 1}, C={i['capacity']} "
                 f"({i['capacity_frac']:.3g} E), {i['tier']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    from expertcache.telemetry.atomic import write_figure

    write_figure(fig, png)
    plt.close(fig)
