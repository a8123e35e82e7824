"""lm-eval over local tasks with a runtime policy, step-wise perplexity and the gate, on a tiny trained base."""

import json
import os
import subprocess
import sys

import pytest
import torch

from expertcache.evals.gate import gate
from expertcache.evals.run import evaluate
from expertcache.runtime.engine.config import EngineConfig
from expertcache.telemetry.errors import InputError

pytestmark = pytest.mark.slow  # end-to-end: trains, evaluates or runs the CLI in subprocesses (`make test-fast` skips)

TASKS = ["ec_ppl_prose", "ec_cloze_prose", "ec_math_em"]


@pytest.fixture(scope="module")
def evals(tiny_data, tiny_base, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("evals")
    base = tiny_base
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
           "served": evaluate(base, engine=EngineConfig(capacity=0.25, tier="disk"), **kw),
           # a lossy policy: lm-eval forwards go one token at a time through the engine
           "reroute": evaluate(base, engine=EngineConfig(capacity=0.25, miss="reroute", tau=1.0),
                               **dict(kw, tasks=["ec_cloze_prose"], limit=2)),
           "root": root, "base_model": base, "corpus": tiny_data["corpus"]}
    return out


def test_eval_writes_lm_eval_results_and_stepwise_ppl(evals):
    r = evals["base"]
    assert set(r["lm_eval"]) == set(TASKS)
    assert 0 <= r["lm_eval"]["ec_cloze_prose"]["acc,none"] <= 1
    assert r["lm_eval"]["ec_ppl_prose"]["bits_per_byte,none"] > 0
    assert set(r["stepwise"]["ppl"]) == {"code", "prose", "math", "overall"}
    assert (evals["root"] / "base.lm_eval.json").is_file()
    assert json.loads((evals["root"] / "base.json").read_text())["policy"] == "plain"


def _ppl_only(res):
    """`res` without its accuracy tasks (perplexity and bits per byte kept): a gate of it decides on Δppl, which 2
    blocks per domain can resolve, where 4 documents cannot resolve a -1 point accuracy limit."""
    import copy

    r = copy.deepcopy(res)
    acc = [t for t, m in r["lm_eval"].items() if "bits_per_byte,none" not in m]
    for key in ("lm_eval", "lm_eval_docs", "lm_eval_samples", "n_documents"):
        for t in acc:
            r.get(key, {}).pop(t, None)
    return r


def test_gate_passes_the_baseline_against_itself_and_fails_a_damaged_checkpoint(evals):
    """On 4 documents per task the baseline against itself cannot PASS its accuracy (±49 points at 95%): never
    FAIL, INCONCLUSIVE on accuracy alone, asking for the 381 documents the same agreement would need; its Δppl
    alone PASSes."""
    same = gate(evals["base"], evals["base"])
    assert same["gate"] == "INCONCLUSIVE" and not same["failures"] and same["dppl_percent"]["overall"] == 0.0
    assert same["unresolved"] and all(u.startswith("Δacc") for u in same["unresolved"])
    assert same["resolve"]["documents"] == {"ec_cloze_prose": 381, "ec_math_em": 381}
    assert gate(_ppl_only(evals["base"]), _ppl_only(evals["base"]))["pass"]
    bad = gate(evals["base"], evals["damaged"])
    assert not bad["pass"], bad
    assert bad["dppl_percent"]["overall"] > 1.0
    assert any("Δppl overall" in f for f in bad["failures"])
    assert bad["bpb_crosscheck"]["delta"] > 0 and bad["bpb_crosscheck"]["agrees_in_sign"]


def test_lossless_serving_has_the_plain_perplexity(evals, tiny_data):
    """Batched (the default for a lossless policy): the plain figures within float rounding (the engine sums its
    experts in another order); token by token: exactly the plain figures."""
    served, base = evals["served"], evals["base"]
    assert served["stepwise"]["engine"]["demand_loads"] > 0  # it really served from a 1/4 cache on disk
    assert served["stepwise"]["method"] == base["stepwise"]["method"] == "batched"
    for d, p in base["stepwise"]["ppl"].items():
        assert served["stepwise"]["ppl"][d] == pytest.approx(p, rel=1e-6)
    g = gate(base, served)
    assert not g["failures"] and not any(u.startswith("Δppl") for u in g["unresolved"])
    kw = dict(corpus=tiny_data["corpus"], tasks=[], ppl_blocks=2, seq_len=32, split="validation", stepwise="token")
    plain = evaluate(evals["base_model"], **kw)
    disk = evaluate(evals["base_model"], engine=EngineConfig(capacity=0.25, tier="disk"), **kw)
    assert plain["stepwise"]["method"] == disk["stepwise"]["method"] == "token"
    assert disk["stepwise"]["engine"]["demand_loads"] > 0
    assert disk["stepwise"]["ppl"] == plain["stepwise"]["ppl"]
    for d, p in base["stepwise"]["ppl"].items():  # the two paths agree
        assert plain["stepwise"]["ppl"][d] == pytest.approx(p, rel=1e-5)


def test_reroute_reports_its_accuracy_cost(evals):
    r = evals["reroute"]
    assert r["stepwise"]["method"] == "token"  # a lossy policy: one token at a time, the cache in order
    assert r["stepwise"]["engine"]["rerouted"] > 0
    assert r["stepwise"]["ppl"]["overall"] != evals["base"]["stepwise"]["ppl"]["overall"]
    assert r["policy"] == "C=0.25,reroute,tau=1"
    assert 0 <= r["lm_eval"]["ec_cloze_prose"]["acc,none"] <= 1


def test_gate_cli_exit_status(evals, capsys):
    from expertcache.recipes.cli import main

    root = evals["root"]
    (root / "damaged.json").write_text(json.dumps(evals["damaged"]))
    (root / "base-ppl.json").write_text(json.dumps(_ppl_only(evals["base"])))
    assert main(["gate", "--baseline", str(root / "base-ppl.json"), "--candidate", str(root / "base-ppl.json")]) == 0
    assert main(["gate", "--baseline", str(root / "base.json"), "--candidate", str(root / "base.json")]) == 3
    assert main(["gate", "--baseline", str(root / "base.json"), "--candidate", str(root / "damaged.json")]) == 1
    assert "gate: FAIL" in capsys.readouterr().err


