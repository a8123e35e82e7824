"""`expertcache import-gguf`: a llama.cpp GGUF file (written here with the `gguf` package, as llama.cpp's converter
writes one) becomes a checkpoint whose experts are llama.cpp's own bytes, repacked without rounding."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from helpers import tiny_file

from expertcache.runtime.kernels import quant
from expertcache.telemetry.errors import InputError

Q = gguf.GGMLQuantizationType
TEXT = "thou art\n\n\nthe cat é ü 字 and 42"  # a run of newlines: GPT-2 and Qwen2 patterns split it apart


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


GGUF_ARCH = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama"}  # llama.cpp files Mixtral as llama


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's row order for a llama-architecture query or key matrix (its rotary layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(src, out, experts=Q.Q8_0, arch=None, others=Q.F32, drop=(), expert_width=None, fuse_qkv=False,
               meta=None, rows=None):
    """The HF checkpoint at `src` as a GGUF file the way llama.cpp's converter writes its family (Qwen3-MoE, OLMoE,
    or Mixtral as `llama` with permuted query/key rows): names, shapes and metadata, its tokenizer as a gpt2-style
    BPE vocabulary, the experts in `experts` and the other matrices in `others`; `fuse_qkv` as the converter's
    --fuse-qkv (one attn_qkv matrix); `meta`: extra `{arch}.KEY` values; `rows`: a damaged file whose query matrix
    has that many rows."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    c = m.config
    family = c.model_type
    arch = arch or GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if family == "qwen3_moe":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_expert_feed_forward_length(expert_width or c.moe_intermediate_size)
    elif family == "mixtral":  # as the converter writes a config with its own head_dim
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_dimension_count(c.head_dim)
    for k, v in (meta or {}).items():
        if isinstance(v, str):
            w.add_string(f"{arch}.{k}", v)
        else:
            w.add_float32(f"{arch}.{k}", v)
    tj = json.loads((src / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    for t in tj.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {t["id"] for t in tj.get("added_tokens", [])}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    merges = tj["model"]["merges"]
    w.add_token_merges([" ".join(x) if isinstance(x, list) else x for x in merges])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.pad_token_id)

    def put(name, t, qtype):
        a = t.detach().float().numpy() if isinstance(t, torch.Tensor) else t
        if name in drop:
            return
        if qtype == Q.F32:
            w.add_tensor(name, a)
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    sd = m.state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"], others)
    put("output_norm.weight", sd["model.norm.weight"], Q.F32)
    if not c.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"], others)
    names = {"input_layernorm.weight": ("attn_norm.weight", Q.F32),
             "post_attention_layernorm.weight": ("ffn_norm.weight", Q.F32),
             "self_attn.o_proj.weight": ("attn_output.weight", others),
             "self_attn.q_norm.weight": ("attn_q_norm.weight", Q.F32),
             "self_attn.k_norm.weight": ("attn_k_norm.weight", Q.F32), "mlp.gate.weight": ("ffn_gate_inp.weight", Q.F32)}
    inter = c.moe_intermediate_size if family == "qwen3_moe" else c.intermediate_size
    for i, layer in enumerate(m.model.layers):
        for hf, (g, qt) in names.items():
            if f"model.layers.{i}.{hf}" in sd:  # (Mixtral has no query/key norms)
                put(f"blk.{i}.{g}", sd[f"model.layers.{i}.{hf}"], qt)
        q, k, v = (sd[f"model.layers.{i}.self_attn.{x}_proj.weight"].numpy() for x in "qkv")
        if arch == "llama":
            q, k = permute(q, c.num_attention_heads), permute(k, c.num_key_value_heads)
        if rows is not None:
            q = q[:rows]
        if fuse_qkv:
            put(f"blk.{i}.attn_qkv.weight", np.concatenate([q, k, v]), others)
        else:
            for x, a in zip("qkv", (q, k, v)):
                put(f"blk.{i}.attn_{x}.weight", a, others)
        ex = layer.mlp.experts
        put(f"blk.{i}.ffn_gate_exps.weight", ex.gate_up_proj[:, :inter], experts)
        put(f"blk.{i}.ffn_up_exps.weight", ex.gate_up_proj[:, inter:], experts)
        put(f"blk.{i}.ffn_down_exps.weight", ex.down_proj, experts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def refused_in_one_line(cases, out, capsys) -> None:
    """Each (file, message): `import-gguf` exits 2 with that message as its one stderr line and writes nothing."""
    from expertcache.recipes.cli import main

    capsys.readouterr()
    for f, msg in cases:
        assert main(["import-gguf", "--gguf", str(f), "--out", str(out)]) == 2, msg
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], (msg, err)
        assert not out.exists()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from tiny_lm import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("gguf") / "src", hidden_size=64, moe_intermediate_size=64,
                                intermediate_size=64)


