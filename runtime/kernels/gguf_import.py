"""`expertcache import-gguf`: a llama.cpp GGUF file as an expertcache checkpoint, its routed experts kept in the
format they are stored in.

llama.cpp's Q8_0 and Q4_0 are group-wise integer formats over groups of 32 inputs, as ours are, so their experts are
repacked without any rounding:
- **Q8_0** (per block: fp16 scale d, 32 int8 q; w = d q) is our int8 at group 32: the same integers and scales.
- **Q4_0** (per block: fp16 scale d, 16 bytes of nibbles, inputs 0-15 low and 16-31 high; w = d (q - 8)) is our
  symmetric int4 at group 32 (`quantize --symmetric true`): the same codes and scales, repacked into our nibble
  order, 18 bytes per 32 weights as in the file.
- **BF16 / F16 / F32** experts become a plain bf16 checkpoint (per-expert tensors, as Hugging Face saves them), one
  safetensors shard per MoE layer written as it is converted, so memory holds one layer's experts at a time.
Other expert types (the K-quants of `Q4_K_M` and friends, IQ*) are refused in one line, unless `--requantize int4`
(or int8) is given: they are then dequantized with gguf's own dequantization and quantized again (a second rounding,
each layer's relative error against the file's weights reported); `llama-quantize --pure FILE OUT Q4_0` is the
lossless-at-import alternative. Attention matrices and an untied output head stored in the
experts' own Q8_0/Q4_0 stay packed the same way (`QuantLinear`, as `quantize --linears true` writes them); the other
tensors (norms, routers, embeddings, matrices of another type) are dequantized to bf16. The configuration and the tokenizer come from the file's
metadata through transformers' GGUF reader (which needs the `gguf` package); the expert width is read from the
file itself (`expert_feed_forward_length`).

Architectures (llama.cpp's name -> ours): `qwen3moe` (Qwen3-MoE: Qwen3-30B-A3B, Qwen3-235B-A22B and their
fine-tunes), `olmoe` (OLMoE) and `llama` with experts (Mixtral: llama.cpp files Mixtral under the llama architecture,
with its query and key rows permuted for its rotary layout; they are permuted back). A dense `llama` file (no experts)
is refused. The converter's `--fuse-qkv` (`attn_qkv`) is read too (split back into the query, key and value
matrices). Qwen3-MoE's configuration is transformers' GGUF mapping; OLMoE's and Mixtral's, which transformers does not
map, are read from the file's own keys here (`_own_config`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from expertcache.telemetry.errors import InputError

from expertcache.runtime.storage.weight_checks import INTEGRITY_DEFAULT

ARCHS = {"qwen3moe": "qwen3_moe", "olmoe": "olmoe", "llama": "mixtral"}  # GGUF architecture -> our family
FAMILY = {"qwen3_moe": ("Qwen3-MoE", "Qwen3MoeForCausalLM"), "olmoe": ("OLMoE", "OlmoeForCausalLM"),
          "mixtral": ("Mixtral", "MixtralForCausalLM")}
# GGUF tensor name (after `blk.N.`) -> the model's module tensor name (after `model.layers.N.`); the checkpoint's
# own name follows from it (`checkpoint.checkpoint_name`: Mixtral's `block_sparse_moe`)
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
               "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
               "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
               "ffn_gate_inp.weight": "mlp.gate.weight"}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
QKV = "attn_qkv.weight"  # the converter's --fuse-qkv: query rows, key rows, value rows
PACKED = {"Q8_0": 8, "Q4_0": 4}  # GGUF type -> our bits (group 32), repacked by CONVERT below
FLOAT = ("BF16", "F16", "F32")


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise InputError("import-gguf reads GGUF files with the `gguf` package: pip install gguf") from None
    if not path.is_file():
        raise InputError(f"--gguf {path}: no such file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file, whatever gguf raises for it
        raise InputError(f"--gguf {path} is not a readable GGUF file ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:120]})") from None


def _field(r, key: str, path: Path, default=None, kind=None):
    """Metadata `key`: its contents, or as a number (`kind`, one line when it is not one); `default` when absent
    (None: required, one line)."""
    f = r.fields.get(key)
    if f is None:
        if default is None:
            raise InputError(f"--gguf {path} has no {key} in its metadata (not a complete llama.cpp model file)")
        return default
    v = f.contents()
    if kind is None or kind is str:
        return v
    if isinstance(v, (list, str)):
        raise InputError(f"--gguf {path}: {key} is {str(v)[:40]!r}, not a number (damaged file)")
    return kind(v)


def _array(t) -> np.ndarray:
    """A tensor's values as float32 in numpy order (the GGUF shape reversed), dequantized from its type."""
    from gguf import quants

    a = quants.dequantize(t.data, t.tensor_type) if t.tensor_type.name != "F32" else np.array(t.data)
    return np.asarray(a, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])


