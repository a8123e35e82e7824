"""`expertcache bench big`: a checkpoint larger than this machine's RAM, decoded by expertcache and by what a user
runs today, side by side.

1. `bigckpt.write_checkpoint` writes a Qwen3-30B-A3B-shaped checkpoint (random bf16 weights, the published
   per-expert layout) with as many layers as make its experts >= `ram_factor` x physical RAM (fewer if the disk
   cannot hold them: said in the JSON).
2. Every system decodes the same prompt with the same routing: each router's choice is replaced by the reference
   Qwen3-30B-A3B trace's (a forward hook on the routers), so every cache sees real locality:
   - ``expertcache``: `load(..., tier="disk")`, a cache sized to the memory budget, on-demand and with prefetch
     (the co-occurrence predictor fitted on trace tokens outside the decoded window); lossless;
   - ``accelerate``: transformers + accelerate disk offload (`device_map="auto"`, `max_memory` = the budget);
   - ``mmap``: the page cache as the expert cache (the safetensors file mapped, experts computed in place, as
     llama.cpp does by default);
   - ``llama.cpp``: llama.cpp itself (`llama-bench`, mmap) on a BF16 GGUF conversion of the same checkpoint
     (`runtime/bench/llamacpp.py`); it routes with the model's own routers, so it runs with `routing="native"` only.
   Every system but the ``:unbounded`` ones runs inside one memory cgroup of the budget (resident memory and page
   cache) when one can be made (root); ``mmap:unbounded``/``llama.cpp:unbounded`` are what a user gets by default.
   Each run is its own process (its peak RSS is its own); the page cache is dropped before each when this
   process may (root), so every system starts cold; rounds alternate the order.
3. With `--prefill N,...` every system also prefills prompts of those lengths, one cold prefill per length and round
   in a process of its own (`run_prefill`; llama.cpp's `llama-bench -p N -n 0`), and the roofline's compute term is
   one prefill with every expert resident (`resident_prefills`); `bigprefill.py` turns the runs into the JSON's
   `prefill` rows, `roofline_tokens_per_s` and ratios. `--decode false` runs that phase alone.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.memory import peak_rss_bytes, rss_bytes
from expertcache.telemetry.registry import Registry

from expertcache.runtime.bench.harness import alternate, claim_text, compare
from expertcache.runtime.bench.runner import read_config, run_child, write_config

from expertcache.runtime.bench.bigckpt import ALIGN, EXPERTS, HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, TOP_K, expert_bytes, physical_ram, \
    q4_0_expert_bytes, write_checkpoint, write_gguf_q4_0
from expertcache.runtime.storage.checkpoint import free_disk
from expertcache.runtime.engine.config import EngineConfig

ROUTING_REGISTRY = Registry("routing")  # --routing
for _r in ("trace", "native"):
    ROUTING_REGISTRY.register(_r)
ROUTINGS = ROUTING_REGISTRY.names()
FORMAT_REGISTRY = Registry("experts format")  # --experts, and an expertcache system's `:int4` suffix
for _f in ("bf16", "int8", "int4"):
    FORMAT_REGISTRY.register(_f)
FORMATS = FORMAT_REGISTRY.names()
TRACE_START = 2000  # the trace's token that routes the prompt's first; the predictor is fitted on tokens before it
RAM_OTHER = 2 << 30  # what an expertcache system's budget leaves beside its cache: non-expert weights (~1.3 GB at
# this shape; 1.67 GiB resident after loading), interpreter, activations
PROMPT_RESERVE = 12 << 10  # and, for a prefill, per prompt token and layer: what a long cold prefill adds to the
# process. Measured on the 48-layer int4 checkpoint (8 GiB budget, one forward): the resident set grew by 0.80 GB over
# a 512-token prefill and 1.62 GB over a 2,048-token one (the KV cache, heap the forward keeps, oneDNN's primitives,
# the expert calls' rows), about 10 KiB per token and layer beyond RAM_OTHER's room; 2,048 tokens were killed in the
# cgroup without it


def parse_system(name: str) -> tuple[str, str, dict[str, str]]:
    """`(system, experts format, engine overrides)` of a system name. An expertcache system may carry its format
    (`expertcache:on-demand:int4`) and engine options after slashes (`expertcache:on-demand/victims=false/policy=lfu`:
    that row serves with those options over `--engine`'s), so two configurations compare in one alternated run."""
    keys = "|".join(EngineConfig.__dataclass_fields__)  # a slash before an engine option's `key=` (a value may be
    base, *opts = re.split(rf"/(?=(?:{keys})=)", name)  # a path with slashes)
    if "/" in base:
        raise InputError(f"system {name!r}: {base.split('/', 1)[1]!r} is not an engine option key=value "
                         f"({', '.join(EngineConfig.__dataclass_fields__)})")
    over = dict(o.split("=", 1) for o in opts)  # each split before a known `key=`
    empty = [k for k, v in over.items() if not v]
    if empty:
        raise InputError(f"system {name!r}: engine option {empty[0]} has no value")
    fmt = "bf16"
    if base.startswith("expertcache") and base.rsplit(":", 1)[-1] in FORMATS[1:]:
        base, fmt = base.rsplit(":", 1)
    SYSTEM_REGISTRY.parse(base)  # an unknown system, or a variant it does not have: one line listing them
    if over and not base.startswith("expertcache"):
        raise InputError(f"system {name!r}: only expertcache systems take engine options")
    fixed = sorted(set(over) & {"capacity", "budget_gb"}) + (["predictor"] if "predictor" in over
                                                             and base != "expertcache:prefetch" else [])
    if fixed:  # what bench big sets itself: the cache from --budget_gb, no predictor on an on-demand row
        raise InputError(f"system {name!r}: {', '.join(fixed)} is set by bench big (the cache from --budget_gb; "
                         f"a predictor only on expertcache:prefetch)")
    return base, fmt, over


def system_engine(name: str, engine: EngineConfig) -> EngineConfig:
    """`engine` with the system name's overrides, checked (an unknown key or a bad value is one line)."""
    over = parse_system(name)[2]
    if not over:
        return engine
    return EngineConfig.from_text({**asdict(engine), **over})


class TraceRouting:
    """Forward hooks on every router that replace its choice with a trace's: token p of a pass (prefill
    positions first) takes trace token `start + p` at the same layer, weights uniform over the k."""

    def __init__(self, routers, ids: np.ndarray, start: int, predictor=None):
        """`predictor`: a `TracePredictor` over the same trace, told which trace token each pass decodes."""
        self.ids, self.start, self.pos = torch.as_tensor(ids.astype(np.int64)), start, 0
        self.n, self.predictor = 0, predictor
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer):
        def hook(module, args, output):
            logits, weights, _ = output
            t = logits.shape[0]
            if layer == 0:
                self.pos, self.n = self.pos + self.n, t
                if self.predictor is not None:  # the pass's last row: the token whose next layers it names
                    self.predictor.t = self.start + self.pos + t - 1
            idx = self.ids[layer, self.start + self.pos:self.start + self.pos + t].to(logits.device)
            w = torch.full(idx.shape, 1.0 / idx.shape[1], dtype=weights.dtype, device=logits.device)
            return logits, w, idx
        return hook


def _slot_bytes(ckpt: Path) -> int:
    """Bytes one cached expert takes: a quantized checkpoint's store block, else the bf16 expert (+ alignment)."""
    from expertcache.runtime.kernels.quant import open_source, read_config

    qc = read_config(ckpt)
    return open_source(ckpt, qc).meta.block_bytes if qc else expert_bytes() + ALIGN


def _ckpt_shape(ckpt: Path) -> tuple[int, int, int, int]:
    """`(experts, top_k, hidden, expert intermediate)` of a checkpoint, from its config.json."""
    c = json.loads((Path(ckpt) / "config.json").read_text())
    n_exp = c.get("num_experts", c.get("num_local_experts"))  # the name differs across transformers versions
    return n_exp, c["num_experts_per_tok"], c["hidden_size"], c["moe_intermediate_size"]


def replay_only(spec: str) -> bool:
    """Whether a predictor name is one only a routing trace can serve (cooccurrence, oracle[:recall]): in bench big,
    the trace-routing prefetch rows only."""
    from expertcache.runtime.engine.predictors import LIVE_PREDICTORS, REPLAY_PREDICTORS

    return spec not in LIVE_PREDICTORS and spec in REPLAY_PREDICTORS


def check_system(name: str, engine: EngineConfig, routing: str) -> None:
    """A system of bench big, before anything runs: its name and engine options (`system_engine`), and a prefetch
    row's predictor: a live one (probe:D, persistence, ...) as everywhere; a trace's own (cooccurrence,
    oracle[:recall]) only with --routing trace, where the trace is the routing."""
    from expertcache.runtime.engine.predictors import check_predictor_spec

    spec = system_engine(name, engine).predictor
    if parse_system(name)[0] != "expertcache:prefetch" or spec == "none":
        return
    if replay_only(spec):
        if routing != "trace":
            raise InputError(f"system {name!r}: predictor {spec} reads the routing trace; with --routing {routing} "
                             f"there is none (use probe:D or lookahead:D)")
        return
    check_predictor_spec(spec)


