"""Loading a HF checkpoint folder with transformers, its failures as one `InputError` naming the folder."""

from __future__ import annotations

from pathlib import Path

from .errors import InputError


# the one map of the compute dtypes a command takes (`--dtype`, `dtype=`): None = the checkpoint's own
DTYPE_NAMES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}


def parse_dtype(dtype, flag: str = "dtype"):
    """A `torch.dtype` (None for auto: the checkpoint's own) from a name in `DTYPE_NAMES` or a torch.dtype; an
    `InputError` naming `flag` and the names it takes for anything else."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
        raise InputError(f"{flag} {dtype!r}; expected one of {', '.join(DTYPE_NAMES)}")
    name = DTYPE_NAMES[dtype]
    return None if name is None else getattr(torch, name)


def load_tokenizer(path: str | Path):
    """The tokenizer of a checkpoint or tokenizer folder (`tokenizer.json` or `tokenizer_config.json`), or one
    InputError."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise InputError(f"no tokenizer at {path} (expected {path / 'tokenizer.json'}); "
                         f"build one with `expertcache data build`")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"tokenizer {path} does not load ({type(e).__name__}: {str(e)[:120]})") from None


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer a GGUF file's metadata describes (transformers' GGUF conversion; needs the `gguf` package), or
    one InputError."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        try:
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except ValueError as e:
            if "is not supported yet" not in str(e):
                raise
            # an architecture transformers maps no config for (OLMoE): the tokenizer from its metadata alone
            from transformers import TokenizersBackend
            from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

            arch, vocab, tok_config = get_gguf_tokenizer(str(path))
            backend, extra = convert_gguf_tokenizer(arch, vocab)
            return TokenizersBackend(tokenizer_object=backend, **tok_config, **extra)
    except Exception as e:  # noqa: BLE001 - the file's tokenizer metadata is not one transformers converts
        raise InputError(f"--gguf {path}: its tokenizer could not be converted ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:120]})") from None


def _checkpoint_dir(path: str | Path) -> Path:
    """`path` (`~` expanded) as a checkpoint folder, or one InputError: a folder without config.json, or a path that
    names no folder here and cannot be a hub id either (absolute, ./ or ../, or more than one `/`), where
    transformers would say "Repo id must be in the form 'repo_name' ..."."""
    p = Path(path).expanduser()
    text = str(p)
    if not p.exists():
        if text.startswith(("/", "./", "../", "~")) or text.count("/") > 1:
            raise InputError(f"no HF checkpoint at {text}: no such folder")
    elif not (p / "config.json").is_file():
        raise InputError(f"no HF checkpoint at {p} (expected {p / 'config.json'})")
    return p


def load_config(path: str | Path):
    """A checkpoint's `config.json` as a transformers config, or one InputError naming the folder."""
    import json

    from transformers import AutoConfig

    p = _checkpoint_dir(path)
    try:
        return AutoConfig.from_pretrained(str(p))
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise InputError(f"checkpoint {p}: config.json does not load ({type(e).__name__}: {str(e)[:120]})") from None


def load_generation_config(path: str | Path):
    """The checkpoint's `generation_config.json` (sampling defaults), None where it has none; InputError if it does
    not parse."""
    from transformers import GenerationConfig

    if not (Path(path) / "generation_config.json").is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise InputError(f"{path}/generation_config.json: {str(e)[:160]}") from None


def load_causal_lm(path: str | Path, **kwargs):
    """`AutoModelForCausalLM.from_pretrained` of a local checkpoint folder (or a cached hub id). Refused, as an
    InputError naming the folder: no config.json, a config that does not parse, weights that are truncated, not
    safetensors or unreadable, and weights that do not fit the config (a tensor missing or of another shape, which
    transformers would otherwise initialise at random)."""
    import json

    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    p = _checkpoint_dir(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(p), output_loading_info=True, **kwargs)
    except InputError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError, json.JSONDecodeError) as e:
        why = (str(e).strip().splitlines() or [""])[0][:160]
        raise InputError(f"checkpoint {p} does not load ({type(e).__name__}: {why})") from None
    bad = [(kind, info.get(kind)) for kind in ("missing_keys", "mismatched_keys") if info.get(kind)]
    if bad:
        kind, keys = bad[0]
        first = sorted(keys)[0] if not isinstance(keys, (list, tuple)) else keys[0]
        raise InputError(f"checkpoint {p}: its weights do not fit its config ({len(keys)} {kind.replace('_', ' ')},"
                         f" e.g. {first if isinstance(first, str) else first[0]})")
    try:  # transformers takes a tensor's saved shape over its config's: a config that lies loads "fine"
        from .adapters import adapter_for

        a = adapter_for(model)
        rows = {int(L.router.weight.shape[0]) for L in a.moe_layers(model)}
    except (InputError, AttributeError, ValueError):
        return model  # not a family the telemetry reads: nothing more to check here
    if rows != {a.num_experts}:
        raise InputError(f"checkpoint {p}: its config says {a.num_experts} experts per layer, its router weights "
                         f"have {sorted(rows)}")
    return model


def context_length(model_or_config) -> int | None:
    """The positions a model knows (`max_position_embeddings` of its text config), or None when it says none."""
    cfg = getattr(model_or_config, "config", model_or_config)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def check_context(model_or_config, prompt_tokens: int, new_tokens: int, prompt_what: str = "the prompt",
                  new_what: str = "max_tokens") -> None:
    """Every decode path, before any work: the prompt and the tokens to generate within the model's positions
    (past them RoPE tables and caches run on positions the model never saw)."""
    ctx = context_length(model_or_config)
    if ctx is None or prompt_tokens + new_tokens <= ctx:
        return
    if not new_tokens:  # a block scored, nothing decoded
        raise InputError(f"this model's context is {ctx} positions: {prompt_what} has {prompt_tokens} tokens")
    left = max(0, ctx - prompt_tokens)
    raise InputError(f"this model's context is {ctx} positions: {prompt_what} has {prompt_tokens} tokens and "
                     f"{new_what}={new_tokens} asks for {prompt_tokens + new_tokens} (at most {left} new tokens "
                     f"fit{'' if left else '; shorten the prompt'})")
