"""llama.cpp, the peer users pick, on the same weights: built from the source that the PyPI sdist
`llama-cpp-python` vendors (cached outside the repository), a Hugging Face checkpoint converted with the converter
that ships in that source, and decode timed with llama.cpp's own `llama-bench`.

    source_dir()  -> the vendored llama.cpp (the sdist downloaded once from the package registry)
    build(src)    -> its bin/ with llama-bench and llama-quantize (cmake; about 10-30 minutes on 2 cores)
    gguf(...)     -> the checkpoint as GGUF (BF16 by the converter, Q8_0/Q4_0 by llama-quantize)
    bench(...)    -> one `llama-bench` run in a child: seconds per decoded token, the child's peak RSS and the
                     bytes it read from storage (its own rusage, so nothing else on the machine is counted)

Each step that fails raises `LlamaCppError` naming the step, in one line (the command's last output line with
it); `bench big` skips the system with that reason in its JSON.

The converter refuses a BPE tokenizer whose pre-tokenizer hash it does not know (ours); an unknown one is mapped
to "gpt-2" (the same byte-level rules) by wrapping the converter in a child, without editing llama.cpp's files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from expertcache.telemetry.atomic import write_text

QUANTS = {"bf16": None, "q8_0": "Q8_0", "q4_0": "Q4_0"}
TARGETS = ("llama-bench", "llama-quantize")


class LlamaCppError(RuntimeError):
    """One step of the llama.cpp pipeline failed: `step` is download | build | convert | quantize | bench."""

    def __init__(self, step: str, why: str):
        super().__init__(f"llama.cpp {step} failed: {why}")
        self.step = step


def cache_dir() -> Path:
    return Path(os.environ.get("EXPERTCACHE_LLAMACPP", str(Path.home() / ".cache" / "expertcache" / "llamacpp")))


def _run(step: str, cmd: list[str], log: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """`cmd` with its output kept (in `log` when given); a failure is one line naming the step."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    except OSError as e:
        raise LlamaCppError(step, f"{cmd[0]}: {e.strerror or e}") from None
    if log is not None:
        write_text(log, p.stdout + p.stderr)
    if p.returncode != 0:
        tail = [ln for ln in (p.stderr or p.stdout).strip().splitlines() if ln.strip()]
        where = f" (log: {log})" if log is not None else ""
        raise LlamaCppError(step, f"exit {p.returncode}: {tail[-1][:300] if tail else 'no output'}{where}")
    return p


