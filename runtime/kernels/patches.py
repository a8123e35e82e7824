"""The model patches that put the CPU kernels (`cpu_kernels`) under a transformers model for decode steps: linear
layers, RMSNorms, top-k routers, and Qwen3-MoE's attention (its query/key norms and rotary embedding in one call,
its projections fused, the KV cache read once per head). Each patch checks first that the kernel computes exactly
what the module's own forward does; anything else (a prefill, training, other devices) keeps the module's path."""

from __future__ import annotations

import torch

from expertcache.runtime.kernels import cpu_kernels as ck
from expertcache.runtime.kernels.qlinear import QuantLinear


def _fast_linear(self, x):
    if ck.decode_sized(x, self.weight):
        return ck.linear_bf16(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def patch_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every bf16 `nn.Linear` of `model` computes decode-sized inputs (at most `MAX_ROWS` rows, no grad) with
    `linear_bf16`; larger inputs, other dtypes and training keep `F.linear`. Returns the patched modules for
    `unpatch_linears`."""
    import types

    done = []
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and mod.weight.dtype == torch.bfloat16 and "forward" not in mod.__dict__:
            mod.forward = types.MethodType(_fast_linear, mod)
            done.append(mod)
    return done


def unpatch_linears(mods) -> None:
    for mod in mods:
        mod.__dict__.pop("forward", None)
        mod.__dict__.pop("_ec_qkv", None)  # (the projections keep their views of the fused rows)


class _Linears(torch.overrides.TorchFunctionMode):
    """Inside: `F.linear` of decode-sized bf16 inputs runs `linear_bf16` (for modules that call `F.linear` on their
    own weight, as the families' routers do)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            if ck.decode_sized(x, w):
                return ck.linear_bf16(x, w, args[2] if len(args) > 2 else kwargs.get("bias"))
        return func(*args, **kwargs)


def patch_calls(mods) -> list[torch.nn.Module]:
    """Each module's forward runs inside `_Linears` (its few torch calls pay the mode's dispatch; the routers')."""
    import types

    done = []
    for mod in mods:
        if "forward" in mod.__dict__:
            continue
        orig = type(mod).forward

        def fwd(self, *a, _orig=orig, **kw):
            with _Linears():
                return _orig(self, *a, **kw)

        mod.forward = types.MethodType(fwd, mod)
        done.append(mod)
    return done


def _fast_norm(self, x):
    if ck.decode_input(x) and x.dtype == self.weight.dtype:
        return ck.rms_norm(x, self.weight, self.variance_epsilon)
    return type(self).forward(self, x)


def _fast_router(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim)
    if ck.decode_input(x) and x.dtype == torch.bfloat16:
        return ck.route_topk(x, self.weight, self.top_k, bool(self.norm_topk_prob))
    return type(self).forward(self, hidden_states)


def _own_router(mod, x):
    with _Linears():  # the router as the engine ran it before: its F.linear through linear_bf16
        return type(mod).forward(mod, x)


def _same_as_own(mod, fast, x, own=None) -> bool:
    """Whether `fast(mod, x)` computes exactly what the module's own forward (`own(mod, x)`, default its class's)
    does on `x` (outputs of the same structure, dtype and shape, equal bit for bit): the check that a family's norm
    or router is the formula the kernel implements, roundings included, before it takes over."""
    own = own or type(mod).forward
    with torch.no_grad():
        try:
            a, b = own(mod, x), fast(mod, x)
        except Exception:  # noqa: BLE001 - a module the kernel cannot take keeps its own forward
            return False
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    if len(a) != len(b):
        return False
    return all(isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.shape == v.shape
               and u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(a, b))


def patch_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's RMSNorm modules (a 1-D `weight` and `variance_epsilon`, checked against their own forward on a
    random input first) compute decode-sized inputs with `rms_norm`. Returns them for `unpatch_linears`."""
    import types

    done = []
    gen = torch.Generator().manual_seed(0)
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if ("forward" in mod.__dict__ or not type(mod).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor)
                or w.dim() != 1 or w.is_cuda or w.dtype not in (torch.bfloat16, torch.float32)
                or not isinstance(getattr(mod, "variance_epsilon", None), float)):
            continue
        x = torch.randn(2, w.shape[0], generator=gen).to(w.dtype)
        if _same_as_own(mod, _fast_norm, x):
            mod.forward = types.MethodType(_fast_norm, mod)
            done.append(mod)
    return done


def patch_routers(routers) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """Top-k routers (bf16 `weight [E, H]`, `top_k`, `norm_topk_prob`, `hidden_dim`; no bias) whose own forward
    returns what `route_topk` does (checked on a random input) compute decode-sized inputs with it. Returns (patched,
    the others)."""
    import types

    done, rest = [], []
    gen = torch.Generator().manual_seed(0)
    for mod in routers:
        w = getattr(mod, "weight", None)
        ok = ("forward" not in mod.__dict__ and isinstance(w, torch.Tensor) and w.dim() == 2 and not w.is_cuda
              and w.dtype == torch.bfloat16 and w.stride(-1) == 1 and w.is_contiguous()
              and getattr(mod, "bias", None) is None and isinstance(getattr(mod, "top_k", None), int)
              and getattr(mod, "hidden_dim", None) == w.shape[1] and hasattr(mod, "norm_topk_prob"))
        if ok:
            x = torch.randn(3, w.shape[1], generator=gen).bfloat16()
            ok = _same_as_own(mod, _fast_router, x, _own_router)
        if ok:
            mod.forward = types.MethodType(_fast_router, mod)
            done.append(mod)
        else:
            rest.append(mod)
    return done, rest


ATTENTION = "expertcache_cpu"


def _one_token_mask(mask, B: int, L: int):
    """The attention interface's mask as `attend_one` takes it ([B, L] additive), None for no mask, or False where it
    has another shape (per head, per query) and the caller falls back."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[0] != B or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != L:
        return False
    m = mask[:, 0, 0, :]
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float32).masked_fill_(~m, float("-inf"))
    return m.float()


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The transformers attention interface's function for decode: one query token per row on the CPU, no grad, a
    bf16 or fp32 cache, no dropout, softcap or position bias, goes through `attend_one`; everything else (the
    prefill, training, other devices) through transformers' own `sdpa` function, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, Hq, T, D = query.shape
    Hk, L = key.shape[1], key.shape[2]
    window = kwargs.get("sliding_window")
    fits = (T == 1 and query.device.type == key.device.type == value.device.type == "cpu"
            and key.shape[0] == B and key.shape[3] == D and not torch.is_grad_enabled() and dropout == 0.0
            and query.dtype in (torch.bfloat16, torch.float32) and key.dtype == query.dtype == value.dtype
            and value.shape == key.shape
            and key.stride(-1) == 1 and value.stride(-1) == 1 and 0 < D <= 256
            and Hk > 0 and Hq % Hk == 0 and Hq // Hk <= 16 and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions", False)
            and (window is None or attention_mask is not None or L <= window) and ck.available())
    if fits:
        mask = _one_token_mask(attention_mask, B, L)
        if mask is not False:
            out = ck.attend_one(query[:, :, 0], key, value, mask, scaling)
            return out.unsqueeze(1), None  # [B, 1, Hq, D], as sdpa's function returns it
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _fast_qwen3_attention(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    """Qwen3-MoE's attention for a decode step (one token per row, bf16, on the CPU, no grad, our attention
    function configured): the query and key norms and the rotary embedding in one `qk_norm_rope` call, with the
    module's own projections, KV cache and `attention`; anything else goes to the module's own forward."""
    cos, sin = position_embeddings
    old_name = kwargs.pop("past_key_values", None)  # the name the module's decorator maps to `cache`
    cache = cache if cache is not None else old_name
    B, T, _ = hidden_states.shape if hidden_states.dim() == 3 else (0, 0, 0)
    D = self.head_dim
    if not (T == 1 and ck.decode_input(hidden_states) and hidden_states.dtype == torch.bfloat16 and cache is not None
            and not self.training and self.config._attn_implementation == ATTENTION
            and cos.dtype == torch.bfloat16 and sin.dtype == torch.bfloat16
            and cos.shape == (B, 1, D) and sin.shape == (B, 1, D) and not kwargs.get("output_attentions", False)):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    qkv = self.__dict__.get("_ec_qkv")
    if qkv is not None and qkv.current((self.q_proj, self.k_proj, self.v_proj)):  # one matrix: one kernel call
        q, k, v = qkv(hidden_states).split(qkv.sizes, -1)
    else:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    q, k, v = q.view(B, 1, -1, D), k.view(B, 1, -1, D), v.view(B, 1, -1, D).transpose(1, 2)
    q, k = ck.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon,
                        self.k_norm.variance_epsilon, cos, sin)
    k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                             sliding_window=self.sliding_window, **kwargs)
    return self.o_proj(out.reshape(B, 1, -1).contiguous()), weights


