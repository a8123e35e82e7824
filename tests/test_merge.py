"""A prompt chunk and the batch's decode step as one pass over the experts (`serve.merge`, issue 47's chat load):
the two forwards meet at every MoE layer and the engine computes the layer once for both. They decode the greedy
tokens of the two forwards run one after the other (fp32, every expert resident), count one layer call where there
were two, never run at once (one core's worth), and neither hangs nor hides a failure of the other. Over HTTP, a
server that merges answers as one that does not."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from helpers import LiveServer
from tiny_lm import make_tiny_checkpoint, one_torch_thread  # noqa: F401 - autouse fixture

from expertcache.runtime import EngineConfig, load
from expertcache.runtime.serve.decode import Batch
from expertcache.runtime.serve.generate import Generation
from expertcache.runtime.serve.request import SamplingParams

NAME = "tiny-moe"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("merge") / "ckpt", max_positions=1024)


@pytest.fixture(scope="module")
def served(ckpt):
    m = load(str(ckpt), engine=EngineConfig(capacity=1.0, tier="host", kernel="native"))
    yield m
    m.expertcache.close()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model, merge: bool, chunk: int = 5):
    """Two sequences decoding while a third's 40-token prompt is prefilled in chunks of `chunk`, each chunk beside
    a decode step (merged or not), then all three to their end. Returns (their tokens, layers merged, layer calls)."""
    gens = [Generation(model, None, _ids(n, s), SamplingParams(max_tokens=t, temperature=0, ignore_eos=True))
            for n, s, t in ((12, 1, 24), (7, 2, 20), (40, 3, 8))]
    b = Batch(model, 4)
    for g in gens[:2]:
        b.admit(g)
    job, merged_layers = b.start(gens[2]), 0
    engine = model.expertcache
    calls = engine.stats.calls
    done = False
    while not done:
        if merge:
            _, done, n = b.step_with(job, chunk)
            merged_layers += n
        else:
            done = job.advance(chunk)
            b.step()
    calls = engine.stats.calls - calls
    b.finish(job)
    while len(b):
        b.step()
    return [g.completion_ids for g in gens], merged_layers, calls


def test_a_merged_chunk_and_step_decode_the_tokens_of_two_forwards_with_one_layer_call_each(served):
    alone, none, calls_alone = _run(served, merge=False)
    together, layers, calls_together = _run(served, merge=True)
    assert together == alone and none == 0
    n_layers = len(served.expertcache.modules)
    chunks = -(-40 // 5)
    assert layers == chunks * n_layers  # every MoE layer of every chunk computed once for both forwards
    assert calls_alone == 2 * chunks * n_layers and calls_together == chunks * n_layers


def test_the_two_forwards_take_turns_and_a_failure_in_either_is_raised_without_a_hang(served, monkeypatch):
    from expertcache.runtime.serve.merge import merged

    engine = served.expertcache
    running, most = [0], [0]
    lock = threading.Lock()
    real = type(engine).run_layer

    def counted(self, *a):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return real(self, *a)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(type(engine), "run_layer", counted)
    ids = torch.tensor([_ids(9, 4)])

    def fwd():
        with torch.no_grad():
            return served(input_ids=ids).logits

    a, b, layers = merged(engine, fwd, fwd)
    assert torch.equal(a, b) and layers == len(engine.modules) and most[0] == 1 and engine.meeting is None

    def bad():  # fails before its first MoE layer: the other computes alone
        with torch.no_grad():
            return served(input_ids=torch.tensor([[10**6]])).logits

    for first, second in ((fwd, bad), (bad, fwd)):
        t = threading.Thread(target=lambda: pytest.raises(IndexError, merged, engine, first, second), daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive()
    calls = [0]

    def fails_on_the_second_layer(self, *a):  # fails inside the shared layer: both forwards raise it
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("disk gone")
        return real(self, *a)

    monkeypatch.setattr(type(engine), "run_layer", fails_on_the_second_layer)
    with pytest.raises(RuntimeError, match="disk gone"):
        merged(engine, fwd, fwd)
    assert engine.meeting is None


def test_a_merging_server_answers_as_one_that_does_not(ckpt, served):
    """Concurrent requests, each arriving while others decode (so their prompts merge with decode steps), give the
    greedy tokens of the same server with `merge_prefill=False`; /health says which."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    from expertcache.runtime.serve.serve import create_app

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    prompts = [_ids(n, 50 + n) for n in (30, 60, 90, 120, 45, 75)]

    def answers(url):
        def one(p):
            r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 16,
                                                          "temperature": 0, "ignore_eos": True}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        with ThreadPoolExecutor(6) as ex:
            return list(ex.map(one, prompts))

    got = {}
    for merge in (True, False):
        app = create_app(served, tok, NAME, torch_threads=1, prefill_chunk=16, merge_prefill=merge)
        with LiveServer(app) as url:
            got[merge] = answers(url)
            assert httpx.get(url + "/health").json()["merge_prefill"] is merge
            merged_tokens = [ln for ln in httpx.get(url + "/metrics").text.splitlines()
                             if ln.startswith("expertcache_prompt_tokens_merged_total")]
            assert (float(merged_tokens[0].split()[-1]) > 0) is merge  # prompts did meet decode steps
    assert got[True] == got[False]
