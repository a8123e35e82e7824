"""One class per weight format of the experts the compute stage computes over (a slot pool's, a stream pool's, the
host copy's or the packed copy of `miss_precision`), behind one interface: `compute(x, slots, weights, tensors)`,
each token's weighted sum over its k choices. Each class is registered in `WEIGHT_FORMAT_REGISTRY` with the rule
that says whether it computes a given set of views (`fits`); `choose` takes the first that fits, in registration
order, once per pool format (`experts.OffloadedExperts`), so no call branches on the format:

- ``mixed``: a mixed-precision pool (`quantize --by_usage`: several packed formats, each slot tagged with its own),
  each format's pairs through that format's registered class (`quant.swiglu_mixed`);
- ``int8`` / ``int4``: packed experts (`expertcache quantize`): the integer CPU kernels where they take the shapes,
  triton's dequantizing kernel on CUDA, else dequantized (`quant.swiglu`);
- ``triton``: bf16/fp32 SwiGLU experts without biases on CUDA slots (`--engine.kernel triton`);
- ``cpu_bf16``: bf16 SwiGLU experts without biases on CPU slots, the AVX-512 kernel (`--engine.kernel cpu`/`auto`);
- ``native``: anything else, the family's own experts forward (bit-identical to plain generate).
"""

from __future__ import annotations

import copy

import torch

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.registry import Registry

from expertcache.runtime.kernels import cpu_kernels, quant
from expertcache.runtime.storage.store import FMT

WEIGHT_FORMAT_REGISTRY = Registry("expert weight format")


