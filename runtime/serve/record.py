"""`expertcache trace record`: telemetry's recorder, on the checkpoint read whole or, with `--offload true` (or any
`--engine.*` option), through the offload engine (`load()`): only the non-expert weights in memory, each routed
expert read through the tiers into a cache of `--engine.capacity` experts per layer, so a checkpoint bigger than
memory can be recorded (hidden states included, for `train-cache-aware --recipe aux-only` from a trace)."""

from __future__ import annotations

from typing import Literal, Optional

from expertcache.runtime.engine.config import EngineConfig

Split = Literal["train", "validation", "test"]


def trace_record(model: str, out: str, corpus: str = "data/corpus", tokenizer: Optional[str] = None,
                 split: Split = "test", prompt_len: int = 128, decode_tokens: int = 64, batch_size: int = 8,
                 max_seqs: int = 16, domains: Optional[list[str]] = None, hidden: bool = False,
                 logits: bool = False, prompts: Optional[str] = None, field: str = "text", domain: str = "prompts",
                 max_prompts: int = 0, dtype: str = "auto", offload: bool = False,
                 engine: EngineConfig = EngineConfig()) -> dict:
    """Record every MoE layer's routing of a checkpoint (prefill, then greedy decode) on held-out corpus blocks,
    or on your own prompts (--prompts FILE); with --offload true through the offload engine (a checkpoint bigger
    than memory).

    Args:
        model: HF checkpoint directory (e.g. runs/base-tiny/model)
        out: Parquet trace to write
        corpus: corpus folder (`expertcache data build`)
        tokenizer: tokenizer folder (default: the checkpoint's own)
        split: corpus split the blocks come from
        prompt_len: prefill tokens per sequence
        decode_tokens: greedy decode steps per sequence (model.generate)
        batch_size: sequences per forward
        max_seqs: sequences per domain
        domains: corpus domains to record (default: every domain)
        hidden: also record the hidden state entering each MoE layer (lookahead recall, router training)
        logits: also record the router logits
        prompts: your own prompts, recorded instead of the corpus: a folder of a local `datasets` dataset
            (save_to_disk; FOLDER:SPLIT picks a split; the prompt in column --field), .jsonl (the prompt under
            --field) or text (one prompt per non-empty line); each is cut to --prompt_len tokens and decoded --decode_tokens
        field: with a .jsonl or dataset --prompts: the field (column) holding the prompt
        domain: with --prompts: the domain label of every row
        max_prompts: with --prompts: the first N prompts only (0: all)
        dtype: the dtype the model runs in while recording: auto (the checkpoint's own, as it is served) | fp32 |
            bf16 | fp16; the trace's metadata names it
        offload: record through the offload engine (`expertcache.runtime.load`): the experts stay on
            --engine.tier and pass through a cache of --engine.capacity per layer; any --engine.* option implies it
        engine: how the experts are served with --offload (the same routing as the checkpoint read whole)
    """
    from expertcache.telemetry.commands import record
    from expertcache.telemetry.hf import parse_dtype

    def through_engine():
        from expertcache.runtime.storage.loader import load

        return load(model, dtype=parse_dtype(dtype, "--dtype"), engine=engine)

    # one default: EngineConfig's; a field changed from it asks for the engine as --offload true does
    open_model = through_engine if offload or engine != EngineConfig() else None
    res = record(model, out, corpus, tokenizer, split, prompt_len, decode_tokens, batch_size, max_seqs, domains,
                 hidden, logits, prompts, field, domain, max_prompts, dtype, open_model=open_model)
    return res | {"offload": open_model is not None}