class _FusedProjections:
    """Linear layers that read the same input, as one: their weights concatenated by output row (each module's
    weight then a view of its rows, so nothing is held twice), one kernel call for a decode step instead of one per
    module; each output row is computed exactly as the module's own call computes it. Packed (`QuantLinear`, one
    format) or bf16 `nn.Linear`, none with a bias; `None` from `make` where the modules are not all alike."""

    def __init__(self, parts: dict, packed: tuple | None, sizes: list[int], mods):
        self.parts, self.packed, self.sizes = parts, packed, sizes
        self._ptrs = self._weights(mods)

    def _weights(self, mods) -> list[int]:
        return [getattr(m, "weight_q" if self.packed else "weight").data_ptr() for m in mods]

    def current(self, mods) -> bool:
        """Whether the modules still hold their views of the fused rows (a weight replaced since, e.g. by
        `load_state_dict(assign=True)`, sends the step back to the modules' own calls)."""
        return self._weights(mods) == self._ptrs

    @staticmethod
    def make(mods):
        sizes = [m.out_features for m in mods]
        if all(type(m) is QuantLinear for m in mods):
            fmt = {(m.bits, m.group, m.in_features, m.symmetric) for m in mods}
            if len(fmt) != 1 or any(m.bias is not None for m in mods) or mods[0].in_features % 64:
                return None  # (the kernel takes inputs in 64s: QuantLinear dequantizes the others)
            bits, group, _, symmetric = fmt.pop()
            names = ["weight_q", "weight_scales"] + ([] if symmetric else ["weight_mins"])
            parts = {n: torch.cat([getattr(m, n) for m in mods]) for n in names}
            for n, t in parts.items():
                for m, piece in zip(mods, t.split(sizes)):
                    setattr(m, n, piece)  # the module's buffer: a view of the fused rows
            return _FusedProjections(parts, (bits, group), sizes, mods)
        if all(type(m) is torch.nn.Linear for m in mods):
            ws = [m.weight for m in mods]
            if any(m.bias is not None for m in mods) or {w.dtype for w in ws} != {torch.bfloat16} or \
                    len({w.shape[1] for w in ws}) != 1 or any(w.requires_grad for w in ws):
                return None
            w = torch.cat([m.weight.detach() for m in mods])
            for m, piece in zip(mods, w.split(sizes)):
                m.weight = torch.nn.Parameter(piece, requires_grad=False)
            return _FusedProjections({"weight": w}, None, sizes, mods)
        return None

    def __call__(self, x):
        if self.packed is None:
            return ck.linear_bf16(x, self.parts["weight"])
        bits, group = self.packed
        return ck.linear_q(x, self.parts["weight_q"], self.parts["weight_scales"], self.parts.get("weight_mins"), bits,
                        group)


