"""The compute stage: `OffloadedExperts` replaces a MoE layer's `experts` module and computes its tokens' experts from
the engine's cache slots, per weight format (bf16 through the CPU kernels or the model's own implementation,
int8/int4 through the integer kernels), resident experts first."""

from __future__ import annotations

import copy

import torch
from torch import nn

from expertcache.telemetry.errors import InputError

from expertcache.runtime.kernels import cpu_kernels, quant
from expertcache.runtime.storage.tiers import SlotPool


class OffloadedExperts(nn.Module):
    """Stands in for a HF experts module; computes with the original class's forward over the slot pool."""

    def __init__(self, engine, pos: int, original: nn.Module, pool: SlotPool):  # engine: the OffloadEngine
        super().__init__()
        self._engine = [engine]  # a list: not registered as a submodule
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
        self._tmpl = tmpl
        self.quant = quant.format_of(pool.views)  # (bits, group) of an `expertcache quantize` checkpoint, else None
        self._views = pool.views
        self.swiglu_ok = self._swiglu_ok()  # fixed by the family and the slots' dtype: decided once
        self.cpu_kernel = False  # set by the engine: whether the CPU expert kernel computes this layer
        self._forward = type(original).forward
        impl = getattr(getattr(original, "config", None), "_experts_implementation", None)
        self.eager = impl in (None, "eager")  # eager adds experts one by one in expert order; the others sum over k

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self._engine[0].run_layer(self, hidden_states, top_k_index, top_k_weights)

    def fast_kernel(self, x: torch.Tensor) -> bool:
        """Whether the CPU expert kernel computes this call: the engine chose it for this layer (`cpu` or `auto`, a
        SwiGLU family without biases whose slots are bf16 on the CPU, the extension built here: `OffloadEngine`
        decides once; `cpu` where it cannot apply was refused by `EngineConfig.check` or `_check_cpu_kernel`)."""
        return self.cpu_kernel and not x.is_cuda

    def _swiglu_ok(self) -> bool:
        """bf16 `gate_up_proj [S, 2I, H]` / `down_proj [S, H, I]` slots of a SwiGLU family without biases."""
        v = self._tmpl
        if self.quant is not None:
            return False  # the integer path (`quant.swiglu`) computes these; kernel cpu is the bf16 one
        gu, dn = getattr(v, "gate_up_proj", None), getattr(v, "down_proj", None)
        act = getattr(getattr(v, "config", None), "hidden_act", None)
        return (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dtype == torch.bfloat16
                and dn.dtype == torch.bfloat16 and gu.dim() == 3 and dn.dim() == 3
                and gu.shape[1] == 2 * dn.shape[2] and not getattr(v, "has_bias", False) and act == "silu")

    def compute(self, hidden, slot_index, weights, tensors: dict[str, torch.Tensor] | None = None):
        """All (token, choice) pairs at once over the slot pool (or over `tensors`, `[n, ...]` views such as the
        stream slots): the family's own forward, as plain generate (or the CPU kernel / the triton SwiGLU kernel,
        when the engine is configured for them)."""
        if self._engine[0].cfg.kernel == "triton" and hidden.is_cuda and not getattr(self._tmpl, "has_bias", False) \
                and tensors is None and self.quant is None:  # (packed experts: quant.swiglu's own triton kernel)
            from expertcache.runtime.kernels.triton_experts import swiglu_experts

            v = self._tmpl
            return swiglu_experts(hidden, v.gate_up_proj, v.down_proj, slot_index, weights)
        return self._on_cpu_or_native(hidden, slot_index, weights, tensors)

    def rows(self, x, slots, weights, tensors: dict[str, torch.Tensor] | None = None):
        """`x [S, H]`, `slots [S]`, `weights [S]` -> each (token, choice) row's weighted expert output `[S, H]`,
        through the family's own forward with k = 1 (the same kernels and roundings as the full call), over the
        slot pool or over `tensors` (`[n, ...]` views, e.g. the host copy of a layer)."""
        return self._on_cpu_or_native(x, slots[:, None], weights[:, None], tensors)

    def _on_cpu_or_native(self, x, slot_index, weights, tensors):
        """`compute` without the triton kernel: the integer kernels for packed experts (the slots', or the
        miss_precision copy's), the bf16 CPU kernel where the engine chose it, else the family's own forward."""
        if self.quant is not None or (tensors is not None and quant.format_of(tensors) is not None):
            return quant.swiglu(x, tensors if tensors is not None else self._views, slot_index, weights)
        t = self._over(tensors)
        if self.fast_kernel(x):
            return cpu_kernels.swiglu_bf16(x, t.gate_up_proj, t.down_proj, slot_index, weights)
        return self._forward(t, x, slot_index, weights)

    def _over(self, tensors):
        """The experts module over the slot pool, or over `tensors` (a copy: the pool's template stays)."""
        if tensors is None:
            return self._tmpl
        t = copy.copy(self._tmpl)
        for n, v in tensors.items():
            setattr(t, n, v)
        t.num_experts = next(iter(tensors.values())).shape[0]
        return t


def _check_cpu_kernel(mod: OffloadedExperts) -> None:
    if mod.quant is None and not mod.swiglu_ok:
        v = mod._tmpl
        dt = getattr(getattr(v, "down_proj", None), "dtype", None)
        raise InputError(f"kernel cpu computes bf16 SwiGLU experts without biases; this model's experts are "
                         f"{type(mod._proto[0]).__name__} in {dt}: use --engine.kernel auto or native")
    if not cpu_kernels.available():
        raise InputError(f"kernel cpu: the CPU expert kernels are unavailable here ({cpu_kernels.why_unavailable()});"
                         f" use --engine.kernel auto or native")
    if mod.quant is not None:
        if not quant.kernel_fits(mod._views):
            sc = mod._views["down_proj.scales"]
            raise InputError(f"kernel cpu: the integer kernels need hidden and intermediate sizes that are multiples "
                             f"of 64 and of the group size ({mod.quant[1]}); this model's are {sc.shape[1]} and "
                             f"{sc.shape[2] * mod.quant[1]}: use --engine.kernel auto (it dequantizes these)")
