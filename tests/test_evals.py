"""lm-eval over local tasks with a runtime policy, step-wise perplexity and the gate, on a tiny trained base."""

import json

import pytest
import torch

from expertcache.evals.gate import gate
from expertcache.evals.policy import parse_policy
from expertcache.evals.run import evaluate
from expertcache.telemetry.errors import InputError
from expertcache.trainer.config import load_recipe
from helpers import REPO, smoke_overrides

TASKS = ["ec_ppl_prose", "ec_cloze_prose", "ec_math_em"]


@pytest.fixture(scope="module")
def evals(tiny_data, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from expertcache.trainer.pretrain import PretrainRecipe, run_pretrain

    root = tmp_path_factory.mktemp("evals")
    run_pretrain(load_recipe(PretrainRecipe, REPO / "recipes" / "smoke.yaml",
                             smoke_overrides(tiny_data, root / "base", **{"train.max_steps": 20})))
    base = root / "base" / "model"
    damaged = root / "damaged"
    m = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():  # a really worse model: the token embeddings (tied to the output) shuffled
        g = torch.Generator().manual_seed(0)
        emb = m.get_input_embeddings().weight
        emb.copy_(emb[torch.randperm(emb.shape[0], generator=g)])
    m.save_pretrained(damaged)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(base).save_pretrained(damaged)
    kw = dict(corpus=tiny_data["corpus"], tasks=TASKS, task_dir=root / "tasks", limit=4, ppl_blocks=2, seq_len=32,
              batch_size=4, split="validation")  # the tiny test split is too small
    out = {"base": evaluate(base, out=root / "base.json", **kw),
           "damaged": evaluate(damaged, **kw),
           "served": evaluate(base, policy="capacity=0.25,tier=disk", **kw),
           # a lossy policy: lm-eval forwards go one token at a time through the engine
           "reroute": evaluate(base, policy="capacity=0.25,miss=reroute,tau=1.0",
                               **dict(kw, tasks=["ec_cloze_prose"], limit=2)),
           "root": root}
    return out


def test_eval_writes_lm_eval_results_and_stepwise_ppl(evals):
    r = evals["base"]
    assert set(r["lm_eval"]) == set(TASKS)
    assert 0 <= r["lm_eval"]["ec_cloze_prose"]["acc,none"] <= 1
    assert r["lm_eval"]["ec_ppl_prose"]["bits_per_byte,none"] > 0
    assert set(r["stepwise"]["ppl"]) == {"code", "prose", "math", "overall"}
    assert (evals["root"] / "base.lm_eval.json").is_file()
    assert json.loads((evals["root"] / "base.json").read_text())["policy"] == "plain"


def test_gate_passes_the_baseline_against_itself_and_fails_a_damaged_checkpoint(evals):
    same = gate(evals["base"], evals["base"])
    assert same["pass"] and same["dppl_percent"]["overall"] == 0.0
    bad = gate(evals["base"], evals["damaged"])
    assert not bad["pass"], bad
    assert bad["dppl_percent"]["overall"] > 1.0
    assert any("Δppl overall" in f for f in bad["failures"])
    assert bad["bpb_crosscheck"]["delta"] > 0 and bad["bpb_crosscheck"]["agrees_in_sign"]


def test_lossless_serving_has_exactly_the_plain_perplexity(evals):
    served = evals["served"]
    assert served["stepwise"]["engine"]["demand_loads"] > 0  # it really served from a 1/4 cache on disk
    assert served["stepwise"]["ppl"] == evals["base"]["stepwise"]["ppl"]
    assert gate(evals["base"], served)["pass"]


def test_reroute_reports_its_accuracy_cost(evals):
    r = evals["reroute"]
    assert r["stepwise"]["engine"]["rerouted"] > 0
    assert r["stepwise"]["ppl"]["overall"] != evals["base"]["stepwise"]["ppl"]["overall"]
    assert r["policy"] == "C=0.25,reroute,tau=1"
    assert 0 <= r["lm_eval"]["ec_cloze_prose"]["acc,none"] <= 1


def test_gate_cli_exit_status(evals, capsys):
    from expertcache.recipes.cli import main

    root = evals["root"]
    (root / "damaged.json").write_text(json.dumps(evals["damaged"]))
    assert main(["gate", "--baseline", str(root / "base.json"), "--candidate", str(root / "base.json")]) == 0
    assert main(["gate", "--baseline", str(root / "base.json"), "--candidate", str(root / "damaged.json")]) == 1
    assert "gate: FAIL" in capsys.readouterr().out


def test_bad_policy_is_refused():
    with pytest.raises(InputError, match="unknown policy key"):
        parse_policy("capacty=0.25")
    with pytest.raises(InputError, match="expected a number"):
        parse_policy("capacity=quarter")


def test_a_users_own_task_yaml_is_evaluated_and_gated(evals, tiny_data, tmp_path):
    """lm-eval's convention: a folder of task YAMLs over local files, named in --tasks beside the local ones."""
    rows = [{"question": f"Is {a} plus {b} equal to {a + b + (i % 2)}?", "label": 1 - i % 2}
            for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6), (7, 1), (2, 2), (9, 9)])]
    data = tmp_path / "yesno.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "my_yesno.yaml").write_text(
        "task: my_yesno\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}} Answer:'\ndoc_to_choice: [' no', ' yes']\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n")
    base = evals["root"] / "base" / "model"
    kw = dict(corpus=tiny_data["corpus"], tasks=["ec_cloze_prose", "my_yesno"], task_dir=evals["root"] / "tasks",
              limit=6, ppl_blocks=1, seq_len=32, batch_size=4, split="validation", include_path=tasks)
    res = evaluate(base, **kw)
    assert set(res["lm_eval"]) == {"ec_cloze_prose", "my_yesno"}
    assert 0 <= res["lm_eval"]["my_yesno"]["acc,none"] <= 1
    assert gate(res, res)["pass"]
    with pytest.raises(InputError, match="not a directory"):  # refused before any work
        evaluate(base, **dict(kw, include_path=tmp_path / "nope"))
