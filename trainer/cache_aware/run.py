"""A cache-aware run: post-train the base, save the checkpoint, evaluate it against the base (cached beside the
base), summarise with the gate, write the run folder's reports; a sweep runs every point, then its table."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from expertcache.telemetry.atomic import write_json, write_text

from ..config import RecipeError, apply_overrides, from_dict, to_dict
from .module import CacheAwareModule
from .recipe import CacheAwareRecipe
from .report import plot_cache, result_row, results_table


def _check_base(base: str | Path) -> Path:
    from expertcache.telemetry.errors import InputError

    base = Path(base)
    if not (base / "config.json").is_file():
        raise InputError(f"no HF checkpoint at {base} (expected {base / 'config.json'}); pretrain one first: "
                         f"expertcache pretrain --recipe base-tiny")
    return base


def baseline_eval(recipe: CacheAwareRecipe) -> dict:
    """The base checkpoint under the run's eval spec; cached beside the base (every run of a table shares it)."""
    from ..cache_eval import evaluate_checkpoint

    base = _check_base(recipe.base)
    ev = to_dict(recipe.eval)
    key = hashlib.sha256(json.dumps([ev, recipe.data.corpus, (base / "config.json").read_text(),
                                     (base / "model.safetensors").stat().st_mtime], sort_keys=True,
                                    default=str).encode()).hexdigest()[:12]
    folder = base.parent / "cache-aware-baseline"
    path = folder / f"{key}.json"
    if path.is_file():
        res = json.loads(path.read_text())
        if "block_nll" in res:  # one cached before the gate's intervals is measured again
            return res
    folder.mkdir(parents=True, exist_ok=True)
    e = recipe.eval
    res = evaluate_checkpoint(base, recipe.data.corpus, e.split, folder / f"trace-{key}.parquet", e.prompt_len,
                              e.decode_tokens, e.max_seqs, e.capacities, e.ppl_blocks, e.seq_len)
    write_json(path, res)
    return res


def summarize(recipe: CacheAwareRecipe, base: dict, cand: dict) -> dict:
    """Miss reduction against the base's LRU, the routers against LRU on the same model, Δppl and the gate."""
    caps = {}
    for row in cand["cache"]:
        c = caps.setdefault(str(row["capacity"]), {"capacity_frac": row["capacity_frac"]})
        c[row["policy"]] = row
    for cap, c in caps.items():
        base_lru = next(r for r in base["cache"] if str(r["capacity"]) == cap and r["policy"] == "lru")
        c["base_lru"] = base_lru
        c["lru_miss_reduction"] = 1 - c["lru"]["misses_per_token"] / base_lru["misses_per_token"]
        routed = [p for p in ("spatio_temporal", "temporal", "spatio") if p in c]
        if routed:
            best = max(routed, key=lambda p: c[p]["adjusted_hit_rate"])
            c["best_router_policy"] = best
            c["router_adjusted_gain_points"] = 100 * (c[best]["adjusted_hit_rate"] - c["lru"]["adjusted_hit_rate"])
            c["router_traffic_ratio"] = c[best]["traffic_bytes_per_token"] / c["lru"]["traffic_bytes_per_token"]
    dppl = {d: 100 * (cand["ppl"][d] / base["ppl"][d] - 1) for d in cand["ppl"]}
    e = recipe.eval
    from expertcache.telemetry.metrics import GateThresholds, gate_verdict
    from expertcache.telemetry.stats import dppl_intervals

    th = GateThresholds(e.gate_ppl_overall, e.gate_ppl_domain)
    # the same blocks for both (the same corpus, split, seq_len and ppl_blocks): paired intervals, the gate's rule
    iv = dppl_intervals(base["block_nll"], cand["block_nll"], base["block_tokens"])
    est = {"overall": [dppl["overall"], *iv["overall"][1:]],
           **{d: [dppl[d], *v[1:]] for d, v in iv["domains"].items()}}
    v = gate_verdict(est, {}, iv["n_blocks"], {}, th)
    return {"capacities": caps, "dppl_percent": dppl, "gate": {
        "verdict": v["gate"], "pass": v["gate"] == "PASS", "failures": v["failures"], "unresolved": v["unresolved"],
        "resolve": v["resolve"], "dppl_ci95": {d: x[1:] for d, x in est.items()},
        "dppl_max_domain_ci95": iv["max_domain"][1:], "n_blocks": iv["n_blocks"],
        "ppl_overall_max": e.gate_ppl_overall, "ppl_domain_max": e.gate_ppl_domain}}


