"""Predictors: which experts a later MoE layer will need, known before it runs.

Interface: `predict(layer, hidden, history) -> scores [tokens, E]` for MoE layer `layer + distance`, from the
hidden state `[tokens, H]` entering MoE layer `layer` now and `history`, the experts each layer used at the
previous token (`{layer: [k ids]}`). Higher scores first; the engine prefetches the top ones.

- ``none``: no prediction (on-demand loading only).
- ``probe:d``: the zero-parameter lookahead probe: layer L+d's own router applied to layer L's hidden state.
- ``lookahead:D``: the probe for every layer from L+1 to L+D at once (each later layer's own router on layer L's
  hidden state); the engine queues their loads nearest first, and a nearer layer's prediction replaces a farther
  one's (what it no longer names is cancelled if it has not started).
- ``persistence``: the experts layer L+1 used at the previous token.
- ``estimator``: a ridge-regression map from layer L's hidden state to layer L+1's experts, fitted on a trace
  with hidden states (`expertcache fit-predictor`), saved as safetensors.
- ``spatio``: the trained Spatio router saved beside a cache-aware checkpoint (the probe plus its learned
  correction).
- the oracle (the true experts of the next layer, or a stated fraction of them) exists only in a replay, where
  the trace knows the future: `runtime.replay`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Protocol

import numpy as np
import torch

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.registry import Registry


class AuxRoutersConfig(Protocol):
    num_experts: int
    history: int


class AuxRouters(Protocol):
    """What the runtime needs of a checkpoint's auxiliary routers (the trainer's `AuxRouters`, saved beside the
    checkpoint as aux_routers.safetensors): a Spatio head that scores layer L's experts from the state entering
    layer L-1, and a Temporal head that scores layer L's experts for the tokens ahead from the hidden state and the
    last `history` tokens' routing."""

    cfg: AuxRoutersConfig
    spatio: object | None
    temporal: object | None

    def spatio_scores(self, layer: int, hidden: torch.Tensor, router: torch.nn.Module) -> torch.Tensor: ...

    def temporal_scores(self, layer: int, hidden: torch.Tensor, router: torch.nn.Module,
                        history: torch.Tensor) -> torch.Tensor: ...


# The one way a checkpoint's aux routers reach the runtime: `(checkpoint_dir, model) -> AuxRouters`, installed by
# the entry points (the `expertcache` CLI, the evaluation's model opener), since the runtime does not import the
# trainer that defines them. `loader.load` asks for them when the predictor is spatio or the policy scored.
_AUX_LOADER: Optional[Callable] = None


def set_aux_routers_loader(fn: Optional[Callable]) -> None:
    """Install `fn(checkpoint_dir, model) -> AuxRouters` (in Python: `set_aux_routers_loader(
    expertcache.trainer.aux_routers.load_aux_routers)`); None uninstalls it."""
    global _AUX_LOADER
    _AUX_LOADER = fn


def aux_routers_for(checkpoint_dir, model) -> AuxRouters:
    """The aux routers saved beside `checkpoint_dir`, checked against `model`, through the installed loader."""
    if _AUX_LOADER is None:
        raise InputError("the spatio predictor and the scored policy need the checkpoint's aux routers, and no "
                         "loader is installed: call expertcache.runtime.engine.predictors.set_aux_routers_loader("
                         "expertcache.trainer.aux_routers.load_aux_routers) first (the expertcache CLI does)")
    return _AUX_LOADER(checkpoint_dir, model)


class Predictor:
    name = "none"
    distance = 1

    @property
    def active(self) -> bool:
        """Whether it predicts anything (the base class is the `none` predictor)."""
        return type(self).predict is not Predictor.predict

    def predict(self, layer: int, hidden: torch.Tensor, history: dict) -> torch.Tensor | None:
        return None

    def predict_ahead(self, layer: int, hidden: torch.Tensor, history: dict) -> list[tuple[int, torch.Tensor]]:
        """`[(distance, scores)]` for each later layer it predicts (what the engine calls); one, at `distance`,
        unless a predictor looks at several."""
        s = self.predict(layer, hidden, history)
        return [] if s is None else [(self.distance, s)]

    def describe(self) -> dict:
        return {"predictor": self.name, "distance": self.distance}


