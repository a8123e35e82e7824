"""The predictors a routing trace itself provides (`predictors.REPLAY_PREDICTORS`), for the replay and `bench big`,
where a model's router is replaced by a trace's routing: `persistence` (the experts the next layer used at the
previous token), `cooccurrence` (counts of which experts follow which, fitted on the trace's earlier tokens; not
the runtime's ridge `estimator:FILE`, which needs hidden states) and `oracle[:<recall>]` (the trace's own next
experts, degraded to a stated recall); and the trace's next-use keep scores, under which the scored policy is
Belady."""

from __future__ import annotations

import functools

import numpy as np
import torch

from expertcache.runtime.engine.predictors import REPLAY_PREDICTORS, Predictor

# what a replay compares against on-demand when no predictor is named (`bench decode --replay`)
REPLAY_DEFAULTS = ("persistence", "cooccurrence", "oracle:0.25", "oracle:0.5", "oracle:0.75", "oracle")

class CooccurrenceEstimator:
    """P(expert b at layer i+1 | the experts layer i uses now), from counts over fit tokens, plus a
    persistence prior (the experts layer i+1 used at the previous token)."""

    def __init__(self, ids_fit: np.ndarray, num_experts: int, persistence: float = 1.0):
        n_l = ids_fit.shape[0]
        self.m = np.zeros((n_l, num_experts, num_experts))
        for i in range(n_l - 1):
            a, b = ids_fit[i], ids_fit[i + 1]  # [tokens, k]
            np.add.at(self.m[i], (np.repeat(a, b.shape[1], axis=1).ravel(), np.tile(b, (1, a.shape[1])).ravel()), 1)
        self.m /= np.maximum(self.m.sum(-1, keepdims=True), 1)
        self.persistence = persistence

    def scores(self, i: int, cur: np.ndarray, prev_next: np.ndarray | None) -> np.ndarray:
        s = self.m[i][cur].sum(0)
        if prev_next is not None:
            s[prev_next] += self.persistence * s.max()
        return s


class CooccurrencePredictor(Predictor):
    """The co-occurrence estimator as an engine predictor: layer L+1's experts from the experts layer L uses now
    and those layer L+1 used at the previous token (both in the engine's history). Routing ids only: it serves a
    model whose router is replaced by a trace's routing (`bench big`), fitted on other tokens of that trace."""

    name = "cooccurrence"

    def __init__(self, est: CooccurrenceEstimator):
        self.est = est

    def predict(self, layer, hidden, history):
        if layer + 1 >= self.est.m.shape[0] or layer not in history:
            return None
        prev = history.get(layer + 1)
        s = self.est.scores(layer, np.asarray(history[layer]), None if prev is None else np.asarray(prev))
        return torch.from_numpy(s).float()[None, :]


def check_replay_predictor(p: str) -> None:
    """Replay predictors (`predictors.REPLAY_PREDICTORS`) come from the trace (`cooccurrence`: counts of which
    experts follow which, fitted on the trace's earlier tokens; not the runtime's ridge `estimator:FILE`, which
    needs hidden states)."""
    REPLAY_PREDICTORS.parse(p)


def next_use_scores(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """`[layers, tokens, E]`: minus the token index of each expert's next use after t (-inf: never again), the
    keep scores under which the scored policy is Belady."""
    from expertcache.telemetry.cachesim import NEVER, next_use_steps

    out = np.stack([next_use_steps(layer, num_experts) for layer in ids]).astype(np.float64)
    out[out >= NEVER] = np.inf
    return -out


_replay_spec = functools.lru_cache(maxsize=None)(REPLAY_PREDICTORS.parse)  # once per name, not per step


def predicted(predictor: str, ids, est, rng, i: int, t: int, k: int, e: int) -> list[int]:
    """Layer i+1's experts at token t as the replay predictor `predictor` sees them when layer i starts (wrapping
    to layer 0 of token t+1 after the last layer)."""
    n_l = ids.shape[0]
    ni, nt = (i + 1, t) if i + 1 < n_l else (0, t + 1)
    if nt >= ids.shape[1]:
        return []
    p = _replay_spec(predictor)
    if p.name == "persistence":
        return ids[ni, nt - 1].tolist() if nt >= 1 else []
    if p.name == "cooccurrence":
        prev = ids[ni, nt - 1] if nt >= 1 else None
        if ni == 0:  # across tokens there is no layer-to-layer evidence: persistence
            return prev.tolist() if prev is not None else []
        return np.argsort(-est.scores(i, ids[i, t], prev))[:k].tolist()
    if p.name == "oracle":
        true = ids[ni, nt].tolist()
        keep = [x for x in true if rng.random() < p.arg]  # p.arg: the recall
        wrong = [x for x in rng.permutation(e).tolist() if x not in true][:k - len(keep)]
        return keep + wrong
    return []  # none


class TracePredictor(Predictor):
    """`predicted(...)` as an engine predictor: the replay sets `t`, the token being decoded, before each one."""

    def __init__(self, predictor: str, ids: np.ndarray, est, seed: int = 0):
        self.ids, self.est = ids, est
        self.name, self.t = predictor, 0
        self.rng = np.random.default_rng(seed)
        self.e = int(ids.max()) + 1 if est is None else est.m.shape[-1]

    def predict(self, layer, hidden, history):
        if layer + 1 >= self.ids.shape[0]:
            return None
        pred = predicted(self.name, self.ids, self.est, self.rng, layer, self.t, self.ids.shape[2], self.e)
        if not pred:
            return None
        s = torch.zeros(1, self.e)
        s[0, pred] = torch.arange(len(pred), 0, -1, dtype=torch.float32)  # in the predictor's order
        return s
