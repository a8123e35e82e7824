"""`load`: a HF MoE checkpoint that need not fit in memory, ready to `generate` through the offload engine.

    from expertcache.runtime import load
    model = load("Qwen/Qwen3-30B-A3B", capacity=0.125)   # or a local directory; the tier: what fits (auto)
    model.generate(...)                                                # through the engine
    model.expertcache.stats                                             # hit rate, traffic, stall

The model is built on the meta device; only the non-expert weights (attention, norms, routers, embeddings,
shared experts) are read into memory, from the checkpoint's own safetensors files. The routed experts are never
materialised: the engine reads each one by byte range when it is needed (`checkpoint.CheckpointExperts`), in the
checkpoint's dtype unless `dtype=` says otherwise. Nothing here executes code from the checkpoint: safetensors
only, no `trust_remote_code`.
"""

from __future__ import annotations

import gc
import os
from dataclasses import replace
from pathlib import Path

import torch

from expertcache.telemetry.errors import InputError

from expertcache.runtime.storage.checkpoint import Checkpoint, CheckpointExperts, checkpoint_name
from expertcache.runtime.engine.config import EngineConfig
from expertcache.runtime.engine.engine import OffloadEngine
from expertcache.runtime.storage.weight_checks import INTEGRITY_DEFAULT, check_integrity, check_weights, max_abs

from expertcache.telemetry.hf import DTYPE_NAMES as DTYPES, parse_dtype  # noqa: E402,F401 - the one dtype map


def parse_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise InputError(f"device {device!r}; expected auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("device cuda asked for, but torch sees no CUDA GPU here (use --engine.device cpu; for eval "
                         "--device cpu or auto)")
    return device


def resolve(model: str | Path, revision: str | None = None) -> Path:
    """A local checkpoint directory, or a hub id resolved through the Hugging Face cache (downloads only when
    `HF_HUB_OFFLINE` is unset; the project's Makefile sets it to 1)."""
    p = Path(model).expanduser()
    if p.exists():
        if not p.is_dir():
            raise InputError(f"model {p} is a file; expected a checkpoint directory (config.json + safetensors)")
        if not (p / "config.json").is_file():
            raise InputError(f"{p} has no config.json: not a Hugging Face checkpoint directory")
        return p
    s = str(model)
    parts = s.split("/")
    if s.startswith((".", "/", "~")) or len(parts) != 2 or not all(parts):
        raise InputError(f"model {s!r} not found: neither a local directory nor a hub id (org/name)")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(s, revision=revision, local_files_only=offline,
                                      allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja",
                                                      "tokenizer*"]))
    except Exception as e:  # noqa: BLE001 - every hub failure is the same bad input: the id cannot be had
        why = "downloads are off (HF_HUB_OFFLINE=1) and it is not in the local cache" if offline else \
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise InputError(f"hub model {s!r} cannot be opened: {why}") from None