def _blocks(t, size: int) -> np.ndarray:
    """A packed tensor's bytes as `[E, rows, blocks, size]` (a matrix: E = 1)."""
    e = int(t.shape[2]) if len(t.shape) > 2 else 1
    return np.ascontiguousarray(t.data).reshape(e, int(t.shape[1]), -1, size)


def _q8(t) -> dict[str, np.ndarray]:
    """Q8_0 `[E, rows, n]` -> our int8 group 32: `q` int8 `[E, rows, n]`, `scales` fp16 `[E, rows, n / 32]`."""
    b = _blocks(t, 34)
    d = b[..., :2].copy().view(np.float16)[..., 0]
    q = b[..., 2:].copy().view(np.int8).reshape(b.shape[0], b.shape[1], -1)
    return {"q": q, "scales": d}


def _q4(t) -> dict[str, np.ndarray]:
    """Q4_0 -> our symmetric int4 group 32: the same codes in our order (per 64 inputs, byte j holds input j low and
    32 + j high), scale d (w = d (q - 8))."""
    b = _blocks(t, 18)
    d = b[..., :2].copy().view(np.float16)[..., 0]
    from expertcache.runtime.kernels import quant

    qs = b[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(b.shape[0], b.shape[1], -1)  # inputs in order
    return {"q": quant.pack4(torch.from_numpy(codes)).numpy(), "scales": d}


def rest_is_linear(name: str) -> bool:
    """The GGUF matrices that load as linear layers (not the embeddings, norms or the router)."""
    return name == "output.weight" or name.split(".", 2)[-1] in ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                                  "attn_output.weight", QKV)


CONVERT = {"Q8_0": _q8, "Q4_0": _q4}  # GGUF type -> its repacking into our parts


def _meta(r, arch: str, key: str, path: Path, default=None, kind=float):
    """`_field` of the architecture's `{arch}.{key}`, as a number (`kind`) by default."""
    return _field(r, f"{arch}.{key}", path, default, kind)


