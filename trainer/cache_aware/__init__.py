"""Cache-aware post-training of a trained MoE: locality losses on the backbone's routers, auxiliary Temporal and
Spatio routers, and the end-of-run cache and perplexity figures with the pre-registered gate.

Modes:
- `joint`: the backbone (LM loss + its load-balancing loss + locality losses) and the auxiliary routers are
  trained together; the routers' cache loss is weighted by `routers.weight` and its gradient reaches the
  backbone's hidden states.
- `aux-only`: the backbone is frozen (bit-identical); only the auxiliary routers train.
- `locality-only`: the backbone with locality losses, no auxiliary routers.
Inference always uses the model's native top-k: nothing here changes which experts a token computes with once
it is served. `serving.reroute` changes the *training* forward only: each training sequence is replayed token by
token through an LRU cache of `serving.capacity` experts per layer, and every layer computes with the experts the
engine's reroute miss policy would serve (`locality.ServedRouting`), so the model learns to work with them
(serving-aware fine-tuning); `locality.kind=margin` teaches the router to choose those experts itself.

Run folder (`out_dir`): recipe.yaml, checkpoints/ (resumable), logs/, model/ (HF checkpoint + tokenizer +
aux_routers.safetensors), trace-<split>.parquet (the run's decode routing), result.json, result.md,
training_curve.png, cache.png.

One job per file: `recipe.py` (the recipe's dataclasses, defined torch-free in trainer/specs.py), `module.py`
(the LightningModule), `run.py` (a run, the base's cached evaluation, the summary and gate, a sweep), `report.py`
(tables, the frontier table, the cache plot).
"""

from .module import CacheAwareModule
from .recipe import (MODES, TRAINABLE, CacheAwareRecipe, EvalSpec, FrontierSpec, LocalitySpec, QualitySpec,
                     RouterSpec, ServingSpec, SweepSpec)
from .report import frontier_table, plot_cache, result_row, results_table
from .run import baseline_eval, run_cache_aware, run_sweep, summarize

__all__ = ["MODES", "TRAINABLE", "CacheAwareModule", "CacheAwareRecipe", "EvalSpec", "FrontierSpec", "LocalitySpec",
           "QualitySpec", "RouterSpec", "ServingSpec", "SweepSpec", "baseline_eval", "frontier_table", "plot_cache",
           "result_row", "results_table", "run_cache_aware", "run_sweep", "summarize"]
