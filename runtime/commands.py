"""The runtime's commands: plain typed functions; `expertcache` builds its command line from their signatures and
docstrings (expertcache.recipes.cli). Engine options are one `EngineConfig` everywhere (`--engine.capacity`,
`--engine.tier`, ...). Each returns what it reports (printed as JSON by the CLI, tables on stderr)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

from expertcache.telemetry.atomic import check_output, own_dir
from expertcache.telemetry.errors import InputError
from expertcache.telemetry.provenance import git_commit as _git_commit  # the one lookup, results record it

from expertcache.runtime.engine.config import EngineConfig
from expertcache.runtime.storage.store import STORE_DIR
from expertcache.runtime.storage.weight_checks import INTEGRITY_DEFAULT


def _table(text: str) -> None:
    print("\n" + text, file=sys.stderr)


def bench_decode(model: Optional[str] = None, replay: Optional[str] = None,
                 engine: EngineConfig = EngineConfig(tier="disk"), capacities: list[int | float] = [0.125, 0.25],
                 predictors: Optional[list[str]] = None, dtype: Optional[str] = None, tokens: int = 64,
                 warmup: int = 8, rounds: int = 2, prompts: int = 2, prompt_len: int = 64,
                 corpus: str = "data/corpus", domain: str = "prose", plain: Optional[bool] = None,
                 expert_shape: str = "2048x768", disk_budget_gb: float = 8.0, store_dir: str = STORE_DIR,
                 out: Optional[str] = None) -> dict:
    """TPOT, hit rate, traffic, stall and overlap of the offload engine against plain generate and on-demand
    loading, alternated in one run; or `--replay` a routing trace at real size with random experts.

    Args:
        model: HF checkpoint (live mode)
        replay: replay a trace (.npz or Parquet; 'reference': the Qwen3-30B-A3B code trace shipped in
            telemetry/reference) with random experts of --expert_shape instead of a live model
        engine: the engine options; each of --capacities and --predictors is run on top of them
        capacities: resident experts per layer to compare: fractions of E as floats in (0, 1] (1.0 = all), counts
            as integers (16)
        predictors: live: none, probe:D, lookahead:D, persistence, estimator:FILE, spatio (default
            --engine.predictor, else probe:1); replay: persistence, cooccurrence, oracle[:recall] (default
            --engine.predictor, else those and the oracle at recall 0.25-1)
        dtype: live: compute dtype (default: the checkpoint's own); replay: the store's dtype (default bf16)
        tokens: timed decode tokens per pass (after the warm-up)
        warmup: untimed decode tokens per pass
        rounds: alternated passes per configuration
        prompts: live: held-out prompts per pass
        prompt_len: live: prompt tokens
        corpus: live: prompts from this corpus's test split (absent: fixed random token ids)
        domain: live: the corpus domain of the prompts
        plain: live: also run the plain from_pretrained reference (default: when it fits in half the memory)
        expert_shape: replay: HIDDENxINTERMEDIATE of one expert (Qwen3-30B-A3B: 2048x768)
        disk_budget_gb: replay: store size; sets how many layers are replayed
        store_dir: replay: where the expert store is written (reused)
        out: also write the JSON here (and a PNG beside it for a replay)
    """
    config = dict(locals())  # the resolved configuration, recorded in the result
    from expertcache.telemetry.progress import Progress

    from expertcache.runtime.bench.results import started, write_result

    check_output(out, replay, model)
    engine.check()
    prov = started()  # the code that runs (commit, dirty) and the machine, before it runs
    commit = (prov["commit"] or "") + ("+dirty" if prov["dirty"] else "")  # `git_commit`'s form, one lookup
    if min(tokens, rounds, prompts, prompt_len) < 1 or warmup < 0 or not capacities:
        raise InputError("tokens, rounds, prompts and prompt_len must be >= 1, warmup >= 0, capacities non-empty")
    from expertcache.telemetry.cachesim import capacity_count

    for c in capacities:  # each a fraction or a count, before any pass runs
        capacity_count(c, None)
    if (model is None) == (replay is None):
        raise InputError("bench decode needs exactly one of --model CKPT or --replay TRACE")
    if engine.predictor not in ("none", ""):  # each pass sets its own predictor: --engine.predictor is one of them
        if predictors:
            raise InputError(f"--engine.predictor {engine.predictor} and --predictors {predictors} both given: bench "
                             f"decode runs each of --predictors; name it there")
        predictors = [engine.predictor]
    if replay is not None:
        from expertcache.runtime.bench.replay import REFERENCE_TRACE, plot_recall, replay_benchmark, table
        from expertcache.runtime.engine.trace_predictors import REPLAY_DEFAULTS, check_replay_predictor

        preds = [p for p in (predictors or []) if p != "none"] or list(REPLAY_DEFAULTS)
        for p in preds:
            check_replay_predictor(p)
        own_dir(store_dir, "bench decode", legacy=_store_folder)  # never a folder of anything but its stores
        with Progress() as prog:
            task = prog.add_task("replay passes", total=rounds * (2 + len(preds)))
            res = replay_benchmark(REFERENCE_TRACE if replay == "reference" else replay, expert_shape,
                                   dtype or "bf16", dataclasses.replace(engine, capacity=capacities[0]), preds,
                                   tokens, warmup, rounds, disk_budget_gb, store_dir,
                                   progress=lambda: prog.advance(task))
    else:
        import numpy as np
        import torch

        from expertcache.telemetry.corpus import packed_blocks

        from expertcache.runtime.bench.bench import bench_decode as run, table
        from expertcache.runtime.engine.predictors import check_predictor_spec

        preds = predictors or ["probe:1"]
        for p in preds:  # every name before the first pass runs (and before the prompts are read)
            check_predictor_spec(p)
        if Path(corpus).is_dir():
            blocks = packed_blocks(corpus, model, "test", domain, prompt_len)
            if not len(blocks):
                raise InputError(f"no {domain} test text in {corpus} long enough for --prompt_len {prompt_len}")
            idx = np.linspace(0, len(blocks) - 1, prompts).astype(int)
            ids = torch.from_numpy(blocks[idx].astype(np.int64))
        else:  # a checkpoint of its own, no corpus here: fixed random token ids (timing does not need text)
            from expertcache.telemetry.hf import load_config

            from expertcache.runtime.storage.loader import resolve

            vocab = load_config(resolve(model)).get_text_config().vocab_size
            ids = torch.randint(0, vocab, (prompts, prompt_len), generator=torch.Generator().manual_seed(0))
        with Progress() as prog:
            task = prog.add_task("decode passes", total=rounds * (2 + len(capacities) * (1 + len(preds))))
            res = run(model, ids, engine, capacities, preds, tokens, warmup, rounds, dtype=dtype,
                      plain=plain, progress=lambda: prog.advance(task))
    res["git_commit"] = commit
    if out:
        from expertcache.runtime.bench.results import command_line

        res = write_result(out, res, config, command_line("bench decode", bench_decode, config), provenance=prov,
                           read_GBps=res.get("tier_bandwidth_GBps"))
        if replay is not None:
            plot_recall(res, Path(out).with_suffix(".png"))
    _table(table(res))
    return res


def _store_folder(p: Path) -> bool:
    """The replay's stores from before output markers: nothing but `replay-*.store` files (and their config)."""
    return all(f.is_file() and (f.name.startswith("replay-") or f.suffix == ".yaml") for f in p.iterdir())


def _step(prog, task, n: int, what: str | None) -> None:
    """bench big's progress: `n` checkpoint layers written, or (0) one run ended, `what` saying which and how."""
    prog.update(task, advance=n or 1, **({"description": f"bench big: {what}"} if what else {}))


def bench_big(out_dir: str = "runs/bench-big", trace: Optional[str] = None, budget_gb: float = 8.0,
              tokens: int = 64, warmup: int = 8, accelerate_tokens: int = 8, accelerate_warmup: int = 2,
              prompt_len: int = 8, rounds: int = 3,
              systems: list[str] = ["expertcache:on-demand", "expertcache:prefetch", "accelerate", "mmap",
                                    "mmap:unbounded"],
              layers: Optional[int] = None, ram_factor: float = 1.25,
              engine: EngineConfig = EngineConfig(tier="disk"),
              experts: list[str] = ["bf16"], routing: str = "trace", cgroup: bool = True,
              keep_gguf: bool = False, llamacpp_dir: Optional[str] = None, quant_linears: bool = False,
              prefill: list[int] = [], decode: bool = True, llamacpp_build: bool = True, checkpoint: str = "bf16",
              out: Optional[str] = "results/bench_big.json") -> dict:
    """A Qwen3-30B-A3B-shaped checkpoint larger than RAM, decoded by expertcache (disk tier, cache within the
    budget), transformers + accelerate disk offload and the page cache (mmap), on the same routing, alternated,
    each inside one memory cgroup of the budget (as root; `mmap:unbounded` outside it: the page cache a user gets
    by default). Each expertcache row reports its time budget per token (expert compute, stall, other compute,
    overhead), its reads' bandwidth while in flight beside the disk's measured limits, and its roofline (the
    token with reads fully overlapped).

    Args:
        out_dir: where the checkpoint is written (reused) and the logs go
        trace: routing trace (default: the reference Qwen3-30B-A3B code trace)
        budget_gb: memory budget (GiB) for expertcache and accelerate
        tokens: timed decode tokens (after the warm-up)
        warmup: untimed decode tokens
        accelerate_tokens: accelerate reads every offloaded layer per token (seconds each): fewer timed tokens
        accelerate_warmup: untimed tokens for accelerate
        prompt_len: prompt tokens
        rounds: alternated runs per system (a ratio is claimed only where the round medians do not overlap)
        systems: which systems run: expertcache:on-demand, expertcache:prefetch, accelerate, mmap (in the
            cgroup), mmap:unbounded, llama.cpp (in the cgroup), llama.cpp:no-repack (in the cgroup, its weights
            left in the mapped file: `--repack 0`), llama.cpp:unbounded (llama.cpp only with
            --routing native: it is built from the PyPI sdist's source and the checkpoint converted to a BF16
            GGUF the first time, which takes tens of minutes and as much disk as the checkpoint; accelerate writes
            a converted copy of what the budget leaves out, deleted when done. Either is skipped, with the reason
            in the JSON, when the disk cannot hold it), vllm (in the cgroup), vllm:unbounded (vLLM's CPU build,
            --routing native, from its own venv, which `python scripts/vllm_peer.py --build_only` makes once;
            it loads every weight before it runs, so it is skipped, saying so, where the checkpoint does not fit
            in the memory it would have: e.g. with --layers 4). An expertcache
            system may add engine options after slashes, over --engine's, to compare configurations in one
            alternated run: e.g. [expertcache:on-demand,expertcache:on-demand/victims=false]
        layers: MoE layers (default: experts >= ram_factor x RAM)
        ram_factor: size of the experts against this machine's RAM
        engine: how expertcache serves (tier, workers, policy, prefetch guard, ...; its capacity is what
            --budget_gb leaves after the non-expert weights). --engine.predictor is the expertcache:prefetch
            row's predictor (default: co-occurrence fitted on the trace; probe:1 with --routing native); with
            --routing trace it may be one of the trace's own: cooccurrence, or oracle[:recall] (the trace's true
            next experts: the limit of prefetching on this disk, marked not realisable in the JSON), e.g.
            [expertcache:on-demand,expertcache:prefetch,expertcache:prefetch/predictor=oracle]
        experts: the formats expertcache serves, each against the same budget: bf16 (the checkpoint) | int8 |
            int4 (`expertcache quantize` copies, group 32, written beside the checkpoint once); e.g. [bf16,int4]
        quant_linears: the int8/int4 copies pack the non-expert linear layers too (attention, the output head;
            `quantize --linears true`), as llama.cpp's Q8_0/Q4_0 files do (a copy of its own, beside the other)
        routing: trace (every router's choice replaced by --trace's, so every system sees real locality) |
            native (the checkpoint's own random routers; expertcache:prefetch then probes the next router)
        cgroup: run every system but mmap:unbounded inside one memory cgroup of --budget_gb (root only; without
            root everything runs unbounded and the JSON says so)
        keep_gguf: keep llama.cpp's GGUF copy of the checkpoint (beside it in --out_dir) when done
        llamacpp_dir: where llama.cpp's source is downloaded and built (default: $EXPERTCACHE_LLAMACPP or
            ~/.cache/expertcache/llamacpp)
        prefill: prompt lengths of a prefill phase (default none), e.g. [512,2048]: per system and length, one
            cold prefill per round (the page cache dropped, its own process, alternated like the decode rounds):
            prompt tokens/s, time to first token and bytes read; llama.cpp's is `llama-bench -p N -n 0`. Then one
            prefill per length with every expert resident (when they fit in memory): the roofline
            (`roofline_tokens_per_s`, the larger of the reads at the disk's measured bandwidth and that compute)
        decode: run the decode rounds (false: the prefill phase alone)
        llamacpp_build: build llama.cpp when it is not built (10-30 minutes of every core); false: its systems are
            skipped, saying so
        checkpoint: bf16 (random bf16 weights in safetensors; int8/int4 copies quantized from it) | q4_0 (no bf16
            copy: a llama.cpp Q4_0 GGUF of the same random draws written directly, about 17 GB at 48 layers where
            bf16 takes 58, and imported by `import-gguf` as the int4 checkpoint expertcache reads: llama.cpp and
            expertcache serve the same codes and scales). q4_0 takes --experts [int4] --quant_linears true and the
            expertcache and llama.cpp systems only
        out: the JSON (a PNG beside it when decode runs)
    """
    config = dict(locals())  # the resolved configuration, recorded in the result
    from expertcache.telemetry.progress import Progress

    from expertcache.runtime.bench.bigbench import ROUTINGS, bench_big as run, check_checkpoint, check_systems, \
        plot, table
    from expertcache.runtime.bench.results import started, write_result

    if routing not in ROUTINGS:
        raise InputError(f"--routing {routing!r}; expected one of: {', '.join(ROUTINGS)}")

    if not experts or any(f not in ("bf16", "int8", "int4") for f in experts) or len(set(experts)) < len(experts):
        raise InputError(f"--experts {experts}: expected distinct formats among bf16, int8, int4")

    check_output(out)
    engine.check()
    prov = started()  # the code that runs (commit, dirty) and the machine, before it runs
    commit = (prov["commit"] or "") + ("+dirty" if prov["dirty"] else "")  # `git_commit`'s form, one lookup
    check_systems(systems, engine, routing)  # known, with valid options and predictors, runnable under --routing
    check_checkpoint(checkpoint, experts, quant_linears, systems)  # before the checkpoint is written
    import math

    if not (math.isfinite(budget_gb) and budget_gb > 0 and math.isfinite(ram_factor) and ram_factor > 0) \
            or min(tokens, rounds, prompt_len, accelerate_tokens) < 1 or min(warmup, accelerate_warmup) < 0:
        raise InputError("budget_gb and ram_factor must be finite and > 0; tokens, accelerate_tokens, rounds, "
                         "prompt_len >= 1; warmup, accelerate_warmup >= 0")
    if layers is not None and layers < 2:
        raise InputError(f"--layers {layers}: expected at least 2 MoE layers")
    from expertcache.runtime.bench.bigckpt import big_config

    positions = big_config(2).max_position_embeddings  # the checkpoint's context (the same at every depth)
    longest = prompt_len + max(warmup + tokens, accelerate_warmup + accelerate_tokens)
    if longest > positions:  # before the checkpoint (tens of GB) is written, not as a traceback in its first run
        raise InputError(f"--prompt_len {prompt_len} + warm-up and timed tokens ({longest} positions) exceeds the "
                         f"checkpoint's context of {positions} positions")
    bad = [n for n in prefill if not 1 <= n <= positions]
    if bad or len(set(prefill)) < len(prefill):  # a prefill's prompt fills its positions; its first token needs none
        raise InputError(f"--prefill {list(prefill)}: expected distinct prompt lengths from 1 to the checkpoint's "
                         f"context of {positions} positions" + (f" ({bad[0]} is not)" if bad else ""))
    if not decode and not prefill:
        raise InputError("--decode false and no --prefill lengths: nothing to run")
    if trace is not None:  # read before the (large) checkpoint is written, not after
        from expertcache.telemetry.routing import load_routing
        from expertcache.runtime.bench.bigbench import TRACE_START

        n_trace = load_routing(trace).ids.shape[1]
        if routing == "trace" and prefill and TRACE_START + max(prefill) > n_trace:  # a prompt's token p routes as
            raise InputError(f"--prefill {list(prefill)}: a prompt of {max(prefill)} tokens routes by trace tokens "
                             f"{TRACE_START} to {TRACE_START + max(prefill) - 1} and --trace {trace} has "
                             f"{n_trace}")  # the trace's token TRACE_START + p
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise InputError(f"--out_dir {out_dir} is a file; expected a folder")
    # the checkpoint (tens of GB) is written into it once and reused: never into a folder of anything else
    own_dir(out_dir, "bench big", legacy=lambda p: (p / "qwen3-30b-a3b-shaped").is_dir())
    with Progress() as prog:
        task = prog.add_task("bench big: checkpoint layers, then runs", total=None)
        res = run(out_dir, trace, budget_gb, tokens, warmup, prompt_len, rounds, systems, ram_factor, layers,
                  accelerate_tokens, accelerate_warmup, engine,
                  progress=lambda n, what=None: _step(prog, task, n, what),
                  experts=tuple(experts), routing=routing, cgroup=cgroup, keep_gguf=keep_gguf,
                  llamacpp_dir=llamacpp_dir, quant_linears=quant_linears, prefill=tuple(prefill), decode=decode,
                  llamacpp_build=llamacpp_build, checkpoint=checkpoint)
    res["git_commit"] = commit
    failed = {sys_: r.get("errors", []) + [f"prefill {p['prompt_tokens']}: {e}" for p in r.get("prefill", [])
                                           for e in p.get("errors", [])]
              for sys_, r in res["systems"].items()}  # a decode round or a prefill that failed, each
    failed = {k: v for k, v in failed.items() if v}
    # a system asked for that failed or was skipped makes the run exit 1 (its reason stays in the JSON)
    res["ok"] = not failed and not res.get("skipped")
    if out:
        bw = [r["read_bandwidth"]["at_queue_depth_GBps"] for r in res["systems"].values() if r.get("read_bandwidth")]
        bw += [p["read_bandwidth_GBps"] for r in res["systems"].values() for p in r.get("prefill", [])
               if p.get("read_bandwidth_GBps")]
        from expertcache.runtime.bench.results import command_line

        res = write_result(out, res, config, command_line("bench big", bench_big, config), provenance=prov,
                           read_GBps=max(bw) if bw else None)
        if decode:
            plot(res, Path(out).with_suffix(".png"))
    if decode:
        _table(table(res))
    if prefill:
        from expertcache.runtime.bench.bigprefill import table as prefill_table

        _table(prefill_table(res))
    for sys_, why in res.get("skipped", {}).items():
        print(f"bench big: skipped {sys_}: {why}", file=sys.stderr)
    if failed:
        print(f"bench big: {len(failed)} system(s) failed: " + "; ".join(f"{k}: {v[0]}" for k, v in failed.items()),
              file=sys.stderr)
    return res


def simulate(trace: str, hardware: str, model_shape: str = "qwen3-30b-a3b",
             capacities: list[int | float] = [0.125, 0.25], policy: str = "lru", layers: Optional[str] = None,
             tokens: Optional[str] = None,
             moe_layers: Optional[int] = None, link_gbps: Optional[float] = None,
             compute_ms: Optional[float] = None) -> list[dict]:
    """Project TPOT on named hardware from a trace's hit rates and a bandwidth model.

    Args:
        trace: .npz reference trace or Parquet trace
        hardware: h100-pcie5 | 4gpu-cxl3 | consumer-8gb-nvme | this-machine (needs --link_gbps)
        model_shape: qwen3-30b-a3b | base-tiny
        capacities: resident experts per layer: fractions of E as floats in (0, 1] (1.0 = all), counts as
            integers (16)
        policy: cache policy of the simulated cache (lru | lfu | static | belady)
        layers: LO:HI trace layers to use (default: all)
        tokens: LO:HI trace tokens to use (default: all)
        moe_layers: override the shape's MoE layer count
        link_gbps: this-machine: the measured tier bandwidth (GB/s)
        compute_ms: a measured T_compute per token (overrides the bandwidth model's)
    """
    import math

    from expertcache.runtime.bench.bandwidth import HARDWARE, MODEL_SHAPES, Hardware, project
    from expertcache.telemetry.routing import load_routing

    def span(s: Optional[str], n: int, what: str) -> slice:
        if s is None:
            return slice(0, n)
        try:
            lo, hi = (int(x) for x in s.split(":"))
        except ValueError:
            raise InputError(f"--{what} {s!r}: expected LO:HI (two integers)") from None
        if not 0 <= lo < hi <= n:
            raise InputError(f"--{what} {s}: expected 0 <= LO < HI <= {n}")
        return slice(lo, hi)

    if model_shape not in MODEL_SHAPES:
        raise InputError(f"unknown model shape {model_shape!r}; known: {', '.join(MODEL_SHAPES)}")
    for name, v in (("link_gbps", link_gbps), ("compute_ms", compute_ms)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise InputError(f"--{name} {v}: expected a finite number > 0")
    r = load_routing(trace)
    ids, e = r.ids, r.num_experts
    ids = ids[span(layers, ids.shape[0], "layers")]
    ids = ids[:, span(tokens, ids.shape[1], "tokens")]
    shape = MODEL_SHAPES[model_shape]
    if moe_layers:
        shape = dataclasses.replace(shape, moe_layers=moe_layers)
    if hardware == "this-machine":
        if not link_gbps:
            raise InputError("--hardware this-machine needs --link_gbps (measured, e.g. by the replay benchmark)")
        hw = Hardware("this-machine", link_gbps, 1.0, 1e9, 0.0, "bandwidths as measured on this machine")
    elif hardware in HARDWARE:
        hw = HARDWARE[hardware]
    else:
        raise InputError(f"unknown hardware {hardware!r}; known: {', '.join(HARDWARE)}, this-machine")
    if e != shape.num_experts:
        raise InputError(f"trace has {e} experts per layer, model shape {shape.name} has {shape.num_experts}")
    rows = [project(ids, hw, shape, c, policy, compute_ms / 1e3 if compute_ms else None) for c in capacities]
    lines = ["| capacity | hit | MB/token | T_compute ms | T_transfer ms | on-demand ms | perfect overlap ms |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['capacity']} ({r['capacity_frac']:.3g} E) | {r['hit_rate']:.3f} | "
              f"{r['traffic_bytes_per_token'] / 1e6:.1f} | {1e3 * r['t_compute_s']:.2f} | "
              f"{1e3 * r['t_transfer_s']:.2f} | {1e3 * r['tpot_on_demand_s']:.2f} | "
              f"{1e3 * r['tpot_perfect_overlap_s']:.2f} |" for r in rows]
    _table("\n".join(lines))
    return rows


def fit_predictor(trace: str, out: str, ridge: float = 1.0) -> dict:
    """Fit the ridge estimator (layer L's hidden state -> layer L+1's experts) on a trace recorded with --hidden.

    Args:
        trace: Parquet trace with hidden states (`trace record --hidden true`)
        out: safetensors file to write; use it as `--engine.predictor estimator:FILE`
        ridge: ridge regularisation (> 0)
    """
    import math

    from expertcache.telemetry.parquet_trace import read_meta

    from expertcache.runtime.engine.predictors import EstimatorPredictor

    if not (math.isfinite(ridge) and ridge > 0):
        raise InputError(f"--ridge {ridge}: expected a finite number > 0")
    check_output(out, trace)
    est = EstimatorPredictor.fit(trace, ridge)
    est.save(out, read_meta(trace).__dict__)
    return {"estimator": out, "layers": int(est.w.shape[0]) + 1, "hidden": int(est.w.shape[1]),
            "experts": int(est.w.shape[2]), "trace": trace}


def _talk_model(model: Optional[str], engine: EngineConfig, dtype: Optional[str], plain: bool):
    """(model, tokenizer, path) for generate/serve: --model or the quickstart's checkpoint."""
    from expertcache.runtime.storage.loader import load_model, resolve_model_arg

    path = resolve_model_arg(model)
    engine.check()
    m, tok = load_model(path, engine, dtype, plain=plain)
    return m, tok, path


def generate(prompt: Optional[str] = None, model: Optional[str] = None,
             engine: EngineConfig = EngineConfig(), dtype: Optional[str] = None,
             plain: bool = False, chat: bool = False, raw: bool = False, max_tokens: int = 128,
             temperature: Optional[float] = None, top_p: Optional[float] = None, stop: list[str] = [],
             seed: Optional[int] = None, top_k: Optional[int] = None, min_p: float = 0.0,
             repetition_penalty: Optional[float] = None, prompts: Optional[str] = None, field: str = "text",
             max_batch: int = 8) -> int:
    """Stream a completion to the terminal through the offload engine, then tokens/s, hit rate and bytes moved.

    With --prompts FILE, every prompt of the file is decoded, up to --max_batch together (continuous batching:
    one forward per step for the whole batch), and each result printed as a JSON line as it finishes.

    Args:
        prompt: the prompt (with --chat: an optional system message)
        model: checkpoint directory or cached hub id (default: the quickstart's runs/ca-starter/model)
        engine: how the experts are served
        dtype: auto (the checkpoint's) | bf16 | fp16 | fp32
        plain: no engine: plain from_pretrained, every expert in memory (the reference)
        chat: interactive chat loop (an empty line or /exit ends it)
        raw: the prompt as is, without the tokenizer's chat template
        max_tokens: new tokens at most
        temperature: sampling temperature (0: greedy; default: the checkpoint's generation_config, else 0.8)
        top_p: nucleus sampling mass (default: the checkpoint's, else 0.95)
        stop: stop strings
        seed: sampling seed
        top_k: sample from the k most likely tokens only (0: off; default: the checkpoint's, else off)
        min_p: drop tokens under min_p x the most likely one's probability (0: off)
        repetition_penalty: > 1 discourages tokens already in the prompt or the output (default: the
            checkpoint's, else 1: off)
        prompts: a file of prompts (text: one per line; .jsonl: the string under --field), decoded as a batch
        field: the JSONL field holding each prompt
        max_batch: sequences decoded together with --prompts
    """
    from expertcache.runtime.serve.generate import generate_text
    from expertcache.runtime.serve.request import SamplingParams, checkpoint_sampling

    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty}
    fallback = {"temperature": 0.8, "top_p": 0.95, "top_k": 0, "repetition_penalty": 1.0}
    SamplingParams(max_tokens=max_tokens, stop=stop, seed=seed, min_p=min_p,  # flags checked before the load
                   **{k: v if v is not None else fallback[k] for k, v in given.items()}).check()
    batch_prompts = None
    if prompts is not None:
        from expertcache.telemetry.recorder import read_prompts

        if prompt is not None or chat:
            raise InputError("--prompts decodes a file of prompts: give it without a prompt and without --chat")
        if max_batch < 1:
            raise InputError(f"--max_batch {max_batch}: expected >= 1")
        batch_prompts = read_prompts(prompts, field)
    m, tok, _ = _talk_model(model, engine, dtype, plain)
    ck = checkpoint_sampling(m)
    params = SamplingParams(max_tokens=max_tokens, stop=stop, seed=seed, min_p=min_p,
                            **{k: v if v is not None else ck.get(k, fallback[k]) for k, v in given.items()})
    params.top_k = int(params.top_k)
    params.check()
    if batch_prompts is not None:
        return _generate_file(m, tok, batch_prompts, params, max_batch, raw)
    return generate_text(m, tok, prompt, params, chat=chat, raw=raw)


def _generate_file(m, tok, prompts: list[str], params, max_batch: int, raw: bool) -> int:
    import json

    from expertcache.runtime.serve.generate import generate_many
    from expertcache.runtime.serve.request import user_prompt

    turns = [user_prompt(tok, p, raw) for p in prompts]  # (text, templated): the same templating for every prompt
    texts, templated = [t for t, _ in turns], turns[0][1]

    def done(i, g):
        print(json.dumps({"index": i, "prompt": prompts[i], "text": g.text, "finish_reason": g.finish_reason,
                          "prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens}), flush=True)
    gens, wall = generate_many(m, tok, texts, params, max_batch, templated, on_done=done)
    n = sum(g.completion_tokens for g in gens)
    eng = getattr(m, "expertcache", None)
    extra = f", hit rate {eng.stats.counters().hit_rate:.2f}" if eng is not None and eng.stats.accesses else ""
    print(f"[{len(gens)} prompts, {n} tokens in {wall:.2f} s: {n / wall:.1f} tok/s overall, up to {max_batch} "
          f"decoded together{extra}]", file=sys.stderr)
    return 0


def serve(model: Optional[str] = None, engine: EngineConfig = EngineConfig(),
          dtype: Optional[str] = None, plain: bool = False, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: Optional[str] = None, log_level: str = "info", max_batch: int = 8,
          kv_cache_gb: float = 1.0, api_key: Optional[str] = None, chat_template: Optional[str] = None,
          trace: Optional[str] = None, trace_rotate_tokens: int = 50_000, prompt_cache: bool = True,
          prefill_chunk: int = 256) -> int:
    """OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).

    Concurrent requests are batched continuously: each joins the running batch after its prefill and leaves it
    when done; every decode step is one forward for the whole batch. lm-eval scores against it with
    `lm_eval --model local-completions --model_args base_url=http://127.0.0.1:8000/v1/completions,model=NAME,
    tokenizer=MODEL_DIR,tokenizer_backend=huggingface`.

    Args:
        model: checkpoint directory or cached hub id (default: the quickstart's runs/ca-starter/model)
        engine: how the experts are served
        dtype: auto (the checkpoint's) | bf16 | fp16 | fp32
        plain: no engine: plain from_pretrained, every expert in memory (the reference)
        host: bind address (default: this machine only)
        port: TCP port
        served_model_name: the model id clients send (default: --model)
        log_level: uvicorn log level
        max_batch: the most sequences decoded together (1: one at a time); more wait in a FIFO queue
        kv_cache_gb: the KV cache bound (GiB) of the running batch and the prompt cache together: a request
            whose KV would pass it waits; the prompt cache holds what the batch leaves (least recently used evicted)
        api_key: require `Authorization: Bearer <key>` on /v1 (default: $EXPERTCACHE_API_KEY, else none)
        chat_template: a Jinja chat template file for /v1/chat/completions, in place of the tokenizer's
        trace: record the routing of every request (prefill and decode) into rotating Parquet traces in this
            folder (trace-000001.parquet, ...; each with a .requests.json naming the requests), readable by
            `analyze`, `fit-policy` and `train-cache-aware`; never holds a request (rows are dropped and counted
            in /metrics when the writer falls behind)
        trace_rotate_tokens: tokens per trace file
        prompt_cache: keep the KV of earlier prompts and finished sequences; a prompt starts from its longest
            cached prefix (a chat's next turn prefills only the new turn); greedy tokens are the same without it
        prefill_chunk: the most prompt tokens per prefill forward (1 .. the model's context); a long prompt is
            prefilled chunk by chunk between the running batch's decode steps, each chunk (while sequences decode)
            sized to take about one decode step
    """
    import os

    from expertcache.runtime.serve.request import check_chat_template
    from expertcache.runtime.serve.serve import check_api_key, serve as run

    if not 0 < port < 65536:
        raise InputError(f"--port {port}: expected 1..65535")
    if max_batch < 1:
        raise InputError(f"--max_batch {max_batch}: expected >= 1")
    from expertcache.runtime.serve.serve import check_kv_cache_gb, check_prefill_chunk

    check_kv_cache_gb(kv_cache_gb)
    check_prefill_chunk(prefill_chunk, None)
    template = None
    if chat_template is not None:
        try:
            template = Path(chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"--chat_template {chat_template}: cannot read it ({e.__class__.__name__})") from None
        if "{%" not in template and "{{" not in template:
            raise InputError(f"--chat_template {chat_template} has no Jinja tags: not a chat template")
    check_api_key(api_key)  # an empty one would serve without authentication
    api_key = api_key or os.environ.get("EXPERTCACHE_API_KEY") or None
    if trace is not None:
        from expertcache.telemetry.live_trace import check_trace_dir

        check_trace_dir(trace)  # before the model loads: an unwritable place is a one-line error now
        if trace_rotate_tokens < 1:
            raise InputError(f"--trace_rotate_tokens {trace_rotate_tokens}: expected >= 1")
    _check_serve_template(model, template, chat_template)  # before the model loads: every chat request needs it
    _check_serve_context(model, prefill_chunk)
    m, tok, path = _talk_model(model, engine, dtype, plain)
    eng = getattr(m, "expertcache", None)
    if eng is not None:
        d = eng.describe()
        print(f"serve: {eng.capacity}/{eng.adapter.num_experts} experts resident per layer, tier {d['tier']}"
              + (f" ({d['tier_choice']})" if d.get("tier_choice") else ""), file=sys.stderr)
    if eng is not None and eng.integrity().startswith("unverified"):  # also in /health
        print(f"serve: {path} is {eng.integrity()}", file=sys.stderr)
    if template is not None:
        tok.chat_template = template
    run(m, tok, served_model_name or str(path), host, port, log_level, max_batch=max_batch, kv_cache_gb=kv_cache_gb,
        api_key=api_key, trace_dir=trace, trace_rotate_tokens=trace_rotate_tokens, prompt_cache=prompt_cache,
        prefill_chunk=prefill_chunk)
    return 0


def _check_serve_context(model: Optional[str], prefill_chunk: int) -> None:
    """--prefill_chunk within the checkpoint's positions, from its config, before the model loads."""
    from expertcache.runtime.serve.serve import check_prefill_chunk
    from expertcache.runtime.storage.loader import resolve, resolve_model_arg
    from expertcache.telemetry.hf import context_length, load_config

    path = resolve(resolve_model_arg(model))
    if (path / "config.json").is_file():  # (none: the loader's one line says so)
        check_prefill_chunk(prefill_chunk, context_length(load_config(path)))




def _check_serve_template(model: Optional[str], template: Optional[str], template_file: Optional[str]) -> None:
    """The chat template serve will use (--chat_template's, else the tokenizer's) renders a sample conversation;
    only the tokenizer is read."""
    from expertcache.telemetry.hf import load_tokenizer

    from expertcache.runtime.storage.loader import resolve, resolve_model_arg
    from expertcache.runtime.serve.request import check_chat_template

    path = resolve(resolve_model_arg(model))
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return  # no tokenizer: the loader's one line says so
    tok = load_tokenizer(path)
    if template is not None:
        tok.chat_template = template
    check_chat_template(tok, f"--chat_template {template_file}" if template is not None
                        else f"{path}'s chat template")


def verify(model: str, write_index: bool = True, rebless: bool = False) -> dict:
    """Check every routed expert's bytes against its checksum reference, every weight's finiteness and each
    tensor's magnitude against its siblings; the verdict on stderr, the report as JSON; exit 0 when ok (or
    unverified: no reference existed and the checks that need none passed), 1 on damage or an index that cannot
    be used without --rebless, 2 on bad input.

    Args:
        model: a checkpoint directory (safetensors) or an expert store file
        write_index: record the checkpoint's first checksum index (<dir>/.expertcache-checksums.json, or in the
            user cache folder when <dir> is not writable) when it has none and nothing failed; reads through
            `load` then check against it
        rebless: record the current bytes as the reference in place of an index that disagrees with them, is
            unreadable or was made for another layout (only when the change is yours: a re-saved checkpoint)
    """
    from expertcache.telemetry.progress import Progress

    from expertcache.runtime.storage.verify import verdict_line
    from expertcache.runtime.storage.verify import verify as run

    with Progress(transient=True) as prog:
        task = prog.add_task("experts checked", total=None)
        rep = run(model, write_index=write_index, rebless=rebless,
                  progress=lambda n=1: prog.advance(task, n))
    print(verdict_line(rep), file=sys.stderr)
    return rep


def quantize(model: str, bits: int = 8, group_size: int = 32, out: str = "", linears: bool = False,
             by_usage: str | None = None, hot_bits: int = 8, hot_group_size: int = 32,
             max_bytes_ratio: float = 0.35, symmetric: bool = False, overwrite: bool = False,
             integrity: str = INTEGRITY_DEFAULT) -> dict:
    """Write a checkpoint whose routed experts are packed integers with fp16 group scales (int8: symmetric; int4:
    min-max with a minimum per group, or with --symmetric true one scale only, llama.cpp's Q4_0 layout), each
    expert one contiguous 4 KiB-aligned block of an expert store beside the non-expert weights (unchanged, or with
    `--linears true` their linear layers packed the same way);
    `load`, `generate`, `serve`, `eval` and `bench` read it as they read any checkpoint, and the engine's slots hold
    the packed bytes (a byte budget holds 2-4x more experts). Prints the report as JSON: bytes against the
    original and each MoE layer's (and packed linear's) relative weight error.

    Args:
        model: the checkpoint directory to quantize (bf16/fp16/fp32 SwiGLU experts)
        bits: 8 or 4
        group_size: inputs sharing one scale: 32 or a multiple of 64 dividing the experts' input sizes (32 is the most
            accurate; 128 the smallest)
        out: the folder to write (written whole, or not at all)
        linears: pack the non-expert linear layers too (attention, dense and shared MLPs, an untied output head;
            never the routers), as llama.cpp's Q8_0/Q4_0 files do: decode reads a quarter (int4) or half (int8)
            of their bytes, at an accuracy cost the gate prices
        by_usage: a routing trace of this model (`expertcache trace record --split train`): precision per expert
            from telemetry. The most used experts are written at --hot_bits/--hot_group_size, the rest at
            --bits/--group_size, as many hot as fit --max_bytes_ratio of the experts' bf16 bytes (one store file per
            format; the engine's slots take the larger format's size). Record the trace on other text than you
            evaluate on
        hot_bits: with --by_usage, the bits of the most used experts (8 or 4)
        hot_group_size: with --by_usage, their group size
        max_bytes_ratio: with --by_usage, every expert's bytes together, as a fraction of the experts in bf16
        symmetric: int4 without a minimum per group: w = s (q - 8), llama.cpp's Q4_0 layout at group 32. 0.5625
            bytes per weight at group 32 instead of 0.625 (a tenth fewer bytes to read per token), for a larger
            weight error than min-max; price it with `expertcache gate`
        overwrite: replace an earlier `quantize` output in --out (a folder of anything else is never written)
        integrity: on (the weights read, and the folder written before it is published, pass `verify`'s
            reference-free checks: finite, no tensor over 1000x its siblings' magnitude; a failure is refused naming
            the tensor and nothing is written) | off
    """
    from expertcache.telemetry.progress import Progress

    from expertcache.runtime.kernels.quant_write import write_quantized

    if not out:
        raise InputError("--out is required: the folder the quantized checkpoint is written to")
    check_output(out, model, by_usage, folder=True, command="quantize", overwrite=overwrite)
    with Progress(transient=True) as prog:
        task = prog.add_task("MoE layers quantized", total=None)
        rep = write_quantized(model, out, bits, group_size, progress=lambda: prog.advance(task), linears=linears,
                              by_usage=by_usage, hot=(hot_bits, hot_group_size), max_bytes_ratio=max_bytes_ratio,
                              symmetric=symmetric, overwrite=overwrite,
                              integrity=integrity)
    worst = max(max(v) for v in rep["relative_error"].values())
    lin = rep["linears"]
    if linears:
        worst_lin = max(lin["relative_error"].values(), default=0.0)
        print(f"quantize: {len(lin['modules'])} non-expert linears packed ({lin['bytes'] / 2**20:.1f} MiB; worst "
              f"relative error {worst_lin:.4f})" + (f"; kept: {'; '.join(lin['skipped'])}" if lin["skipped"] else ""),
              file=sys.stderr)
    if by_usage:
        u, (hi, lo) = rep["by_usage"], rep["formats"]
        print(f"quantize: by usage ({u['tokens']} tokens of {by_usage}): {hi['experts']} most used experts at "
              f"{_int_name(hi['bits'], symmetric)} (group {hi['group_size']}), serving "
              f"{100 * u['hot_share_of_routing']:.1f}% of the trace's routing; {lo['experts']} at "
              f"{_int_name(lo['bits'], symmetric)} (group {lo['group_size']})", file=sys.stderr)
        print(f"quantize: {rep['experts']} experts, mixed precision: {rep['expert_bytes'] / 2**30:.3f} GiB, "
              f"{rep['bf16_bytes_ratio']:.3f}x their bf16 bytes; worst layer relative error {worst:.4f}; -> {out}",
              file=sys.stderr)
        return rep
    print(f"quantize: {rep['experts']} experts to {_int_name(bits, symmetric)} (group {group_size}): "
          f"{rep['expert_bytes'] / 2**30:.2f} "
          f"GiB, {rep['bytes_ratio']:.3f}x the original's expert bytes; worst layer relative error {worst:.4f}; "
          f"-> {out}", file=sys.stderr)
    return rep


def _int_name(bits: int, symmetric: bool) -> str:
    """A format as the quantize summary names it: int8, int4, int4 symmetric."""
    return f"int{bits}" + (" symmetric" if bits == 4 and symmetric else "")


def import_gguf(gguf: str, out: str = "", requantize: str = "", overwrite: bool = False,
                integrity: str = INTEGRITY_DEFAULT) -> dict:
    """Turn a llama.cpp GGUF file (Qwen3-MoE, OLMoE, or Mixtral: llama.cpp's `llama` architecture with experts) into
    an expertcache checkpoint that every command reads. Experts in
    Q8_0 or Q4_0 are repacked without rounding into the int8 / int4 (group 32) store `expertcache quantize` writes,
    so the engine caches and moves the bytes llama.cpp would; BF16/F16/F32 experts become a bf16 checkpoint. The
    attention matrices in the same type stay packed, the other tensors are dequantized to bf16; the configuration
    and tokenizer come from the file's metadata. Other expert types (K-quants such as Q4_K_M, IQ*) need
    --requantize (or `llama-quantize --pure IN OUT Q4_0` first).

    Args:
        gguf: the .gguf file (one file; split GGUFs: merge them first with `llama-gguf-split --merge`)
        out: the folder to write (written whole, or not at all)
        requantize: int4 | int8: experts in other types (K-quants such as Q4_K_M's, IQ*) are dequantized and
            quantized again into our group-32 format (a second rounding: each layer's relative error against the
            file's weights is reported); without it such files are refused
        overwrite: replace an earlier `import-gguf` output in --out (a folder of anything else is never written)
        integrity: on (the folder written passes `verify`'s reference-free checks before it is published: NaN or
            exponent-flipped experts in the file are refused naming the tensor, nothing is written) | off
    """
    from expertcache.telemetry.progress import Progress

    from expertcache.runtime.kernels.gguf_import import import_gguf as run

    if not out:
        raise InputError("--out is required: the folder the checkpoint is written to")
    check_output(out, gguf, folder=True, command="import-gguf", overwrite=overwrite)
    with Progress(transient=True) as prog:
        task = prog.add_task("layers converted", total=None)
        rep = run(gguf, out, progress=lambda: prog.advance(task), requantize=requantize, overwrite=overwrite,
                  integrity=integrity)
    print(f"import-gguf: {rep['architecture']}, {rep['layers']} layers x {rep['experts_per_layer']} experts stored "
          f"as {rep['experts_type']} -> {rep['experts']} experts ({rep['expert_bytes'] / 2**30:.2f} GiB); "
          f"{rep['packed_linears']} linears packed as stored, {rep['non_expert_tensors']} other tensors in bf16 -> "
          f"{out}", file=sys.stderr)
    if rep["requantized"]:
        print(f"import-gguf: experts quantized again from {rep['experts_type']}: worst layer relative error against "
              f"the file's weights {max(rep['relative_error_vs_gguf']):.4f}", file=sys.stderr)
    return rep