def _meta_model(config, dtype: torch.dtype):
    """The model's skeleton: parameters on the meta device (no memory), buffers (RoPE tables) real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _skeleton(path: Path, dtype):
    """`(checkpoint, config, adapter, meta model, expert-module prefixes, expert params)` of the checkpoint at
    `path`: its config read, the model built on the meta device (no weight read)."""
    from expertcache.telemetry.adapters import adapter_for
    from expertcache.telemetry.hf import load_config

    ckpt = Checkpoint(path)
    config = load_config(path)
    adapter = adapter_for(config)
    model = _meta_model(config, dtype or torch.float32)
    layers = adapter.moe_layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = [names[id(L.experts)] for L in layers]
    params = {n: (list(p.shape[1:]), p.dtype) for n, p in layers[0].experts.named_parameters(recurse=False)}
    return ckpt, config, adapter, model, prefixes, params


def expert_source(path: str | Path, dtype=None) -> CheckpointExperts:
    """Where each routed expert's bytes lie in the checkpoint at `path` (its config read, the model built on the
    meta device only: no weight is read). For `verify` and tools that walk every expert."""
    ckpt, _, adapter, _, prefixes, params = _skeleton(Path(path), parse_dtype(dtype))
    return CheckpointExperts(ckpt, adapter.family, prefixes, adapter.num_experts, params, "", parse_dtype(dtype))


def build_offloaded(path: str | Path, dtype=None, verify: bool | None = None, integrity: str = INTEGRITY_DEFAULT,
                    off: str = "--engine.integrity off"):
    """`(model, source)`: the model with its non-expert weights read and its experts' modules still on meta,
    and where each expert's bytes lie. The engine (attached by `load`) replaces those modules. `verify`: check
    each expert read against the checkpoint's checksum index (`CheckpointExperts.use_index`); `integrity` on: the
    weights read pass `weight_checks.check_weights` (`off`: the option that turns that off, for the message)."""
    from expertcache.telemetry.adapters import router_fingerprint

    from expertcache.runtime.kernels import qlinear, quant
    path = Path(path)
    dtype = asked = parse_dtype(dtype)
    qc = quant.read_config(path)  # a checkpoint of `expertcache quantize`: experts in its store file
    if qc is not None and dtype is None:
        from expertcache.telemetry.hf import load_config

        cfg = load_config(path)
        dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.bfloat16
        dtype = parse_dtype(str(dtype).removeprefix("torch.")) if not isinstance(dtype, torch.dtype) else dtype
    ckpt, config, adapter, model, prefixes, params = _skeleton(path, dtype)
    if qc is not None and asked is not None:
        _check_store_dtype(path, ckpt, adapter, model, asked)
    if dtype is None:  # the checkpoint's own dtype (of its experts), for the whole model, as from_pretrained(auto)
        probe = CheckpointExperts(ckpt, adapter.family, prefixes[:1], adapter.num_experts, params, "")
        dtype = probe.dtype
        model = _meta_model(config, dtype)
    expert_prefixes = tuple(p + "." for p in prefixes)
    read = [] if check_integrity(integrity) else None  # (name, max |w| as read) for the weight checks
    lin = (qc or {}).get("linears")
    if lin:  # non-expert linears packed too (`quantize --linears true`): their modules become QuantLinear
        if not isinstance(lin, dict) or not isinstance(lin.get("modules"), list) or \
                not all(isinstance(n, str) for n in lin["modules"]):
            raise InputError(f"{path}: quantization_config linears is not a list of module names "
                             f"(damaged config.json)")
        sym = qc.get("symmetric", False)
        if qc["bits"] == 4:  # symmetric int4 stores no minimums: the file and the config must agree
            with_mins = [n for n in lin["modules"]
                         if f"{checkpoint_name(n + '.weight', adapter.family)}_mins" in ckpt.tensors]
            if with_mins and sym:
                raise InputError(f"{path}: quantization_config says symmetric, but packed linear {with_mins[0]} "
                                 f"stores minimums (damaged config.json)")
        qlinear.install_linears(model, lin["modules"], qc["bits"], qc["group_size"], sym)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith(expert_prefixes):
            continue
        ck = checkpoint_name(name, adapter.family)
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        if ck not in ckpt.tensors:
            if isinstance(p, torch.nn.Parameter) and p.is_meta and not _tied(model, name):
                raise InputError(f"checkpoint {path} has no tensor {ck} (model parameter {name})")
            if isinstance(mod, qlinear.QuantLinear):  # a packed linear's integers, scales or minimums
                raise InputError(f"checkpoint {path} has no tensor {ck} (packed linear {mod_name}"
                                 + (": quantization_config says min-max int4, not symmetric" if attr == "weight_mins"
                                    else "") + "; damaged checkpoint or config.json)")
            continue
        t = ckpt.read(ck)
        if read is not None and t.dtype.is_floating_point:
            read.append((ck, max_abs(t)))
        if list(t.shape) != list(p.shape):
            raise InputError(f"checkpoint tensor {ck} has shape {list(t.shape)}; the model expects {list(p.shape)}")
        if attr == "weight_q" and t.dtype != p.dtype:  # a packed linear's integers: int8 (8 bits) or uint8 (4 bits)
            raise InputError(f"checkpoint tensor {ck} is {t.dtype}; packed {p.dtype} expected (damaged checkpoint)")
        t = t.to(p.dtype if p.dtype.is_floating_point else t.dtype)
        if isinstance(p, torch.nn.Parameter):
            mod._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[attr] = t
    if read is not None:
        check_weights(read, str(path), off)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if qc is not None:
        from expertcache.runtime.storage.store import check_store

        source = quant.open_source(path, qc, verify)  # one store, or one per format (mixed precision)
        check_store(source.meta, model)
        if qc["bits"] != quant.MIXED and quant.format_of_specs(source.meta.tensors) != (qc["bits"], qc["group_size"]):
            raise InputError(f"{source.files[0]} does not hold the {qc['bits']}-bit, group {qc['group_size']} experts "
                             f"config.json describes (damaged checkpoint: quantize again)")
    else:
        source = CheckpointExperts(ckpt, adapter.family, prefixes, adapter.num_experts,
                                   {n: (s, dtype) for n, (s, _) in params.items()}, router_fingerprint(model), dtype)
        source.use_index(verify)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
            if p.is_meta and not n.startswith(expert_prefixes)]
    if left:
        raise InputError(f"checkpoint {path} leaves {len(left)} parameters unset (first: {left[0]})")
    model.config._name_or_path = str(path)
    _generation_config(model, path)
    return model.eval(), source


def _check_store_dtype(path: Path, ckpt, adapter, model, dtype: torch.dtype) -> None:
    """A quantized checkpoint's expert store is stamped with the fingerprint of its routers as stored
    (`store.check_store`); a compute dtype narrower than they are (float32 routers in bf16) rounds them, and the store
    would read as another checkpoint's. Refused saying so, from the safetensors header (before any weight is read)."""
    names = {id(m): n for n, m in model.named_modules()}
    for layer in adapter.moe_layers(model):
        ck = checkpoint_name(names[id(layer.router)] + ".weight", adapter.family)
        info = ckpt.tensors.get(ck)
        if info is None or not info.dtype.is_floating_point or info.dtype == dtype or \
                torch.finfo(dtype).bits > torch.finfo(info.dtype).bits:  # missing: the read says so; wider: exact
            continue
        have, want = (str(d).removeprefix("torch.") for d in (info.dtype, dtype))
        raise InputError(f"--dtype {want}: {path} is a quantized checkpoint whose expert store belongs to its {have} "
                         f"routers ({ck}), which {want} rounds (its store would then match no router); leave --dtype "
                         f"out to serve it in {have}, or pass one at least as wide")


