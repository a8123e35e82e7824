"""A whole decode step for Qwen3-MoE on the CPU: one function instead of transformers' module tree.

With every expert resident and the expert kernels at memory speed, about a fifth of a Qwen3-MoE decode step on a
small model was Python around the kernels: the model's decorators, its causal-mask builder and rotary module, every
decoder layer's and attention module's own forward, output dataclasses. `patch_decode_step` gives a
`Qwen3MoeForCausalLM` whose parts the engine has already put on the CPU kernels (`patches.patch_norms`,
`patch_attention_modules`, `patch_attention`) a forward that takes a decode step (one token per row, a plain KV
cache, no grad) straight through the same kernels, in the same order, with the same roundings: its logits are equal
bit for bit to the module tree's (tested). The MoE blocks (router, engine) and the lm head are still called as
modules, so their hooks run (telemetry, the engine's router-logits hook, forced routing); a hook on any module the
step does not call, a global module hook, or any input it does not take (a prefill, labels, embeddings,
`output_*` flags, a cache other than transformers' plain `DynamicCache`) sends the call to the model's own forward.
From `KV_BUFFER_FROM` positions on, the step also grows each layer's KV cache in place (`_Qwen3MoeStep.append`)
instead of concatenating the whole cache with every new position.
"""

from __future__ import annotations

import functools
import types
import weakref

import torch
import torch.nn.functional as F

from expertcache.runtime.kernels import cpu_kernels, patches
from expertcache.runtime.serve.decode import _cache_kw


# transformers' output-capturing hook (`utils.output_capturing`): inert unless the decorated forward collects
_CAPTURE_HOOK = "install_output_capuring_hook.<locals>.output_capturing_hook"


