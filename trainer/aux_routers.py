"""Auxiliary cache routers: Temporal (update-only) and Spatio (refine before access). Inference keeps the native
top-k; these heads only decide what the expert cache keeps and prefetches.

Both heads are the native router of the layer they predict, applied to an earlier hidden state, plus a small
learned low-rank correction whose output layer starts at zero, so an untrained head *is* a zero-parameter
predictor and training can only start from there:

- Temporal, layer L: `h_{L,t}` (the hidden state entering layer L's MoE block at token t) and which experts the
  last few tokens used at layer L -> scores of layer L's experts for the tokens ahead. Starts as "the next token
  routes like this one" (persistence). After layer L is
  accessed at token t, the cache keeps the top-C experts by these scores; it never loads anything itself.
- Spatio, layer L >= 1: `h_{L-1,t}` (the causal predecessor) -> scores of layer L's experts at token t. Starts as
  the lookahead probe at d = 1. Before layer L runs, at most R (the refinement budget) of its top predictions
  that are not resident are prefetched.

Supervision: the native routing, by binary cross-entropy on every expert's score. Spatio: membership of the
true top-k. Temporal: soft membership `gamma^(d-1)`, d the number of tokens until the expert's next use at that
layer (1: the next token's top-k; 0 beyond `horizon`), so the scores rank experts by how soon they are needed,
the order Belady keeps (gamma = 0 is plain next-token membership). Saved as safetensors beside the HF checkpoint, with the shapes and a fingerprint of the
checkpoint's router weights in the metadata, so routers trained for another checkpoint are refused.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from expertcache.telemetry.adapters import router_fingerprint
from expertcache.telemetry.errors import InputError

ROUTERS_FILE = "aux_routers.safetensors"


@dataclass
class AuxRouterConfig:
    hidden_size: int
    num_experts: int
    top_k: int
    moe_layers: list[int]  # decoder indices of the MoE layers, in order
    temporal: bool = True
    spatio: bool = True
    rank: int = 32
    refine_budget: int = 2  # R: at most R Spatio prefetches per layer per token
    prefetch_threshold: float = 0.5  # a Spatio prediction is prefetched only if sigmoid(score) >= this
    horizon: int = 8  # Temporal target: uses up to this many tokens ahead
    horizon_decay: float = 0.5  # Temporal target gamma^(d-1) for an expert next used d tokens ahead
    history: int = 8  # Temporal input: which experts the last `history` tokens used at this layer


class ResidualHead(nn.Module):
    """`scores [tokens, E] = native_logits + up(gelu(down(h)))`, `up` zero at start."""

    def __init__(self, hidden: int, num_experts: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, num_experts)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor, native_logits: torch.Tensor) -> torch.Tensor:
        return native_logits + self.up(nn.functional.gelu(self.down(h)))


class TemporalHead(ResidualHead):
    """A residual head that also reads the layer's recent routing: `+ sum_j w_j * used(e, t - j)`, one learned
    weight per lag (zero at start), so recency and reuse count as well as the hidden state."""

    def __init__(self, hidden: int, num_experts: int, rank: int, history: int):
        super().__init__(hidden, num_experts, rank)
        self.lag_w = nn.Parameter(torch.zeros(history))

    def forward(self, h, native_logits, hist):  # hist [tokens, E, history] 0/1
        return super().forward(h, native_logits) + hist.to(self.lag_w.dtype) @ self.lag_w


class AuxRouters(nn.Module):
    def __init__(self, cfg: AuxRouterConfig):
        super().__init__()
        if not (cfg.temporal or cfg.spatio):
            raise InputError("auxiliary routers need temporal, spatio or both")
        self.cfg = cfg
        n = len(cfg.moe_layers)
        mk = lambda: ResidualHead(cfg.hidden_size, cfg.num_experts, cfg.rank)  # noqa: E731
        self.temporal = nn.ModuleList([TemporalHead(cfg.hidden_size, cfg.num_experts, cfg.rank, cfg.history)
                                       for _ in range(n)]) if cfg.temporal else None
        # spatio[i] predicts MoE layer i + 1 from layer i's hidden state
        self.spatio = nn.ModuleList([mk() for _ in range(n - 1)]) if cfg.spatio else None

    @staticmethod
    def native(router: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The router's logits for `h`, as a fixed prior (no gradient into the backbone's router)."""
        from expertcache.telemetry.adapters import router_logits

        return router_logits(router, h, detach=True)

    def temporal_scores(self, i: int, h: torch.Tensor, router: nn.Module, hist: torch.Tensor) -> torch.Tensor:
        """MoE layer i's scores for the next token, from `h [tokens, H]` entering layer i now and `hist
        [tokens, E, history]` (`history_features`) of the tokens up to now."""
        return self.temporal[i](h, self.native(router, h), hist)

    def spatio_scores(self, i: int, h_prev: torch.Tensor, router: nn.Module) -> torch.Tensor:
        """MoE layer i's (i >= 1) scores for this token, from `h_prev [tokens, H]` entering layer i - 1."""
        return self.spatio[i - 1](h_prev, self.native(router, h_prev))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def loss(self, hidden: list[torch.Tensor], ids: list[torch.Tensor], routers: list[nn.Module],
             batch: int) -> dict[str, torch.Tensor]:
        """BCE of each head against the native top-k membership. `hidden[i] [B*T, H]` entering MoE layer i,
        `ids[i] [B*T, k]` its native top-k, `routers[i]` its router. Tokens of a sequence are adjacent."""
        e = self.cfg.num_experts
        bce = nn.functional.binary_cross_entropy_with_logits
        out = {}
        if self.temporal is not None:
            terms = []
            for i, (h, r) in enumerate(zip(hidden, routers)):
                h3 = h.view(batch, -1, h.shape[-1])[:, :-1].reshape(-1, h.shape[-1])  # tokens t < T-1
                ids3 = ids[i].view(batch, -1, ids[i].shape[-1])  # [B, T, k]
                tgt = next_use_target(ids3, e, self.cfg.horizon, self.cfg.horizon_decay)  # [B, T-1, E]
                hist = history_features(ids3, e, self.cfg.history)[:, :-1]  # [B, T-1, E, history]
                terms.append(bce(self.temporal_scores(i, h3, r, hist.reshape(-1, e, self.cfg.history)),
                                 tgt.reshape(-1, e)))
            out["temporal"] = torch.stack(terms).mean()
        if self.spatio is not None:
            terms = [bce(self.spatio_scores(i, hidden[i - 1], routers[i]), _multi_hot(ids[i], e))
                     for i in range(1, len(hidden))]
            out["spatio"] = torch.stack(terms).mean()
        return out

    # --- files ---------------------------------------------------------------------------------------------

    def save(self, model_dir: str | Path, model) -> Path:
        from safetensors.torch import save

        from expertcache.telemetry.atomic import write_bytes

        path = Path(model_dir) / ROUTERS_FILE
        meta = {"config": json.dumps(asdict(self.cfg)), "routers_fingerprint": router_fingerprint(model)}
        write_bytes(path, save({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, metadata=meta))
        return path


def _multi_hot(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[..., k]` ids -> `[..., E]` 0/1."""
    return torch.zeros(*ids.shape[:-1], num_experts, device=ids.device).scatter_(-1, ids.long(), 1.0)


@torch.no_grad()
def history_features(ids: torch.Tensor, num_experts: int, history: int) -> torch.Tensor:
    """`ids [B, T, k]` -> `[B, T, E, history]`: feature j of token t is 1 if expert e was used at t - j."""
    m = _multi_hot(ids, num_experts)  # [B, T, E]
    out = torch.zeros(*m.shape, history, device=m.device)
    for j in range(min(history, m.shape[1])):
        out[:, j:, :, j] = m[:, :m.shape[1] - j]
    return out


@torch.no_grad()
def next_use_target(ids: torch.Tensor, num_experts: int, horizon: int, decay: float) -> torch.Tensor:
    """`ids [B, T, k]` -> `[B, T-1, E]`: for token t, `decay^(d-1)` if expert e is next used at t + d
    (1 <= d <= horizon, within the block), else 0."""
    m = _multi_hot(ids, num_experts)  # [B, T, E]
    t = m.shape[1]
    tgt = torch.zeros_like(m[:, :-1])
    for d in range(horizon, 0, -1):  # nearest use last, so it wins
        if d >= t:
            continue
        w = decay ** (d - 1)
        fut = m[:, d:]  # token t + d for t < T - d
        tgt[:, :t - d] = torch.where(fut > 0, torch.full_like(fut, w), tgt[:, :t - d])
    return tgt


def config_for(model, temporal: bool, spatio: bool, rank: int, refine_budget: int, prefetch_threshold: float,
               horizon: int, horizon_decay: float, history: int) -> AuxRouterConfig:
    from expertcache.telemetry.adapters import adapter_for

    a = adapter_for(model)
    return AuxRouterConfig(hidden_size=a.hidden_size, num_experts=a.num_experts, top_k=a.top_k,
                           moe_layers=[L.index for L in a.moe_layers(model)], temporal=temporal, spatio=spatio,
                           rank=rank, refine_budget=refine_budget, prefetch_threshold=prefetch_threshold,
                           horizon=horizon, horizon_decay=horizon_decay, history=history)


def load_aux_routers(model_dir: str | Path, model) -> AuxRouters:
    """The routers saved beside `model_dir`'s checkpoint, checked against `model` (the loaded checkpoint)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(model_dir) / ROUTERS_FILE
    if not path.is_file():
        raise InputError(f"no auxiliary routers at {path} (a locality-only run has none)")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "config" not in meta:
        raise InputError(f"{path} has no router config in its metadata; not written by expertcache")
    cfg = AuxRouterConfig(**json.loads(meta["config"]))
    want = router_fingerprint(model)
    if meta.get("routers_fingerprint") != want:
        raise InputError(f"{path} was trained for another checkpoint (router fingerprint "
                         f"{meta.get('routers_fingerprint')}, this model's is {want})")
    aux = AuxRouters(cfg)
    state = load_file(str(path))
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise InputError(f"{path}: router tensor {bad[0]} holds non-finite values (NaN/inf); its scores would be "
                         f"meaningless")
    aux.load_state_dict(state)
    return aux.eval()