def source_dir(cache: Path | None = None) -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist (downloaded once from the package registry)."""
    cache = cache or cache_dir()
    for d in sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp")):
        return d
    cache.mkdir(parents=True, exist_ok=True)
    _run("download", [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
                      "llama-cpp-python", "-d", str(cache)])
    sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise LlamaCppError("download", f"pip wrote no llama_cpp_python sdist into {cache}")
    with tarfile.open(sdists[-1]) as t:
        t.extractall(cache, filter="data")
    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise LlamaCppError("download", f"{sdists[-1].name} has no vendor/llama.cpp")
    return found[-1]


def build(src: Path) -> Path:
    """`src`'s build/bin with llama-bench and llama-quantize (built once; the cmake log beside it)."""
    b = src / "build" / "bin"
    if all((b / t).exists() for t in TARGETS):
        return b
    _run("build", ["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                   "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON"], src / "build-configure.log", cwd=src)
    _run("build", ["cmake", "--build", "build", "-j", str(os.cpu_count() or 2), "--target", *TARGETS],
         src / "build.log", cwd=src)
    return b


_CONVERT = """
import runpy, sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
from conversion.base import TextModel
_orig = TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:  # our byte-level BPE: the gpt-2 pre-tokenizer rules
        return "gpt-2"
TextModel.get_vocab_base_pre = _pre
sys.argv = ["convert_hf_to_gguf.py"] + {args!r}
runpy.run_path({src!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def gguf_path(model: Path, fmt: str, out_dir: Path) -> Path:
    """Where `gguf` writes (and finds) the checkpoint `model` in `fmt`."""
    return out_dir / f"{model.name}-{fmt}.gguf"


def gguf(model: Path, fmt: str, src: Path, bins: Path, out_dir: Path | None = None) -> Path:
    """The checkpoint as GGUF in `fmt` (bf16 | q8_0 | q4_0), in `out_dir` (default: the cache, by the model's
    folder name) and reused there; each file is written under a temporary name and renamed when complete."""
    if fmt not in QUANTS:
        raise LlamaCppError("convert", f"format {fmt!r}; expected one of {', '.join(QUANTS)}")
    out_dir = out_dir or cache_dir() / "gguf" / model.name
    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = gguf_path(model, "bf16", out_dir)
    if not bf16.exists():
        if not (model / "tokenizer.json").is_file():
            raise LlamaCppError("convert", f"{model} has no tokenizer.json (the converter needs one)")
        tmp = bf16.with_suffix(".tmp")
        code = _CONVERT.format(src=str(src), args=[str(model), "--outtype", "bf16", "--outfile", str(tmp)])
        try:
            _run("convert", [sys.executable, "-c", code], out_dir / "convert.log")
        except LlamaCppError:
            tmp.unlink(missing_ok=True)  # a half-written GGUF never stays behind
            raise
        tmp.rename(bf16)
    if QUANTS[fmt] is None:
        return bf16
    out = gguf_path(model, fmt, out_dir)
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        try:
            _run("quantize", [str(bins / "llama-quantize"), str(bf16), str(tmp), QUANTS[fmt]],
                 out_dir / f"quantize-{fmt}.log")
        except LlamaCppError:
            tmp.unlink(missing_ok=True)
            raise
        tmp.rename(out)
    return out


def _proc_read_bytes(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/io"):
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _llama_bench(cmd: list[str], preexec=None, timeout_s: float = 3600, log: Path | None = None):
    """`cmd` (a llama-bench line with `-o jsonl`) in a child: `(its JSON lines, /proc/PID/io read_bytes as each
    line came, its rusage, wall seconds)`; a failure is one `LlamaCppError` line."""
    import tempfile
    import threading

    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        try:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=preexec)
        except OSError as e:
            raise LlamaCppError("bench", f"{cmd[0]}: {e.strerror or e}") from None
        timer = threading.Timer(timeout_s, p.kill)
        timer.start()
        lines, marks = [], []
        try:
            for line in p.stdout:  # one JSON line per finished test
                if line.strip():
                    lines.append(line)
                    marks.append(_proc_read_bytes(p.pid))
            _, status, ru = os.wait4(p.pid, 0)  # this child's own rusage (Popen's wait would not give it)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read()
    if log is not None:
        write_text(log, " ".join(cmd) + "\n" + stderr)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        if wall >= timeout_s:
            raise LlamaCppError("bench", f"no result within {timeout_s:.0f} s")
        why = " (killed: out of memory in the cgroup?)" if p.returncode in (-9, 137) else ""
        where = f" (log: {log})" if log is not None else ""
        raise LlamaCppError("bench", f"exit {p.returncode}{why}: {tail[-1][:300] if tail else 'no output'}{where}")
    return lines, marks, ru, wall


def prompt_row(lines: list[str], n_prompt: int) -> dict:
    """The prompt-processing test of llama-bench's `-o jsonl` output (`-p N -n 0`: the object with `n_prompt` N and
    `n_gen` 0): its prompt tokens/s (`avg_ts`), seconds per repetition (`samples_ns`, else `avg_ns`), build and
    threads; unreadable output is one `LlamaCppError` line."""
    try:
        row = next(r for r in map(json.loads, lines) if r["n_prompt"] == n_prompt and r["n_gen"] == 0)
        samples = [s / 1e9 for s in (row.get("samples_ns") or [row["avg_ns"]])]
        return {"tokens_per_s": float(row["avg_ts"]), "prompt_s": samples, "build": row.get("build_commit"),
                "threads": row.get("n_threads")}
    except (ValueError, StopIteration, KeyError, TypeError):
        raise LlamaCppError("bench", f"no prompt test of {n_prompt} tokens in llama-bench's output: "
                            f"{''.join(lines)[:200]!r}") from None


def bench_prompt(bins: Path, model: Path, threads: int, n_prompt: int, preexec=None, timeout_s: float = 3600,
                 log: Path | None = None, extra: tuple[str, ...] = ()) -> dict:
    """One `llama-bench -p N -n 0 -r 1` process (mmap): its prompt tokens/s and seconds (`prompt_row`), the bytes
    the child read from storage in all (loading included: llama-bench prints nothing before its test ends), its
    peak RSS and the command."""
    from expertcache.telemetry.memory import child_peak_rss_bytes

    cmd = [str(bins / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", "0",
           "-r", "1", "-o", "jsonl", *extra]
    lines, _, ru, wall = _llama_bench(cmd, preexec, timeout_s, log)
    return {**prompt_row(lines, n_prompt), "read_bytes": ru.ru_inblock * 512, "wall_s": wall,
            "peak_rss_bytes": child_peak_rss_bytes(ru), "cmd": " ".join(cmd)}


def built(cache: Path | None = None) -> Path | None:
    """The bin/ of a llama.cpp already built under `cache` (None: none is; nothing is downloaded or built)."""
    for d in sorted((cache or cache_dir()).glob("llama_cpp_python-*/vendor/llama.cpp/build/bin")):
        if all((d / t).exists() for t in TARGETS):
            return d
    return None


def bench(bins: Path, model: Path, threads: int, tokens: int, warmup: int = 0, depth: int = 0, reps: int = 1,
          preexec=None, timeout_s: float = 3600, log: Path | None = None, extra: tuple[str, ...] = ()) -> dict:
    """One `llama-bench` process (mmap, its default; `extra`: more of its options, e.g. `--repack 0`): `-d depth`
    tokens of context, then `warmup` decoded tokens as one untimed test (when > 0) and `tokens` decoded tokens
    `reps` times, timed by llama-bench (which also runs its own one-token warm-up before each test). `preexec`: run
    in the child before exec (joining a memory cgroup). `log`: where llama-bench's own messages go (kept for a
    failed run's diagnosis).

    Returns seconds per token (`tpot_s`: one figure per repetition, llama-bench's mean over its `tokens`), the
    child's own peak RSS and the bytes it read from storage: in all (its rusage from wait4, `ru_inblock`: the counter
    of /proc/PID/io read_bytes, page-cache hits not counted) and, with a warm-up, during the timed test only (read
    from /proc/PID/io when llama-bench prints the warm-up test's result, `-o jsonl`), and llama.cpp's build."""

    from expertcache.telemetry.memory import child_peak_rss_bytes

    gens = f"{warmup},{tokens}" if warmup > 0 else str(tokens)
    cmd = [str(bins / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "0", "-n", gens, "-d",
           str(depth), "-r", str(reps), "-o", "jsonl", *extra]
    lines, marks, ru, wall = _llama_bench(cmd, preexec, timeout_s, log)
    try:
        rows = [json.loads(x) for x in lines]
        i = next(j for j, r in enumerate(rows) if r["n_gen"] == tokens and r["n_prompt"] == 0)
        row = rows[i]
        samples = row.get("samples_ns") or [row["avg_ns"]]
    except (ValueError, StopIteration, KeyError, TypeError):
        raise LlamaCppError("bench", f"unreadable llama-bench output: {''.join(lines)[:200]!r}") from None
    total = ru.ru_inblock * 512
    timed = total - marks[i - 1] if i > 0 and marks[i - 1] is not None else None
    return {"tpot_s": [s / 1e9 / tokens for s in samples], "wall_s": wall, "build": row.get("build_commit"),
            "threads": row.get("n_threads", threads), "n_depth": row.get("n_depth", depth), "tokens": tokens,
            "warmup": warmup, "reps": reps, "peak_rss_bytes": child_peak_rss_bytes(ru), "read_bytes": total,
            "read_bytes_timed": timed, "cmd": " ".join(cmd)}


def decode(model: str | Path, fmt: str, threads: int, tokens: int = 32, reps: int = 3, depth: int = 0) -> dict:
    """llama-bench's decode figure on `model` in `fmt` (`-p 0 -n tokens`, `reps` repetitions, `-d depth` tokens
    already in the context): seconds per token, mean and stddev (what `expertcache bench kernels` pairs against)."""
    src = source_dir()
    bins = build(src)
    path = gguf(Path(model), fmt, src, bins)
    r = _run("bench", [str(bins / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(tokens),
                       "-r", str(reps), "-o", "json"] + (["-d", str(depth)] if depth else []))
    row = json.loads(r.stdout)[0]
    ts, sd = row["avg_ts"], row["stddev_ts"]
    return {"format": fmt, "threads": threads, "tpot_s": 1 / ts, "tok_s": ts, "tok_s_stddev": sd,
            "gguf_bytes": path.stat().st_size, "build": row.get("build_commit"), "tokens": tokens, "reps": reps,
            "depth": depth}
