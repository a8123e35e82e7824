"""Cache-aware post-training: losses with hand-made cases, router shapes and targets, the predictor-driven cache
simulator, and real post-training runs (aux-only freeze, joint, resume) on a tiny pretrained base."""

import csv
import json
import math

import numpy as np
import pytest
import torch

from expertcache.telemetry.cache import lru_resident, served_routing
from expertcache.telemetry.cachesim import next_use, simulate, simulate_scored
from expertcache.telemetry.errors import InputError
from expertcache.trainer.aux_routers import (AuxRouterConfig, AuxRouters, history_features, load_aux_routers,
                                             next_use_target)
from expertcache.trainer.config import RecipeError, load_recipe
from expertcache.trainer.locality import domain_loss, layer_weights, locality_loss, served_margin_loss
from helpers import REPO

pytestmark = pytest.mark.slow  # end-to-end: trains, evaluates or runs the CLI in subprocesses (`make test-fast` skips)

CA_RECIPES = REPO / "recipes" / "cache-aware"


# --- losses ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dot", "l2"])
def test_locality_gradient_pulls_the_next_token_towards_the_previous_routing(kind):
    # one sequence of 2 tokens, 4 experts: token 0 prefers expert 0, token 1 prefers expert 3
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]], requires_grad=True)
    loss = locality_loss([logits], batch=1, kind=kind)
    loss.backward()
    g = logits.grad
    assert g[1, 0] < 0, g  # raising token 1's logit for token 0's expert lowers the loss
    assert g[1, 3] > 0, g  # and raising its own, different, favourite raises it
    assert g[0, 3] < 0 and g[0, 0] > 0  # symmetric for token 0
    same = torch.tensor([[3.0, 0, 0, 0], [3.0, 0, 0, 0]])
    p = same[0].softmax(-1)
    want = 0.0 if kind == "l2" else float(1 - (p * p).sum())
    assert locality_loss([same], 1, kind).item() == pytest.approx(want, abs=1e-6)


def test_locality_layer_weights_and_pairs_stay_inside_a_sequence():
    # two sequences of one token each: no adjacent pair inside a sequence -> nothing to compare
    a = torch.randn(4, 8)
    l_two = locality_loss([a], batch=2)  # [2, 2, 8]: one pair per sequence
    manual = np.mean([1 - float((a[2 * b].softmax(-1) * a[2 * b + 1].softmax(-1)).sum()) for b in range(2)])
    assert l_two.item() == pytest.approx(manual, rel=1e-5)
    w = layer_weights([0.0, 1.0], 2)
    assert torch.allclose(w, torch.tensor([0.0, 2.0]))
    l_w = locality_loss([a, torch.zeros(4, 8)], 2, "l2", w)  # layer 0 weighted out; layer 1 constant: 0
    assert l_w.item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(InputError, match="2 MoE layers"):
        layer_weights([1.0], 2)


@pytest.mark.parametrize("cache", [2, 3, 4, 7])
def test_lru_resident_set_is_the_simulators_lru(cache):
    # random routing of 2 sequences: the misses the loss sees are exactly the simulated LRU's demand loads
    torch.manual_seed(cache)
    b, t, e, k = 2, 40, 8, 2
    logits = torch.randn(b * t, e) * 3
    resident, chosen = lru_resident(logits, b, k, cache)
    ids = logits.view(b, t, e).topk(k, dim=-1).indices.numpy()
    for s in range(b):
        misses = int((chosen[s] & ~resident[s]).sum()) + k  # + token 0's k cold misses
        assert misses == simulate(ids[s], cache, "lru", "token").loads


@pytest.mark.parametrize("kind", ["resident", "miss"])
def test_cache_losses_push_the_missed_expert_down_and_the_resident_one_up(kind):
    # 4 experts, top-1, cache of 1: token 0 chose expert 0; token 1 chooses expert 3 (a miss)
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]], requires_grad=True)
    loss = locality_loss([logits], batch=1, kind=kind, top_k=1, cache=1, temperature=0.5)
    loss.backward()
    g = logits.grad
    assert g[1, 3] > 0 and g[1, 0] < 0, g  # descent lowers the miss and raises the resident expert
    assert torch.all(g[0] == 0)  # the cache's contents come from the hard choice: no gradient into token 0
    hit = torch.tensor([[3.0, 0, 0, 0], [3.0, 0, 0, 0]])
    assert locality_loss([hit], 1, "miss", top_k=1, cache=1).item() == 0.0


def _reroute_by_hand(probs, choice, lru, cap, tau):
    """The engine's reroute rule, written out for one token: `lru` the served experts, least recent first."""
    resident = set(lru[-cap:])
    out = list(choice)
    for j, e in enumerate(out):
        if e in resident:
            continue
        cand = [r for r in resident if r not in out]
        if cand:
            r = max(cand, key=lambda x: (probs[x], -x))
            if probs[e] - probs[r] <= tau:
                out[j] = r
    return out


