"""Token-level perplexity, step by step: each block is fed one token at a time through the KV cache, so a served
model's expert cache sees the tokens in order, as it would while decoding (METRICS.md: lossy policies are
measured this way, never in one wide batch). The same tokens for every model and policy."""

from __future__ import annotations

import math

import numpy as np
import torch

from expertcache.telemetry.errors import InputError


def step(model, token: torch.Tensor, cache):
    """One forward of `token [B, 1]` through `cache` (a DynamicCache, updated in place): the decode loop's own
    forward (`runtime.decode.forward`, where the KV-cache argument's name is handled once)."""
    from expertcache.runtime.decode import forward

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


def _ppl(nll: float, n: int, dom: str) -> float:
    if not n:
        raise InputError(f"no step-wise tokens in the {dom} blocks (blocks of one token): a larger --seq_len")
    if nll / n > 700:  # exp overflows a double; a model this far off (uniform over 50k tokens is 10.8) is broken
        raise InputError(f"the model's mean step-wise NLL on {dom} is {nll / n:.3g} nats per token: perplexity "
                         f"overflows; corrupted weights?")
    return math.exp(nll / n)


def stepwise_perplexity(model, blocks: dict[str, np.ndarray], progress=None) -> dict:
    """Per-domain and overall token perplexity over `blocks[domain] [n, T]` (the engine, if any, attached), and
    each block's summed NLL (nats) and token count (`block_nll`, `block_tokens`: the gate's paired intervals)."""
    model.eval()
    res, tot_nll, tot_n = {"ppl": {}, "tokens": {}, "block_nll": {}, "block_tokens": {}}, 0.0, 0
    for dom, b in blocks.items():
        nll = n = 0
        res["block_nll"][dom], res["block_tokens"][dom] = [], []
        for row in b:
            x, c = stepwise_nll(model, torch.from_numpy(row[None].astype(np.int64)).to(model.device))
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
