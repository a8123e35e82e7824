#!/usr/bin/env python
"""Lookahead recall (METRICS.md) of every predictor on one trace with hidden states, side by side.

recall = |top-k predicted for MoE layer L ∩ true top-k at L| / k, averaged over decode tokens and layers L >= d.
Predictors: the zero-parameter probe at d = 1, 2, 3 (layer L's router on the state entering L-d); the ridge
estimator (`expertcache fit-predictor`, fitted on another split) at d = 1; the trained Spatio router of a
cache-aware checkpoint at d = 1 (its backbone must be this model's); persistence (layer L's experts of the previous
token). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from expertcache.runtime.engine.predictors import EstimatorPredictor
from expertcache.telemetry.adapters import adapter_for
from expertcache.telemetry.analysis import lookahead_recall
from expertcache.telemetry.parquet_trace import check_compatible, read_trace


def recall(pred_ids: np.ndarray, true_ids: np.ndarray) -> float:
    """[tokens, k] each -> mean fraction of the true k that the predicted k contain."""
    return float((pred_ids[:, :, None] == true_ids[:, None, :]).any(-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--trace", required=True, help="decode trace recorded with --hidden (e.g. the test split)")
    ap.add_argument("--estimator", default=None, help="estimator safetensors fitted on another split")
    ap.add_argument("--routers", default=None, help="checkpoint dir with aux_routers.safetensors for this backbone")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from expertcache.telemetry.hf import load_causal_lm

    model = load_causal_lm(a.model, dtype=torch.float32).eval()
    tr = read_trace(a.trace).filter(phase="decode")
    check_compatible(tr.meta, model)
    ad = adapter_for(model)
    ids, seq, _ = tr.routing()
    ids = ids.astype(np.int64)
    hidden = tr.layer_matrix("hidden").astype(np.float32)
    k = ad.top_k
    out = {"model": a.model, "trace": a.trace, "decode_tokens": int(ids.shape[1]), "top_k": k,
           "probe": {d: v["mean"] for d, v in lookahead_recall(tr, model, (1, 2, 3)).items()}}
    same_seq = seq[1:] == seq[:-1]
    out["persistence_d1"] = float(np.mean([recall(ids[i][:-1][same_seq], ids[i][1:][same_seq])
                                           for i in range(ids.shape[0])]))
    if a.estimator:
        est = EstimatorPredictor.load(a.estimator, ad.num_experts, ad.hidden_size)
        r = [recall(est.predict(i - 1, torch.from_numpy(hidden[i - 1]), {}).topk(k, -1).indices.numpy(), ids[i])
             for i in range(1, ids.shape[0])]
        out["estimator_d1"] = float(np.mean(r))
    if a.routers:
        from expertcache.trainer.aux_routers import load_aux_routers

        aux = load_aux_routers(a.routers, model)
        routers = [L.router for L in ad.moe_layers(model)]
        with torch.no_grad():
            r = [recall(aux.spatio_scores(i, torch.from_numpy(hidden[i - 1]), routers[i]).topk(k, -1).indices.numpy(),
                        ids[i]) for i in range(1, ids.shape[0])]
        out["spatio_router_d1"] = float(np.mean(r))
    print(json.dumps(out, indent=2))
    if a.out:
        from expertcache.runtime.bench.results import write_result

        write_result(a.out, out, config=vars(a))


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
