"""Issue 45 finding 2: `verify`'s reference-free checks (finite; each tensor's magnitude against its siblings') run
where weights are served or written. A checkpoint without a checksum index (every fresh, imported or downloaded
one) whose expert is NaN or exponent-flipped is refused by load (host tier: every expert; disk tier: a sample at
start, then each expert's first read through the engine), generate, eval and serve, naming the tensor, and
import-gguf / quantize of such weights are refused before anything is published; `--integrity off` lets them by."""

import json

import gguf
import numpy as np
import pytest
import torch

from expertcache.recipes.cli import main
from expertcache.runtime import EngineConfig, load
from expertcache.runtime.storage import weight_checks
from expertcache.runtime.storage.checkpoint import CHECKSUM_INDEX
from expertcache.runtime.storage.loader import expert_source
from expertcache.runtime.storage.tiers import DiskTier
from expertcache.runtime.storage.weight_checks import expert_checks, magnitudes, max_abs
from expertcache.telemetry.errors import InputError
from test_gguf_import import Q, write_gguf
from tiny_lm import make_tiny_checkpoint
from tiny_models import build_model, tiny_config

NAN = np.float32("nan")


def _poke(path, offset: int, dtype: torch.dtype, fn) -> None:
    """The element of `dtype` at byte `offset` of `path` replaced by `fn(its bit pattern)`, in place."""
    n = torch.empty((), dtype=dtype).element_size()
    with open(path, "r+b") as f:
        f.seek(offset)
        bits = int.from_bytes(f.read(n), "little")
        f.seek(offset)
        f.write(int(fn(bits)).to_bytes(n, "little"))


def _damage_expert(ckpt, layer: int, expert: int, how: str, index: int = 5) -> str:
    """One weight of MoE `layer`'s `expert` (its first tensor in the file, element `index`): `nan`, or `flip` (the top
    exponent bit set: |w| < 2 becomes 2^128 times larger, still finite, as bit rot does). Returns the tensor's name
    as the engine's message names it."""
    src = expert_source(ckpt)
    s = src.spans(layer, expert)[0]
    assert s.src_dtype == torch.bfloat16
    off = s.offset + index * 2
    if how == "nan":
        _poke(src.files[s.file], off, s.src_dtype, lambda b: 0x7FC0)
    else:
        _poke(src.files[s.file], off, s.src_dtype, lambda b: b | 0x4000)
    assert not (ckpt / CHECKSUM_INDEX).exists()  # no reference: only the reference-free checks can see it
    return src.meta.tensors[0].name


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    build_model(tiny_config("qwen3_moe"), seed=2, dtype=torch.bfloat16).save_pretrained(d)
    return d


def test_magnitudes_are_max_abs_from_the_bits_with_nan_and_inf_kept():
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(6, 300, generator=g) * 0.05).to(dt)
        x[1, 4], x[2, 9], x[3, 0], x[4, 17] = float("nan"), float("-inf"), -7.5, float("inf")
        x[5] = -x[5].abs()  # a row of negatives only
        got = magnitudes(x)
        want = x.double().abs().amax(dim=1).numpy()
        assert np.isnan(got[1]) and np.isinf(got[2]) and np.isinf(got[4]), dt
        ok = [0, 3, 5]
        assert np.array_equal(got[ok], want[ok]) and got[3] == 7.5, dt
    # a strided [E, n] view (a host copy's layer: one block per expert, padding between): no copy, same values
    raw = (torch.randn(4, 96, generator=g) * 0.02).to(torch.bfloat16)
    view = raw[:, :80]
    assert not view.is_contiguous() and np.array_equal(magnitudes(view), view.double().abs().amax(1).numpy())
    assert max_abs(torch.tensor([-3.0, 2.0])) == 3.0 and max_abs(torch.empty(0)) == 0.0


