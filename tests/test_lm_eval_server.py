"""lm-eval as users run it against a server: its `local-completions` model (token-id prompts, echo + logprobs for
log-likelihoods, stop strings for generate_until) scores `expertcache serve` with the same per-document results
as `expertcache eval` gives on the same checkpoint and documents; and `import expertcache` makes the lm-eval model
name `expertcache` known to lm-eval's Python API."""

import subprocess
import sys

import pytest
from helpers import LiveServer
from tiny_lm import make_tiny_checkpoint, one_torch_thread  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.slow  # runs lm-eval twice over two tasks (`make test-fast` skips)

TASKS = ["ec_cloze_prose", "ec_ppl_prose", "ec_math_em"]  # loglikelihood (multiple choice), rolling, generate_until
NAME = "tiny-moe"


def test_import_expertcache_registers_the_lm_eval_model(tmp_path):
    code = ("import expertcache\nfrom lm_eval.api.registry import get_model\n"
            "print(get_model('expertcache').__module__, get_model('hf').__name__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["expertcache.evals.lm", "HFLM"]


@pytest.fixture(scope="module")
def served(tiny_data, tmp_path_factory):
    from expertcache.runtime.engine.config import EngineConfig
    from expertcache.runtime.storage.loader import load_model
    from expertcache.runtime.serve.serve import create_app

    root = tmp_path_factory.mktemp("lm_eval_server")
    ckpt = make_tiny_checkpoint(root / "ckpt", max_positions=1024)
    model, tok = load_model(ckpt, EngineConfig(capacity=0.25, tier="disk", kernel="native"))  # the engine, lossless
    with LiveServer(create_app(model, tok, NAME, torch_threads=1)) as url:
        yield {"url": url, "ckpt": ckpt, "root": root, "data": tiny_data}
    model.expertcache.close()


def test_local_completions_against_the_server_scores_as_expertcache_eval(served):
    import lm_eval

    from expertcache.evals.run import evaluate, per_document
    from expertcache.evals.taskdata import build_task_data, lm_eval_tasks

    root, data = served["root"], served["data"]
    task_dir = root / "tasks"
    build_task_data(data["corpus"], task_dir, "validation")
    ours = evaluate(served["ckpt"], corpus=data["corpus"], tasks=TASKS, task_dir=task_dir, limit=4, ppl_blocks=1,
                    seq_len=16, split="validation", batch_size=4, out=root / "eval.json")
    task_list, manager = lm_eval_tasks(TASKS, task_dir, None)
    theirs = lm_eval.simple_evaluate(
        model="local-completions", tasks=task_list, task_manager=manager, limit=4, log_samples=True,
        model_args={"base_url": served["url"] + "/v1/completions", "model": NAME, "tokenizer_backend": "huggingface",
                    "tokenizer": str(served["ckpt"]), "max_length": 512, "batch_size": 4, "num_concurrent": 2,
                    "max_retries": 1, "tokenized_requests": True},
        bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    server = per_document(theirs["samples"])  # each document's score, as the gate reads them
    assert {t: len(v["doc_id"]) for t, v in server.items()} == {t: 4 for t in TASKS}
    mine = ours["lm_eval_docs"]
    for task in TASKS:  # the same documents; accuracy equal, rolling log-likelihoods equal to float precision
        assert server[task]["docs_sha256"] == mine[task]["docs_sha256"]
        for metric in ("acc", "exact_match", "bpb_bytes"):
            assert server[task].get(metric) == mine[task].get(metric), (task, metric)
    # lm-eval sums a long document's log-likelihood in float32 itself, the server's per-token values in doubles
    assert server["ec_ppl_prose"]["bpb_ll"] == pytest.approx(mine["ec_ppl_prose"]["bpb_ll"], rel=5e-5)
    # the generations themselves: what plain transformers decodes greedily from the same context, cut at `until`
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(served["ckpt"]).eval()
    tok = AutoTokenizer.from_pretrained(served["ckpt"])
    for smp in theirs["samples"]["ec_math_em"]:
        ctx, kw = smp["arguments"][0]
        ids = tok(ctx, return_tensors="pt").input_ids
        with torch.no_grad():
            out = ref.generate(ids, max_new_tokens=kw["max_gen_toks"], do_sample=False, pad_token_id=tok.pad_token_id)
        want = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        for stop in kw["until"]:
            want = want.split(stop)[0]
        assert smp["resps"][0][0] == want, smp["doc_id"]
    assert theirs["results"]["ec_cloze_prose"]["acc,none"] == ours["lm_eval"]["ec_cloze_prose"]["acc,none"]
    assert theirs["results"]["ec_ppl_prose"]["bits_per_byte,none"] == pytest.approx(
        ours["lm_eval"]["ec_ppl_prose"]["bits_per_byte,none"], rel=5e-5)
