"""A Qwen3-30B-A3B-shaped checkpoint from random weights, for `expertcache bench big` (and anyone who needs a
real-size MoE checkpoint without a hub): hidden 2048, 128 experts of 2048x768, top-8, 32 query / 4 KV heads of
128, bf16, in the per-expert layout of the published checkpoint (`model.layers.{i}.mlp.experts.{e}.{gate,up,down}
_proj.weight`, each expert's three tensors back to back), sharded with an index, its data aligned to 4 KiB. Shards
are streamed tensor by tensor (a layer's experts are never all in memory) and the index is written last: its
presence marks a complete checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from expertcache.telemetry.atomic import atomic_open, write_json, write_text

HIDDEN, INTER, EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM = 2048, 768, 128, 8, 32, 4, 128
ALIGN = 4096


def big_config(layers: int, vocab: int = 32768):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=6144, moe_intermediate_size=INTER,
                          num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                          head_dim=HEAD_DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=1,
                          norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=4096,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1, dtype="bfloat16",
                          architectures=["Qwen3MoeForCausalLM"])  # what converters (llama.cpp's) detect it by


def expert_bytes() -> int:
    return 3 * HIDDEN * INTER * 2


def physical_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def write_tokenizer(out: Path, texts: list[str] | None = None, vocab: int = 300) -> None:
    """A byte-level BPE, so the checkpoint is complete for tools that need a tokenizer. By default a small one (the
    256 byte tokens, a few merges, `<|endoftext|>`; llama.cpp's converter pads the vocabulary to the model's with
    unused tokens), enough for the benchmarks that feed token ids; with `texts`, `vocab` tokens learned from them
    (see `full_vocab_copy`). Kept when one is there."""
    if (out / "tokenizer.json").is_file():
        return
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts or ["the expert cache keeps the hot experts close and reads the rest from disk"] * 64,
                            vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>", unk_token=None, model_max_length=4096)
    from expertcache.telemetry.atomic import atomic_dir

    with atomic_dir(out / ".tokenizer") as tmp:
        tok.save_pretrained(str(tmp))
    for f in (out / ".tokenizer").iterdir():
        os.replace(f, out / f.name)
    (out / ".tokenizer").rmdir()


def full_vocab_copy(src: Path, dst: Path, texts: list[str]) -> Path:
    """`src`'s weights and config (linked, not copied) with a byte-level BPE of the model's whole vocabulary learned
    from `texts`, in `dst`. The small tokenizer covers 300 of a random model's 32,768 ids, so nearly every token it
    emits decodes to no text and a server streams nothing for it; serving benchmarks need every id to be text."""
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix in (".safetensors", ".json") and not f.name.startswith("tokenizer") \
                and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    write_tokenizer(dst, texts, vocab)
    got = len(json.loads((dst / "tokenizer.json").read_text())["model"]["vocab"])
    if got < vocab:
        raise ValueError(f"the texts given teach {got} tokens, fewer than the model's {vocab}: give more text")
    return dst


def _write_shard(path: Path, tensors: list[tuple[str, list[int], object]]) -> None:
    """A safetensors file streamed tensor by tensor (`fill` is a tensor or a callable making one), data aligned to
    4 KiB, written to a temporary name and renamed when complete."""
    header, off = {}, 0
    for name, shape, _ in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    pad = (-(8 + len(raw))) % ALIGN
    raw += b" " * pad
    with atomic_open(path) as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, shape, fill in tensors:
            t = fill() if callable(fill) else fill
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def write_checkpoint(out: str | Path, layers: int, vocab: int = 32768, layers_per_shard: int = 3,
                     progress=None) -> Path:
    """The checkpoint (see the module doc); reused when it is already there and complete."""
    out = Path(out)
    cfg = big_config(layers, vocab)
    if (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file():
        from expertcache.runtime.storage.checkpoint import Checkpoint

        have = json.loads((out / "config.json").read_text())
        if have["num_hidden_layers"] == layers:
            Checkpoint(out)  # shards present and complete, or a clear error
            if "architectures" not in have:  # written before the config named it
                write_json(out / "config.json", {**have, "architectures": cfg.architectures})
            write_tokenizer(out)
            return out
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    pool = {n: [rnd(*s) for _ in range(8)] for n, s in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                                                         ("down_proj", (HIDDEN, INTER)))}
    Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM  # query and key/value projection widths
    weight_map = {}
    shards = [list(range(i, min(i + layers_per_shard, layers))) for i in range(0, layers, layers_per_shard)]
    n_sh = len(shards) + 1
    for s_i, group in enumerate(shards):
        name = f"model-{s_i + 1:05d}-of-{n_sh:05d}.safetensors"
        tensors = []
        for li in group:
            p = f"model.layers.{li}"
            tensors += [(f"{p}.input_layernorm.weight", [HIDDEN], torch.ones(HIDDEN, dtype=torch.bfloat16)),
                        (f"{p}.post_attention_layernorm.weight", [HIDDEN], torch.ones(HIDDEN, dtype=torch.bfloat16)),
                        (f"{p}.self_attn.q_proj.weight", [Q, HIDDEN], lambda: rnd(Q, HIDDEN)),
                        (f"{p}.self_attn.k_proj.weight", [KV, HIDDEN], lambda: rnd(KV, HIDDEN)),
                        (f"{p}.self_attn.v_proj.weight", [KV, HIDDEN], lambda: rnd(KV, HIDDEN)),
                        (f"{p}.self_attn.o_proj.weight", [HIDDEN, Q], lambda: rnd(HIDDEN, Q)),
                        (f"{p}.self_attn.q_norm.weight", [HEAD_DIM], torch.ones(HEAD_DIM, dtype=torch.bfloat16)),
                        (f"{p}.self_attn.k_norm.weight", [HEAD_DIM], torch.ones(HEAD_DIM, dtype=torch.bfloat16)),
                        (f"{p}.mlp.gate.weight", [EXPERTS, HIDDEN], lambda: rnd(EXPERTS, HIDDEN))]
            for e in range(EXPERTS):  # each expert's three tensors back to back, as published checkpoints are
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    w = pool[proj][(e + li) % 8]
                    tensors.append((f"{p}.mlp.experts.{e}.{proj}.weight", list(w.shape), w))
        _write_shard(out / name, tensors)
        weight_map.update({t[0]: name for t in tensors})
        if progress:
            progress(len(group))
    name = f"model-{n_sh:05d}-of-{n_sh:05d}.safetensors"
    rest = [("model.embed_tokens.weight", [vocab, HIDDEN], lambda: rnd(vocab, HIDDEN)),
            ("model.norm.weight", [HIDDEN], torch.ones(HIDDEN, dtype=torch.bfloat16)),
            ("lm_head.weight", [vocab, HIDDEN], lambda: rnd(vocab, HIDDEN))]
    _write_shard(out / name, rest)
    weight_map.update({t[0]: name for t in rest})
    write_text(out / "config.json", cfg.to_json_string())
    write_tokenizer(out)
    write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})  # the marker: last
    return out