def test_bad_engine_options_are_refused(capsys):
    from expertcache.evals.lm import engine_from_args
    from expertcache.recipes.cli import main

    assert main(["eval", "--model", "x", "--engine.capacty", "0.25"]) == 2
    assert main(["eval", "--model", "x", "--engine.capacity", "quarter"]) == 2
    assert main(["eval", "--model", "x", "--engine.miss", "bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("expertcache eval: error:") for line in err), err
    with pytest.raises(InputError, match="expected a float"):
        engine_from_args({"capacity": "quarter"})
    assert engine_from_args({"batch_size": 4}) is None  # no engine option: the plain model
    assert engine_from_args({"capacity": "0.25", "miss": "reroute"}).lossy


def test_eval_hands_its_engine_configuration_to_lm_eval_as_it_is():
    """`expertcache eval` gives lm-eval's model the resolved `EngineConfig` itself (no text round trip); lm-eval's
    own command line gives its fields as text; both at once, or something else as `engine`, is one line."""
    from expertcache.evals.lm import engine_from_args
    from expertcache.runtime import EngineConfig

    cfg = EngineConfig(capacity=16, tier="host", miss="reroute", tau=0.05)
    assert engine_from_args({"engine": cfg, "batch_size": 4}) is cfg
    assert engine_from_args({"capacity": "16", "tier": "host", "miss": "reroute", "tau": "0.05"}) == cfg
    with pytest.raises(InputError, match="both given"):
        engine_from_args({"engine": cfg, "capacity": "0.5"})
    with pytest.raises(InputError, match="expected an EngineConfig"):
        engine_from_args({"engine": "capacity=0.5"})


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
    base = evals["base_model"]
    kw = dict(corpus=tiny_data["corpus"], tasks=["ec_cloze_prose", "my_yesno"], task_dir=evals["root"] / "tasks",
              limit=6, ppl_blocks=1, seq_len=32, batch_size=4, split="validation", include_path=tasks)
    res = evaluate(base, **kw)
    assert set(res["lm_eval"]) == {"ec_cloze_prose", "my_yesno"}
    assert 0 <= res["lm_eval"]["my_yesno"]["acc,none"] <= 1
    same = gate(res, res)  # 6 documents alike: not enough to PASS -1 point, never a FAIL
    assert same["gate"] == "INCONCLUSIVE" and not same["failures"] and set(same["resolve"]["documents"]) == {
        "ec_cloze_prose", "my_yesno"}
    with pytest.raises(InputError, match="not a directory"):  # refused before any work
        evaluate(base, **dict(kw, include_path=tmp_path / "nope"))


def test_eval_records_what_makes_two_evals_comparable(evals):
    r = evals["base"]
    assert r["format_version"] == 3
    assert len(r["tokenizer"]["vocab_sha256"]) == 64 and r["tokenizer"]["vocab_size"] == 512
    assert len(r["stepwise"]["blocks_sha256"]) == 64
    assert r["stepwise"]["tokens"]["overall"] > 0
    assert r["limit"] == 4 and r["tasks"] == TASKS
    assert set(r["lm_eval_samples"]) == set(TASKS)
    # the damaged checkpoint re-saved its tokenizer: same vocabulary, same fingerprint; the same tokens
    assert evals["damaged"]["tokenizer"] == r["tokenizer"]
    assert evals["damaged"]["stepwise"]["blocks_sha256"] == r["stepwise"]["blocks_sha256"]


def _broken(res, path, value):
    import copy

    r = copy.deepcopy(res)
    *keys, last = path
    d = r
    for k in keys:
        d = d[k]
    if value is _DEL:
        del d[last]
    else:
        d[last] = value
    return r


_DEL = object()


@pytest.mark.parametrize("path,value,match", [
    (("stepwise",), _DEL, "no step-wise perplexity"),
    (("stepwise", "ppl"), {}, "no step-wise perplexity"),
    (("stepwise", "ppl", "overall"), float("nan"), "not a finite positive"),
    (("stepwise", "ppl", "prose"), float("inf"), "not a finite positive"),
    (("stepwise", "ppl", "code"), 0.0, "not a finite positive"),
    (("stepwise", "ppl", "math"), -3.0, "not a finite positive"),
    (("stepwise", "ppl", "overall"), "12.5", "not a finite positive"),
    (("lm_eval", "ec_cloze_prose", "acc,none"), float("nan"), "not a finite accuracy"),
    (("lm_eval", "ec_cloze_prose", "acc,none"), 1.5, "not a finite accuracy"),
    (("lm_eval", "ec_math_em", "exact_match,answer"), float("-inf"), "not a finite accuracy"),
    (("format_version",), _DEL, "older `expertcache eval`.*re-run"),
    (("format_version",), 99, "format_version 99"),
    (("format_version",), 2, "format 2, which keeps no per-block NLLs.*re-run"),
    (("stepwise", "block_nll"), _DEL, "no per-block step-wise NLLs"),
    (("stepwise", "block_nll", "prose"), [1.0], "one finite NLL and one token count"),
    (("stepwise", "block_nll", "code", 0), float("nan"), "one finite NLL"),
    (("stepwise", "block_nll", "code", 0), 0.0, "an edited or corrupted eval"),
    (("lm_eval_docs",), _DEL, "no per-document lm-eval scores"),
    (("lm_eval_docs", "ec_cloze_prose"), _DEL, "no per-document scores for ec_cloze_prose"),
    (("lm_eval_docs", "ec_cloze_prose", "acc", 0), 2.0, "not one score in \\[0, 1\\] per document"),
    (("lm_eval_docs", "ec_ppl_prose", "bpb_bytes", 0), 0, "positive byte count"),
    (("tokenizer",), _DEL, "no tokenizer fingerprint"),
    (("stepwise", "blocks_sha256"), _DEL, "no hash of the step-wise blocks"),
])
def test_gate_refuses_a_broken_or_old_input_on_either_side(evals, path, value, match):
    bad = _broken(evals["base"], path, value)
    with pytest.raises(InputError, match=match):
        gate(evals["base"], bad)
    with pytest.raises(InputError, match=match):
        gate(bad, evals["base"])


@pytest.mark.parametrize("path,value,match", [
    (("tokenizer", "vocab_sha256"), "0" * 64, "different tokenizers"),
    (("stepwise", "tokens", "prose"), 1, "different step-wise tokens"),
    (("stepwise", "blocks_sha256"), "f" * 64, "different step-wise token ids"),
    (("limit",), 8, "different limits"),
    (("lm_eval_samples", "ec_cloze_prose"), {"original": 9, "effective": 3}, "different documents"),
    (("lm_eval", "ec_math_em"), _DEL, "different lm-eval tasks"),
    (("lm_eval",), _DEL, "different lm-eval tasks"),
    (("lm_eval_docs", "ec_math_em", "docs_sha256"), "0" * 64, "ec_math_em on different documents"),
])
def test_gate_refuses_incomparable_inputs(evals, path, value, match):
    other = _broken(evals["base"], path, value)
    with pytest.raises(InputError, match=match):
        gate(evals["base"], other)


def test_gate_cli_refuses_broken_candidate_with_exit_2(evals, capsys):
    from expertcache.recipes.cli import main

    root = evals["root"]
    nan = _broken(evals["base"], ("stepwise", "ppl", "overall"), float("nan"))
    (root / "nan.json").write_text(json.dumps(nan))  # json writes NaN and reads it back
    old = _broken(evals["base"], ("format_version",), _DEL)
    (root / "old.json").write_text(json.dumps(old))
    assert main(["gate", "--baseline", str(root / "base.json"), "--candidate", str(root / "nan.json")]) == 2
    assert main(["gate", "--baseline", str(root / "old.json"), "--candidate", str(root / "base.json")]) == 2
    captured = capsys.readouterr()
    assert "gate: PASS" not in captured.out and "re-run" in captured.err + captured.out


def test_load_eval_refuses_unreadable_files(tmp_path):
    from expertcache.evals.gate import load_eval

    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(InputError, match="not a readable eval JSON"):
        load_eval(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="not an `expertcache eval` result"):
        load_eval(tmp_path / "y.json")
    with pytest.raises(InputError, match="no such file"):
        load_eval(tmp_path / "nope.json")


def test_eval_refuses_a_checkpoint_that_produces_nan(evals, tiny_data):
    """Corrupted weights that make NaN logits never reach a result (and so never a gate, never exit 0): a NaN
    weight is refused as the model is opened (the weight checks), finite weights that overflow the logits when the
    logits come out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = evals["base_model"]
    for fill, msg in ((float("nan"), r"damaged weights: tensor model\.norm\.weight .*holds NaN/inf"),
                      (3.0e38, "non-finite logits: corrupted weights")):  # (the final norm alone: no siblings)
        bad = evals["root"] / f"bad-model-{fill}"
        m = AutoModelForCausalLM.from_pretrained(base)
        with torch.no_grad():
            m.model.norm.weight.fill_(fill)  # the final norm: every logit NaN or inf
        m.save_pretrained(bad)
        AutoTokenizer.from_pretrained(base).save_pretrained(bad)
        with pytest.raises(InputError, match=msg):
            evaluate(bad, corpus=tiny_data["corpus"], tasks=[], task_dir=evals["root"] / "tasks", ppl_blocks=1,
                     seq_len=16, split="validation")


def _scaled(res, factors):
    """`res` with each domain's block NLLs multiplied by `factors[domain]` (one per block), perplexities recomputed:
    a candidate whose degradation varies from block to block."""
    import copy
    import math

    r = copy.deepcopy(res)
    s = r["stepwise"]
    tot = 0.0
    for d, f in factors.items():
        s["block_nll"][d] = [x * k for x, k in zip(s["block_nll"][d], f)]
        s["ppl"][d] = math.exp(sum(s["block_nll"][d]) / sum(s["block_tokens"][d]))
        tot += sum(s["block_nll"][d])
    s["ppl"]["overall"] = math.exp(tot / s["tokens"]["overall"])
    return r


def test_eval_keeps_the_per_item_scores_the_intervals_need(evals):
    import math

    r = evals["base"]
    s = r["stepwise"]
    for d in ("code", "prose", "math"):
        assert len(s["block_nll"][d]) == len(s["block_tokens"][d]) == 2
        assert math.isclose(math.exp(sum(s["block_nll"][d]) / sum(s["block_tokens"][d])), s["ppl"][d], rel_tol=1e-9)
    docs = r["lm_eval_docs"]
    for task, key, metric in (("ec_cloze_prose", "acc,none", "acc"), ("ec_math_em", "exact_match,answer",
                                                                        "exact_match")):
        assert docs[task]["doc_id"] == [0, 1, 2, 3]  # --limit 4
        assert math.isclose(sum(docs[task][metric]) / 4, r["lm_eval"][task][key])
    d = docs["ec_ppl_prose"]
    bpb = -sum(d["bpb_ll"]) / sum(d["bpb_bytes"]) / math.log(2)
    assert math.isclose(bpb, r["lm_eval"]["ec_ppl_prose"]["bits_per_byte,none"], rel_tol=1e-9)


def test_gate_json_carries_intervals_sample_sizes_and_a_verdict(evals):
    g = gate(evals["base"], evals["damaged"], resamples=500, seed=3)
    assert g["gate"] == "FAIL" and not g["pass"]
    lo, hi = g["dppl_overall_ci95"]
    assert 1.0 < lo <= g["dppl_percent"]["overall"] <= hi
    assert g["dppl_max_domain_ci95"][0] > 2.0
    assert set(g["dacc_ci95"]) == set(g["n_documents"]) == {"ec_cloze_prose", "ec_math_em"}
    assert all(lo <= g["dacc_points"][t] <= hi for t, (lo, hi) in g["dacc_ci95"].items())
    assert g["n_blocks"] == 2 and g["n_documents"] == {"ec_cloze_prose": 4, "ec_math_em": 4}
    assert g == gate(evals["base"], evals["damaged"], resamples=500, seed=3)  # seeded: reproducible
    same = gate(evals["base"], evals["base"])
    assert same["gate"] == "INCONCLUSIVE" and same["dppl_overall_ci95"] == [0.0, 0.0]
    z2 = 1.959964 ** 2  # 4 documents answered alike: Tango's interval ±z²/(4+z²), not [0, 0]
    assert all(v == pytest.approx([-100 * z2 / (4 + z2), 100 * z2 / (4 + z2)], rel=1e-6)
               for v in same["dacc_ci95"].values())
    assert same["dacc_method"] == "Tango's paired score interval"


def test_gate_inconclusive_exits_3_and_says_what_would_resolve_it(evals, capsys):
    from expertcache.recipes.cli import main

    root = evals["root"]
    # about +0.8% overall, every domain's two blocks far apart: the interval straddles +1%
    worse = _scaled(evals["base"], {d: [1.0, 1.0032] for d in ("code", "prose", "math")})
    g = gate(evals["base"], worse)
    assert g["gate"] == "INCONCLUSIVE", g
    lo, hi = g["dppl_overall_ci95"]
    assert lo < 1.0 < hi
    assert g["resolve"]["blocks_per_domain"] > 2 and any("blocks per domain" in u for u in g["unresolved"])
    (root / "straddle.json").write_text(json.dumps(worse))
    out = root / "gate-straddle.json"
    assert main(["gate", "--baseline", str(root / "base.json"), "--candidate", str(root / "straddle.json"),
                 "--out", str(out)]) == 3
    assert "gate: INCONCLUSIVE" in capsys.readouterr().err
    assert json.loads(out.read_text())["gate"] == "INCONCLUSIVE"
    # far above the threshold on every block: FAIL; far below: PASS
    assert gate(evals["base"], _scaled(evals["base"], {d: [1.05, 1.06] for d in ("code", "prose", "math")}))[
        "gate"] == "FAIL"
    assert gate(_ppl_only(evals["base"]), _scaled(_ppl_only(evals["base"]), {d: [0.99, 0.995] for d in
                                                                             ("code", "prose", "math")}))["gate"] == "PASS"


def test_bits_per_byte_noise_does_not_fail_a_better_model(evals):
    """The quickstart's case: bits per byte up by noise, the token Δppl down; the intervals overlap zero."""
    import copy
    import math

    better = _scaled(_ppl_only(evals["base"]), {d: [0.99, 0.985] for d in ("code", "prose", "math")})
    cand = copy.deepcopy(better)
    d = cand["lm_eval_docs"]["ec_ppl_prose"]
    noise = [(-1) ** i * 0.01 * abs(x) for i, x in enumerate(d["bpb_ll"])]  # ± 1% per document
    noise[0] -= 1e-3 * abs(d["bpb_ll"][0])  # net: slightly worse
    d["bpb_ll"] = [x + e for x, e in zip(d["bpb_ll"], noise)]
    cand["lm_eval"]["ec_ppl_prose"]["bits_per_byte,none"] = -sum(d["bpb_ll"]) / sum(d["bpb_bytes"]) / math.log(2)
    g = gate(_ppl_only(evals["base"]), cand)
    x = g["bpb_crosscheck"]
    assert x["delta"] > 0 and g["dppl_percent"]["overall"] < 0
    assert x["agrees_in_sign"] and x["delta_ci95"][0] < 0 < x["delta_ci95"][1]
    assert g["gate"] == "PASS", g["failures"]


@pytest.mark.parametrize("args,needle", [
    (["--confidence", "1"], "--confidence"), (["--confidence", "0"], "--confidence"),
    (["--confidence", "-0.5"], "--confidence"), (["--confidence", "nan"], "confidence"),
    (["--resamples", "0"], "--resamples"), (["--resamples", "-3"], "--resamples"),
])
def test_gate_cli_refuses_bad_interval_options_with_exit_2(evals, capsys, args, needle):
    from expertcache.recipes.cli import main

    b = str(evals["root"] / "base.json")
    assert main(["gate", "--baseline", b, "--candidate", b, *args]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and needle in err[0] and err[0].startswith("expertcache gate: error:"), err


def test_eval_reports_its_samples_and_sizes_them_from_an_inconclusive_gate(evals, tiny_data, tmp_path, capsys):
    from expertcache.recipes.cli import main

    r = evals["base"]
    assert r["n_blocks"] == {"code": 2, "prose": 2, "math": 2} and r["sample_notes"] == []
    assert r["n_documents"] == {"ec_ppl_prose": 4, "ec_cloze_prose": 4, "ec_math_em": 4}
    g = gate(r, _scaled(r, {d: [1.0, 1.0032] for d in ("code", "prose", "math")}))
    assert g["gate"] == "INCONCLUSIVE"
    want = g["resolve"]["blocks_per_domain"]
    (tmp_path / "g.json").write_text(json.dumps(g))
    out = tmp_path / "sized.json"
    assert main(["eval", "--model", str(evals["base_model"]), "--corpus", tiny_data["corpus"],
                 "--tasks", "[]", "--seq_len", "32", "--ppl_blocks", "2", "--task_dir", str(evals["root"] / "tasks"),
                 "--size_from", str(tmp_path / "g.json"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["sizing"]["ppl_blocks"] == want > 2
    for d, n in res["n_blocks"].items():  # as many as asked, or all the split has (and a note says so)
        assert n == want or (n < want and any(x.startswith(f"{d}: {n} blocks") for x in res["sample_notes"]))
    capsys.readouterr()
    (tmp_path / "not-gate.json").write_text(json.dumps({"gate": "PASS"}))
    assert main(["eval", "--model", "x", "--size_from", str(tmp_path / "not-gate.json")]) == 2
    assert "not an `expertcache gate` JSON" in capsys.readouterr().err


def test_gate_refuses_the_same_tokens_split_into_other_blocks(evals):
    import copy

    other = copy.deepcopy(evals["base"])
    t = other["stepwise"]["block_tokens"]["code"]
    t[0], t[1] = t[0] - 1, t[1] + 1  # same total, same perplexity, other blocks
    with pytest.raises(InputError, match="different step-wise blocks"):
        gate(evals["base"], other)


def test_quickstart_gate_table_shows_intervals_and_the_three_verdicts(evals):
    from expertcache.recipes.quickstart import gate_summary, gate_table

    straddle = _scaled(evals["base"], {d: [1.0, 1.0032] for d in ("code", "prose", "math")})
    same = _ppl_only(evals["base"])  # 4 documents alike cannot PASS -1 point: the same model on Δppl alone
    rows = [gate_summary(n, gate(b, c), c) for n, b, c in
            (("same", same, same), ("damaged", evals["base"], evals["damaged"]),
             ("straddle", evals["base"], straddle))]
    assert [r["gate"] for r in rows] == ["PASS", "FAIL", "INCONCLUSIVE"]
    md = gate_table(rows)
    table = [line for line in md if line.startswith("| ")]
    assert table[-3].startswith("| same | +0.00% [+0.00, +0.00] (2) |") and table[-3].endswith("| PASS |")
    assert "ec_cloze_prose" in table[-2] and "(4)" in table[-2] and table[-1].endswith("| INCONCLUSIVE |")
    # under the table, each FAIL's and INCONCLUSIVE's reasons, one line each, naming the row; none for the PASS
    notes = [line for line in md if line.startswith("- ")]
    assert notes and not any(n.startswith("- same:") for n in notes)
    assert any(n.startswith("- damaged: Δppl") and "> +" in n for n in notes), notes
    assert any(n.startswith("- straddle: ") and "would resolve it" in n for n in notes), notes


def test_eval_on_the_users_own_text_and_on_accuracy_alone(evals, tiny_data, tmp_path):
    """`--ppl_file`: the step-wise perplexity of the user's own text (no corpus read); `--ppl_blocks 0`: no
    perplexity, and a gate of two such evals decides on accuracy alone and says so; mixing the two kinds is
    refused."""
    from expertcache.evals.gate import format_gate

    base, damaged = evals["base_model"], evals["root"] / "damaged"
    words = "thou art the king of night and day my lord what say you now come hither sweet love".split()
    mine = tmp_path / "my notes.txt"
    mine.write_text("\n\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(12)))
    r = evaluate(base, corpus=str(tmp_path / "no-corpus-here"), tasks=[], ppl_file=mine, ppl_blocks=3, seq_len=16)
    assert set(r["stepwise"]["ppl"]) == {"my_notes", "overall"} and r["stepwise"]["tokens"]["overall"] == 3 * 15
    assert r["stepwise"]["source"] == str(mine) and r["stepwise"]["ppl"]["overall"] > 1
    with pytest.raises(InputError, match="not one block"):
        evaluate(base, corpus="nowhere", tasks=[], ppl_file=mine, ppl_blocks=3, seq_len=1000)
    kw = dict(corpus=tiny_data["corpus"], tasks=["ec_cloze_prose"], task_dir=evals["root"] / "tasks", limit=4,
              ppl_blocks=0, split="validation", batch_size=4)
    a, b = evaluate(base, **kw), evaluate(damaged, **kw)
    assert a["stepwise"] is None and any("accuracy alone" in n for n in a["sample_notes"])
    g = gate(a, b)
    assert g["accuracy_only"] and g["dppl_percent"] == {} and set(g["dacc_points"]) == {"ec_cloze_prose"}
    assert "rests on accuracy alone" in format_gate(g)
    assert gate(a, a)["gate"] in ("PASS", "INCONCLUSIVE")
    with pytest.raises(InputError, match="evaluate both the same way"):
        gate(a, evals["base"])


def test_a_quantized_checkpoint_is_evaluated_and_benchmarked(tiny_data, tmp_path, capsys):
    """`eval` of an `expertcache quantize` checkpoint: lm-eval's HF wrapper used to hand our quantization_config
    to transformers, which refused it (ValueError: unknown quantization type); `bench decode` tried to load a
    plain reference of packed experts. Both found by scripts/quantized_table.py."""
    from tiny_lm import make_tiny_checkpoint

    from expertcache.recipes.cli import main

    src = make_tiny_checkpoint(tmp_path / "m", hidden_size=64, moe_intermediate_size=64)
    q = tmp_path / "q8"
    assert main(["quantize", "--model", str(src), "--bits", "8", "--group_size", "32", "--out", str(q)]) == 0
    served = EngineConfig(capacity=1.0, tier="host")
    kw = dict(corpus=tiny_data["corpus"], engine=served, tasks=["ec_cloze_prose"], limit=2, ppl_blocks=1,
              seq_len=32, task_dir=tmp_path / "tasks", split="validation")  # the tiny test split is too small
    a = evaluate(src, out=tmp_path / "a.json", **kw)
    b = evaluate(q, out=tmp_path / "b.json", **kw)
    pa, pb = a["stepwise"]["ppl"]["overall"], b["stepwise"]["ppl"]["overall"]
    assert pa != pb and abs(pb / pa - 1) < 0.05  # int8 moves the perplexity a little, not a lot
    capsys.readouterr()
    assert main(["bench", "decode", "--model", str(q), "--corpus", tiny_data["corpus"], "--plain", "true",
                 "--tokens", "2", "--rounds", "1"]) == 2
    assert "quantized checkpoint" in capsys.readouterr().err


def test_bits_per_byte_is_checked_against_its_own_domains_token_ppl(evals):
    """lm-eval's bits per byte on prose text is a measure of prose: it is checked against the prose Δppl, not the
    overall one (the quickstart's reroute row FAILed on prose bits per byte against an overall Δppl that code and
    math had pulled down). Prose unchanged (its interval spans zero) while code and math improve: no clash. Prose
    clearly better by tokens and clearly worse by bytes: a clash, FAIL."""
    import copy
    import math

    def worse_bytes(res):
        cand = copy.deepcopy(res)
        d = cand["lm_eval_docs"]["ec_ppl_prose"]
        d["bpb_ll"] = [x * 1.05 for x in d["bpb_ll"]]  # every document 5% less likely: clearly worse
        cand["lm_eval"]["ec_ppl_prose"]["bits_per_byte,none"] = -sum(d["bpb_ll"]) / sum(d["bpb_bytes"]) / math.log(2)
        return cand

    mixed = worse_bytes(_scaled(evals["base"], {"code": [0.95, 0.96], "prose": [0.999, 1.001], "math": [0.95, 0.96]}))
    g = gate(evals["base"], mixed)
    x = g["bpb_crosscheck"]
    assert x["against_dppl"] == "prose" and x["delta_ci95"][0] > 0 and g["dppl_overall_ci95"][1] < 0
    assert x["agrees_in_sign"] and not any("bits/byte" in f for f in g["failures"])
    clash = worse_bytes(_scaled(evals["base"], {d: [0.95, 0.96] for d in ("code", "prose", "math")}))
    g = gate(evals["base"], clash)
    assert not g["bpb_crosscheck"]["agrees_in_sign"] and g["gate"] == "FAIL"
    assert any("token Δppl (prose)" in f for f in g["failures"])




def test_a_task_folder_built_for_fewer_documents_is_built_again_for_the_limit(tiny_base, tiny_data, tmp_path):
    """The gate may ask for more documents than a task folder holds (the default being 2,000): `--limit N` then
    gets them where the held-out text has them (the folder is built again for N), and the eval reports the n it
    scored. The tiny corpus's held-out prose has a few dozen cloze windows and no text beyond its splits."""
    from expertcache.evals.taskdata import build_task_data, task_docs_built

    d = tmp_path / "tasks"
    build_task_data(tiny_data["corpus"], d, "validation", per_domain=4)  # a folder built for 4
    kw = dict(corpus=tiny_data["corpus"], tasks=["ec_cloze_prose"], task_dir=d, ppl_blocks=0, split="validation",
              batch_size=4)
    r = evaluate(tiny_base, limit=3, **kw)  # within what the folder holds: kept (its 4, limited to 3)
    assert task_docs_built(d) == 4 and r["n_documents"]["ec_cloze_prose"] == 3
    r = evaluate(tiny_base, limit=3000, **kw)
    assert task_docs_built(d) == 3000  # built again, for the limit asked
    held = len((d / "cloze_prose.jsonl").read_text().splitlines())
    assert 4 < r["n_documents"]["ec_cloze_prose"] == held < 3000  # all the held-out text has, and said
    assert any(n.startswith(f"ec_cloze_prose: {held} documents, 3000 asked") for n in r["sample_notes"])


def test_gate_grows_an_inconclusive_sample_and_says_when_it_cannot(evals, tiny_data, tmp_path, capsys, monkeypatch):
    """`gate --grow`: an INCONCLUSIVE verdict is evaluated again, both sides, on the sample its intervals ask for
    (a quarter more), within the caps and the held-out text, and the JSON keeps every round."""
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.evals.commands import gate as gate_cmd, grow_sample
    from expertcache.recipes.cli import main

    cand = tmp_path / "noisy"
    m = AutoModelForCausalLM.from_pretrained(evals["base_model"])
    g0 = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g0) * 0.02 * p.float().pow(2).mean().sqrt())
    m.save_pretrained(cand)
    AutoTokenizer.from_pretrained(evals["base_model"]).save_pretrained(cand)
    kw = dict(corpus=tiny_data["corpus"], tasks=[], task_dir=str(evals["root"] / "tasks"), ppl_blocks=2, seq_len=32,
              max_dppl_domain=1e6, min_dacc=-100.0)
    first = gate_cmd(str(evals["base_model"]), str(cand), **kw)
    est = first["dppl_percent"]["overall"]
    lo, hi = first["dppl_overall_ci95"]
    th = est + 0.3 * (hi - est)  # the threshold inside the interval, above the estimate: INCONCLUSIVE by design
    grown = gate_cmd(str(evals["base_model"]), str(cand), **kw, max_dppl=th, grow=2, out=str(tmp_path / "g.json"))
    rounds = grown["sizing"]["rounds"]
    assert rounds[0]["gate"] == "INCONCLUSIVE" and rounds[0]["n_blocks"] == 2 and len(rounds) >= 2
    asked = rounds[0]["resolve"]["blocks_per_domain"]  # a quarter more than the first round's intervals asked
    assert rounds[1]["ppl_blocks"] == min(math.ceil(asked * 1.25), 256) > 2
    assert rounds[1]["n_blocks"] == min(rounds[1]["ppl_blocks"], 14)  # the tiny test split has 14 code blocks
    assert rounds[-1]["gate"] == grown["gate"] and all(r["gate"] == "INCONCLUSIVE" for r in rounds[:-1])
    assert len(rounds) == 3 or grown["gate"] != "INCONCLUSIVE"  # it stops growing once resolved
    assert json.loads((tmp_path / "g.json").read_text())["sizing"]["rounds"] == rounds
    # #46: each growth round is announced with why, its sample and its expected time (15 silent minutes before)
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("gate: round 1/3 INCONCLUSIVE on 2 blocks per domain"))
    assert f"round 2: both again on {rounds[1]['ppl_blocks']} blocks" in line and "straddles" in line
    assert " s at the last round's pace" in line
    if grown["gate"] == "INCONCLUSIVE":  # the text ran out, or the rounds did: a note says which
        assert grown["sizing"]["notes"], grown["sizing"]
    # the blocks resolve and accuracy does not: only the unresolved task is evaluated again, on more documents;
    # the blocks and the step-wise figures are the first round's
    capsys.readouterr()
    import expertcache.evals.run as run_mod

    calls, real = [], run_mod.evaluate

    def recorded(*a, **k):  # what each evaluation was asked for: (tasks, documents, blocks)
        calls.append((list(a[3]), a[6], a[7]))
        return real(*a, **k)

    monkeypatch.setattr(run_mod, "evaluate", recorded)
    acc = gate_cmd(str(evals["base_model"]), str(cand), **{**kw, "tasks": ["ec_math_em"], "limit": 3,
                                                           "min_dacc": -1.0}, max_dppl=1e6, grow=1, max_documents=6)
    assert calls == [(["ec_math_em"], 3, 2)] * 2 + [(["ec_math_em"], 6, 0)] * 2  # round 2: no blocks again
    first, second = acc["sizing"]["rounds"]
    assert first["gate"] == "INCONCLUSIVE" and first["resolve"]["blocks_per_domain"] is None
    assert second["tasks_grown"] == ["ec_math_em"] and second["ppl_blocks"] == first["ppl_blocks"]
    assert second["n_blocks"] == first["n_blocks"] and acc["dppl_overall_ci95"] == first["dppl_overall_ci95"]
    assert second["limit"] == 6 and acc["n_documents"]["ec_math_em"] > 3
    assert (evals["root"] / "tasks-6").is_dir()  # the grown documents' task data, built apart
    assert "ec_math_em again on 6 documents (the blocks and other tasks kept)" in capsys.readouterr().err
    # the tasks to grow are the frontier's own function's (`documents_to_grow`, per task; its rules are tested in
    # test_cache_aware): where it says a task's held-out text is spent, the gate grows nothing and says why
    import expertcache.evals.commands as commands_mod

    calls.clear()
    asked = []
    monkeypatch.setattr(commands_mod, "documents_to_grow", lambda g, limit, cap: asked.append((limit, cap)) or (
        {}, "ec_math_em: the held-out text gave 3 documents, ~40 would resolve it"))
    spent = gate_cmd(str(evals["base_model"]), str(cand), **{**kw, "tasks": ["ec_math_em"], "limit": 3,
                                                             "min_dacc": -1.0}, max_dppl=1e6, grow=1, max_documents=6)
    assert asked == [(3, 6)] and len(calls) == 2 and len(spent["sizing"]["rounds"]) == 1
    assert spent["gate"] == "INCONCLUSIVE" and spent["sizing"]["notes"] == [
        "ec_math_em: the held-out text gave 3 documents, ~40 would resolve it"]
    # the caps and the text stop the growth, with a note
    g = {"resolve": {"blocks_per_domain": 40, "documents": {"t": 30}}, "n_blocks": 14, "n_documents": {"t": 8}}
    assert grow_sample(g, 14, 8, 256, 128)[:2] == (50, 38)
    nb, nl, notes = grow_sample(g, 20, 8, 256, 16)
    assert (nb, nl) == (20, 16) and "held-out text gave 14 blocks" in notes[0] and "--max_documents 16" in notes[1]
    assert grow_sample(dict(g, resolve={"blocks_per_domain": -1, "documents": {}}), 14, 8, 256, 128)[2] == [
        "a Δppl estimate sits on its threshold: no number of blocks resolves it"]
    nb, nl, notes = grow_sample(g, 14, None, 256, 128, docs_can_grow=False)  # no --limit, no local task: all in
    assert nl is None and "without --limit" in notes[-1]
    # --grow needs checkpoints; negative counts are refused
    capsys.readouterr()
    b = str(evals["root"] / "base.json")
    assert main(["gate", "--baseline", b, "--candidate", b, "--grow", "1"]) == 2
    assert "checkpoint directories" in capsys.readouterr().err
    assert main(["gate", "--baseline", b, "--candidate", b, "--grow", "-1"]) == 2



def test_eval_sizes_its_sample_from_a_target_interval_width(evals, tiny_data, tmp_path, capsys):
    import math

    from expertcache.evals.commands import sample_from_gate
    from expertcache.recipes.cli import main

    g = gate(evals["base"], _scaled(evals["base"], {d: [1.0, 1.0032] for d in ("code", "prose", "math")}))
    (tmp_path / "g.json").write_text(json.dumps(g))
    half = max((hi - lo) / 2 for lo, hi in g["dppl_ci95"].values())
    nb, _, sizing = sample_from_gate(str(tmp_path / "g.json"), 2, None, half / 2)
    assert nb == 8  # half the width: four times the blocks
    assert "~8 give" in sizing["notes"][0]
    assert sample_from_gate(str(tmp_path / "g.json"), 2, None, half * 4)[0] == 2  # never fewer than given
    out = tmp_path / "sized.json"
    assert main(["eval", "--model", str(evals["base_model"]), "--corpus", tiny_data["corpus"], "--tasks", "[]",
                 "--seq_len", "32", "--ppl_blocks", "2", "--task_dir", str(evals["root"] / "tasks"),
                 "--size_from", str(tmp_path / "g.json"), "--target_width", str(half / 10), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["sizing"]["ppl_blocks"] == 200 and res["n_blocks"]["code"] < 200  # the tiny split has fewer
    err = capsys.readouterr().err
    assert "~200 give" in err and "200 asked" in err  # it says what it could not give
    broken = dict(g, dppl_ci95={d: [float("nan"), "x"] for d in g["dppl_ci95"]})
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(InputError, match="no Δppl intervals"):
        sample_from_gate(str(tmp_path / "broken.json"), 2, None, 0.5)
    for bad in (["--target_width", "0.5"], ["--size_from", str(tmp_path / "g.json"), "--target_width", "0"]):
        assert main(["eval", "--model", str(evals["base_model"]), *bad]) == 2
        assert "--target_width" in capsys.readouterr().err


def test_eval_size_from_evaluates_the_gated_configuration_or_refuses(evals, tiny_data, tmp_path, capsys):
    """#46: `eval --size_from` on a gate of a served candidate over some tasks evaluated the plain model on the
    default tasks. It now repeats a side of that gate (its engine options and tasks), or refuses in one line."""
    import shutil

    from expertcache.evals.commands import gated_configuration
    from expertcache.recipes.cli import main

    g = gate(evals["base"], evals["served"])
    assert g["baseline"]["engine"] is None and g["candidate"]["engine"]["capacity"] == 0.25
    assert g["candidate"]["tasks"] == TASKS and g["candidate"]["seq_len"] == 32
    p = tmp_path / "g.json"
    p.write_text(json.dumps(g))
    m = str(evals["base_model"])
    # the same checkpoint on both sides: no --engine is the plain baseline, the candidate's options the candidate
    assert gated_configuration(str(p), m, None, None, 32, "fp32") == (None, TASKS)
    e, t = gated_configuration(str(p), m, EngineConfig(capacity=0.25, tier="host"), ["ec_math_em"], 32, "fp32")
    assert (e.capacity, e.tier, t) == (0.25, "host", ["ec_math_em"])  # the tier moves bytes, computes the same
    # refused, one line each, exit 2, before any model is loaded
    for args, needle in ((["--engine.capacity", "0.5"], "neither side of that gate"),
                         (["--tasks", "[arc_easy]"], "arc_easy were not gated"),
                         (["--seq_len", "64"], "pass --seq_len 32"),
                         (["--engine.capacity", "0.25", "--engine.miss", "reroute"], "candidate")):
        capsys.readouterr()
        assert main(["eval", "--model", m, "--size_from", str(p), *args]) == 2, args
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and needle in err[0] and err[0].startswith("expertcache eval: error:"), (args, err)
    # a candidate checkpoint of its own, served reroute over one task: given without --engine and --tasks, the eval
    # is that served configuration on that task, and says so (the sample this gate would size is the smallest: what
    # is checked here is the configuration; the sizing has its tests above, and a large sample served token by
    # token took minutes)
    rr = evals["reroute"]
    cand = dict(g, resolve={"blocks_per_domain": 1, "documents": {"ec_cloze_prose": 2}},
                candidate=dict(g["candidate"], model=str(tmp_path / "cand"), engine=rr["engine"],
                               policy=rr["policy"], tasks=rr["tasks"]))
    shutil.copytree(evals["base_model"], tmp_path / "cand")  # another folder: a symlink is the same model
    p.write_text(json.dumps(cand))
    out = tmp_path / "sized.json"
    assert main(["eval", "--model", str(tmp_path / "cand"), "--corpus", tiny_data["corpus"], "--seq_len", "32",
                 "--ppl_blocks", "1", "--limit", "2", "--task_dir", str(evals["root"] / "tasks"),
                 "--size_from", str(p), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["policy"] == rr["policy"] and res["engine"]["miss"] == "reroute" and res["engine"]["tau"] == 1.0
    assert res["tasks"] == ["ec_cloze_prose"] and set(res["lm_eval"]) == {"ec_cloze_prose"}
    assert "served as the gate's candidate was" in capsys.readouterr().err


LM_EVAL_ONE_LINE = "import expertcache, lm_eval.__main__ as m; m.cli_evaluate()"  # expertcache's docstring


@pytest.mark.slow  # two lm-eval command lines in subprocesses
def test_lm_eval_command_line_with_the_documented_one_liner(evals, tmp_path):
    """#46: `lm_eval --model expertcache` from lm-eval's own command line. lm-eval offers installed packages no
    registration: its command line looks the model up in its registry, where a fresh interpreter that has not
    imported expertcache finds none (if a later lm-eval finds it, this test says the docs must change; asked of
    the registry, not of `python -m lm_eval`, which indexes its ~13k task files for 8 s before it looks); the one
    line the package docstring gives runs lm-eval's command line with the model, served, on a local task."""
    import expertcache

    assert LM_EVAL_ONE_LINE in expertcache.__doc__.replace("\\\n", "")
    args = ["--model", "expertcache", "--model_args", f"pretrained={evals['base_model']},capacity=0.5",
            "--tasks", "ec_cloze_prose", "--include_path", str(evals["root"] / "tasks" / "lm_eval_tasks"),
            "--limit", "2", "--batch_size", "1", "--device", "cpu", "--output_path", str(tmp_path / "out")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    plain = subprocess.run([sys.executable, "-c", "from lm_eval.api.registry import get_model; "
                            "get_model('expertcache')"], capture_output=True, text=True, env=env, timeout=300)
    assert plain.returncode != 0 and "no model for this name" in plain.stderr and "expertcache" in plain.stderr, \
        plain.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", LM_EVAL_ONE_LINE, *args], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ec_cloze_prose" in r.stdout and "acc" in r.stdout
    (res,) = (tmp_path / "out").rglob("results_*.json")
    assert 0 <= json.loads(res.read_text())["results"]["ec_cloze_prose"]["acc,none"] <= 1


@pytest.mark.slow  # lm-eval indexes its ~13k task YAMLs to find arc_easy
def test_an_lm_eval_task_whose_data_is_offline_is_one_line_before_the_model_loads(tiny_base, tmp_path):
    """#46: `eval --tasks arc_easy` offline (its hub dataset not cached) ended in a traceback."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               HF_DATASETS_CACHE=str(tmp_path / "empty-cache"))
    r = subprocess.run([sys.executable, "-m", "expertcache.recipes.cli", "eval", "--model", str(tiny_base),
                        "--tasks", "[arc_easy]", "--ppl_blocks", "0", "--task_dir", str(tmp_path / "tasks")],
                       capture_output=True, text=True, env=env, timeout=600)
    err = [x for x in r.stderr.splitlines() if x.startswith("expertcache eval")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(err) == 1 and "task arc_easy: its data could not be loaded" in err[0], r.stderr[-2000:]


@pytest.mark.parametrize("capacity,tau", [(0.25, 1.0), (0.5, 0.05)])
def test_replayed_reroute_gives_the_engines_logits_document_by_document(tiny_base, capacity, tau):
    """`--accuracy replay`: the plain model in one batched forward over right-padded documents, the reroute rule
    replayed in its routers per document, gives the logits the engine gives serving each document one token at a
    time from a fresh engine (an empty cache), rerouting included."""
    from transformers import DynamicCache

    from expertcache.evals.replay import ReplayedReroute
    from expertcache.evals.served import open_model
    from expertcache.evals.stepwise import step

    eng = EngineConfig(capacity=capacity, tier="host", miss="reroute", tau=tau)
    plain, _ = open_model(tiny_base, None)
    vocab = plain.config.vocab_size
    g = torch.Generator().manual_seed(1)
    lengths = [24, 17, 24, 9]
    docs = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    want, rerouted = [], 0
    for d in docs:
        model, engine = open_model(tiny_base, eng)
        cache = DynamicCache()
        with torch.no_grad():
            want.append(torch.stack([step(model, d[None, j:j + 1], cache).logits[0, -1] for j in range(len(d))]))
        rerouted += engine.stats.to_dict(engine.traffic_expert_bytes)["rerouted"]
        engine.close()
    batch = torch.zeros(len(docs), max(lengths), dtype=torch.long)  # right-padded, as lm-eval pads loglikelihood
    for i, d in enumerate(docs):
        batch[i, :len(d)] = d
    rp = ReplayedReroute(plain, eng)
    rp.batch = len(docs)
    with torch.no_grad():
        got = plain(input_ids=batch, use_cache=False).logits
    for i, n in enumerate(lengths):
        torch.testing.assert_close(got[i, :n], want[i], atol=2e-4, rtol=1e-4)
    assert rerouted > 0 and rp.rerouted > 0  # the engine rerouted, and so did the replay (not a vacuous match)
    rp.remove()
    with torch.no_grad():
        native = plain(input_ids=batch, use_cache=False).logits
    assert any(not torch.allclose(native[i, :n], want[i], atol=1e-3) for i, n in enumerate(lengths))


def test_replay_is_refused_where_it_cannot_replay(evals):
    base, root = evals["base_model"], evals["root"]
    kw = dict(corpus="unused", tasks=["ec_cloze_prose"], task_dir=root / "tasks", limit=2, ppl_blocks=0)
    with pytest.raises(InputError, match="replays a lossy miss policy"):
        evaluate(base, accuracy="replay", **kw)
    with pytest.raises(InputError, match="served token by token only"):
        evaluate(base, engine=EngineConfig(capacity=0.25, miss="speculative"), accuracy="replay", **kw)
    with pytest.raises(InputError, match="ec_math_em generates text"):
        evaluate(base, engine=EngineConfig(capacity=0.25, miss="reroute"), accuracy="replay",
                 **dict(kw, tasks=["ec_cloze_prose", "ec_math_em"]))
    with pytest.raises(InputError, match="expected one of token, replay"):
        evaluate(base, accuracy="fast", **kw)
    r = evaluate(base, engine=EngineConfig(capacity=0.25, miss="reroute", tau=1.0), accuracy="replay",
                 **dict(kw, corpus=evals["corpus"]))
    assert r["accuracy_method"] == "replay" and r["n_documents"] == {"ec_cloze_prose": 2}
    assert 0 <= r["lm_eval"]["ec_cloze_prose"]["acc,none"] <= 1
    assert evals["reroute"]["accuracy_method"] == "token" and evals["base"]["accuracy_method"] == "batched"
