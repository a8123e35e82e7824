"""Router training on a checkpoint whose experts do not fit in memory: the experts stay frozen in the checkpoint
(bf16 in place, or an `expertcache quantize` store of int8/int4) and are read through the decode side's tiers.

    base = open_streamed("ckpt/", tier="disk")    # non-expert weights read (`loader.build_offloaded`); experts not
    base.model(input_ids=ids, labels=ids)          # every MoE block's experts are a `StreamedExperts`
    base.save_into(folder, base.model)             # the checkpoint copied, its router tensors rewritten in place

Per pass (a forward, or a backward) each MoE layer reads every expert its tokens selected once, into one layer's
slot pool (`tiers.SlotPool` of E slots, reused by every layer), and computes all of that expert's tokens at once.
Gradients reach the routing weights (so the routers) and the hidden states (so earlier layers' routers), never the
experts, and no expert outlives its layer. Two paths:
- the SwiGLU families (`swiglu_fits`: qwen3_moe, mixtral, olmoe, deepseek_v3): `_SwigluStreamed` keeps each
  (token, choice)'s gate, up and output from the forward and has a backward of its own, which reads the experts
  again for the two products through them (none for the first MoE layer, whose input needs no gradient), and
  starts reading the first chunk of the layer below while its own last chunk computes; packed experts are
  dequantized one at a time;
- any other family: `_Streamed` runs the family's own experts forward over the slots (packed experts dequantized a
  chunk at a time), and the backward reads them again and recomputes it under autograd.

`plan` sizes a run from the checkpoint's headers alone (nothing is read but the config and the safetensors or store
headers), so a budget too small is refused before any work (`floor_bytes`).
"""

from __future__ import annotations

import copy
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.memory import rss_bytes

from expertcache.runtime.kernels import quant
from expertcache.runtime.storage.store import FMT
from expertcache.runtime.storage.tiers import SlotPool, make_tier, tier_host_bytes, TIER_REGISTRY

WORKERS = 4  # concurrent expert reads (the disk tier splits each large one further: `tiers.SPLIT`)
CHUNK = 16  # experts per compute chunk; two chunks' slots are held (one computing, one reading)


@dataclass
class StreamPlan:
    """What a streamed run holds, from headers only: bytes of each part (for `floor_bytes`)."""

    path: str
    family: str
    num_layers: int  # MoE layers
    num_experts: int
    top_k: int
    hidden: int
    vocab: int
    expert_params: int  # parameters of one expert
    expert_bytes: int  # one expert as stored (bf16, or packed)
    block_bytes: int  # one slot
    experts_bytes: int  # every routed expert as stored
    non_expert_params: int
    router_params: int
    dtype_bytes: int  # the compute dtype's element size
    quant_bits: int | None  # 8 / 4 for an `expertcache quantize` checkpoint
    tier: str

    def describe(self) -> dict:
        return dict(self.__dict__)


def plan(path: str | Path, dtype: torch.dtype, tier: str = "disk") -> StreamPlan:
    """Sizes of a streamed run on the checkpoint at `path` (config, headers, a meta-device model: no weight read).
    A mixed-precision checkpoint or an unknown tier is refused here."""
    from expertcache.runtime.storage.loader import _skeleton, resolve

    TIER_REGISTRY.parse(tier)  # a bad name: one line listing the tiers
    if tier == "auto":
        raise InputError("train.expert_tier=auto: name the tier experts are read from while training: disk (the "
                         "checkpoint, page cache bypassed) or host (every expert in RAM)")
    path = resolve(path)
    qc = quant.read_config(path)
    if qc is not None and qc["bits"] == quant.MIXED:
        raise InputError(f"{path} holds mixed-precision experts (quantize --by_usage); streamed training reads one "
                         f"format: quantize the base with one --bits")
    ckpt, config, adapter, model, prefixes, params = _skeleton(path, dtype)
    pre = tuple(p + "." for p in prefixes)
    es = dtype.itemsize
    e_params = sum(int(torch.Size(s).numel()) for s, _ in params.values())
    if qc is not None:
        source = quant.open_source(path, qc, False)
        meta = source.meta
    else:
        from expertcache.runtime.storage.loader import expert_source

        meta = expert_source(path).meta  # as stored: the slots hold the checkpoint's dtype, converted per use
    non_expert = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(pre))
    routers = sum(p.numel() for L in adapter.moe_layers(model) for p in L.router.parameters())
    cfg = model.config.get_text_config()
    return StreamPlan(str(path), adapter.family, len(prefixes), adapter.num_experts, adapter.top_k,
                      adapter.hidden_size, int(cfg.vocab_size), e_params, meta.expert_bytes, meta.block_bytes,
                      len(prefixes) * adapter.num_experts * meta.expert_bytes, non_expert, routers, es,
                      qc["bits"] if qc is not None else None, tier)