class ExpertFormat:
    """Computes experts of one weight format. `views`: the pool's `[S, ...]` tensors; `tmpl`: the family's experts
    module over them (config, act_fn, the pool's views as its parameters); `forward`: the family's experts forward.
    `one_call`: on CPU, one call computes a token's chosen experts' weighted sum (the compute stage then groups a
    one-token step's experts by call instead of gathering a row per expert)."""

    name = ""
    one_call = False

    def __init__(self, views: dict[str, torch.Tensor], tmpl, forward, kernel: str, device: str):
        self.views, self.tmpl, self.forward = views, tmpl, forward

    @classmethod
    def fits(cls, views: dict[str, torch.Tensor], tmpl, kernel: str, device: str) -> bool:
        """Whether this class computes `views` (a pool's) under `--engine.kernel` `kernel` on slots on `device`."""
        raise NotImplementedError

    def compute(self, x, slots, weights, tensors: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """`x [T, H]`, `slots [T, k]`, `weights [T, k]` -> `[T, H]`: over the pool's views, or over `tensors`
        (`[n, ...]` views of the same format: stream slots, the host copy of a layer)."""
        raise NotImplementedError

    def rows(self, x, slots, weights, tensors: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """`x [S, H]`, `slots [S]`, `weights [S]` -> each row's weighted expert output `[S, H]` (k = 1)."""
        return self.compute(x, slots[:, None], weights[:, None], tensors)

    def over(self, tensors):
        """The experts module over the pool, or over `tensors` (a copy: the pool's template stays)."""
        if tensors is None:
            return self.tmpl
        t = copy.copy(self.tmpl)
        for n, v in tensors.items():
            setattr(t, n, v)
        t.num_experts = next(iter(tensors.values())).shape[0]
        return t

    def describe(self) -> str:
        return self.name


def swiglu_layout(tmpl) -> bool:
    """`gate_up_proj [S, 2I, H]` / `down_proj [S, H, I]` tensors of a SwiGLU family (SiLU) without biases."""
    gu, dn = getattr(tmpl, "gate_up_proj", None), getattr(tmpl, "down_proj", None)
    act = getattr(getattr(tmpl, "config", None), "hidden_act", None)
    return (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3
            and gu.shape[1] == 2 * dn.shape[2] and not getattr(tmpl, "has_bias", False) and act == "silu")


def swiglu_bf16(tmpl) -> bool:
    """bf16 slots of a SwiGLU family without biases (`swiglu_layout`)."""
    return swiglu_layout(tmpl) and tmpl.gate_up_proj.dtype == torch.bfloat16 and tmpl.down_proj.dtype == torch.bfloat16


@WEIGHT_FORMAT_REGISTRY.register("mixed")
class Mixed(ExpertFormat):
    """A mixed-precision pool: its formats' views (`quant.format_views`), each computed by its own registered class,
    the partial sums added in fp32 (`quant.swiglu_mixed`)."""

    name, one_call = "mixed", True

    def __init__(self, views, tmpl, forward, kernel, device):
        super().__init__(views, tmpl, forward, kernel, device)
        self.formats = [choose(v, tmpl, forward, kernel, device) for v in quant.format_views(views)]

    @classmethod
    def fits(cls, views, tmpl, kernel, device):
        return FMT in views

    def compute(self, x, slots, weights, tensors=None):
        return quant.swiglu_mixed(x, self.views if tensors is None else tensors, slots, weights,
                                  [f.compute for f in self.formats])

    def describe(self):
        return "mixed(" + ", ".join(f.describe() for f in self.formats) + ")"


class Packed(ExpertFormat):
    """Packed experts (`runtime/kernels/quant.py`): the integer CPU kernels, triton's on CUDA, else dequantized."""

    bits, one_call = 0, True

    def __init__(self, views, tmpl, forward, kernel, device):
        super().__init__(views, tmpl, forward, kernel, device)
        _, self.group = quant.format_of(views)

    @classmethod
    def fits(cls, views, tmpl, kernel, device):
        f = quant.format_of(views)
        return f is not None and f[0] == cls.bits

    def compute(self, x, slots, weights, tensors=None):
        return quant.swiglu(x, self.views if tensors is None else tensors, slots, weights)


@WEIGHT_FORMAT_REGISTRY.register("int8")
class Int8(Packed):
    name, bits = "int8", 8


@WEIGHT_FORMAT_REGISTRY.register("int4")
class Int4(Packed):
    name, bits = "int4", 4


class Native(ExpertFormat):
    """The family's own experts forward (any dtype, any family): as plain generate computes."""

    name = "native"

    @classmethod
    def fits(cls, views, tmpl, kernel, device):
        return True

    def compute(self, x, slots, weights, tensors=None):
        return self.forward(self.over(tensors), x, slots, weights)


@WEIGHT_FORMAT_REGISTRY.register("triton")
class Triton(Native):
    """The triton SwiGLU kernel over CUDA slots (the whole layer's call); rows, stream slots and CPU inputs go
    through the family's own forward. Triton is imported on the first call, on a GPU."""

    name = "triton"

    @classmethod
    def fits(cls, views, tmpl, kernel, device):
        return kernel == "triton" and not getattr(tmpl, "has_bias", False)

    def compute(self, x, slots, weights, tensors=None):
        if x.is_cuda and tensors is None:
            from expertcache.runtime.kernels.triton_experts import swiglu_experts

            return swiglu_experts(x, self.tmpl.gate_up_proj, self.tmpl.down_proj, slots, weights)
        return super().compute(x, slots, weights, tensors)

    def rows(self, x, slots, weights, tensors=None):
        return super().compute(x, slots[:, None], weights[:, None], tensors)


@WEIGHT_FORMAT_REGISTRY.register("cpu_bf16")
class CpuBf16(Native):
    """bf16 SwiGLU experts without biases on CPU slots: calls whose experts have few (token, choice) pairs each
    (`cpu_kernels.expert_rows_fit`: a decode step, a short prompt chunk) through the AVX-512 kernel
    (`cpu_kernels.swiglu_bf16`), fp32 accumulation, equal to plain up to rounding; a long prompt's rows, inputs
    autograd records through, and CUDA inputs through the family's own forward."""

    name, one_call = "cpu_bf16", True

    @classmethod
    def fits(cls, views, tmpl, kernel, device):
        return kernel in ("cpu", "auto") and device == "cpu" and swiglu_bf16(tmpl) and cpu_kernels.available()

    def compute(self, x, slots, weights, tensors=None):
        # (not `decode_input`, whose no-grad rule is the linears': the engine's own drivers, the replay among them,
        # call with grad enabled and no input that requires it, and stay on the kernel)
        records = torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad)
        if x.is_cuda or records or not cpu_kernels.expert_rows_fit(slots):
            return super().compute(x, slots, weights, tensors)
        t = self.over(tensors)
        return cpu_kernels.swiglu_bf16(x, t.gate_up_proj, t.down_proj, slots, weights)


WEIGHT_FORMAT_REGISTRY.register("native", Native)  # last: it computes anything


def choose(views: dict[str, torch.Tensor], tmpl, forward, kernel: str, device: str) -> ExpertFormat:
    """The first registered format that computes `views` (decided once per pool format)."""
    for e in WEIGHT_FORMAT_REGISTRY.entries():
        if e.obj.fits(views, tmpl, kernel, device):
            return e.obj(views, tmpl, forward, kernel, device)
    raise AssertionError("native fits every pool")


def check_cpu_kernel(views: dict[str, torch.Tensor], tmpl, family: str) -> None:
    """`--engine.kernel cpu` where it cannot run: one line (bf16 SwiGLU without biases, or packed experts whose
    shapes the integer kernels take, and the extension built here)."""
    packed = quant.format_of(views)
    if packed is None and not swiglu_bf16(tmpl):
        dt = getattr(getattr(tmpl, "down_proj", None), "dtype", None)
        raise InputError(f"kernel cpu computes bf16 SwiGLU experts without biases; this model's experts are "
                         f"{family} in {dt}: use --engine.kernel auto or native")
    if not cpu_kernels.available():
        raise InputError(f"kernel cpu: the CPU expert kernels are unavailable here ({cpu_kernels.why_unavailable()});"
                         f" use --engine.kernel auto or native")
    if packed is not None:
        if not quant.kernel_fits(views):
            sc = views["down_proj.scales"]
            raise InputError(f"kernel cpu: the integer kernels need hidden and intermediate sizes that are multiples "
                             f"of 64 and of the group size ({packed[1]}); this model's are {sc.shape[1]} and "
                             f"{sc.shape[2] * packed[1]}: use --engine.kernel auto (it dequantizes these)")
