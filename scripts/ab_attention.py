#!/usr/bin/env python
"""The decode step's attention, our kernel against transformers' sdpa, alternated in one process: prints JSON.

    python scripts/ab_attention.py --model /work/ckpt/q30-4l --threads 1 --context 512 --tokens 16 --rounds 3

Loads `--model` all resident with the CPU kernels (`load(..., engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))`, which switches
its sdpa attention to `expertcache_cpu`), then decodes greedily from a random prompt of `--context` tokens, each
round once with our attention and once with sdpa (the order alternating), after one untimed decode of each. Time
per output token = the decode steps after the prefill / their number; the medians of the rounds, and whether both
produced the same tokens. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from expertcache.telemetry.errors import count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a bf16 (or packed) checkpoint the CPU kernels compute")
    ap.add_argument("--threads", type=count, default=1)
    ap.add_argument("--context", type=count, default=512, help="prompt tokens before decoding")
    ap.add_argument("--tokens", type=count, default=16, help="tokens decoded per run")
    ap.add_argument("--rounds", type=count, default=3)
    a = ap.parse_args()
    import torch

    from expertcache.runtime.kernels import cpu_kernels as ck, patches
    from expertcache.runtime import EngineConfig, load
    from expertcache.runtime.serve.generate import timed_greedy

    torch.set_num_threads(a.threads)
    m = load(a.model, verify=False, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    cfgs = m.expertcache.compute.attention
    if not cfgs:
        raise SystemExit("ab_attention: the engine did not switch this model's attention (no CPU kernels, or not "
                         "sdpa)")
    ids = torch.randint(2, min(4000, m.config.vocab_size), (1, a.context), generator=torch.Generator().manual_seed(1))
    tokens = {}

    def run(arm: str, r: int = -1) -> float:
        for c in cfgs:
            c._attn_implementation_internal = patches.ATTENTION if arm == "kernel" else "sdpa"
        t, out, _ = timed_greedy(m, ids, a.tokens + 1)
        tokens[arm] = torch.as_tensor(out).tolist()
        return (t[-1] - t[0]) / a.tokens

    from expertcache.runtime.bench.harness import alternate, compare

    run("kernel")  # untimed: each arm warmed once
    run("sdpa")
    times = alternate(["kernel", "sdpa"], a.rounds, run)
    print(json.dumps({"model": a.model, "threads": a.threads, "context": a.context, "tokens": a.tokens,
                      "same_tokens": tokens["kernel"] == tokens["sdpa"],
                      **{arm: {"tpot_ms_median": statistics.median(v) * 1e3, "rounds_ms": [x * 1e3 for x in v]}
                         for arm, v in times.items()},
                      "kernel_vs_sdpa": compare(times["kernel"], times["sdpa"])}))

if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