@pytest.mark.parametrize("cap,k,tau", [(2, 2, 0.05), (3, 2, 0.2), (4, 4, 0.1), (6, 2, float("inf")), (8, 2, 0.1)])
def test_served_routing_replays_the_engines_reroute_token_by_token(cap, k, tau):
    torch.manual_seed(cap * 10 + k)
    b, t, e = 3, 30, 8
    probs = (torch.randn(b * t, e) * 2).softmax(-1)
    idx = probs.topk(k, dim=-1).indices
    served, changed = served_routing(probs, idx, b, cap, tau)
    for s in range(b):
        lru: list[int] = []
        for i in range(t):
            row = s * t + i
            want = _reroute_by_hand(probs[row].tolist(), idx[row].tolist(), lru, cap, tau)
            assert served[row].tolist() == want, (s, i)
            assert changed[row].tolist() == [a != c for a, c in zip(want, idx[row].tolist())]
            for x in want:  # the served experts become the most recent (in choice order)
                if x in lru:
                    lru.remove(x)
                lru.append(x)
    if tau > 0:
        assert changed.any()  # the replay did reroute something (the comparison above is not vacuous)
    same, none = served_routing(probs, idx, b, cap, -1.0)  # a negative tau never swaps
    assert torch.equal(same, idx) and not none.any()


def test_margin_loss_lifts_the_served_experts_over_the_rest():
    # 4 experts, top-1: the router prefers expert 3, the reroute served expert 0 -> push 0 up and 3 down
    logits = torch.tensor([[0.0, 0.0, 0.0, 3.0], [3.0, 0.0, 0.0, 0.0]], requires_grad=True)
    served = torch.tensor([[0], [0]])
    loss = served_margin_loss([logits], [served], margin=0.5)
    assert loss.item() == pytest.approx((3.0 - 0.0 + 0.5) / 2)  # token 1 agrees already: it adds nothing
    loss.backward()
    g = logits.grad
    assert g[0, 0] < 0 and g[0, 3] > 0 and torch.all(g[1] == 0), g
    agree = served_margin_loss([torch.tensor([[3.0, 0, 0, 0]])], [torch.tensor([[0]])], margin=0.5)
    assert agree.item() == 0.0


def test_serving_aware_forward_computes_with_the_served_experts(tiny_base):
    from transformers import AutoModelForCausalLM

    from expertcache.telemetry.adapters import adapter_for
    from expertcache.trainer.locality import ServedRouting

    model = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    a = adapter_for(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        native = model(input_ids=ids, output_router_logits=True, use_cache=False)
    hooks = ServedRouting(a.moe_layers(model), a, capacity=a.top_k, tau=1.0, apply=True)
    with torch.no_grad():
        off = model(input_ids=ids, use_cache=False).logits  # inactive: the model's own routing
        hooks.active, hooks.batch = True, 2
        on = model(input_ids=ids, output_router_logits=True, use_cache=False)
    assert torch.equal(off, native.logits)
    assert hooks.rerouted_fraction() > 0 and not torch.allclose(on.logits, native.logits)
    # layer 0 sees the same input either way: its served set is the replay of its own logits
    want, _ = served_routing(a.scores(native.router_logits[0]), native.router_logits[0].topk(a.top_k).indices, 2,
                             a.top_k, 1.0)
    assert torch.equal(hooks.served[0], want)


def test_domain_loss_gradient_moves_mass_into_the_allowed_set():
    logits = torch.zeros(3, 4, requires_grad=True)  # one sequence, 3 tokens, 4 experts, uniform
    allowed = torch.tensor([[[True, True, False, False]]])  # [D=1, layers=1, E=4]
    loss = domain_loss([logits], batch=1, domain=torch.tensor([0]), allowed=allowed)
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    assert (logits.grad[:, :2] < 0).all() and (logits.grad[:, 2:] > 0).all()


# --- routers ---------------------------------------------------------------------------------------------------

def _routers(temporal=True, spatio=True, e=8, h=16, layers=3, history=4):
    cfg = AuxRouterConfig(hidden_size=h, num_experts=e, top_k=2, moe_layers=list(range(layers)),
                          temporal=temporal, spatio=spatio, rank=4, history=history)
    torch.manual_seed(0)
    return AuxRouters(cfg), [torch.nn.Linear(h, e, bias=False) for _ in range(layers)]


def test_router_shapes_and_zero_start_equal_the_native_router():
    aux, routers = _routers()
    h = torch.randn(10, 16)
    hist = torch.zeros(10, 8, 4)
    t = aux.temporal_scores(1, h, routers[1], hist)
    s = aux.spatio_scores(2, h, routers[2])
    assert t.shape == (10, 8) and s.shape == (10, 8)
    # untrained: the Temporal head is the layer's own router (persistence), the Spatio head the lookahead probe
    assert torch.allclose(t, routers[1](h)) and torch.allclose(s, routers[2](h))
    assert len(aux.temporal) == 3 and len(aux.spatio) == 2  # layer 0 has no predecessor
    with pytest.raises(InputError):
        AuxRouters(AuxRouterConfig(16, 8, 2, [0, 1], temporal=False, spatio=False))


def test_router_loss_gradient_raises_the_score_of_the_true_expert():
    aux, routers = _routers(temporal=False)
    b, t = 1, 5
    hidden = [torch.randn(b * t, 16) for _ in range(3)]
    ids = [torch.tensor([[0, 1]] * t) for _ in range(3)]
    loss = aux.loss(hidden, ids, routers, b)["spatio"]
    loss.backward()
    up = aux.spatio[0].up  # predicts layer 1; its bias is a per-expert score offset
    assert up.bias.grad[0] < 0 and up.bias.grad[1] < 0  # true experts: push their scores up
    assert (up.bias.grad[2:] > 0).all()


def test_temporal_targets_and_history_by_hand():
    ids = torch.tensor([[[0], [1], [2], [0], [1]]])  # [B=1, T=5, k=1], E=3
    tgt = next_use_target(ids, 3, horizon=3, decay=0.5)  # [1, 4, 3]
    # token 0: expert 1 next at d=1, expert 2 at d=2, expert 0 at d=3
    assert tgt[0, 0].tolist() == [0.25, 1.0, 0.5]
    # token 3: only token 4 lies ahead (expert 1 at d=1)
    assert tgt[0, 3].tolist() == [0.0, 1.0, 0.0]
    assert next_use_target(ids, 3, 3, 0.0)[0, 0].tolist() == [0.0, 1.0, 0.0]  # gamma 0: next token only
    hist = history_features(ids, 3, history=2)  # [1, 5, 3, 2]
    assert hist[0, 2].tolist() == [[0, 0], [0, 1], [1, 0]]  # used now: 2; one token ago: 1
    assert hist[0, 0, :, 1].tolist() == [0, 0, 0]  # nothing before the first token


# --- the predictor-driven cache --------------------------------------------------------------------------------

def _steps(seed=0, s=300, e=8, k=2):
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(e, k, replace=False) for _ in range(s)])


