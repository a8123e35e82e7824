"""`expertcache.runtime.load`: checkpoints read in place by byte range (both expert layouts), never materialising
an expert, lossless against plain `from_pretrained` + `generate` in the checkpoint's dtype, and one-line errors
for what cannot be read."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from expertcache.recipes.cli import main
from expertcache.runtime import EngineConfig, load
from expertcache.runtime.storage.checkpoint import Checkpoint
from expertcache.telemetry.errors import InputError
from helpers import greedy
from tiny_models import FAMILIES

PROMPT = torch.tensor([[5, 9, 33, 2, 71, 100, 7, 12]])


def _greedy(model, n=10):
    return greedy(model, PROMPT, n, pad_token_id=1)


@pytest.fixture(scope="module")
def saved(family_checkpoints):
    """Each family's checkpoint (the session's, bf16, the per-expert layout, GPT-OSS fused) and its plain tokens."""
    out = {}
    for fam in FAMILIES:
        d = family_checkpoints / fam
        plain = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
        out[fam] = (d, _greedy(plain))
    return out


@pytest.mark.parametrize("fam", FAMILIES)
def test_lossless_from_saved_checkpoints_in_their_dtype(saved, fam):
    d, ref = saved[fam]
    for tier, cap in (("disk", 2), ("host", 3)):
        # kernel native: the default (auto) is equal up to rounding only
        m = load(d, engine=EngineConfig(capacity=cap, tier=tier, kernel="native"))
        eng = m.expertcache
        assert eng.meta.tensors[0].dtype == "bfloat16" and next(m.parameters()).dtype == torch.bfloat16
        assert torch.equal(_greedy(m), ref), (fam, tier)
        assert eng.stats.demand_loads > 0 and eng.stats.hits > 0  # the cache was really exercised
        eng.close()


def test_both_layouts_read_the_same_experts(saved, tmp_path):
    """The per-expert layout (as saved) and transformers 5's fused layout give the same slots and tokens."""
    d, ref = saved["qwen3_moe"]
    fused = tmp_path / "fused"
    shutil.copytree(d, fused)
    plain = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    sd = {k: v.contiguous() for k, v in plain.state_dict().items()}  # module names: fused experts
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    os.remove(fused / "model.safetensors")
    save_file(sd, str(fused / "model.safetensors"), metadata={"format": "pt"})
    cfg = EngineConfig(capacity=8, tier="host", kernel="native")
    a, b = load(d, engine=cfg), load(fused, engine=cfg)
    for pa, pb in zip(a.expertcache.pools, b.expertcache.pools):
        assert torch.equal(pa.views["gate_up_proj"], pb.views["gate_up_proj"])
        assert torch.equal(pa.views["down_proj"], pb.views["down_proj"])
    assert torch.equal(_greedy(b), ref)
    per_expert = Checkpoint(d)
    assert any(".experts.0.gate_proj.weight" in n for n in per_expert.tensors)
    a.expertcache.close(), b.expertcache.close()


def test_loader_never_materialises_an_expert(saved, monkeypatch):
    d, _ = saved["mixtral"]  # renamed keys too (block_sparse_moe -> mlp)
    read = []
    orig = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, name: read.append(name) or orig(self, name))
    m = load(d, capacity=2, tier="disk")
    eng = m.expertcache
    experts = eng.source.names
    assert len(experts) == 2 * 8 * 3  # layers x experts x (w1, w2, w3)
    assert read and not set(read) & experts  # every tensor read whole is a non-expert one
    assert not any(p.is_meta for p in m.parameters())  # nothing left unset
    n_expert_elems = sum(p.numel() for n, p in m.named_parameters() if "experts" in n)
    assert n_expert_elems == 0  # the routed experts live only in the engine's slots
    eng.close()


