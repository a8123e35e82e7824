"""The lm-eval model `expertcache`: a checkpoint served under a runtime policy, so lm-eval tasks measure the model
as it will be served, not only its weights.

    lm_eval.simple_evaluate(model="expertcache", model_args={"pretrained": "runs/x/model",
                            "policy": "capacity=0.25,miss=reroute,tau=0.1"}, tasks=[...])

Under a lossy policy every forward lm-eval asks for runs one token at a time through the KV cache (batch 1),
so the expert cache sees tokens in order; lossless policies and the plain model use lm-eval's batched path.
"""

from __future__ import annotations

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .policy import open_model, parse_policy


@register_model("expertcache")
class ExpertCacheLM(HFLM):
    def __init__(self, pretrained: str, policy: str = "", batch_size: int = 8,
                 max_length: int = 512, dtype: str = "fp32", device: str = "cpu", **kwargs):
        from transformers import AutoTokenizer

        from expertcache.runtime.loader import parse_device, resolve

        path = resolve(pretrained)
        self.serve = parse_policy(policy)
        model, self.engine = open_model(path, self.serve, dtype, device)
        tok = AutoTokenizer.from_pretrained(str(path))
        bs = 1 if self.serve.lossy else int(batch_size)
        super().__init__(pretrained=model, tokenizer=tok, device=parse_device(device), batch_size=bs,
                         max_length=int(max_length), **kwargs)

    def _model_call(self, inps, attn_mask=None, labels=None):
        if not self.serve.lossy:
            return super()._model_call(inps, attn_mask, labels)
        from transformers import DynamicCache

        from .stepwise import step

        outs = []
        with torch.no_grad():
            for row in inps:  # [T] each; one token at a time, the cache in order
                cache = DynamicCache()
                logits = [step(self.model, row[None, j:j + 1], cache).logits[0, -1] for j in range(row.shape[0])]
                outs.append(torch.stack(logits))
        return torch.stack(outs)
