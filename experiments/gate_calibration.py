#!/usr/bin/env python
"""Does the gate's verdict mean what it says on a real model? `results/gate_calibration.json` (#23).

On a trained base (`runs/base-tiny`), every candidate is scored on one pool of held-out blocks (`--pool` blocks of
`--seq_len` tokens per domain, the test split, step-wise), and each seed draws `--sample` blocks per domain from
the pool (eval's default sample, 8) and gates the candidate against the base on them with `evals.gate.gate` itself
(the same eval records, paired bootstrap and rule as `expertcache gate`; the bootstrap seeded with the seed too):

- **null, exact**: the base against a second evaluation of itself by the other step-wise path (one token at a time
  through the KV cache against whole blocks per forward): the same model, other arithmetic. Must never FAIL.
- **null, harmless**: the base with Gaussian noise added to every weight matrix (`sigma` x the matrix's RMS, a new
  noise draw per seed), sigma set so the pool's Δppl is about `--harmless` % (+0.1%, a tenth of the threshold).
  Must never FAIL: a change well inside the threshold is PASS or, on a small sample, INCONCLUSIVE.
- **degraded**: the same noise with sigma set so the first `--calib_blocks` (64) blocks per domain read `--target`
  % (+3%, three times the overall threshold) on noise seed 0, then a new noise draw per seed at that sigma. Should
  FAIL at the default sample size; the FAIL count is reported, not assumed.

Each condition is also gated on the whole pool (per seed), where the intervals are narrowest. Accuracy (lm-eval
documents) is not part of this calibration: Δppl only; the synthetic checks in tests/test_gate_stats.py cover Δacc.
The run also times the two step-wise paths on the same blocks (the batched one is what makes large samples cheap).

    python experiments/gate_calibration.py --base runs/base-tiny/model --out results/gate_calibration.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from expertcache.evals.gate import EVAL_FORMAT_VERSION, gate
from expertcache.evals.run import blocks_sha256, stepwise_blocks, tokenizer_fingerprint
from expertcache.evals.stepwise import stepwise_perplexity
from expertcache.telemetry.errors import count


def record(step: dict, idx: dict[str, np.ndarray], blocks: dict[str, np.ndarray], tok: dict) -> dict:
    """An `expertcache eval` record (format 3, step-wise only) of the blocks `idx[d]` of a pool evaluation."""
    nll = {d: [step["block_nll"][d][i] for i in idx[d]] for d in idx}
    n = {d: [step["block_tokens"][d][i] for i in idx[d]] for d in idx}
    ppl = {d: math.exp(sum(nll[d]) / sum(n[d])) for d in idx}
    ppl["overall"] = math.exp(sum(map(sum, nll.values())) / sum(map(sum, n.values())))
    tokens = {d: sum(n[d]) for d in idx}
    tokens["overall"] = sum(tokens.values())
    return {"format_version": EVAL_FORMAT_VERSION, "tokenizer": tok, "lm_eval": {}, "limit": None,
            "stepwise": {"ppl": ppl, "tokens": tokens, "block_nll": nll, "block_tokens": n,
                         "blocks_sha256": blocks_sha256({d: blocks[d][idx[d]] for d in idx})}}


def perturbed(base: dict[str, torch.Tensor], model, sigma: float, seed: int) -> None:
    """Load `base` into `model` with N(0, (sigma * RMS(w))^2) noise on every weight matrix (ndim >= 2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = base[name]
            if w.ndim >= 2 and sigma > 0:
                rms = w.float().pow(2).mean().sqrt()
                p.copy_(w + sigma * rms * torch.randn(w.shape, generator=g, dtype=w.dtype))
            else:
                p.copy_(w)


def dppl(base: dict, cand: dict, idx: dict[str, np.ndarray] | None = None) -> float:
    """Δppl overall, %, of `cand` against `base` (step-wise results) on `idx` (all blocks when None)."""
    def tot(s):
        ks = idx or {d: range(len(v)) for d, v in s["block_nll"].items()}
        return (sum(s["block_nll"][d][i] for d in ks for i in ks[d]),
                sum(s["block_tokens"][d][i] for d in ks for i in ks[d]))
    (nb, tb), (nc, tc) = tot(base), tot(cand)
    return 100 * (math.exp(nc / tc - nb / tb) - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", type=Path, default=Path("runs/base-tiny/model"))
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--seq_len", type=count, default=128)
    ap.add_argument("--pool", type=count, default=128, help="blocks per domain every candidate is scored on")
    ap.add_argument("--sample", type=count, default=8, help="blocks per domain each seed gates on (eval's default)")
    ap.add_argument("--calib_blocks", type=count, default=64, help="blocks per domain the degradation is set on")
    ap.add_argument("--seeds", type=count, default=20)
    ap.add_argument("--target", type=float, default=3.0, help="the degraded model's Δppl, %%")
    ap.add_argument("--harmless", type=float, default=0.1, help="the harmless change's Δppl, %%")
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/gate_calibration.json"))
    a = ap.parse_args()
    if not (a.base / "config.json").is_file():
        print(f"gate_calibration: {a.base} is not a checkpoint (no config.json); train it with `expertcache pretrain "
              f"--recipe base-tiny`", file=sys.stderr)
        return 2
    if not 2 <= a.sample <= a.pool or a.calib_blocks > a.pool:  # (--seeds >= 1: its type)
        print("gate_calibration: expected 2 <= --sample <= --pool, --calib_blocks <= --pool",
              file=sys.stderr)
        return 2
    from expertcache.telemetry.hf import load_causal_lm

    torch.set_num_threads(a.threads)
    t_start = time.time()
    blocks = stepwise_blocks(a.corpus, str(a.base), "test", a.seq_len, a.pool)
    pool = min(len(b) for b in blocks.values())
    blocks = {d: b[:pool] for d, b in blocks.items()}
    tok = tokenizer_fingerprint(a.base)
    model = load_causal_lm(a.base).float().eval()
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    say = lambda m: print(f"[{time.time() - t_start:6.0f} s] {m}", file=sys.stderr, flush=True)  # noqa: E731

    t0 = time.perf_counter()
    base = stepwise_perplexity(model, blocks, method="batched")
    t_batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    base_token = stepwise_perplexity(model, blocks, method="token")
    t_token = time.perf_counter() - t0
    diff = max(abs(x - y) / abs(y) for d in blocks for x, y in zip(base["block_nll"][d], base_token["block_nll"][d]))
    say(f"{pool} blocks x {a.seq_len} tokens per domain: batched {t_batched:.1f} s, token by token {t_token:.1f} s "
        f"({t_token / t_batched:.1f}x); largest relative difference of a block's NLL {diff:.2e}")

    calib = {d: np.arange(a.calib_blocks) for d in blocks}

    def score(sigma: float, seed: int) -> dict:
        perturbed(state, model, sigma, seed)
        return stepwise_perplexity(model, blocks, method="batched")

    def sigma_for(target: float, idx) -> tuple[float, float]:
        """sigma (bisection on log sigma, noise seed 0) whose Δppl on `idx` (all blocks when None) is `target` %."""
        lo, hi = 1e-4, 4.0
        for _ in range(16):
            mid = math.sqrt(lo * hi)
            got = dppl(base, score(mid, 0), idx)
            lo, hi = (mid, hi) if got < target else (lo, mid)
        s = math.sqrt(lo * hi)
        return s, dppl(base, score(s, 0), idx)

    s_bad, got_bad = sigma_for(a.target, calib)
    if abs(got_bad - a.target) > 0.1 * a.target:
        print(f"gate_calibration: no noise level up to 4 x RMS gives {a.target:+g}% on this model (got "
              f"{got_bad:+.3f}%); the degraded condition is not what it says", file=sys.stderr)
        return 1
    say(f"degraded: sigma {s_bad:.4g} x RMS gives {got_bad:+.3f}% on {a.calib_blocks} blocks per domain (seed 0)")
    s_ok, got_ok = sigma_for(a.harmless, None)
    say(f"harmless: sigma {s_ok:.4g} x RMS gives {got_ok:+.3f}% on the pool (seed 0)")

    conds = {"null_exact": {"what": "the base against a second evaluation of itself (token by token vs batched)"},
             "null_harmless": {"what": f"weights + N(0, ({s_ok:.4g} x RMS)^2), a new draw per seed",
                               "sigma": s_ok, "dppl_pct_seed0_pool": got_ok},
             "degraded": {"what": f"weights + N(0, ({s_bad:.4g} x RMS)^2), a new draw per seed; seed 0 reads "
                                  f"{got_bad:+.2f}% on {a.calib_blocks} blocks per domain",
                          "sigma": s_bad, "dppl_pct_seed0_calib": got_bad}}
    for c in conds.values():
        c.update(seeds=[], verdicts_sample={}, verdicts_pool={})
    everything = {d: np.arange(pool) for d in blocks}
    for seed in range(a.seeds):
        rng = np.random.default_rng(1000 + seed)
        idx = {d: np.sort(rng.choice(pool, a.sample, replace=False)) for d in blocks}
        cands = {"null_exact": base_token, "null_harmless": score(s_ok, seed), "degraded": score(s_bad, seed)}
        for name, cand in cands.items():
            g_s = gate(record(base, idx, blocks, tok), record(cand, idx, blocks, tok), seed=seed)
            g_p = gate(record(base, everything, blocks, tok), record(cand, everything, blocks, tok), seed=seed)
            c = conds[name]
            c["seeds"].append({"seed": seed, "dppl_pct_pool": dppl(base, cand),
                               "dppl_pct_sample": g_s["dppl_percent"]["overall"],
                               "sample": {"gate": g_s["gate"], "dppl_overall_ci95": g_s["dppl_overall_ci95"],
                                          "dppl_max_domain_ci95": g_s["dppl_max_domain_ci95"]},
                               "pool": {"gate": g_p["gate"], "dppl_overall_ci95": g_p["dppl_overall_ci95"],
                                        "dppl_max_domain_ci95": g_p["dppl_max_domain_ci95"]}})
            for key, g in (("verdicts_sample", g_s), ("verdicts_pool", g_p)):
                c[key][g["gate"]] = c[key].get(g["gate"], 0) + 1
        say(f"seed {seed}: " + ", ".join(f"{n} {conds[n]['seeds'][-1]['sample']['gate']}"
                                         f"/{conds[n]['seeds'][-1]['pool']['gate']}" for n in conds))
    for c in conds.values():
        pools = [s["dppl_pct_pool"] for s in c["seeds"]]
        c["dppl_pct_pool_range"] = [min(pools), max(pools)]
    checks = {"null_never_fails": all(conds[n]["verdicts_sample"].get("FAIL", 0) == 0
                                      and conds[n]["verdicts_pool"].get("FAIL", 0) == 0
                                      for n in ("null_exact", "null_harmless")),
              "degraded_fails_at_the_default_sample": conds["degraded"]["verdicts_sample"].get("FAIL", 0),
              "degraded_fails_on_the_pool": conds["degraded"]["verdicts_pool"].get("FAIL", 0)}
    from expertcache.telemetry.provenance import provenance

    prov = provenance(Path(__file__).parent)
    out = {"command": "python " + " ".join(sys.argv), "base": str(a.base), **prov,
           "split": "test", "seq_len": a.seq_len, "pool_blocks_per_domain": pool, "sample_blocks_per_domain": a.sample,
           "seeds": a.seeds, "threads": a.threads, "target_pct": a.target, "harmless_pct": a.harmless,
           "calib_blocks_per_domain": a.calib_blocks, "thresholds": {"ppl_overall_pct": 1.0, "ppl_domain_pct": 2.0},
           "accuracy": "not calibrated here (Δppl only); tests/test_gate_stats.py covers Δacc on synthetic data",
           "stepwise_paths": {"blocks": pool * len(blocks), "batched_s": t_batched, "token_s": t_token,
                              "speedup": t_token / t_batched, "max_rel_diff_block_nll": diff},
           "conditions": conds, "checks": checks, "seconds": round(time.time() - t_start, 1)}
    from expertcache.runtime.bench.results import write_result

    write_result(a.out, out, config=vars(a), command=out["command"])
    say(f"wrote {a.out}: " + json.dumps(checks))
    for n, c in conds.items():
        print(f"{n:14s} Δppl on the pool {c['dppl_pct_pool_range'][0]:+.3f}..{c['dppl_pct_pool_range'][1]:+.3f}%  "
              f"at {a.sample} blocks: {c['verdicts_sample']}  on {pool}: {c['verdicts_pool']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
