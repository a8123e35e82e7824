"""The lm-eval model `expertcache`: a checkpoint served by the offload engine, so lm-eval tasks measure the model
as it will be served, not only its weights. Engine options are `EngineConfig` fields given as model args (lm-eval's
own `key=value,...` convention); `served=True` is implied by any of them, and nothing given is the plain model.

    import expertcache   # registers the model name with lm-eval
    lm_eval.simple_evaluate(model="expertcache", model_args={"pretrained": "runs/x/model", "capacity": 0.25,
                            "miss": "reroute", "tau": 0.1}, tasks=[...])

From the command line: `expertcache eval --model runs/x/model --engine.capacity 0.25 --engine.miss reroute`, or
`lm_eval --model local-completions` against `expertcache serve`. `lm_eval --model expertcache` itself fails: lm-eval
offers installed packages no registration (see `expertcache`'s package docstring for the one-line `python -c` that
runs lm-eval's command line with this model registered).

Under a lossy policy every forward lm-eval asks for runs one token at a time through the KV cache (batch 1),
so the expert cache sees tokens in order; lossless policies and the plain model use lm-eval's batched path. With
`accuracy="replay"` (reroute only) the plain model runs lm-eval's batched path with the reroute rule replayed per
document in its routers (`evals.replay`): the same rule, each document from an empty cache, at batched speed.
"""

from __future__ import annotations

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from expertcache.runtime.engine.config import EngineConfig
from expertcache.runtime.kernels.quant import QUANT_METHOD

from expertcache.telemetry.errors import InputError

from .served import open_model, served_engine

ENGINE_FIELDS = set(EngineConfig.__dataclass_fields__) - {"device"}


def engine_from_args(args: dict) -> EngineConfig | None:
    """The `EngineConfig` named by lm-eval model args, or None for plain: `engine`, an `EngineConfig` itself
    (`expertcache eval` hands its resolved configuration on as it is), or its fields as strings (lm-eval's command
    line, `--model_args capacity=0.25,...`), parsed once; not both."""
    given = {k: v for k, v in args.items() if k in ENGINE_FIELDS}
    cfg = args.get("engine")
    if cfg is not None:
        if not isinstance(cfg, EngineConfig):
            raise InputError(f"model_args engine={cfg!r}: expected an EngineConfig (or its fields as model args)")
        if given:
            raise InputError(f"model_args engine=... and engine fields {sorted(given)} both given: one or the other")
        return cfg
    return EngineConfig.from_text(given) if given else None


@register_model("expertcache")
class ExpertCacheLM(HFLM):
    def __init__(self, pretrained: str, batch_size: int = 8, max_length: int = 512, dtype: str = "fp32",
                 device: str = "cpu", accuracy: str = "token", **kwargs):
        from expertcache.runtime.storage.loader import parse_device, resolve
        from expertcache.telemetry.hf import load_tokenizer

        from .replay import ReplayedReroute, check_replayable

        path = resolve(pretrained)
        self.serve = served_engine(path, engine_from_args(kwargs))  # quantized: through the engine
        check_replayable(self.serve, accuracy)
        kwargs = {k: v for k, v in kwargs.items() if k not in ENGINE_FIELDS | {"engine"}}
        self.replay = None
        if accuracy == "replay":  # the plain model, its routers serving as the reroute policy would
            model, self.engine = open_model(path, None, dtype, device)
            self.replay = ReplayedReroute(model, self.serve)
        else:
            model, self.engine = open_model(path, self.serve, dtype, device)
        tok = load_tokenizer(path)
        self.lossy = self.serve is not None and self.serve.lossy and self.replay is None
        bs = 1 if self.lossy else int(batch_size)
        from expertcache.telemetry.hf import context_length

        ctx = context_length(model)  # lm-eval truncates each request to max_length: never past the positions
        # HFLM hands a config's quantization_config to transformers, which knows only its own methods: our
        # packed experts are the engine's to read (already loaded here), so lm-eval does not see the entry
        qc = getattr(model.config, "quantization_config", None)
        ours = isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD
        if ours:
            model.config.quantization_config = None
        try:
            super().__init__(pretrained=model, tokenizer=tok, device=parse_device(device), batch_size=bs,
                             max_length=min(int(max_length), ctx) if ctx else int(max_length), **kwargs)
        finally:
            if ours:
                model.config.quantization_config = qc

    def _model_call(self, inps, attn_mask=None, labels=None):
        if self.replay is not None:
            self.replay.batch = inps.shape[0]  # each row a document, replayed from an empty cache
        if not self.lossy:
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

    def generate_until(self, requests, disable_tqdm: bool = False):
        if self.replay is not None:  # generation's steps are one token each: a per-forward replay would start cold
            raise InputError("--accuracy replay scores loglikelihood tasks (cloze, perplexity); a generation task "
                             "(e.g. ec_math_em) is served token by token: leave it out or use --accuracy token")
        return super().generate_until(requests, disable_tqdm)