def patch_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Qwen3-MoE attention modules whose query / key norms are bf16 RMSNorms over the head (`q_norm.weight [D]`)
    take `_fast_qwen3_attention` for decode steps, their query, key and value projections fused where they are
    alike (`_FusedProjections`). Returns them for `unpatch_linears`."""
    import types

    done = []
    for mod in model.modules():
        if type(mod).__name__ != "Qwen3MoeAttention" or "forward" in mod.__dict__:
            continue
        D = getattr(mod, "head_dim", None)
        norms = [getattr(mod, n, None) for n in ("q_norm", "k_norm")]
        if all(type(n).__name__ == "Qwen3MoeRMSNorm" and n.weight.dtype == torch.bfloat16 and n.weight.shape == (D,)
               and isinstance(n.variance_epsilon, float) for n in norms):
            mod.forward = types.MethodType(_fast_qwen3_attention, mod)
            fused = _FusedProjections.make([mod.q_proj, mod.k_proj, mod.v_proj])
            if fused is not None:
                mod.__dict__["_ec_qkv"] = fused
            done.append(mod)
    if any("_ec_qkv" in mod.__dict__ for mod in done):
        ck.release_freed()  # the projections' own weights, now copied into the fused rows
    return done


def patch_attention(model: torch.nn.Module) -> list:
    """The model's configs that use transformers' `sdpa` attention switch to `attention` (registered as
    `ATTENTION`, with sdpa's masks): its decode steps read the KV cache once per key/value head in fp32 instead of
    torch's flash kernel, which tiles for many queries (2.7 ms per layer for one bf16 query against 512 keys here,
    against about 0.12 ms). Returns what `unpatch_attention` restores."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    seen, done = set(), []
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation_internal"):
            continue
        seen.add(id(cfg))
        if cfg._attn_implementation_internal == "sdpa":
            cfg._attn_implementation_internal = ATTENTION
            done.append(cfg)
    return done


def unpatch_attention(configs) -> None:
    for cfg in configs:
        if cfg._attn_implementation_internal == ATTENTION:
            cfg._attn_implementation_internal = "sdpa"