@pytest.mark.parametrize("how", ["nan", "flip"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_load_refuses_a_damaged_expert_of_an_unindexed_checkpoint_naming_it(ckpt, how, tier):
    healthy = load(ckpt, capacity=2, tier=tier)  # a fresh, healthy checkpoint passes, its experts checked
    try:
        checks = next(iter(healthy.expertcache.loads.checks.values()))
        assert checks.checked.sum() == (16 if tier == "host" else min(16, weight_checks.SAMPLE))
    finally:
        healthy.expertcache.close()
    name = _damage_expert(ckpt, 1, 3, how)
    why = "holds NaN/inf" if how == "nan" else r"has max \|w\| [\d.e+]+, [\d.e+]+x its siblings' [\d.e-]+ " \
                                               r"\(an exponent flip\?\)"
    with pytest.raises(InputError, match=rf"damaged weights: {name} of MoE layer 1 \(model\.layers\.1\.mlp\.experts\) "
                                         rf"expert 3 in model\.safetensors of .*{why}; refused "
                                         rf"\(--engine\.integrity off serves it anyway\)") as e:
        load(ckpt, capacity=2, tier=tier)
    assert "\n" not in str(e.value)
    m = load(ckpt, engine=EngineConfig(capacity=2, tier=tier, integrity="off"))  # the user's word: served as read
    try:
        assert m.expertcache.describe()["weight_checks"] == "off" and not m.expertcache.loads.checks
        m(input_ids=torch.arange(8)[None])
    finally:
        m.expertcache.close()


def test_a_miss_through_the_engine_refuses_an_expert_the_start_did_not_read(ckpt, monkeypatch):
    """The disk tier reads a sample at start; every other expert is checked on its first read, in the engine's load
    threads, and the refusal reaches the forward that needed it."""
    monkeypatch.setattr(weight_checks, "SAMPLE", 2)
    tier = DiskTier(expert_source(ckpt))
    try:
        sampled = expert_checks(tier).checked.copy()  # what a start reads (deterministic) on the healthy file
    finally:
        tier.close()
    assert sampled.sum() == 2
    unread = [(i, e) for i in range(2) for e in range(8) if not sampled[i, e]]
    for i, e in unread:  # every expert the start does not read: any miss of the forward below meets one
        _damage_expert(ckpt, i, e, "nan")
    m = load(ckpt, capacity=1, tier="disk")  # the sample is healthy: the load passes
    eng = m.expertcache
    try:
        ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
        with pytest.raises(InputError, match=r"damaged weights: \w+ of MoE layer \d .* expert \d .*holds NaN/inf"):
            with torch.no_grad():
                m(input_ids=ids)
        assert eng.stats.bytes_moved > 0
    finally:
        eng.close()
    m = load(ckpt, engine=EngineConfig(capacity=1, tier="disk", integrity="off"))
    try:
        with torch.no_grad():
            out = m(input_ids=ids).logits
        assert not torch.isfinite(out).all()  # what the check kept from being served
    finally:
        m.expertcache.close()


def test_a_damaged_non_expert_weight_is_refused_at_load(ckpt):
    from safetensors import safe_open
    from safetensors.torch import save_file

    f = ckpt / "model.safetensors"
    with safe_open(str(f), "pt") as r:
        state = {k: r.get_tensor(k) for k in r.keys()}
    good = dict(state)
    state["model.layers.1.self_attn.o_proj.weight"] = state["model.layers.1.self_attn.o_proj.weight"] * 2.0 ** 20
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"tensor model\.layers\.1\.self_attn\.o_proj\.weight of .* has max \|w\| "
                                         r"[\d.e+]+, [\d.]+e\+0[56]x its siblings'"):
        load(ckpt, capacity=2, tier="disk")
    state = dict(good)
    state["model.norm.weight"] = state["model.norm.weight"].clone()
    state["model.norm.weight"][3] = float("nan")  # a group of one: finiteness still applies
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"tensor model\.norm\.weight of .* holds NaN/inf"):
        load(ckpt, capacity=2, tier="disk")
    load(ckpt, engine=EngineConfig(capacity=2, tier="disk", integrity="off")).expertcache.close()