class ProbePredictor(Predictor):
    def __init__(self, model, distance: int = 1):
        from expertcache.telemetry.adapters import adapter_for

        self.adapter = adapter_for(model)
        self.routers = [L.router for L in self.adapter.moe_layers(model)]
        if distance >= len(self.routers):  # it would never name an expert: a no-op that looks like prefetching
            raise InputError(f"predictor probe:{distance} looks {distance} MoE layers ahead; this model has "
                             f"{len(self.routers)}, so at most probe:{max(1, len(self.routers) - 1)}")
        self.distance, self.name = distance, f"probe:{distance}"

    def predict(self, layer, hidden, history):
        t = layer + self.distance
        if t >= len(self.routers):
            return None
        return self.adapter.scores(self.adapter.router_logits(self.routers[t], hidden))  # the family's own rule


class LookaheadPredictor(ProbePredictor):
    """The probe for layers L+1..L+depth at once: each one's own router on layer L's hidden state."""

    def __init__(self, model, depth: int = 2):
        super().__init__(model, 1)
        if depth >= len(self.routers):
            raise InputError(f"predictor lookahead:{depth} looks {depth} MoE layers ahead; this model has "
                             f"{len(self.routers)}, so at most lookahead:{max(1, len(self.routers) - 1)}")
        self.depth, self.name = depth, f"lookahead:{depth}"

    def predict_ahead(self, layer, hidden, history):
        return [(d, self.adapter.scores(self.adapter.router_logits(self.routers[layer + d], hidden)))
                for d in range(1, self.depth + 1) if layer + d < len(self.routers)]

    def describe(self) -> dict:
        return {"predictor": self.name, "distance": 1, "depth": self.depth}


class PersistencePredictor(Predictor):
    name = "persistence"

    def __init__(self, num_experts: int):
        self.e = num_experts

    def predict(self, layer, hidden, history):
        prev = history.get(layer + 1)
        if prev is None:
            return None
        s = torch.zeros(1, self.e)
        s[0, torch.as_tensor(prev)] = 1.0
        return s


