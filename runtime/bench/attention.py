"""`expertcache bench attention`: the decode step's attention, our CPU kernel against transformers' sdpa."""

from __future__ import annotations

import statistics
from typing import Optional

from expertcache.telemetry.errors import InputError, check_counts


def bench_attention(model: str, threads: int = 1, context: int = 512, tokens: int = 16, rounds: int = 3,
                    out: Optional[str] = None) -> dict:
    """The decode step's attention, our CPU kernel against transformers' sdpa, alternated in one process.

    Loads `--model` all resident with the CPU kernels (capacity 1.0, host tier, kernel cpu), which switches its sdpa
    attention to ours, then decodes greedily from a random prompt of `--context` tokens, each round once with our
    attention and once with sdpa (the order reversed every other round), after one untimed decode of each. Time per
    output token = the decode steps after the prefill / their number; the medians of the rounds, and whether both
    produced the same tokens. Run it alone.

    Args:
        model: a bf16 (or packed) checkpoint the CPU kernels compute
        threads: torch threads
        context: prompt tokens before decoding
        tokens: tokens decoded per run
        rounds: kernel/sdpa alternations
        out: also write the JSON here
    """
    config = dict(locals())
    check_counts(threads=threads, context=context, tokens=tokens, rounds=rounds)
    import torch

    from expertcache.telemetry.atomic import check_output

    from expertcache.runtime import EngineConfig, load
    from expertcache.runtime.bench.harness import alternate, compare
    from expertcache.runtime.bench.results import command_line, started, write_result
    from expertcache.runtime.kernels import patches
    from expertcache.runtime.serve.generate import timed_greedy

    check_output(out, model)
    torch.set_num_threads(threads)
    prov = started()  # the code and the machine, before the work
    m = load(model, verify=False, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    cfgs = m.expertcache.compute.attention
    if not cfgs:
        raise InputError(f"--model {model}: the engine did not switch this model's attention (no CPU kernels here, "
                         f"or its attention is not sdpa)")
    ids = torch.randint(2, min(4000, m.config.vocab_size), (1, context), generator=torch.Generator().manual_seed(1))
    made = {}

    def run(arm: str, r: int = -1) -> float:
        for c in cfgs:
            c._attn_implementation_internal = patches.ATTENTION if arm == "kernel" else "sdpa"
        t, toks, _ = timed_greedy(m, ids, tokens + 1)
        made[arm] = torch.as_tensor(toks).tolist()
        return (t[-1] - t[0]) / tokens

    run("kernel")  # untimed: each arm warmed once
    run("sdpa")
    times = alternate(["kernel", "sdpa"], rounds, run)
    res = {"model": model, "threads": threads, "context": context, "tokens": tokens,
           "same_tokens": made["kernel"] == made["sdpa"],
           **{arm: {"tpot_ms_median": statistics.median(v) * 1e3, "rounds_ms": [x * 1e3 for x in v]}
              for arm, v in times.items()},
           "kernel_vs_sdpa": compare(times["kernel"], times["sdpa"]),
           "commit": prov["commit"], "dirty": prov["dirty"]}
    if out:
        res = write_result(out, res, config, command_line("bench attention", bench_attention, config),
                           provenance=prov)
    return res
