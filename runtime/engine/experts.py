"""The compute stage: `OffloadedExperts` replaces a MoE layer's `experts` module and computes its tokens' experts from
the engine's cache slots through its weight format's class (`formats`: native, cpu_bf16, triton, int8, int4, mixed;
chosen once per pool); `Compute` runs a layer's plan over them, resident experts first, each miss
as the loads stage delivers it, and combines the rows as the family's implementation does."""

from __future__ import annotations

import copy
import os
import time

import torch
from torch import nn

from expertcache.telemetry.errors import InputError

from expertcache.runtime.kernels import cpu_kernels, fast_step, patches, quant
from expertcache.runtime.storage.store import FMT
from expertcache.runtime.storage.tiers import SlotPool

from expertcache.runtime.engine import formats
from expertcache.runtime.engine.loads import quiesce


class OffloadedExperts(nn.Module):
    """Stands in for a HF experts module; computes over the slot pool through its weight format's class (`formats`:
    chosen once, from the pool's views, `--engine.kernel` and where the slots are)."""

    def __init__(self, engine, pos: int, original: nn.Module, pool: SlotPool, kernel: str = "auto",
                 device: str = "cpu"):
        super().__init__()
        self._engine = [engine]  # the OffloadEngine, in a list: not registered as a submodule
        self.pos = pos
        if isinstance(original, OffloadedExperts):  # a new engine on a model that already has one
            original = original._proto[0]
        proto = copy.copy(original)  # shares config, act_fn, _apply_gate...; no parameters (the experts stay out)
        proto._parameters = {}
        proto._modules = dict(original._modules)
        self._proto = [proto]
        tmpl = copy.copy(proto)
        for name, view in pool.views.items():
            setattr(tmpl, name, view)
        tmpl.num_experts = pool.n_slots
        self._choose = lambda views: formats.choose(views, tmpl, type(original).forward, kernel, device)
        self.fmt = self._choose(pool.views)  # the pool's format, decided once
        self._key = _format_key(pool.views)
        self._other: dict = {}  # views of another format (the packed copy of miss_precision) -> their format
        impl = getattr(getattr(original, "config", None), "_experts_implementation", None)
        self.eager = impl in (None, "eager")  # eager adds experts one by one in expert order; the others sum over k

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self._engine[0].run_layer(self, hidden_states, top_k_index, top_k_weights)

    def check_cpu_kernel(self) -> None:
        """`--engine.kernel cpu` refused in one line where it cannot run on this layer's experts."""
        formats.check_cpu_kernel(self.fmt.views, self.fmt.tmpl, type(self._proto[0]).__name__)

    def format_of(self, tensors: dict[str, torch.Tensor] | None):
        """The format that computes `tensors` (None: the pool): the pool's, unless they are another format's."""
        if tensors is None:
            return self.fmt
        key = _format_key(tensors)
        if key == self._key:
            return self.fmt
        if key not in self._other:
            self._other[key] = self._choose(tensors)
        return self._other[key]

    def compute(self, hidden, slot_index, weights, tensors: dict[str, torch.Tensor] | None = None):
        """All (token, choice) pairs at once over the slot pool (or over `tensors`, `[n, ...]` views such as the
        stream slots): the family's own forward, as plain generate (or the CPU kernel / the triton SwiGLU kernel,
        when the engine is configured for them, or the integer kernels for packed experts)."""
        return self.format_of(tensors).compute(hidden, slot_index, weights, tensors)

    def rows(self, x, slots, weights, tensors: dict[str, torch.Tensor] | None = None):
        """`x [S, H]`, `slots [S]`, `weights [S]` -> each (token, choice) row's weighted expert output `[S, H]`,
        with k = 1 (the same kernels and roundings as the full call, never triton's), over the slot pool or over
        `tensors` (`[n, ...]` views, e.g. the host copy of a layer)."""
        return self.format_of(tensors).rows(x, slots, weights, tensors)


def _format_key(views: dict[str, torch.Tensor]):
    """What decides a set of views' format class: mixed or not, and packed `(bits, group)` or plain."""
    return FMT in views, quant.format_of(views)