class EstimatorPredictor(Predictor):
    """`scores = h @ W[L] + b[L]`, W fitted by ridge regression on multi-hot targets of layer L+1."""

    name = "estimator"

    def __init__(self, weights: torch.Tensor, bias: torch.Tensor):
        self.w, self.b = weights, bias  # [layers-1, H, E], [layers-1, E]

    def predict(self, layer, hidden, history):
        if layer + 1 > self.w.shape[0]:
            return None
        return hidden.float() @ self.w[layer] + self.b[layer]

    @classmethod
    def fit(cls, trace_path: str | Path, ridge: float = 1.0) -> "EstimatorPredictor":
        from expertcache.telemetry.parquet_trace import read_trace

        tr = read_trace(trace_path)
        if "hidden" not in tr.table.column_names:
            raise InputError(f"trace {trace_path} has no hidden states; record it with --hidden")
        ids = tr.routing()[0].astype(np.int64)  # [layers, tokens, k]
        hid = tr.layer_matrix("hidden").astype(np.float64)  # [layers, tokens, H]
        n_l, n_t, _ = ids.shape
        e = tr.meta.num_experts
        ws, bs = [], []
        for i in range(n_l - 1):
            x = np.concatenate([hid[i], np.ones((n_t, 1))], axis=1)  # [tokens, H+1]
            y = np.zeros((n_t, e))
            np.put_along_axis(y, ids[i + 1], 1.0, axis=1)
            a = x.T @ x + ridge * np.eye(x.shape[1])
            sol = np.linalg.solve(a, x.T @ y)  # [H+1, E]
            ws.append(sol[:-1])
            bs.append(sol[-1])
        w, b = np.stack(ws), np.stack(bs)
        if not (np.isfinite(w).all() and np.isfinite(b).all()):
            raise InputError(f"trace {trace_path}: the fitted estimator is not finite (non-finite hidden states in "
                             f"the trace, or --ridge too small); nothing written")
        return cls(torch.tensor(w, dtype=torch.float32), torch.tensor(b, dtype=torch.float32))

    def save(self, path: str | Path, trace_meta: dict) -> None:
        from safetensors.torch import save

        from expertcache.telemetry.atomic import write_bytes

        write_bytes(path, save({"weights": self.w.contiguous(), "bias": self.b.contiguous()},
                               metadata={"kind": "expertcache-estimator", "trace": json.dumps(trace_meta, default=str)}))

    @classmethod
    def load(cls, path: str | Path, num_experts: int, hidden_size: int) -> "EstimatorPredictor":
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise InputError(f"estimator {path} not found (fit one with `expertcache fit-predictor`)")
        from safetensors import SafetensorError

        try:
            with safe_open(str(path), "pt") as f:
                if (f.metadata() or {}).get("kind") != "expertcache-estimator":
                    raise InputError(f"{path} is not an expertcache estimator")
            t = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise InputError(f"estimator {path} is not a readable safetensors file ({' '.join(str(e).split())[:120]})"
                             ) from None
        if set(t) != {"weights", "bias"} or t["weights"].ndim != 3:
            raise InputError(f"{path} is not an expertcache estimator (tensors {sorted(t)[:4]})")
        if t["weights"].shape[1:] != (hidden_size, num_experts):
            raise InputError(f"estimator {path} maps {tuple(t['weights'].shape[1:])} (hidden, experts); the model "
                             f"has ({hidden_size}, {num_experts})")
        bad = [name for name in ("weights", "bias") if not torch.isfinite(t[name].float()).all()]
        if bad:
            n = int((~torch.isfinite(t[bad[0]].float())).sum())
            raise InputError(f"estimator {path}: {bad[0]} holds {n} non-finite value(s) (NaN/inf); its scores would "
                             f"be meaningless (refit it with `expertcache fit-predictor`)")
        if t["bias"].shape != (t["weights"].shape[0], num_experts):
            raise InputError(f"estimator {path}: bias of shape {tuple(t['bias'].shape)}, expected "
                             f"{(t['weights'].shape[0], num_experts)}")
        return cls(t["weights"], t["bias"])


class SpatioPredictor(Predictor):
    name = "spatio"

    def __init__(self, model, aux: AuxRouters):
        from expertcache.telemetry.adapters import adapter_for

        if aux.spatio is None:
            raise InputError("these auxiliary routers have no Spatio head (trained with routers.spatio=false)")
        self.aux = aux
        self.routers = [L.router for L in adapter_for(model).moe_layers(model)]

    @torch.no_grad()
    def predict(self, layer, hidden, history):
        if layer + 1 >= len(self.routers):
            return None
        return self.aux.spatio_scores(layer + 1, hidden.float(), self.routers[layer + 1]).sigmoid()


def _distance(s: str) -> int:
    if not (s.isdigit() and 1 <= int(s) <= 64):
        raise ValueError(s)
    return int(s)


def _recall(s: str) -> float:
    r = float(s)
    if not 0.0 <= r <= 1.0:
        raise ValueError(s)
    return r


# Every predictor name, once. `live`: built for a model by `make_predictor` as `factory(arg, model, aux,
# num_experts, hidden_size)`; `replay`: predicted from a trace by the replay (`runtime.replay.predicted`), which
# alone knows the trace (cooccurrence, the oracle: no factory here).
PREDICTOR_REGISTRY = Registry("predictor")


@PREDICTOR_REGISTRY.register("none", tags=("live", "replay"), aliases=("",))
def _none(arg, model, aux, num_experts, hidden_size):
    return Predictor()


@PREDICTOR_REGISTRY.register("probe", takes_arg="D", default="1", convert=_distance,
                             arg_help="a lookahead distance D from 1 to 64, e.g. probe:1", tags=("live",))
def _probe(d, model, aux, num_experts, hidden_size):
    if model is None:
        raise InputError("the lookahead probe needs the model's routers")
    return ProbePredictor(model, d)


@PREDICTOR_REGISTRY.register("lookahead", takes_arg="D", default="2", convert=_distance,
                             arg_help="how many MoE layers ahead, 1 to 64: layers L+1..L+D, e.g. lookahead:3",
                             tags=("live",))