def test_integrity_takes_on_or_off_only(ckpt, capsys):
    with pytest.raises(InputError, match="integrity 'maybe'; expected on or off"):
        load(ckpt, engine=EngineConfig(capacity=2, integrity="maybe"))
    assert main(["generate", "--model", str(ckpt), "--prompt", "x", "--engine.integrity", "no"]) == 2
    assert main(["quantize", "--model", str(ckpt), "--out", str(ckpt.parent / "q"), "--integrity", "no"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("expected on or off" in line for line in err), err
    assert not (ckpt.parent / "q").exists()


@pytest.fixture(scope="module")
def talk(tmp_path_factory):
    """A tiny checkpoint with a tokenizer (generate, eval, serve read one), its layer 1 expert 3 NaN."""
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("talk") / "m", hidden_size=64, moe_intermediate_size=64,
                             intermediate_size=64)  # (sizes quantize's group 32 divides)
    st = d / "model.safetensors"
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(st), "pt") as r:
        state = {k: r.get_tensor(k) for k in r.keys()}
    k = "model.layers.1.mlp.experts.3.down_proj.weight"  # (saved per expert, as published checkpoints are)
    state[k] = state[k].clone()
    state[k][0, 1] = float("nan")
    save_file(state, str(st), metadata={"format": "pt"})
    text = d.parent / "text.txt"
    text.write_text("the cat sat on the mat and the dog ran after it " * 20)
    return d, text


@pytest.mark.slow  # generate, eval and serve in turn (about 1 s)
def test_generate_eval_and_serve_refuse_the_damaged_checkpoint_in_one_line(talk, tmp_path, capsys):
    d, text = talk
    engine = ["--engine.capacity", "2"]
    cases = {
        "generate": ["generate", "--model", str(d), "--prompt", "hello", "--max_tokens", "2", *engine],
        "eval": ["eval", "--model", str(d), "--tasks", "[]", "--ppl_file", str(text), "--seq_len", "16",
                 "--ppl_blocks", "1", "--out", str(tmp_path / "e.json"), *engine],
        "serve": ["serve", "--model", str(d), "--port", "8123", *engine],
    }
    capsys.readouterr()
    for name, argv in cases.items():
        for tier in ("host", "disk"):
            assert main([*argv, "--engine.tier", tier]) == 2, (name, tier)
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "damaged weights: down_proj of MoE layer 1" in err[0] and \
                "expert 3 " in err[0] and "holds NaN/inf" in err[0] and "--engine.integrity off" in err[0], \
                (name, tier, err)
    assert not (tmp_path / "e.json").exists()
    rc = main(["generate", "--model", str(d), "--prompt", "hello", "--max_tokens", "2", "--temperature", "0",
               *engine, "--engine.tier", "host", "--engine.integrity", "off"])
    assert rc == 0  # the user's word


def _refused_late(argv, msg: str, out, capsys) -> None:
    """`argv` exits 2 after its work (progress lines above), the refusal one line naming `msg`, `out` not written
    and no temporary folder beside it."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    bad = [line for line in err if "error:" in line]
    assert len(bad) == 1 and bad == err[-1:] and msg in bad[0] and "nothing was published" in bad[0], err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _nan_expert_scale(f, layer: int) -> None:
    """The first Q8_0 block's fp16 scale of `blk.{layer}.ffn_down_exps` (expert 0) set to NaN, in the file."""
    t = next(t for t in gguf.GGUFReader(str(f)).tensors if t.name == f"blk.{layer}.ffn_down_exps.weight")
    _poke(f, int(t.data_offset), torch.float16, lambda b: 0x7E00)