def _logits(m, ids):
    with torch.no_grad():
        return m(input_ids=ids).logits[0].float()


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.BF16])
def test_a_gguf_file_imports_with_llama_cpps_own_expert_weights(src, tmp_path, kind):
    """Q8_0 / Q4_0 experts become our int8 / int4 group-32 store holding exactly the weights llama.cpp dequantizes;
    BF16 a bf16 checkpoint. The tokenizer and configuration come from the file; the model decodes through the engine
    like the source model holding the same expert weights (within the integer kernels' 5%)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.runtime import load
    from expertcache.runtime.kernels.gguf_import import _array, import_gguf
    from expertcache.runtime.storage.tiers import HostTier

    f = write_gguf(src, tmp_path / "m.gguf", experts=kind)
    out = tmp_path / "imported"
    rep = import_gguf(f, out)
    assert rep["experts_type"] == kind.name
    tok, ref_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(src)
    assert tok(TEXT).input_ids == ref_tok(TEXT).input_ids
    from transformers import AutoConfig

    cfg, want = AutoConfig.from_pretrained(out), AutoConfig.from_pretrained(src)
    for k in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):
        assert getattr(cfg, k) == getattr(want, k), k
    r = gguf.GGUFReader(str(f))
    T = {t.name: t for t in r.tensors}
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    qc = quant.read_config(out)
    tier = HostTier(quant.open_source(out, qc)) if qc else None
    if tier is not None:  # bytes in the store = bytes in the file: Q4_0 is our symmetric int4 (no minimums)
        assert qc["symmetric"] is True
        gguf_bytes = sum(int(T0.n_bytes) for T0 in gguf.GGUFReader(str(f)).tensors if "_exps" in T0.name)
        per_expert = sum(t.nbytes for t in tier.source.meta.tensors)  # (the 4 KiB alignment aside)
        assert per_expert * cfg.num_hidden_layers * cfg.num_experts == gguf_bytes
        names = {t.name for t in tier.source.meta.tensors}
        assert ("gate_up_proj.mins" in names) is False
    for i, layer in enumerate(ref.model.layers):  # the reference holds what llama.cpp would compute with
        g, u, d = (torch.from_numpy(_array(T[f"blk.{i}.{x}"]))
                   for x in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))
        gu = torch.cat([g, u], 1)
        if tier is not None:
            v = tier.layer_views(i)
            assert torch.equal(quant.dequantize(quant.parts(v, "gate_up_proj"), qc["bits"], 32), gu)  # bit-exact
            assert torch.equal(quant.dequantize(quant.parts(v, "down_proj"), qc["bits"], 32), d)
        layer.mlp.experts.gate_up_proj.data.copy_(gu)
        layer.mlp.experts.down_proj.data.copy_(d)
    ids = torch.tensor([ref_tok(TEXT).input_ids])
    m = load(out, capacity=0.5, tier="disk")
    assert _rel(_logits(m, ids), _logits(ref, ids)) < 5e-2
    m.expertcache.close()


def test_import_gguf_refuses_in_one_line(src, tmp_path, capsys):
    from expertcache.recipes.cli import main

    tiny_file(tmp_path / "s2.gguf", "qwen3moe", {"split.count": 2},  # the first of two split files
              **{"output_norm.weight": np.ones(4, np.float32)})
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    dense = tiny_file(tmp_path / "dense.gguf", "llama", **{"output_norm.weight": np.ones(4, np.float32)})  # Llama
    cases = [(write_gguf(src, tmp_path / "k.gguf", experts=Q.Q5_0), "stored as Q5_0; import-gguf reads experts all "
              "in one of Q8_0, Q4_0 (repacked as they are) or BF16/F16/F32; give --requantize int4"),
             (write_gguf(src, tmp_path / "l.gguf", arch="qwen2moe"), "is a 'qwen2moe' model; import-gguf reads "
              "qwen3moe (Qwen3-MoE), olmoe (OLMoE), llama (Mixtral)"),
             (dense, "is a dense llama-architecture model (no expert_count)"),
             (write_gguf(src, tmp_path / "d.gguf", drop=("blk.1.ffn_up_exps.weight",)), "has no blk.1.ffn_up_exps"),
             (bad, "is not a readable GGUF file"), (tmp_path / "none.gguf", "no such file"),
             (tmp_path / "s2.gguf", "is one of 2 split files: merge them first"),
             (write_gguf(src, tmp_path / "w.gguf", expert_width=128), "blk.0.ffn_gate_exps.weight is [8, 64, 64]; "
              "its metadata (hidden 64, expert width 128, 8 experts) says [8, 128, 64]"),
             (write_gguf(src, tmp_path / "r.gguf", drop=("blk.0.ffn_gate_inp.weight",)),
              "has no tensor for model.layers.0.mlp.gate.weight")]
    refused_in_one_line(cases, tmp_path / "o", capsys)
    assert main(["import-gguf", "--gguf", str(cases[0][0]), "--out", str(tmp_path / "o"), "--requantize",
                 "int3"]) == 2
    assert "--requantize int3: expected int8 or int4" in capsys.readouterr().err
    with pytest.raises(InputError, match="--out is required"):
        from expertcache.runtime.commands import import_gguf

        import_gguf(str(bad))


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0])
def test_attention_in_the_experts_type_stays_packed(src, tmp_path, kind):
    """A file whose attention matrices are in the experts' type (what `llama-quantize q4_0` writes) keeps them packed:
    they load as QuantLinear holding llama.cpp's weights exactly, and the model decodes like the source holding
    llama.cpp's dequantized attention and experts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.runtime import load
    from expertcache.runtime.kernels.gguf_import import _array, import_gguf

    f = write_gguf(src, tmp_path / "m.gguf", experts=kind, others=kind)
    out = tmp_path / "imported"
    rep = import_gguf(f, out)
    # q, k, v, o of 2 layers and the untied output head; int4 packs 64 inputs per chunk: o_proj (32 inputs) is not
    assert rep["packed_linears"] == (4 * 2 + 1 if kind == Q.Q8_0 else 3 * 2 + 1)
    T = {t.name: t for t in gguf.GGUFReader(str(f)).tensors}
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    gg = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    for i, layer in enumerate(ref.model.layers):
        for hf, g in gg.items():
            getattr(layer.self_attn, hf).weight.data.copy_(torch.from_numpy(_array(T[f"blk.{i}.{g}.weight"])))
        gu = torch.cat([torch.from_numpy(_array(T[f"blk.{i}.ffn_{x}_exps.weight"])) for x in ("gate", "up")], 1)
        layer.mlp.experts.gate_up_proj.data.copy_(gu)
        layer.mlp.experts.down_proj.data.copy_(torch.from_numpy(_array(T[f"blk.{i}.ffn_down_exps.weight"])))
    ref.lm_head.weight.data.copy_(torch.from_numpy(_array(T["output.weight"])))
    ref.model.embed_tokens.weight.data.copy_(torch.from_numpy(_array(T["token_embd.weight"])))  # in `kind` too
    m = load(out, capacity=0.5, tier="disk")
    q = m.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == "QuantLinear" and q.bits == (8 if kind == Q.Q8_0 else 4) and q.group == 32
    bits = 8 if kind == Q.Q8_0 else 4
    assert torch.equal(quant.dequantize(q.packed(), bits, 32), torch.from_numpy(_array(T["blk.0.attn_q.weight"])))
    ids = torch.tensor([AutoTokenizer.from_pretrained(src)(TEXT).input_ids])
    assert _rel(_logits(m, ids), _logits(ref, ids)) < 5e-2
    m.expertcache.close()