def _rope(r, arch: str, path: Path, theta: float, ctx: int) -> dict:
    """The rotary embedding's `rope_parameters`, as llama.cpp applies the file's keys: no scaling, linear (`factor`),
    or YaRN (`factor`, the original context, beta fast/slow). Another type, or YaRN settings transformers would read
    differently, are refused rather than imported as a model that computes something else."""
    typ = _meta(r, arch, "rope.scaling.type", path, "linear", str)  # llama.cpp's default type is linear
    factor = _meta(r, arch, "rope.scaling.factor", path, _meta(r, arch, "rope.scale_linear", path, 0.0))
    if typ == "none" or (typ == "linear" and factor in (0.0, 1.0)):
        return {"rope_type": "default", "rope_theta": theta}
    if typ == "linear":
        return {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    if typ == "yarn" and factor > 1:
        for key, neutral in (("rope.scaling.attn_factor", 1.0), ("rope.scaling.yarn_attn_factor", 1.0),
                             ("rope.scaling.yarn_ext_factor", -1.0), ("rope.scaling.yarn_log_multiplier", 0.0)):
            v = _meta(r, arch, key, path, neutral)
            if v != neutral:
                raise InputError(f"--gguf {path}: {arch}.{key} = {v:g}; import-gguf reads YaRN files with the "
                                 f"default attention scaling only")
        return {"rope_type": "yarn", "factor": factor, "rope_theta": theta,
                "original_max_position_embeddings": int(_meta(r, arch, "rope.scaling.original_context_length", path,
                                                              ctx)),
                "beta_fast": _meta(r, arch, "rope.scaling.yarn_beta_fast", path, 32.0),
                "beta_slow": _meta(r, arch, "rope.scaling.yarn_beta_slow", path, 1.0)}
    raise InputError(f"--gguf {path}: rope scaling {typ!r} (factor {factor:g}); import-gguf reads none, linear or "
                     f"yarn")


def _config(path: Path, r, arch: str, tensors: dict):
    """The Hugging Face config: transformers' GGUF mapping, with what it leaves out read from the file (the expert
    width, tying, and rope scaling, which the mapping drops)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    d = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    d = {k: v for k, v in d.items() if not k.startswith("_")}
    d["moe_intermediate_size"] = _meta(r, arch, "expert_feed_forward_length", path, kind=int)
    d["tie_word_embeddings"] = "output.weight" not in tensors
    d["rope_parameters"] = _rope(r, arch, path, float(d.pop("rope_theta", 10000.0)),
                                 int(d.get("max_position_embeddings", 4096)))
    d.pop("model_type", None)
    cfg = AutoConfig.for_model(ARCHS[arch], **d)
    cfg.architectures = [FAMILY[ARCHS[arch]][1]]
    cfg.dtype = torch.bfloat16
    return cfg


def _own_config(path: Path, r, arch: str, tensors: dict):
    """OLMoE's and Mixtral's config from the file's own keys (transformers' GGUF mapping has neither), read as
    llama.cpp reads them: sizes from the metadata (the head size from `key_length`, else hidden / heads), the expert
    width and vocabulary from the tensors themselves, the routing rule llama.cpp applies (OLMoE: top-k weights not
    renormalised, whatever the file says; Mixtral: renormalised, its only rule), special tokens only where the file
    names them."""
    from transformers import AutoConfig

    def get(key, default=None):
        return _meta(r, arch, key, path, default, int)

    family = ARCHS[arch]
    h, heads = get("embedding_length"), get("attention.head_count")
    kv = get("attention.head_count_kv", heads)
    if heads <= 0 or kv <= 0 or heads % kv:
        raise InputError(f"--gguf {path}: {heads} attention heads over {kv} key/value heads (damaged file)")
    for name in ("token_embd.weight", "blk.0.ffn_down_exps.weight"):
        if name not in tensors:
            raise InputError(f"--gguf {path} has no {name} (a complete {arch} file has one)")
    hd = get("attention.key_length", h // heads)
    for key in ("attention.value_length", "rope.dimension_count"):
        if get(key, hd) != hd:  # llama.cpp refuses a partial rotary dimension for these, transformers has none
            raise InputError(f"--gguf {path}: {arch}.{key} is {get(key)}, not the head size {hd}; import-gguf reads "
                             f"{FAMILY[family][0]} with full-width heads")
    ctx = get("context_length", 4096)
    theta = _meta(r, arch, "rope.freq_base", path, 10000.0)
    d = dict(hidden_size=h, num_hidden_layers=get("block_count"), num_attention_heads=heads, num_key_value_heads=kv,
             intermediate_size=int(tensors["blk.0.ffn_down_exps.weight"].shape[0]), max_position_embeddings=ctx,
             rms_norm_eps=_meta(r, arch, "attention.layer_norm_rms_epsilon", path),
             rope_parameters=_rope(r, arch, path, theta, ctx), vocab_size=int(tensors["token_embd.weight"].shape[1]),
             num_experts_per_tok=get("expert_used_count"), tie_word_embeddings="output.weight" not in tensors)
    if family == "mixtral":
        d.update(num_local_experts=get("expert_count"), head_dim=hd)
    else:
        if hd * heads != h:
            raise InputError(f"--gguf {path}: head size {hd} is not hidden {h} / {heads} heads, which OLMoE assumes")
        d.update(num_experts=get("expert_count"), norm_topk_prob=False)  # llama.cpp's OLMoE graph: never renormalised
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        f = r.fields.get(f"tokenizer.ggml.{key}")
        d[name] = int(f.contents()) if f is not None else None
    cfg = AutoConfig.for_model(family, **d)
    cfg.architectures = [FAMILY[family][1]]
    cfg.dtype = torch.bfloat16
    return cfg


REQUANTIZE = {"int8": (8, 32), "int4": (4, 32)}


def import_gguf(gguf_file, out, progress=None, requantize: str = "", overwrite: bool = False,
                integrity: str = INTEGRITY_DEFAULT) -> dict:
    """Write the checkpoint (see the module's docstring) at `out`, whole or not at all; returns the report.
    `requantize` (int8 | int4): experts in any other type (the K-quants of a `Q4_K_M` file, IQ*) are dequantized
    with gguf's own dequantization and quantized again into our format at group 32; a second rounding, so each
    layer's relative error against the file's weights is reported. `integrity` on: the folder written passes
    `verify`'s reference-free checks (finite, no magnitude outlier) before it is published (`weight_checks`)."""
    from safetensors.torch import save_file

    from expertcache.telemetry.adapters import weights_fingerprint
    from expertcache.telemetry.atomic import atomic_dir

    from expertcache.runtime.kernels import quant
    from expertcache.runtime.storage.checkpoint import INDEX, PARTS, checkpoint_name
    from expertcache.runtime.storage.store import StoreMeta, _write, layout
    from expertcache.runtime.storage.verify import check_written
    from expertcache.runtime.storage.weight_checks import check_integrity

    checks = check_integrity(integrity)
    path = Path(gguf_file).expanduser()
    r = _reader(path)
    split = r.fields.get("split.count")
    if split is not None and int(split.contents()) > 1:
        raise InputError(f"--gguf {path} is one of {int(split.contents())} split files: merge them first "
                         f"(`llama-gguf-split --merge {path.name} merged.gguf`)")
    arch = _field(r, "general.architecture", path)
    if arch not in ARCHS:
        raise InputError(f"--gguf {path} is a {arch!r} model; import-gguf reads "
                         f"{', '.join(f'{a} ({FAMILY[f][0]})' for a, f in ARCHS.items())}")
    family = ARCHS[arch]
    tensors = {t.name: t for t in r.tensors}
    n_l = _meta(r, arch, "block_count", path, kind=int)
    if arch == "llama" and not _meta(r, arch, "expert_count", path, 0, int):
        raise InputError(f"--gguf {path} is a dense llama-architecture model (no expert_count): import-gguf reads "
                         f"mixture-of-experts files (a Mixtral file has llama.expert_count)")
    n_e = _meta(r, arch, "expert_count", path, kind=int)
    kinds = set()
    for i in range(n_l):
        if f"blk.{i}.ffn_gate.0.weight" in tensors:
            raise InputError(f"--gguf {path} stores one tensor per expert (blk.{i}.ffn_gate.0.weight: llama.cpp's "
                             f"format before 2024); convert the model again with a current convert_hf_to_gguf.py")
        for x in EXPERTS:
            t = tensors.get(f"blk.{i}.{x}")
            if t is None:
                raise InputError(f"--gguf {path} has no blk.{i}.{x}: every layer of {arch} has routed experts")
            kinds.add(t.tensor_type.name)
    if requantize and requantize not in REQUANTIZE:
        raise InputError(f"--requantize {requantize}: expected int8 or int4 (or nothing)")
    native = len(kinds) == 1 and kinds <= set(PACKED) | set(FLOAT)
    if native and requantize and PACKED.get(next(iter(kinds))) != REQUANTIZE[requantize][0]:
        native = False  # another format asked for (Q8_0 or BF16 experts to int4, ...): quantized again
    if not native and not requantize:
        raise InputError(f"--gguf {path}: its experts are stored as {', '.join(sorted(kinds))}; import-gguf reads "
                         f"experts all in one of Q8_0, Q4_0 (repacked as they are) or BF16/F16/F32; give "
                         f"--requantize int4 (or int8) to quantize them again, or requantize the file with "
                         f"`llama-quantize --pure {path.name} OUT.gguf Q4_0`")
    kind = kinds.pop() if native else "+".join(sorted(kinds))
    out = Path(out)
    if out.resolve() == path.resolve() or out.resolve() in path.resolve().parents:
        raise InputError(f"--out {out} is or holds the GGUF file's folder (writing it would delete the file); write "
                         f"the checkpoint to a folder of its own")
    file_bytes = path.stat().st_size
    pre = r.fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in r.fields else None
    cfg = _config(path, r, arch, tensors) if family == "qwen3_moe" else _own_config(path, r, arch, tensors)
    h, inter = cfg.hidden_size, (cfg.moe_intermediate_size if family == "qwen3_moe" else cfg.intermediate_size)
    want = {"ffn_gate_exps.weight": (n_e, inter, h), "ffn_up_exps.weight": (n_e, inter, h),
            "ffn_down_exps.weight": (n_e, h, inter)}
    for i in range(n_l):  # the metadata and the tensors must agree, or the store would be laid out wrong
        for x in EXPERTS:
            got, shape = tuple(int(v) for v in reversed(tensors[f"blk.{i}.{x}"].shape)), want[x]
            if got != shape:
                raise InputError(f"--gguf {path}: blk.{i}.{x} is {list(got)}; its metadata (hidden "
                                 f"{h}, expert width {inter}, {n_e} experts) says {list(shape)} (damaged file)")
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
    hd = getattr(cfg, "head_dim", None) or h // heads[0]
    want_rows = {"self_attn.q_proj.weight": heads[0] * hd, "self_attn.k_proj.weight": heads[1] * hd,
                 "self_attn.v_proj.weight": heads[1] * hd}

    def rows(name: str, t) -> list[tuple[str, slice | None]]:
        """The module tensors (names after `model.layers.N.`) one GGUF layer tensor holds, with their rows; the
        attention matrices' rows checked against the heads (before any permutation relies on them)."""
        n = int(t.shape[1]) if len(t.shape) > 1 else 0
        if name == QKV:  # query, key and value rows, one after another
            q, k = heads[0] * hd, heads[1] * hd
            if n != q + 2 * k:
                raise InputError(f"--gguf {path}: {t.name} has {n} rows; {heads[0]} query and {heads[1]} key/value "
                                 f"heads of {hd} need {q + 2 * k} (damaged file)")
            return [("self_attn.q_proj.weight", slice(0, q)), ("self_attn.k_proj.weight", slice(q, q + k)),
                    ("self_attn.v_proj.weight", slice(q + k, None))]
        if name not in LAYER_NAMES:
            raise InputError(f"--gguf {path}: tensor {t.name} is not one import-gguf knows for {arch}")
        mod = LAYER_NAMES[name]
        if mod in want_rows and n != want_rows[mod]:
            raise InputError(f"--gguf {path}: {t.name} has {n} rows; the metadata's heads need {want_rows[mod]} "
                             f"(damaged file)")
        return [(mod, None)]

    def unpermute(mod: str, a: np.ndarray, axis: int) -> np.ndarray:
        """llama.cpp's llama architecture stores query and key rows permuted for its rotary layout (per head, the
        two halves interleaved); the model's own order is restored here."""
        if arch != "llama" or not mod.endswith(("q_proj.weight", "k_proj.weight")):
            return a
        n = heads[0] if mod.endswith("q_proj.weight") else heads[1]
        b = np.moveaxis(a, axis, 0)
        b = b.reshape(n, b.shape[0] // n // 2, 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)
        return np.moveaxis(b, 0, axis)

    state: dict[str, torch.Tensor] = {}
    linears: list[str] = []
    for name, t in tensors.items():
        if name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            if rest in EXPERTS:
                continue
            parts = [(f"model.layers.{i}.{mod}", sl) for mod, sl in rows(rest, t)]
        elif name in TOP_NAMES:
            parts = [(TOP_NAMES[name], None)]
        else:
            raise InputError(f"--gguf {path}: tensor {name} is not one import-gguf knows for {arch}")
        if native and kind in PACKED and t.tensor_type.name == kind and rest_is_linear(name) \
                and (kind == "Q8_0" or int(t.shape[0]) % 64 == 0):  # (our int4 packs 64 inputs per chunk)
            # (only where the experts stay in the file's type: --requantize to another format dequantizes them,
            # since a checkpoint's packed linears share its experts' format)
            # a matrix in the experts' packed type (attention, an untied output head): kept packed, as
            # `quantize --linears true` writes it (QuantLinear), without rounding (rows sliced or permuted whole)
            packed = CONVERT[kind](t)
            for mod, sl in parts:
                for part, v in packed.items():
                    v = unpermute(mod, v[0] if sl is None else v[0][sl], 0)
                    state[f"{checkpoint_name(mod, family)}_{part}"] = torch.from_numpy(np.ascontiguousarray(v))
                linears.append(mod.removesuffix(".weight"))
            continue
        a = _array(t)
        for mod, sl in parts:
            v = unpermute(mod, a if sl is None else a[sl], 0)
            state[checkpoint_name(mod, family)] = torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16)
    _check_state(path, cfg, state, linears)
    # the store's fingerprint: the one the model these weights load into will have (its routers, as loaded)
    fingerprint = weights_fingerprint(state[checkpoint_name(f"model.layers.{i}.mlp.gate.weight", family)]
                                      for i in range(n_l))

    def gate_up_down(i: int, read):
        """MoE layer i's gate, up and down experts as `read` gives them."""
        return tuple(read(tensors[f"blk.{i}.{x}"]) for x in EXPERTS)
    expert_bytes, report_kind, rel_err = 0, None, None
    shards: dict[str, str] = {}  # tensor -> shard file (the bf16 checkpoint)
    with atomic_dir(out, command="import-gguf", overwrite=overwrite) as tmp:
        if native and kind in FLOAT:
            # a plain bf16 checkpoint, per-expert tensors, one shard per MoE layer written as it is converted (a
            # 30B model's experts are 57 GiB in bf16: only one layer's are ever in memory) and an index
            (gn, un), (dnn,) = (PARTS[t][family == "mixtral"] for t in ("gate_up_proj", "down_proj"))
            for i in range(n_l):
                g, u, dn = (torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16)
                            for a in gate_up_down(i, _array))
                layer = {}
                for e in range(n_e):  # the family's own per-expert names (Mixtral's w1 / w3 / w2)
                    p = checkpoint_name(f"model.layers.{i}.mlp.experts.{e}.", family)
                    layer[p + f"{gn}.weight"] = g[e].contiguous()
                    layer[p + f"{un}.weight"] = u[e].contiguous()
                    layer[p + f"{dnn}.weight"] = dn[e].contiguous()
                name = f"model-experts-{i + 1:05d}-of-{n_l:05d}.safetensors"
                save_file(layer, str(tmp / name), metadata={"format": "pt"})
                shards.update(dict.fromkeys(layer, name))
                expert_bytes += 2 * (g.numel() + u.numel() + dn.numel())
                del g, u, dn, layer
                if progress:
                    progress()
            report_kind = "bf16"
        else:  # our int8/int4 group-32 store: repacked as stored (Q8_0, Q4_0), or dequantized and quantized again
            bits = PACKED[kind] if native else REQUANTIZE[requantize][0]
            for n in (h, inter):
                quant.check_group(bits, 32, n, "expert input")
            specs, block = layout(quant.quantized_specs([("gate_up_proj", [2 * inter, h], "bfloat16"),
                                                         ("down_proj", [h, inter], "bfloat16")], bits, 32,
                                                        symmetric=native and kind == "Q4_0"))
            err = [[0.0, 0.0] for _ in range(n_l)]

            def layer_parts(i) -> dict:
                """{tensor: {part: [E, ...]}} of MoE layer i in our format (gate rows before up rows)."""
                if native:
                    g, u, d = gate_up_down(i, CONVERT[kind])
                    return {"gate_up_proj": {p: torch.from_numpy(np.concatenate([g[p], u[p]], axis=1)) for p in g},
                            "down_proj": {p: torch.from_numpy(v) for p, v in d.items()}}
                g, u, d = (torch.from_numpy(np.ascontiguousarray(a)) for a in gate_up_down(i, _array))
                out_l = {}
                for name, w in (("gate_up_proj", torch.cat([g, u], 1)), ("down_proj", d)):
                    t = quant.quantize(w, bits, 32)
                    err[i][0] += float((w - quant.dequantize(t, bits, 32)).pow(2).sum())
                    err[i][1] += float(w.pow(2).sum())
                    out_l[name] = t
                return out_l

            cur: dict = {}

            def expert(i, e):
                if cur.get("layer") != i:
                    cur.update(layer=i, parts=layer_parts(i))
                    if progress:
                        progress()
                return {f"{name}.{p}": v[e].contiguous() for name, parts in cur["parts"].items()
                        for p, v in parts.items()}

            meta = _write(tmp / quant.EXPERTS_FILE, StoreMeta(fingerprint, n_l, n_e, specs, block, str(path)), expert)
            expert_bytes = meta.expert_bytes * n_l * n_e
            report_kind = f"int{bits}"
            if not native:
                rel_err = [round((a / b) ** 0.5, 6) if b else 0.0 for a, b in err]
        if shards:  # the other tensors in a shard of their own, and the index of every tensor's shard
            save_file(state, str(tmp / "model-rest.safetensors"), metadata={"format": "pt"})
            shards.update(dict.fromkeys(state, "model-rest.safetensors"))
            total = expert_bytes + sum(v.numel() * v.element_size() for v in state.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": shards}, indent=1))
        else:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        c = cfg.to_dict()
        if report_kind != "bf16":
            scheme = {"Q8_0": "int8 symmetric, fp16 scale per group (GGUF Q8_0, repacked as it is)",
                      "Q4_0": "int4 symmetric, fp16 scale d per group, w = d (q - 8) (GGUF Q4_0, repacked as it "
                              "is)"}
            c["quantization_config"] = {
                "quant_method": quant.QUANT_METHOD, "bits": int(report_kind[3:]), "group_size": 32,
                "experts_file": quant.EXPERTS_FILE, "source_dtype": "bfloat16",
                "symmetric": native or report_kind == "int8",
                "scheme": scheme.get(kind) or f"{report_kind} group 32, quantized again from GGUF {kind} (dequantized)",
                "source": {"gguf": path.name, "type": kind, "requantized": not native}}
            if rel_err is not None:
                c["quantization_config"]["relative_error"] = {"experts_vs_gguf": rel_err}
            if linears:
                c["quantization_config"]["linears"] = {"modules": linears, "source": f"GGUF {kind}, repacked"}
        (tmp / "config.json").write_text(json.dumps(c, indent=2))
        tok, gen = _tokenizer(path)
        tok.save_pretrained(str(tmp))
        gen.save_pretrained(str(tmp))
        if pre == "gpt-2":
            tc = _gpt2_config(path, json.loads((tmp / "tokenizer_config.json").read_text()),
                              json.loads((tmp / "tokenizer.json").read_text()))
            (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
        if checks:  # before it is published: NaN or scaled experts in the file are refused, nothing written
            check_written(tmp, "import-gguf")
    return {"out": str(out), "gguf": str(path), "architecture": arch, "experts_type": kind, "experts": report_kind,
            "requantized": not native, "relative_error_vs_gguf": rel_err,
            "layers": n_l, "experts_per_layer": n_e, "expert_bytes": expert_bytes,
            "non_expert_tensors": len([k for k in state if ".experts." not in k
                                       and not k.endswith(("_q", "_scales", "_mins"))]),
            "packed_linears": len(linears), "packed_linear_modules": linears,
            "tokenizer_pre": pre,
            "file_bytes": file_bytes}


def _check_state(path: Path, cfg, state: dict, linears: list[str]) -> None:
    """Every non-expert tensor the model needs is there, in its shape (a packed linear: its integers' shape), and
    nothing else; one line for the first that is not."""
    from transformers import AutoModelForCausalLM

    from expertcache.runtime.storage.checkpoint import checkpoint_name

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    need = {checkpoint_name(k, cfg.model_type): tuple(v.shape) for k, v in m.state_dict().items()
            if ".mlp.experts." not in k}
    if cfg.tie_word_embeddings:
        need.pop("lm_head.weight", None)
    packed = {checkpoint_name(f"{n}.weight", cfg.model_type) for n in linears}
    for k, shape in need.items():
        if k in packed:
            q = state[f"{k}_q"]
            if (q.shape[0], q.shape[1] * (1 if q.dtype == torch.int8 else 2)) != shape:
                raise InputError(f"--gguf {path}: {k} is {list(q.shape)} packed; the model needs {list(shape)} "
                                 f"(damaged file)")
        elif k not in state:
            raise InputError(f"--gguf {path} has no tensor for {k} (a complete {cfg.model_type} file has one)")
        elif tuple(state[k].shape) != shape:
            raise InputError(f"--gguf {path}: {k} is {list(state[k].shape)}; its metadata says {list(shape)} "
                             f"(damaged file)")
    allowed = set(need) | {f"{k}_{part}" for k in packed for part in ("q", "scales", "mins")}
    extra = sorted(k for k in state if k not in allowed)
    if extra:  # (a llama file with query/key norms, say: llama.cpp's llama graph would not use them either)
        raise InputError(f"--gguf {path}: {len(extra)} tensors a {cfg.model_type} model has no place for (first: "
                         f"{extra[0]})")


def _tokenizer(path: Path):
    """The tokenizer from the file's metadata (transformers' GGUF conversion), and its generation config."""
    from transformers import GenerationConfig

    from expertcache.telemetry.hf import load_gguf_tokenizer

    tok = load_gguf_tokenizer(path)
    return tok, GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)


def _gpt2_config(path: Path, tokenizer_config: dict, tokenizer_json: dict) -> dict:
    """transformers saves a Qwen3-MoE file's tokenizer as `Qwen2Tokenizer`, which splits text with Qwen2's pattern
    whatever the file says; a file whose `tokenizer.ggml.pre` is `gpt-2` (GPT-2's pattern, as llama.cpp applies it)
    is saved as a plain tokenizers backend instead, so the byte-level GPT-2 pre-tokenizer of its tokenizer.json is
    the one used. Returns the tokenizer_config to write."""
    pt = tokenizer_json.get("pre_tokenizer") or {}
    if pt.get("type") != "ByteLevel" or not pt.get("use_regex"):
        raise InputError(f"--gguf {path}: its gpt-2 tokenizer did not convert to a byte-level GPT-2 pre-tokenizer "
                         f"(got {str(pt)[:80]})")
    return {**tokenizer_config, "tokenizer_class": "TokenizersBackend"}
