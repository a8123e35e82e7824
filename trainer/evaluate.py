"""Held-out perplexity per domain and per-layer expert-usage entropy of a HF MoE LM."""

from __future__ import annotations

import math

import numpy as np
import torch

from expertcache.telemetry.corpus import DOMAINS, packed_blocks
from expertcache.telemetry.errors import InputError


def check_vocab(tokenizer, config) -> None:
    """A tokenizer whose ids exceed the model's embedding table would index out of range deep in the forward."""
    if len(tokenizer) > config.vocab_size:
        raise InputError(f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {config.vocab_size}; "
                         f"they come from different builds (retrain the model with this tokenizer or pass the "
                         f"tokenizer it was trained with)")


@torch.no_grad()
def evaluate_lm(model, corpus: str, tokenizer: str, split: str = "validation", seq_len: int = 256,
                max_blocks: int = 64, batch_size: int = 8) -> dict:
    """Token perplexity per domain and overall (the token NLL alone, no auxiliary loss), each block's summed NLL
    and token count (`block_nll`, `block_tokens`: the end-of-run gate's paired intervals), and expert-usage
    entropy per layer (nats, and / ln E)."""
    model.eval()
    from expertcache.telemetry.adapters import adapter_for

    adapter = adapter_for(model)
    num_experts = adapter.num_experts
    counts = None  # [layers, E] selections
    result = {"split": split, "seq_len": seq_len, "ppl": {}, "tokens": {}, "block_nll": {}, "block_tokens": {}}
    tot_nll, tot_n = 0.0, 0
    for dom in DOMAINS:
        blocks = packed_blocks(corpus, tokenizer, split, dom, seq_len)
        if not len(blocks):
            continue
        idx = np.linspace(0, len(blocks) - 1, min(max_blocks, len(blocks))).astype(int)
        nll, n = 0.0, 0
        result["block_nll"][dom], result["block_tokens"][dom] = [], []
        for i in range(0, len(idx), batch_size):
            ids = torch.from_numpy(blocks[idx[i:i + batch_size]].astype(np.int64))
            # no labels: HF's MoE loss adds router_aux_loss_coef x the load-balancing loss to the token NLL
            out = model(input_ids=ids, output_router_logits=True, use_cache=False)
            row = torch.nn.functional.cross_entropy(out.logits[:, :-1].float().transpose(1, 2), ids[:, 1:],
                                                    reduction="none").double().sum(1)  # [B] summed NLL per block
            result["block_nll"][dom] += [float(x) for x in row]
            result["block_tokens"][dom] += [ids.shape[1] - 1] * ids.shape[0]
            nll += float(row.sum())
            n += ids[:, 1:].numel()
            sel = torch.stack([adapter.route(lg)[0] for lg in out.router_logits])  # [layers, tokens, k]
            c = torch.nn.functional.one_hot(sel, num_experts).sum(dim=(1, 2))  # [layers, E]
            counts = c if counts is None else counts + c
        result["ppl"][dom] = math.exp(nll / n)
        result["tokens"][dom] = n
        tot_nll, tot_n = tot_nll + nll, tot_n + n
    result["ppl"]["overall"] = math.exp(tot_nll / tot_n)
    p = counts.double() / counts.sum(dim=1, keepdim=True)
    ent = -(p * p.clamp_min(1e-12).log()).sum(dim=1)  # [layers] nats
    result["expert_entropy"] = [round(float(e), 4) for e in ent]
    result["expert_entropy_frac_of_max"] = [round(float(e) / math.log(num_experts), 4) for e in ent]
    result["max_entropy"] = math.log(num_experts)
    return result
