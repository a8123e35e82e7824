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


def _bpe(texts: list[str] | None = None, vocab: int = 300):
    """The byte-level BPE `write_tokenizer` saves (a `tokenizers.Tokenizer`)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts or ["the expert cache keeps the hot experts close and reads the rest from disk"] * 64,
                            vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    return bpe._tokenizer


def write_tokenizer(out: Path, texts: list[str] | None = None, vocab: int = 300) -> None:
    """A byte-level BPE, so the checkpoint is complete for tools that need a tokenizer. By default a small one (the
    256 byte tokens, a few merges, `<|endoftext|>`; llama.cpp's converter pads the vocabulary to the model's with
    unused tokens), enough for the benchmarks that feed token ids; with `texts`, `vocab` tokens learned from them
    (see `full_vocab_copy`). Kept when one is there."""
    if (out / "tokenizer.json").is_file():
        return
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(texts, vocab), eos_token="<|endoftext|>",
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


GGUF_NAME = "expertcache bench big, Qwen3-30B-A3B-shaped"  # general.name of `write_gguf_q4_0`'s files
Q4_0_BLOCK = (32, 18)  # llama.cpp's Q4_0: 32 weights in 18 bytes (an fp16 scale, 16 bytes of nibbles)


def q4_0_expert_bytes() -> int:
    """Bytes of one expert's three matrices in Q4_0 (as the GGUF holds them; `import-gguf` keeps the same bytes)."""
    return 3 * HIDDEN * INTER // Q4_0_BLOCK[0] * Q4_0_BLOCK[1]