def floor_bytes(p: StreamPlan, tokens: int, distill: bool, chunk: int = CHUNK) -> dict:
    """The least memory a streamed router-training step on `tokens` tokens (batch x sequence) needs, by part, in
    bytes. Activations are counted as a decoder layer keeps them for the backward (about 20 H-wide rows per token,
    attention's included; per choice the expert's recomputed gate, up and output; the router's E
    logits), the logits four times (logits, log-softmax, their gradient, the teacher's log-probabilities)."""
    b = p.dtype_bytes
    c = min(chunk, p.num_experts)
    one_layer = min(2 * c, p.num_experts) * p.block_bytes  # the slot pool: two chunks (computing, reading)
    if p.quant_bits is not None:  # a chunk dequantized to bf16, one expert's fp32 intermediates (x3)
        one_layer += c * p.expert_params * 2 + 3 * p.expert_params * 4
    inter = p.expert_params // (3 * p.hidden) if p.hidden else 0
    per_token_layer = 20 * p.hidden + p.top_k * (3 * inter + 2 * p.hidden) + 2 * p.num_experts
    parts = {
        "process": rss_bytes(),  # python, torch, the tokenizer: measured, not estimated
        "non_expert_weights": p.non_expert_params * b,
        "router_state": p.router_params * (4 * 4 + (b if distill else 0)),  # fp32 weight, grad, 2 Adam; KD copy
        "experts_in_flight": one_layer,
        "staging": tier_host_bytes(p.tier, _meta_like(p), WORKERS) if p.tier == "disk" else
        p.num_layers * p.num_experts * p.block_bytes,
        "activations": tokens * (p.num_layers * per_token_layer * b + 4 * p.vocab * 4),
    }
    parts["total"] = sum(parts.values())
    return parts


def _meta_like(p: StreamPlan):
    class M:  # what `tier_host_bytes` reads of a store's meta
        block_bytes = p.block_bytes
        num_layers = p.num_layers
        num_experts = p.num_experts
    return M


def check_budget(p: StreamPlan, memory_gb: float, tokens: int, distill: bool, adapter_bytes: int = 0) -> dict:
    """The floor's parts; `InputError` (one line, the floor printed) when `memory_gb` is below it.
    `adapter_bytes`: what attention adapters trained beside the routers add (their state and activations)."""
    parts = floor_bytes(p, tokens, distill)
    if adapter_bytes:
        parts["adapters"] = adapter_bytes
        parts["total"] += adapter_bytes
    if memory_gb * 1e9 < parts["total"]:
        gb = {k: v / 1e9 for k, v in parts.items()}
        raise InputError(
            f"train.memory_gb={memory_gb:g} is below the floor of {gb['total']:.3f} GB for streamed training of "
            f"{p.path} ({tokens} tokens per step): non-expert weights {gb['non_expert_weights']:.3f}, experts in "
            f"flight {gb['experts_in_flight']:.3f}, activations {gb['activations']:.3f}, router state "
            f"{gb['router_state']:.3f}" + (f", adapters {gb['adapters']:.3f}" if "adapters" in gb else "")
            + f", reads {gb['staging']:.3f}, this process {gb['process']:.3f} GB; raise "
            f"train.memory_gb to at least {gb['total']:.3f} or lower data.batch_size / data.seq_len")
    return parts