def _tied(model, name: str) -> bool:
    out = model.get_output_embeddings()
    cfg = model.config.get_text_config()
    return out is not None and getattr(cfg, "tie_word_embeddings", False) and name.endswith("lm_head.weight")


def _generation_config(model, path: Path) -> None:
    from expertcache.telemetry.hf import load_generation_config

    gc = load_generation_config(path)
    if gc is not None:
        model.generation_config = gc


def load(model: str | Path, capacity: float = 0.25, tier: str = "auto", device: str = "cpu", dtype=None, *,
         predictor="none", keep_scores=None, pinned=None, revision: str | None = None,
         verify: bool | None = None, engine: EngineConfig | None = None, **stale):
    """An HF causal LM whose routed experts stay on `tier` (read from the checkpoint's own safetensors files) and
    pass through a cache of `capacity` experts per layer (a fraction of E, or a count) on `device`. The defaults
    are `EngineConfig`'s, as in every command: a quarter of the experts, the tier chosen by what fits (`auto`).

    `predictor`: a name for `predictors.make_predictor` (none, probe:1, persistence, estimator:FILE, spatio) or a
    `Predictor`; the spatio predictor and the scored policy read the checkpoint's aux routers through
    `predictors.aux_routers_for` (the loader the entry point installed); `keep_scores`: the scored policy's
    keep-score source. `verify`: check every expert read against the checkpoint's checksum index (`expertcache
    verify` writes it); None = `checkpoint.VERIFY_DEFAULT` (on: about 2% of TPOT, `expertcache bench checksum`), False
    = off, True = on and warn when there is no index. A mismatch raises `InputError` naming the layer, expert and
    file. Every other engine option (policy, miss, tau, budget, kernel, workers, ...) goes in one
    `engine=EngineConfig(...)` (what the commands take), which then carries capacity, tier and device too (a
    `Predictor` object may go beside it); an option given as a keyword of `load` is refused in one line naming
    that form. The engine is `model.expertcache`.
    """
    from expertcache.runtime.engine.predictors import Predictor, TemporalKeep, aux_routers_for, check_predictor_spec, make_predictor

    if stale:  # the keyword form of engine options is gone: one line says where they go
        fields = set(EngineConfig.__dataclass_fields__)
        opts = ", ".join(f"{k}={v!r}" for k, v in stale.items() if k in fields)
        other = sorted(set(stale) - fields)
        raise InputError((f"load() takes no argument {', '.join(other)}; " if other else f"load({opts}): ")
                         + f"engine options go in engine=EngineConfig({opts or '...'})"
                         + (f" (its fields: {', '.join(sorted(fields))})" if other else ""))
    if engine is not None:  # the one carrier of engine options: its fields, nothing given beside it
        given = [n for n, v, d in (("capacity", capacity, 0.25), ("tier", tier, "auto"), ("device", device, "cpu"))
                 if v != d] + (["predictor"] if isinstance(predictor, str) and predictor != "none" else [])
        if given:
            raise InputError(f"load(engine=...) and engine options {given} both given; put them in the EngineConfig")
        if not isinstance(predictor, Predictor):  # an object may go beside the config, which then names its type
            predictor = engine.predictor
    if not isinstance(model, (str, os.PathLike)):
        raise InputError(f"load(model={model!r}): expected a checkpoint folder or hub id (a str or a Path)")
    if not (isinstance(predictor, (str, Predictor))):
        raise InputError(f"load(predictor={predictor!r}): expected a predictor name (none, probe:1, persistence, "
                         f"estimator:FILE, spatio) or a Predictor")
    if isinstance(predictor, str):
        check_predictor_spec(predictor)  # before anything is read
    if verify not in (None, True, False):
        raise InputError(f"load(verify={verify!r}): expected None, True or False")
    if engine is None:  # the design's named arguments, every other option its default
        engine = EngineConfig(capacity=capacity, tier=tier, device=device)
    cfg = replace(engine, device=parse_device(engine.device),
                  predictor=predictor if isinstance(predictor, str) else type(predictor).__name__)
    cfg.check()
    dev = cfg.device
    path = resolve(model, revision)
    m, source = build_offloaded(path, dtype, verify, cfg.integrity)
    if dev == "cuda":
        m.to(dev)  # the non-expert model; the experts' modules are still meta and are replaced below
    aux_routers = aux_routers_for(path, m) if predictor == "spatio" or cfg.policy == "scored" else None
    if cfg.policy == "scored" and keep_scores is None and aux_routers is not None:
        keep_scores = TemporalKeep(m, aux_routers)
    pred = predictor if isinstance(predictor, Predictor) else make_predictor(
        predictor, m, aux_routers, num_experts=source.meta.num_experts, hidden_size=m.config.hidden_size)
    m.expertcache = OffloadEngine(m, source, cfg, predictor=pred, pinned=pinned, keep_scores=keep_scores)
    return m