@pytest.mark.parametrize("kind,bits", [(Q.Q5_0, 4), (Q.Q4_1, 8)])
def test_other_expert_types_are_quantized_again_on_request(src, tmp_path, kind, bits):
    """`--requantize int4|int8`: experts in a type we do not hold (here Q5_0 and Q4_1, as K-quants would be) are
    dequantized by gguf and quantized again; the report gives each layer's relative error against the file's weights,
    and it is the error of what the store holds."""
    from expertcache.runtime import load
    from expertcache.runtime.kernels.gguf_import import _array, import_gguf
    from expertcache.runtime.storage.tiers import HostTier

    f = write_gguf(src, tmp_path / "m.gguf", experts=kind)
    out = tmp_path / "imported"
    rep = import_gguf(f, out, requantize=f"int{bits}")
    assert rep["requantized"] and rep["experts"] == f"int{bits}" and rep["experts_type"] == kind.name
    qc = quant.read_config(out)
    assert qc["bits"] == bits and qc["source"]["requantized"]
    T = {t.name: t for t in gguf.GGUFReader(str(f)).tensors}
    tier = HostTier(quant.open_source(out, qc))
    for i, e in enumerate(rep["relative_error_vs_gguf"]):
        w = torch.cat([torch.from_numpy(_array(T[f"blk.{i}.ffn_{x}_exps.weight"])) for x in ("gate", "up")], 1)
        d = torch.from_numpy(_array(T[f"blk.{i}.ffn_down_exps.weight"]))
        v = tier.layer_views(i)
        gu = quant.dequantize(quant.parts(v, "gate_up_proj"), bits, 32)
        dn = quant.dequantize(quant.parts(v, "down_proj"), bits, 32)
        got = float((((gu - w) ** 2).sum() + ((dn - d) ** 2).sum()) / ((w ** 2).sum() + (d ** 2).sum())) ** 0.5
        assert got == pytest.approx(e, rel=1e-3, abs=1e-6) and 0 < e < (0.02 if bits == 8 else 0.2)
    m = load(out, capacity=0.5, tier="disk")
    with torch.no_grad():
        assert torch.isfinite(m(input_ids=torch.tensor([[5, 9, 33, 2]])).logits).all()
    m.expertcache.close()