def write_gguf_q4_0(out: str | Path, layers: int, vocab: int = 32768, progress=None) -> Path:
    """The checkpoint of `write_checkpoint` (the same random draws, in the same order) written directly as a llama.cpp
    GGUF with llama.cpp's own Q4_0 rule (gguf's reference quantization) for every matrix but the router, and no bf16
    copy anywhere: the 48-layer shape's bf16 experts are 58 GB, its Q4_0 file 17 GB. Norms and routers are F32, as
    llama.cpp's converter writes them; the metadata and the tokenizer (the small byte-level BPE, padded to the
    vocabulary with unused tokens) as the converter writes them for Qwen3-MoE. Tensors are written one at a time (a
    layer's experts are never all in memory); the file is complete when it has its name (`atomic_open`'s rule).
    Reused when it is there with `layers` layers. `expertcache import-gguf` turns it into the int4 checkpoint that
    expertcache serves, with the same codes and scales."""
    import gguf

    from expertcache.telemetry.atomic import _alive, atomic_open

    out = Path(out)
    want = {"general.name": GGUF_NAME, "qwen3moe.block_count": layers, "qwen3moe.expert_count": EXPERTS,
            "qwen3moe.embedding_length": HIDDEN, "qwen3moe.expert_feed_forward_length": INTER}
    if out.is_file():
        try:  # this writer's file at this shape: reused; anything else (another shape, a foreign file): replaced
            r = gguf.GGUFReader(str(out))
            same = all(k in r.fields and r.fields[k].contents() == v for k, v in want.items()) \
                and len(r.fields["tokenizer.ggml.tokens"].contents()) == vocab
            del r
        except Exception:  # noqa: BLE001 - a file gguf cannot read is one to write again
            same = False
        if same:
            return out
        out.unlink()  # before the new one is written: the disk need not hold both
    for stale in out.parent.glob(f".{out.name}.tmp-*"):  # a run killed while writing (atomic_open's temporaries)
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            stale.unlink()
    cfg = big_config(layers, vocab)
    Q = gguf.GGMLQuantizationType
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=0.02):  # write_checkpoint's draws, in its order
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    def q4(t: torch.Tensor) -> np.ndarray:
        return gguf.quants.quantize(t.float().numpy(), Q.Q4_0)

    def f32(t: torch.Tensor) -> np.ndarray:
        return t.float().numpy()

    pool = {n: [rnd(*s) for _ in range(8)] for n, s in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                                                         ("down_proj", (HIDDEN, INTER)))}
    pool_q = {n: [q4(w) for w in ws] for n, ws in pool.items()}  # each distinct expert matrix quantized once
    del pool
    Q_W, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731 - the norms' weights, as write_checkpoint's
    # (name, numpy shape, kind, make): every tensor in write_checkpoint's draw order, made when it is written
    plan = []
    for li in range(layers):
        b = f"blk.{li}"
        plan += [(f"{b}.attn_norm.weight", [HIDDEN], Q.F32, lambda: ones(HIDDEN)),
                 (f"{b}.ffn_norm.weight", [HIDDEN], Q.F32, lambda: ones(HIDDEN)),
                 (f"{b}.attn_q.weight", [Q_W, HIDDEN], Q.Q4_0, lambda: q4(rnd(Q_W, HIDDEN))),
                 (f"{b}.attn_k.weight", [KV, HIDDEN], Q.Q4_0, lambda: q4(rnd(KV, HIDDEN))),
                 (f"{b}.attn_v.weight", [KV, HIDDEN], Q.Q4_0, lambda: q4(rnd(KV, HIDDEN))),
                 (f"{b}.attn_output.weight", [HIDDEN, Q_W], Q.Q4_0, lambda: q4(rnd(HIDDEN, Q_W))),
                 (f"{b}.attn_q_norm.weight", [HEAD_DIM], Q.F32, lambda: ones(HEAD_DIM)),
                 (f"{b}.attn_k_norm.weight", [HEAD_DIM], Q.F32, lambda: ones(HEAD_DIM)),
                 (f"{b}.ffn_gate_inp.weight", [EXPERTS, HIDDEN], Q.F32, lambda: f32(rnd(EXPERTS, HIDDEN)))]
        for gname, proj, shape in (("ffn_gate_exps", "gate_proj", [EXPERTS, INTER, HIDDEN]),
                                   ("ffn_up_exps", "up_proj", [EXPERTS, INTER, HIDDEN]),
                                   ("ffn_down_exps", "down_proj", [EXPERTS, HIDDEN, INTER])):
            plan.append((f"{b}.{gname}.weight", shape, Q.Q4_0,  # expert e of layer li: write_checkpoint's choice
                         lambda li=li, proj=proj: np.stack([pool_q[proj][(e + li) % 8] for e in range(EXPERTS)])))
    plan += [("token_embd.weight", [vocab, HIDDEN], Q.Q4_0, lambda: q4(rnd(vocab, HIDDEN))),
             ("output_norm.weight", [HIDDEN], Q.F32, lambda: ones(HIDDEN)),
             ("output.weight", [vocab, HIDDEN], Q.Q4_0, lambda: q4(rnd(vocab, HIDDEN)))]

    tj = json.loads(_bpe().to_str())
    vocab_of = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj.get("added_tokens", [])}}
    tokens = [f"[PAD{i}]" for i in range(vocab)]  # the converter pads a small vocabulary the same way
    types = [gguf.TokenType.UNUSED] * vocab
    for t, i in vocab_of.items():
        tokens[i], types[i] = t, gguf.TokenType.NORMAL
    for t in tj.get("added_tokens", []):
        types[t["id"]] = gguf.TokenType.CONTROL

    with atomic_open(out) as f:
        w = gguf.GGUFWriter(None, "qwen3moe")  # the file is handed to it below, so the temporary name is atomic_open's
        w.add_type("model")
        w.add_name(GGUF_NAME)
        w.add_block_count(layers)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(HIDDEN)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(TOP_K)
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_expert_feed_forward_length(INTER)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
        w.add_bos_token_id(cfg.bos_token_id)
        w.add_eos_token_id(cfg.eos_token_id)
        w.add_pad_token_id(cfg.pad_token_id)
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
        for name, shape, kind, _ in plan:
            if kind == Q.Q4_0:
                nbytes = int(np.prod(shape)) // Q4_0_BLOCK[0] * Q4_0_BLOCK[1]
                w.add_tensor_info(name, [*shape[:-1], shape[-1] // Q4_0_BLOCK[0] * Q4_0_BLOCK[1]], np.dtype(np.uint8),
                                  nbytes, raw_dtype=kind)
            else:
                w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        w.fout = [f]
        w.state = gguf.gguf_writer.WriterState.EMPTY
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (name, shape, kind, make) in enumerate(plan):
            w.write_tensor_data(make())
            if progress and name.endswith("ffn_down_exps.weight"):
                progress(1)
        w.fout = None  # atomic_open closes, fsyncs and names the file
    return out