CHECKPOINTS = ("bf16", "q4_0")  # --checkpoint: what bench big writes (see `bench_big`)


def check_checkpoint(checkpoint: str, experts, quant_linears: bool, systems) -> None:
    """bench big's --checkpoint with the formats and systems it can serve, before anything is written: q4_0 (no
    bf16 copy) is served as int4 with packed linears, by expertcache and llama.cpp only."""
    if checkpoint not in CHECKPOINTS:
        raise InputError(f"--checkpoint {checkpoint!r}: expected {' or '.join(CHECKPOINTS)}")
    if checkpoint != "q4_0":
        return
    if list(experts) != ["int4"] or not quant_linears:
        raise InputError("--checkpoint q4_0 is served as int4 with packed linears (the GGUF imported as it is): "
                         "give --experts [int4] --quant_linears true")
    bf16_only = [x for x in systems if not x.startswith(("expertcache", "llama.cpp"))]
    if bf16_only:
        raise InputError(f"--checkpoint q4_0: {bf16_only[0]} reads the bf16 checkpoint, which q4_0 does not write; "
                         f"run expertcache and llama.cpp systems")


def check_systems(systems, engine: EngineConfig, routing: str) -> None:
    """bench big's --systems, before the checkpoint is written: at least one, each known with its options
    (`check_system`), none twice, none that cannot run under `routing` (llama.cpp takes no forced routing), and
    --engine.predictor checked as the prefetch row would use it even when no such row asks for it."""
    if not systems:
        raise InputError(f"--systems {list(systems)}: no system to run; expected some of: "
                         f"{SYSTEM_REGISTRY.listing()}")
    for x in systems:
        check_system(x, engine, routing)
        if routing != "native" and system_entry(x).native_only:
            raise InputError(f"system {x!r} routes with the model's own routers (llama.cpp and vLLM have no hook to "
                             f"force a trace's choice): run it with --routing native, not --routing {routing}")
    if len(set(systems)) < len(systems):
        raise InputError(f"--systems {list(systems)}: a system is named twice")
    if engine.predictor not in ("none", ""):
        check_system("expertcache:prefetch", engine, routing)


def _load_system(system: str, ckpt: Path, budget: int, layers: int, trace_ids: np.ndarray | None, start: int,
                 engine: EngineConfig, resident: bool = False, prompt_len: int = 0):
    """`(model, engine or None, routers)` for one system; expertcache's under `engine` with the capacity the budget
    leaves. The prefetch row predicts with `engine.predictor` when one is given (a trace's own, cooccurrence or
    oracle[:recall], over `trace_ids`, the routing replayed from `start`); else with the co-occurrence predictor
    fitted on the trace's tokens before `start` (trace routing), or, with `trace_ids` None (the checkpoint's own
    routing), the probe of the next layer's router. `resident`: expertcache with every expert in memory (capacity
    1.0, host tier), whatever the budget. `prompt_len`: a prefill's prompt, whose working memory (`PROMPT_RESERVE`
    per token and layer) the budget keeps beside the cache."""
    from expertcache.telemetry.adapters import adapter_for

    if system.startswith("expertcache"):  # expertcache:on-demand | :prefetch, then :int8 / :int4 for quantized
        from expertcache.runtime.storage.loader import load
        from expertcache.runtime.engine.trace_predictors import CooccurrenceEstimator, CooccurrencePredictor, TracePredictor

        from expertcache.runtime.engine.config import STREAM_SLOTS_PER_K
        from expertcache.telemetry.cachesim import budget_capacity

        # the stream slots (a prefill's misses) come out of the budget too: with every slot touched when it is
        # made, the cache's whole size is resident from the start, and a cgroup of the budget holds no slack
        n_exp, top_k = _ckpt_shape(ckpt)[:2]  # the checkpoint's own (a test's tiny one; bigckpt's otherwise)
        stream = min(STREAM_SLOTS_PER_K * top_k, n_exp) * _slot_bytes(ckpt)
        other = RAM_OTHER + PROMPT_RESERVE * prompt_len * layers
        cap = budget_capacity(budget - other - stream, _slot_bytes(ckpt), layers, top_k, n_exp)  # packed: more
        if cap < 1 and not resident:
            raise InputError(f"a budget of {budget / 2**30:.1f} GiB leaves no cache slots after the non-expert weights"
                             + (f" and a {prompt_len}-token prompt" if prompt_len else ""))
        cfg, pred = replace(engine, capacity=cap, predictor="none"), "none"  # "none": the config's predictor
        if resident:  # every expert in memory: the prefill's compute alone (the roofline's compute term)
            cfg = replace(engine, capacity=1.0, tier="host", predictor="none")
        prefetch = parse_system(system)[0] == "expertcache:prefetch"
        ids_fit = None if trace_ids is None else trace_ids[:, :start - 1]
        if prefetch and replay_only(engine.predictor) and trace_ids is not None:  # the trace's own (an oracle reads
            spec = engine.predictor  # its future): the routing's token is set by TraceRouting at each pass
            est = CooccurrenceEstimator(ids_fit, EXPERTS) if spec == "cooccurrence" else None
            pred = TracePredictor(spec, trace_ids, est)
        elif prefetch and engine.predictor != "none":  # the one asked for (--engine.predictor)
            cfg = replace(cfg, predictor=engine.predictor)
        elif prefetch and ids_fit is None:
            cfg = replace(cfg, predictor="probe:1")
        elif prefetch:
            pred = CooccurrencePredictor(CooccurrenceEstimator(ids_fit, EXPERTS))
        m = load(ckpt, engine=cfg, predictor=pred)
        return m, m.expertcache, [L.router for L in m.expertcache.layers]
    if system == "accelerate":
        from expertcache.telemetry.hf import load_causal_lm

        m = load_causal_lm(ckpt, dtype=torch.bfloat16, device_map="auto", max_memory={"cpu": budget},
                           offload_folder=str(offload_dir(ckpt))).eval()
        return m, None, [L.router for L in adapter_for(m).moe_layers(m)]
    if system in ("mmap", "mmap:unbounded"):  # the same process; the cgroup (or none) is the difference
        m = _mmap_model(ckpt)
        return m, None, [L.router for L in adapter_for(m).moe_layers(m)]
    raise InputError(f"system {system!r} does not run in a process of bench big's own")


def _mmap_model(ckpt: Path):
    """The non-expert weights in memory; every layer's `[E, ...]` expert tensors strided views into the mapped
    shard (each expert's gate, up and down lie back to back): the model's own forward reads the pages it needs
    and the page cache keeps what it keeps."""
    import mmap

    from expertcache.runtime.storage.checkpoint import Checkpoint
    from expertcache.runtime.storage.loader import build_offloaded

    m, source = build_offloaded(ckpt)
    ck: Checkpoint = source.ckpt
    maps = []
    for p in ck.files:  # copy-on-write private maps: reads are the page cache's pages, nothing is ever written
        fd = os.open(str(p), os.O_RDONLY)
        maps.append(mmap.mmap(fd, 0, access=mmap.ACCESS_COPY))
        os.close(fd)
    raw = [torch.frombuffer(mp, dtype=torch.uint8) for mp in maps]
    from expertcache.telemetry.adapters import adapter_for

    n_exp, _, hidden, inter = _ckpt_shape(ckpt)
    for li, layer in enumerate(adapter_for(m).moe_layers(m)):
        g0 = ck.tensors[f"model.layers.{layer.index}.mlp.experts.0.gate_proj.weight"]
        g1 = ck.tensors[f"model.layers.{layer.index}.mlp.experts.1.gate_proj.weight"]
        d0 = ck.tensors[f"model.layers.{layer.index}.mlp.experts.0.down_proj.weight"]
        stride = (g1.start - g0.start) // 2  # elements between experts
        base = raw[g0.file]
        gu = base[g0.start:].view(torch.bfloat16).as_strided([n_exp, 2 * inter, hidden], [stride, hidden, 1])
        dn = base[d0.start:].view(torch.bfloat16).as_strided([n_exp, hidden, inter], [stride, inter, 1])
        ex = layer.experts
        ex._parameters["gate_up_proj"] = torch.nn.Parameter(gu, requires_grad=False)
        ex._parameters["down_proj"] = torch.nn.Parameter(dn, requires_grad=False)
    m._expertcache_maps = maps  # kept alive with the model
    return m


def _done(system: str, r: int, rounds: int, run: dict) -> str:
    """What a progress line says after one run: the system, the round, its median TPOT or its error."""
    tpot = run.get("tpot_median_s")
    what = run["error"] if "error" in run else f"{tpot:.3f} s/token" if tpot is not None else "done"
    return f"{system} round {r + 1}/{rounds}: {what}"