def reattach(model, cfg: EngineConfig, **kw) -> OffloadEngine:
    """A new engine configuration on an already loaded model (`load`): the old engine stops, the new one
    reuses its expert source and, when the tier kind is the same, its open tier (one host copy, not two)."""
    old: OffloadEngine = model.expertcache
    old.detach()
    same = cfg.tier in (old.cfg.tier, "auto") and cfg.slot_device == old.cfg.slot_device  # (old's is resolved)
    if not same:
        old.tier.close()
    model_source, tier = old.source, old.tier if same else None
    del old
    model.expertcache = None
    gc.collect()  # the old slots are freed before the new ones are allocated: peak memory is one configuration's
    eng = OffloadEngine(model, model_source, cfg, tier=tier, **kw)
    model.expertcache = eng
    return eng


# `make quickstart` (recipes/quickstart.py) leaves its cache-aware post-trained checkpoint here.
QUICKSTART_MODEL = Path("runs/ca-starter/model")


def load_model(model: str | Path, engine: EngineConfig | None = None, dtype=None, *, plain: bool = False):
    """(model, tokenizer) of a checkpoint directory or cached hub id: `expertcache.runtime.load` under `engine` (the
    offload engine attached as `model.expertcache`; None: `EngineConfig()`'s defaults), or with `plain` the
    unmodified `from_pretrained` model, every expert in memory, on `engine.device`."""
    from expertcache.telemetry.hf import load_causal_lm, load_tokenizer

    path = resolve(model)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path} has no tokenizer (tokenizer.json)")
    tokenizer = load_tokenizer(path)
    engine = engine if engine is not None else EngineConfig()
    if plain:
        check_plain(path)
        m = load_causal_lm(path, dtype=parse_dtype(dtype) or "auto").eval()
        if check_integrity(engine.integrity):  # the engine's per-expert checks, on the whole plain model
            from expertcache.runtime.storage.weight_checks import check_model

            check_model(m, str(path))
        return m.to(parse_device(engine.device)), tokenizer
    # the one place the checkpoint is opened through the engine (experts stay on `tier`, read by byte range)
    return load(path, dtype=dtype, engine=engine), tokenizer


def is_quantized(path: Path) -> bool:
    """Whether `path` is an `expertcache quantize` copy (experts packed in its own store), from its config.json;
    another method's quantization_config is transformers' to read, and a missing or broken config.json is its
    loader's to report."""
    import json

    from expertcache.runtime.kernels import quant

    try:
        qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == quant.QUANT_METHOD


def check_plain(path: Path) -> None:
    """A checkpoint `from_pretrained` can read: an `expertcache quantize` copy (experts packed in its own store)
    has no plain form, and transformers would only say its expert weights are missing."""
    if is_quantized(path):
        raise InputError(f"{path} is a quantized checkpoint (its experts are packed), which has no plain transformers "
                         f"form: serve it through the engine (leave --plain out; e.g. --engine.capacity 1.0), or "
                         f"use the checkpoint it was quantized from")


def resolve_model_arg(model: str | None) -> Path:
    """`--model`, or the quickstart's final checkpoint when none is given."""
    if model:
        return Path(model)
    if not (QUICKSTART_MODEL / "config.json").is_file():
        raise FileNotFoundError(f"no --model given and no quickstart model at {QUICKSTART_MODEL}: run "
                                f"`make quickstart` first, or pass --model DIR")
    return QUICKSTART_MODEL
