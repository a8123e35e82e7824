"""What checking every expert read against its checksum costs at decode time, as a share of TPOT. Prints JSON.

One checkpoint (make one with scripts/make_checkpoint.py), its checksum index built by `verify`, loaded once with
`load(..., tier="disk", capacity=C, predictor="none")`: greedy decode passes alternate between checking off and on
(the same engine, the source's checksums detached and re-attached), page cache bypassed (O_DIRECT). Two figures:

- `ab`: median TPOT with checks on against off (the end-to-end difference; noisy on a busy machine);
- `hash`: the time to hash one expert's bytes (xxh3_64, measured in process) x the experts read per decode token,
  against TPOT off: the work the check adds to each token, independent of scheduling noise.

    python scripts/make_checkpoint.py --out /tmp/ck --layers 4 --experts 16 --hidden 1024 --inter 512 --vocab 8192
    python scripts/bench_checksum.py --model /tmp/ck --capacity 0.125 --tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from expertcache.telemetry.errors import count, fraction, nonnegative


def _decode(model, prompt, n_new: int, warmup: int) -> list[float]:
    from expertcache.runtime.serve.generate import timed_greedy

    times, _, _ = timed_greedy(model, prompt, n_new)  # the decode loop of generate and serve, its clock
    return np.diff(times).tolist()[warmup:]


def _loads(stats) -> int:
    return int(getattr(stats, "demand_loads", 0)) + int(getattr(stats, "prefetch_loads", 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--capacity", type=fraction, default=0.125)
    ap.add_argument("--tokens", type=count, default=32, help="decode steps timed per pass")
    ap.add_argument("--warmup", type=nonnegative, default=4)
    ap.add_argument("--rounds", type=count, default=3, help="off/on pairs (alternated)")
    ap.add_argument("--prompt-len", type=count, default=16)
    ap.add_argument("--threads", type=count, default=1)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertcache.runtime.bench.harness import alternate, compare, tpot_figures
    from expertcache.runtime.bench.results import started, write_result

    prov = started()  # the code and the machine, before the work

    from expertcache.runtime import load
    from expertcache.runtime.storage.store import checksum
    from expertcache.runtime.storage.verify import verify

    rep = verify(a.model)
    if not rep["ok"]:
        raise SystemExit(f"verify failed: {rep}")
    m = load(a.model, capacity=a.capacity, tier="disk", predictor="none", verify=True)
    eng = m.expertcache
    src = eng.source
    assert src.index_state == "on", src.index_state
    expected = src.expected
    vocab = m.config.vocab_size
    prompt = torch.randint(0, vocab, (1, a.prompt_len), generator=torch.Generator().manual_seed(0))
    n_new = a.warmup + a.tokens + 1

    def one(mode: str, r: int) -> dict:  # one pass, checksums off or on
        src.expected = expected if mode == "on" else None
        eng.reset()
        return {"tpot": _decode(m, prompt, n_new, a.warmup), "loads": _loads(eng.stats)}

    try:
        runs = alternate(["off", "on"], a.rounds, one)
    finally:
        eng.close()
    tpot = {k: [t for x in v for t in x["tpot"]] for k, v in runs.items()}
    loads = {k: sum(x["loads"] for x in v) for k, v in runs.items()}
    tokens = {k: n_new * len(v) for k, v in runs.items()}
    rounds = {k: [float(np.median(x["tpot"])) for x in v] for k, v in runs.items()}
    # the hash of one expert's bytes, as the tier computes it (one span list, in memory)
    nbytes = sum(s.nbytes for s in src.spans(0, 0))
    buf = os.urandom(nbytes)
    reps = max(20, int(2e9 // max(nbytes, 1)))
    t0 = time.perf_counter()
    for _ in range(reps):
        checksum(buf)
    t_hash = (time.perf_counter() - t0) / reps
    # the same over bytes not in any cache (as an O_DIRECT read leaves them): 256 MiB walked once
    cold = np.frombuffer(os.urandom(256 << 20), dtype=np.uint8)
    n_cold = len(cold) // nbytes
    t0 = time.perf_counter()
    for i in range(n_cold):
        checksum(cold[i * nbytes:(i + 1) * nbytes])
    t_cold = (time.perf_counter() - t0) / n_cold
    figures = tpot_figures(tpot)
    med = figures["tpot_median_s"]
    per_tok = loads["on"] / tokens["on"]  # experts read per token (demand + prefetch, prefill included)
    out = {"inputs": {"model": a.model, "checkpoint_bytes": sum(p.stat().st_size for p in src.files),
                      "capacity": a.capacity, "tier": "disk", "predictor": "none", "tokens": a.tokens,
                      "warmup": a.warmup, "rounds": a.rounds, "prompt_len": a.prompt_len, "torch_threads": a.threads,
                      "expert_bytes": nbytes, "num_experts": src.num_experts, "moe_layers": len(src.prefixes),
                      "page_cache": eng.tier.describe().get("page_cache")},
           "verify_seconds": rep["seconds"], "verify_bytes": rep["expert_bytes_checked"],
           **figures,
           "tpot_round_medians_s": rounds, "on_vs_off": compare(rounds["on"], rounds["off"]),
           "experts_read_per_token": per_tok, "hash_s_per_expert": t_hash,
           "hash_GBps": nbytes / t_hash / 1e9, "hash_s_per_expert_cold": t_cold, "hash_GBps_cold": nbytes / t_cold / 1e9,
           "share_of_tpot": {"ab": med["on"] / med["off"] - 1, "hash": per_tok * t_hash / med["off"],
                             "hash_cold": per_tok * t_cold / med["off"]},
           "commit": prov["commit"], "dirty": prov["dirty"]}
    print(json.dumps(out, indent=2))
    if a.out:
        write_result(a.out, out, config=vars(a), provenance=prov)


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