class _Qwen3MoeStep:
    """What a decode step needs, collected once from the model (modules, their kernels' arguments)."""

    def __init__(self, model):
        inner = model.model
        self.model = model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.layers = list(inner.layers)
        self.attn = [L.self_attn for L in self.layers]
        self.configs = list({id(a.config): a.config for a in self.attn}.values())
        self.kv_bufs = weakref.WeakKeyDictionary()  # a KV layer -> the views of its buffers it was given
        # each layer's modules, looked up once (not through nn.Module's attribute hook on every step)
        self.plan = [(a, L.input_layernorm, L.post_attention_layernorm, a.q_norm, a.k_norm,
                      (a.q_proj, a.k_proj, a.v_proj), a.o_proj, L.mlp, a.head_dim)
                     for L, a in zip(self.layers, self.attn)]
        # the modules the step computes itself, with their parents: a hook on any of them, or one replaced, of
        # another class (a parametrization) or with another forward since, sends the call to the model's own forward
        where = [(model, "model"), (inner, "embed_tokens"), (inner, "norm"), (inner, "rotary_emb")]
        for i, L in enumerate(self.layers):
            where += [(inner.layers, str(i)), (L, "self_attn"), (L, "input_layernorm"), (L, "post_attention_layernorm"),
                      (L, "mlp")]
            where += [(L.self_attn, n) for n in ("q_norm", "k_norm", "q_proj", "k_proj", "v_proj", "o_proj")]
        # (the MoE blocks are called as modules: their hooks run, so only their identity is checked)
        self.bypassed = [(p._modules, name, p._modules[name], type(p._modules[name]),
                          p._modules[name].__dict__.get("forward"), name == "mlp") for p, name in where]

    @staticmethod
    def build(model):
        """The step for `model`, or None where it does not apply (another family, a rotary type other than the
        default, sliding windows, modules the engine did not put on the kernels)."""
        inner = getattr(model, "model", None)
        cfg = getattr(model, "config", None)
        if type(model).__name__ != "Qwen3MoeForCausalLM" or inner is None or cfg is None:
            return None
        rot = getattr(inner, "rotary_emb", None)
        if rot is None or getattr(rot, "rope_type", None) != "default" or not isinstance(
                getattr(rot, "attention_scaling", None), float):
            return None
        emb = inner.embed_tokens
        if type(emb) is not torch.nn.Embedding or emb.max_norm is not None or emb.weight.dtype != torch.bfloat16:
            return None
        norms = [inner.norm] + [n for L in inner.layers for n in (L.input_layernorm, L.post_attention_layernorm)]
        if any(getattr(n.__dict__.get("forward"), "__func__", None) is not patches._fast_norm
               or n.weight.dtype != torch.bfloat16 for n in norms):
            return None
        for L in inner.layers:
            a = L.self_attn
            if getattr(a.__dict__.get("forward"), "__func__", None) is not patches._fast_qwen3_attention:
                return None
            if getattr(a, "sliding_window", None) is not None or a.config._attn_implementation != patches.ATTENTION:
                return None
            hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, a.head_dim
            if not (0 < d <= 256 and hk > 0 and hq % hk == 0 and hq // hk <= 16):
                return None
        return _Qwen3MoeStep(model)

    def hooked(self) -> bool:
        """Whether a module the step does not call was replaced (or re-classed, or given another forward) since it
        was built, or whether a hook would run on one (transformers' own output-capturing hooks,
        left on the modules after a call that asked for hidden states, do nothing outside such a call: they do not
        count; a call that asks goes to the model's own forward)."""
        from torch.nn.modules import module as M

        if M._global_forward_hooks or M._global_forward_pre_hooks:
            return True
        for mods, name, m, cls, fwd, called in self.bypassed:
            if mods.get(name) is not m or type(m) is not cls or m.__dict__.get("forward") is not fwd:
                return True  # replaced since the step was built (its plan would call the old module)
            if called:
                continue
            if m._forward_pre_hooks:
                return True
            if m._forward_hooks and any(getattr(h, "__qualname__", "") != _CAPTURE_HOOK
                                        for h in m._forward_hooks.values()):
                return True
        return False

    def takes(self, ids, cache, attention_mask, position_ids) -> bool:
        """Whether this call is a decode step the function computes (the rest go to the model's own forward)."""
        from transformers.cache_utils import DynamicCache, DynamicLayer

        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1 and ids.device.type == "cpu"
                and ids.shape[0] <= cpu_kernels.MAX_ROWS and not torch.is_grad_enabled() and not self.model.training):
            return False
        B = ids.shape[0]
        if type(cache) is not DynamicCache or getattr(cache, "offloading", False) \
                or len(cache.layers) != len(self.layers) \
                or any(type(c) is not DynamicLayer or not c.is_initialized for c in cache.layers):
            return False
        keys = cache.layers[0].keys
        if keys.dim() != 4 or keys.shape[0] != B or keys.dtype != torch.bfloat16:
            return False
        L = keys.shape[2] + 1
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2
                                           or tuple(attention_mask.shape) != (B, L)):
            return False
        if position_ids is not None and (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
                                         or tuple(position_ids.shape) != (B, 1)):
            return False
        # (a config switched back to sdpa sends the step to the modules' own forward, as it does each layer's)
        return all(c._attn_implementation == patches.ATTENTION for c in self.configs) and not self.hooked()

    def __call__(self, ids, cache, attention_mask, position_ids):
        """Logits `[B, 1, V]` of one decode step; `cache` grows by one position per layer."""
        B = ids.shape[0]
        if position_ids is None:
            position_ids = torch.full((1, 1), cache.layers[0].keys.shape[2], dtype=torch.long)
        mask = None  # additive [B, L], as `patches.attention` passes the model's padding mask to `attend_one`
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = patches._one_token_mask(attention_mask[:, None, None, :].bool(), B, attention_mask.shape[1])
        h = F.embedding(ids, self.embed.weight, self.embed.padding_idx)
        cos, sin = self.rotary.forward(h, position_ids)  # (its hooks checked in `takes`)
        if cos.shape[0] != B:  # one position for every row (no padding)
            cos, sin = cos.expand(B, -1, -1).contiguous(), sin.expand(B, -1, -1).contiguous()
        rms, qk_norm_rope, attend = cpu_kernels.rms_norm, cpu_kernels.qk_norm_rope, cpu_kernels.attend_one
        for kv, (a, ln1, ln2, qn, kn, projs, o_proj, mlp, D) in zip(cache.layers, self.plan):
            x = rms(h, ln1._parameters["weight"], ln1.variance_epsilon)
            qkv = a.__dict__.get("_ec_qkv")
            if qkv is not None and qkv.current(projs):
                q, k, v = qkv(x).split(qkv.sizes, -1)
            else:
                q, k, v = (p.forward(x) for p in projs)
            q, k = qk_norm_rope(q.view(B, 1, -1, D), k.view(B, 1, -1, D), qn._parameters["weight"],
                                kn._parameters["weight"], qn.variance_epsilon, kn.variance_epsilon, cos, sin)
            kv.keys, kv.values = self.append(kv, k, v.view(B, 1, -1, D).transpose(1, 2))
            o = attend(q[:, :, 0], kv.keys, kv.values, mask, a.scaling)
            h = h + o_proj.forward(o.reshape(B, 1, -1))
            h = h + mlp(rms(h, ln2._parameters["weight"], ln2.variance_epsilon))
        h = rms(h, self.norm.weight, self.norm.variance_epsilon)
        return self.model.lm_head(h)

    def append(self, kv, k, v):
        """The KV layer `kv` one position longer (`k`, `v` `[B, H, 1, D]`). Transformers' layer concatenates the
        whole cache with the new position at every step: O(context) bytes copied per layer and token (2 MB per layer
        at 1,024 tokens here). From `KV_BUFFER_FROM` positions on, the position is written into a buffer with room
        to spare instead (grown by half its length, at least `KV_SPARE` positions, when full) and the layer gets
        views of its first positions; below it the concatenation is cheaper than the buffer's bookkeeping and stays.
        Keys and values that are not the views this function returned last (the prefill's, or changed since:
        padded, rows dropped, a step through the model's own forward) are copied into a new buffer first. Positions
        already written are never written again, so a view taken earlier keeps its values."""
        keys, values = kv.keys, kv.values
        L = keys.shape[2]
        st = self.kv_bufs.get(kv)  # weak references to the views handed out last: a buffer lives as long as they do
        if st is None or st[0]() is not keys or st[1]() is not values:  # not our views: the prefill's, or changed
            if L < KV_BUFFER_FROM:
                if st is not None:
                    del self.kv_bufs[kv]
                return torch.cat([keys, k], dim=-2), torch.cat([values, v], dim=-2)
            kb, vb = _grown(keys, L), _grown(values, L)
        else:
            kb, vb = keys._base, values._base  # (our views' buffers)
            if L == kb.shape[2]:  # full: a longer buffer, the positions so far copied once
                kb, vb = _grown(kb, L), _grown(vb, L)
        kb[:, :, L:L + 1].copy_(k)
        vb[:, :, L:L + 1].copy_(v)
        kv_, vv = kb[:, :, :L + 1], vb[:, :, :L + 1]
        self.kv_bufs[kv] = (weakref.ref(kv_), weakref.ref(vv))
        return kv_, vv