def test_import_gguf_of_nan_experts_is_refused_before_anything_is_published(tmp_path, capsys):
    src = make_tiny_checkpoint(tmp_path / "src", hidden_size=64, moe_intermediate_size=64, intermediate_size=64)
    f = write_gguf(src, tmp_path / "m.gguf", experts=Q.Q8_0)
    _nan_expert_scale(f, 1)
    out = tmp_path / "imported"
    _refused_late(["import-gguf", "--gguf", str(f), "--out", str(out)],
                  "MoE layer 1 expert 0 down_proj.scales of the import-gguf output holds NaN/inf", out, capsys)
    assert main(["import-gguf", "--gguf", str(f), "--out", str(out), "--integrity", "off"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 8


def test_import_gguf_of_bf16_experts_scaled_by_a_million_is_refused(tmp_path, capsys):
    src = make_tiny_checkpoint(tmp_path / "src", hidden_size=64, moe_intermediate_size=64, intermediate_size=64)
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        m.model.layers[0].mlp.experts.down_proj[2] *= 1e6
    m.save_pretrained(src)
    f = write_gguf(src, tmp_path / "m.gguf", experts=Q.BF16)
    out = tmp_path / "imported"
    _refused_late(["import-gguf", "--gguf", str(f), "--out", str(out)],
                  "MoE layer 0 expert 2 (expert part 2) of the import-gguf output has max |w|", out, capsys)


def test_quantize_of_a_nan_expert_is_refused_before_anything_is_published(talk, tmp_path, capsys):
    d, _ = talk
    out = tmp_path / "q"
    _refused_late(["quantize", "--model", str(d), "--bits", "8", "--out", str(out)],
                  "MoE layer 1 expert 3 down_proj.scales of the quantize output holds NaN/inf", out, capsys)
    assert main(["quantize", "--model", str(d), "--bits", "8", "--out", str(out), "--integrity", "off"]) == 0
    assert (out / "config.json").is_file()


def test_serve_refuses_a_request_that_meets_a_damaged_expert_and_goes_on(talk, monkeypatch):
    """The disk tier's start sample misses the damaged expert: the request whose decode reads it gets a 400 naming
    it (never its tokens); the server keeps serving, and refuses it again when it is read again."""
    import httpx
    from helpers import LiveServer
    from transformers import AutoTokenizer

    from expertcache.runtime.serve.serve import create_app

    d, _ = talk
    monkeypatch.setattr(weight_checks, "SAMPLE", 1)
    tier = DiskTier(expert_source(d))
    try:
        sampled = expert_checks(tier).checked
        assert not sampled[1, 3]  # the damaged one is left to a miss
    finally:
        tier.close()
    m = load(d, capacity=1, tier="disk")
    app = create_app(m, AutoTokenizer.from_pretrained(str(d)), "tiny", max_tokens_default=8, torch_threads=1)
    body = {"model": "tiny", "prompt": "the cat sat on the mat and the dog " * 6, "max_tokens": 8,
            "temperature": 0}
    try:
        with LiveServer(app) as url:
            for _ in range(2):
                r = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 400 and "choices" not in r.json(), r.text
                msg = r.json()["error"]["message"]
                assert "damaged weights: down_proj of MoE layer 1" in msg and "expert 3 " in msg and \
                    "holds NaN/inf" in msg, msg
            assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        m.expertcache.close()


@pytest.mark.slow  # the same three on the plain model (about 1 s)
def test_the_plain_model_is_checked_too(talk, tmp_path, capsys):
    """No engine options (eval's default, generate --plain true): the whole model is in memory, and the same
    checks run over it once; a NaN expert is refused in one line naming its tensor, and nothing is written."""
    d, text = talk
    cases = {
        "eval": ["eval", "--model", str(d), "--tasks", "[]", "--ppl_file", str(text), "--seq_len", "16",
                 "--ppl_blocks", "1", "--out", str(tmp_path / "e.json")],
        "generate": ["generate", "--model", str(d), "--prompt", "hello", "--max_tokens", "2", "--plain", "true"],
    }
    capsys.readouterr()
    for name, argv in cases.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()  # (transformers' loading bar above it)
        bad = [line for line in err if "error:" in line]
        assert len(bad) == 1 and bad == err[-1:] and "layers.1.mlp.experts" in bad[0] and "NaN" in bad[0] \
            and "--engine.integrity off" in bad[0], (name, err)
    assert not (tmp_path / "e.json").exists()


def test_check_model_finds_one_flipped_expert_of_a_fused_tensor():
    """A fused `[E, out, in]` experts tensor counts as E siblings: one expert scaled by 2^60 is refused by index,
    the same tensor unscaled passes."""
    import torch

    from expertcache.runtime.storage.weight_checks import check_model

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.down_proj = torch.nn.Parameter(torch.randn(8, 4, 4))

    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList()
    for _ in range(2):
        blk = torch.nn.Module()
        blk.experts = Experts()
        m.layers.append(blk)
    check_model(m, "m")  # clean
    with torch.no_grad():
        m.layers[1].experts.down_proj[5] *= 2.0 ** 60
    with pytest.raises(InputError, match=r"layers\.1\.experts\.down_proj\.5"):
        check_model(m, "m")


@pytest.fixture
def overlapped(monkeypatch):
    """Loads in the load threads (as for experts of 1 MiB or more), whatever the tiny experts' size, and one compute
    thread (a core left free): first-read checks run in the check thread, beside the compute."""
    import os

    from expertcache.runtime.engine import engine as engine_mod

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a check beside the compute needs a core the compute leaves free")
    monkeypatch.setattr(engine_mod, "OVERLAP_MIN_BYTES", 0)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_the_check_runs_inline_where_the_compute_takes_every_core(ckpt, overlapped):
    """With as many compute threads as cores, a first read is checked in the load thread before the read completes
    (a third thread beside the compute measured slower on 2 cores); with a core free, beside the compute."""
    import os

    m = load(ckpt, capacity=2, tier="disk")
    loads = m.expertcache.loads
    try:
        assert loads.spare_core()
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        assert not loads.spare_core()
    finally:
        m.expertcache.close()


def test_a_first_read_check_runs_beside_the_compute_and_holds_the_step(ckpt, overlapped, monkeypatch):
    """The layer computes as soon as a miss's bytes land; the check of that first read runs beside it, and the
    forward does not return (its logits do not leave the engine) until the check has passed."""
    import threading

    monkeypatch.setattr(weight_checks, "SAMPLE", 2)
    m = load(ckpt, capacity=1, tier="disk")
    eng = m.expertcache
    release, held = threading.Event(), []
    real = weight_checks.ExpertChecks.check

    def check(self, *a):
        held.append(a[:2])
        assert release.wait(60)
        return real(self, *a)

    monkeypatch.setattr(weight_checks.ExpertChecks, "check", check)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    done, out = threading.Event(), {}

    def forward():
        with torch.no_grad():
            out["logits"] = m(input_ids=ids).logits
        done.set()

    t = threading.Thread(target=forward, daemon=True)
    try:
        t.start()
        n_layers = len(eng.modules)
        for _ in range(600):  # every layer computed while the first check is still held (no wall-clock bound:
            if eng.stats.calls >= n_layers or done.is_set():  # a condition waited for)
                break
            threading.Event().wait(0.05)
        assert held and eng.stats.calls == n_layers, (held, eng.stats.calls)
        assert not done.is_set() and "logits" not in out  # held at the forward's end
        release.set()
        assert done.wait(60) and torch.isfinite(out["logits"]).all()
    finally:
        release.set()
        t.join(60)
        eng.close()


def test_a_damaged_expert_found_beside_the_compute_is_refused_at_the_step_end_and_again(ckpt, overlapped,
                                                                                     monkeypatch):
    """The check thread finds the NaN expert: the forward that read it raises, naming it; the cache starts cold, so
    the next forward reads it again and is refused again (no slot or victim serves it unchecked); with integrity off
    the same forward returns."""
    monkeypatch.setattr(weight_checks, "SAMPLE", 2)
    tier = DiskTier(expert_source(ckpt))
    try:
        sampled = expert_checks(tier).checked.copy()
    finally:
        tier.close()
    for i, e in [(i, e) for i in range(2) for e in range(8) if not sampled[i, e]]:
        _damage_expert(ckpt, i, e, "nan")
    m = load(ckpt, capacity=2, tier="disk")
    eng = m.expertcache
    assert eng.loads.checker is not None
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(2):
            with pytest.raises(InputError, match=r"damaged weights: \w+ of MoE layer \d .* expert \d .*NaN/inf"):
                with torch.no_grad():
                    m(input_ids=ids)
    finally:
        eng.close()
    m = load(ckpt, engine=EngineConfig(capacity=2, tier="disk", integrity="off"))
    try:
        with torch.no_grad():
            assert not torch.isfinite(m(input_ids=ids).logits).all()
    finally:
        m.expertcache.close()
