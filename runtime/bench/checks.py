"""What the engine's two checks on expert reads cost at decode time, as a share of TPOT: `expertcache bench checksum`
(every read against the checkpoint's checksum index) and `expertcache bench integrity` (the weight checks on each
expert's first read). Both alternate the check off and on in one process on the same tokens
(`harness.alternate`), page cache bypassed, and write their JSON through `results.write_result`.

    expertcache bench checksum --model CKPT --capacity 0.125 --tokens 32 --rounds 3
    expertcache bench integrity --layers 2 --tokens 48 --rounds 3
"""

from __future__ import annotations

import os
import time
from typing import Optional

from expertcache.telemetry.errors import InputError, check_counts

from expertcache.runtime.storage.store import STORE_DIR


def _check_fraction(capacity: float) -> None:
    if not 0 < capacity <= 1:
        raise InputError(f"--capacity {capacity}: a fraction of the experts in (0, 1]")


def bench_checksum(model: str, capacity: float = 0.125, tokens: int = 32, warmup: int = 4, rounds: int = 3,
                   prompt_len: int = 16, threads: int = 1, out: Optional[str] = None) -> dict:
    """What checking every expert read against the checkpoint's checksum index costs at decode time, as a share of
    TPOT.

    One checkpoint with its index (`expertcache verify` writes it), loaded once on the disk tier with no
    predictor; greedy decode passes alternate between checks off and on (the same engine, the source's checksums
    detached and re-attached), page cache bypassed (O_DIRECT). Two figures: `ab`, median TPOT on against off (the
    end-to-end difference; noisy on a busy machine), and `hash`, the time to hash one expert's bytes (xxh3_64, in
    process, warm and cold) x the experts read per token, against TPOT off: the work the check adds to each token,
    free of scheduling noise.

    Args:
        model: a checkpoint folder (its checksum index is built first if missing)
        capacity: resident experts per layer, a fraction of E
        tokens: decode steps timed per pass
        warmup: untimed decode steps per pass
        rounds: off/on pairs, alternated
        prompt_len: prompt tokens (fixed random ids)
        threads: torch threads
        out: also write the JSON here
    """
    config = dict(locals())
    import numpy as np
    import torch

    from expertcache.telemetry.atomic import check_output

    from expertcache.runtime.bench.harness import alternate, compare, tpot_figures
    from expertcache.runtime.bench.results import command_line, started, write_result

    check_counts(("warmup",), tokens=tokens, warmup=warmup, rounds=rounds, prompt_len=prompt_len, threads=threads)
    _check_fraction(capacity)
    check_output(out, model)
    torch.set_num_threads(threads)
    prov = started()  # the code and the machine, before the work

    from expertcache.runtime import EngineConfig, load
    from expertcache.runtime.serve.generate import timed_greedy
    from expertcache.runtime.storage.store import checksum
    from expertcache.runtime.storage.verify import verify

    rep = verify(model)
    if not rep["ok"]:
        raise InputError(f"--model {model}: its experts fail their checksums ({rep.get('mismatches') or rep})")
    m = load(model, engine=EngineConfig(capacity=capacity, tier="disk", predictor="none"), verify=True)
    eng = m.expertcache
    src = eng.source
    if src.index_state != "on":
        raise InputError(f"--model {model}: no checksum index to check against ({src.index_state})")
    expected = src.expected
    prompt = torch.randint(0, m.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    n_new = warmup + tokens + 1

    def one(mode: str, r: int) -> dict:  # one pass, checksums off or on
        src.expected = expected if mode == "on" else None
        eng.reset()
        times, _, _ = timed_greedy(m, prompt, n_new)  # the decode loop of generate and serve, its clock
        st = eng.stats
        return {"tpot": np.diff(times).tolist()[warmup:],
                "loads": int(getattr(st, "demand_loads", 0)) + int(getattr(st, "prefetch_loads", 0))}

    try:
        runs = alternate(["off", "on"], rounds, one)
    finally:
        eng.close()
    tpot = {k: [t for x in v for t in x["tpot"]] for k, v in runs.items()}
    loads = {k: sum(x["loads"] for x in v) for k, v in runs.items()}
    toks = {k: n_new * len(v) for k, v in runs.items()}
    per_round = {k: [float(np.median(x["tpot"])) for x in v] for k, v in runs.items()}
    # the hash of one expert's bytes, as the tier computes it (one span list, in memory)
    nbytes = sum(s.nbytes for s in src.spans(0, 0))
    buf = os.urandom(nbytes)
    reps = max(20, int(2e9 // max(nbytes, 1)))
    t0 = time.perf_counter()
    for _ in range(reps):
        checksum(buf)
    t_hash = (time.perf_counter() - t0) / reps
    # the same over bytes in no cache (as an O_DIRECT read leaves them): 256 MiB walked once
    cold = np.frombuffer(os.urandom(max(256 << 20, 2 * nbytes)), dtype=np.uint8)
    n_cold = len(cold) // nbytes
    t0 = time.perf_counter()
    for i in range(n_cold):
        checksum(cold[i * nbytes:(i + 1) * nbytes])
    t_cold = (time.perf_counter() - t0) / n_cold
    figures = tpot_figures(tpot)
    med = figures["tpot_median_s"]
    per_tok = loads["on"] / toks["on"]  # experts read per token (demand + prefetch, prefill included)
    res = {"inputs": {"model": model, "checkpoint_bytes": sum(p.stat().st_size for p in src.files),
                      "capacity": capacity, "tier": "disk", "predictor": "none", "tokens": tokens, "warmup": warmup,
                      "rounds": rounds, "prompt_len": prompt_len, "torch_threads": threads, "expert_bytes": nbytes,
                      "num_experts": src.num_experts, "moe_layers": len(src.prefixes),
                      "page_cache": eng.tier.describe().get("page_cache")},
           "verify_seconds": rep["seconds"], "verify_bytes": rep["expert_bytes_checked"],
           **figures,
           "tpot_round_medians_s": per_round, "on_vs_off": compare(per_round["on"], per_round["off"]),
           "experts_read_per_token": per_tok, "hash_s_per_expert": t_hash, "hash_GBps": nbytes / t_hash / 1e9,
           "hash_s_per_expert_cold": t_cold, "hash_GBps_cold": nbytes / t_cold / 1e9,
           "share_of_tpot": {"ab": med["on"] / med["off"] - 1, "hash": per_tok * t_hash / med["off"],
                             "hash_cold": per_tok * t_cold / med["off"]},
           "commit": prov["commit"], "dirty": prov["dirty"]}
    if out:
        res = write_result(out, res, config, command_line("bench checksum", bench_checksum, config), provenance=prov)
    return res


def bench_integrity(trace: Optional[str] = None, expert_shape: str = "2048x768", layers: int = 2,
                    capacity: float = 0.25, tier: str = "disk", tokens: int = 48, warmup: int = 4, rounds: int = 3,
                    store_dir: str = STORE_DIR, out: Optional[str] = None) -> dict:
    """What the engine's weight checks (finite, magnitude against the siblings', on each expert's first read) cost
    at decode time, as a share of TPOT, on the replay.

    The replay (the engine's own layer step, a real routing trace, random experts of a real shape in a store on
    disk, page cache bypassed) on demand, passes alternated in one process on the same tokens: `off`
    (`--engine.integrity off`); `on_cold`, checks on with the checked-expert table cleared before the pass (every
    expert's first read is scanned: what a fresh process pays, the worst case); `on_warm`, the table kept (an expert
    once checked is a look-up). Also `scan`: one expert's bytes scanned cold in memory (as an O_DIRECT read leaves
    them), timed in process, x the experts read per token, against TPOT off.

    Args:
        trace: routing trace (.npz or Parquet; default: the shipped Qwen3-30B-A3B code trace)
        expert_shape: HIDDENxINTERMEDIATE of one expert (Qwen3-30B-A3B: 2048x768)
        layers: MoE layers replayed (the store: layers x E experts)
        capacity: resident experts per layer, a fraction of E
        tier: where the store's experts are read from (disk, host, auto, throttled:<GB/s>)
        tokens: decode steps timed per pass
        warmup: untimed steps per pass
        rounds: off / on_cold / on_warm triples (the order reversed every other round)
        store_dir: where the expert store is written (reused)
        out: also write the JSON here
    """
    config = dict(locals())
    from dataclasses import replace

    import numpy as np
    import torch

    from expertcache.telemetry.atomic import check_output, own_dir
    from expertcache.telemetry.routing import load_routing

    from expertcache.runtime.bench.harness import alternate, compare, tpot_figures
    from expertcache.runtime.bench.replay import (REFERENCE_TRACE, ReplayConfig, Replayer, check_replay_fits,
                                                  ensure_store, parse_shape)
    from expertcache.runtime.bench.results import command_line, started, write_result
    from expertcache.runtime.engine.config import EngineConfig
    from expertcache.runtime.storage.weight_checks import expert_checks, magnitudes

    check_counts(("warmup",), layers=layers, tokens=tokens, warmup=warmup, rounds=rounds)
    _check_fraction(capacity)
    check_output(out, trace)
    hidden, inter = parse_shape(expert_shape)
    r = load_routing(trace or REFERENCE_TRACE)
    if layers > r.ids.shape[0]:
        raise InputError(f"--layers {layers}: the trace has {r.ids.shape[0]} MoE layers")
    engine = EngineConfig(capacity=capacity, tier=tier)
    engine.check()
    e = r.num_experts
    start = r.ids.shape[0] // 2 - layers // 2
    ids = r.ids[start:start + layers]
    cut = ids.shape[1] // 5  # the tokens after the first fifth, as the replay benchmark times them
    if cut + warmup + tokens > ids.shape[1]:
        raise InputError(f"--tokens {tokens} --warmup {warmup}: the trace has {ids.shape[1]} tokens and the replay "
                         f"times from token {cut}: at most {ids.shape[1] - cut} in all")
    span = range(cut, cut + warmup + tokens)
    check_replay_fits(store_dir, layers, e, hidden, inter, "bfloat16", 3 * hidden * inter * 2, tier, capacity)
    prov = started()  # the code and the machine, before the work
    own_dir(store_dir, "bench decode")  # the replay's cache of stores (bench decode --replay writes the same)
    store = ensure_store(store_dir, layers, e, hidden, inter, "bfloat16")
    rp = Replayer(store, ids, engine)
    on_demand = ReplayConfig("on-demand")
    checks = None

    def one(mode: str, rnd: int) -> dict:  # one pass with the weight checks off, on from cold, or on and warm
        rp.cfg = replace(rp.cfg, integrity="off" if mode == "off" else "on")
        if mode == "on_cold":
            checks.checked[:] = False
        return rp.run(on_demand, span)

    try:
        rp.cfg = replace(rp.cfg, integrity="on")
        rp.run(on_demand, range(cut, cut + warmup))  # untimed: threads, files, the checks' start sample
        checks = expert_checks(rp.tier)
        runs = alternate(["off", "on_cold", "on_warm"], rounds, one)  # reversed every other round
    finally:
        rp.close()
    tpot = {m: [t for x in v for t in x["times"][warmup:]] for m, v in runs.items()}
    loads = {m: sum(x["demand"] + x["prefetch"] for x in v) for m, v in runs.items()}
    toks = {m: sum(len(x["times"]) for x in v) for m, v in runs.items()}
    per_round = {m: [float(np.median(x["times"][warmup:])) for x in v] for m, v in runs.items()}
    # one expert's scan over bytes in no cache: a 256 MiB region of random bf16 weights walked once, expert by expert
    meta = rp.meta
    n_el = meta.expert_bytes // 2
    region = (torch.randn((256 << 20) // 2) * 0.02).to(torch.bfloat16)
    n = region.numel() // n_el
    t0 = time.perf_counter()
    for i in range(n):
        for t in meta.tensors:  # per tensor, as `ExpertChecks.check` scans a slot
            magnitudes(region[i * n_el:i * n_el + t.nbytes // 2].view(1, -1))
    t_scan = (time.perf_counter() - t0) / n
    figures = tpot_figures(tpot)
    med = figures["tpot_median_s"]
    per_tok = loads["on_cold"] / max(toks["on_cold"], 1)
    res = {"inputs": {"trace": str(trace or REFERENCE_TRACE), "layers": layers, "num_experts": e,
                      "expert_shape": [hidden, inter], "expert_bytes": meta.expert_bytes, "capacity": capacity,
                      "tier": tier, "page_cache": rp.tier.describe().get("page_cache"), "tokens": tokens,
                      "warmup": warmup, "rounds": rounds, "torch_threads": torch.get_num_threads()},
           **figures,
           "tpot_round_medians_s": per_round, "on_cold_vs_off": compare(per_round["on_cold"], per_round["off"]),
           "on_warm_vs_off": compare(per_round["on_warm"], per_round["off"]),
           "experts_read_per_token": per_tok, "scan_s_per_expert_cold": t_scan,
           "scan_GBps_cold": meta.expert_bytes / t_scan / 1e9,
           "share_of_tpot": {"on_cold_ab": med["on_cold"] / med["off"] - 1,
                             "on_warm_ab": med["on_warm"] / med["off"] - 1,
                             "scan_every_read": per_tok * t_scan / med["off"]},
           "commit": prov["commit"], "dirty": prov["dirty"]}
    if out:
        res = write_result(out, res, config, command_line("bench integrity", bench_integrity, config),
                           provenance=prov)
    return res
