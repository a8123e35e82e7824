"""Aux routers for a base bigger than memory (#44 item 5): `trace record --hidden true` through the offload engine
(`load()`, experts read through the tiers at capacity 0.25) gives the in-memory recorder's trace; `train-cache-aware
--recipe aux-only` trains the aux routers from that trace (no forward of the model), and `load(predictor="spatio")`
serves with them; a trace without hidden states or of another model's shape is one line and exit 2."""

import json

import pytest
import torch
from tiny_lm import make_tiny_checkpoint, one_torch_thread  # noqa: F401 - autouse fixture

from expertcache.recipes.cli import main
from expertcache.telemetry.parquet_trace import read_trace

WORDS = "the cat sat on a mat while dogs ran past quiet old houses near the river bank"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("auxbig")
    ck = make_tiny_checkpoint(root / "ck")
    prompts = root / "p.txt"
    w = WORDS.split()
    prompts.write_text("\n".join(" ".join(w[i:] + w[:i]) for i in range(6)) + "\n")
    return {"root": root, "ck": ck, "prompts": prompts}


def _record(setup, out, *extra):
    return main(["trace", "record", "--model", str(setup["ck"]), "--out", str(out), "--prompts", str(setup["prompts"]),
                 "--prompt_len", "8", "--decode_tokens", "6", *extra])


def _train(setup, trace, out, capsys=None):
    return main(["train-cache-aware", "--recipe", "aux-only", "--recipe.base", str(setup["ck"]),
                 "--recipe.out_dir", str(out), "--recipe.routers.trace", str(trace), "--recipe.routers.rank", "2",
                 "--recipe.data.tokenizer", str(setup["ck"]), "--recipe.data.batch_size", "3",
                 "--recipe.train.max_steps", "30", "--recipe.train.warmup_steps", "2",
                 "--recipe.routers.lr", "0.01", "--recipe.routers.prefetch_threshold", "0.05"])


@pytest.mark.slow  # records through the engine, trains, serves (about 1 s)
def test_offloaded_record_trains_aux_routers_that_spatio_serves(setup, tmp_path, capsys):
    mem, off = tmp_path / "mem.parquet", tmp_path / "off.parquet"
    assert _record(setup, mem, "--hidden", "true") == 0
    assert json.loads(capsys.readouterr().out)["offload"] is False
    assert _record(setup, off, "--hidden", "true", "--offload", "true", "--engine.capacity", "0.25") == 0
    assert json.loads(capsys.readouterr().out)["offload"] is True
    a, b = read_trace(mem), read_trace(off)
    ids_a, seq_a, pos_a = a.routing()
    ids_b, seq_b, pos_b = b.routing()
    assert ids_a.shape == ids_b.shape and (seq_a == seq_b).all() and (pos_a == pos_b).all()
    assert (ids_a == ids_b).all()  # the same experts, token by token, layer by layer
    ha, hb = a.layer_matrix("hidden"), b.layer_matrix("hidden")
    assert ha.shape == hb.shape and abs(ha).max() > 0.1
    assert abs(ha.astype("float32") - hb.astype("float32")).max() < 2e-2  # float16 storage: rounding only

    run = tmp_path / "run"
    assert _train(setup, off, run) == 0
    res = json.loads((run / "result.json").read_text())
    assert res["from_trace"] == str(off) and res["trace_tokens"] == ids_b.shape[1]
    assert res["loss_last"] < res["loss_first"]  # the heads learned the trace's routing
    mtime = (run / "result.json").stat().st_mtime_ns
    capsys.readouterr()
    assert _train(setup, off, run) == 0  # finished with this recipe: reported again, nothing trained
    assert json.loads(capsys.readouterr().out)["nothing_to_do"] is True
    assert (run / "result.json").stat().st_mtime_ns == mtime
    model_dir = run / "model"
    assert (model_dir / "aux_routers.safetensors").is_file()

    from transformers import AutoModelForCausalLM

    from expertcache.runtime import load
    from expertcache.runtime.engine.predictors import aux_routers_for, set_aux_routers_loader
    from expertcache.trainer.aux_routers import load_aux_routers

    set_aux_routers_loader(load_aux_routers)  # what the CLI installs
    m = load(model_dir, capacity=0.25, predictor="spatio")
    aux = aux_routers_for(model_dir, m)
    assert aux is not None and aux.spatio is not None
    assert any(float(p.detach().abs().sum()) > 0 for p in aux.spatio[0].up.parameters())  # trained, not the zero start
    prompt = torch.tensor([[5, 9, 14, 3, 7, 11]])
    got = m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=m.config.pad_token_id)
    ref = AutoModelForCausalLM.from_pretrained(setup["ck"]).eval()
    want = ref.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=ref.config.pad_token_id)
    assert torch.equal(got, want)  # the predictor decides prefetches, never the tokens
    pred = m.expertcache.predictor
    assert pred.name == "spatio" and torch.equal(pred.aux.spatio[0].up.weight, aux.spatio[0].up.weight)


