"""What cannot work is refused at start, in one line (exit 2), before any work (#45 findings 3, 4, 5, 7, 8, 9):
serve's empty API key and a chat template that cannot render; a chat message's unknown role (HTTP 400 naming the
roles, as OpenAI answers, from the real server); bench big's empty or routing-incompatible systems (before the
checkpoint is written); bench decode's lookahead distances; a dtype that a quantized checkpoint's store cannot be
served in, named as such."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from helpers import LiveServer
from tiny_lm import CHATML, make_tiny_checkpoint, one_torch_thread  # noqa: F401 - autouse fixture

from expertcache.recipes.cli import main
from expertcache.runtime.serve.request import ROLES, check_chat_template
from expertcache.telemetry.errors import InputError

NAME = "tiny-moe"
# ChatML that refuses a system turn, as Gemma's and Mistral's templates do (`raise_exception`)
NO_SYSTEM = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" \
    + CHATML


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("refused") / "ckpt")


def _one_line(capsys, *needles) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("expertcache ") and ": error: " in err[0], err
    assert all(n in err[0] for n in needles), err[0]
    return err[0]


# --- serve ---------------------------------------------------------------------------------------------------

@pytest.mark.slow  # starts a server (about 1.5 s)
def test_an_unknown_chat_role_is_a_400_naming_the_roles_and_the_server_goes_on(ckpt):
    """From the real server over HTTP: role "wizard" is a 400 whose message names every accepted role (param
    messages.0.role); a turn the template itself refuses is a 400 with the template's words, not a 500; a valid
    conversation is answered after both."""
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.runtime.serve.serve import create_app

    model = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    tok.chat_template = NO_SYSTEM
    with LiveServer(create_app(model, tok, NAME, max_tokens_default=4, torch_threads=1)) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "messages.0.role", err
        assert all(f"'{role}'" in err["message"] for role in ROLES), err["message"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="System role not supported"):
            client.chat.completions.create(model=NAME, messages=[{"role": "system", "content": "be brief"},
                                                                 {"role": "user", "content": "hi"}], max_tokens=2)
        ok = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "thou art"}],
                                            max_tokens=3, temperature=0)
        assert ok.choices[0].message.role == "assistant" and 1 <= ok.usage.completion_tokens <= 3


def test_an_empty_api_key_is_refused_before_the_model_is_opened(tmp_path, capsys):
    """`--api_key "$KEY"` with $KEY unset served everyone; the model named does not even exist, so the key is
    checked first. A key with surrounding spaces (no client can send it) is refused the same way; the app refuses
    an empty key too (the Python API)."""
    from expertcache.runtime.serve.serve import create_app

    for key in ("", "   "):
        assert main(["serve", "--model", str(tmp_path / "none"), "--api_key", key]) == 2
        _one_line(capsys, "--api_key", "is empty", "leave --api_key out")
    assert main(["serve", "--model", str(tmp_path / "none"), "--api_key", " s3cret"]) == 2
    assert "s3cret" not in _one_line(capsys, "--api_key", "whitespace")  # the key is not echoed
    with pytest.raises(InputError, match="is empty"):
        create_app(torch.nn.Linear(1, 1), None, NAME, api_key="")


@pytest.mark.parametrize("template, cause", [
    ("{% for m in messages %}{{ m['content'] }}", "TemplateSyntaxError"),  # an unclosed tag
    ("{% for m in messages %}{{ m.meta.name }}{% endfor %}", "UndefinedError"),  # a missing attribute
    ("{{ bos_token }} hello", "without its last user message"),  # renders, but drops the conversation
    ("{{ raise_exception('no') }}", "TemplateError"),
])
def test_a_chat_template_that_cannot_render_is_refused_before_the_model_loads(ckpt, tmp_path, capsys, template,
                                                                             cause):
    """The checkpoint here has no weights file: the template is refused before any weight is read."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, bare / f.name)
    (tmp_path / "t.jinja").write_text(template)
    assert main(["serve", "--model", str(bare), "--chat_template", str(tmp_path / "t.jinja")]) == 2
    _one_line(capsys, f"--chat_template {tmp_path / 't.jinja'}", cause)


def test_a_checkpoints_own_broken_template_is_refused_and_good_ones_pass(ckpt, tmp_path, capsys):
    from expertcache.telemetry.hf import load_tokenizer

    tok = load_tokenizer(ckpt)
    for good in (CHATML, NO_SYSTEM):  # the sample conversation has no system turn: a template may refuse one
        tok.chat_template = good
        check_chat_template(tok)
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    cfg = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{% if messages %}x"}))
    assert main(["serve", "--model", str(broken)]) == 2
    _one_line(capsys, f"{broken}'s chat template", "cannot render a sample conversation")


# --- bench big -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--systems", "[]"], "no system to run"),
    (["--systems", "[llama.cpp]"], "run it with --routing native"),  # the default routing is trace
    (["--systems", "[mmap,llama.cpp:unbounded]", "--routing", "trace"], "'llama.cpp:unbounded' routes with"),
    (["--systems", "[mmap]", "--engine.predictor", "lookahead:0"], "1 to 64"),  # checked with no prefetch row too
])
def test_bench_big_refuses_systems_that_cannot_run_before_the_checkpoint(tmp_path, capsys, args, needle):
    out_dir = tmp_path / "big"
    assert main(["bench", "big", "--out_dir", str(out_dir), "--out", str(tmp_path / "b.json"), *args]) == 2
    _one_line(capsys, needle)
    assert not out_dir.exists() and not (tmp_path / "b.json").exists()