def run_cache_aware(recipe: CacheAwareRecipe, resume: bool = True) -> dict:
    """Post-train, save, evaluate; returns (and writes) result.json. A sweep runs every point, then the table."""
    if recipe.sweep.key:
        return run_sweep(recipe, resume)
    from expertcache.telemetry.errors import InputError

    from ..aux_routers import AuxRouters, config_for
    from expertcache.telemetry.corpus import packed_blocks

    from ..data import CorpusDataModule
    from ..evaluate import check_vocab
    from ..models import count_parameters, save_model_dir
    from ..runfolder import finish_run, fit_resumable, plot_training_curve, prepare_run

    base = _check_base(recipe.base)
    if recipe.routers.trace:  # aux-only from a recorded trace: no forward of the model, no expert read
        from .from_trace import run_from_trace

        return run_from_trace(recipe, base, resume)
    from . import stream

    streamed = parts = None
    if stream.wants_stream(recipe, base):  # experts frozen in the checkpoint: the budget checked before any work
        plan, parts = stream.open_base(recipe, base)
    tok, out, done = prepare_run(recipe, resume, ("result.json", "model/config.json"), command="train-cache-aware")
    if done is not None:
        return {**done, "nothing_to_do": True}  # finished with this recipe: reported again, nothing trained
    from expertcache.telemetry.hf import load_causal_lm

    if parts is not None:
        streamed = stream._RUNTIME.open_streamed(base, recipe.train.expert_tier, stream.compute_dtype(recipe))
        model = streamed.model
        stream.keep_routers_fp32(recipe, model)
    else:
        model = load_causal_lm(base, dtype=torch.float32)
    check_vocab(tok, model.config)
    q = recipe.quality
    lora = None
    if q.lora_rank:  # (aux-only, which keeps the backbone frozen, is refused with the recipe)
        from ..lora import add_lora

        lora = {"rank": q.lora_rank, "alpha": q.lora_alpha, "targets": list(q.lora_targets),
                "parameters": add_lora(model, q.lora_rank, q.lora_alpha, q.lora_targets)}
    if (base / "tokenizer.json").is_file():
        from expertcache.telemetry.hf import load_tokenizer

        if load_tokenizer(str(base)).get_vocab() != tok.get_vocab():
            raise InputError(f"data.tokenizer {recipe.data.tokenizer} is not the tokenizer of the base {base} (their "
                             f"vocabularies differ); pass data.tokenizer={base}")
    r = recipe.routers
    aux = AuxRouters(config_for(model, r.temporal, r.spatio, r.rank, r.refine_budget, r.prefetch_threshold,
                                r.horizon, r.horizon_decay, r.history)) \
        if recipe.mode != "locality-only" else None
    n_backbone = streamed.num_parameters if streamed is not None else count_parameters(model)["total"]
    n_aux = aux.num_parameters() if aux is not None else 0
    if n_aux > 0.01 * n_backbone:
        raise RecipeError(f"auxiliary routers have {n_aux} parameters, over 1% of the backbone's {n_backbone}; "
                          f"lower routers.rank ({r.rank})")
    allowed = None
    if recipe.locality.domain_weight:
        from expertcache.telemetry.corpus import DOMAINS
        from ..locality import allowed_experts

        blocks = [torch.from_numpy(packed_blocks(recipe.data.corpus, recipe.data.tokenizer, "train", d,
                                                 recipe.data.seq_len)[:16].astype("int64")) for d in DOMAINS]
        if any(len(b) == 0 for b in blocks):
            raise InputError("the domain loss needs training text in every domain")
        allowed = allowed_experts(model, blocks, recipe.locality.domain_frac)
    dm = CorpusDataModule(recipe.data, seed=recipe.train.seed)
    dm.setup("fit")
    model.train()  # from_pretrained returns eval mode
    teacher = base_routers = None
    if recipe.quality.distill and recipe.mode != "aux-only":
        if streamed is not None or recipe.quality.trainable == "routers":  # the base = this model, its routers
            from expertcache.telemetry.adapters import adapter_for

            names = {id(p): n for n, p in model.named_parameters()}
            base_routers = {names[id(p)]: p.detach().clone() for L in adapter_for(model).moe_layers(model)
                            for p in L.router.parameters()}
        else:
            teacher = load_causal_lm(base, dtype=torch.float32).eval().requires_grad_(False)
    module = CacheAwareModule(model, recipe, dm.val_domains(), aux, allowed, teacher, base_routers)
    if streamed is not None:
        module.save_frozen = False  # resumable checkpoints hold what trains; the frozen rest is the base's
        module.strict_loading = False
        parts["resident_check"] = stream._RUNTIME.check_resident(streamed, recipe.train.memory_gb, parts)
        module.read_counter = lambda: streamed.counters()["bytes_read"]  # each step's own reads (stream_result)
    try:
        start_step, train_s, trainer = fit_resumable(recipe, module, dm, out, resume)
        if trainer.global_rank != 0:  # data-parallel workers: rank 0 alone writes the checkpoint and the reports
            return None
        if streamed is not None:
            return _finish_streamed(recipe, streamed, parts, module, trainer, train_s, start_step, tok, out, aux,
                                    lora)
    finally:
        if streamed is not None:
            streamed.close()

    model_dir = out / "model"
    if lora is not None:  # the checkpoint is a plain one: each adapter merged into its projection
        from ..lora import merge_into

        merge_into(model)
    save_model_dir(model, tok, model_dir, aux)
    plot_training_curve(out / "logs", out / "training_curve.png")

    result = {"name": recipe.name, "mode": recipe.mode, "base": str(base), "out_dir": str(out),
              "global_step": trainer.global_step, "resumed_from_step": start_step,
              "train_seconds_this_run": round(train_s, 1),
              "locality": to_dict(recipe.locality), "routers": to_dict(recipe.routers) if aux is not None else None,
              "parameters": {"backbone": n_backbone, "aux_routers": n_aux,
                             "aux_fraction_of_backbone": n_aux / n_backbone},
              "losses": module.step_losses, "lora": lora,
              **cache_figures(recipe, out, aux.eval() if aux is not None else None)}
    from expertcache.telemetry.atomic import write_json

    write_json(out / "result.json", result)
    write_text(out / "result.md", results_table([result]) + "\n")
    plot_cache(result, out / "cache.png")
    finish_run(out, "train-cache-aware")
    return result


