"""End-of-run cache metrics: decode-style routing of a checkpoint through the shared cache simulator.

The checkpoint is recorded token by token (`model.generate`, greedy, hidden states kept) on held-out blocks;
every MoE layer then gets its own cache of C experts, C a fraction of E, under:
- `lru`: demand loads only (the baseline every cache-aware result is compared to);
- `temporal`: the Temporal router's scores decide what stays after each access (update-only, no prefetch);
- `spatio`: the Spatio router prefetches at most R predicted experts before each access, LRU eviction;
- `spatio_temporal`: both.
Figures (METRICS.md): hit rate, adjusted hit rate `1 - (D + P) / A`, traffic in bytes per output token
(every layer's loads x bytes of one expert in the checkpoint's dtype), and each as a fraction of Belady.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from expertcache.telemetry.cachesim import capacity_count, simulate, simulate_scored


def expert_bytes(model) -> int:
    """Bytes of one routed expert's weights (gate, up, down) in the checkpoint's dtype."""
    from expertcache.telemetry.adapters import adapter_for

    experts = adapter_for(model).moe_layers(model)[0].experts
    n = sum(p.numel() for p in experts.parameters())
    e = adapter_for(model).num_experts
    return n // e * next(experts.parameters()).element_size()


@torch.no_grad()
def router_predictions(model, aux, hidden: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """From `hidden [layers, tokens, H]` and `ids [layers, tokens, k]` (tokens in decode order): Temporal keep
    scores `[layers, tokens, E]` (row t scores the tokens after t, from the routing up to t) and Spatio prefetch lists `[layers, tokens, R]`: the top-R predictions whose
    probability reaches the threshold (-1 elsewhere, and on layer 0, which has no predecessor)."""
    from expertcache.telemetry.adapters import adapter_for

    from .aux_routers import history_features

    routers = [L.router for L in adapter_for(model).moe_layers(model)]
    h = torch.from_numpy(hidden.astype(np.float32))
    keep = pre = None
    if aux.temporal is not None:
        c = aux.cfg
        keep = np.stack([aux.temporal_scores(i, h[i], r, history_features(
            torch.from_numpy(ids[i][None]), c.num_experts, c.history)[0]).numpy() for i, r in enumerate(routers)])
    if aux.spatio is not None:
        n_layers, n_tok = hidden.shape[:2]
        r = aux.cfg.refine_budget
        pre = np.full((n_layers, n_tok, r), -1, dtype=np.int64)
        for i in range(1, n_layers):
            top = aux.spatio_scores(i, h[i - 1], routers[i]).topk(r, dim=-1)
            sure = top.values.sigmoid() >= aux.cfg.prefetch_threshold
            pre[i] = torch.where(sure, top.indices, -1).numpy()
    return keep, pre


def cache_table(ids: np.ndarray, caps: list[int], num_experts: int, bytes_per_expert: int,
                keep: np.ndarray | None = None, prefetch: np.ndarray | None = None) -> list[dict]:
    """One row per (capacity, policy) over `ids [layers, tokens, k]`; traffic is bytes per token, all layers."""
    n_layers, n_tok, _ = ids.shape
    policies = {"lru": (False, False)}
    if keep is not None:
        policies["temporal"] = (True, False)
    if prefetch is not None:
        policies["spatio"] = (False, True)
    if keep is not None and prefetch is not None:
        policies["spatio_temporal"] = (True, True)
    rows = []
    for cap in caps:
        bel = sum(simulate(ids[i], cap, "belady", "token").hits for i in range(n_layers))
        for name, (k_on, p_on) in policies.items():
            per_layer = [simulate_scored(ids[i], cap, keep[i] if k_on else None, prefetch[i] if p_on else None)
                         for i in range(n_layers)]
            r = sum(per_layer[1:], per_layer[0])  # every layer's cache together: one set of counters
            d = r.per_step(bytes_per_expert, "token", n_tok)
            rows.append({"policy": name, "capacity": cap, "capacity_frac": cap / num_experts, "accesses": r.accesses,
                         "hit_rate": r.hit_rate, "adjusted_hit_rate": r.adjusted_hit_rate,
                         "demand_loads": r.loads, "prefetch_loads": r.prefetches,
                         "misses_per_token": d["misses_per_token"],
                         "traffic_bytes_per_token": d["traffic_bytes_per_token"],
                         "belady_hit_rate": bel / r.accesses, "of_belady": r.hits / bel if bel else None})
    return rows


def evaluate_checkpoint(model_dir: str | Path, corpus: str, split: str, trace_path: str | Path, prompt_len: int,
                        decode_tokens: int, max_seqs: int, fractions: list[float], ppl_blocks: int,
                        seq_len: int, aux=None) -> dict:
    """Record the checkpoint's decode routing on `split`, simulate its caches, and measure its perplexity."""
    from expertcache.telemetry.adapters import adapter_for
    from expertcache.telemetry.parquet_trace import read_trace
    from expertcache.telemetry.recorder import record_corpus

    from .evaluate import evaluate_lm

    record_corpus(model_dir, corpus, None, split, trace_path, prompt_len, decode_tokens, batch_size=8,
                  max_seqs=max_seqs, hidden=aux is not None)
    from expertcache.telemetry.hf import load_causal_lm

    model = load_causal_lm(model_dir, dtype=torch.float32).eval()
    a = adapter_for(model)
    trace = read_trace(trace_path).filter(phase="decode")
    ids = trace.routing()[0].astype(np.int64)  # [layers, tokens, k]
    keep = pre = None
    if aux is not None:
        keep, pre = router_predictions(model, aux, trace.layer_matrix("hidden"), ids)
    caps = sorted({capacity_count(f, a.num_experts) for f in fractions})
    ppl = evaluate_lm(model, corpus, str(model_dir), split, seq_len, ppl_blocks)
    return {"decode_tokens": int(ids.shape[1]), "expert_bytes": expert_bytes(model),
            "cache": cache_table(ids, caps, a.num_experts, expert_bytes(model), keep, pre), "ppl": ppl["ppl"],
            "ppl_tokens": ppl["tokens"], "block_nll": ppl["block_nll"], "block_tokens": ppl["block_tokens"],
            "expert_entropy_frac_of_max": ppl["expert_entropy_frac_of_max"]}
