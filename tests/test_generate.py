"""`Generation` (the decode loop of generate and serve) against HF `generate`, through the offload engine too;
stop strings; and `expertcache generate` from the command line, streamed."""

import re

import pytest
import torch
from tiny_lm import make_tiny_checkpoint, one_torch_thread  # noqa: F401 - autouse fixture

from expertcache.recipes.cli import main
from expertcache.runtime.engine.config import EngineConfig
from expertcache.runtime.engine.engine import offload
from expertcache.runtime.serve.generate import Generation, generate_text
from expertcache.runtime.storage.loader import load_model
from expertcache.runtime.serve.request import SamplingParams, chat_prompt, encode
from expertcache.runtime.storage.store import write_store

PROMPT = "thou art the king"




@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-lm"), chat_template=True)


@pytest.fixture(scope="module")
def plain(ckpt):
    return load_model(ckpt, plain=True)


def _hf_greedy(model, ids, n):
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_matches_hf_generate_plain_and_through_the_engine(plain, tmp_path):
    model, tok = plain
    ids = encode(tok, PROMPT)
    g = Generation(model, tok, ids, SamplingParams(max_tokens=24, temperature=0))
    text = "".join(g)
    ref = _hf_greedy(model, ids, 24)
    assert g.completion_ids == ref[:g.completion_tokens]
    if g.finish_reason == "stop":  # ended on EOS, which HF keeps and we do not
        assert ref[g.completion_tokens] == tok.eos_token_id
    else:
        assert g.finish_reason == "length" and g.completion_tokens == 24
    assert text == tok.decode(g.completion_ids, skip_special_tokens=True)
    assert g.stats is None and "hit_rate" not in g.summary()

    from transformers import AutoModelForCausalLM

    m2 = AutoModelForCausalLM.from_pretrained(str(model.name_or_path)).eval()
    write_store(m2, tmp_path / "e.store")
    m2.expertcache = offload(m2, tmp_path / "e.store", EngineConfig(capacity=0.25, tier="disk"))
    try:
        g2 = Generation(m2, tok, ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        assert "".join(g2).startswith(text) and g2.completion_ids[:g.completion_tokens] == g.completion_ids
        s = g2.stats
        decode_steps = len(g2.token_times) - 1  # forwards after the first token (the prefill made that one)
        assert g2.completion_tokens == 24 and decode_steps == 23
        assert s.accesses == decode_steps * 2 * 2  # 2 MoE layers x top-2, one token per step
        assert 0 <= s.hits < s.accesses and s.demand_loads == s.accesses - s.hits
        summ = g2.summary()
        assert summ["hit_rate"] == pytest.approx(s.hits / s.accesses)
        assert summ["bytes_moved_per_token"] == pytest.approx(s.bytes_moved / decode_steps)
    finally:
        m2.expertcache.close()


def test_stop_strings_cut_the_text_and_are_never_streamed(plain):
    model, tok = plain
    ids = encode(tok, PROMPT)
    full = "".join(Generation(model, tok, ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
    assert len(full) > 20
    stop = full[10:14]
    g = Generation(model, tok, ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                   stop=["\x00never", stop]))
    pieces = list(g)
    assert "".join(pieces) == full[:full.find(stop)] == g.text
    assert g.finish_reason == "stop" and g.completion_tokens < 40


def test_sampling_is_seeded_and_cancel_stops(plain):
    model, tok = plain
    ids = encode(tok, PROMPT)
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    a = Generation(model, tok, ids, p)
    b = Generation(model, tok, ids, SamplingParams(**p.__dict__))
    assert "".join(a) == "".join(b) and a.completion_ids == b.completion_ids
    g = Generation(model, tok, ids, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    it = iter(g)
    while g.completion_tokens < 3:
        next(it)
    g.cancel.set()
    list(it)
    assert g.finish_reason == "cancelled" and 3 <= g.completion_tokens < 10
    with pytest.raises(Exception, match="max_tokens"):
        Generation(model, tok, ids, SamplingParams(max_tokens=0))


def test_chat_template_and_plain_transcript(plain):
    _, tok = plain
    msgs = [{"role": "user", "content": "hi"}]
    assert chat_prompt(tok, msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tok2 = type(tok).from_pretrained(tok.name_or_path)
    tok2.chat_template = None
    assert chat_prompt(tok2, msgs) == "user: hi\nassistant:"


class _Pieces:
    def __init__(self):
        self.writes = []

    def write(self, s):
        self.writes.append(s)

    def flush(self):
        pass


def test_generate_text_streams_piece_by_piece_and_chat_keeps_the_conversation(plain):
    model, tok = plain
    out, err = _Pieces(), _Pieces()
    generate_text(model, tok, PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), out=out,
                  err=err)
    assert len(out.writes) > 3 and out.writes[-1] == "\n"  # streamed as it decoded, not one write at the end
    assert "plain model" in err.writes[0]
    seen = []
    turns = iter(["hello", "and again", ""])

    def read(prompt):
        seen.append(prompt)
        return next(turns)

    out = _Pieces()
    generate_text(model, tok, None, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), chat=True,
                  out=out, err=_Pieces(), read=read)
    assert seen == ["> "] * 3 and out.writes.count("\n") == 2


def test_cli_generate_streams_then_one_line_of_figures(ckpt, capsys, tmp_path, monkeypatch):
    rc = main(["generate", "--model", str(ckpt), "--engine.capacity", "0.25", "--engine.tier", "disk",
               "--temperature", "0", "--max_tokens", "10", "--prompt", PROMPT])
    assert rc == 0
    cap = capsys.readouterr()
    model, tok = load_model(ckpt, plain=True)
    templated = chat_prompt(tok, [{"role": "user", "content": PROMPT}])
    g = Generation(model, tok, encode(tok, templated, templated=True), SamplingParams(max_tokens=10, temperature=0))
    assert cap.out == "".join(g) + "\n"  # the engine is lossless: the plain model's greedy text
    line = cap.err.strip().splitlines()[-1]
    assert re.fullmatch(r"\[\d+ tokens, [\d.]+ tok/s, hit rate [\d.]+ \(adjusted [\d.-]+\), [\d.]+ (B|KiB|MiB) "
                        r"moved/token, tier disk, 2/8 experts resident per layer, unverified \(no checksum index: "
                        r"`expertcache verify --model .*` records one\)\]", line), line  # no index: it says so
    monkeypatch.chdir(tmp_path)  # no runs/ca-starter/model here
    assert main(["generate", "--prompt", "hello"]) == 2
    assert "make quickstart" in capsys.readouterr().err


def test_the_checkpoint_generation_config_gives_the_sampling_defaults():
    """What `generation_config.json` sets (only that) fills what a request or flag leaves out: Qwen3's sampling
    values as they are; do_sample false, or sampling values without do_sample (transformers then decodes
    greedily), mean temperature 0; a config that sets none keeps OpenAI's defaults."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from expertcache.runtime.serve.request import checkpoint_sampling
    from expertcache.runtime.serve.serve import CompletionRequest, _params

    def ck(**kw):
        return checkpoint_sampling(SimpleNamespace(generation_config=GenerationConfig(**kw)))

    assert ck(do_sample=True, temperature=0.6, top_p=0.95, top_k=20) == {"temperature": 0.6, "top_p": 0.95,
                                                                         "top_k": 20}
    assert ck(do_sample=False, temperature=0.6) == {"temperature": 0.0}
    assert ck(temperature=0.7) == {"temperature": 0.0}
    assert ck(eos_token_id=1, pad_token_id=0) == {}
    req = CompletionRequest(prompt="x")
    p = _params(req, 8, 100, {"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, 20)
    p = _params(CompletionRequest(prompt="x", temperature=0.2, top_k=0), 8, 100, {"temperature": 0.6, "top_k": 20})
    assert (p.temperature, p.top_k) == (0.2, 0)  # what the request names wins
    p = _params(CompletionRequest(prompt="x"), 8, 100, {})
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, 0, 1.0)  # OpenAI's


def test_a_batch_of_prompts_decodes_as_each_alone_and_the_cli_prints_one_json_line_each(ckpt, plain, tmp_path,
                                                                                      capsys):
    """Continuous batching (prompts of different lengths joining and leaving a running batch of 3, the padded KV
    cache trimmed as rows leave) gives each prompt the greedy tokens plain HF `generate` gives it alone; through
    the engine at 1/4 capacity too."""
    import json

    from expertcache.runtime.serve.generate import generate_many

    model, tok = plain
    prompts = ["thou", "thou art the king of night and day", "my lord", "come hither sweet love", "what say you now"]
    lens = [5, 9, 3, 12, 7]
    for m in (model, load_model(ckpt, EngineConfig(capacity=0.25, tier="disk", kernel="native"))[0]):
        gens, _ = generate_many(m, tok, prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                max_batch=3)
        for p, g in zip(prompts, gens):
            assert g.completion_ids == _hf_greedy(model, encode(tok, p), 12), p
        assert any(g.shared for g in gens)
    # different max_tokens per prompt: the batch shrinks and grows while it decodes
    from expertcache.runtime.serve.decode import Batch

    b = Batch(model, 3)
    gs = [Generation(model, tok, encode(tok, p), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
          for p, n in zip(prompts, lens)]
    pending = list(gs)
    while pending or len(b):
        while pending and b.can_join():
            b.admit(pending.pop(0))
        assert len(b) <= 3 and b.columns() <= max(len(g.prompt_ids) + n for g, n in zip(gs, lens))
        b.step()
    for g, p, n in zip(gs, prompts, lens):
        assert g.completion_ids == _hf_greedy(model, encode(tok, p), n)
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    assert main(["generate", "--model", str(ckpt), "--prompts", str(f), "--max_tokens", "4", "--temperature", "0",
                 "--raw", "true", "--max_batch", "2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert sorted(x["index"] for x in lines) == list(range(5)) and all(x["completion_tokens"] <= 4 for x in lines)