def test_a_failed_read_surfaces(saved, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(saved["qwen3_moe"][0], d)
    m = load(d, capacity=2, tier="disk")
    os.truncate(d / "model.safetensors", 4096)  # the file shrinks under the running engine
    with pytest.raises(InputError, match="short read"):
        _greedy(m)
    m.expertcache.close()


def test_deepseek_reroute_weights_follow_its_own_rule(saved):
    d, _ = saved["deepseek_v3"]
    m = load(d, engine=EngineConfig(capacity=3, tier="host", miss="reroute", tau=1.0))
    eng = m.expertcache
    seen = []
    run = eng.run_layer
    eng.run_layer = lambda mod, h, idx, w: (seen.append((eng.plan.logits[mod.pos].clone(),
                                                         eng.plan.reroute(mod.pos, idx, w)[:2], idx)),
                                            run(mod, h, idx, w))[1]
    _greedy(m, 6)
    cfg = m.config
    changed = 0
    for logits, (ids, w), orig in seen:
        if torch.equal(ids, orig):
            continue
        changed += 1
        logits = logits.float()
        s = logits.sigmoid().gather(1, ids)
        want = s / (s.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor  # sigmoid, renorm, scaling
        torch.testing.assert_close(w.float(), want.to(w.dtype).float())
    assert changed > 0 and eng.stats.rerouted > 0
    eng.close()


def test_bad_checkpoints_are_one_line_errors(saved, tmp_path, monkeypatch, capsys):
    d = saved["olmoe"][0]
    pick = tmp_path / "pickle"
    pick.mkdir()
    shutil.copy(d / "config.json", pick)
    torch.save({"x": torch.zeros(1)}, pick / "pytorch_model.bin")
    with pytest.raises(InputError, match="pickle"):
        load(pick)
    sharded = tmp_path / "sharded"
    shutil.copytree(d, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    wm = {k: "model-00001-of-00002.safetensors" for k in Checkpoint(d).tensors}
    wm["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(InputError, match="00002-of-00002.safetensors named in .* is missing"):
        load(sharded)
    trunc = tmp_path / "trunc"
    shutil.copytree(d, trunc)
    os.truncate(trunc / "model.safetensors", (trunc / "model.safetensors").stat().st_size - 100)
    with pytest.raises(InputError, match="truncated"):
        load(trunc)
    with pytest.raises(InputError, match="capacity 0: a fraction of E"):
        load(d, capacity=0)
    import expertcache.runtime.engine.loads as loads_mod

    monkeypatch.setattr(loads_mod, "available_memory", lambda: 1 << 16)  # less than one layer's k experts
    with pytest.raises(InputError, match="needs .* GiB; only"):
        load(d, capacity=1)
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match="'nobody/no-such-moe' cannot be opened: downloads are off"):
        load("nobody/no-such-moe")
    with pytest.raises(InputError, match=r"load\(\) takes no argument capcity; engine options go in engine="):
        load(d, capcity=0.5)
    # through the CLI: one line on stderr, exit 2, no traceback
    assert main(["bench", "decode", "--model", str(pick), "--corpus", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pickle" in err[0]


def test_engine_config_is_checked_before_anything_is_allocated():
    for bad in (dict(tau=-1.0), dict(tier="throttled:nan"), dict(tier="throttled:-5"), dict(workers=0),
                dict(device="tpu"), dict(miss="pray")):
        with pytest.raises(InputError):
            EngineConfig(**bad).check()


def test_large_reads_go_in_concurrent_pieces_and_land_intact(tmp_path, monkeypatch):
    """An expert of >= 4 MiB is read as four aligned pieces at once; the slot holds exactly the file's bytes."""
    from expertcache.runtime.storage.checkpoint import StoreExperts
    from expertcache.runtime.storage.store import read_store_meta, write_random_store
    from expertcache.runtime.storage.tiers import DiskTier, SlotPool

    path = tmp_path / "big.store"
    write_random_store(path, 2, 2, [("gate_up_proj", [2048, 1024], "bfloat16"), ("down_proj", [1024, 1024], "bfloat16")])
    meta = read_store_meta(path)
    tier = DiskTier(StoreExperts(path, meta))
    pieces = []
    one = tier._pread_one
    monkeypatch.setattr(tier, "_pread_one", lambda fd, view, off, need, what: (pieces.append(len(view)),
                                                                              one(fd, view, off, need, what)))
    pool = SlotPool(meta, 2)
    tier.read(1, 1, pool, 1)
    tier.close()
    assert len(pieces) == 4 and sum(pieces) == meta.block_bytes
    raw = path.read_bytes()[meta.offset(1, 1):meta.offset(1, 1) + meta.block_bytes]
    assert bytes(pool.slot_bytes(1)) == raw


def test_one_engine_config_carries_every_option(saved):
    """`load(engine=EngineConfig(...))` (what the commands pass) uses its fields, all of them; engine options given
    beside it are refused in one line rather than one silently winning."""
    from expertcache.telemetry.errors import InputError

    d, _ = saved["qwen3_moe"]
    m = load(d, engine=EngineConfig(capacity=3, tier="host", policy="lfu", workers=2, prefetch_guard=0.0))
    eng = m.expertcache
    assert (eng.capacity, eng.cfg.tier, eng.cfg.policy, eng.cfg.workers, eng.cfg.prefetch_guard) == \
        (3, "host", "lfu", 2, 0.0)
    eng.close()
    with pytest.raises(InputError, match="both given"):
        load(d, capacity=2, engine=EngineConfig())
    # the keyword form of engine options is gone: one line names the form that carries them
    with pytest.raises(InputError, match=r"^load\(policy='lfu', tau=0.2\): engine options go in "
                                         r"engine=EngineConfig\(policy='lfu', tau=0.2\)$"):
        load(d, capacity=3, policy="lfu", tau=0.2)
    with pytest.raises(InputError, match="engine options go in"):
        load(d, engine=EngineConfig(), policy="lru")


def test_aux_routers_reach_the_runtime_one_way(saved, monkeypatch):
    """The spatio predictor and the scored policy get the checkpoint's aux routers from the loader an entry point
    installed (`set_aux_routers_loader`), asked by `load` itself; with none installed, one line says how."""
    from expertcache.runtime.engine import predictors

    d = saved["qwen3_moe"][0]
    monkeypatch.setattr(predictors, "_AUX_LOADER", None)
    with pytest.raises(InputError, match="set_aux_routers_loader"):
        load(d, capacity=2, tier="host", predictor="spatio")
    asked = []

    def loader(checkpoint_dir, model):
        asked.append(checkpoint_dir)
        raise InputError(f"no auxiliary routers at {checkpoint_dir}")

    predictors.set_aux_routers_loader(loader)
    with pytest.raises(InputError, match="no auxiliary routers"):
        load(d, engine=EngineConfig(capacity=2, tier="host", policy="scored"))
    assert asked == [d]
    load(d, capacity=2, tier="host").expertcache.close()  # nothing asks for them otherwise
    assert asked == [d]
