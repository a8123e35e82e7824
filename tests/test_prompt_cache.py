"""Prompt reuse and chunked prefill in `serve` (issue 47, items 3 and 4): a prompt that starts from its longest
cached prefix decodes the same greedy tokens as one prefilled whole (fp32, tiny model, exact); the prompt cache
stays within its bound and evicts least recently used; over real HTTP a chat's next turn reuses the earlier turn's
KV (counted in /metrics) and gives the tokens a server without the cache gives; a running stream keeps receiving
tokens while a long prompt is prefilled; bad flags are one line, exit 2."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from helpers import LiveServer
from tiny_lm import make_tiny_checkpoint, one_torch_thread  # noqa: F401 - autouse fixture
from tiny_models import build_model, tiny_config

from expertcache.runtime.serve.decode import Batch
from expertcache.runtime.serve.generate import Generation
from expertcache.runtime.serve.prefix_cache import BLOCK, PrefixCache
from expertcache.runtime.serve.request import SamplingParams

NAME = "tiny-moe"


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config("qwen3_moe", max_position_embeddings=512))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode(model, ids, cache=None, chunk=None, n=12):
    """Greedy `n` tokens of `ids` through the decode loop (a batch of one); returns (generation, prefill job)."""
    b = Batch(model, 4)
    b.prefix_cache, b.prefill_chunk = cache, chunk
    g = Generation(model, None, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    job = b.start(g)
    while not job.advance():
        pass
    b.finish(job)
    while g.finish_reason is None:
        b.step()
    return g, job


def test_reuse_and_chunks_give_the_greedy_tokens_of_a_whole_prefill(model):
    cache = PrefixCache(2**30)
    history = _ids(70, 0)
    first, job = _decode(model, history, cache)
    assert job.reused == 0 and cache.misses == 1 and len(cache) == 1  # the finished sequence's KV is kept
    follow = history + first.completion_ids + _ids(9, 1)  # a chat's next turn: history, answer, new words
    reused, rjob = _decode(model, follow, cache)
    whole, _ = _decode(model, follow)
    chunked, cjob = _decode(model, follow, chunk=7)
    # the earlier sequence as fed (its last token was chosen, never fed) is reused; only the rest is prefilled
    assert rjob.reused == len(history) + len(first.completion_ids) - 1 and cache.hits == 1
    assert rjob.prefilled == len(follow) - rjob.reused and cjob.prefilled == len(follow)
    assert reused.completion_ids == whole.completion_ids == chunked.completion_ids
    # a prompt that shares less than one block with every entry starts from nothing
    other, ojob = _decode(model, history[:BLOCK - 1] + _ids(30, 2), cache)
    assert ojob.reused == 0 and cache.misses == 2


def test_a_cached_prefix_is_its_own_kv_whatever_follows(model):
    """The longest prefix is taken token by token inside an entry (not only whole blocks), and a prompt that
    diverges from an entry midway reuses exactly the shared part."""
    cache = PrefixCache(2**30)
    base = _ids(50, 3)
    _decode(model, base, cache, n=1)
    fork = base[:37] + _ids(20, 4)
    got, job = _decode(model, fork, cache)
    assert job.reused == 37
    assert got.completion_ids == _decode(model, fork)[0].completion_ids


def test_the_cache_stays_within_its_bound_and_evicts_least_recently_used(model):
    seqs = [_ids(40, 10 + i) for i in range(4)]
    per_entry = None
    probe = PrefixCache(2**30)
    _decode(model, seqs[0], probe, n=1)
    per_entry = probe.nbytes  # 40 positions of every layer's keys and values
    assert per_entry == 40 * 2 * 2 * 2 * 8 * 4  # positions x layers x (k, v) x heads x head_dim x fp32 bytes
    cache = PrefixCache(int(2.5 * per_entry))
    for s in seqs[:2]:
        _decode(model, s, cache, n=1)
    assert cache.lookup(seqs[0] + [5])[0] == 40  # seqs[0] used again: seqs[1] is now the least recent
    for s in seqs[2:]:
        _decode(model, s, cache, n=1)
        assert cache.nbytes <= cache.max_bytes
    assert cache.evicted == 2 and len(cache) == 2
    assert cache.lookup(seqs[1] + [5])[0] == 0 and cache.lookup(seqs[0] + [5])[0] == 0  # evicted
    assert cache.lookup(seqs[3] + [5])[0] == 40
    cache.trim(per_entry)  # a smaller bound (the batch needs the room): the least recent goes
    assert len(cache) == 1 and cache.lookup(seqs[3] + [5])[0] == 40
    assert not PrefixCache(per_entry - 1).insert(seqs[0], [(torch.zeros(1, 2, 40, 8),) * 2] * 2)  # over the bound


# --- over HTTP ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The same tiny model behind three servers: with the prompt cache (prompts in chunks of 8 tokens), without it,
    and with a small KV bound (~0.5 MiB)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.runtime.serve.serve import create_app

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("pc") / "ckpt", max_positions=2048)
    m = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    on = create_app(m, tok, NAME, torch_threads=1, prefill_chunk=8)
    off = create_app(m, tok, NAME, torch_threads=1, prompt_cache=False)
    small = create_app(m, tok, NAME, torch_threads=1, kv_cache_gb=0.0005)
    with LiveServer(on) as url_on, LiveServer(off) as url_off, LiveServer(small) as url_small:
        yield {"on": url_on, "off": url_off, "small": url_small, "tok": tok}


def _metrics(url) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
            for s in fam.samples}


def _complete(url, prompt, n=8) -> list[str]:
    """The greedy tokens (as their pieces) of `prompt` (token ids)."""
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                                  "ignore_eos": True, "logprobs": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_a_follow_up_turn_reuses_the_last_turns_kv_and_decodes_the_same(servers):
    on, off, tok = servers["on"], servers["off"], servers["tok"]
    history = _ids(120, 20)
    first = _complete(on, history)
    assert first == _complete(off, history)
    before = _metrics(on)
    follow = history + tok("".join(first), add_special_tokens=False)["input_ids"] + _ids(10, 21)
    assert _complete(on, follow, 12) == _complete(off, follow, 12)
    after = _metrics(on)
    reused = after["expertcache_prompt_tokens_reused_total"] - before["expertcache_prompt_tokens_reused_total"]
    prefilled = after["expertcache_prompt_tokens_prefilled_total"] - before["expertcache_prompt_tokens_prefilled_total"]
    assert reused >= len(history) and reused + prefilled == len(follow)
    assert after["expertcache_prefix_cache_hits_total"] == before["expertcache_prefix_cache_hits_total"] + 1
    off_m = _metrics(off)
    assert off_m["expertcache_prompt_tokens_reused_total"] == 0 and "expertcache_prefix_cache_bytes" not in off_m
    # a prompt scored whole (echo with logprobs: lm-eval's log-likelihoods) in chunks of 8 scores as in one forward
    body = {"model": NAME, "prompt": history[:45], "max_tokens": 0, "echo": True, "logprobs": 1}
    a, b = (httpx.post(u + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"] for u in (on, off))
    assert a["tokens"] == b["tokens"] and len(a["token_logprobs"]) == 45
    assert a["token_logprobs"][0] is None and a["token_logprobs"][1:] == pytest.approx(b["token_logprobs"][1:], abs=1e-4)
    assert off_m["expertcache_prompt_tokens_prefilled_total"] >= len(history) + len(follow)


def test_the_prompt_cache_holds_to_kv_cache_gb_while_prompts_keep_coming(servers):
    url = servers["small"]
    bound = 0.0005 * 2**30
    for i in range(6):  # 401 positions x 256 B each (~100 KB): the 5th no longer fits beside the batch's need
        _complete(url, _ids(400, 30 + i), 2)
        m = _metrics(url)
        assert 0 < m["expertcache_prefix_cache_bytes"] <= m["expertcache_prefix_cache_bound_bytes"] <= bound
    pc = httpx.get(url + "/health").json()["prompt_cache"]
    assert pc["entries"] == 4 and pc["bytes"] == 4 * 401 * 256  # the most recent four sequences
    assert _metrics(url)["expertcache_prefix_cache_evictions_total"] == 2


def test_a_running_stream_keeps_receiving_tokens_while_a_long_prompt_is_prefilled(servers):
    """The long prompt (1,600 tokens: 200 chunks of 8) arrives while a stream decodes; the stream gets tokens
    between the long request's arrival and its first token (one decode step between two chunks). Counted by the
    order of events, not by a clock: a token counts as during the prefill when it arrives after the long request was
    sent and before its first token came back."""
    import json

    url = servers["on"]
    seen = {"before": 0, "during": 0, "after": 0}
    started, sent, first, long_done = (threading.Event() for _ in range(4))

    def stream():
        body = {"model": NAME, "prompt": _ids(20, 40), "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    seen["after" if first.is_set() else "during" if sent.is_set() else "before"] += 1
                    if seen["before"] >= 3:
                        started.set()
                    if long_done.is_set():
                        return

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert started.wait(60)
    body = {"model": NAME, "prompt": _ids(1600, 41), "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent.set()  # before the request goes: a token counted "during" cannot predate it
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                first.set()
                break
    long_done.set()
    t.join(timeout=120)
    assert first.is_set() and not t.is_alive()
    assert sum(seen.values()) < 400, seen  # the stream was still running when the long prompt's token came
    # about a token per chunk; prefilled whole, the stream got 7 in that window (tokens already under way)
    assert seen["during"] >= 50, seen


# --- bad flags -----------------------------------------------------------------------------------------------------

def test_bad_prefill_chunk_and_kv_cache_gb_are_one_line_exit_2_before_the_model_loads(tmp_path, capsys):
    from expertcache.recipes.cli import main
    from expertcache.runtime.serve.serve import create_app
    from expertcache.telemetry.errors import InputError

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", max_positions=512)
    (ckpt / "model.safetensors").write_bytes(b"not weights")  # refused before the weights are read
    capsys.readouterr()
    for args, needles in ((["--prefill_chunk", "0"], ("--prefill_chunk 0", ">= 1")),
                          (["--prefill_chunk", "513"], ("--prefill_chunk 513", "1..512")),
                          (["--kv_cache_gb", "-1"], ("--kv_cache_gb -1", "> 0"))):
        assert main(["serve", "--model", str(ckpt), "--port", "18765", *args]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and ": error: " in err[0] and all(n in err[0] for n in needles), err
    m = build_model(tiny_config("qwen3_moe", max_position_embeddings=64))
    with pytest.raises(InputError, match="--prefill_chunk 65"):  # the Python API refuses it too
        create_app(m, None, NAME, prefill_chunk=65)
    with pytest.raises(InputError, match="--kv_cache_gb -0.5"):
        create_app(m, None, NAME, kv_cache_gb=-0.5)