KV_BUFFER_FROM = 256  # context length from which a KV layer grows in place (`_Qwen3MoeStep.append`)
KV_SPARE = 64  # positions a KV buffer grows by at least
KV_HEADROOM = 1.5  # a buffer holds at most this times its cache's positions (room to spare: half the length)


def kv_headroom(model, length: int) -> float:
    """How many times the bytes of its positions a KV cache of `length` positions may hold on `model` (a budget for
    a batch's cache at its longest counts this): `KV_HEADROOM` where the decode step grows caches in place."""
    return KV_HEADROOM if "_ec_step" in model.__dict__ and length >= KV_BUFFER_FROM else 1.0


def _grown(t, L: int):
    """A buffer `[B, H, L + room, D]` whose first `L` positions hold `t`'s."""
    buf = t.new_empty((t.shape[0], t.shape[1], L + max(KV_SPARE, L // 2), t.shape[3]))
    buf[:, :, :L].copy_(t[:, :, :L])
    return buf


_OUTPUT_FLAGS = ("output_router_logits", "output_hidden_states", "output_attentions")


def _decode_step_forward(self, *args, **kwargs):
    """The model's forward: a decode step through `_Qwen3MoeStep`, anything else through the class's own."""
    step = self.__dict__.get("_ec_step")
    if not args and step is not None:
        ids = kwargs.get("input_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        extra = set(kwargs) - {"input_ids", "cache", "past_key_values", "attention_mask", "position_ids",
                               "use_cache", "logits_to_keep"}
        keep = kwargs.get("logits_to_keep", 0)
        if (not extra and kwargs.get("use_cache") is not False and type(keep) is int and keep in (0, 1)
                and not any(getattr(self.config, f, False) for f in _OUTPUT_FLAGS)
                and getattr(self.config, "return_dict", True) is not False  # (a tuple is asked for)
                and step.takes(ids, cache, kwargs.get("attention_mask"), kwargs.get("position_ids"))):
            from transformers.modeling_outputs import MoeCausalLMOutputWithPast

            logits = step(ids, cache, kwargs.get("attention_mask"), kwargs.get("position_ids"))
            return MoeCausalLMOutputWithPast(logits=logits, **{_cache_kw(type(self)): cache})
    return type(self).forward(self, *args, **kwargs)


def patch_decode_step(model) -> list:
    """`model` (a `Qwen3MoeForCausalLM` whose norms and attention the engine put on the CPU kernels) takes its decode
    steps through one function (`_Qwen3MoeStep`). Returns `[model]` for `unpatch_decode_step`, or `[]` where the
    step does not apply (the model keeps its own forward)."""
    if "forward" in model.__dict__:
        return []
    step = _Qwen3MoeStep.build(model)
    if step is None:
        return []
    model.__dict__["_ec_step"] = step
    # with the class's signature: `generate` reads it to decide what it passes (position ids from the attention
    # mask, the mask itself, logits_to_keep)
    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        return _decode_step_forward(self, *args, **kwargs)

    model.forward = types.MethodType(forward, model)
    return [model]


def unpatch_decode_step(models) -> None:
    for m in models:
        m.__dict__.pop("forward", None)
        m.__dict__.pop("_ec_step", None)