def check_resident(base: "StreamedBase", memory_gb: float, parts: dict) -> int:
    """After the base is open and the data ready (before the first step): what this process holds now (measured)
    plus what a step adds (`floor_bytes`' activations, router state and dequantized chunk; the slot pool is
    already resident) must fit `memory_gb`. Returns that need in bytes; `InputError` (one line) when it does not fit:
    the header-only floor cannot see the corpus's tokens or the allocator's overhead."""
    now = rss_bytes()
    pool = base.reader.pool.n_slots * base.reader.meta.block_bytes
    need = now + max(0, parts["experts_in_flight"] - pool) + parts["activations"] + parts["router_state"] \
        + parts.get("adapters", 0)
    if memory_gb * 1e9 < need:
        raise InputError(f"train.memory_gb={memory_gb:g}: with the base open and the data ready this process holds "
                         f"{now / 1e9:.3f} GB, and a step adds {(need - now) / 1e9:.3f} GB: {need / 1e9:.3f} GB in "
                         f"all; raise train.memory_gb or lower data.batch_size / data.seq_len")
    return need


class LayerReader:
    """Expert reads for one layer at a time over a tier, in chunks of `chunk` experts: `chunks(layer, experts)`
    yields each chunk's `[n, ...]` slot views as it lands, the next chunk already reading into the other half of a
    pool of 2 x `chunk` slots (reads overlap compute). Each expert asked for is read once; counts what it moved."""

    def __init__(self, source, tier: str, workers: int = WORKERS, chunk: int = CHUNK):
        self.tier = make_tier(tier, source, "cpu")
        self.meta = source.meta
        if FMT in SlotPool(self.meta, 1).views:
            raise InputError("mixed-precision experts are not streamed for training; quantize with one --bits")
        e = self.meta.num_experts
        self.chunk = max(1, min(chunk, e))
        self.dtype = weights_dtype(self.meta)
        self.pool = SlotPool(self.meta, min(2 * self.chunk, e), touch=True)  # chunk g in slots (g % 2) * chunk on
        self.ex = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="train-read")
        self.reads = self.bytes_read = 0
        self.wait_s = 0.0  # time compute waited for reads (what overlap did not hide)
        self.buffers: dict[str, torch.Tensor] = {}  # packed experts dequantized: one chunk's, reused (`compute_weights`)
        self.half = 0  # the pool's half the next chunk goes to (chunks alternate halves across passes too)
        self.ahead = None  # (layer, first chunk's experts, futures, half): a next pass's first chunk, already reading
        self.ahead_hits = 0  # passes that started on a chunk read ahead
        self.back_plan: dict[int, list[int] | None] = {}  # per layer: the experts its backward reads (`_SwigluStreamed`)

    def _submit(self, layer: int, group: list[int], half: int):
        c = self.chunk
        return [self.ex.submit(self.tier.read, layer, e, self.pool, half * c + j) for j, e in enumerate(group)]

    def chunks(self, layer: int, experts: list[int], then: tuple[int, list[int]] | None = None):
        """`(index of the chunk's first expert in experts, {name: [n, ...] views})` per chunk, in order. `then`:
        the `(layer, experts)` of the pass that follows this one, whose first chunk starts reading while this pass's
        last chunk computes (so the next layer does not start by waiting; a pass that turns out different waits for
        it and reads its own)."""
        c = self.chunk
        groups = [experts[i:i + c] for i in range(0, len(experts), c)]
        ahead, self.ahead = self.ahead, None
        full = self.pool.n_slots >= 2 * c  # two whole halves (else E < 2 chunks: a pass starts at half 0, no read-ahead)
        pending, half = [], self.half if full else 0
        if ahead is not None:
            if groups and ahead[0] == layer and ahead[1] == groups[0]:
                pending, half = ahead[2], ahead[3]  # read ahead by the pass before: its half of the pool
                self.ahead_hits += 1
            else:  # not this pass's: it must land before its slots are read into again (and it was read)
                self.bytes_read += sum(f.result() for f in ahead[2])
                self.reads += len(ahead[2])
        if groups and not pending:
            pending = self._submit(layer, groups[0], half)
        try:
            for g, group in enumerate(groups):
                t0 = time.perf_counter()
                futs, pending = pending, []
                self.bytes_read += sum(f.result() for f in futs)
                self.wait_s += time.perf_counter() - t0
                self.reads += len(group)
                b = half * c
                half ^= 1  # the other half: the chunk before this one is done with it
                if g + 1 < len(groups):
                    pending = self._submit(layer, groups[g + 1], half)  # while this chunk computes
                elif then is not None and then[1] and full:
                    first = then[1][:c]
                    self.ahead = (then[0], first, self._submit(then[0], first, half), half)
                self.half = half
                yield g * c, {k: v[b:b + len(group)] for k, v in self.pool.views.items()}
        finally:  # an abandoned pass: no read may still be writing a slot when the next one starts
            for f in pending:
                f.exception()

    def counters(self) -> dict:
        return {"reads": self.reads, "bytes_read": self.bytes_read, "read_wait_s": self.wait_s}

    def close(self) -> None:
        if self.ahead is not None:
            for f in self.ahead[2]:
                f.exception()
            self.ahead = None
        self.ex.shutdown(wait=True)
        self.tier.close()


