"""The CPU expert kernels (`runtime/kernels/csrc/experts_cpu.cpp`): one or a few tokens through k experts' SwiGLU MLPs in
bf16, int8 or int4, reading each weight once, with AVX-512 BF16 / VNNI.

The extension is compiled on first use with `torch.utils.cpp_extension` (a C++ compiler and ninja are needed; `make
install` builds it once) into a cache folder keyed by the source's hash and torch's version. Where it cannot be built
or loaded (no compiler, a CPU without AVX-512 BF16 and VNNI, a failed build), `available()` is False, one warning line
says why, and every caller keeps the torch path: nothing here ever raises on import.

Threads: the kernels split their work over torch's intra-op threads (`torch.set_num_threads`; `--threads` in the
benchmarks). Set `EXPERTCACHE_NO_EXT=1` to skip the extension.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import platform
import threading
import warnings
from pathlib import Path

import torch

_SRC = Path(__file__).parent / "csrc" / "experts_cpu.cpp"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma",
          "-mf16c", "-std=c++17", "-fopenmp"]  # at::parallel_for is OpenMP in torch's CPU wheels
_AMX_FLAGS = ["-mamx-tile", "-mamx-bf16"]  # added where the compiler knows them (the tile code is used only where
                                          # the CPU has the units: `amx_available`)
_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")
_lock = threading.Lock()
_state: dict = {}


def flags() -> list[str]:
    """The build's flags: `_FLAGS`, and AMX's where the C++ compiler accepts them (GCC 11 and later)."""
    if "flags" not in _state:
        import subprocess

        try:
            ok = subprocess.run([os.environ.get("CXX", "c++"), *_AMX_FLAGS, "-x", "c++", "-E", "-"], input=b"",
                                capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        _state["flags"] = _FLAGS + (_AMX_FLAGS if ok else [])
    return _state["flags"]


def cache_dir() -> Path:
    base = os.environ.get("EXPERTCACHE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "expertcache")
    # keyed by the source, the flags and the torch it builds against (its headers' path is in ninja's build file:
    # two environments sharing one folder, a clean clone's `make test` venv beside the working tree's, rebuilt
    # each other's extension on every switch)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    digest = hashlib.sha256(_SRC.read_bytes() + " ".join(flags()).encode() + torch_dir.encode()).hexdigest()[:16]
    return Path(base) / "ext" / f"torch{torch.__version__.replace('+', '_')}-{digest}"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _why_not() -> str | None:
    if os.environ.get("EXPERTCACHE_NO_EXT"):
        return "EXPERTCACHE_NO_EXT is set"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are written for x86-64 with AVX-512, not {platform.machine()}"
    missing = [f for f in _NEEDS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


@contextlib.contextmanager
def _build_lock(d: Path):
    """One build at a time in `d`, under a lock the kernel drops when its holder dies (`flock`). torch's own lock
    is a file that a build killed midway (Ctrl-C, an out-of-memory kill) leaves behind, and every later process
    then waited on it forever, silently; holding ours, any such file is stale, and it goes."""
    import fcntl
    import sys

    fd = os.open(d / ".build.flock", os.O_RDWR | os.O_CREAT, 0o644)  # a lock, never written
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        stale = d / "lock"
        if stale.exists():
            print(f"expertcache: removing {stale}, left by a build of the CPU kernels that was killed",
                  file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # the flock goes with it


def load(verbose: bool = False) -> bool:
    """Build (once, cached) and load the extension; True when its ops are usable. Never raises."""
    if "ok" in _state:  # decided: no lock on the per-call path (`quant.swiglu` asks on every layer)
        return _state["ok"]
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        why = _why_not()
        if why is None:
            try:
                from torch.utils import cpp_extension

                d = cache_dir()
                d.mkdir(parents=True, exist_ok=True)
                if not (d / "expertcache_cpu.so").is_file():  # the first use on this machine: say why it waits
                    import sys

                    print(f"expertcache: building the CPU expert kernels once (about 10 s; cached in {d})",
                          file=sys.stderr, flush=True)
                with _build_lock(d):
                    # built from a copy inside the (content-keyed) folder: ninja's build file names its source by
                    # path, so two checkouts of the same code (a clean clone's `make test` beside the working tree)
                    # rebuilt each other's extension, minutes each time, and inside `bench big`'s memory cgroup
                    src = d / _SRC.name  # the folder is keyed by the source's bytes: a copy there is this one
                    if not src.is_file():
                        from expertcache.telemetry.atomic import write_bytes

                        write_bytes(src, _SRC.read_bytes())
                    cpp_extension.load(name="expertcache_cpu", sources=[str(src)], extra_cflags=flags(),
                                       extra_ldflags=["-fopenmp"],
                                       build_directory=str(d), is_python_module=False, verbose=verbose)
                torch.ops.expertcache_cpu.read_bytes  # noqa: B018 - registered?
                _state["ok"] = True  # (set_tuning's callers check it)
                try:
                    _apply_tuning(d)
                except Exception as e:  # noqa: BLE001 - the kernels stay usable; the defaults are kept
                    _state["tuning"] = {"source": f"defaults (the measurement failed: {type(e).__name__}: {e})"}
                    warnings.warn(f"expertcache: the CPU kernels keep their built-in prefetch distances "
                                  f"({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
            except Exception as e:  # noqa: BLE001 - any failure falls back; the line says what it was
                msg = str(e).strip().splitlines()
                why = f"the build failed ({type(e).__name__}: {msg[-1] if msg else ''})"
        _state["ok"] = why is None
        _state["why"] = why
        if why is not None:
            warnings.warn(f"expertcache: CPU expert kernels unavailable ({why}); experts compute with torch",
                          RuntimeWarning, stacklevel=2)
        return _state["ok"]


def available() -> bool:
    return load()


def why_unavailable() -> str | None:
    load()
    return _state.get("why")


# --- prefetch distances chosen on this machine -------------------------------------------------------------------
# The integer kernels' software prefetch distance (bytes ahead along a row) and the int4 group-32 kernels' scale
# prefetch (rows ahead) are settings of the extension (`set_tuning`). At first use on a machine, `load` calls
# `_apply_tuning`: `measure_prefetch` times the int8 and int4 expert kernels at one thread on Qwen3-30B-A3B's expert
# shape, 8 experts drawn from a pool larger than any cache, under each candidate, alternated over rounds, and
# `choose` keeps the fastest of those clearly faster than the built-in default (by TUNE_MARGIN in the median, and in
# TUNE_WINS of the rounds), else the default. The choice and every candidate's median time go to `tuning.json` beside
# the build, keyed by the CPU, and later processes read it. `EXPERTCACHE_TUNE=off` keeps the built-in defaults (the
# tests run so), `EXPERTCACHE_TUNE=again` measures anew. Prefetching never changes a result, only its time.
TUNE_DISTANCES = (0, 2048, 4096, 8192, 16384, 32768)
TUNE_SCALE_ROWS = (0, 16)
TUNE_DEFAULTS = {"pf_int8": 8192, "pf_int4": 8192, "scale_rows": 16}
TUNE_MARGIN = 0.05  # a candidate replaces the default only when its median is this much faster
TUNE_WINS = 0.85  # and it beat the default in this share of the rounds (paired within each round): 6 of 7
_TUNE_FILE = "tuning.json"


def set_tuning(pf_int8: int = -1, pf_int4: int = -1, scale_rows: int = -1, pf_bf16: int = -1) -> dict:
    """Set the extension's prefetch settings (a negative one is left as it is); returns them as they were."""
    was = torch.ops.expertcache_cpu.set_tuning(pf_bf16, pf_int8, pf_int4, scale_rows)
    return {"pf_bf16": was[0], "pf_int8": was[1], "pf_int4": was[2], "scale_rows": was[3]}