def run_one(system: str, ckpt: str | Path, trace: str | Path, budget_gb: float, tokens: int, warmup: int,
            prompt_len: int, start: int, engine: EngineConfig | None = None, routing: str = "trace",
            quant_linears: bool = False) -> dict:
    """One system's decode in this process: TPOT per token (prefill excluded), hits, bytes read, peak RSS.
    `ckpt`: the bf16 checkpoint; an expertcache system named `...:int8`/`...:int4` reads its quantized copy.
    `engine`: the system's resolved `EngineConfig` (its name's options applied: `system_engine`; default: the disk
    tier). `routing`: trace (every router's
    choice replaced by the trace's) or native (the checkpoint's own routers)."""
    from expertcache.telemetry.routing import load_routing

    ckpt = Path(ckpt)
    fmt = parse_system(system)[1]
    if fmt in ("int8", "int4"):
        ckpt = quantized_path(ckpt, fmt, quant_linears)
    cfg = json.loads((ckpt / "config.json").read_text())
    r = load_routing(trace)
    ids = r.ids
    ids = ids[:cfg["num_hidden_layers"]]
    budget = int(budget_gb * 2**30)
    io0 = _read_bytes()
    t0 = time.perf_counter()
    cfg_engine = engine or EngineConfig(tier="disk")
    native = routing == "native"
    m, eng, routers = _load_system(system, ckpt, budget, cfg["num_hidden_layers"], None if native else ids, start,
                                   cfg_engine)
    load_s = time.perf_counter() - t0
    rss_load = rss_bytes()
    if eng is not None:  # the cache's slots are touched as they are made, so loading left them resident: that
        # and the tier's host buffers must fit. Said in the run's log, which a failed run's error quotes (an
        # out-of-memory kill leaves no other word)
        over = " (over the budget: a cgroup of this size will kill the run)" if rss_load + eng.host_bytes > budget \
            else ""
        print(f"{system}: resident after loading {rss_load / 2**30:.2f} GiB, of which cache slots "
              f"{eng.fast_bytes / 2**30:.2f} GiB (streaming buffers and activations come on top), budget "
              f"{budget / 2**30:.2f} GiB{over}", file=sys.stderr, flush=True)
    from expertcache.runtime.engine.trace_predictors import TracePredictor

    told = eng.predictor if eng is not None and isinstance(eng.predictor, TracePredictor) else None
    forced = None if native else TraceRouting(routers, ids, start, told)
    prompt = torch.randint(2, cfg["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    from expertcache.runtime.serve.generate import timed_greedy

    io1 = _read_bytes()
    # the decode loop of generate and serve; the engine's counters over the timed steps (after the warmup)
    io_mark = []  # disk reads when the timed steps begin: prefill and warmup read a cold cache's misses
    times, out, dec_stats = timed_greedy(m, prompt, warmup + tokens + 1, eng, warmup,
                                         lambda: io_mark.append(_read_bytes()))
    io2 = _read_bytes()
    tpot = np.diff(times)[warmup:]
    n_dec = len(times) - 1 - warmup  # the timed steps: the TPOT figures' and the time budget's
    res = {"system": system, "load_s": load_s, "tokens_timed": int(len(tpot)),
           "tpot_median_s": float(np.median(tpot)), "tpot_p90_s": float(np.percentile(tpot, 90)),
           "tokens_per_s": float(1 / np.median(tpot)), "tpot_s": [float(x) for x in tpot],
           "peak_rss_bytes": peak_rss_bytes(), "rss_after_load_bytes": rss_load, "disk_read_bytes_load": io1 - io0,
           # over the timed steps, as TPOT and the engine's traffic; before, prefill and warmup reads were averaged
           # in over every token, which read as a 1.2-1.4x amplification of the engine's traffic
           "disk_read_bytes_per_token": (io2 - io_mark[0]) / max(n_dec, 1),
           "disk_read_bytes_prefill_warmup": io_mark[0] - io1,
           "output_tokens_sha": hash(tuple(out[0].tolist())) & 0xFFFFFFFF,
           "routing_positions": None if forced is None else forced.pos + forced.n}
    if eng is not None:
        d = dec_stats.per_token(eng.traffic_expert_bytes, n_dec)
        res.update({"hit_rate": d["hit_rate"], "stall_per_token_s": d["stall_per_token_s"],
                    # what was read, and why: on demand, or ahead by the predictor (and of those, how many the
                    # layer then used): a prefetch row that names only resident experts reads as on-demand here
                    "demand_loads_per_token": d["demand_loads_per_token"],
                    "prefetch_loads_per_token": d["prefetch_loads_per_token"],
                    "prefetch_hits_per_token": dec_stats.prefetch_hits / max(n_dec, 1),
                    "time_budget_s": dec_stats.time_budget(times[-1] - times[warmup], n_dec),
                    "traffic_bytes_per_token": d["traffic_bytes_per_token"], "engine": eng.describe()})
        if eng.tier.name == "disk":  # the reads' achieved bandwidth beside this disk's limits, measured after the
            from expertcache.runtime.storage.tiers import read_limits  # timed tokens (into buffers of its own: the cache is not touched)

            lim = read_limits(eng.tier, eng.meta, eng.meta.num_layers, cfg_engine.workers)
            res["read_bandwidth"] = {"in_flight_GBps": d["read_GBps_in_flight"],
                                     "read_busy_per_token_s": d["read_busy_per_token_s"],
                                     "one_at_a_time_GBps": lim["one_at_a_time"]["GBps"],
                                     "at_queue_depth_GBps": lim["at_queue_depth"]["GBps"],
                                     "queue_depth": lim["at_queue_depth"]["queue_depth"]}
        eng.close()
    return res


def run_prefill(system: str, ckpt: str | Path, trace: str | Path, budget_gb: float, prompt_len: int, start: int,
                engine: EngineConfig | None = None, routing: str = "trace", quant_linears: bool = False,
                resident: bool = False, tokens: int | None = None, warmup: int | None = None) -> dict:
    """One system's cold prefill in this process: `prompt_len` tokens in one forward through the decode loop's
    prefill (`timed_greedy` for one token: the path `generate` and `serve` run), the first token chosen. Returns
    `tokens_per_s` (prompt tokens over the time to the first token), `ttft_s` (the forward and the first token's
    sampling), `disk_read_bytes` (/proc/self/io read_bytes over the prefill: O_DIRECT reads and mmap's page faults
    alike), the (layer, expert) pairs the prompt routed to, and for expertcache the engine's own bytes, stall and
    compute seconds and the disk's measured read limits. `resident`: expertcache with every expert in memory (the
    roofline's compute term): one untimed prefill first, then the timed one, which must read nothing (said in
    `loads_in_timed`). `tokens`/`warmup` of the run configuration are the decode's, unused here."""
    import copy

    from expertcache.runtime.serve.generate import timed_greedy
    from expertcache.telemetry.routing import load_routing

    ckpt = Path(ckpt)
    fmt = parse_system(system)[1]
    if fmt in ("int8", "int4"):
        ckpt = quantized_path(ckpt, fmt, quant_linears)
    cfg = json.loads((ckpt / "config.json").read_text())
    native = routing == "native"
    ids = None if native else load_routing(trace).ids[:cfg["num_hidden_layers"]]
    cfg_engine = engine or EngineConfig(tier="disk")
    t0 = time.perf_counter()
    m, eng, routers = _load_system(system, ckpt, int(budget_gb * 2**30), cfg["num_hidden_layers"], ids, start,
                                   cfg_engine, resident, prompt_len)
    load_s = time.perf_counter() - t0
    prompt = torch.randint(2, cfg["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))

    from expertcache.runtime.engine.trace_predictors import TracePredictor

    told = eng.predictor if eng is not None and isinstance(eng.predictor, TracePredictor) else None

    def once():
        forced = None if native else TraceRouting(routers, ids, start, told)
        touched = set()  # (layer, expert) pairs the prompt routed to, after any forced routing
        hooks = [r.register_forward_hook(lambda mod, a, out, i=i: touched.update(
            (i, int(e)) for e in out[2].unique().tolist())) for i, r in enumerate(routers)]
        s0 = copy.copy(eng.stats) if eng is not None else None
        io0 = _read_bytes()
        t = time.perf_counter()
        times, ids_out, _ = timed_greedy(m, prompt, 1, eng)  # the prefill, then the first token chosen
        io1 = _read_bytes()
        for h in hooks + (forced.handles if forced is not None else []):
            h.remove()
        return (times[0] - t, io1 - io0, (eng.stats - s0) if eng is not None else None, len(touched),
                int(ids_out[0, -1]))

    if resident:
        once()  # every expert brought in; the timed pass below is compute alone
    ttft, read, st, touched, first = once()
    res = {"system": system, "prompt_tokens": prompt_len, "tokens_per_s": prompt_len / ttft, "ttft_s": ttft,
           "disk_read_bytes": read, "load_s": load_s, "experts_touched": touched, "first_token": first,
           # an expert's bytes as read: the engine's store (int8/int4 packed), else bf16 gate, up, down
           "expert_bytes": eng.meta.expert_bytes if eng is not None
           else 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2,
           "peak_rss_bytes": peak_rss_bytes(), "resident": resident}
    if eng is not None:
        res.update({"engine_bytes_moved": st.bytes_moved, "stall_s": st.stall_s, "expert_compute_s": st.compute_s,
                    "forward_s": st.forward_s, "loads_in_timed": st.demand_loads + st.prefetch_loads,
                    "engine": eng.describe()})
        if eng.tier.name == "disk":  # this disk's read limits, measured after the prefill (into buffers of its own)
            from expertcache.runtime.storage.tiers import read_limits

            lim = read_limits(eng.tier, eng.meta, eng.meta.num_layers, cfg_engine.workers)
            res["read_bandwidth"] = {"at_queue_depth_GBps": lim["at_queue_depth"]["GBps"],
                                     "queue_depth": lim["at_queue_depth"]["queue_depth"],
                                     "one_at_a_time_GBps": lim["one_at_a_time"]["GBps"]}
        eng.close()
    return res


def run_process(config: Path, log: Path, cg=None, timeout_s: float = 3600) -> dict:
    """One round of a system in a process of its own (`runner.run_child`: the page cache dropped, inside the memory
    cgroup `cg` when given, its peak memory read), from its run configuration `config` (`write_run_config`), its
    stderr in `log`: its result, or `{"error": ...}` quoting the log's last line."""
    return run_child("expertcache.runtime.bench.bigbench", config, log, cg, timeout_s)


RUN_KEYS = ("system", "ckpt", "trace", "budget_gb", "tokens", "warmup", "prompt_len", "start", "engine", "routing",
            "quant_linears", "phase")  # a run configuration's keys: `run_one`'s arguments, then which phase runs
PHASES = ("decode", "prefill", "resident")  # `run_one`; `run_prefill`; `run_prefill(resident=True)`


def write_run_config(path: Path, system: str, job: dict, engine: EngineConfig, phase: str = "decode") -> Path:
    """A system's run configuration, the file its process reads: `job` (what every system shares) with the system
    and its engine resolved here, once (its name's options applied over --engine's: `system_engine`), and the
    phase it runs (`PHASES`)."""
    cfg = {**job, "system": system, "engine": asdict(system_engine(system, engine)), "phase": phase}
    return write_config(path, {k: cfg[k] for k in RUN_KEYS if k in cfg})


def load_run_config(path: str | Path) -> dict:
    """A run configuration read back and checked once: `run_one`'s keyword arguments (the engine an `EngineConfig`,
    checked); a key nothing reads or one missing is one line."""
    cfg = read_config(path)
    unknown = sorted(set(cfg) - set(RUN_KEYS))
    missing = sorted(set(RUN_KEYS[:8]) - set(cfg))
    if unknown or missing:
        raise InputError(f"run configuration {path}: " + "; ".join(
            ([f"unknown keys {unknown}"] if unknown else []) + ([f"missing keys {missing}"] if missing else []))
            + f" (expected {', '.join(RUN_KEYS)})")
    if cfg.get("engine") is not None:
        eng = cfg["engine"]
        if not isinstance(eng, dict) or set(eng) - set(EngineConfig.__dataclass_fields__):
            raise InputError(f"run configuration {path}: engine {eng!r} is not a mapping of EngineConfig fields")
        cfg["engine"] = EngineConfig(**eng)
        cfg["engine"].check()
    if cfg.setdefault("phase", "decode") not in PHASES:
        raise InputError(f"run configuration {path}: phase {cfg['phase']!r}; expected one of {', '.join(PHASES)}")
    return cfg


def prepare_llamacpp(systems, routing: str, ckpt: Path, out_dir: Path, llamacpp_dir=None, build: bool = True,
                     given: Path | None = None):
    """For the llama.cpp systems asked for: `(bin dir, GGUF, {})` once llama.cpp is built and the checkpoint
    converted (both reused; `given`: a GGUF written already, used as it is), or `(None, None, {system: why})` when
    they cannot run (trace routing, or a step that failed: its one line). `build` False: a llama.cpp not built
    already is not downloaded nor built (10-30 minutes of every core): its systems are skipped, saying so.
    """
    want = [s for s in systems if parse_system(s)[0].startswith("llama.cpp")]
    if not want:
        return None, None, {}
    if routing != "native":
        return None, None, {s: "llama.cpp routes with the model's own routers: run with --routing native"
                            for s in want}
    from expertcache.runtime.bench import llamacpp

    try:
        cache = Path(llamacpp_dir) if llamacpp_dir else None
        if not build and llamacpp.built(cache) is None:
            raise llamacpp.LlamaCppError("build", f"llama.cpp is not built in {cache or llamacpp.cache_dir()} and "
                                         f"--llamacpp_build false (building takes 10-30 minutes of every core)")
        src = llamacpp.source_dir(cache)
        bins = llamacpp.build(src)
        if given is not None:
            return bins, given, {}  # (q4_0: the checkpoint, written as a GGUF)
        need, free = have_ckpt(ckpt), free_disk(out_dir)  # a BF16 GGUF is about the checkpoint's size
        if not llamacpp.gguf_path(ckpt, "bf16", out_dir).exists() and free < need + (1 << 30):
            raise llamacpp.LlamaCppError("convert", f"the GGUF needs about {need / 1e9:.1f} GB of disk and "
                                         f"{free / 1e9:.1f} GB are free in {out_dir}")
        return bins, llamacpp.gguf(ckpt, "bf16", src, bins, out_dir), {}
    except llamacpp.LlamaCppError as e:
        return None, None, {s: str(e) for s in want}


def llamacpp_options(system: str) -> tuple[str, ...]:
    """llama-bench's options for a llama.cpp system: `llama.cpp:no-repack` keeps the weights in the mapped file
    (`--repack 0`). By default llama.cpp repacks Q4_0/Q8_0 weights into interleaved rows in anonymous memory at load:
    the whole model resident, which a memory cgroup smaller than the model cannot hold."""
    return ("--repack", "0") if system.endswith(":no-repack") else ()


def run_llamacpp(system: str, bins: Path, gguf: Path, tokens: int, warmup: int, prompt_len: int, threads: int,
                 preexec=None, timeout_s: float = 3600, log: Path | None = None) -> dict:
    """One round of llama.cpp (`llama-bench`, its own process, in the cgroup when `preexec` joins it): `prompt_len`
    tokens of context, `warmup` untimed decoded tokens, then `tokens` timed; the same fields as `run_one`'s.
    `tpot_s` holds one figure, llama-bench's mean over the timed tokens (it times the run, not each token); the
    bytes read per token are the child's own during the timed test (with no warm-up: the whole run's, loading
    included, and `disk_read_includes_load` says so)."""
    from expertcache.runtime.bench.llamacpp import bench

    r = bench(bins, gguf, threads, tokens, warmup, prompt_len, 1, preexec, timeout_s, log, llamacpp_options(system))
    if r["read_bytes_timed"] is not None:  # from the end of the warm-up test: the timed test (its context and
        per_tok, with_load = r["read_bytes_timed"] / (tokens + 1), False  # one-token warm-up included)
    else:
        per_tok, with_load = r["read_bytes"] / (1 + tokens), True  # llama-bench warms each test up with one token
    return {"system": system, "load_s": None, "tokens_timed": tokens, "tpot_median_s": float(r["tpot_s"][0]),
            "tpot_p90_s": float(r["tpot_s"][0]), "tokens_per_s": float(1 / r["tpot_s"][0]),
            "tpot_s": [float(x) for x in r["tpot_s"]], "tpot_is_run_mean": True,
            "peak_rss_bytes": r["peak_rss_bytes"], "disk_read_bytes_load": None,
            "disk_read_bytes_per_token": per_tok, "disk_read_includes_load": with_load,
            "disk_read_bytes_run": r["read_bytes"],
            "output_tokens_sha": None, "routing_positions": None, "llamacpp_build": r["build"],
            "threads": r["threads"], "cmd": r["cmd"]}


def run_llamacpp_prefill(system: str, bins: Path, gguf: Path, prompt_len: int, threads: int, preexec=None,
                         timeout_s: float = 3600, log: Path | None = None) -> dict:
    """One cold prefill of llama.cpp (`llama-bench -p N -n 0`, its own process, in the cgroup when `preexec` joins
    it): `run_prefill`'s fields. `ttft_s` is llama-bench's prompt time (it excludes sampling, microseconds); the
    bytes read are the whole process's (loading included, `disk_read_includes_load`)."""
    from expertcache.runtime.bench.llamacpp import bench_prompt

    r = bench_prompt(bins, gguf, threads, prompt_len, preexec, timeout_s, log, llamacpp_options(system))
    return {"system": system, "prompt_tokens": prompt_len, "tokens_per_s": r["tokens_per_s"],
            "ttft_s": float(np.median(r["prompt_s"])), "disk_read_bytes": r["read_bytes"],
            "disk_read_includes_load": True, "peak_rss_bytes": r["peak_rss_bytes"], "llamacpp_build": r["build"],
            "threads": r["threads"], "cmd": r["cmd"]}


VLLM_OVERHEAD = 2 << 30  # beside a vLLM run's weights: its KV cache (1 GiB) and about 1 GiB of torch and vLLM


def prepare_vllm(systems, routing: str, ckpt: Path, budget_bytes: int | None):
    """For the vLLM systems asked for: `(its venv's python, {system: why})`, the python None when none can run:
    trace routing, or no venv made (bench big does not install it: `python scripts/vllm_peer.py --build_only`
    makes it once, about 3.5 GB). vLLM loads every weight before it runs, so a system whose memory (the cgroup's
    `budget_bytes`, or what is available for `vllm:unbounded`) cannot hold the checkpoint is skipped, saying so,
    rather than run out of memory midway."""
    want = [s for s in systems if parse_system(s)[0].startswith("vllm")]
    if not want:
        return None, {}
    if routing != "native":
        return None, {s: "vLLM routes with the model's own routers: run with --routing native" for s in want}
    from expertcache.runtime.bench import vllm
    from expertcache.runtime.storage.tiers import available_memory

    py = vllm.ready()
    if py is None:
        return None, {s: f"vLLM's venv is not made in {vllm.cache_dir()}: `python scripts/vllm_peer.py --build_only` "
                         f"makes it (about 3.5 GB)" for s in want}
    # every weight, its KV cache (VLLM_CPU_KVCACHE_SPACE, 1 GiB) and about 1 GiB of its own (torch, vLLM)
    weights, skipped = have_ckpt(ckpt), {}
    need = weights + VLLM_OVERHEAD
    for s in want:
        room = available_memory() if s.endswith(":unbounded") or budget_bytes is None else budget_bytes
        if need > room:
            skipped[s] = (f"vLLM loads every weight first: the checkpoint's {weights / 2**30:.1f} GiB, with its KV "
                          f"cache and its own memory about {need / 2**30:.1f} GiB, do not fit in the "
                          f"{room / 2**30:.1f} GiB it would have")
    return (py if len(skipped) < len(want) else None), skipped


def _prompt_ids(ckpt: Path, n: int) -> list[int]:
    """A peer's prompt of `n` token ids drawn from the checkpoint's vocabulary (seeded: the same every run)."""
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    return np.random.default_rng(0).integers(0, vocab, n).tolist()


def run_vllm(system: str, python: Path, ckpt: Path, tokens: int, warmup: int, prompt_len: int, threads: int,
             preexec=None, timeout_s: float = 3600, log: Path | None = None) -> dict:
    """One round of vLLM's CPU build on the bf16 checkpoint (`vllm.bench`: its own process of its own venv, in the
    cgroup when `preexec` joins it): `prompt_len` tokens of prompt, `warmup` untimed tokens, then `tokens` timed,
    one engine step each; `run_one`'s fields. vLLM loads every weight before it runs (not timed: `load_s`), so its
    bytes read are the whole process's, loading included (`disk_read_includes_load`)."""
    import hashlib

    from expertcache.runtime.bench import vllm

    r = vllm.bench(python, ckpt, "decode", _prompt_ids(ckpt, prompt_len), warmup, tokens, threads, preexec,
                   timeout_s, log)
    t = np.asarray(r["tpot_s"], dtype=float)
    return {"system": system, "load_s": r["load_s"], "tokens_timed": tokens, "tpot_median_s": float(np.median(t)),
            "tpot_p90_s": float(np.percentile(t, 90)), "tokens_per_s": float(1 / np.median(t)),
            "tpot_s": t.tolist(), "tpot_is_run_mean": False, "peak_rss_bytes": r["peak_rss_bytes"],
            "disk_read_bytes_load": None, "disk_read_bytes_per_token": r["read_bytes"] / (1 + warmup + tokens),
            "disk_read_includes_load": True, "disk_read_bytes_run": r["read_bytes"],
            "output_tokens_sha": hashlib.sha256(json.dumps(r["output_ids"]).encode()).hexdigest()[:16],
            "routing_positions": None, "vllm_version": r["vllm_version"], "threads": r["threads"], "cmd": r["cmd"]}


def run_vllm_prefill(system: str, python: Path, ckpt: Path, prompt_len: int, threads: int, preexec=None,
                     timeout_s: float = 3600, log: Path | None = None) -> dict:
    """One cold prefill of vLLM (its own process, in the cgroup when `preexec` joins it): `run_prefill`'s fields.
    `ttft_s` is from the request's arrival at the loaded engine to its first token; the bytes read are the whole
    process's (loading included, `disk_read_includes_load`)."""
    from expertcache.runtime.bench import vllm

    r = vllm.bench(python, ckpt, "prefill", _prompt_ids(ckpt, prompt_len), 0, 0, threads, preexec, timeout_s, log)
    return {"system": system, "prompt_tokens": prompt_len, "tokens_per_s": prompt_len / r["ttft_s"],
            "ttft_s": r["ttft_s"], "disk_read_bytes": r["read_bytes"], "disk_read_includes_load": True,
            "peak_rss_bytes": r["peak_rss_bytes"], "vllm_version": r["vllm_version"], "threads": r["threads"],
            "cmd": r["cmd"]}


class System(NamedTuple):
    """A registered system of bench big: the names it runs under, how one round of it runs, and what it needs."""
    variants: tuple[str, ...]  # its full names (`mmap`, `mmap:unbounded`); `:unbounded` runs outside the cgroup
    run: Callable[..., dict]  # one round: `run_one` (in the process the runner starts) or `run_llamacpp`
    prefill: Callable[..., dict] | None = None  # one cold prefill: `run_prefill`, or `run_llamacpp_prefill`
    own_process: bool = True  # run by `runner.run_child` (False: it starts its own, llama-bench or vLLM, itself)
    native_only: bool = False  # routes with the checkpoint's own routers (no hook to force a trace's choice)


def _variant(allowed: tuple[str, ...]):
    def convert(arg: str) -> str:
        if arg not in allowed:
            raise ValueError(arg)
        return arg
    return convert


# --systems of bench big: each system a registered runner, `name` or `name:variant`; an expertcache system may add
# its experts format (`:int8`, `:int4`) and engine options after slashes (`parse_system`). Every system but the
# `:unbounded` ones runs inside a memory cgroup of the budget when one can be made; `mmap:unbounded` is the page
# cache a user gets by default (all the free RAM)
SYSTEM_REGISTRY = Registry("system")
SYSTEM_REGISTRY.register("expertcache", System(("expertcache:on-demand", "expertcache:prefetch"), run_one,
                                               run_prefill),
                         takes_arg="config", convert=_variant(("on-demand", "prefetch")),
                         arg_help="on-demand or prefetch, then :int8/:int4 and /key=value engine options")
SYSTEM_REGISTRY.register("accelerate", System(("accelerate",), run_one, run_prefill))
SYSTEM_REGISTRY.register("mmap", System(("mmap", "mmap:unbounded"), run_one, run_prefill), takes_arg="unbounded",
                         default="",
                         convert=_variant(("", "unbounded")), arg_help="mmap or mmap:unbounded")
SYSTEM_REGISTRY.register("llama.cpp", System(("llama.cpp", "llama.cpp:unbounded", "llama.cpp:no-repack"), run_llamacpp,
                                             run_llamacpp_prefill, own_process=False,
                                             native_only=True), takes_arg="variant", default="",
                         convert=_variant(("", "unbounded", "no-repack")),
                         arg_help="llama.cpp, llama.cpp:unbounded, or llama.cpp:no-repack (in the cgroup, weights kept "
                                  "in the mapped file: --repack 0)")
SYSTEM_REGISTRY.register("vllm", System(("vllm", "vllm:unbounded"), run_vllm, run_vllm_prefill, own_process=False,
                                        native_only=True), takes_arg="variant", default="",
                         convert=_variant(("", "unbounded")),
                         arg_help="vllm or vllm:unbounded (vLLM's CPU build in its own venv, every weight loaded "
                                  "first; `python scripts/vllm_peer.py --build_only` makes the venv)")
SYSTEMS = tuple(v for e in SYSTEM_REGISTRY.entries() for v in e.obj.variants)  # every full name, from the registry


def system_entry(name: str) -> System:
    """The registered system a --systems name runs (its format and options stripped: `parse_system`)."""
    return SYSTEM_REGISTRY.get(parse_system(name)[0])


def accelerate_disk(ckpt: Path, budget_gb: float, out_dir: Path, beside_gguf: bool = False) -> str | None:
    """Why accelerate cannot run here (None: it can): its converted copy of what the budget leaves out (about
    the checkpoint less the budget; 26.6 GB for the 33.9 GB checkpoint at 8 GiB) must fit on the disk, which it
    would otherwise fill midway."""
    need = max(0, have_ckpt(ckpt) - int(budget_gb * 2**30)) + (2 << 30)
    free = free_disk(out_dir) + dir_bytes(offload_dir(ckpt))  # a copy already there is rewritten in place
    if free >= need:
        return None
    return (f"its offload copy needs about {need / 1e9:.1f} GB of disk and {free / 1e9:.1f} GB are free beside the "
            f"checkpoint" + (" and the GGUF" if beside_gguf else ""))


def have_ckpt(ckpt: Path) -> int:
    """Bytes of the checkpoint's safetensors files (0 where there is none yet)."""
    return sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))


def offload_dir(ckpt: Path) -> Path:
    """Where accelerate writes its converted copy of what the budget leaves out, beside the checkpoint."""
    return ckpt.parent / (ckpt.name + "-accelerate-offload")


def dir_bytes(d: Path) -> int:
    """Bytes of the files under `d` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0


def _read_bytes() -> int:
    """Bytes this process has read from storage (/proc/self/io read_bytes): page-cache hits excluded."""
    try:
        for line in open("/proc/self/io"):
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


QUANT_GROUP = 32


def quantized_path(ckpt: Path, fmt: str, linears: bool = False) -> Path:
    return ckpt.parent / f"{ckpt.name}-{fmt}-g{QUANT_GROUP}{'-linears' if linears else ''}"


def _slug(system: str) -> str:
    """A system's name as a file name (its logs, its run configuration)."""
    return system.replace(":", "-").replace("/", "+")


def system_names(systems, experts=("bf16",)) -> list[str]:
    """Each expertcache system once per experts format (`expertcache:on-demand:int4`, before any `/key=value`;
    bf16 keeps the plain name); the peers once (they read the bf16 checkpoint)."""
    out = []
    for s in systems:
        if s.startswith("expertcache"):
            head, slash, opts = s.partition("/")
            out += [s if f == "bf16" else f"{head}:{f}{slash}{opts}" for f in experts]
        else:
            out.append(s)
    return out


def bench_big(out_dir: str | Path = "runs/bench-big", trace: str | Path | None = None, budget_gb: float = 8.0,
              tokens: int = 64, warmup: int = 8, prompt_len: int = 8, rounds: int = 3, systems=SYSTEMS,
              ram_factor: float = 1.25, layers: int | None = None, slow_tokens: int = 8, slow_warmup: int = 2,
              engine: EngineConfig = EngineConfig(tier="disk"), timeout_s: int = 3600, progress=None,
              experts=("bf16",), routing: str = "trace", cgroup: bool = True, keep_gguf: bool = False,
              llamacpp_dir: str | Path | None = None, quant_linears: bool = False, prefill=(), decode: bool = True,
              llamacpp_build: bool = True, checkpoint: str = "bf16") -> dict:
    """Write (or reuse) the checkpoint, then run every system `rounds` times, alternated, each in its own process.
    `slow_tokens`/`slow_warmup`: the token counts for accelerate, whose per-token time is minutes-scale here.
    `experts`: the formats expertcache serves (int8/int4: `expertcache quantize` copies, group 32, reused;
    `quant_linears`: with the non-expert linear layers packed too, `quantize --linears true`).
    `engine`: how expertcache serves (its capacity is what the budget leaves). `routing`: trace | native.
    `cgroup`: run every system but `mmap:unbounded` inside one memory cgroup of `budget_gb` (resident memory and
    page cache), when one can be made (root). llama.cpp systems: the checkpoint converted to a BF16 GGUF beside it
    (llama.cpp built from the PyPI sdist's source in `llamacpp_dir`, default `runtime.llamacpp.cache_dir()`); the
    GGUF is deleted when done unless `keep_gguf`. A llama.cpp step that fails skips its systems with the reason in
    the JSON (`skipped`); `llamacpp_build` False skips them when llama.cpp is not built already.
    `prefill`: prompt lengths of the prefill phase (`bigprefill`: one cold prefill per length, system and round,
    alternated, then one prefill per length with every expert resident for the roofline); `decode` False runs the
    prefill phase alone.
    `checkpoint` q4_0: no bf16 checkpoint; a llama.cpp Q4_0 GGUF of the same random draws is written directly
    (`bigckpt.write_gguf_q4_0`) and imported (`import-gguf`: the same codes and scales, attention and the output head
    packed too) as the int4 checkpoint every expertcache system reads, while llama.cpp reads the GGUF itself:
    `experts` must be (int4,) and `quant_linears` True; mmap and accelerate, which read bf16, cannot run."""
    from expertcache.runtime.bench.memcg import MemoryCgroup
    from expertcache.runtime.bench.replay import REFERENCE_TRACE

    trace = trace or REFERENCE_TRACE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    q4_0 = checkpoint == "q4_0"  # (checked by `check_checkpoint` before anything is written)
    per_layer = EXPERTS * (q4_0_expert_bytes() if q4_0 else expert_bytes())
    want = layers or int(np.ceil(ram_factor * physical_ram() / per_layer))
    # q4_0's own names: its int4 copy is the GGUF's import, never the bf16 checkpoint's `quantize` copy
    ckpt = out_dir / ("qwen3-30b-a3b-shaped-q4_0" if q4_0 else "qwen3-30b-a3b-shaped")
    given_gguf = out_dir / f"{ckpt.name}.gguf" if q4_0 else None
    have = (dir_bytes(quantized_path(ckpt, "int4", True))
            + (given_gguf.stat().st_size if given_gguf.is_file() else 0)) if q4_0 else have_ckpt(ckpt)
    # the bf16 checkpoint's experts, or the GGUF's and their imported copy's; 4 GiB kept free
    fits = int((free_disk(out_dir) + have - (4 << 30)) // (per_layer * (2 if q4_0 else 1)))
    n_layers = min(want, fits, 48)
    note = None if n_layers >= want else f"disk holds {n_layers} layers; {want} wanted for {ram_factor}x RAM"
    if n_layers < 2:
        raise InputError(f"not enough free disk for even 2 layers of experts ({per_layer / 1e9:.1f} GB each)")
    if q4_0:
        write_gguf_q4_0(given_gguf, n_layers, progress=progress)
        q = quantized_path(ckpt, "int4", True)
        have_layers = json.loads((q / "config.json").read_text())["num_hidden_layers"] \
            if (q / "config.json").is_file() else None
        if have_layers != n_layers or q.stat().st_mtime < given_gguf.stat().st_mtime:  # (re)written since
            from expertcache.runtime.kernels.gguf_import import import_gguf

            import_gguf(given_gguf, q, overwrite=True)
    else:
        write_checkpoint(ckpt, n_layers, progress=progress)
    for f in experts if not q4_0 else ():
        q = quantized_path(ckpt, f, quant_linears)
        if f != "bf16" and not (q / "config.json").is_file():
            from expertcache.runtime.kernels.quant_write import write_quantized

            write_quantized(ckpt, q, 8 if f == "int8" else 4, QUANT_GROUP, progress=lambda: progress and progress(1),
                            linears=quant_linears)
    systems = system_names(systems, experts)
    threads = torch.get_num_threads()  # what each system's own process gets (torch's default here)
    if any(s.startswith("expertcache") for s in systems):  # the CPU kernels built here if they must be, not by the
        from expertcache.runtime.kernels.cpu_kernels import load as load_kernels  # first round: inside the cgroup, beside a loaded model, a

        load_kernels()  # build crawled along at half a core for over ten minutes, its time the run's
    bins, gguf_path, skipped = prepare_llamacpp(systems, routing, ckpt, out_dir, llamacpp_dir, llamacpp_build,
                                                given_gguf)
    why = accelerate_disk(ckpt, budget_gb, out_dir, gguf_path is not None) if "accelerate" in systems else None
    if why:
        skipped["accelerate"] = why
    vllm_python, why = prepare_vllm(systems, routing, ckpt, int(budget_gb * 2**30) if cgroup else None)
    skipped.update(why)
    systems = [s for s in systems if s not in skipped]
    start = TRACE_START
    cg, cg_note = MemoryCgroup.create(int(budget_gb * 2**30)) if cgroup else (None, "--cgroup false")
    # the peers that start their own process: what each reads (llama.cpp: its build and GGUF; vLLM: its venv's
    # python and the bf16 checkpoint), and the error its steps raise
    from expertcache.runtime.bench.llamacpp import LlamaCppError
    from expertcache.runtime.bench.vllm import VllmError

    peer_args = {"llama.cpp": (bins, gguf_path), "vllm": (vllm_python, ckpt)}
    peer_errors = (LlamaCppError, VllmError)

    def peer(s: str) -> tuple:  # what a peer system's runner reads, by its registered name
        return peer_args[parse_system(s)[0].split(":")[0]]
    job = {"ckpt": str(ckpt), "trace": str(trace), "budget_gb": budget_gb, "prompt_len": prompt_len, "start": start,
           "routing": routing, "quant_linears": quant_linears}
    configs = {}  # each system's run configuration, written once: the file its process reads
    for s in systems:
        if system_entry(s).own_process:
            slow = s == "accelerate"
            configs[s] = write_run_config(out_dir / f"{_slug(s)}.run.yaml", s, dict(
                job, tokens=slow_tokens if slow else tokens, warmup=slow_warmup if slow else warmup), engine)

    def one_round(s: str, r: int) -> dict:
        bounded = cg if cg is not None and not s.endswith(":unbounded") else None
        log = out_dir / f"{_slug(s)}-round{r}.log"
        if s in configs:
            return run_process(configs[s], log, bounded, timeout_s)
        from expertcache.runtime.bench.runner import cold_start

        dropped = cold_start(bounded)
        try:
            x = system_entry(s).run(s, *peer(s), tokens, warmup, prompt_len, threads,
                                    bounded.preexec if bounded else None, timeout_s, log)
            return {**x, "cgroup_peak_bytes": bounded.peak_bytes() if bounded else None, "page_cache_dropped": dropped}
        except peer_errors as e:
            return {"error": str(e), "page_cache_dropped": dropped}

    def one_prefill_round(s: str, r: int) -> list[dict]:  # one cold prefill per prompt length, each its own process
        from expertcache.runtime.bench.runner import cold_start

        bounded = cg if cg is not None and not s.endswith(":unbounded") else None
        out = []
        for n in prefill:
            log = out_dir / f"{_slug(s)}-prefill{n}-round{r}.log"
            if system_entry(s).own_process:
                cfg = write_run_config(out_dir / f"{_slug(s)}.prefill{n}.run.yaml", s,
                                       dict(job, tokens=tokens, warmup=warmup, prompt_len=n), engine, "prefill")
                x = run_process(cfg, log, bounded, timeout_s)
            else:
                dropped = cold_start(bounded)
                try:
                    x = {**system_entry(s).prefill(s, *peer(s), n, threads, bounded.preexec if bounded else None,
                                                    timeout_s, log),
                         "cgroup_peak_bytes": bounded.peak_bytes() if bounded else None, "page_cache_dropped": dropped}
                except peer_errors as e:
                    x = {"error": str(e), "page_cache_dropped": dropped}
            out.append({**x, "prompt_tokens": n})
            if progress:
                progress(0, f"{s} prefill {n} round {r + 1}/{rounds}: "
                         + (x["error"] if "error" in x else f"{x['tokens_per_s']:.1f} tokens/s"))
        return out

    load_avg = [os.getloadavg()]  # what else ran on this machine (1, 5, 15 minutes), at the start and the end
    try:  # the order reversed every other round; each run in its own process
        runs = alternate(systems, rounds, one_round,
                         after=(lambda s, r, x: progress(0, _done(s, r, rounds, x))) if progress else None) \
            if decode else {s: [] for s in systems}
        pre = alternate(systems, rounds, one_prefill_round) if prefill else {}
    finally:
        if cg is not None:
            cg.close()
    resident = resident_prefills(prefill, ckpt, n_layers * per_layer, job, tokens, warmup, engine, out_dir,
                                 timeout_s, experts[0]) if prefill else {}
    load_avg.append(os.getloadavg())
    cold = [x["page_cache_dropped"] for rs in runs.values() for x in rs] \
        + [x["page_cache_dropped"] for rs in pre.values() for r in rs for x in r]
    gguf_bytes = gguf_path.stat().st_size if gguf_path is not None and gguf_path.exists() else 0
    if gguf_path is not None and not keep_gguf and not q4_0:  # q4_0's GGUF is the checkpoint itself: kept
        gguf_path.unlink(missing_ok=True)
    disk_used = have_ckpt(ckpt)
    off = offload_dir(ckpt)
    quant_used = {f: sum(p.stat().st_size for p in quantized_path(ckpt, f, quant_linears).iterdir() if p.is_file())
                  for f in experts if f != "bf16"}
    res = {"inputs": {"shape": {"hidden": HIDDEN, "experts": EXPERTS, "expert": [HIDDEN, INTER], "top_k": TOP_K,
                                "heads": [HEADS, KV_HEADS, HEAD_DIM], "vocab": 32768,
                                "dtype": "q4_0" if q4_0 else "bfloat16"}, "checkpoint": checkpoint,
                      "layers": n_layers, "expert_bytes_total": n_layers * per_layer, "physical_ram": physical_ram(),
                      "experts_over_ram": n_layers * per_layer / physical_ram(), "note": note,
                      "budget_gb": budget_gb, "tokens": tokens, "warmup": warmup,
                      "accelerate_tokens": slow_tokens, "accelerate_warmup": slow_warmup, "prompt_len": prompt_len,
                      "trace": str(trace) if routing == "trace" else None, "trace_start": start, "rounds": rounds,
                      "engine": asdict(engine),
                      "experts": list(experts), "quant_group": QUANT_GROUP, "quant_linears": quant_linears,
                      "torch_threads": threads, "llamacpp_threads": threads, "prefill": list(prefill),
                      "decode": decode, "load_average_start_end": load_avg,
                      "page_cache_dropped_before_each": all(cold)},
           "disk_used_bytes": {"checkpoint": given_gguf.stat().st_size if q4_0 else disk_used,
                               **{f"checkpoint_{f}": b for f, b in quant_used.items()},
                               "accelerate_offload": dir_bytes(off),
                               "llamacpp_gguf": 0 if q4_0 else gguf_bytes,  # q4_0: the checkpoint itself
                               "llamacpp_gguf_kept": bool(gguf_bytes and (keep_gguf or q4_0))},
           "rounds": rounds, "routing": routing,
           "memory_cgroup_bytes": cg.limit_bytes if cg is not None else None,
           "memory_cgroup_note": (f"every system but the :unbounded ones ran inside a {cg.limit_bytes / 2**30:g} GiB "
                                  f"memory cgroup (v{2 if cg.v2 else 1}: resident memory and page cache)")
           if cg is not None else f"no memory cgroup ({cg_note}): every system ran unbounded",
           "skipped": skipped, "systems": {}}
    if off.is_dir():  # accelerate rewrites its copy at every load: nothing to keep (its size is counted above)
        import shutil

        shutil.rmtree(off, ignore_errors=True)
    for s, why in skipped.items():
        res["systems"][s] = {"runs": 0, "errors": [], "skipped": why}
    for s, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        row = {"runs": len(rs), "errors": [x["error"] for x in rs if "error" in x]}
        if ok:
            t = np.concatenate([x["tpot_s"] for x in ok])
            row.update({"tpot_median_s": float(np.median(t)), "tpot_p90_s": float(np.percentile(t, 90)),
                        "tpot_mean_s": float(np.mean(t)),
                        "tokens_per_s": float(1 / np.median(t)), "tokens_timed": int(len(t)),
                        "peak_rss_bytes": max(x["peak_rss_bytes"] for x in ok),
                        "disk_read_bytes_per_token": float(np.mean([x["disk_read_bytes_per_token"] for x in ok])),
                        "load_s": float(np.mean([x["load_s"] for x in ok])) if ok[0]["load_s"] is not None else None,
                        "same_output_tokens": len({x["output_tokens_sha"] for x in ok}) == 1
                        if ok[0]["output_tokens_sha"] is not None else None,
                        "tpot_round_medians_s": [x["tpot_median_s"] for x in ok],
                        "in_memory_cgroup": ok[0]["cgroup_peak_bytes"] is not None,
                        "cgroup_peak_bytes": max(x["cgroup_peak_bytes"] for x in ok)
                        if ok[0]["cgroup_peak_bytes"] is not None else None})
            for k in ("hit_rate", "stall_per_token_s", "traffic_bytes_per_token", "demand_loads_per_token",
                      "prefetch_loads_per_token", "prefetch_hits_per_token"):
                if k in ok[0]:
                    row[k] = float(np.mean([x[k] for x in ok]))
            if "engine" in ok[0]:
                row["engine"] = ok[0]["engine"]
                # an oracle reads the trace's future: the limit of prefetching on this disk, not a configuration
                # anyone can run (never the best expertcache row)
                row["realisable"] = not str(row["engine"].get("predictor", "")).startswith("oracle")
            for k in ("tpot_is_run_mean", "disk_read_includes_load", "llamacpp_build", "vllm_version", "threads",
                      "cmd"):
                if k in ok[0]:
                    row[k] = ok[0][k]
            if "read_bandwidth" in ok[0]:  # medians over the runs (the achieved figure is None with no reads)
                rb = [x["read_bandwidth"] for x in ok]
                row["read_bandwidth"] = {k: (float(np.median([b[k] for b in rb if b[k] is not None]))
                                             if any(b[k] is not None for b in rb) else None)
                                         for k in rb[0]}
            if "time_budget_s" in ok[0]:  # seconds per token, averaged over the runs
                row["time_budget_s"] = {k: float(np.mean([x["time_budget_s"][k] for x in ok]))
                                        for k in ok[0]["time_budget_s"]}
            if "time_budget_s" in row and row.get("read_bandwidth") and row.get("traffic_bytes_per_token"):
                row["roofline"] = roofline(row["time_budget_s"], row["traffic_bytes_per_token"],
                                           row["read_bandwidth"]["at_queue_depth_GBps"])
        res["systems"][s] = row
    if prefill:
        from expertcache.runtime.bench import bigprefill

        for s, rs in pre.items():
            res["systems"][s]["prefill"] = bigprefill.prefill_rows(rs, prefill)
        res["prefill_roofline"] = bigprefill.roofline(res["systems"], resident, prefill)
        res["roofline_tokens_per_s"] = {n: x["tokens_per_s"] for n, x in res["prefill_roofline"].items()}
        res["prefill_comparisons"] = bigprefill.comparisons(res["systems"], res["prefill_roofline"], prefill)
    res["comparisons"] = comparisons(res["systems"])
    ec = {s: r["tpot_median_s"] for s, r in res["systems"].items() if s.startswith("expertcache")
          and "tpot_median_s" in r and r.get("realisable", True)}
    peers = {s: r["tpot_median_s"] for s, r in res["systems"].items() if not s.startswith("expertcache")
             and "tpot_median_s" in r}
    if ec and peers:
        best_ec, best_peer = min(ec, key=ec.get), min(peers, key=peers.get)
        res["best_expertcache"], res["best_expertcache_tpot_s"] = best_ec, ec[best_ec]
        res["best_peer"] = best_peer
        res["tpot_ratio_vs_best_peer"] = ec[best_ec] / peers[best_peer]
    return res


def resident_prefills(lengths, ckpt: Path, expert_bytes_total: int, job: dict, tokens: int, warmup: int,
                      engine: EngineConfig, out_dir: Path, timeout_s: float, fmt: str = "bf16") -> dict:
    """The roofline's compute term: per prompt length, one prefill by expertcache with every expert in memory
    (`run_prefill(resident=True)`, its own process, no cgroup), when a host copy and the slots of every expert fit
    in the memory available now; else `{"skipped": why}` for each length."""
    from expertcache.runtime.storage.tiers import available_memory

    avail = available_memory()
    need = 2 * expert_bytes_total + RAM_OTHER  # the tier's host copy and the slots, beside the model
    if need > avail:
        return {n: {"skipped": f"every expert resident needs about {need / 2**30:.1f} GiB and "
                               f"{avail / 2**30:.1f} GiB are available"} for n in lengths}
    out = {}
    for n in lengths:
        s = "expertcache:on-demand" + ("" if fmt == "bf16" else f":{fmt}")  # the experts' first format
        cfg = write_run_config(out_dir / f"resident.prefill{n}.run.yaml", s,
                               dict(job, tokens=tokens, warmup=warmup, prompt_len=n), engine, "resident")
        out[n] = run_process(cfg, out_dir / f"resident-prefill{n}.log", None, timeout_s)
    return out


def roofline(budget: dict, traffic_bytes: float, disk_GBps: float) -> dict:
    """This machine's limit for one configuration (METRICS.md's roofline), per token: `t_compute_s` is the time
    budget without its stall (what a token costs with every expert resident, measured in the same runs),
    `t_transfer_s` the expert bytes moved over the disk's measured bandwidth at the engine's queue depth. Reads
    fully overlapped with compute would reach `bound_s` = max of the two; `overlap_efficiency` is that bound over
    the measured mean TPOT (the budget's, the same tokens), `no_overlap_s` their sum."""
    from expertcache.runtime.bench.bench import overlap

    t_c = budget["tpot"] - budget["stall"]
    t_t = traffic_bytes / (disk_GBps * 1e9) if disk_GBps else float("inf")
    return {"t_compute_s": t_c, "t_transfer_s": t_t, "bound_s": max(t_c, t_t), "no_overlap_s": t_c + t_t,
            **overlap(max(t_c, t_t), budget["tpot"])}


def comparisons(systems: dict) -> dict:
    """Each expertcache system against each peer (and against expertcache:on-demand): the ratio of their median
    TPOTs, the range of the per-round ratios' inputs, and whether the ratio is *claimed*: only when the two
    systems' round medians do not overlap (every round of one faster than every round of the other)."""
    out = {}
    ok = {s: r for s, r in systems.items() if r.get("tpot_round_medians_s")}
    for a, ra in ok.items():
        if not a.startswith("expertcache"):
            continue
        others = [b for b in ok if not b.startswith("expertcache")]
        if a != "expertcache:on-demand" and "expertcache:on-demand" in ok:
            others.append("expertcache:on-demand")
        for b in others:
            out[f"{a} vs {b}"] = compare(ra["tpot_round_medians_s"], ok[b]["tpot_round_medians_s"])
    return out


def table(res: dict) -> str:
    rows = ["| system | TPOT med (s) | round medians (s) | p90 (s) | peak RSS (GiB) | cgroup peak (GiB) | "
            "disk read MB/tok | hit | s/tok: experts / stall / other / overhead | "
            "reads GB/s: achieved in flight / disk, one expert at a time / disk at the engine's queue depth |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for s, r in res["systems"].items():
        if "skipped" in r:
            rows.append(f"| {s} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        if "tpot_median_s" not in r:
            why = "; ".join(e[:160] for e in r["errors"]).replace("|", "/")  # one cell: no column breaks
            rows.append(f"| {s} | failed: {why} | | | | | | | | |")
            continue
        budget = " / ".join(f"{r['time_budget_s'][k]:.3f}" for k in ("expert_compute", "stall", "other_compute",
                                                                     "overhead")) if "time_budget_s" in r else "—"
        rb = r.get("read_bandwidth")
        reads = "—" if not rb else (f"{rb['in_flight_GBps']:.2f}" if rb["in_flight_GBps"] is not None else "no reads") \
            + f" / {rb['one_at_a_time_GBps']:.2f} / {rb['at_queue_depth_GBps']:.2f} (depth {rb['queue_depth']:.0f})"
        peak = f"{r['cgroup_peak_bytes'] / 2**30:.2f}" if r.get("cgroup_peak_bytes") else "unbounded"
        name = s + (" (a limit: reads the trace's future)" if r.get("realisable") is False else "")
        read = f"{r['disk_read_bytes_per_token'] / 1e6:.0f}" + (" (with loading)" if r.get("disk_read_includes_load")
                                                                else "")
        hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "—"  # a peer keeps no cache of experts to count
        rows.append(f"| {name} | {r['tpot_median_s']:.3f} | "
                    f"{', '.join(f'{x:.3f}' for x in r.get('tpot_round_medians_s', []))} | {r['tpot_p90_s']:.3f} | "
                    f"{r['peak_rss_bytes'] / 2**30:.2f} | {peak} | {read} | {hit} | {budget} | {reads} |")
    roof = {s: r["roofline"] for s, r in res["systems"].items() if r.get("roofline")}
    if roof:
        def loads(r):  # rows written before these counters existed show none
            if "prefetch_loads_per_token" not in r:
                return "—"
            return (f"{r['demand_loads_per_token']:.1f} / {r['prefetch_loads_per_token']:.1f} "
                    f"({r['prefetch_hits_per_token']:.1f})")

        rows += ["", "| system | s/tok: compute (no stall) | reads at the disk's queue-depth bandwidth | bound: "
                 "max of the two | no overlap: their sum | overlap efficiency | expert reads/tok: on demand / "
                 "prefetched (of those, used) |", "|---|---|---|---|---|---|---|"]
        rows += [f"| {s} | {x['t_compute_s']:.3f} | {x['t_transfer_s']:.3f} | {x['bound_s']:.3f} | "
                 f"{x['no_overlap_s']:.3f} | {x['overlap_efficiency']:.2f}"
                 f"{' (bound above TPOT: unreliable)' if x['roofline_unreliable'] else ''} | "
                 f"{loads(res['systems'][s])} |"
                 for s, x in roof.items()]
    comp = res.get("comparisons", {})
    if comp:
        def pre(r):  # beside each ratio: the prefetches its expertcache system issued and used per token
            if "prefetch_hits_per_token" not in r:
                return "—"
            return f"{r['prefetch_loads_per_token']:.2f} ({r['prefetch_hits_per_token']:.2f})"

        rows += ["", "| comparison | TPOT ratio | claimed (rounds apart) | prefetched/tok (used) |", "|---|---|---|---|"]
        rows += [f"| {k} | {v['ratio']:.2f} | {claim_text(v)} | "
                 f"{pre(res['systems'].get(k.split(' vs ')[0], {}))} |" for k, v in comp.items()]
    return "\n".join(rows)


def plot(res: dict, png: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s for s, r in res["systems"].items() if "tpot_median_s" in r]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    t = [res["systems"][s]["tpot_median_s"] for s in names]
    rss = [res["systems"][s]["peak_rss_bytes"] / 2**30 for s in names]
    ax[0].barh(names, t, color=["C0" if s.startswith("expertcache") else "C7" for s in names])
    if max(t) / min(t) > 10:  # accelerate's seconds beside the others' tenths: a log axis
        ax[0].set_xscale("log")
        ax[0].set_xlabel("TPOT, median (s, log)")
    else:  # bars from zero, so their lengths compare
        ax[0].set_xlabel("TPOT, median (s)")
    ax[1].barh(names, rss, color=["C0" if s.startswith("expertcache") else "C7" for s in names])
    ax[1].axvline(res["inputs"]["budget_gb"], color="C3", ls="--", label="memory budget")
    ax[1].set_xlabel("peak RSS (GiB)")
    ax[1].legend(loc="lower right")
    i = res["inputs"]
    fig.suptitle(f"{i['layers']} layers x 128 experts ({i['expert_bytes_total'] / 2**30:.1f} GiB of experts, "
                 f"{i['experts_over_ram']:.2f}x RAM), {i['shape'].get('dtype', 'bfloat16')}, "
                 + ("reference Qwen3-30B-A3B routing" if res.get("routing", "trace") == "trace" else "native routing"))
    fig.tight_layout()
    from expertcache.telemetry.atomic import write_figure

    write_figure(fig, png)
    plt.close(fig)


def main(argv=None) -> int:
    """One round of one system of `expertcache bench big` in its own process (its memory measured alone), started by
    `runner.run_child`: the argument is its run configuration (a YAML file `write_run_config` wrote; this is no
    user command); prints one JSON line."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m expertcache.runtime.bench.bigbench RUN_CONFIG.yaml (run by `expertcache bench big`)",
              file=sys.stderr)
        return 2
    cfg = load_run_config(argv[0])
    phase, entry = cfg.pop("phase"), system_entry(cfg["system"])
    # the registered runner of its system, for the phase asked for
    res = entry.run(**cfg) if phase == "decode" else entry.prefill(**cfg, resident=phase == "resident")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
