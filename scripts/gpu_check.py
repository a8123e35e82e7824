"""Every GPU check of the runtime in one run (well under 5 minutes on one GPU); prints JSON, writes it to $OUT.

1. lossless: greedy tokens of `load(..., device="cuda")` (host tier: pinned RAM -> GPU on a side stream; disk
   tier: O_DIRECT -> staging -> GPU) equal plain `from_pretrained(...).cuda().generate` in bf16, per family;
2. triton: `kernels.swiglu_triton` against the torch reference over strided slot views, on the GPU, and
   `kernels.swiglu_triton_q` (int8 / int4 / symmetric int4 experts dequantized in the kernel) against the
   dequantized reference;
3. TPOT: `bench decode` on a mid-size bf16 checkpoint made here, cuda slots, host and disk tiers, native and
   triton kernels.
Run it with `bash scripts/gpu_check.sh` from the repository root.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from expertcache.telemetry.atomic import atomic_dir, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_models: the tests' tiny models


def lossless(root: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from expertcache.runtime import load
    from expertcache.runtime.serve.generate import timed_greedy
    from tiny_models import FAMILIES, build_model, tiny_config

    out = {}
    prompt = torch.tensor([[5, 9, 33, 2, 71, 100, 7, 12]], device="cuda")
    for fam in FAMILIES:
        d = root / fam
        with atomic_dir(d) as tmp:
            build_model(tiny_config(fam), seed=3, dtype=torch.bfloat16).save_pretrained(tmp)
        # transformers' own greedy generate is the reference; the engine decodes through the decode loop of
        # generate and serve (`generate.timed_greedy`, 16 tokens, end-of-sequence ignored as min_new_tokens does)
        gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt),
                   pad_token_id=1)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval().generate(prompt, **gen)
        row = {}
        for tier in ("host", "disk"):
            m = load(d, capacity=2, tier=tier, device="cuda")
            row[tier] = bool(torch.equal(timed_greedy(m, prompt, 16)[1], ref))
            row[tier + "_hits_loads"] = [m.expertcache.stats.hits, m.expertcache.stats.demand_loads]
            m.expertcache.close()
        out[fam] = row
    return out


def triton_vs_torch() -> dict:
    from expertcache.runtime.kernels.triton_experts import HAVE_TRITON, swiglu_reference, swiglu_triton
    from expertcache.runtime.storage.store import StoreMeta, layout
    from expertcache.runtime.storage.tiers import SlotPool

    if not HAVE_TRITON:
        return {"error": "triton not importable"}
    res = {}
    for h, i, s, t, k in ((2048, 768, 24, 1, 8), (1024, 512, 16, 4, 4)):
        specs, block = layout([("gate_up_proj", [2 * i, h], "bfloat16"), ("down_proj", [h, i], "bfloat16")])
        pool = SlotPool(StoreMeta("t", 1, s, specs, block), s, "cuda")
        for v in pool.views.values():
            v.copy_(torch.randn(v.shape, device="cuda") * 0.02)
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        slots = torch.randint(0, s, (t, k), device="cuda")
        w = torch.rand(t, k, device="cuda").softmax(-1)
        a = swiglu_triton(x, pool.views["gate_up_proj"], pool.views["down_proj"], slots, w)
        b = swiglu_reference(x, pool.views["gate_up_proj"], pool.views["down_proj"], slots, w)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            swiglu_triton(x, pool.views["gate_up_proj"], pool.views["down_proj"], slots, w)
        torch.cuda.synchronize()
        res[f"{h}x{i} T={t} k={k}"] = {"max_abs_diff": float((a.float() - b.float()).abs().max()),
                                        "rel": float((a.float() - b.float()).norm() / b.float().norm()),
                                        "triton_ms": (time.perf_counter() - t0) / 20 * 1e3}
    return res


def triton_q_vs_torch() -> dict:
    """The packed (int8 / int4) triton kernel against the torch reference over the dequantized weights, at the
    Qwen3-30B-A3B expert shape, with its time per call."""
    from expertcache.runtime.kernels import quant
    from expertcache.runtime.kernels.triton_experts import HAVE_TRITON, swiglu_reference, swiglu_triton_q

    if not HAVE_TRITON:
        return {"error": "triton not importable"}
    res = {}
    h, i, s, t, k = 2048, 768, 24, 1, 8
    g = torch.Generator().manual_seed(0)
    # packed on the CPU (as `expertcache quantize` does), then moved; symmetric int4 is Q4_0's layout
    for bits, group, sym in ((8, 32, False), (4, 32, False), (4, 128, False), (4, 32, True)):
        gu = {n: v.cuda() for n, v in
              quant.quantize(torch.randn(s, 2 * i, h, generator=g) * 0.02, bits, group, sym).items()}
        dn = {n: v.cuda() for n, v in
              quant.quantize(torch.randn(s, h, i, generator=g) * 0.02, bits, group, sym).items()}
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        slots = torch.randint(0, s, (t, k), device="cuda")
        w = torch.rand(t, k, device="cuda").softmax(-1)
        a = swiglu_triton_q(x, gu, dn, bits, group, slots, w)
        b = swiglu_reference(x.float(), quant.dequantize(gu, bits, group), quant.dequantize(dn, bits, group),
                             slots, w)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            swiglu_triton_q(x, gu, dn, bits, group, slots, w)
        torch.cuda.synchronize()
        res[f"int{bits}{' symmetric' if sym else ''} group {group}"] = {
            "rel": float((a.float() - b.float()).norm() / b.float().norm()),
            "triton_ms": (time.perf_counter() - t0) / 20 * 1e3}
    return res


def tpot(root: Path) -> dict:
    from transformers import Qwen3MoeConfig

    from expertcache.runtime.bench.bench import bench_decode
    from expertcache.runtime.engine.config import EngineConfig
    from tiny_models import build_model

    d = root / "mid"
    cfg = Qwen3MoeConfig(vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    with atomic_dir(d) as tmp:  # 8 Qwen3-30B-A3B-sized layers, 9.7 GB
        build_model(cfg, seed=0, dtype=torch.bfloat16).save_pretrained(tmp)
    prompts = torch.randint(2, 32768, (1, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for tier in ("host", "disk"):
        for kernel in ("native", "triton"):
            r = bench_decode(d, prompts, EngineConfig(tier=tier, device="cuda", kernel=kernel),
                             capacities=(0.125, 0.25), predictors=("probe:1",), tokens=64, warmup=8, rounds=1,
                             plain=(tier == "host"))
            out[f"{tier}/{kernel}"] = {n: {k: v for k, v in c.items() if not isinstance(v, list)}
                                       for n, c in r["configs"].items()}
            out[f"{tier}/{kernel}"]["tier_bandwidth_GBps"] = r["tier_bandwidth_GBps"]
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    import transformers

    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "transformers": transformers.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, fn in (("lossless", lambda: lossless(root)), ("triton_vs_torch", triton_vs_torch),
                         ("triton_q_vs_torch", triton_q_vs_torch),
                         ("tpot", lambda: tpot(root))):
            t0 = time.time()
            try:
                res[name] = fn()
            except Exception as e:  # noqa: BLE001 - one check failing must not hide the others' results
                res[name] = {"error": f"{type(e).__name__}: {e}"}
            res[name + "_seconds"] = round(time.time() - t0, 1)
            print(json.dumps({name: res[name]}), flush=True)
    out = Path(os.environ.get("OUT", "runs/gpu-check"))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "gpu_check.json", res)
    ok = all(all(v for k, v in r.items() if not k.endswith("loads")) for r in res["lossless"].values()) \
        if "error" not in res["lossless"] else False
    print(json.dumps(res, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