@pytest.mark.parametrize("cap", [2, 3, 5])
def test_scored_cache_is_lru_without_scores_and_belady_with_oracle_scores(cap):
    steps = _steps()
    assert simulate_scored(steps, cap).hits == simulate(steps, cap, "lru", "token").hits
    # oracle Temporal scores: minus the step of each key's next use -> keeps exactly what Belady keeps
    nxt = next_use(steps.tolist())
    keep = np.full((len(steps), 8), -1e18)
    seen = {}
    for s in range(len(steps) - 1, -1, -1):
        for e, n in seen.items():
            keep[s, e] = -n
        for e in steps[s]:
            seen[int(e)] = s
    bel = simulate(steps, cap, "belady", "token")
    got = simulate_scored(steps, cap, keep=keep)
    assert got.hits == bel.hits, (got, bel)
    assert got.prefetches == 0 and got.adjusted_hit_rate == pytest.approx(got.hit_rate)
    assert nxt  # next_use is the helper Belady itself uses


def test_prefetch_of_the_true_experts_hits_and_is_charged():
    steps = _steps(1)
    exact = simulate_scored(steps, 2, prefetch=steps)  # a perfect Spatio refinement with R = k
    assert exact.hit_rate == 1.0 and exact.loads == 0
    assert exact.prefetches == simulate_scored(steps, 2).loads  # every load became a prefetch: no saving
    assert exact.adjusted_hit_rate == pytest.approx(simulate_scored(steps, 2).adjusted_hit_rate)
    wrong = simulate_scored(steps, 4, prefetch=(steps + 4) % 8)  # prefetch experts that are not needed
    lru = simulate_scored(steps, 4)
    assert wrong.adjusted_hit_rate < lru.adjusted_hit_rate


# --- recipes and real runs -------------------------------------------------------------------------------------

