"""Projection of decode TPOT for hardware we do not have, from a trace's cache behaviour and a bandwidth model.

Per output token: misses per token come from the shared simulator on the trace (per-layer LRU at capacity C,
token semantics; at C + k for the runtime's victims, the default: its k staging slots per layer keep the experts
that last left, and LRU over C slots then hits as LRU over C + k), scaled to the model's MoE layer count; then
    T_transfer = misses x expert_bytes / link bandwidth        (+ the link's per-transfer latency)
    T_compute  = resident bytes read per token / memory bandwidth (decode is bandwidth-bound)
    on-demand  = T_compute + T_transfer        prefetch (perfect overlap) = max(T_compute, T_transfer)
Every projection prints its inputs. `this-machine` takes its two bandwidths as measured (e.g. by the replay
benchmark), which is how the model is checked against a measured run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from expertcache.telemetry.errors import InputError


@dataclass
class Hardware:
    name: str
    link_GBps: float  # slow tier -> fast tier, sustained
    mem_GBps: float  # fast tier read bandwidth (HBM / DRAM), what decode compute is bound by
    fast_GB: float  # fast-tier memory for weights
    link_latency_us: float = 0.0  # per expert transfer
    note: str = ""


HARDWARE = {
    "h100-pcie5": Hardware("h100-pcie5", 55.0, 3350.0, 80.0, 10.0,
                           "H100 SXM HBM3 3.35 TB/s; PCIe 5.0 x16 host link, ~55 GB/s sustained of 64"),
    "4gpu-cxl3": Hardware("4gpu-cxl3", 128.0, 3350.0, 4 * 80.0, 2.0,
                          "4 GPUs sharing a CXL 3.0 memory pool at 128 GB/s"),
    "consumer-8gb-nvme": Hardware("consumer-8gb-nvme", 2.4, 272.0, 8.0, 80.0,
                                  "8 GB consumer GPU (272 GB/s GDDR6) with a PCIe 4 NVMe SSD at 2.4 GB/s"),
}


@dataclass
class ModelShape:
    name: str
    moe_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    dense_bytes_per_token: int  # attention, norms, embeddings, shared experts read per token


MODEL_SHAPES = {
    # Qwen3-30B-A3B in bf16: 48 MoE layers x 128 experts (hidden 2048, expert width 768), top-8;
    # ~3.3 B active parameters per token of which 48 x 8 x 4.7 M are routed experts.
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 128, 8, 3 * 2048 * 768 * 2, int((3.3e9 - 48 * 8 * 3 * 2048 * 768) * 2)),
    # the trained base of this repository (fp32)
    "base-tiny": ModelShape("base-tiny", 8, 32, 4, 3 * 256 * 128 * 4, 3_700_000 * 4),
}


def trace_misses_per_layer_token(ids: np.ndarray, capacity: int, policy: str = "lru") -> float:
    """Mean demand misses per (layer, token) of per-layer caches of `capacity`, token semantics."""
    from expertcache.telemetry.cachesim import simulate

    return float(np.mean([simulate(ids[i], capacity, policy, "token").misses_per_step for i in range(ids.shape[0])]))


def project(ids: np.ndarray, hw: Hardware, shape: ModelShape, capacity_frac: float, policy: str = "lru",
            compute_s: float | None = None, victims: bool = True) -> dict:
    """TPOT projection; `compute_s` overrides T_compute with a measured one. `victims` (LRU): the runtime's k
    staging slots serve the experts that last left, so the cache hits as LRU over C + k (`--engine.victims`)."""
    if ids.shape[2] != shape.top_k:
        raise InputError(f"trace is top-{ids.shape[2]}, model shape {shape.name} is top-{shape.top_k}")
    from expertcache.telemetry.cachesim import capacity_count

    cap = capacity_count(capacity_frac, shape.num_experts)
    sim_cap = min(cap + shape.top_k, shape.num_experts) if victims and policy == "lru" else cap
    mpt = trace_misses_per_layer_token(ids, sim_cap, policy)
    misses = mpt * shape.moe_layers  # per output token
    t_transfer = misses * (shape.expert_bytes / (hw.link_GBps * 1e9) + hw.link_latency_us * 1e-6)
    active = shape.dense_bytes_per_token + shape.moe_layers * shape.top_k * shape.expert_bytes
    t_compute = compute_s if compute_s is not None else active / (hw.mem_GBps * 1e9)
    fast_need = (cap + shape.top_k) * shape.moe_layers * shape.expert_bytes / 1e9  # the staging slots too
    return {"hardware": asdict(hw), "model_shape": asdict(shape), "capacity": cap, "capacity_frac": cap / shape.num_experts,
            "simulated_capacity": sim_cap, "victims": sim_cap != cap,
            "policy": policy, "trace_layers": int(ids.shape[0]), "trace_tokens": int(ids.shape[1]),
            "misses_per_layer_token": mpt, "hit_rate": 1 - mpt / shape.top_k, "misses_per_token": misses,
            "traffic_bytes_per_token": misses * shape.expert_bytes, "t_compute_s": t_compute,
            "t_transfer_s": t_transfer, "tpot_on_demand_s": t_compute + t_transfer,
            "tpot_perfect_overlap_s": max(t_compute, t_transfer),
            "tpot_all_resident_s": t_compute, "cache_GB": fast_need,
            "fits_fast_tier": fast_need + shape.dense_bytes_per_token / 1e9 <= hw.fast_GB}
