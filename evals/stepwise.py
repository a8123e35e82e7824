"""Token-level perplexity over fixed blocks of held-out text. Two paths give the same figures:
- **token by token** (`stepwise_nll`): each block is fed one token at a time through the KV cache, so a served
  model's expert cache sees the tokens in order, as it would while decoding. Lossy policies (outputs that depend on
  the cache state) are always measured this way, never in one wide batch (METRICS.md);
- **batched** (`batched_nll`): several whole blocks in one causal forward each, for the plain model and lossless
  policies, whose outputs do not depend on the order the cache saw the tokens in. The two paths differ only in the
  floating-point order of the attention sums (`experiments/gate_calibration.py` measures how little).
The same tokens for every model and policy."""

from __future__ import annotations

import math

import numpy as np
import torch

from expertcache.telemetry.errors import InputError


def step(model, token: torch.Tensor, cache):
    """One forward of `token [B, 1]` through `cache` (a DynamicCache, updated in place): the decode loop's own
    forward (`runtime.decode.forward`, where the KV-cache argument's name is handled once)."""
    from expertcache.runtime.serve.decode import forward

    return forward(model, token, cache)


@torch.no_grad()
def stepwise_nll(model, ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL (nats) over `ids [1, T]`, fed one token at a time; and the token count (T-1)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    nll = 0.0
    t = ids.shape[1]
    for j in range(t - 1):
        out = step(model, ids[:, j:j + 1], cache)
        logp = out.logits[0, -1].float().log_softmax(-1)
        nll -= float(logp[ids[0, j + 1]])
    return nll, t - 1


METHODS = ("auto", "token", "batched")
LOGITS_BYTES = 256 << 20  # the batched path's fp32 logits per forward, at most (a row at a time beyond it)


def check_method(method: str, lossy: bool) -> str:
    """The step-wise path to use: `auto` is batched unless the policy is lossy; `batched` under a lossy policy is
    one line (its outputs depend on the order the cache sees the tokens in)."""
    if method not in METHODS:
        raise InputError(f"--stepwise {method!r}; expected one of {', '.join(METHODS)}")
    if method == "batched" and lossy:
        raise InputError("--stepwise batched under a lossy policy: its outputs depend on the order the cache sees the "
                         "tokens in, so it is measured token by token (--stepwise token or auto)")
    return "token" if lossy or method == "token" else "batched"


@torch.no_grad()
def batched_nll(model, rows: np.ndarray):
    """Each row's summed next-token NLL (nats) over `rows [n, T]`, yielded in order, several rows per causal
    forward (no KV cache between forwards): as many rows as keep the fp32 logits under `LOGITS_BYTES`."""
    n, t = rows.shape
    vocab = int(model.get_output_embeddings().out_features)  # (a packed QuantLinear head has no .weight)
    per = max(1, min(n, LOGITS_BYTES // max(1, t * vocab * 4)))
    for i in range(0, n, per):
        ids = torch.from_numpy(rows[i:i + per].astype(np.int64)).to(model.device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        nll = -logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        yield from (float(x) for x in nll.double().sum(1))


def _ppl(nll: float, n: int, dom: str) -> float:
    if not n:
        raise InputError(f"no step-wise tokens in the {dom} blocks (blocks of one token): a larger --seq_len")
    if nll / n > 700:  # exp overflows a double; a model this far off (uniform over 50k tokens is 10.8) is broken
        raise InputError(f"the model's mean step-wise NLL on {dom} is {nll / n:.3g} nats per token: perplexity "
                         f"overflows; corrupted weights?")
    return math.exp(nll / n)


def _rows(model, b: np.ndarray, method: str):
    """(summed NLL, tokens) of each block, in order, by `method`."""
    if method == "batched" and len(b) and b.shape[1] > 1:
        yield from ((x, b.shape[1] - 1) for x in batched_nll(model, b))
        return
    for row in b:
        yield stepwise_nll(model, torch.from_numpy(row[None].astype(np.int64)).to(model.device))


def stepwise_perplexity(model, blocks: dict[str, np.ndarray], progress=None, method: str = "token") -> dict:
    """Per-domain and overall token perplexity over `blocks[domain] [n, T]` (the engine, if any, attached), and
    each block's summed NLL (nats) and token count (`block_nll`, `block_tokens`: the gate's paired intervals).
    `method`: token (one token at a time through the KV cache) | batched (whole blocks per forward; plain models
    and lossless policies only: `check_method`)."""
    if method not in ("token", "batched"):
        raise InputError(f"step-wise method {method!r}; expected token or batched")
    model.eval()
    res, tot_nll, tot_n = {"ppl": {}, "tokens": {}, "block_nll": {}, "block_tokens": {}, "method": method}, 0.0, 0
    for dom, b in blocks.items():
        nll = n = 0
        res["block_nll"][dom], res["block_tokens"][dom] = [], []
        for x, c in _rows(model, b, method):
            if not math.isfinite(x):
                raise InputError(f"the model produced non-finite logits: corrupted weights? (step-wise NLL {x} on a "
                                 f"{dom} block)")
            nll, n = nll + x, n + c
            res["block_nll"][dom].append(x)
            res["block_tokens"][dom].append(c)
            if progress:
                progress()
        res["ppl"][dom] = _ppl(nll, n, dom)
        res["tokens"][dom] = n
        tot_nll, tot_n = tot_nll + nll, tot_n + n
    if not tot_n:
        raise InputError("no step-wise tokens to measure (every block empty): a larger split or a smaller --seq_len")
    res["ppl"]["overall"] = _ppl(tot_nll, tot_n, "overall")
    res["tokens"]["overall"] = tot_n
    return res
