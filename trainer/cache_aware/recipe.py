"""The cache-aware recipe: its typed sections (locality, quality, serving, routers, eval, sweep, frontier) and
the checks that reject a bad value before anything runs."""

from __future__ import annotations

from ..specs import (MODES, TRAINABLE, CacheAwareRecipe, EvalSpec, FrontierSpec,  # noqa: F401 - re-exported
                     LocalitySpec, QualitySpec, RouterSpec, ServingSpec, SweepSpec)
