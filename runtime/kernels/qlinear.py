"""Quantized non-expert linears (`expertcache quantize --linears true`): `QuantLinear`, an `nn.Linear` whose weight
is packed group-wise integers in the experts' format (`quant`), computed by the CPU integer kernel for decode-sized
inputs and dequantized for the rest."""

from __future__ import annotations

import torch

from expertcache.telemetry.errors import InputError
from expertcache.runtime.kernels import cpu_kernels
from expertcache.runtime.kernels.quant import check_group, dequantize


LINEAR_PARTS = {"q": "weight_q", "scales": "weight_scales", "mins": "weight_mins"}  # part -> buffer name


class QuantLinear(torch.nn.Module):
    """An `nn.Linear` whose weight is packed group-wise integers (the format above, for one `[out, in]` matrix).
    Decode-sized inputs (at most `cpu_kernels.MAX_ROWS` rows, CPU) go through the integer kernel, which reads the
    packed bytes once; larger inputs (a prefill, a batched evaluation), GPUs and machines without the extension
    compute with the weight dequantized for the call, in the input's dtype (the same weights; on the CPU by
    `cpu_kernels.dequant_q` into a reused buffer, 25x faster than `quant.dequantize` for a 4096 x 2048 int4 matrix).
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group: int, bias: bool,
                 dtype: torch.dtype = torch.bfloat16, device="meta", symmetric: bool = False):
        super().__init__()
        check_group(bits, group, in_features)
        self.in_features, self.out_features, self.bits, self.group = in_features, out_features, bits, group
        self.symmetric = bits == 8 or symmetric  # int4 without minimums (`quantize(symmetric=True)`)
        qshape = [out_features, in_features if bits == 8 else in_features // 2]
        self.register_buffer("weight_q", torch.empty(qshape, dtype=torch.int8 if bits == 8 else torch.uint8,
                                                     device=device))
        sshape = [out_features, in_features // group]
        self.register_buffer("weight_scales", torch.empty(sshape, dtype=torch.float16, device=device))
        if not self.symmetric:
            self.register_buffer("weight_mins", torch.empty(sshape, dtype=torch.float16, device=device))
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                       requires_grad=False) if bias else None

    def packed(self) -> dict[str, torch.Tensor]:
        return {p: getattr(self, b) for p, b in LINEAR_PARTS.items() if hasattr(self, b)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.decode_input(x) and self.in_features % 64 == 0 and cpu_kernels.available():
            return cpu_kernels.linear_q(x, self.weight_q, self.weight_scales, getattr(self, "weight_mins", None),
                                        self.bits, self.group, self.bias)
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and self.in_features % 64 == 0 \
                and cpu_kernels.available():  # one pass in C++ (bit for bit `dequantize`), into a reused buffer
            keeps = torch.is_grad_enabled() and x.requires_grad  # autograd keeps the weight for the backward
            n = self.in_features * self.out_features
            w = cpu_kernels.dequant_q(self.packed(), self.bits, self.group, x.dtype,
                                      None if keeps else cpu_kernels.scratch("linear", x.dtype, n))
        else:
            w = dequantize(self.packed(), self.bits, self.group, x.dtype)
        return torch.nn.functional.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}"
                f"{' symmetric' if self.bits == 4 and self.symmetric else ''}, group={self.group}, "
                f"bias={self.bias is not None}")


def quantizable_linears(model, expert_prefixes, routers, bits: int, group: int) -> tuple[list[str], list[str]]:
    """(names, skipped with why) of the non-expert `nn.Linear`s `--linears true` packs: every one outside the
    routed experts whose input size the kernel takes (a multiple of 64 and of the group), except the routers (their
    top-k decides which experts run: kept exact) and an output head tied to the input embeddings."""
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    out_emb = model.get_output_embeddings()
    router_ids = {id(r) for r in routers}
    names, skipped = [], []
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear or name.startswith(tuple(expert_prefixes)):
            continue
        if id(mod) in router_ids:
            continue
        if tied and mod is out_emb:
            skipped.append(f"{name}: tied to the input embeddings")
        elif mod.in_features % group or mod.in_features % 64:
            skipped.append(f"{name}: input size {mod.in_features} is not a multiple of 64 and of group {group}")
        else:
            names.append(name)
    return names, skipped


def install_linears(model, names: list[str], bits: int, group: int, symmetric: bool = False) -> None:
    """Replace the named `nn.Linear`s of a (meta) model by `QuantLinear`s of the same shape (their buffers on meta,
    filled by the loader from the checkpoint)."""
    for name in names:
        parent, _, attr = name.rpartition(".")
        try:
            owner = model.get_submodule(parent) if parent else model
        except AttributeError:
            owner = None
        old = getattr(owner, attr, None)
        if type(old) is not torch.nn.Linear:
            raise InputError(f"quantization_config lists linear {name!r}, which this model does not have as a linear "
                             f"layer (damaged config.json)")
        dtype = old.weight.dtype
        setattr(owner, attr, QuantLinear(old.in_features, old.out_features, bits, group, old.bias is not None, dtype,
                                         symmetric=symmetric))
