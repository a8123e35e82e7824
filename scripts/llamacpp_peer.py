"""llama.cpp, the peer, on the same weights: build it from the PyPI sdist's vendored source (cached outside the repo),
convert a Hugging Face checkpoint to GGUF (BF16, then Q8_0 and Q4_0 with its own `llama-quantize`) and time decode
with `llama-bench`. `expertcache bench kernels` calls its `decode()`; run alone it prints one JSON line per format.

    python scripts/llamacpp_peer.py --model /work/ckpt/q30-4l --threads 1 --tokens 32

Building (once, about 10-30 minutes on 2 cores; `--build_only` to do just that):
    pip download --no-deps --no-binary llama-cpp-python llama-cpp-python      # the sdist, from the package registry
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON
    cmake --build build -j2 --target llama-bench llama-quantize
The converter refuses a BPE tokenizer whose pre-tokenizer hash it does not know (ours); this script maps an
unknown one to "gpt-2" (the same byte-level rules) by wrapping the converter, without editing llama.cpp's files.
The steps live in `expertcache.runtime.bench.llamacpp` (what `bench big --systems [llama.cpp,...]` uses too); the cache
is $EXPERTCACHE_LLAMACPP or ~/.cache/expertcache/llamacpp.
"""

from __future__ import annotations

import argparse
import json
import sys

from expertcache.runtime.bench.llamacpp import LlamaCppError, build, decode, source_dir
from expertcache.telemetry.errors import count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Hugging Face checkpoint folder with its tokenizer")
    ap.add_argument("--formats", default="bf16,q8_0,q4_0")
    ap.add_argument("--threads", type=count, default=1)
    ap.add_argument("--tokens", type=count, default=32)
    ap.add_argument("--build_only", action="store_true")
    a = ap.parse_args()
    try:
        if a.build_only:
            print(build(source_dir()))
            return 0
        if not a.model:
            ap.error("--model is required (or --build_only)")
        from expertcache.telemetry.hf import load_config

        load_config(a.model)  # a checkpoint, before any build, conversion or cache folder
        for f in a.formats.split(","):
            print(json.dumps(decode(a.model, f, a.threads, a.tokens)), flush=True)
    except LlamaCppError as e:
        print(f"llamacpp_peer: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
