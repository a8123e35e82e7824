"""A learned eviction policy for expert caches: fitted from traces alone, lossless at serving time (only which
expert stays changes; nothing is rerouted).

After each MoE layer runs for a token, the policy scores every expert of that layer from what a serving engine
knows at that moment (the *online features*, below), and the cache keeps the top C of (resident ∪ the step's
experts) by score: the ``scored`` policy of `telemetry.cache.CacheState` and of `cachesim.simulate_scored`.

Online features, per layer and expert, updated from the ids each step chose (router probabilities optional):
- recency: used now, log steps since the last use, never used yet; log of the gap between the last two uses;
- decayed frequencies at several rates (EMAs of the use indicator) and the use share so far;
- co-occurrence: an online estimate of P(e at the next token | the experts this token chose at this layer), and of
  P(e at this layer, next token | the experts this token chose at the previous layer) (cross-layer);
- the router probability of e at this step (0 when not chosen; 1/k per chosen expert when a trace has no
  probabilities, e.g. llama.cpp traces);
- the layer's position (one model shared by every layer).

Supervision from the future of the trace: the distance to each expert's next use, as ordinal targets
`next use <= h` for h in HORIZONS. The model is a tiny MLP (a few thousand weights); its keep score is
`sum_h P(next use <= h)`, a ranking by expected log next-use distance: the quantity Belady's rule sorts by.
Scores do not depend on the cache's state or capacity, so one scorer serves every capacity and budget.

The file is safetensors (weights) + JSON metadata (model, num_experts, top_k, the traces fitted on, the feature
spec). Loading reads tensors and JSON only: no code is executed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .errors import InputError

KIND = "expertcache-learned-policy"
FORMAT_VERSION = 1
EMA_RATES = (0.5, 0.8, 0.9, 0.95, 0.98, 0.995)
HORIZONS = (1, 2, 4, 8)  # longer horizons measured worse at ranking (they favour frequency over recency)
FEATURES = (("used_now", "log_recency", "never_used", "log_gap")
            + tuple(f"ema_{r:g}" for r in EMA_RATES)
            + ("use_share", "cooc_next", "cooc_prev_layer", "router_prob", "layer_pos"))
_CAP = 4096.0  # recency / gap beyond this are the same
_ALPHA = 1.0  # co-occurrence smoothing towards the use share (in pseudo-counts)
_TIE = 1e-9  # score += _TIE * (layer * E + e) / (L * E): no two keys ever tie, so every cache keeps the same set


# --- traces -----------------------------------------------------------------------------------------------

def next_use_distance(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """One layer's `ids [T, k]` -> `[T, E]`: steps from t to the next use of e after t (a large value if none)."""
    from .cachesim import next_use_steps

    return np.minimum(next_use_steps(ids, num_experts), 1 << 30) - np.arange(ids.shape[0])[:, None]


# --- online features ---------------------------------------------------------------------------------------

class _LayerState:
    """What one layer's scorer remembers between steps."""

    def __init__(self, e: int):
        self.t = 0
        self.last = np.full(e, -1.0)
        self.gap = np.full(e, _CAP)
        self.count = np.zeros(e)
        self.ema = np.zeros((len(EMA_RATES), e))
        self.cooc = np.zeros((e, e))  # [a, b]: a at step t-1, b at step t
        self.cooc_n = np.zeros(e)
        self.cross = np.zeros((e, e))  # [a, b]: a at the previous layer, token t-1; b at this layer, token t
        self.cross_n = np.zeros(e)
        self.prev: np.ndarray | None = None  # this layer's ids at the previous step
        self.prev_up: np.ndarray | None = None  # the previous layer's ids at the previous step


_RATES = np.asarray(EMA_RATES)[:, None]
_RATES_1D = np.asarray(EMA_RATES, dtype=np.float64)
_NO_PROBS = np.zeros((1, 1))


