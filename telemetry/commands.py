"""Telemetry's commands: plain typed functions; `expertcache` builds its command line from their signatures and
docstrings (expertcache.recipes.cli). Each returns what it reports (printed as JSON by the CLI)."""

from __future__ import annotations

import sys
from typing import Literal, Optional

from .errors import InputError

Split = Literal["train", "validation", "test"]
Phase = Literal["decode", "prefill", "all"]


def record(model: str, out: str, corpus: str = "data/corpus", tokenizer: Optional[str] = None,
           split: Split = "test", prompt_len: int = 128, decode_tokens: int = 64, batch_size: int = 8,
           max_seqs: int = 16, domains: Optional[list[str]] = None, hidden: bool = False,
           logits: bool = False, prompts: Optional[str] = None, field: str = "text", domain: str = "prompts",
           max_prompts: int = 0, dtype: str = "auto", open_model=None) -> dict:
    """`expertcache trace record`'s work (the command is `runtime/serve/record.py: trace_record`, which can record
    through the offload engine), its arguments checked first; `open_model`: a callable returning the model to record
    instead of the whole checkpoint read into memory (the runtime's `trace record --offload true` passes `load()`)."""
    from .atomic import check_output
    from .recorder import DTYPES, read_prompts, record_corpus, record_prompts

    check_output(out, model)
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    if prompts is not None:
        for name, v in (("prompt_len", prompt_len), ("decode_tokens", decode_tokens)):
            if v < 1:
                raise InputError(f"{name}={v}; expected >= 1")
        if max_prompts < 0:
            raise InputError(f"max_prompts={max_prompts}; expected >= 0 (0: all)")
        texts = read_prompts(prompts, field, max_prompts)
        return record_prompts(model, texts, out, prompt_len, decode_tokens, domain, hidden, logits, dtype,
                              source=str(prompts), open_model=open_model)
    from .corpus import DOMAINS

    unknown = [d for d in domains or [] if d not in DOMAINS]
    if unknown or domains == []:
        raise InputError(f"--domains {domains}: expected some of {', '.join(DOMAINS)}")
    for name, v in (("prompt_len", prompt_len), ("decode_tokens", decode_tokens), ("batch_size", batch_size),
                    ("max_seqs", max_seqs)):
        if v < 1:
            raise InputError(f"{name}={v}; expected >= 1")
    return record_corpus(model, corpus, tokenizer, split, out, prompt_len, decode_tokens, batch_size, max_seqs,
                         domains, hidden, logits, dtype, open_model)


def trace_import(src: str, out: str, num_experts: Optional[int] = None, domain: str = "",
                 model_name: str = "") -> dict:
    """Convert a llama.cpp `llama-moe-trace` stream (binary, or its .npz form) into a Parquet trace.

    Args:
        src: .npz (experts [layers, tokens, k] + meta) or the binary eval-callback stream
        out: Parquet trace to write
        num_experts: experts per layer (needed for the binary stream)
        domain: domain label of every token
        model_name: model id for the trace's metadata
    """
    from .atomic import check_output
    from .llamacpp import import_trace

    check_output(out, src)
    return import_trace(src, out, num_experts, domain, model_name)


def trace_info(trace: str) -> dict:
    """A trace's metadata and counts.

    Args:
        trace: Parquet trace
    """
    from .parquet_trace import info

    return info(trace)


def analyze(trace: str, out: str, model: Optional[str] = None, phase: Phase = "decode",
            semantics: Literal["token", "reference"] = "token", static_fit: Optional[str] = None,
            domains: bool = True, policy_file: Optional[str] = None, overwrite: bool = False) -> dict:
    """Reuse, coverage, hit-rate curves against the Belady bound and lookahead recall of a trace; JSON, text, plots.

    Args:
        trace: Parquet trace (`expertcache trace record` or `trace import`)
        out: folder for summary.json, summary.txt and the PNG plots
        model: HF checkpoint: adds lookahead recall (the trace needs --hidden)
        phase: tokens to analyse (METRICS.md: decode)
        semantics: token (a token's k experts resident together: an engine's view) | reference (the published
            simulator's sequential accesses)
        static_fit: fit the static policy's pins on this trace (e.g. the validation split)
        domains: also break the figures down by domain
        policy_file: a learned eviction policy (`expertcache fit-policy`): adds its rows to the hit curves
        overwrite: replace an earlier `analyze` output in --out (a folder of anything else is never written)
    """
    from .analysis import analyze as run, text_summary
    from .atomic import atomic_dir, check_output

    check_output(out, trace, static_fit, policy_file, model, folder=True, command="analyze", overwrite=overwrite,
                 legacy=_analysis_folder)
    # written whole: an interrupted analysis leaves the earlier one as it was, never a new summary.json beside
    # an older run's plots
    with atomic_dir(out, command="analyze", overwrite=overwrite, legacy=_analysis_folder) as tmp:
        s = run(trace, tmp, model_dir=model, phase=None if phase == "all" else phase, semantics=semantics,
                fit_trace=static_fit, by_domain=domains, policy_file=policy_file)
    print(text_summary(s), file=sys.stderr)
    return {k: s[k] for k in ("trace", "model", "num_experts", "top_k", "moe_layers", "phase", "capacities")} | \
        {"out": out, "files": ["summary.json", "summary.txt", "hit_rate.png", "reuse_coverage.png"]}


def _analysis_folder(p) -> bool:
    """An `analyze` output from before output markers: summary.json and nothing but what analyze writes."""
    return (p / "summary.json").is_file() and all(
        f.suffix in (".json", ".txt", ".png", ".yaml") and f.is_file() for f in p.iterdir())


def fit_policy(trace: list[str], out: str, phase: Phase = "decode", hidden: int = 32, epochs: int = 4,
               seed: int = 0, probs: bool = True) -> dict:
    """Fit a learned eviction policy (keep scores from online features, supervised by the traces' future).

    Args:
        trace: Parquet traces or llama-moe-trace .npz files, all of one model
        out: policy file to write (safetensors + JSON metadata); use it as `--engine.policy learned:FILE`
        phase: Parquet traces: the tokens to fit on (a trace without them: every token)
        hidden: MLP width
        epochs: passes over the traces
        seed: initialisation and shuffling seed
        probs: use the traces' router probabilities as a feature (false: for an engine that passes expert ids only)
    """
    import os

    import torch

    from .learned_policy import fit

    from .atomic import check_output

    if hidden < 1 or epochs < 1:
        raise InputError("hidden and epochs must be >= 1")
    if not trace:
        raise InputError("--trace is empty; expected a list of traces, e.g. [t.parquet]")
    check_output(out, trace)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    pol = fit(trace, hidden=hidden, epochs=epochs, seed=seed, phase=None if phase == "all" else phase,
              log=lambda m: print(m, file=sys.stderr), use_probs=probs)
    pol.save(out)
    return {"policy": out, **{k: pol.meta[k] for k in ("model", "num_experts", "top_k", "num_layers", "traces",
                                                       "uses_probs", "rows", "fit_seconds")}}