def test_aux_only_refuses_a_trace_without_hidden_states_or_of_another_model(setup, tmp_path, capsys):
    plain = tmp_path / "plain.parquet"
    assert _record(setup, plain) == 0
    capsys.readouterr()
    assert _train(setup, plain, tmp_path / "r1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no hidden states" in err[0] and "--hidden true" in err[0]
    other = make_tiny_checkpoint(tmp_path / "other", num_experts=4)
    t = tmp_path / "other.parquet"
    assert main(["trace", "record", "--model", str(other), "--out", str(t), "--prompts", str(setup["prompts"]),
                 "--prompt_len", "8", "--decode_tokens", "2", "--hidden", "true"]) == 0
    capsys.readouterr()
    assert _train(setup, t, tmp_path / "r2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a trace of the base" in err[0] and "4 experts" in err[0]
    assert not (tmp_path / "r1" / "model").exists() and not (tmp_path / "r2" / "model").exists()


def test_engine_options_imply_offload_and_trace_is_for_aux_only(setup, tmp_path, capsys):
    from expertcache.trainer.cache_aware import CacheAwareRecipe
    from expertcache.trainer.config import RecipeError, load_recipe
    from helpers import REPO

    assert _record(setup, tmp_path / "t.parquet", "--engine.capacity", "0.5") == 0  # a changed engine field
    assert json.loads(capsys.readouterr().out)["offload"] is True
    with pytest.raises(RecipeError, match="routers.trace is for mode=aux-only"):
        load_recipe(CacheAwareRecipe, REPO / "recipes" / "cache-aware" / "aux-only.yaml",
                    ["mode=joint", "routers.trace=t.parquet"])


@pytest.mark.slow  # two recordings of a checkpoint (about 1 s)
def test_offloaded_record_of_a_bf16_checkpoint_matches_in_memory(setup, tmp_path):
    """bf16: the engine's CPU kernels (patched routers, the one-function decode step) run, and the router hooks
    still see every forward; the ids are the same and the hidden states agree to bf16 rounding."""
    import shutil

    from transformers import AutoModelForCausalLM

    bf = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(setup["ck"]).to(torch.bfloat16).save_pretrained(bf)
    for f in setup["ck"].iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, bf / f.name)
    args = ["trace", "record", "--model", str(bf), "--prompts", str(setup["prompts"]), "--prompt_len", "8",
            "--decode_tokens", "6", "--hidden", "true"]
    assert main([*args, "--out", str(tmp_path / "mem.parquet")]) == 0
    assert main([*args, "--out", str(tmp_path / "off.parquet"), "--offload", "true", "--engine.capacity", "0.25"]) == 0
    a, b = read_trace(tmp_path / "mem.parquet"), read_trace(tmp_path / "off.parquet")
    assert a.meta.dtype == b.meta.dtype == "bfloat16"
    assert (a.routing()[0] == b.routing()[0]).all()
    ha, hb = (t.layer_matrix("hidden").astype("float32") for t in (a, b))
    assert abs(ha - hb).max() <= 2 ** -5 * abs(ha).max()  # a few bf16 ulps (measured: 0.031 at |h| 3.4)
    # the bf16 base's aux routers (trained in fp32 from the trace) are this checkpoint's: spatio loads them
    assert _train({**setup, "ck": bf}, tmp_path / "off.parquet", tmp_path / "run") == 0
    from expertcache.runtime import load

    m = load(tmp_path / "run" / "model", capacity=0.25, predictor="spatio")
    assert m.expertcache.predictor.name == "spatio" and next(m.parameters()).dtype == torch.bfloat16
    assert m.generate(torch.tensor([[5, 9, 14, 3]]), max_new_tokens=4, do_sample=False,
                      pad_token_id=m.config.pad_token_id).shape == (1, 8)