def _finish_streamed(recipe, streamed, parts, module, trainer, train_s, start_step, tok, out, aux, lora=None) -> dict:
    """A streamed run's end: the checkpoint (the base's files, routers rewritten) and result.json with the
    training figures (`stream.stream_result`). The end-of-run evaluation, which loads the model whole, is left to
    `expertcache eval --model OUT/model` (it serves through the offload engine)."""
    from ..runfolder import plot_training_curve
    from . import stream

    added = {}
    if lora is not None:  # each adapter added to its projection's tensor as the checkpoint holds it, in fp32
        from ..lora import deltas

        added = deltas(module.model)
    stream.save_model(streamed, module.model, tok, out / "model", aux, add=added)
    plot_training_curve(out / "logs", out / "training_curve.png")
    result = {"name": recipe.name, "mode": recipe.mode, "base": str(recipe.base), "out_dir": str(out),
              "streamed": True, "global_step": trainer.global_step, "resumed_from_step": start_step,
              "train_seconds_this_run": round(train_s, 1), "locality": to_dict(recipe.locality), "lora": lora,
              **stream.stream_result(recipe, streamed, parts, module, trainer, train_s, start_step)}
    if lora is not None:
        result["trainable"] = "routers + attention adapters"
    write_json(out / "result.json", result)
    return result


def with_cache_summary(recipe: CacheAwareRecipe, res: dict) -> dict:
    """`res` (a finished run's result.json) with the cache figures and Δppl an in-memory run ends with: a streamed
    run leaves them out (its model may not fit in memory); for one that fits (the frontier's tiny base), they are
    measured here the same way (`evaluate_checkpoint` on the saved model, against `baseline_eval`) and written back
    into result.json, so they are measured once."""
    if "summary" in res:
        return res
    out = Path(res["out_dir"])
    res = {**res, **cache_figures(recipe, out)}
    write_json(out / "result.json", res)
    return res


def cache_figures(recipe: CacheAwareRecipe, out: Path, aux=None) -> dict:
    """`baseline`, `candidate` and `summary` of a run's saved model (`out/model`, its trace beside it) against the
    base under the recipe's eval spec: what every finished run's result.json holds."""
    from ..cache_eval import evaluate_checkpoint

    e = recipe.eval
    base_res = baseline_eval(recipe)
    cand = evaluate_checkpoint(out / "model", recipe.data.corpus, e.split, out / f"trace-{e.split}.parquet",
                               e.prompt_len, e.decode_tokens, e.max_seqs, e.capacities, e.ppl_blocks, e.seq_len,
                               aux=aux)
    return {"baseline": base_res, "candidate": cand, "summary": summarize(recipe, base_res, cand)}


def run_sweep(recipe: CacheAwareRecipe, resume: bool = True) -> dict:
    """Every value of `sweep.key` as its own run under out_dir, then one table (sweep.md, sweep.json)."""
    out = Path(recipe.out_dir)
    from ..runfolder import claim_runs_folder

    claim_runs_folder(out)
    base = to_dict(recipe)
    base["sweep"] = {"key": "", "values": []}
    results = []
    for v in recipe.sweep.values:
        point = apply_overrides(json.loads(json.dumps(base)), [f"{recipe.sweep.key}={v}"])
        point["out_dir"] = str(out / f"{recipe.sweep.key}={v:g}")
        point["name"] = f"{recipe.name}-{recipe.sweep.key}={v:g}"
        results.append(run_cache_aware(from_dict(CacheAwareRecipe, point), resume))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep.json", [result_row(r) for r in results])
    write_text(out / "sweep.md", results_table(results) + "\n")
    return {"sweep": recipe.sweep.key, "values": recipe.sweep.values, "rows": [result_row(r) for r in results],
            "table": str(out / "sweep.md")}