def test_bench_big_accepts_llama_cpp_under_native_routing():
    from expertcache.runtime.bench.bigbench import check_systems
    from expertcache.runtime.engine.config import EngineConfig

    check_systems(["llama.cpp", "llama.cpp:unbounded", "mmap"], EngineConfig(tier="disk"), "native")
    check_systems(["mmap"], EngineConfig(tier="disk", predictor="oracle:0.5"), "trace")  # a trace's own, on trace


# --- bench decode --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--engine.predictor", "lookahead:0"], "1 to 64"),
    (["--engine.predictor", "lookahead:-2"], "1 to 64"),
    (["--predictors", "[lookahead:0]"], "1 to 64"),
    (["--engine.predictor", "lookahead:1", "--predictors", "[probe:1]"], "both given"),
])
def test_bench_decode_refuses_lookahead_distances_before_any_pass(ckpt, tmp_path, capsys, args, needle):
    assert main(["bench", "decode", "--model", str(ckpt), "--tokens", "2", "--corpus", str(tmp_path / "none"),
                 "--out", str(tmp_path / "b.json"), *args]) == 2
    _one_line(capsys, needle)
    assert not (tmp_path / "b.json").exists()


@pytest.mark.slow  # a whole bench decode run (about 2 s)
def test_bench_decode_runs_the_engines_predictor_not_probe_1(ckpt, tmp_path, capsys):
    """--engine.predictor lookahead:1 ran as probe:1 (the default list ignored it): its row is lookahead:1."""
    from expertcache.runtime.commands import bench_decode
    from expertcache.runtime.engine.config import EngineConfig

    res = bench_decode(model=str(ckpt), engine=EngineConfig(tier="host", predictor="lookahead:1"),
                       capacities=[0.25], tokens=2, warmup=0, rounds=1, prompts=1, prompt_len=8,
                       corpus=str(tmp_path / "none"), plain=False)
    assert res["inputs"]["predictors"] == ["lookahead:1"]
    assert [c for c in res["configs"] if not c.startswith(("on-demand", "resident"))] == ["lookahead:1+blocking@0.25"]


# --- a dtype against a quantized checkpoint ------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """int8 copies of a float32 checkpoint and of its bfloat16 cast (experts 32 wide: one group of 32)."""
    from transformers import AutoModelForCausalLM

    from expertcache.runtime.kernels.quant_write import write_quantized

    root = tmp_path_factory.mktemp("quantized")
    fp32 = make_tiny_checkpoint(root / "fp32", moe_intermediate_size=32)
    bf16 = root / "bf16"
    shutil.copytree(fp32, bf16)
    AutoModelForCausalLM.from_pretrained(str(fp32)).to(torch.bfloat16).save_pretrained(str(bf16))
    for src in (fp32, bf16):
        write_quantized(src, root / f"{src.name}-q8", 8, 32)
    return root


def test_a_narrower_dtype_on_a_quantized_checkpoint_names_the_real_cause(quantized, capsys):
    """bf16 compute on an int8 copy of a float32 model: the store belongs to the float32 routers, which bf16
    rounds. Said so, not "expert store comes from another checkpoint"; wider dtypes still serve."""
    from expertcache.runtime.storage.loader import load

    q32, q16 = quantized / "fp32-q8", quantized / "bf16-q8"
    for dtype, name in (("bf16", "bfloat16"), ("fp16", "float16")):
        with pytest.raises(InputError, match=f"--dtype {name}: .* its float32 routers") as e:
            load(q32, dtype=dtype, tier="host")
        assert "another checkpoint" not in str(e.value)
    assert main(["generate", "--model", str(q32), "--prompt", "hi", "--max_tokens", "2", "--dtype", "bf16"]) == 2
    _one_line(capsys, "float32 routers", "leave --dtype out")
    ids = torch.tensor([[5, 9, 17, 3]])
    for q, dtype in ((q32, None), (q16, None), (q16, "fp32")):  # a bfloat16 router is exact in float32
        m = load(q, dtype=dtype, capacity=1.0, tier="host")
        with torch.no_grad():
            logits = m(ids).logits
        assert logits.dtype == (torch.float32 if q is q32 or dtype == "fp32" else torch.bfloat16)
        assert torch.isfinite(logits).all()
        m.expertcache.close()


def test_a_quantized_checkpoint_has_no_plain_form_and_says_so(quantized, tmp_path, capsys):
    """eval and generate --plain of an int8 copy said "its weights do not fit its config (8 missing keys)"; eval
    with no engine option now serves it through the engine (every expert resident), --plain is refused."""
    from expertcache.evals.served import open_model

    q = quantized / "fp32-q8"
    m, eng = open_model(q, None)
    assert eng is not None and m.expertcache is eng and eng.cfg.capacity == 1.0
    eng.close()
    assert main(["generate", "--model", str(q), "--prompt", "hi", "--max_tokens", "2", "--plain", "true"]) == 2
    _one_line(capsys, "quantized checkpoint", "--engine.capacity")
    m, eng = open_model(quantized / "fp32", None)  # its source still opens plain
    assert eng is None and not any(p.is_meta for p in m.parameters())