def test_import_gguf_never_writes_over_the_file_it_reads(src, tmp_path, capsys):
    """--out naming the file, its folder or a folder above it is refused, and the file is still there."""
    from expertcache.recipes.cli import main

    (tmp_path / "a" / "b").mkdir(parents=True)
    f = write_gguf(src, tmp_path / "a" / "b" / "m.gguf")
    before = f.read_bytes()
    capsys.readouterr()
    for out in (f, f.parent, tmp_path / "a"):
        assert main(["import-gguf", "--gguf", str(f), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("is also an input" in err[0] or "writing it would delete the input" in err[0]), err
        assert f.read_bytes() == before


def test_requantize_takes_a_native_file_to_another_format(src, tmp_path):
    """--requantize int4 on a Q8_0 file gives int4 experts (quantized again), not a silent int8 import."""
    from expertcache.runtime.kernels.gguf_import import import_gguf

    rep = import_gguf(write_gguf(src, tmp_path / "m.gguf", experts=Q.Q8_0), tmp_path / "o", requantize="int4")
    assert rep["requantized"] and rep["experts"] == "int4" and quant.read_config(tmp_path / "o")["bits"] == 4
    rep = import_gguf(write_gguf(src, tmp_path / "n.gguf", experts=Q.Q8_0), tmp_path / "p", requantize="int8")
    assert not rep["requantized"] and rep["experts"] == "int8"  # the same format: repacked as it is
    # attention in the file's own Q4_0 while the experts go to int8: the attention is dequantized, not left packed
    # in a format the checkpoint's config does not describe (it was, and the checkpoint did not load)
    from expertcache.runtime import load

    f = write_gguf(src, tmp_path / "a.gguf", experts=Q.Q4_0, others=Q.Q4_0)
    rep = import_gguf(f, tmp_path / "r", requantize="int8")
    assert rep["requantized"] and rep["experts"] == "int8"
    assert "linears" not in quant.read_config(tmp_path / "r")
    load(tmp_path / "r", capacity=1.0, tier="host").expertcache.close()


@pytest.fixture(scope="module", params=["mixtral", "olmoe"])
def family_src(request, tmp_path_factory):
    from tiny_lm import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "src", family=request.param, hidden_size=64,
                                intermediate_size=64, rms_norm_eps=3e-6,
                                rope_parameters={"rope_type": "default", "rope_theta": 54321.0})


def _qdq(a: np.ndarray, kind) -> torch.Tensor:
    """`a` as llama.cpp holds it in `kind` (quantized, then dequantized by gguf)."""
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(gguf.quants.quantize(a, kind), kind), np.float32)
                            .reshape(a.shape))