class Compute:
    """The compute stage, from the part of the config it is given (`ComputeConfig`): a layer's experts over the
    slots the plan and the loads stage put them in. `stats` is the engine's `Stats` (`compute_s`)."""

    def __init__(self, part):
        self.part = part
        self.stats = None
        self.linears, self.attention, self.step = [], [], []  # what `patch` replaced, restored by `unpatch`

    def patch(self, model, routers) -> None:
        """The rest of a decode step through the same CPU kernels as the experts (where the extension is built
        here): the decode-sized linears, routers, norms, one-token attention over the KV cache, and a Qwen3-MoE
        decode step in one function (`EXPERTCACHE_NO_FAST_STEP=1` switches that off)."""
        if not cpu_kernels.available():
            return
        routed, rest = patches.patch_routers(routers)
        self.linears = (patches.patch_linears(model) + routed + patches.patch_calls(rest)
                        + patches.patch_norms(model) + patches.patch_attention_modules(model))
        self.attention = patches.patch_attention(model)  # one-token attention over the KV cache
        if os.environ.get("EXPERTCACHE_NO_FAST_STEP") != "1":
            self.step = fast_step.patch_decode_step(model)

    def unpatch(self) -> None:
        fast_step.unpatch_decode_step(self.step)  # first: the step relies on the modules patched below
        patches.unpatch_linears(self.linears)
        patches.unpatch_attention(self.attention)
        self.linears, self.attention, self.step = [], [], []

    def timed(self, fn, *args):
        """Expert compute, timed (the time budget's `expert_compute`)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.stats.compute_s += time.perf_counter() - t0

    def in_slots(self, mod: OffloadedExperts, hidden, slots: list[int], top_k_index, top_k_weights):
        """Every (token, choice) of the layer at once over its own slot pool (`slots`: each row's slot, flat): the
        family's own forward, as plain generate."""
        s = torch.tensor(slots, dtype=torch.long).view_as(top_k_index)
        return self.timed(mod.compute, hidden, s.to(hidden.device), top_k_weights)

    def layer(self, mod: OffloadedExperts, p, hidden, top_k_index, top_k_weights, flat: list[int], loads):
        """The layer's output under plan `p` (`plan.LayerPlan`) and `(staged, transient, seconds waited)`:
        `{expert: staging slot}` (what the cache may keep) and the streamed experts (used once, not kept). The
        resident experts (and victims) compute first, while the misses load; each miss computes as its weights
        arrive when experts are large enough to be worth it (`loads.overlap`), else all once everything is there
        (one call over the layer's slots: a call costs more than a small expert's compute). Misses of the `host`
        policy compute where they live, those of `low` from the packed copy's slots. Rows are combined as the
        family's implementation combines them."""
        if p.serve == "slots":
            return self.in_slots(mod, hidden, [p.slot_of[e] for e in flat], top_k_index, top_k_weights), ({}, [], 0.0)
        hits, misses = p.hits, p.misses
        k = top_k_index.shape[-1]
        rows: dict[int, list[int]] = {}
        for r, e in enumerate(flat):  # (token, choice) rows of each expert
            rows.setdefault(e, []).append(r)
        x_all = hidden.reshape(-1, hidden.shape[-1])
        w_flat = top_k_weights.reshape(-1)
        n_rows = len(flat)
        dev = hidden.device
        parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # expert -> (row ids, weighted outputs)
        # one token through the CPU kernels (bf16 or packed): each call computes its experts' weighted sum in one
        # kernel call, in place of a row per expert gathered and summed at the end (a decode step's Python and small
        # ops). The calls' groups do not depend on when loads land (the resident experts and victims together, then
        # each load alone), and their sums are added in fp32 in the order of their first expert, so a step's output
        # does not depend on load timing; equal to plain up to rounding, as the kernels are
        one = x_all.shape[0] == 1 and not x_all.is_cuda and len(rows) == len(flat) and not mod.eager \
            and mod.fmt.one_call
        sums: dict[int, torch.Tensor] = {}  # first expert of a call -> its weighted sum (fp32)

        def run(experts, slot_of, tensors=None, arrivals=False):
            if one:  # `arrivals`: loads that landed together (timing decides which): one call each
                for group in ([[e] for e in experts] if arrivals else [experts]):
                    s = torch.tensor([[slot_of[e] for e in group]], dtype=torch.long)
                    w = w_flat[[rows[e][0] for e in group]][None, :]
                    sums[min(group)] = self.timed(mod.compute, x_all, s, w, tensors).float()
                    parts.update((e, None) for e in group)
                return
            r = torch.tensor([i for e in experts for i in rows[e]], dtype=torch.long)
            s = torch.tensor([slot_of[e] for e in experts for _ in rows[e]], dtype=torch.long)
            rd = r.to(dev)
            y = self.timed(mod.rows, x_all[rd // k], s.to(dev), w_flat[rd], tensors)
            n = 0
            for e in experts:
                m = len(rows[e])
                parts[e] = (rd[n:n + m], y[n:n + m])
                n += m

        waited, staged, transient = 0.0, {}, []
        if p.serve == "host":
            run(hits, {e: p.slot_of[e] for e in hits}) if hits else None
            if not hasattr(loads.tier, "layer_views"):
                raise InputError(f"miss policy host computes experts where they live: it needs the host or a "
                                 f"throttled tier, not {loads.part.tier}")
            run(misses, {e: e for e in misses}, loads.tier.layer_views(mod.pos))  # [E, ...] views of the host copy
        elif p.serve == "low":
            futs, slot_of = loads.low(mod.pos, misses)
            try:  # a failed read or compute raises once the other reads have stopped writing their slots
                run(hits, {e: p.slot_of[e] for e in hits}) if hits else None
                t0 = time.perf_counter()
                for f in futs:
                    f.result()  # a failed read raises here
                waited += time.perf_counter() - t0
            except BaseException:
                quiesce(futs)
                raise
            run(misses, slot_of, loads.low_pool.views)
        else:
            d = loads.demand(mod.pos, misses, p.reused)
            staged, transient = d.staged, d.transient
            here = {e: p.slot_of[e] for e in hits}  # experts in the layer's own slots, not computed yet
            here.update((e, staged[e]) for e in p.reused)
            try:  # a failed read or compute raises once the step's other loads have stopped writing their slots
                for what, got in d.events():
                    if what == "started":
                        if here and got and loads.overlap:  # resident experts (and victims) compute while misses load
                            run(sorted(here), here)
                            here = {}
                    elif what == "staged":
                        here.update(got)
                        if loads.overlap:
                            run(sorted(here), here, arrivals=True)
                            here = {}
                    else:  # streamed: computed, then their slots take the next loads
                        run(sorted(got), got, d.spool.views)
            except BaseException:
                d.quiesce()
                raise
            waited = d.waited
            if here:
                if not parts and not mod.eager:  # everything in the layer's slots: the family's one call
                    out = self.in_slots(mod, hidden, [here[e] for e in flat], top_k_index, top_k_weights)
                    return out, (staged, transient, waited)
                run(sorted(here), here)
        # combine
        if one:
            out = sum(sums[key] for key in sorted(sums))
            return out.to(hidden.dtype).view_as(hidden), (staged, transient, waited)
        if mod.eager:  # eager: index_add of each expert's rows, in expert order, into the hidden dtype
            out = torch.zeros_like(x_all)
            for e in sorted(parts):
                r, y = parts[e]
                out.index_add_(0, r // k, y.to(out.dtype))
        else:  # grouped/batched implementations: the k weighted rows of a token summed
            buf = torch.empty(n_rows, x_all.shape[-1], dtype=next(iter(parts.values()))[1].dtype, device=dev)
            for r, y in parts.values():
                buf[r] = y
            out = buf.view(-1, k, x_all.shape[-1]).sum(dim=1).to(hidden.dtype)
        return out.view_as(hidden), (staged, transient, waited)