def _lookahead(d, model, aux, num_experts, hidden_size):
    if model is None:
        raise InputError("the lookahead probe needs the model's routers")
    return LookaheadPredictor(model, d)


@PREDICTOR_REGISTRY.register("persistence", tags=("live", "replay"))
def _persistence(arg, model, aux, num_experts, hidden_size):
    return PersistencePredictor(num_experts)


@PREDICTOR_REGISTRY.register("estimator", takes_arg="FILE", arg_help="a file written by `expertcache fit-predictor`",
                             tags=("live",))
def _estimator(path, model, aux, num_experts, hidden_size):
    return EstimatorPredictor.load(path, num_experts, hidden_size)


@PREDICTOR_REGISTRY.register("spatio", tags=("live",))
def _spatio(arg, model, aux, num_experts, hidden_size):
    if aux is None:
        raise InputError("predictor spatio needs a checkpoint with aux_routers.safetensors (a joint or aux-only "
                         "train-cache-aware run)")
    return SpatioPredictor(model, aux)


PREDICTOR_REGISTRY.register("cooccurrence", tags=("replay",))
PREDICTOR_REGISTRY.register("oracle", takes_arg="recall", default="1", convert=_recall,
                            arg_help="the fraction of the true experts it names, in [0, 1]; oracle alone is 1",
                            tags=("replay",))
LIVE_PREDICTORS = PREDICTOR_REGISTRY.view("live")
REPLAY_PREDICTORS = PREDICTOR_REGISTRY.view("replay", kind="replay predictor")  # what a trace itself can predict


def _live(spec):
    """A live predictor's spec parsed; a replay's predictor named here is told where it runs."""
    if spec not in LIVE_PREDICTORS and spec in REPLAY_PREDICTORS:
        raise InputError(f"predictor {spec!r}: a replay's predictor (it needs the trace): use it with "
                         f"`expertcache bench decode --replay TRACE --predictors [{spec}]`")
    return LIVE_PREDICTORS.parse(spec)


def check_predictor_spec(spec: str) -> None:
    """A live predictor's name, checked before any work (the model is not needed): none, probe:D, lookahead:D,
    persistence,
    estimator:FILE (the file exists) or spatio."""
    p = _live(spec)
    if p.name == "estimator" and not Path(p.arg).is_file():
        raise InputError(f"estimator {p.arg} not found (fit one with `expertcache fit-predictor`)")


def make_predictor(spec: str, model=None, aux=None, num_experts: int | None = None, hidden_size: int | None = None):
    """A live predictor (`LIVE_PREDICTORS`): `none`, `probe[:D]`, `lookahead[:D]`, `persistence`,
    `estimator:<file>`, `spatio`."""
    p = _live(spec)
    return p.obj(p.arg, model, aux, num_experts, hidden_size)


class TemporalKeep:
    """Keep scores for the engine's `scored` cache policy from a trained Temporal router: after layer L runs
    for a token, its scores for the tokens ahead, from the hidden state entering layer L and the experts the
    layer used at the last `history` tokens (kept here)."""

    def __init__(self, model, aux: AuxRouters):
        from collections import deque

        from expertcache.telemetry.adapters import adapter_for

        if aux.temporal is None:
            raise InputError("these auxiliary routers have no Temporal head (trained with routers.temporal=false)")
        self.aux = aux
        self.routers = [L.router for L in adapter_for(model).moe_layers(model)]
        self.e, self.h = aux.cfg.num_experts, aux.cfg.history
        self.past = [deque(maxlen=self.h) for _ in self.routers]

    @torch.no_grad()
    def __call__(self, pos: int, hidden: torch.Tensor, needed: list[int]) -> list[float]:
        self.past[pos].appendleft(needed)  # feature j: used j tokens ago (0 = now)
        hist = torch.zeros(1, self.e, self.h)
        for j, ids in enumerate(self.past[pos]):
            hist[0, ids, j] = 1.0
        s = self.aux.temporal_scores(pos, hidden[-1:].float(), self.routers[pos], hist)
        return s[0].tolist()

    def reset(self) -> None:
        for d in self.past:
            d.clear()