@pytest.mark.parametrize("kind,fuse_qkv", [(Q.BF16, False), (Q.BF16, True), (Q.Q8_0, False), (Q.Q8_0, True),
                                           (Q.Q4_0, False)])
def test_mixtral_and_olmoe_files_import(family_src, tmp_path, kind, fuse_qkv):
    """Mixtral (llama.cpp's `llama` architecture, query/key rows permuted for its rotary layout) and OLMoE files, with
    the attention in the experts' type and, as the converter's --fuse-qkv writes them, in one matrix. BF16: the
    checkpoint `from_pretrained` loads is the source's weights exactly (names, row order, config). Q8_0: the packed
    attention holds llama.cpp's weights exactly in the model's own row order (row-wise blocks commute with the row
    permutation, so the reference is quantized in the model's order), and the model decodes like the source holding
    llama.cpp's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from expertcache.runtime import load
    from expertcache.runtime.kernels.gguf_import import import_gguf

    src = family_src
    f = write_gguf(src, tmp_path / "m.gguf", experts=kind, others=Q.F32 if kind == Q.BF16 else kind, fuse_qkv=fuse_qkv)
    out = tmp_path / "imported"
    rep = import_gguf(f, out)
    want, cfg = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(out)
    assert rep["architecture"] == GGUF_ARCH[want.model_type] and cfg.model_type == want.model_type
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "num_experts_per_tok", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
              "max_position_embeddings"):
        assert getattr(cfg, k) == getattr(want, k), k
    assert cfg.rope_parameters["rope_theta"] == 54321.0 and cfg.rope_parameters["rope_type"] == "default"
    assert cfg.rms_norm_eps == pytest.approx(3e-6)
    if want.model_type == "mixtral":
        assert cfg.num_local_experts == want.num_local_experts and cfg.head_dim == want.head_dim
    else:
        assert cfg.num_experts == want.num_experts and cfg.norm_topk_prob is False  # as llama.cpp routes OLMoE
    tok, ref_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(src)
    assert tok(TEXT).input_ids == ref_tok(TEXT).input_ids
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.tensor([ref_tok(TEXT).input_ids])
    if kind == Q.BF16:  # one shard per MoE layer (written as converted) and the rest, with an index
        assert sorted(x.name for x in out.glob("*.safetensors")) == [
            "model-experts-00001-of-00002.safetensors", "model-experts-00002-of-00002.safetensors",
            "model-rest.safetensors"] and (out / "model.safetensors.index.json").is_file()
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
        for k, v in ref.to(torch.bfloat16).state_dict().items():
            assert torch.equal(got[k], v), k
        ref = ref.to(torch.float32)
    else:
        inter = want.intermediate_size
        for layer in ref.model.layers:
            for x in ("q_proj", "k_proj", "v_proj", "o_proj"):
                lin = getattr(layer.self_attn, x)
                lin.weight.data.copy_(_qdq(lin.weight.detach().numpy(), kind))
            ex = layer.mlp.experts
            gu = ex.gate_up_proj.detach().numpy()
            ex.gate_up_proj.data.copy_(torch.cat([_qdq(gu[:, :inter].copy(), kind), _qdq(gu[:, inter:].copy(), kind)], 1))
            ex.down_proj.data.copy_(_qdq(ex.down_proj.detach().numpy(), kind))
        for lin in (ref.lm_head, ref.model.embed_tokens):
            lin.weight.data.copy_(_qdq(lin.weight.detach().numpy(), kind))
    m = load(out, capacity=0.5, tier="disk")
    if kind != Q.BF16:
        for x in ("q_proj", "k_proj", "v_proj"):  # bit-exact, in the model's own row order
            lin = getattr(m.model.layers[1].self_attn, x)
            assert type(lin).__name__ == "QuantLinear"
            assert torch.equal(quant.dequantize(lin.packed(), lin.bits, 32).float(),
                               getattr(ref.model.layers[1].self_attn, x).weight.detach()), x
    assert _rel(_logits(m, ids), _logits(ref.to(torch.bfloat16), ids)) < 5e-2
    m.expertcache.close()


def test_rope_scaling_is_read_as_llama_cpp_applies_it(family_src, tmp_path, capsys):
    """Linear and YaRN rope scaling become the config's rope_parameters; a type or YaRN setting the import cannot
    reproduce is refused in one line, as are damaged files of these families (nothing written)."""
    from expertcache.recipes.cli import main
    from expertcache.runtime.kernels.gguf_import import import_gguf

    arch = GGUF_ARCH["mixtral" if "mixtral" in str(family_src) else "olmoe"]
    import_gguf(write_gguf(family_src, tmp_path / "lin.gguf", meta={"rope.scaling.type": "linear",
                                                                    "rope.scaling.factor": 4.0}), tmp_path / "a")
    from transformers import AutoConfig

    rp = AutoConfig.from_pretrained(tmp_path / "a").rope_parameters
    assert rp["rope_type"] == "linear" and rp["factor"] == 4.0 and rp["rope_theta"] == 54321.0
    import_gguf(write_gguf(family_src, tmp_path / "y.gguf", meta={
        "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64.0}),
        tmp_path / "b")
    rp = AutoConfig.from_pretrained(tmp_path / "b").rope_parameters
    assert rp["rope_type"] == "yarn" and rp["factor"] == 4.0 and rp["original_max_position_embeddings"] == 64
    old = tiny_file(tmp_path / "old.gguf", arch, {f"{arch}.expert_count": 2},  # llama.cpp's files before 2024:
                    **{"blk.0.ffn_gate.0.weight": np.ones((4, 4), np.float32)})  # one tensor per expert
    cases = [(write_gguf(family_src, tmp_path / "s.gguf", meta={"rope.scaling.type": "longrope",
                                                                "rope.scaling.factor": 2.0}),
              "rope scaling 'longrope' (factor 2); import-gguf reads none, linear or yarn"),
             (write_gguf(family_src, tmp_path / "t.gguf", meta={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                                                "rope.scaling.yarn_attn_factor": 0.5}),
              "yarn_attn_factor = 0.5; import-gguf reads YaRN files with the default attention scaling only"),
             (write_gguf(family_src, tmp_path / "r.gguf", rows=30), "has 30 rows; the metadata's heads need"),
             (write_gguf(family_src, tmp_path / "f.gguf", rows=30, fuse_qkv=True), "rows; 4 query and 2 key/value heads of"),
             (old, "stores one tensor per expert (blk.0.ffn_gate.0.weight")]
    refused_in_one_line(cases, tmp_path / "o", capsys)