def _step(st: _LayerState, ids: np.ndarray, up: np.ndarray | None, probs: np.ndarray | None, k: int,
          layer_pos: float) -> np.ndarray:
    """Update `st` with this step's `ids` (this layer's chosen experts; `up`: the same token's experts at the
    previous layer, None at the first) and return the features `[E, F]` for the keep decision after it."""
    e = st.last.shape[0]
    t = st.t
    # learn co-occurrence from what this step revealed
    if st.prev is not None:
        st.cooc[np.ix_(st.prev, ids)] += 1.0
        st.cooc_n[st.prev] += 1.0
    if st.prev_up is not None:
        st.cross[np.ix_(st.prev_up, ids)] += 1.0
        st.cross_n[st.prev_up] += 1.0
    # recency, gaps, counts, EMAs
    seen = st.last[ids] >= 0
    st.gap[ids] = np.where(seen, np.minimum(t - st.last[ids], _CAP), _CAP)
    st.last[ids] = t
    st.count[ids] += 1.0
    used = np.zeros(e)
    used[ids] = 1.0
    st.ema *= _RATES
    st.ema += (1.0 - _RATES) * used
    share = st.count / (t + 1)
    rec = np.where(st.last >= 0, np.minimum(t - st.last, _CAP), _CAP)
    f = np.empty((e, len(FEATURES)))
    f[:, 0] = used
    f[:, 1] = np.log1p(rec)
    f[:, 2] = st.last < 0
    f[:, 3] = np.log1p(st.gap)
    f[:, 4:4 + len(EMA_RATES)] = st.ema.T
    j = 4 + len(EMA_RATES)
    f[:, j] = share
    f[:, j + 1] = (st.cooc[ids].sum(0) + _ALPHA * share) / (st.cooc_n[ids].sum() + _ALPHA)
    if up is not None:
        f[:, j + 2] = (st.cross[up].sum(0) + _ALPHA * share) / (st.cross_n[up].sum() + _ALPHA)
    else:
        f[:, j + 2] = share
    pr = np.zeros(e)
    if probs is None:
        pr[ids] = 1.0 / k
    else:
        np.add.at(pr, ids, probs)
    f[:, j + 3] = pr
    f[:, j + 4] = layer_pos
    st.prev, st.prev_up = ids, up
    st.t = t + 1
    return f


# --- the policy --------------------------------------------------------------------------------------------

