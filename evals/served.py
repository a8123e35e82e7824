"""How a checkpoint is opened for evaluation: plain (`from_pretrained`, every expert in memory) or served by the
offload engine under an `EngineConfig` (the runtime's one set of engine options)."""

from __future__ import annotations

from expertcache.runtime.engine.config import EngineConfig


def label(engine: EngineConfig | None) -> str:
    return "plain" if engine is None else engine.label()


# a quantized checkpoint opened with no engine options: every expert resident, the nearest it has to a plain model
QUANTIZED_DEFAULT = EngineConfig(capacity=1.0)


def served_engine(path, engine: EngineConfig | None) -> EngineConfig | None:
    """The engine a checkpoint is evaluated under: `engine` as given, or, for an `expertcache quantize` copy given
    none, `QUANTIZED_DEFAULT` (its experts are packed in its own store: it has no plain form, #46 item 5)."""
    from expertcache.runtime.storage.loader import is_quantized, resolve

    if engine is None and is_quantized(resolve(path)):
        return QUANTIZED_DEFAULT
    return engine


def open_model(model_dir, engine: EngineConfig | None, dtype="fp32", device="cpu"):
    """`(model, engine)`: the checkpoint (a local directory or a cached hub id) as `engine` serves it (a quantized
    checkpoint with no `engine`: as `served_engine` says).
    Offloaded, it goes through the runtime's loader (experts stay in the checkpoint's files, read by byte range);
    plain (`engine` None), through `from_pretrained` (engine None). fp32 by default: the figures the gates
    compare were measured in fp32 (`auto`: the checkpoint's own dtype)."""
    from expertcache.runtime.storage.loader import check_plain, load, parse_device, parse_dtype, resolve

    path = resolve(model_dir)
    device = parse_device(device)
    engine = served_engine(path, engine)
    if engine is None:
        from expertcache.telemetry.hf import load_causal_lm

        from expertcache.runtime.storage.weight_checks import check_model

        check_plain(path)
        m = load_causal_lm(path, dtype=parse_dtype(dtype) or "auto")
        check_model(m, str(path))  # what the engine checks on each expert's first read, here on the whole model
        return m.eval().to(device), None

    from expertcache.runtime.engine.predictors import set_aux_routers_loader
    from expertcache.trainer.aux_routers import load_aux_routers

    set_aux_routers_loader(load_aux_routers)  # the routers saved beside the checkpoint (spatio, scored)
    engine.check()
    from dataclasses import replace

    model = load(path, dtype=dtype, engine=replace(engine, device=device))
    return model, model.expertcache
