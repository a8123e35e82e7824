"""Prefill from the slow tier (#47 item 2): a prompt's forward reads each expert its tokens touched once per layer
(every token that chose it computed together), not once per token, and its logits equal the plain model's."""

import pytest
import torch

from expertcache.runtime.engine.config import EngineConfig
from expertcache.runtime.engine.engine import offload
from expertcache.runtime.storage.store import write_store
from tiny_models import FAMILIES, build_model, tiny_config


@pytest.mark.parametrize("fam", [f for f in ("qwen3_moe", "mixtral", "olmoe") if f in FAMILIES])
def test_a_prompt_reads_each_touched_expert_once_per_layer_and_equals_the_plain_forward(fam, tmp_path):
    cfg = tiny_config(fam)
    plain = build_model(cfg, seed=1).eval()
    store = tmp_path / f"{fam}.store"
    write_store(plain, store)
    prompt = torch.randint(0, cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = plain(prompt, output_router_logits=True)
    k = getattr(cfg, "num_experts_per_tok", 2)
    touched = [set(r.topk(k, dim=-1).indices.flatten().tolist()) for r in ref.router_logits]
    distinct = sum(len(t) for t in touched)
    layers = len(touched)
    m = build_model(cfg, seed=1).eval()
    cap = 2
    eng = offload(m, store, EngineConfig(capacity=cap, tier="disk"))
    try:
        with torch.no_grad():
            out = m(prompt).logits
        st = eng.stats
    finally:
        eng.close()
    # 48 tokens x top-k are 96 expert uses per layer; the step needs each distinct expert once (`accesses`), and
    # reads exactly the needed ones not already resident (at most `cap` per layer were), once each
    assert st.calls == layers and st.accesses == distinct < 48 * k * layers, (st, distinct)
    assert distinct - cap * layers <= st.demand_loads <= distinct, (st.demand_loads, distinct)
    assert st.bytes_moved == st.demand_loads * (st.bytes_moved // max(st.demand_loads, 1))
    torch.testing.assert_close(out, ref.logits, rtol=1e-4, atol=1e-5)