def tuning() -> dict:
    """The settings in force (after `load`, which applies this machine's tuning): the prefetch distances, the
    pairs per expert from which a prompt's packed experts take the GEMM (`gemm_pairs`), and `source`: the tuning
    file they came from, or the defaults."""
    load()
    return ({**set_tuning(), "gemm_pairs": {f"int{b}": n for b, n in GEMM_PAIRS.items()},
             "source": _state.get("tuning", {}).get("source")} if _state.get("ok") else {})


def choose(times: dict, default) -> tuple:
    """(the choice, median per candidate, rounds each beat the default in) from per-round times {candidate: [s]}:
    the fastest median among candidates clearly faster than `default` (TUNE_MARGIN in the median, and faster in the
    same round in TUNE_WINS of the rounds), else `default`."""
    import statistics

    med = {c: statistics.median(v) for c, v in times.items()}
    wins = {c: sum(a < b for a, b in zip(v, times[default])) for c, v in times.items()}
    n = len(times[default])
    clear = [c for c in med if med[c] <= (1 - TUNE_MARGIN) * med[default] and wins[c] >= TUNE_WINS * n]
    return (min(clear, key=med.get) if clear else default), med, wins


def _packed_pool(n: int, rows: int, cols: int, bits: int) -> dict:
    """`n` packed experts' matrices `[n, rows, cols]` (group 32) written directly, for timing (the values do not
    change the time; a random fill costs more than it measures): codes of one byte pattern, one small scale and
    minimum throughout."""
    t = {"q": torch.full((n, rows, cols * bits // 8), 0x35, dtype=torch.int8 if bits == 8 else torch.uint8),
         "scales": torch.full((n, rows, cols // 32), 0.01, dtype=torch.float16)}
    if bits == 4:
        t["mins"] = torch.full((n, rows, cols // 32), -0.05, dtype=torch.float16)
    return t


def measure_prefetch(rounds: int = 7, calls: int = 8, pool: int = 24) -> dict:
    """Median seconds per call of the int8 and int4 (group 32) expert kernels under each candidate, one thread,
    candidates alternated within each round; and the setting `choose` keeps per format."""
    import time

    from expertcache.runtime.bench.harness import alternate

    if not load():
        raise RuntimeError(f"measure_prefetch: the CPU kernels are unavailable ({why_unavailable()})")
    H, I, k = 2048, 768, 8
    if pool < k:
        raise ValueError(f"measure_prefetch: a pool of {pool} experts cannot give {k} distinct ones a call")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    was = set_tuning()
    try:
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(1, H, generator=g) * 0.5).bfloat16()
        w = torch.full((1, k), 1.0 / k)
        draws = [torch.randperm(pool, generator=g)[:k][None] for _ in range(calls)]
        out = {}
        for bits in (8, 4):
            gu, dn = _packed_pool(pool, 2 * I, H, bits), _packed_pool(pool, H, I, bits)
            fmt = f"int{bits}"
            cands = [(d, s) for d in TUNE_DISTANCES for s in (TUNE_SCALE_ROWS if bits == 4 else (was["scale_rows"],))]
            for s in draws[:2]:  # warm: the first touch of the pool's pages is not a kernel's time
                swiglu_q(x, gu, dn, bits, 32, s, w)

            def timed(c: tuple, _r: int) -> float:  # one round of candidate c = (distance, scale rows)
                set_tuning(**{f"pf_{fmt}": c[0], "scale_rows": c[1]})
                t0 = time.perf_counter()
                for s in draws:
                    swiglu_q(x, gu, dn, bits, 32, s, w)
                return (time.perf_counter() - t0) / calls

            times = alternate(cands, rounds, timed)
            default = (TUNE_DEFAULTS[f"pf_{fmt}"], TUNE_DEFAULTS["scale_rows"] if bits == 4 else was["scale_rows"])
            best, med, wins = choose(times, default)
            out[fmt] = {"best": {"distance": best[0], "scale_rows": best[1]}, "default_s": med[default],
                        "best_s": med[best], "rounds": rounds,
                        "bytes_per_call": k * sum(t.nbytes for t in (*gu.values(), *dn.values())) // pool,
                        "candidates": [{"distance": c[0], "scale_rows": c[1], "s": v, "rounds_beating_default": wins[c]}
                                       for c, v in med.items()]}
            del gu, dn
        return out
    finally:
        set_tuning(**{k_: v for k_, v in was.items()})
        torch.set_num_threads(threads)


def _apply_tuning(d: Path) -> None:
    """Called by `load` once the extension is in: this machine's settings from `d`/tuning.json, measured first if
    there are none for this CPU (under the build's lock: one process measures, the others wait and read)."""
    import json
    import sys

    mode = os.environ.get("EXPERTCACHE_TUNE", "").strip().lower()
    if mode not in ("", "on", "off", "again"):
        warnings.warn(f"expertcache: EXPERTCACHE_TUNE={mode!r} is not one of on, off, again; taken as on",
                      RuntimeWarning, stacklevel=3)
    if mode == "off":
        _state["tuning"] = {"source": "defaults (EXPERTCACHE_TUNE=off)", **TUNE_DEFAULTS}
        return
    from expertcache.runtime.bench.results import cpu_model

    path, cpu = d / _TUNE_FILE, cpu_model()

    def read():
        try:
            rec = json.loads(path.read_text())
            return rec if (rec.get("cpu") == cpu and rec.get("defaults") == TUNE_DEFAULTS
                           and {"int8", "int4"} <= set(rec.get("gemm_pairs") or {})) else None
        except (OSError, ValueError, AttributeError):
            return None

    rec = None if mode == "again" else read()
    if rec is None:
        with _build_lock(d):
            rec = None if mode == "again" else read()
            if rec is None:
                print("expertcache: choosing the CPU kernels' prefetch distances, and the pairs per expert at "
                      "which a prompt's packed experts take the GEMM, for this machine (once, about 6 s; "
                      f"EXPERTCACHE_TUNE=off skips it; kept in {path})", file=sys.stderr, flush=True)
                m = measure_prefetch()
                gm = measure_gemm_pairs()
                rec = {"cpu": cpu, "defaults": TUNE_DEFAULTS, "threads": 1,
                       "choice": {"pf_int8": m["int8"]["best"]["distance"], "pf_int4": m["int4"]["best"]["distance"],
                                  "scale_rows": m["int4"]["best"]["scale_rows"]},
                       "gemm_pairs": {"int8": gm["int8"]["pairs"], "int4": gm["int4"]["pairs"]},
                       "measured": m, "measured_gemm": gm}
                from expertcache.telemetry.atomic import write_text

                write_text(path, json.dumps(rec, indent=1))
    set_tuning(**rec["choice"])
    GEMM_PAIRS.update({8: int(rec["gemm_pairs"]["int8"]), 4: int(rec["gemm_pairs"]["int4"])})
    _state["tuning"] = {"source": str(path), **rec["choice"], "gemm_pairs": dict(rec["gemm_pairs"])}


def swiglu_bf16(x, gate_up, down, slots, weights) -> torch.Tensor:
    """x [T, H], gate_up [S, 2I, H] bf16, down [S, H, I] bf16, slots [T, k], weights [T, k] -> y [T, H] in x's
    dtype (fp32 accumulation)."""
    return torch.ops.expertcache_cpu.swiglu_bf16(x, gate_up, down, slots, weights).to(x.dtype)


def linear_bf16(x, weight, bias=None) -> torch.Tensor:
    """`F.linear` for a few rows of bf16 weights: x [..., in] -> [..., out] in x's dtype (fp32 accumulation)."""
    lead = x.shape[:-1]
    y = torch.ops.expertcache_cpu.linear_bf16(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.to(x.dtype).reshape(*lead, weight.shape[0])


MAX_ROWS = 8  # decode-sized calls take the kernels; a prefill's GEMM stays with torch (oneDNN)
# The bf16 expert kernel reads each expert's weights once for the tokens that chose it and computes its (token,
# choice) pairs one dot product at a time; torch's GEMMs (the family's forward) compute an expert's pairs together
# at a fixed cost per expert. So the kernel wins while experts have few pairs each, whatever the rows: a decode step,
# a prompt chunk spread over most experts. Per layer of the 4-layer Qwen3-30B-A3B shape (128 experts, top-8, random
# routing), every expert resident, AMD EPYC, kernel vs torch: 1 thread, 36 rows 34 vs 76 ms, 72 rows 54 vs 97,
# 144 rows (9 pairs an expert) 97 vs 114, 288 rows 180 vs 122; 2 threads 30 vs 54, 40 vs 67, 64 vs 67, 112 vs 94
# (and a 512-token prompt: ~270 tokens/s through the kernel, ~960 through torch, 2 threads).
EXPERT_ROWS = 32  # calls of at most this many rows take the kernel
PAIRS_PER_EXPERT = 8  # larger calls take it while their pairs are at most this many per expert they touch


def expert_rows_fit(slots: torch.Tensor) -> bool:
    """Whether the bf16 expert kernel should compute a call whose (token, choice) pairs go to `slots` `[T, k]`:
    at most `EXPERT_ROWS` rows, or at most `PAIRS_PER_EXPERT` pairs per slot they touch."""
    if slots.shape[0] <= EXPERT_ROWS:
        return True
    return slots.numel() <= PAIRS_PER_EXPERT * int(torch.unique(slots).numel())


def decode_input(x) -> bool:
    """Whether `x` is an input the decode kernels take: on the CPU, at most `MAX_ROWS` rows, no grad (training
    keeps torch's autograd path; a prefill's GEMM stays with torch)."""
    return (isinstance(x, torch.Tensor) and not x.is_cuda and x.dim() >= 1
            and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and not torch.is_grad_enabled())


def decode_sized(x, w) -> bool:
    """Whether `F.linear(x, w)` is one `linear_bf16` takes: a `decode_input` in bf16 and a 2-D bf16 weight with
    contiguous rows on the CPU."""
    return (decode_input(x) and x.dtype == torch.bfloat16 and isinstance(w, torch.Tensor)
            and w.dtype == torch.bfloat16 and w.dim() == 2 and not w.is_cuda and w.stride(-1) == 1)


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    """transformers' RMSNorm in one call: `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`, fp32 inside; x and
    weight both bf16 or both fp32."""
    return torch.ops.expertcache_cpu.rms_norm(x, weight, eps)


def route_topk(x, weight, k: int, norm: bool):
    """A top-k router in one call: (logits [T, E] bf16, weights [T, k] bf16, experts [T, k] int64) for bf16 x [T, H]
    and weight [E, H]: the logits as `linear_bf16` computes them, then softmax in fp32, `torch.topk`, renormalized
    to sum 1 when `norm`, as transformers' top-k routers do."""
    return torch.ops.expertcache_cpu.route_topk(x, weight, k, norm)


def qk_norm_rope(q, k, wq, wk, eps_q: float, eps_k: float, cos, sin):
    """The decode step's query and key heads through their RMSNorms and the rotary embedding: q [B, 1, Hq, D] and
    k [B, 1, Hk, D] bf16 (the projections viewed per head), norm weights [D], cos / sin [B, 1, D] -> (q, k)
    [B, H, 1, D], bit for bit what `q_norm`, `k_norm`, the transpose and `apply_rotary_pos_emb` give."""
    return torch.ops.expertcache_cpu.qk_norm_rope(q, k, wq, wk, eps_q, eps_k, cos, sin)


def swiglu_q(x, gu: dict, dn: dict, bits: int, group: int, slots, weights) -> torch.Tensor:
    """The integer path: `gu`/`dn` hold `q`, `scales` (and `mins` for int4) as written by `runtime.quant`."""
    return torch.ops.expertcache_cpu.swiglu_q(x, gu["q"], gu["scales"], gu.get("mins"), dn["q"], dn["scales"],
                                              dn.get("mins"), bits, group, slots, weights).to(x.dtype)


# The integer kernel computes a packed expert's (token, choice) pairs one dot product at a time; dequantizing the
# expert (`dequant_q`, about 0.3-0.8 ms for one Qwen3-30B-A3B expert) and multiplying its pairs by torch's GEMM costs
# a fixed amount and far less per pair. An expert with at least this many pairs in one call takes the GEMM. These are
# the defaults (`EXPERTCACHE_TUNE=off`): at first use on a machine `measure_gemm_pairs` measures where the two paths
# cross there, and `_apply_tuning` keeps it beside the build with the prefetch distances. On this AMD EPYC, 2 threads,
# it measured 16 (int8) and 24 (int4) in 2 of 3 processes, 24 and 32 in the third (near the crossing the two paths
# are within 10% of each other per expert), 12 and 24 at one thread. A whole layer (128 experts, random
# top-8, 2 threads, medians of 5): int4 at 512 tokens 194 ms on the kernel, 128-130 ms from 16 or 24 pairs, 160 from
# 32; int8 204 ms, 114 from 16. A decode step (a pair or two per expert) never reaches it; a prompt chunk's do.
GEMM_PAIRS = {8: 16, 4: 24}
_bufs = threading.local()  # each thread's dequantization buffers, reused call after call (`scratch`)
SCRATCH_MAX = 64 << 20  # a larger dequantized matrix (an output head's) is a fresh tensor, freed after its call


def scratch(name: str, dtype: torch.dtype, n: int) -> torch.Tensor | None:
    """This thread's reused buffer `name` of at least `n` values of `dtype` (for `dequant_q`'s `out`: a fresh
    tensor's page faults cost as much as the pass), or None above `SCRATCH_MAX` bytes. Only for a result used within
    the call: a later call overwrites it (never one autograd keeps for a backward)."""
    if n * dtype.itemsize > SCRATCH_MAX:
        return None
    b = getattr(_bufs, name, None)
    if b is None or b.dtype != dtype or b.numel() < n:
        b = torch.empty(n, dtype=dtype)
        setattr(_bufs, name, b)
    return b


def swiglu_q_split(x, gu: dict, dn: dict, bits: int, group: int, slots, weights,
                   min_pairs: int | None = None) -> torch.Tensor:
    """`swiglu_q`'s result with each expert that has at least `min_pairs` (token, choice) pairs in the call
    (`GEMM_PAIRS[bits]` by default) dequantized (`dequant_q`, exactly the weights the kernel multiplies) into a
    reused buffer and multiplied by torch's GEMM in x's dtype (bf16 or fp32; fp16 in fp32; exact activations, as
    `triton_experts.swiglu_reference`), the other pairs through the integer kernel in one call. Every pair is added
    to its token's fp32 sum, then cast to x's dtype. A call with no such expert is `swiglu_q` itself."""
    need = GEMM_PAIRS[bits] if min_pairs is None else max(int(min_pairs), 1)
    t_, k = slots.shape
    if slots.numel() < need or torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad):
        return swiglu_q(x, gu, dn, bits, group, slots, weights)
    flat = slots.reshape(-1)
    used, inv, cnt = torch.unique(flat, return_inverse=True, return_counts=True)  # `used` sorted
    big = cnt >= need
    if not bool(big.any()):
        return swiglu_q(x, gu, dn, bits, group, slots, weights)  # (the kernel checks its inputs)
    n_slots = gu["q"].shape[0]
    if x.shape[0] != t_ or int(used[0]) < 0 or int(used[-1]) >= n_slots:
        raise ValueError(f"swiglu_q_split: {x.shape[0]} rows of x for slots {tuple(slots.shape)} with indices in "
                         f"[0, {n_slots})")  # the kernel's own check, which a call all through the GEMM skips
    tok = torch.arange(t_).repeat_interleave(k)
    wf = weights.reshape(-1)
    out = torch.zeros(t_, x.shape[-1], dtype=torch.float32)
    small = (~big[inv]).nonzero().squeeze(1)
    if small.numel():
        ts = tok[small]
        y = torch.ops.expertcache_cpu.swiglu_q(x[ts], gu["q"], gu["scales"], gu.get("mins"), dn["q"], dn["scales"],
                                               dn.get("mins"), bits, group, flat[small][:, None], wf[small][:, None])
        out.index_add_(0, ts, y.float())
    cdt = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
    order = torch.argsort(inv, stable=True)
    ends = torch.cumsum(cnt, 0).tolist()
    inter = dn["q"].shape[-1] * (2 if bits == 4 else 1)
    for j in big.nonzero().squeeze(1).tolist():
        ids = order[ends[j] - int(cnt[j]):ends[j]]
        s = int(used[j])
        g_parts, d_parts = {p: v[s] for p, v in gu.items()}, {p: v[s] for p, v in dn.items()}
        g = dequant_q(g_parts, bits, group, cdt, scratch("gate_up", cdt, 2 * inter * x.shape[-1]))
        d = dequant_q(d_parts, bits, group, cdt, scratch("down", cdt, inter * x.shape[-1]))
        te = tok[ids]
        h = torch.nn.functional.linear(x[te].to(cdt), g)  # [n, 2I]
        a = torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()
        o = torch.nn.functional.linear(a.to(cdt), d).float()
        out.index_add_(0, te, o * wf[ids, None].float())
    return out.to(x.dtype)


GEMM_CANDIDATES = (8, 12, 16, 24, 32, 48, 64)  # pairs per expert at which `measure_gemm_pairs` compares the paths
GEMM_NEVER = 1 << 30  # a threshold no call reaches: the GEMM never won at any candidate
GEMM_SLACK = 1.1  # the GEMM is taken where it is at most this much slower than the kernel in the measurement: a call
# of a few experts favours the kernel against a prompt's whole layer (here, int4 at 24 pairs: the kernel 10% faster in
# the measurement, yet a layer of 512 tokens took 130 ms with the GEMM from 24 pairs on and 160 ms from 32)


def measure_gemm_pairs(rounds: int = 7, experts: int = 16, pool: int = 64) -> dict:
    """Where a prompt's packed experts should leave the integer kernel for dequantize + GEMM on this machine
    (`GEMM_PAIRS`): for each format (int8, int4 group 32) and each candidate count of pairs per expert, the median
    time of one call over `experts` Qwen3-30B-A3B-shaped experts each with that many pairs, through the kernel and
    through the GEMM, every (count, path) alternated over `rounds` rounds at torch's current thread count. Each call
    takes the next `experts` of a `pool` larger than the caches (a prompt's layer reads its experts from memory,
    not from a warm cache: measured on a warm pool of 8, the kernel looked faster than it is, up to 48 pairs). The
    threshold is the smallest candidate from which the GEMM is within `GEMM_SLACK` of the kernel at every larger
    one (`GEMM_NEVER` if none)."""
    import statistics
    import time

    from expertcache.runtime.bench.harness import alternate

    if not load():
        raise RuntimeError(f"measure_gemm_pairs: the CPU kernels are unavailable ({why_unavailable()})")
    H, I = 2048, 768
    g = torch.Generator().manual_seed(0)
    if pool < experts:
        raise ValueError(f"measure_gemm_pairs: a pool of {pool} experts cannot give {experts} distinct ones a call")
    out = {"threads": torch.get_num_threads(), "rounds": rounds, "experts": experts, "pool": pool}
    nxt = [0]
    for bits in (8, 4):
        gu, dn = _packed_pool(pool, 2 * I, H, bits), _packed_pool(pool, H, I, bits)
        cases = {p: ((torch.randn(experts * p, H, generator=g) * 0.5).bfloat16(),
                     torch.arange(experts).repeat_interleave(p)[:, None], torch.ones(experts * p, 1))
                 for p in GEMM_CANDIDATES}

        def call(c: tuple) -> None:
            x, s, w = cases[c[0]]
            first = nxt[0] % (pool - experts + 1)
            nxt[0] += experts
            swiglu_q_split(x, gu, dn, bits, 32, s + first, w, min_pairs=1 if c[1] == "gemm" else GEMM_NEVER)

        def timed(c: tuple, _r: int) -> float:
            t0 = time.perf_counter()
            call(c)
            return time.perf_counter() - t0

        arms = [(p, path) for p in GEMM_CANDIDATES for path in ("kernel", "gemm")]
        for c in arms[:2] + arms[-2:]:  # warm: the buffers' first pages and the GEMM's first shapes
            call(c)
        med = {c: statistics.median(v) for c, v in alternate(arms, rounds, timed).items()}
        wins = [med[(p, "gemm")] <= GEMM_SLACK * med[(p, "kernel")] for p in GEMM_CANDIDATES]
        pairs = next((p for i, p in enumerate(GEMM_CANDIDATES) if all(wins[i:])), GEMM_NEVER)
        out[f"int{bits}"] = {"pairs": pairs, "candidates": [
            {"pairs": p, "kernel_s": med[(p, "kernel")], "gemm_s": med[(p, "gemm")]} for p in GEMM_CANDIDATES]}
        del gu, dn, cases
    return out


def dequant_q(t: dict, bits: int, group: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`quant.dequantize(t, bits, group, dtype)` bit for bit, in one pass over the codes (bf16 or fp32 out; `t`
    holds `q`, `scales` (and `mins`) with any leading dims, as a store's slot views). `out`: a contiguous buffer of
    that dtype and at least as many values to write into (returned as a view of the result's shape); reusing one
    saves the page faults of a fresh tensor, as much time as the pass itself at an expert chunk's size."""
    q = t["q"]
    shape = (*q.shape[:-1], q.shape[-1] * (2 if bits == 4 else 1))
    n = math.prod(shape)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dequant_q: bf16 or fp32 out, not {dtype}")
    if out is None:
        out = torch.empty(n, dtype=dtype)
    elif out.dtype != dtype or not out.is_contiguous() or out.numel() < n:
        raise ValueError(f"dequant_q: out must be contiguous {dtype} of at least {n} values")
    res = out.view(-1)[:n].view(shape)
    torch.ops.expertcache_cpu.dequant_q(q.contiguous(), t["scales"].contiguous(),
                                        t["mins"].contiguous() if "mins" in t else None, bits, group, res)
    torch.autograd.graph.increment_version(res)  # the op writes in place unseen: a graph that kept `out` now raises
    return res


def amx_available() -> bool:
    """True when the CPU has AMX-BF16 tiles and Linux granted this process their state (asked once)."""
    if "amx" not in _state:
        _state["amx"] = bool(available() and "amx_bf16" in cpu_flags() and torch.ops.expertcache_cpu.amx_init())
    return _state["amx"]


def qmm_fits(t: dict, bits: int, group: int) -> bool:
    """Whether `qmm_amx` takes this packed matrix: int4, rows a multiple of 32, inputs of 64, groups of 32."""
    q = t["q"]
    return bits == 4 and q.dim() == 2 and q.shape[0] % 32 == 0 and (2 * q.shape[1]) % 64 == 0 and group % 32 == 0


def qmm_amx(x: torch.Tensor, t: dict, group: int, trans: bool = False) -> torch.Tensor:
    """x [M, K] -> x W^T [M, N] (`trans`: x [M, N] -> x W [M, K]) for one int4 matrix W [N, K] (`t`: its `q`,
    `scales`, `mins`), bf16, on the CPU's tile units (`amx_available`): W dequantized 16 x 32 values at a time
    (`quant.dequantize`'s values in bf16) and never written out; fp32 accumulation."""
    return torch.ops.expertcache_cpu.qmm_amx(x.to(torch.bfloat16).contiguous(), t["q"].contiguous(),
                                             t["scales"].contiguous(), t["mins"].contiguous() if "mins" in t else None,
                                             group, trans)


def linear_q(x, q, scales, mins, bits: int, group: int, bias=None) -> torch.Tensor:
    """A packed linear layer: x [..., in] -> [..., out] in x's dtype; q/scales/mins as `runtime.quant.quantize`
    writes them for a 2-D weight (int8 activations per 32 inputs, fp32 accumulation)."""
    lead = x.shape[:-1]
    y = torch.ops.expertcache_cpu.linear_q(x.reshape(-1, x.shape[-1]), q, scales, mins, bits, group, bias)
    return y.to(x.dtype).reshape(*lead, q.shape[0])


def attend_one(q, k, v, mask=None, scale: float | None = None) -> torch.Tensor:
    """One query per (row, head) against a KV cache: q [B, Hq, D], k and v [B, Hkv, L, D] (rows contiguous; Hq a
    multiple of Hkv: grouped-query attention), mask an additive [B, L] (0 or -inf) or None -> [B, Hq, D] in q's
    dtype (bf16 or fp32; fp32 scores and sums)."""
    return torch.ops.expertcache_cpu.attend_one(q, k, v, mask, scale if scale is not None else q.shape[-1] ** -0.5)


def release_freed() -> None:
    """Hands memory the process has freed back to the system (glibc's `malloc_trim`; a no-op elsewhere). The
    replaced weights of fused projections are freed from the heap, where glibc keeps them: on the 27-layer
    Qwen3-30B-A3B shape they stayed resident (0.41 GiB more RSS), and `bench big`'s engine, sized to its memory
    cgroup, was killed for it."""
    import ctypes

    try:  # the process's own symbols (no `ldconfig` run to find libc): glibc's malloc_trim where there is one
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


def read_bandwidth(nbytes: int = 1 << 30, rounds: int = 5) -> float:
    """This machine's memory read bandwidth in bytes/s at torch's current thread count: the median of `rounds`
    passes over a buffer far larger than the caches (the extension's streaming read)."""
    import statistics
    import time

    buf = torch.ones(nbytes, dtype=torch.uint8)
    torch.ops.expertcache_cpu.read_bytes(buf)  # first touch
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        torch.ops.expertcache_cpu.read_bytes(buf)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)