def test_every_shipped_recipe_loads_and_bad_ones_are_refused():
    from expertcache.trainer.cache_aware import CacheAwareRecipe

    for name in ("locality", "temporal", "spatio-temporal", "aux-only", "sweep", "smoke"):
        load_recipe(CacheAwareRecipe, CA_RECIPES / f"{name}.yaml")
    with pytest.raises(RecipeError, match="unknown recipe key routers.tempral"):
        load_recipe(CacheAwareRecipe, CA_RECIPES / "temporal.yaml", ["routers.tempral=true"])
    with pytest.raises(RecipeError, match="locality-only trains no auxiliary routers"):
        load_recipe(CacheAwareRecipe, CA_RECIPES / "locality.yaml", ["routers.temporal=true"])
    with pytest.raises(RecipeError, match="aux-only freezes the backbone"):
        load_recipe(CacheAwareRecipe, CA_RECIPES / "aux-only.yaml", ["locality.weight=1.0"])
    with pytest.raises(RecipeError, match="serving.tau=-0.1"):
        load_recipe(CacheAwareRecipe, CA_RECIPES / "locality.yaml", ["serving.reroute=true", "serving.tau=-0.1"])
    with pytest.raises(RecipeError, match="locality.margin=nan"):
        load_recipe(CacheAwareRecipe, CA_RECIPES / "locality.yaml", ["locality.kind=margin", "locality.margin=nan"])


def _ca_recipe(tiny_data, base, out, name="smoke", **extra):
    from expertcache.trainer.cache_aware import CacheAwareRecipe

    return load_recipe(CacheAwareRecipe, CA_RECIPES / f"{name}.yaml", _ca_overrides(tiny_data, base, out, **extra))


