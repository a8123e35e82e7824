"""The reroute miss policy replayed inside a batched forward, for lm-eval's accuracy documents (`--accuracy replay`).

Served one token at a time through the engine (`--accuracy token`, the default), a 4-way cloze document of ~100
tokens costs four forwards per token: 2,000 documents per task take hours here. The reroute rule itself is cheap
and exact to replay (`telemetry.cache.served_routing`, the rule's one implementation, as the serving-aware trainer
uses it): in one teacher-forced forward over a batch of documents, each MoE layer's router output is replaced, token
by token in order, by the experts the engine would serve with an LRU cache of C experts per layer, each document
starting from an empty cache. That is the cache simulated in order per document (METRICS.md), never a batch's union.

What differs from the engine served token by token: the engine's cache stays warm from one document to the next,
the replay starts every document cold (more misses, so at least as many reroutes). Demand loads are not counted
here; the step-wise perplexity blocks still go through the engine token by token and count them.
`tests/test_evals.py` checks the replay's logits against the engine's, document by document from a fresh engine.
"""

from __future__ import annotations

import torch

from expertcache.telemetry.errors import InputError

ACCURACY_METHODS = ("token", "replay")


def check_replayable(engine, accuracy: str) -> None:
    """`InputError` (one line) unless `accuracy` names a method and replay is asked only of what it can replay."""
    if accuracy not in ACCURACY_METHODS:
        raise InputError(f"--accuracy {accuracy}: expected one of {', '.join(ACCURACY_METHODS)}")
    if accuracy != "replay":
        return
    if engine is None or not engine.lossy:
        raise InputError("--accuracy replay replays a lossy miss policy; the plain model and lossless policies "
                         "are evaluated batched already (leave --accuracy token)")
    if engine.miss != "reroute" or engine.miss_precision or engine.budget_gb:
        raise InputError(f"--accuracy replay replays the reroute policy at a capacity (--engine.capacity); "
                         f"{engine.label()} is served token by token only (--accuracy token)")


class ReplayedReroute:
    """Forward hooks on every router of `model` (a plain in-memory model): each forward's top-k choice becomes the
    experts `engine` (reroute, its capacity and tau) serves, replayed per sequence over the `batch` sequences of
    the forward (set `batch` before each call), and the routing weights re-derived by the family's rule."""

    def __init__(self, model, engine):
        from expertcache.telemetry.adapters import adapter_for

        self.adapter = a = adapter_for(model)
        self.capacity = engine.slots(a.num_experts, a.top_k)
        self.tau = float(engine.tau)
        self.batch = 1
        self.rerouted = self.choices = 0  # chosen experts swapped, of all chosen (real and padding tokens alike)
        self.handles = [layer.router.register_forward_hook(self._hook) for layer in a.moe_layers(model)]

    def _hook(self, module, args, output):
        from expertcache.telemetry.cache import served_routing

        if not (isinstance(output, tuple) and len(output) == 3):
            raise InputError(f"--accuracy replay needs routers that return (logits, weights, ids); "
                             f"{type(module).__name__} returns {type(output).__name__}")
        logits, weights, idx = output
        if idx.shape[0] % self.batch:
            raise RuntimeError(f"replay: {idx.shape[0]} routed tokens do not split into {self.batch} sequences")
        with torch.no_grad():
            served, changed = served_routing(self.adapter.scores(logits.detach()), idx, self.batch, self.capacity,
                                             self.tau)
        self.rerouted += int(changed.sum())
        self.choices += changed.numel()
        return logits, self.adapter.weights(logits, served).to(weights.dtype), served

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
