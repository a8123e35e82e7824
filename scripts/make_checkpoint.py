"""Write a random-weight Qwen3-MoE checkpoint of a stated shape with plain transformers (`save_pretrained`: the
published per-expert layout), for benchmarks on a real checkpoint of a known size. Prints its size as JSON.

    python scripts/make_checkpoint.py --out runs/ckpt-0.87gb --layers 8 --experts 32 --hidden 1024 --inter 512
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig

from expertcache.telemetry.atomic import atomic_dir
from expertcache.telemetry.errors import count

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import build_model  # noqa: E402 (the tests' seeded random-weight builder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=count, default=8)
    ap.add_argument("--experts", type=count, default=32)
    ap.add_argument("--top-k", type=count, default=4)
    ap.add_argument("--hidden", type=count, default=1024)
    ap.add_argument("--inter", type=count, default=512, help="one expert's intermediate size")
    ap.add_argument("--vocab", type=count, default=16384)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = ap.parse_args()
    if a.top_k > a.experts:
        from expertcache.telemetry.errors import InputError

        raise InputError(f"--top-k {a.top_k} with --experts {a.experts}: a token cannot choose more experts than "
                         f"there are")
    cfg = Qwen3MoeConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                         moe_intermediate_size=a.inter, num_hidden_layers=a.layers, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=128, num_experts=a.experts, num_experts_per_tok=a.top_k,
                         decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1)
    with atomic_dir(a.out) as tmp:
        build_model(cfg, seed=0, dtype=getattr(torch, a.dtype)).save_pretrained(tmp)
    size = sum(p.stat().st_size for p in Path(a.out).glob("*.safetensors"))
    print(json.dumps({"out": a.out, "bytes": size, "layers": a.layers, "experts": a.experts, "hidden": a.hidden,
                      "inter": a.inter, "dtype": a.dtype}))


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
