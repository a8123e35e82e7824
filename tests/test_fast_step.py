"""The whole-step decode function for Qwen3-MoE (`runtime/kernels/fast_step.py`): it takes the decode steps, gives the
module tree's logits bit for bit, and hands every call it does not take back to the model's own forward."""

from __future__ import annotations

import pytest
import torch

from expertcache.runtime.kernels import cpu_kernels as ck
from expertcache.runtime.kernels import fast_step
from expertcache.runtime.kernels import qlinear, quant, quant_write

needs_ext = pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.why_unavailable()}")


def _steps(m, ids, steps, mask=None, **kw):
    """Prefill `ids`, then one decode step per column of `steps` (fixed tokens): every step's last logits. Returns
    (logits, how many calls the step function computed)."""
    from transformers import DynamicCache

    taken = []
    step = m.__dict__.get("_ec_step")
    if step is not None:
        real = type(step).__call__
        step.__class__ = type("Counted", (type(step),), {"__call__": lambda s, *a: taken.append(1) or real(s, *a)})
    out = []
    try:
        with torch.no_grad():
            cache = DynamicCache(config=m.config)
            r = m(input_ids=ids, past_key_values=cache, use_cache=True,
                  **({} if mask is None else {"attention_mask": mask}), **kw)
            out.append(r.logits[:, -1].float())
            for col in steps.T:
                if mask is not None:
                    mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
                r = m(input_ids=col[:, None], past_key_values=cache, use_cache=True,
                      **({} if mask is None else {"attention_mask": mask}), **kw)
                out.append(r.logits[:, -1].float())
    finally:
        if step is not None:
            step.__class__ = type(step).__mro__[1]
    return torch.stack(out), len(taken)


def _tree(m, *a, **kw):
    """The same, with the model on its own forward (the modules' patched decode ops still in place)."""
    fwd = m.__dict__.pop("forward")
    try:
        return _steps(m, *a, **kw)
    finally:
        m.forward = fwd


@pytest.fixture(scope="module")
def qwen(family_checkpoints):
    return family_checkpoints / "qwen3_moe"


@pytest.fixture(scope="module")
def qwen_int4(family_checkpoints, tmp_path_factory):
    """The same family with packed experts and packed attention projections and output head (int4, group 32)."""
    from tiny_models import build_model, tiny_config

    root = tmp_path_factory.mktemp("fast_step")
    build_model(tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64, intermediate_size=64,
                            tie_word_embeddings=False), seed=3, dtype=torch.bfloat16).save_pretrained(root / "src")
    quant_write.write_quantized(root / "src", root / "q", 4, 32, linears=True)
    return root / "q"


@needs_ext
@pytest.mark.parametrize("which", ["bf16", "int4"])
def test_the_step_function_gives_the_module_trees_logits_bit_for_bit(qwen, qwen_int4, which):
    """One row, then two rows without padding: every decode step goes through the step function, and its logits
    equal, bit for bit, those of the model's own forward over the same patched modules."""
    from expertcache.runtime import EngineConfig, load

    m = load(qwen if which == "bf16" else qwen_int4, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    assert m.__dict__.get("_ec_step") is not None and m.expertcache.compute.step == [m]
    if which == "int4":
        assert isinstance(m.model.layers[0].self_attn.q_proj, qlinear.QuantLinear)
    ids, steps = torch.tensor([[5, 9, 33, 2, 71, 100, 7, 12]]), torch.tensor([[3, 14, 15, 92, 6]])
    got, taken = _steps(m, ids, steps)
    want, _ = _tree(m, ids, steps)
    assert taken == steps.shape[1] and torch.equal(got, want)
    ids2, steps2 = torch.cat([ids, ids.flip(1)]), torch.cat([steps, steps.flip(1)])
    got, taken = _steps(m, ids2, steps2)
    want, _ = _tree(m, ids2, steps2)
    assert taken == steps2.shape[1] and torch.equal(got, want)
    m.expertcache.close()
    assert "forward" not in m.__dict__ and "_ec_step" not in m.__dict__  # the model's own forward again


@needs_ext
def test_left_padded_rows_decode_through_the_step_with_their_mask_and_positions(qwen):
    """The decode loop's batch (`decode.Batch`): two prompts of different lengths, left-padded, decoded together,
    each at its own positions under the padding mask: the same tokens and logits, bit for bit, as the module tree."""
    from expertcache.runtime import EngineConfig, load
    from expertcache.runtime.serve.decode import Batch
    from expertcache.runtime.serve.generate import Generation
    from expertcache.runtime.serve.request import SamplingParams

    m = load(qwen, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))

    def run():
        gens = [Generation(m, None, p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3))
                for p in ([5, 9, 33], [7, 12, 71, 100, 2, 8, 40])]
        b = Batch(m, max_rows=2)
        for g in gens:
            b.admit(g)
        while len(b):
            b.step()
        return [(g.completion_ids, g.token_scores) for g in gens]

    step, taken = m.__dict__["_ec_step"], []
    real = type(step).__call__
    step.__class__ = type("Counted", (type(step),), {"__call__": lambda s, *a: taken.append(a[2]) or real(s, *a)})
    got = run()
    step.__class__ = type(step).__mro__[1]
    assert len(taken) == 5 and all(mk is not None and mk.shape[0] == 2 for mk in taken)  # the mask went in
    fwd = m.__dict__.pop("forward")
    want = run()
    m.forward = fwd
    assert got == want
    m.expertcache.close()


