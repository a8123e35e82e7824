#!/usr/bin/env python
"""How well a routing trace's own ids predict a cache's *misses*, one layer ahead: what a trace-fitted prefetcher
could know in `bench big --routing trace`.

An LRU cache of `--slots` experts per layer (16 cached + 8 victims in bench big: LRU over C + k, as tested) runs
over the trace. At each decode step of layer L >= 1 (layer L-1's experts known), the experts not resident at L are
ranked by two predictors, and we count how many of those ranked first the step then used (a miss a prefetch would
have hidden):
- `cooccurrence`: the co-occurrence counts of `runtime.trace_predictors.CooccurrenceEstimator` (P(expert at L | the
  experts L-1 uses now)), fitted on every token before the evaluation window, as bench big fits it;
- `logistic`: a logistic model over co-occurrence (counted on the tokens before the fitting window), recency (log
  tokens since last use at L) and a decayed use count at L, fitted on the fitting window (plain gradient descent, torch), scored on the evaluation window.
Precision: used / named; recall: used / misses. Prints one JSON object (and writes it with --out).

    python experiments/miss_predictability.py --out results/miss_predictability.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from expertcache.runtime.bench.replay import REFERENCE_TRACE
from expertcache.runtime.engine.trace_predictors import CooccurrenceEstimator
from expertcache.telemetry.cache import CacheState
from expertcache.telemetry.errors import count
from expertcache.telemetry.provenance import provenance
from expertcache.telemetry.routing import load_routing


def features(ids: np.ndarray, m: np.ndarray, slots: int, t0: int, t1: int, warm: int = 200):
    """Per decode step (token t in [t0, t1), layer L >= 1): the non-resident experts' features `[n, 4]`, whether
    each was used `[n]`, and the step's misses."""
    n_l, _, _ = ids.shape
    e = m.shape[-1]
    caches = [CacheState(slots, ids.shape[-1]) for _ in range(n_l)]  # the one LRU (telemetry/cache.py)
    last = np.full((n_l, e), -10.0 ** 6)
    cnt = np.zeros((n_l, e))
    out = []
    for t in range(t0 - warm, t1):
        for layer in range(n_l):
            c, cur = caches[layer], ids[layer, t]
            if t >= t0 and layer >= 1:
                s = m[layer - 1][ids[layer - 1, t]].sum(0)
                nonres = np.array([x for x in range(e) if c.lookup(x) is None])
                miss = {int(x) for x in cur if c.lookup(int(x)) is None}
                age = np.minimum(t - last[layer, nonres], 1000.0)
                f = np.stack([s[nonres], np.log1p(age), cnt[layer, nonres], np.log1p(100 * s[nonres])], 1)
                out.append((f, np.array([int(x) in miss for x in nonres]), len(miss)))
            step = [int(x) for x in cur]
            c.retain(step, c.stage([x for x in step if c.lookup(x) is None]))
            cnt[layer] *= 0.97
            cnt[layer, cur] += 1
            last[layer, cur] = t
    return out


def fit_logistic(steps, iters: int = 500) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    x = np.concatenate([f for f, _, _ in steps])
    y = np.concatenate([u for _, u, _ in steps]).astype(np.float32)
    mu, sd = x.mean(0), x.std(0) + 1e-9
    xt, yt = torch.tensor((x - mu) / sd, dtype=torch.float32), torch.tensor(y)
    w, b = torch.zeros(x.shape[1], requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w + b, yt)
        loss.backward()
        return loss
    opt.step(closure)
    return w.detach(), b.detach(), mu, sd


def score(steps, rank, tops=(1, 2, 3, 4)) -> dict:
    """Precision and recall of naming the top N non-resident experts per step by `rank(features)`."""
    n, misses = len(steps), sum(g for _, _, g in steps)
    order = [np.argsort(-rank(f)) for f, _, _ in steps]
    out = {}
    for k in tops:
        used = sum(int(u[o[:k]].sum()) for (_, u, _), o in zip(steps, order))
        out[f"top{k}"] = {"precision": round(used / (n * k), 4), "recall": round(used / misses, 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(REFERENCE_TRACE), help="routing trace (default: the reference code trace)")
    ap.add_argument("--layers", type=count, default=27, help="MoE layers (bench big's 27)")
    ap.add_argument("--slots", type=count, default=24, help="LRU slots per layer (16 cached + 8 victims)")
    ap.add_argument("--fit", default="1000:2000", help="tokens the logistic model is fitted on (co-occurrence: "
                    "the tokens before them)")
    ap.add_argument("--eval", default="2000:3000", help="tokens scored (bench big decodes from token 2000)")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    a = ap.parse_args()
    from expertcache.telemetry.errors import InputError

    try:
        (f0, f1), (e0, e1) = (tuple(map(int, w.split(":"))) for w in (a.fit, a.eval))
    except ValueError:
        raise InputError(f"--fit {a.fit} --eval {a.eval}: expected START:END token windows, e.g. 1000:2000") from None
    if not (0 <= f0 < f1 and 0 <= e0 < e1):
        raise InputError(f"--fit {a.fit} --eval {a.eval}: each window's START must be below its END, both >= 0")
    ids = load_routing(a.trace).ids[:a.layers]
    e = int(ids.max()) + 1
    m = CooccurrenceEstimator(ids[:, :f0], e).m  # the logistic model's feature: fitted before its own window
    fit, ev = features(ids, m, a.slots, f0, f1), features(ids, m, a.slots, e0, e1)
    m_bb = CooccurrenceEstimator(ids[:, :e0 - 1], e).m  # bench big's predictor: every token before the scored ones
    ev_bb = features(ids, m_bb, a.slots, e0, e1)
    w, b, mu, sd = fit_logistic(fit)

    def prob(f):
        return torch.sigmoid(torch.tensor((f - mu) / sd, dtype=torch.float32) @ w + b).numpy()
    n, misses = len(ev), sum(g for _, _, g in ev)
    confident = {}
    for th in (0.2, 0.3, 0.4, 0.5):
        named = [(prob(f) >= th) for f, _, _ in ev]
        k = sum(int(x.sum()) for x in named)
        used = sum(int(u[x].sum()) for x, (_, u, _) in zip(named, ev))
        confident[f"p>={th}"] = {"per_step": round(k / n, 3), "precision": round(used / max(k, 1), 4),
                                 "recall": round(used / misses, 4)}
    prov = provenance(Path(__file__).parent)
    res = {"what": "how well the trace's own routing ids predict an LRU cache's misses one layer ahead",
           "command": "python experiments/miss_predictability.py --out results/miss_predictability.json",
           "trace": Path(a.trace).name, "layers": int(ids.shape[0]), "slots_per_layer": a.slots,
           "fit_tokens": a.fit, "eval_tokens": a.eval, "steps": n, "misses_per_step": round(misses / n, 3),
           "cooccurrence": score(ev_bb, lambda f: f[:, 0]),
           "logistic": {**score(ev, prob), "by_confidence": confident,
                        "features": ["cooccurrence", "log1p(tokens since last use)", "decayed use count",
                                     "log1p(100 cooccurrence)"], "weights": [round(x, 4) for x in w.tolist()]},
           **prov}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        from expertcache.runtime.bench.results import write_result

        write_result(a.out, res, config=vars(a))


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