def weights_dtype(meta) -> torch.dtype:
    """The dtype experts compute in: the checkpoint's own float dtype (bf16 in place: no copy, the CPU's bf16
    matrix units), bf16 for packed experts (dequantized per use)."""
    dt = meta.tensors[0].torch_dtype
    return dt if dt.is_floating_point else torch.bfloat16


def compute_weights(views: dict[str, torch.Tensor], dtype: torch.dtype,
                    buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The experts' tensors as the family's forward takes them, in `dtype`: views of the slots as they are, or
    packed ones dequantized (`quant.dequantize`: exactly the weights the integer kernels multiply) into a `[n, ...]`
    tensor. With the CPU kernels, the whole chunk in one pass into `buffers` (one per tensor name, reused by every
    chunk and layer: valid until the next call); without them, one expert at a time in torch (the fp32
    intermediates of one expert, not of the chunk)."""
    fmt = quant.format_of(views)
    if fmt is None:
        return {k: v if v.dtype == dtype else v.to(dtype) for k, v in views.items()}
    bits, group = fmt
    out = {}
    from expertcache.runtime.kernels import cpu_kernels

    fast = dtype in (torch.bfloat16, torch.float32) and cpu_kernels.available()
    for name in sorted({k.rsplit(".", 1)[0] for k in views}):
        parts = quant.parts(views, name)
        if fast:
            q = parts["q"]
            n = q.numel() * (2 if bits == 4 else 1)
            buf = None if buffers is None else buffers.get(name)
            if buf is None or buf.dtype != dtype or buf.numel() < n:
                buf = torch.empty(n, dtype=dtype)
                if buffers is not None:
                    buffers[name] = buf
            out[name] = cpu_kernels.dequant_q(parts, bits, group, dtype, out=buf)
            continue
        first = quant.dequantize({k: v[0] for k, v in parts.items()}, bits, group, dtype)
        t = out[name] = torch.empty((parts["q"].shape[0], *first.shape), dtype=dtype)
        t[0] = first
        for i in range(1, t.shape[0]):
            t[i] = quant.dequantize({k: v[i] for k, v in parts.items()}, bits, group, dtype)
    return out


class _Streamed(torch.autograd.Function):
    """out = experts(x, ids, w) with the experts read by `mod` in the forward and again in the backward (nothing of
    them is saved: only x, w and ids). Gradients for x and w, none for the experts; the backward takes them chunk
    by chunk, so no more than a chunk's recomputation is alive at once."""

    @staticmethod
    def forward(ctx, x, w, ids, mod):
        ctx.mod = mod
        ctx.save_for_backward(x, w, ids)
        out = None
        for y in mod.chunk_outputs(x, w, ids):
            out = y if out is None else out + y
        return out if out is not None else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        x, w, ids = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        if not any(need):
            return None, None, None, None
        grads = [None, None]
        with torch.enable_grad():
            xi, wi = x.detach().requires_grad_(need[0]), w.detach().requires_grad_(need[1])
            ins = [t for t, n in zip((xi, wi), need) if n]
            for y in ctx.mod.chunk_outputs(xi, wi, ids):
                part = iter(torch.autograd.grad(y, ins, g))
                for i in (0, 1):
                    if need[i]:
                        d = next(part)
                        grads[i] = d if grads[i] is None else grads[i] + d
        return grads[0], grads[1], None, None


# The experts classes whose forward is transformers' shared SwiGLU loop over fused 3-D tensors (the same source in
# each): per expert, gate, up = x gate_up^T; h = silu(gate) * up; y = h down^T; out += y * routing weight.
SWIGLU_CLASSES = ("Qwen3MoeExperts", "MixtralExperts", "OlmoeExperts", "DeepseekV3Experts")


def swiglu_fits(original: nn.Module) -> bool:
    """True when `original` is one of `SWIGLU_CLASSES` with the decode kernels' SwiGLU layout (`formats.
    swiglu_layout`: SiLU, `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], no biases): then `_SwigluStreamed`
    computes what its forward computes."""
    from expertcache.runtime.engine.formats import swiglu_layout

    return type(original).__name__ in SWIGLU_CLASSES and swiglu_layout(original)


class _SwigluStreamed(torch.autograd.Function):
    """`_Streamed` for the SwiGLU families (`swiglu_fits`), with a backward of its own instead of recomputing the
    forward under autograd: the forward keeps each (token, choice)'s gate and up `[P, 2I]` and unweighted output
    `[P, H]` (the activations a MoE layer keeps in memory anyway), and the backward reads each expert once more for
    the two products through it (`dh = g_y down`, `dx = [dgate, dup] gate_up`): three products a pass where the
    recomputation took six. Experts compute one at a time (a packed one dequantized into a buffer of one expert's
    size, which stays in the cache for its products)."""

    @staticmethod
    def forward(ctx, x, w, ids, mod):
        reader = mod._reader[0]
        wdt, out_dt = reader.dtype, x.dtype
        T, k = ids.shape
        x, w = x.detach().to(wdt), w.detach().to(wdt)
        used, inv = ids.unique(return_inverse=True)
        order = torch.argsort(inv.reshape(-1), stable=True)  # (token, choice) pairs by expert, then by token
        tok = order // k
        offs = [0] + torch.bincount(inv.reshape(-1), minlength=used.numel()).cumsum(0).tolist()
        inter = mod.intermediate
        gu = torch.empty(order.numel(), 2 * inter, dtype=wdt)
        ys = torch.empty(order.numel(), x.shape[1], dtype=wdt)
        xs = x[tok]
        if ctx.needs_input_grad[0]:  # this layer's backward reads these (the layer below
            reader.back_plan[mod.pos] = used.tolist()  # reads ahead into them: `experts_of(then=...)`)
        for e, a, b, W in mod.experts_of(used, offs):
            gu[a:b] = W.mm("gate_up_proj", xs[a:b])
            h = mod.act(gu[a:b, :inter]) * gu[a:b, inter:]
            ys[a:b] = W.mm("down_proj", h)
        wp = w.reshape(-1)[order]
        out = torch.zeros_like(x).index_add_(0, tok, ys * wp[:, None])
        ctx.mod, ctx.used, ctx.offs, ctx.k = mod, used, offs, k
        ctx.in_dtypes = (out_dt, w.dtype)
        ctx.save_for_backward(order, wp, gu, ys)
        return out.to(out_dt)

    @staticmethod
    def backward(ctx, g):
        order, wp, gu, ys = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        if not (need_x or need_w):
            return None, None, None, None
        mod, k = ctx.mod, ctx.k
        wdt = gu.dtype
        tok = order // k
        T = g.shape[0]
        gs = g.to(wdt)[tok]  # [P, H]
        dw = None
        if need_w:  # d out / d weight of a pair = its unweighted output
            dwp = (gs.float() * ys.float()).sum(-1)
            dw = torch.zeros(T * k, dtype=torch.float32).index_put_((order,), dwp).view(T, k).to(ctx.in_dtypes[1])
        dx = None
        if need_x:
            inter = mod.intermediate
            gy = gs * wp[:, None]
            dxs = torch.empty_like(gs)
            plan = mod._reader[0].back_plan
            below = [p for p in plan if p < mod.pos and plan[p]]
            then = (max(below), plan[max(below)]) if below else None  # the next backward to read
            for e, a, b, W in mod.experts_of(ctx.used, ctx.offs, then):
                dh = W.mm("down_proj", gy[a:b], trans=True).float()  # [m, I]
                gate, up = gu[a:b, :inter].float(), gu[a:b, inter:].float()
                sg = torch.sigmoid(gate)
                act = gate * sg
                dgu = torch.cat((dh * up * (sg * (1 + gate * (1 - sg))), dh * act), 1).to(wdt)
                dxs[a:b] = W.mm("gate_up_proj", dgu, trans=True)
            dx = torch.zeros(T, gs.shape[1], dtype=wdt).index_add_(0, tok, dxs).to(ctx.in_dtypes[0])
        return dx, dw, None, None


class _DenseExpert:
    """One expert's weights as float tensors: `mm(name, x)` = x W^T, `mm(name, x, trans=True)` = x W."""

    def __init__(self, w: dict[str, torch.Tensor]):
        self.w = w

    def mm(self, name: str, x: torch.Tensor, trans: bool = False) -> torch.Tensor:
        return x @ self.w[name] if trans else x @ self.w[name].t()


class _PackedExpert:
    """One int4 expert as its packed parts, multiplied on the tile units (`cpu_kernels.qmm_amx`)."""

    def __init__(self, parts: dict[str, dict[str, torch.Tensor]], group: int):
        self.parts, self.group = parts, group

    def mm(self, name: str, x: torch.Tensor, trans: bool = False) -> torch.Tensor:
        from expertcache.runtime.kernels import cpu_kernels

        return cpu_kernels.qmm_amx(x, self.parts[name], self.group, trans)


def _packed_amx(views: dict[str, torch.Tensor], dtype: torch.dtype):
    """`({name: parts}, group)` when a chunk's experts can multiply packed on the tile units (int4, bf16 compute,
    shapes `cpu_kernels.qmm_fits` takes, a CPU with AMX-BF16 and its state granted); None otherwise."""
    fmt = quant.format_of(views)
    if fmt is None or fmt[0] != 4 or dtype != torch.bfloat16:
        return None
    from expertcache.runtime.kernels import cpu_kernels

    parts = {name: quant.parts(views, name) for name in ("gate_up_proj", "down_proj")}
    if not all(cpu_kernels.qmm_fits({k: v[0] for k, v in p.items()}, 4, fmt[1]) for p in parts.values()):
        return None
    if not cpu_kernels.amx_available():
        return None
    return parts, fmt[1]


class StreamedExperts(nn.Module):
    """Stands in for a MoE block's experts module: `forward(hidden [T, H], top_k_index [T, k], top_k_weights
    [T, k])` as the original, computed by the original class's forward over the experts read for this call, one
    chunk of experts at a time."""

    def __init__(self, reader: LayerReader, pos: int, original: nn.Module, swiglu: bool | None = None):
        super().__init__()
        self._reader = [reader]  # a list: not a submodule
        self.pos = pos
        proto = copy.copy(original)  # config, act_fn, ...; no parameters (the experts stay in the checkpoint)
        proto._parameters = {}
        proto._modules = dict(original._modules)
        self._proto = proto
        self._forward = type(original).forward
        # the SwiGLU families' own backward (`_SwigluStreamed`), or the family's forward under autograd (any family)
        self.swiglu = swiglu_fits(original) if swiglu is None else swiglu
        if self.swiglu:
            self.intermediate = original.down_proj.shape[2]
            self.act = original.act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        fn = _SwigluStreamed if self.swiglu else _Streamed
        return fn.apply(hidden_states, top_k_weights, top_k_index, self)

    def experts_of(self, used: torch.Tensor, offs: list[int], then=None):
        """`(expert, first pair, end pair, weights)` for each expert in `used` that has pairs, in order, as the
        reader lands them (one pass: each read once; `then`: `LayerReader.chunks`' next pass). `weights.mm(name, x,
        trans)` is `x W^T` (`x W`): int4 experts on a CPU with tile units multiply packed (`cpu_kernels.qmm_amx`),
        other packed ones are dequantized one expert at a time into the reader's buffers (valid until the next)."""
        r = self._reader[0]
        for start, views in r.chunks(self.pos, used.tolist(), then):
            n = next(iter(views.values())).shape[0]
            packed = _packed_amx(views, r.dtype)
            for j in range(n):
                a, b = offs[start + j], offs[start + j + 1]
                if b <= a:
                    continue
                if packed is not None:
                    parts, group = packed
                    yield start + j, a, b, _PackedExpert({k: {p: v[j] for p, v in t.items()} for k, t in parts.items()},
                                                         group)
                else:
                    W = compute_weights({kk: v[j:j + 1] for kk, v in views.items()}, r.dtype, r.buffers)
                    yield start + j, a, b, _DenseExpert({kk: v[0] for kk, v in W.items()})

    def chunk_outputs(self, x, w, ids):
        """Each chunk's part of the layer's output `[T, H]` (their sum is the output)."""
        used, inv = ids.unique(return_inverse=True)  # [n] sorted: slots in expert order, as in memory
        inv = inv.view_as(ids)
        wdt = self._reader[0].dtype
        out_dt = x.dtype
        x, w = x.to(wdt), w.to(wdt)  # the experts' dtype (no-ops for an fp32 checkpoint); gradients pass the casts
        for start, views in self._reader[0].chunks(self.pos, used.tolist()):
            tensors = compute_weights(views, wdt, self._reader[0].buffers)
            n = next(iter(tensors.values())).shape[0]
            t = copy.copy(self._proto)
            for k, v in tensors.items():
                setattr(t, k, v)
            t.num_experts = n
            if n == used.numel():  # one chunk: the family's forward on the whole call, as in memory
                yield self._forward(t, x, inv, w).to(out_dt)
                continue
            # the chunk's (token, choice) pairs as rows of k = 1 (not the others sent to a skipped index: the
            # grouped_mm backward leaves such rows' input gradient unwritten), summed back per token
            local = inv - start
            tok, j = ((local >= 0) & (local < n)).nonzero(as_tuple=True)  # [P] pairs this chunk computes
            y = self._forward(t, x[tok], local[tok, j][:, None], w[tok, j][:, None])  # [P, H]
            yield torch.zeros_like(x, dtype=out_dt).index_add(0, tok, y.to(out_dt))


class StreamedBase:
    """A checkpoint opened for router training with its experts streamed: `model` (non-expert weights in memory,
    frozen; every MoE block's experts a `StreamedExperts`), the `reader` and the `plan`."""

    def __init__(self, path: str | Path, tier: str = "disk", dtype: torch.dtype = torch.float32,
                 workers: int = WORKERS, chunk: int = CHUNK):
        from expertcache.runtime.storage.loader import build_offloaded, resolve
        from expertcache.telemetry.adapters import adapter_for

        self.path = resolve(path)
        self.plan = plan(self.path, dtype, tier)
        self.model, source = build_offloaded(self.path, dtype, verify=None)
        if self.plan.quant_bits is None:  # read in the checkpoint's own dtype (bytes read = bytes on disk)
            from expertcache.runtime.storage.loader import expert_source

            source = expert_source(self.path)
            source.use_index(None)
        self.reader = LayerReader(source, tier, workers, chunk)
        for i, L in enumerate(adapter_for(self.model).moe_layers(self.model)):
            L.block.experts = StreamedExperts(self.reader, i, L.experts)
        self.num_parameters = self.plan.non_expert_params + self.plan.num_layers * self.plan.num_experts * \
            self.plan.expert_params

    def counters(self) -> dict:
        return self.reader.counters()

    def save_into(self, folder: str | Path, model, add=None) -> None:
        """The base checkpoint copied into `folder` (a temporary folder of `atomic_dir`), its router tensors
        rewritten in place with `model`'s, and each tensor named in `add` ({name: delta}, the attention adapters)
        replaced by its own value plus the delta, summed in fp32 (same dtype and shape; nothing else changes,
        experts are copied as bytes). A quantized base's store gets the new router fingerprint in its header.
        Memory: one tensor at a time."""
        from expertcache.telemetry.adapters import adapter_for, router_fingerprint

        from expertcache.runtime.storage.checkpoint import Checkpoint, checkpoint_name
        from expertcache.telemetry.atomic import copy_file

        folder = Path(folder)
        for f in sorted(self.path.iterdir()):
            if f.is_file() and not f.name.startswith("."):  # the checksum index: stamped for the base's files
                copy_file(f, folder / f.name)
        ckpt = Checkpoint(folder)
        a = adapter_for(model)
        names = {id(p): n for n, p in model.named_parameters()}
        new = {names[id(p)]: p.detach() for L in a.moe_layers(model) for p in L.router.parameters()}
        for name, delta in (add or {}).items():
            new[name] = delta  # (added to the checkpoint's own value below)
        for name, value in new.items():
            ck = checkpoint_name(name, a.family)
            t = ckpt.tensors.get(ck)
            if t is None or tuple(t.shape) != tuple(value.shape):
                raise InputError(f"{self.path}: tensor {ck} not found with shape {list(value.shape)}")
            fd = os.open(ckpt.files[t.file], os.O_RDWR)
            try:
                if add and name in add:  # the checkpoint's own value, plus the delta
                    own = torch.frombuffer(bytearray(os.pread(fd, t.nbytes, t.start)), dtype=t.dtype).view(t.shape)
                    value = own.float() + value.float()
                os.pwrite(fd, value.to(t.dtype).contiguous().view(torch.uint8).numpy().tobytes(), t.start)
            finally:
                os.close(fd)
        qc = quant.read_config(folder)
        if qc is not None:
            from expertcache.runtime.storage.store import read_store_meta

            store = folder / qc.get("experts_file", quant.EXPERTS_FILE)
            meta = read_store_meta(store)
            meta.fingerprint = router_fingerprint(model)
            fd = os.open(store, os.O_WRONLY)
            try:
                os.pwrite(fd, meta.to_json(), 0)
            finally:
                os.close(fd)

    def close(self) -> None:
        self.reader.close()


def open_streamed(path: str | Path, tier: str = "disk", dtype: torch.dtype = torch.float32,
                  chunk: int = CHUNK) -> StreamedBase:
    """The checkpoint at `path` for router training with frozen, streamed experts (`StreamedBase`)."""
    return StreamedBase(path, tier, dtype, chunk=chunk)


def measure_read_gbps(base: StreamedBase, n: int = 32) -> float:
    """GB/s the run's tier sustains reading random experts `WORKERS` at a time (`tiers.read_limits`): the roofline's
    bandwidth, measured where the run reads."""
    from expertcache.runtime.storage.tiers import read_limits

    r = read_limits(base.reader.tier, base.reader.meta, base.plan.num_layers, WORKERS, n=n)
    return r["at_queue_depth"]["GBps"]