@needs_ext
def test_calls_the_step_does_not_take_go_to_the_models_own_forward(qwen):
    """A hook on a module the step does not call (a decoder layer), hidden states asked for, or the attention
    switched back to sdpa: the model's own forward runs (the hook fires each step) and the logits are unchanged.
    Hooks on the routers (telemetry, forced routing) stay on the step: it calls the MoE blocks as modules."""
    from expertcache.runtime import EngineConfig, load

    m = load(qwen, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    ids, steps = torch.tensor([[5, 9, 33, 2]]), torch.tensor([[3, 14, 15]])
    want, taken = _steps(m, ids, steps)
    assert taken == 3
    seen = []
    h = m.model.layers[1].register_forward_hook(lambda mod, a, o: seen.append(1))
    got, taken = _steps(m, ids, steps)
    h.remove()
    assert taken == 0 and len(seen) == 4 and torch.equal(got, want)
    got, taken = _steps(m, ids, steps, output_hidden_states=True)
    assert taken == 0 and torch.equal(got, want)
    routed = []
    h = m.model.layers[0].mlp.gate.register_forward_hook(lambda mod, a, o: routed.append(o[2].tolist()))
    got, taken = _steps(m, ids, steps)
    h.remove()
    assert taken == 3 and len(routed) == 4 and torch.equal(got, want)
    for c in m.expertcache.compute.attention:
        c._attn_implementation_internal = "sdpa"
    got, taken = _steps(m, ids, steps)
    assert taken == 0 and (got - want).abs().max() < 0.1  # sdpa's own rounding
    m.expertcache.close()


@needs_ext
def test_only_qwen3_moe_on_the_kernels_takes_the_step(family_checkpoints):
    """Other families, and Qwen3-MoE on the torch path (kernel native), keep the model's own forward."""
    from expertcache.runtime import EngineConfig, load

    for fam, kernel in (("mixtral", "cpu"), ("qwen3_moe", "native")):
        m = load(family_checkpoints / fam, engine=EngineConfig(capacity=1.0, tier="host", kernel=kernel))
        assert "forward" not in m.__dict__ and m.expertcache.compute.step == [], (fam, kernel)
        assert fast_step.patch_decode_step(m) == []
        m.expertcache.close()


@needs_ext
def test_generate_sees_the_models_own_signature_and_decodes_a_padded_batch_the_same(qwen):
    """transformers' `generate` reads the forward's signature to decide what it passes (position ids from the mask,
    the mask, logits_to_keep): the step keeps the class's, and a left-padded batch decodes the same tokens as with
    the step off."""
    import inspect

    from expertcache.runtime import EngineConfig, load

    m = load(qwen, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    params = inspect.signature(m.forward).parameters
    assert list(params) == list(inspect.signature(type(m).forward).parameters)[1:]  # (less `self`)
    assert {"position_ids", "attention_mask", "logits_to_keep"} <= set(params)
    ids = torch.tensor([[0, 0, 5, 9, 33], [7, 12, 71, 100, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = m.generate(ids, **kw)
    fwd = m.__dict__.pop("forward")
    want = m.generate(ids, **kw)
    m.forward = fwd
    assert torch.equal(got, want)
    m.expertcache.close()


@needs_ext
def test_a_module_replaced_or_a_tuple_asked_for_goes_to_the_models_own_forward(qwen):
    """A projection replaced after the engine attached (as an adapter library would), `return_dict=False` and a
    tensor `logits_to_keep`: the model's own forward runs, no error."""
    from expertcache.runtime import EngineConfig, load

    m = load(qwen, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    ids, steps = torch.tensor([[5, 9, 33, 2]]), torch.tensor([[3, 14]])
    want, taken = _steps(m, ids, steps)
    assert taken == 2
    a = m.model.layers[0].self_attn
    old = a.o_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False, dtype=torch.bfloat16)
    new.weight.data.copy_(old.weight.data)
    a.o_proj = new
    got, taken = _steps(m, ids, steps)
    assert taken == 0 and (got - want).abs().max() < 0.1  # the new module ran (torch's own bf16 linear)
    a.o_proj = old
    got, taken = _steps(m, ids, steps)
    assert taken == 2 and torch.equal(got, want)
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        m(input_ids=ids, past_key_values=cache, use_cache=True)
        r = m(input_ids=steps[:, :1], past_key_values=cache, use_cache=True, return_dict=False)
        assert isinstance(r, tuple)
        r = m(input_ids=steps[:, 1:], past_key_values=cache, use_cache=True, logits_to_keep=torch.tensor([0]))
        assert r.logits.shape[-1] == m.config.vocab_size
    m.expertcache.close()


@needs_ext
def test_the_kv_cache_grows_in_place_and_decodes_as_the_module_tree(qwen, monkeypatch):
    """The step appends each position into a buffer with room to spare (no concatenation of the whole cache per
    step): over growths of the buffer, rows leaving a batch mid-way (their cache rows dropped) and a step through
    the model's own forward in between (a hook), every token and logprob equals the module tree's, and the cache
    the caller holds has the same keys and values."""
    from expertcache.runtime import EngineConfig, load
    from expertcache.runtime.serve.decode import Batch
    from expertcache.runtime.serve.generate import Generation
    from expertcache.runtime.serve.request import SamplingParams

    monkeypatch.setattr(fast_step, "KV_SPARE", 3)  # a growth every few steps
    monkeypatch.setattr(fast_step, "KV_BUFFER_FROM", 9)  # (the longest prompt is 7: concatenated, then buffered)
    m = load(qwen, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))

    def run(hook_at=None):
        gens = [Generation(m, None, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2))
                for p, n in (([5, 9, 33], 7), ([7, 12, 71, 100, 2, 8, 40], 16), ([3, 3, 4], 12))]
        b = Batch(m, max_rows=3)
        for g in gens:
            b.admit(g)
        steps, caches = 0, []
        while len(b):
            h = m.model.layers[0].register_forward_hook(lambda *a: None) if steps == hook_at else None
            b.step()
            if h is not None:
                h.remove()
            steps += 1
            if b.cache is not None:
                caches.append([(c.keys.clone(), c.values.clone()) for c in b.cache.layers])
                step = m.__dict__.get("_ec_step")
                if step is not None:  # the buffers' lengths (grown past the prompt's + KV_SPARE)
                    views = [st[0]() for st in step.kv_bufs.values()]
                    sizes.append(max((v._base.shape[2] for v in views if v is not None), default=0))
        return [(g.completion_ids, g.token_scores) for g in gens], caches

    sizes = []

    got, got_kv = run(hook_at=5)
    assert max(sizes) > 7 + 3 + 3  # grown more than once past the longest prompt
    fwd = m.__dict__.pop("forward")
    want, want_kv = run()
    m.forward = fwd
    assert got == want
    assert len(got_kv) == len(want_kv) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for ga, wa in zip(got_kv, want_kv) for a, b in zip(ga, wa))
    m.expertcache.close()


@needs_ext
def test_a_kv_buffer_goes_with_its_views_and_budgets_count_its_room(qwen, monkeypatch):
    """Only the cache holds a buffer alive: once its layer takes other tensors (rows dropped, padding, a fallback
    step), the old buffer is freed at once, not at the layer's next step. A KV budget (the server's) counts the
    buffers' room to spare from the length where the step buffers."""
    import gc
    import weakref

    from transformers import DynamicCache

    from expertcache.runtime import EngineConfig, load

    monkeypatch.setattr(fast_step, "KV_BUFFER_FROM", 4)
    m = load(qwen, engine=EngineConfig(capacity=1.0, tier="host", kernel="cpu"))
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        m(input_ids=torch.tensor([[5, 9, 33, 2, 71]]), past_key_values=cache, use_cache=True)
        for t in (3, 14):
            m(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    buf = weakref.ref(layer.keys._base)
    assert buf() is not None and buf().shape[2] > layer.keys.shape[2]  # a buffer with room to spare
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # as `Batch._keep` replaces them
    gc.collect()
    assert buf() is None
    assert fast_step.kv_headroom(m, 4) == fast_step.KV_HEADROOM and fast_step.kv_headroom(m, 3) == 1.0
    m.expertcache.close()
    assert fast_step.kv_headroom(m, 4) == 1.0  # (the model's own forward again: plain concatenation)