class LearnedPolicy:
    """Keep scores for the `scored` cache policy from a fitted policy file.

    The runtime's keep-score source: `policy(pos, hidden, ids) -> [E] scores` after MoE layer `pos` ran for a
    token (`hidden` is ignored; `ids` the experts it used, any order; optional `probs` their router
    probabilities), layers called in order for each token; `reset()` forgets every layer's history (a new,
    cold pass). One instance holds one stream's state.
    """

    def __init__(self, weights: dict[str, np.ndarray], meta: dict, num_layers: int | None = None):
        self.meta = meta
        self.e, self.k = int(meta["num_experts"]), int(meta["top_k"])
        self.num_layers = int(num_layers or meta.get("num_layers") or 1)
        self.mu, self.sd = weights["mu"], weights["sd"]
        self.layers = [(weights[f"w{i}"], weights[f"b{i}"]) for i in range(int(meta["depth"]))]
        self.uses_probs = bool(meta.get("uses_probs", False))
        self.reset()

    # the runtime interface
    def __call__(self, pos: int, hidden=None, ids=None, probs=None) -> list[float]:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        up = self._cur[pos - 1] if pos > 0 else None
        self._cur[pos] = ids
        return self.scores(self._feat(pos, ids, up, probs), pos).tolist()

    def reset(self) -> None:
        self._states: dict[int, _LayerState] = {}
        self._cur: dict[int, np.ndarray] = {}

    # internals shared by every path (runtime, simulator, fitting)
    def _feat(self, pos: int, ids: np.ndarray, up: np.ndarray | None, probs) -> np.ndarray:
        st = self._states.get(pos)
        if st is None:
            st = self._states[pos] = _LayerState(self.e)
        if not self.uses_probs:
            probs = None
        elif probs is not None:
            probs = np.asarray(probs, dtype=np.float64).reshape(-1)
        return _step(st, ids, up, probs, self.k, pos / max(1, self.num_layers - 1))

    def scores(self, f: np.ndarray, pos: int = 0) -> np.ndarray:
        """Keep scores `[..., E]` of layer `pos` from features `[..., E, F]`."""
        h = (f - self.mu) / self.sd
        for i, (w, b) in enumerate(self.layers):
            h = h @ w + b
            if i < len(self.layers) - 1:
                h = np.maximum(h, 0.0)
        tie = _TIE * (pos * self.e + np.arange(self.e)) / (max(1, self.num_layers) * self.e)
        return (1.0 / (1.0 + np.exp(-h))).sum(-1) + tie

    def check_shape(self, num_experts: int, top_k: int, what: str = "the trace") -> None:
        if (int(num_experts), int(top_k)) != (self.e, self.k):
            raise InputError(f"learned policy {self.meta.get('path', '')} was fitted on {self.e} experts top-{self.k} "
                             f"({self.meta.get('model', '?')}); {what} routes {num_experts} experts top-{top_k}")

    def keep_stream(self, ids: np.ndarray, layer: int | None = None, probs: np.ndarray | None = None):
        """Keep-score rows for `cachesim.simulate_scored`, from a fresh state, over a trace's `ids [L, T, k]`:
        layer `layer`'s `[E]` rows for a per-layer cache, or (layer None) the global key space `layer * E + e`
        in token-major order, each layer's slice updated as it runs (what `LayerView.retain` does)."""
        n_l, n_t, _ = ids.shape
        self.num_layers = n_l
        self.reset()
        if layer is not None:
            for t in range(n_t):
                up = ids[layer - 1, t] if layer > 0 else None
                yield self.scores(self._feat(layer, ids[layer, t], up, None if probs is None else probs[layer, t]),
                                  layer).tolist()
            return
        full = [float("-inf")] * (n_l * self.e)
        for t in range(n_t):
            for i in range(n_l):
                full[i * self.e:(i + 1) * self.e] = self(i, None, ids[i, t], None if probs is None else probs[i, t])
                yield full

    def _batched(self, n_l: int, k: int):
        """(features state for `simkernels.learned_features`, the MLP with the standardisation folded into its
        first layer (the same function, one pass over the features fewer), the tie-break term `[L, E]`)."""
        e, n_r = self.e, len(EMA_RATES)
        st = [np.full((n_l, e), -1.0), np.full((n_l, e), _CAP), np.zeros((n_l, e)), np.zeros((n_l, e, n_r)),
              np.zeros((n_l, e, e)), np.zeros((n_l, e)), np.zeros((n_l, e, e)), np.zeros((n_l, e)),
              np.zeros((n_l, k), np.int64)]
        w0, b0 = self.layers[0]
        layers = [(w0 / self.sd[:, None], b0 - (self.mu / self.sd) @ w0)] + \
            [(np.ascontiguousarray(w), b) for w, b in self.layers[1:]]

        def mlp(x: np.ndarray) -> np.ndarray:  # keep scores of feature rows [n, F] (before the tie term)
            for i, (w, b) in enumerate(layers):
                x = x @ w
                x += b
                if i < len(layers) - 1:
                    np.maximum(x, 0.0, out=x)
            np.negative(x, out=x)
            np.exp(x, out=x)
            x += 1.0
            np.reciprocal(x, out=x)
            return x.sum(-1)

        tie = _TIE * (np.arange(n_l)[:, None] * e + np.arange(e)) / (max(1, n_l) * e)
        return st, mlp, tie

    def _features(self, st, ids_t: np.ndarray, probs_t, t: int, feats: np.ndarray) -> None:
        from .simkernels import learned_features

        learned_features(ids_t, _NO_PROBS if probs_t is None else probs_t, probs_t is not None, t, _CAP, _ALPHA,
                         _RATES_1D, *st, feats)

    def keep_chunks(self, ids: np.ndarray, probs: np.ndarray | None = None, chunk: int = 64):
        """Keep scores of every layer over a trace's `ids [L, T, k]`, from a fresh state, in batches: yields
        `(t0, scores [tc, L, E])` for tokens t0..t0+tc (float64; row [t, l] = what `keep_stream(ids, l)` yields at
        token t, and the global stream's layer-l slice after layer l ran at token t). Features of every layer in
        one compiled loop per token (`simkernels.learned_features`), the MLP in one matrix product per chunk."""
        n_l, n_t, k = ids.shape
        self.num_layers = n_l
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        probs = np.asarray(probs, np.float64) if self.uses_probs and probs is not None else None
        st, mlp, tie = self._batched(n_l, k)
        feats = np.empty((chunk, n_l, self.e, len(FEATURES)))
        for t0 in range(0, n_t, chunk):
            tc = min(chunk, n_t - t0)
            for t in range(tc):
                self._features(st, np.ascontiguousarray(ids[:, t0 + t]),
                               None if probs is None else np.ascontiguousarray(probs[:, t0 + t]), t0 + t, feats[t])
            yield t0, mlp(feats[:tc].reshape(-1, len(FEATURES))).reshape(tc, n_l, self.e) + tie

    # file
    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save

        from .atomic import write_bytes

        t = {"mu": self.mu, "sd": self.sd}
        for i, (w, b) in enumerate(self.layers):
            t[f"w{i}"], t[f"b{i}"] = w, b
        meta = {k: v for k, v in self.meta.items() if k != "path"}
        write_bytes(path, save({k: np.ascontiguousarray(v, dtype=np.float64) for k, v in t.items()},
                               metadata={"kind": KIND, "policy": json.dumps(meta)}))

    @classmethod
    def load(cls, path: str | Path, num_experts: int | None = None, top_k: int | None = None,
             num_layers: int | None = None) -> "LearnedPolicy":
        """Read a policy file (tensors + JSON, no code executed); refused if it was fitted on another shape."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise InputError(f"learned policy {path} not found (fit one with `expertcache fit-policy`)")
        try:
            with safe_open(str(path), "np") as f:
                md = f.metadata() or {}
                if md.get("kind") != KIND:
                    raise InputError(f"{path} is not an expertcache learned policy")
                weights = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as e:
            raise InputError(f"{path} is not a readable safetensors file ({e})") from e
        meta = json.loads(md["policy"])
        bad = [k for k, v in weights.items() if not np.isfinite(np.asarray(v, dtype=np.float64)).all()]
        if bad:
            raise InputError(f"{path}: tensor {bad[0]} holds non-finite values (NaN/inf); refit the policy")
        if meta.get("version") != FORMAT_VERSION or tuple(meta.get("features", ())) != FEATURES:
            raise InputError(f"{path}: policy format {meta.get('version')} with features {meta.get('features')} is "
                             f"not the one this version reads ({FORMAT_VERSION}, {list(FEATURES)})")
        meta["path"] = str(path)
        p = cls(weights, meta, num_layers)
        if num_experts is not None or top_k is not None:
            p.check_shape(num_experts if num_experts is not None else p.e, top_k if top_k is not None else p.k,
                          "the model")
        return p

    def describe(self) -> dict:
        return {"policy": "learned", "file": self.meta.get("path"), "fitted_on": self.meta.get("traces"),
                "model": self.meta.get("model")}


# --- fitting -----------------------------------------------------------------------------------------------

def _collect(ids: np.ndarray, probs: np.ndarray | None, e: int, k: int, uses_probs: bool, rng: np.random.Generator,
             rows_per_step: int, max_rank: int):
    """Features and next-use distances of one trace's sampled (step, expert) rows. Rows are the experts a cache
    decides between: the `max_rank` most recently used (always including the step's own), `rows_per_step` of
    them sampled per step."""
    n_l, n_t, _ = ids.shape
    probe = LearnedPolicy({"mu": np.zeros(len(FEATURES)), "sd": np.ones(len(FEATURES))},
                          {"num_experts": e, "top_k": k, "depth": 0, "uses_probs": uses_probs}, n_l)
    xs, ds = [], []
    for layer in range(n_l):
        dist = next_use_distance(ids[layer], e)
        probe.reset()
        for t in range(n_t):
            up = ids[layer - 1, t] if layer > 0 else None
            f = probe._feat(layer, ids[layer, t], up, None if probs is None else probs[layer, t])
            cand = np.argsort(f[:, 1], kind="stable")[:max_rank]  # most recent first (used now: recency 0)
            pick = rng.choice(cand, size=min(rows_per_step, len(cand)), replace=False)
            xs.append(f[pick])
            ds.append(dist[t, pick])
    return np.concatenate(xs), np.concatenate(ds)


def fit(traces: list[str | Path], hidden: int = 32, epochs: int = 4, rows_per_step: int = 8, max_rank: int = 48,
        seed: int = 0, phase: str | None = "decode", log=None, use_probs: bool = True) -> LearnedPolicy:
    """Fit a policy on one or more traces of one model (same num_experts and top_k). Router probabilities are a
    feature when every trace has them and `use_probs`; a policy fitted with them should be given them at serving
    time too (`policy(pos, hidden, ids, probs)`): without, each chosen expert counts 1/k."""
    import torch

    t0 = time.perf_counter()
    data, shape, names = [], None, []
    from .routing import load_routing

    for p in traces:
        r = load_routing(p, phase)
        ids, probs, meta = r.ids, r.probs, r.meta
        s = (meta["num_experts"], meta["top_k"])
        if shape is not None and s != shape[:2]:
            raise InputError(f"trace {p} routes {s[0]} experts top-{s[1]}; {traces[0]} routes {shape[0]} top-{shape[1]}:"
                             f" one policy fits one model's shape")
        shape = (*s, meta["num_layers"], meta["model"])
        data.append((ids, probs))
        names.append({"path": str(p), "model": meta["model"], "layers": int(ids.shape[0]), "tokens": int(ids.shape[1])})
    if not data:
        raise InputError("fit-policy needs at least one trace")
    e, k, n_l, model = shape
    uses_probs = use_probs and all(pr is not None for _, pr in data)
    rng = np.random.default_rng(seed)
    xs, ds = zip(*(_collect(ids, pr, e, k, uses_probs, rng, rows_per_step, max_rank) for ids, pr in data))
    x, d = np.concatenate(xs), np.concatenate(ds)
    if log:
        log(f"{len(x)} rows of features in {time.perf_counter() - t0:.1f}s")
    mu, sd = x.mean(0), x.std(0)
    sd = np.where(sd > 1e-8, sd, 1.0)
    y = (d[:, None] <= np.asarray(HORIZONS)[None, :]).astype(np.float32)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(len(FEATURES), hidden), torch.nn.ReLU(),
                              torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, len(HORIZONS)))
    xt = torch.tensor((x - mu) / sd, dtype=torch.float32)
    yt = torch.tensor(y)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    n, bs = len(xt), 4096
    epochs = max(epochs, -(-400 // -(-n // bs)))  # at least 400 optimizer steps (small traces)
    steps = epochs * ((n + bs - 1) // bs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    lossf = torch.nn.BCEWithLogitsLoss()
    for ep in range(epochs):
        perm = torch.randperm(n)
        tot = 0.0
        for i in range(0, n, bs):
            j = perm[i:i + bs]
            loss = lossf(net(xt[j]), yt[j])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            tot += loss.item() * len(j)
        if log:
            log(f"epoch {ep + 1}/{epochs}: loss {tot / n:.4f} ({time.perf_counter() - t0:.1f}s)")
    lin = [m for m in net if isinstance(m, torch.nn.Linear)]
    weights = {"mu": mu, "sd": sd}
    for i, m in enumerate(lin):
        weights[f"w{i}"] = m.weight.detach().double().numpy().T.copy()
        weights[f"b{i}"] = m.bias.detach().double().numpy().copy()
    meta = {"kind": KIND, "version": FORMAT_VERSION, "model": model, "num_experts": e, "top_k": k,
            "num_layers": n_l, "traces": names, "features": list(FEATURES), "ema_rates": list(EMA_RATES),
            "horizons": list(HORIZONS), "uses_probs": uses_probs, "depth": len(lin), "hidden": hidden,
            "target": "ordinal next-use distance: P(next use <= h) for h in horizons; score = their sum",
            "rows": {"per_step": rows_per_step, "max_recency_rank": max_rank, "total": int(len(x))},
            "epochs": epochs, "seed": seed, "fit_seconds": round(time.perf_counter() - t0, 1)}
    return LearnedPolicy(weights, meta, n_l)


# --- simulation --------------------------------------------------------------------------------------------

def simulate_learned(policy: LearnedPolicy, ids: np.ndarray, capacities: list[int], probs: np.ndarray | None = None,
                     budget: str | tuple[str, ...] = "layer", progress=None) -> dict:
    """Hits of the learned policy over a trace's `ids [L, T, k]` (token semantics, the scored policy), for each
    capacity C per layer: `budget` ``layer`` (one cache of C per layer, hits summed) or ``global`` (one cache of
    C x L keys), or a tuple of both. Returns `{C: {"hits", "accesses", "hit_rate"}}` (for a tuple:
    `{budget: that}`).

    Every cache advances token by token together (`simkernels.bank_token`); each token's features are computed
    for every layer at once, and the MLP only for the keys some cache can read at that token (its resident keys
    and the token's own: `bank_needed`), in one matrix product: a small cache scores a fraction of E."""
    from .cache import check_slots
    from .cachesim import LEARNED, CacheResult, _check

    budgets = (budget,) if isinstance(budget, str) else tuple(budget)
    for b in budgets:
        if b not in ("layer", "global"):
            raise InputError(f"budget={b!r}; expected layer or global")
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise InputError(f"ids must be [layers, tokens, k], got shape {ids.shape}")
    _check(ids.reshape(-1, ids.shape[2]), 1, "lru", "token")  # distinct non-negative experts per row
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if (ids.size and int(ids.max()) >= policy.e) or ids.shape[2] != policy.k:
        policy.check_shape(max(policy.e, int(ids.max()) + 1), ids.shape[2])
    n_l, n_t, k = ids.shape
    e = policy.e
    policy.num_layers = n_l
    probs = np.asarray(probs, np.float64) if policy.uses_probs and probs is not None else None
    cfg = ([("layer", c, (l, l + 1), c) for c in capacities for l in range(n_l)] if "layer" in budgets else []) + \
          ([("global", c, (0, n_l), c * n_l) for c in capacities] if "global" in budgets else [])
    for *_, cap in cfg:
        check_slots(cap)
    n_c = len(cfg)
    blocks = np.asarray([b for _, _, b, _ in cfg], np.int64).reshape(n_c, 2)
    caps = np.asarray([cap for *_, cap in cfg], np.int64)
    res = np.zeros((n_c, n_l * e), np.bool_)
    rank = np.zeros((n_c, n_l * e), np.int64)
    bmin = np.full((n_c, n_l), -1, np.int64)
    state = np.zeros((n_c, 3), np.int64)
    st, mlp, tie = policy._batched(n_l, k)
    feats = np.empty((n_l, e, len(FEATURES)))
    need = np.zeros((n_l, e), np.bool_)
    cur, prev = np.full((n_l, e), np.nan), np.full((n_l, e), -np.inf)
    with _one_blas_thread():  # a few thousand rows per product: threads cost more than they give
        _bank_loop(policy, ids, probs, st, mlp, tie, feats, need, cur, prev, blocks, caps, res, rank, bmin, state,
                   progress)
    results: dict = {}
    for (b, c, blk, cap), (_, steps, h) in zip(cfg, state.tolist()):
        acc = n_t * k * (blk[1] - blk[0])
        results.setdefault((b, c), []).append(CacheResult(LEARNED, cap, "token", steps, acc, h, acc - h))
    out = {b: {} for b in budgets}
    for (b, c), rs in results.items():
        tot = CacheResult.total(rs)
        out[b][c] = {"hits": tot.hits, "accesses": tot.accesses, "hit_rate": tot.hit_rate}
    return out[budget] if isinstance(budget, str) else out


def _bank_loop(policy, ids, probs, st, mlp, tie, feats, need, cur, prev, blocks, caps, res, rank, bmin, state,
               progress) -> None:
    from . import simkernels as sk

    n_t = ids.shape[1]
    flat = feats.reshape(-1, feats.shape[-1])
    for t in range(n_t):
        ids_t = np.ascontiguousarray(ids[:, t])
        policy._features(st, ids_t, None if probs is None else np.ascontiguousarray(probs[:, t]), t, feats)
        sk.bank_needed(ids_t, blocks, res, need)
        rows = np.flatnonzero(need)
        cur.flat[rows] = mlp(flat[rows]) + tie.flat[rows]
        sk.bank_token(ids_t, cur, prev, blocks, caps, res, rank, bmin, state)
        cur, prev = prev, cur  # the rows of `prev` not written at token t are never read at t + 1
        if progress and ((t + 1) % 256 == 0 or t + 1 == n_t):
            progress(t + 1, n_t)


def _one_blas_thread():
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # not installed: BLAS keeps its own setting
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")