def _ca_overrides(tiny_data, base, out, **extra) -> list[str]:
    o = {"base": str(base), "out_dir": str(out), "data.corpus": tiny_data["corpus"], "data.tokenizer": str(base),
         "data.seq_len": 64, "data.batch_size": 4, "data.val_batches": 1, "train.max_steps": 6,
         "train.ckpt_every": 3, "train.val_every": 6, "train.wandb": False, "eval.prompt_len": 16,
         "eval.decode_tokens": 12, "eval.max_seqs": 2, "eval.ppl_blocks": 2, "eval.seq_len": 64}
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def test_aux_only_keeps_the_backbone_bit_identical(tiny_data, tiny_base, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from expertcache.trainer.cache_aware import run_cache_aware

    res = run_cache_aware(_ca_recipe(tiny_data, tiny_base, tmp_path / "aux", "aux-only", **{"routers.rank": 4}))
    before = load_file(str(tiny_base / "model.safetensors"))
    after = load_file(str(tmp_path / "aux" / "model" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert res["summary"]["dppl_percent"]["overall"] == pytest.approx(0.0, abs=1e-9)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "aux" / "model")
    aux = load_aux_routers(tmp_path / "aux" / "model", model)
    assert aux.cfg.temporal and aux.cfg.spatio and aux.cfg.rank == 4
    # the heads trained: no longer the zero-start (native router) predictors
    assert any(float(h.up.weight.abs().sum()) > 0 for h in aux.temporal)
    assert res["parameters"]["aux_fraction_of_backbone"] < 0.01
    # routers trained for one checkpoint are refused by another
    other = AutoModelForCausalLM.from_pretrained(tiny_base)
    with torch.no_grad():
        other.model.layers[0].mlp.gate.weight.add_(1.0)
    with pytest.raises(InputError, match="another checkpoint"):
        load_aux_routers(tmp_path / "aux" / "model", other)


def test_joint_run_resumes_and_writes_the_table(tiny_data, tiny_base, tmp_path, capsys):
    from expertcache.recipes.cli import main
    from expertcache.trainer.cache_aware import run_cache_aware

    out = tmp_path / "joint"
    first = run_cache_aware(_ca_recipe(tiny_data, tiny_base, out, **{"train.max_steps": 3, "routers.rank": 4}))
    assert first["global_step"] == 3 and first["resumed_from_step"] == 0
    # #24 finding 4: a resume under another recipe (a locality kind, a learning rate) is refused, naming the keys,
    # before anything in the run folder changes
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    for change, named in (({"locality.kind": "l2"}, ["locality.kind: 'dot' in the checkpoint, 'l2' now"]),
                          ({"train.lr": 0.01, "locality.weight": 0.5}, ["train.lr: 0.001 in the checkpoint, 0.01 now",
                                                                       "locality.weight", "2 key(s) differ"])):
        with pytest.raises(RecipeError) as e:
            run_cache_aware(_ca_recipe(tiny_data, tiny_base, out, **{"train.max_steps": 6, "routers.rank": 4},
                                       **change))
        assert all(n in str(e.value) for n in named) and "--resume false" in str(e.value), str(e.value)
        with pytest.raises(RecipeError):  # a finished run too: it would rewrite result.json under that recipe
            run_cache_aware(_ca_recipe(tiny_data, tiny_base, out, **{"train.max_steps": 3, "routers.rank": 4},
                                       **change))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps
    second = run_cache_aware(_ca_recipe(tiny_data, tiny_base, out, **{"train.max_steps": 6, "routers.rank": 4}))
    assert second["resumed_from_step"] == 3 and second["global_step"] == 6
    # the resume keeps one `last.ckpt` and the newest step (no `last-v1.ckpt` beside a stale `last.ckpt`)
    assert sorted(p.name for p in (out / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step6.ckpt"]
    s = second["summary"]
    for cap, c in s["capacities"].items():
        assert {"lru", "temporal", "spatio", "spatio_temporal", "base_lru"} <= set(c)
        for p in ("lru", "temporal", "spatio", "spatio_temporal"):
            row = c[p]
            assert 0 <= row["adjusted_hit_rate"] <= row["hit_rate"] <= 1
            assert row["hit_rate"] <= row["belady_hit_rate"] + 1e-12 or p in ("spatio", "spatio_temporal")
        assert c["temporal"]["prefetch_loads"] == 0 and c["lru"]["prefetch_loads"] == 0
    assert set(s["dppl_percent"]) == {"code", "prose", "math", "overall"}
    g = s["gate"]
    assert g["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE") and g["pass"] == (g["verdict"] == "PASS")
    assert (g["verdict"] == "FAIL") == bool(g["failures"]) and (g["verdict"] == "INCONCLUSIVE") <= bool(g["unresolved"])
    for d, (lo, hi) in g["dppl_ci95"].items():  # the end-of-run gate's paired intervals hold their estimates
        assert lo - 1e-9 <= s["dppl_percent"][d] <= hi + 1e-9
    assert set(second["candidate"]["block_nll"]) == {"code", "prose", "math"}
    table = (out / "result.md").read_text()
    row = next(ln for ln in table.splitlines() if "smoke |" in ln.replace("ca-smoke", "smoke"))
    verdicts = [v for v in ("PASS", "FAIL", "INCONCLUSIVE") if v in row]
    assert verdicts == [g["verdict"]], (row, g["verdict"])  # the table shows this run's verdict, and only it
    from helpers import plotted_pixels

    assert plotted_pixels(out / "cache.png") > 200  # curves were drawn, not just axes
    assert json.loads((out / "result.json").read_text())["global_step"] == 6
    assert main(["train-cache-aware", "--table", str(out)]) == 0
    # README's `--table runs/ca-*` also matches the quickstart's int4 copy: skipped in one line, the run tabulated;
    # a lone folder that is not a run stays a refusal
    capsys.readouterr()
    other = out.parent / "not-a-run"
    other.mkdir(exist_ok=True)
    assert main(["train-cache-aware", "--table", str(out), str(other)]) == 0
    err = capsys.readouterr().err
    assert f"{other} skipped: no result.json" in err and "smoke" in err
    assert main(["train-cache-aware", "--table", str(other)]) == 2
    # #46: the finished folder run again has nothing to do: exit 0 (not the gate's 3), said so, nothing rewritten,
    # and the verdict printed again with its reasons
    capsys.readouterr()
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert main(["train-cache-aware", "--recipe", "smoke",
                 *_ca_overrides(tiny_data, tiny_base, out, **{"train.max_steps": 6, "routers.rank": 4})]) == 0
    err = capsys.readouterr().err
    assert "nothing to do" in err and f"gate: {g['verdict']}" in err
    assert all(r in err for r in g["failures"] + g["unresolved"])
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps


def test_missing_base_is_one_clear_error(tiny_data, tmp_path, capsys):
    from expertcache.recipes.cli import main

    rc = main(["train-cache-aware", "--recipe", "locality", f"base={tmp_path}/nope", f"out_dir={tmp_path}/o",
               f"data.corpus={tiny_data['corpus']}"])
    assert rc == 2
    assert "no HF checkpoint" in capsys.readouterr().err


def test_help_documents_every_key(capsys):
    from expertcache.recipes.cli import main

    with pytest.raises(SystemExit):
        main(["train-cache-aware", "--help"])
    text = capsys.readouterr().out
    for key in ("locality.weight", "routers.refine_budget", "routers.horizon_decay", "eval.gate_ppl_overall",
                "sweep.values", "mode"):
        assert key in text


def test_runtime_reloads_the_routers_and_serves_losslessly_with_them(tiny_data, tiny_base, tmp_path):
    """The Temporal router drives the engine's cache (policy scored), the Spatio router its prefetch; blocking
    misses keep greedy decoding bit-identical to plain generate."""
    from transformers import AutoModelForCausalLM

    from expertcache.evals.served import open_model
    from expertcache.runtime.engine.config import EngineConfig
    from expertcache.trainer.cache_aware import run_cache_aware

    run_cache_aware(_ca_recipe(tiny_data, tiny_base, tmp_path / "r", "aux-only", **{"routers.rank": 4,
                                                                                  "train.max_steps": 4}))
    ckpt = tmp_path / "r" / "model"
    prompt = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    kw = dict(max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    want = plain.generate(prompt, **kw)
    m, eng = open_model(ckpt, EngineConfig(capacity=0.25, tier="disk", policy="scored", predictor="spatio",
                                           prefetch_guard=0))  # load(); guard off: the Spatio prefetch path is tested
    try:
        got = m.generate(prompt, **kw)
        assert eng.stats.prefetch_loads + eng.stats.prefetch_dropped > 0 and eng.stats.demand_loads > 0
    finally:
        eng.close()
    assert torch.equal(want, got)


def test_distillation_to_the_base_starts_at_zero_and_routers_only_leaves_the_rest(tiny_data, tiny_base, tmp_path):
    from safetensors.torch import load_file

    from expertcache.trainer.cache_aware import run_cache_aware

    out = tmp_path / "kd"
    res = run_cache_aware(_ca_recipe(tiny_data, tiny_base, out, "locality", **{
        "locality.kind": "miss", "locality.weight": 0.5, "locality.temperature": 0.5, "locality.warmup_steps": 2,
        "quality.distill": 1.0, "quality.lm_weight": 0.0, "quality.trainable": "routers", "train.max_steps": 3,
        "train.log_every": 1}))
    assert res["global_step"] == 3
    before = load_file(str(tiny_base / "model.safetensors"))
    after = load_file(str(out / "model" / "model.safetensors"))
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.endswith("mlp.gate.weight") for k in moved), moved  # the routers alone trained
    metrics = (out / "logs").rglob("metrics.csv")
    head = next(metrics).read_text().splitlines()
    assert "train/distill" in head[0] and "train/locality" in head[0]


def test_serving_aware_run_with_the_margin_loss_logs_its_reroutes(tiny_data, tiny_base, tmp_path):
    from expertcache.trainer.cache_aware import run_cache_aware

    out = tmp_path / "served"
    res = run_cache_aware(_ca_recipe(tiny_data, tiny_base, out, "locality", **{
        "serving.reroute": "true", "serving.capacity": 0.5, "serving.tau": 0.2, "locality.kind": "margin",
        "locality.weight": 1.0, "quality.distill": 1.0, "train.max_steps": 2, "train.log_every": 1}))
    assert res["global_step"] == 2
    rows = list(csv.DictReader(next((out / "logs").rglob("metrics.csv")).open()))
    rerouted = [float(r["train/rerouted"]) for r in rows if r.get("train/rerouted")]
    assert rerouted and all(0 < x < 1 for x in rerouted)  # the forward computed with swapped experts
    assert any(r.get("train/locality") for r in rows)
    too_small = _ca_recipe(tiny_data, tiny_base, tmp_path / "small", "locality",
                           **{"serving.reroute": "true", "serving.capacity": 1})
    with pytest.raises(RecipeError, match="fewer than top_k"):
        run_cache_aware(too_small)


def test_a_frontier_row_grows_only_the_accuracy_tasks_more_documents_can_decide():
    """frontier.grow_documents: a row INCONCLUSIVE on accuracy alone grows each unresolved task to a quarter above
    the gate's estimate, within the cap; nothing grows while perplexity is unresolved or failing, where a task's
    held-out text is spent (it gave fewer than asked), or where an estimate sits on its threshold. The grown eval
    replaces those tasks' documents and keeps the rest, the step-wise part included."""
    from expertcache.evals.gate import with_tasks
    from expertcache.evals.commands import documents_to_grow

    g = {"gate": "INCONCLUSIVE", "failures": [], "n_documents": {"ec_cloze_math": 2000, "ec_cloze_prose": 833},
         "resolve": {"blocks_per_domain": None, "documents": {"ec_cloze_math": 11756, "ec_cloze_prose": None}}}
    assert documents_to_grow(g, 2000, 20000) == ({"ec_cloze_math": 14695}, None)  # ceil(11756 x 1.25)
    assert documents_to_grow(g, 2000, 8000) == ({"ec_cloze_math": 8000}, None)
    spent = {**g, "resolve": {"blocks_per_domain": None, "documents": {"ec_cloze_math": 11756, "ec_cloze_prose": 1221}}}
    want, why = documents_to_grow(spent, 2000, 20000)
    assert want == {} and why.startswith("ec_cloze_prose: the held-out text gave 833 documents, ~1221")
    on_edge = {**g, "resolve": {"blocks_per_domain": None, "documents": {"ec_cloze_math": -1}}}
    assert documents_to_grow(on_edge, 2000, 20000)[0] == {}
    assert documents_to_grow({**g, "n_documents": {"ec_cloze_math": 8000, "ec_cloze_prose": 833}}, 2000, 8000,
                             "frontier.grow_documents") == ({}, "no unresolved task can grow within "
                                                                "frontier.grow_documents 8000")
    for other in ({**g, "resolve": {"blocks_per_domain": 40, "documents": {"ec_cloze_math": 11756}}},
                  {**g, "gate": "FAIL", "failures": ["Δppl"]}, {**g, "gate": "PASS"}):
        assert documents_to_grow(other, 2000, 20000)[0] == {}
    r = {"lm_eval": {"a": {"acc": 0.5}, "b": {"acc": 0.7}}, "lm_eval_docs": {"a": {"acc": [1, 0]}, "b": {"acc": [1]}},
         "lm_eval_samples": {"a": {"effective": 2}, "b": {"effective": 1}}, "n_documents": {"a": 2, "b": 1},
         "lm_eval_versions": {"a": 1, "b": 1}, "stepwise": {"ppl": {"overall": 3.0}}, "seconds": 10.0,
         "sample_notes": ["a: 2 documents, 4 asked (the task data has no more)", "code: 3 blocks of 8 tokens"]}
    p = {"lm_eval": {"a": {"acc": 0.25}}, "lm_eval_docs": {"a": {"acc": [1, 0, 0, 0]}},
         "lm_eval_samples": {"a": {"effective": 4}}, "n_documents": {"a": 4}, "lm_eval_versions": {"a": 1},
         "stepwise": None, "seconds": 5.0, "sample_notes": []}
    out = with_tasks(r, p, ["a"])
    assert out["lm_eval_docs"] == {"a": {"acc": [1, 0, 0, 0]}, "b": {"acc": [1]}}
    assert out["n_documents"] == {"a": 4, "b": 1}
    assert out["lm_eval"]["a"] == {"acc": 0.25} and out["lm_eval"]["b"] == {"acc": 0.7}
    assert out["stepwise"] == r["stepwise"] and out["grown"] == {"a": [2, 4]} and out["seconds"] == 15.0
    assert out["sample_notes"] == ["code: 3 blocks of 8 tokens"]  # a's note was about its smaller sample


def test_frontier_trains_each_variant_once_gates_it_and_writes_rows(tiny_data, tiny_base, tmp_path):
    from expertcache.recipes.frontier import run_frontier
    from expertcache.trainer.cache_aware import CacheAwareRecipe

    ov = {"base": str(tiny_base), "out_dir": str(tmp_path / "fr"), "data.corpus": tiny_data["corpus"],
          "data.tokenizer": str(tiny_base), "data.seq_len": 64, "data.batch_size": 4, "data.val_batches": 1,
          "train.max_steps": 2, "train.ckpt_every": 1, "train.val_every": 2, "train.wandb": False,
          "eval.prompt_len": 16, "eval.decode_tokens": 8, "eval.max_seqs": 2, "eval.ppl_blocks": 2,
          "eval.seq_len": 64, "frontier.out": str(tmp_path / "frontier.json"), "frontier.limit": 2,
          "frontier.ppl_blocks": 1, "frontier.seq_len": 32, "frontier.lossy_limit": 1,
          "frontier.lossy_ppl_blocks": 1, "frontier.lossy_seq_len": 16,
          "frontier.tasks": "[ec_ppl_prose,ec_cloze_prose]", "frontier.lossy_tasks": "[ec_cloze_prose]",
          "frontier.reroute": "[base,miss]", "frontier.split": "validation",
          "frontier.lossy_accuracy": "replay"}  # the reroute rows' documents replayed (evals.replay)
    recipe = load_recipe(CacheAwareRecipe, CA_RECIPES / "frontier.yaml", [f"{k}={v}" for k, v in ov.items()] + [
        "frontier.variants={control: [locality.weight=0], miss: [locality.weight=1.0, quality.distill=0.5], "
        "streamed: [locality.weight=1.0, quality.trainable=routers, train.memory_gb=8]}"])
    from expertcache.runtime.engine import train_stream
    from expertcache.trainer.cache_aware.stream import set_streamed_runtime

    set_streamed_runtime(train_stream)  # what the CLI installs for train.memory_gb
    try:
        rows = run_frontier(recipe, log=lambda *a: None)
    finally:
        set_streamed_runtime(None)
    assert [(r["name"], r["serving"]) for r in rows] == [("base", "reroute"), ("control", "plain"),
                                                         ("miss", "plain"), ("miss", "reroute"), ("streamed", "plain")]
    # a streamed variant's run leaves its cache figures out; the frontier measures them on its saved model, once
    streamed = json.loads((tmp_path / "fr" / "streamed" / "result.json").read_text())
    assert streamed["streamed"] and rows[-1]["miss_reduction_1_8"] == streamed["summary"]["capacities"][
        min(streamed["summary"]["capacities"], key=lambda c: streamed["summary"]["capacities"][c]["capacity_frac"])
    ]["lru_miss_reduction"]
    for r in rows:
        assert r["gate"] in ("PASS", "FAIL", "INCONCLUSIVE") and (r["gate"] == "FAIL") == bool(r["failures"])
        # the JSON contract of results/frontier.json (issue #23)
        for key in ("dppl_overall_ci95", "dppl_max_domain_ci95"):
            lo, hi = r[key]
            assert math.isfinite(lo) and lo <= hi
        assert r["dppl_overall_ci95"][0] - 1e-9 <= r["dppl_overall_pct"] <= r["dppl_overall_ci95"][1] + 1e-9
        assert set(r["dacc_ci95"]) == set(r["n_documents"]) == {"ec_cloze_prose"}
        assert all(lo <= hi for lo, hi in r["dacc_ci95"].values())
        assert isinstance(r["n_blocks"], int) and r["n_blocks"] >= 1
        assert r["n_documents"]["ec_cloze_prose"] == (1 if r["serving"] == "reroute" else 2)
        assert math.isfinite(r["dppl_overall_pct"]) and r["dppl_max_domain_pct"] >= r["dppl_overall_pct"] - 1e-9 \
            or len(r["dppl_percent"]) == 2
        assert r["miss_reduction_1_8"] is not None and r["miss_reduction_1_8"] <= 1
        # each row says where it came from (#43): commit, command, and the variant and samples it ran with
        assert r["commit"] and r["command"] == "expertcache train-cache-aware --recipe frontier"
        assert r["config"]["eval"]["limit"] == (1 if r["serving"] == "reroute" else 2)
        assert r["config"]["eval"].get("accuracy") == ("replay" if r["serving"] == "reroute" else None)
        assert r["config"]["variant"] == {"base": [], "control": ["locality.weight=0"],
                                          "miss": ["locality.weight=1.0", "quality.distill=0.5"],
                                          "streamed": ["locality.weight=1.0", "quality.trainable=routers",
                                                       "train.memory_gb=8"]}[r["name"]]
    assert "dppl_vs_control_pct" in rows[2] and abs(rows[1]["dppl_vs_control_pct"]["overall"]) < 1e-9
    assert json.loads((tmp_path / "frontier.json").read_text()) == json.loads(json.dumps(rows))
    from helpers import plotted_pixels

    assert plotted_pixels(tmp_path / "frontier.png") > 50  # the variants' points were drawn, not just axes
    # again: nothing is trained or evaluated twice
    stamp = (tmp_path / "fr" / "miss" / "result.json").stat().st_mtime_ns
    assert run_frontier(recipe, log=lambda *a: None) == rows
    assert (tmp_path / "fr" / "miss" / "result.json").stat().st_mtime_ns == stamp
    # more step-wise blocks for the reroute rows (a gate asked for them): only those blocks are evaluated again, the
    # documents' scores kept (the same tasks and limit); the rows rest on the new blocks
    docs = json.loads((tmp_path / "fr" / "evals" / "miss-reroute.json").read_text())["lm_eval_docs"]
    ov["frontier.lossy_ppl_blocks"] = 2
    more = load_recipe(CacheAwareRecipe, CA_RECIPES / "frontier.yaml", [f"{k}={v}" for k, v in ov.items()] + [
        "frontier.variants={control: [locality.weight=0], miss: [locality.weight=1.0, quality.distill=0.5], "
        "streamed: [locality.weight=1.0, quality.trainable=routers, train.memory_gb=8]}"])
    logged = []
    set_streamed_runtime(train_stream)
    try:
        again = run_frontier(more, log=logged.append)
    finally:
        set_streamed_runtime(None)
    assert sorted(x.split(" [")[0] for x in logged if x.startswith("[frontier] eval")) == [
        "[frontier] eval base-lossy", "[frontier] eval base-lru", "[frontier] eval base-reroute",
        "[frontier] eval miss-reroute"]
    assert sum("the documents' scores kept" in x for x in logged) == 3  # base-lru has no documents: evaluated anew
    fresh = json.loads((tmp_path / "fr" / "evals" / "miss-reroute.json").read_text())
    assert fresh["lm_eval_docs"] == docs and set(fresh["n_blocks"].values()) == {2} and fresh["asked_blocks"] == [2, 16]
    for r, before in zip(again, rows):
        assert r["n_blocks"] == (2 if r["serving"] == "reroute" else before["n_blocks"])
        assert r["n_documents"] == before["n_documents"]
        if r["serving"] == "plain":
            assert r["gate"] == before["gate"] and r["dppl_overall_ci95"] == before["dppl_overall_ci95"]
    typo = load_recipe(CacheAwareRecipe, CA_RECIPES / "frontier.yaml", [
        "frontier.variants={typo: [locality.wieght=1]}", "frontier.reroute=[]", "frontier.control=",
        f"out_dir={tmp_path / 'typo'}"])
    with pytest.raises(RecipeError, match="variant typo: unknown recipe key locality.wieght"):
        run_frontier(typo)
    assert not (tmp_path / "typo").exists()  # refused before anything ran
