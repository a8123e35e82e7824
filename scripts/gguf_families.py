"""`import-gguf` against llama.cpp's own converter, one tiny model per family it reads (Qwen3-MoE, OLMoE, Mixtral).

For each family: a random tiny checkpoint (tests/tiny_lm.py, our byte-level BPE), converted by the
`convert_hf_to_gguf.py` that ships in the llama.cpp source vendored by the PyPI sdist `llama-cpp-python`
(runtime/bench/llamacpp.py: downloaded once, cached outside the repository; the converter's own `--outtype bf16` and
`q8_0`, each also with `--fuse-qkv`), then `import-gguf`. Checked per file: the tokenizer splits a test string as the
source's does; a BF16 import loads with `from_pretrained` to the source's weights exactly (tensor names, Mixtral's
query/key row order, config); the imported model decodes through the engine (disk tier, half the experts cached)
close to the source (Q8_0: within its rounding). The tests write their GGUF files with the `gguf` package the way
this converter does; this script is the check that they match the converter itself. Not part of `make test` (it
downloads the sdist; the converter's llama path needs `sentencepiece`, installed beside the cached source).

    python scripts/gguf_families.py --out results/gguf_families.json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TEXT = "thou art\n\n\nthe cat é ü 字 and 42"


def convert(src: Path, model: Path, outtype: str, out: Path, extra: list[str], pydeps: Path) -> None:
    import os

    from expertcache.runtime.bench.llamacpp import _CONVERT, LlamaCppError

    code = _CONVERT.format(src=str(src), args=[str(model), "--outtype", outtype, "--outfile", str(out), *extra])
    env = {**os.environ, "PYTHONPATH": str(pydeps)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise LlamaCppError("convert", (p.stderr.strip().splitlines() or ["no output"])[-1][:300])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/gguf_families.json")
    ap.add_argument("--families", default="qwen3_moe,olmoe,mixtral")
    a = ap.parse_args()

    from tiny_lm import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.runtime import load
    from expertcache.runtime.kernels.gguf_import import import_gguf
    from expertcache.runtime.bench.llamacpp import cache_dir, source_dir

    src = source_dir()
    pydeps = cache_dir() / "pydeps"
    if not (pydeps / "sentencepiece").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(pydeps), "sentencepiece"],
                       check=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for fam in a.families.split(","):
            kw = dict(hidden_size=64, intermediate_size=64)
            if fam == "qwen3_moe":
                kw["moe_intermediate_size"] = 64
            model = make_tiny_checkpoint(tmp / fam, family=fam, **kw)
            ref_tok = AutoTokenizer.from_pretrained(model)
            ids = torch.tensor([ref_tok(TEXT).input_ids])
            ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
            with torch.no_grad():
                want = ref(input_ids=ids).logits[0].float()
            for outtype, extra in (("bf16", []), ("q8_0", []), ("q8_0", ["--fuse-qkv"])):
                name = f"{fam}-{outtype}{'-fused-qkv' if extra else ''}"
                g = tmp / f"{name}.gguf"
                convert(src, model, outtype, g, extra, pydeps)
                out = tmp / f"imp-{name}"
                rep = import_gguf(g, out)
                row = {"family": fam, "converter_outtype": outtype, "fuse_qkv": bool(extra),
                       "architecture": rep["architecture"], "experts": rep["experts"],
                       "packed_linears": rep["packed_linears"],
                       "tokens_equal": AutoTokenizer.from_pretrained(out)(TEXT).input_ids == ref_tok(TEXT).input_ids}
                if rep["experts"] == "bf16":
                    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
                    row["from_pretrained_weights_equal"] = all(torch.equal(got[k], v)
                                                               for k, v in ref.state_dict().items())
                m = load(out, capacity=0.5, tier="disk")
                with torch.no_grad():
                    logits = m(input_ids=ids).logits[0].float()
                m.expertcache.close()
                row["logits_rel_err_vs_source"] = round(float((logits - want).norm() / want.norm()), 5)
                row["argmax_agreement"] = round(float((logits.argmax(-1) == want.argmax(-1)).float().mean()), 4)
                rows.append(row)
                print(row, file=sys.stderr)
                shutil.rmtree(out)
    ok = all(r["tokens_equal"] and r.get("from_pretrained_weights_equal", True)
             and r["logits_rel_err_vs_source"] < (0.01 if r["experts"] == "bf16" else 0.05) for r in rows)
    res = {"command": " ".join(["python", "scripts/gguf_families.py", *sys.argv[1:]]),
           "llama_cpp_source": src.parent.parent.name, "rows": rows, "pass": ok}
    from expertcache.runtime.bench.results import write_result

    write_result(a.out, res, config=vars(a), command=res["command"])
    print(f"{sum(1 for r in rows)} files, pass={ok} -> {a.out}", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
