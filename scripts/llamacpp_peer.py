"""llama.cpp, the peer, on the same weights: build it from the PyPI sdist's vendored source (cached outside the repo),
convert a Hugging Face checkpoint to GGUF (BF16, then Q8_0 and Q4_0 with its own `llama-quantize`) and time decode
with `llama-bench`. `scripts/bench_kernels.py` calls `decode()`; run alone it prints one JSON line per format.

    python scripts/llamacpp_peer.py --model /work/ckpt/q30-4l --threads 1 --tokens 32

Building (once, about 10-30 minutes on 2 cores; `--build_only` to do just that):
    pip download --no-deps --no-binary :all: llama-cpp-python      # the sdist, from the package registry
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON
    cmake --build build -j2 --target llama-bench llama-quantize
The converter refuses a BPE tokenizer whose pre-tokenizer hash it does not know (ours); this script maps an
unknown one to "gpt-2" (the same byte-level rules) by wrapping the converter, without editing llama.cpp's files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE = Path(os.environ.get("EXPERTCACHE_LLAMACPP", str(Path.home() / ".cache" / "expertcache" / "llamacpp")))
QUANTS = {"bf16": None, "q8_0": "Q8_0", "q4_0": "Q4_0"}


def source_dir() -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist (downloaded once from the package registry)."""
    for d in sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp")):
        return d
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "llama-cpp-python", "-d", str(CACHE)], check=True)
    sdist = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))[-1]
    with tarfile.open(sdist) as t:
        t.extractall(CACHE, filter="data")
    return sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


def build(src: Path) -> Path:
    b = src / "build" / "bin"
    if (b / "llama-bench").exists() and (b / "llama-quantize").exists():
        return b
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON"], cwd=src, check=True)
    subprocess.run(["cmake", "--build", "build", "-j", str(os.cpu_count() or 2), "--target", "llama-bench",
                    "llama-quantize"], cwd=src, check=True)
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


def gguf(model: Path, fmt: str, src: Path, bins: Path) -> Path:
    """The checkpoint as GGUF in `fmt` (cached beside the other conversions of it)."""
    out_dir = CACHE / "gguf" / model.name
    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = out_dir / "model-bf16.gguf"
    if not bf16.exists():
        tmp = bf16.with_suffix(".tmp")
        code = _CONVERT.format(src=str(src), args=[str(model), "--outtype", "bf16", "--outfile", str(tmp)])
        subprocess.run([sys.executable, "-c", code], check=True)
        tmp.rename(bf16)
    if QUANTS[fmt] is None:
        return bf16
    out = out_dir / f"model-{fmt}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(bins / "llama-quantize"), str(bf16), str(tmp), QUANTS[fmt]], check=True,
                       stdout=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def decode(model: str | Path, fmt: str, threads: int, tokens: int = 32, reps: int = 3) -> dict:
    """llama-bench's decode figure (`-p 0 -n tokens`, `reps` repetitions): seconds per token, mean and stddev."""
    src = source_dir()
    bins = build(src)
    path = gguf(Path(model), fmt, src, bins)
    r = subprocess.run([str(bins / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(tokens),
                        "-r", str(reps), "-o", "json"], check=True, capture_output=True, text=True)
    row = json.loads(r.stdout)[0]
    ts, sd = row["avg_ts"], row["stddev_ts"]
    return {"format": fmt, "threads": threads, "tpot_s": 1 / ts, "tok_s": ts, "tok_s_stddev": sd,
            "gguf_bytes": path.stat().st_size, "build": row.get("build_commit"), "tokens": tokens, "reps": reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Hugging Face checkpoint folder with its tokenizer")
    ap.add_argument("--formats", default="bf16,q8_0,q4_0")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--build_only", action="store_true")
    a = ap.parse_args()
    if a.build_only:
        print(build(source_dir()))
        return
    if not a.model:
        ap.error("--model is required (or --build_only)")
    for f in a.formats.split(","):
        print(json.dumps(decode(a.model, f, a.threads, a.tokens)), flush=True)


if __name__ == "__main__":
    main()
