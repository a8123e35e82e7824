"""A checkpoint's safetensors files, read by byte range: where every tensor lies, and where each routed expert's
bytes come from.

The safetensors header (8-byte length, then JSON) gives every tensor's dtype, shape and byte range, so one expert
can be read without touching the rest of the file, and nothing here ever unpickles anything: a `.bin` checkpoint
is refused. Two expert layouts are found in the wild, and both are read in place (no second copy of the model):

- one tensor per expert and projection, as published Qwen3-MoE, Mixtral, OLMoE and DeepSeek checkpoints are laid
  out (`...mlp.experts.{e}.gate_proj.weight`, Mixtral's `...block_sparse_moe.experts.{e}.w1.weight`), and as
  transformers 5 still saves them;
- transformers 5's fused tensors `...mlp.experts.gate_up_proj [E, ...]`, `down_proj [E, ...]` (GPT-OSS).

Either way an expert becomes a list of `Span`s: contiguous byte ranges of one file and where each lands inside the
expert's block in a cache slot (`store.StoreMeta` gives the block layout: the experts module's fused tensors, one
expert each, at aligned offsets).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from expertcache.telemetry.errors import InputError

from .store import StoreMeta, layout

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# checkpoint name -> module name, per family (transformers' own conversion mapping renames these)
RENAMES = {"mixtral": [(".block_sparse_moe.", ".mlp.")]}
# one fused module tensor <- the per-expert checkpoint tensors concatenated along dim 0, by family naming
PARTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


@dataclass(frozen=True)
class TensorInfo:
    file: int  # index into Checkpoint.files
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Span:
    """`nbytes` bytes at `offset` of file `file` land at byte `dst` of the expert's block, as `dtype` (converted to
    the block tensor's dtype when they differ)."""

    file: int
    offset: int
    nbytes: int
    dst: int
    src_dtype: torch.dtype
    dst_dtype: torch.dtype


def read_header(path: Path) -> tuple[dict, int]:
    """`(header, data_start)` of one safetensors file, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise InputError(f"{path} is not a safetensors file ({size} bytes)")
        n = struct.unpack("<Q", raw)[0]
        if n > min(size - 8, 100 << 20):
            raise InputError(f"{path} is not a safetensors file (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: unreadable safetensors header")
    header.pop("__metadata__", None)
    data = 8 + n
    need = data + max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if size < need:
        raise InputError(f"{path} is truncated: {size} bytes, its header needs {need} (re-download or re-save it)")
    return header, data


class Checkpoint:
    """Every tensor of a safetensors checkpoint directory (one file or an index of shards), by name."""

    def __init__(self, folder: str | Path):
        self.dir = Path(folder)
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise InputError(f"{index}: not a safetensors index ({e})") from None
            names = sorted(set(weight_map.values()))
            for n in names:
                if not (self.dir / n).is_file():
                    raise InputError(f"shard {n} named in {index} is missing")
        elif (self.dir / SINGLE).is_file():
            names = [SINGLE]
        else:
            pickles = sorted(p.name for p in self.dir.glob("*.bin")) + sorted(p.name for p in self.dir.glob("*.pt"))
            if pickles:
                raise InputError(f"{self.dir} holds only pickle weights ({pickles[0]}); loading them could execute "
                                 f"code, so only safetensors is read (convert with save_pretrained(..., "
                                 f"safe_serialization=True) in a trusted environment)")
            raise InputError(f"no safetensors weights ({SINGLE} or {INDEX}) in {self.dir}")
        self.files = [self.dir / n for n in names]
        self.tensors: dict[str, TensorInfo] = {}
        for i, p in enumerate(self.files):
            header, data = read_header(p)
            for name, v in header.items():
                if v.get("dtype") not in DTYPES:
                    raise InputError(f"{p}: tensor {name} has dtype {v.get('dtype')}, which this loader does not "
                                     f"read ({', '.join(DTYPES)})")
                b, e = (int(x) for x in v["data_offsets"])
                self.tensors[name] = TensorInfo(i, DTYPES[v["dtype"]], tuple(v["shape"]), data + b, data + e)

    def read(self, name: str) -> torch.Tensor:
        """One whole tensor, read into fresh memory (for the non-expert weights; experts go through `spans`)."""
        t = self.tensors[name]
        buf = bytearray(t.nbytes)
        with open(self.files[t.file], "rb") as f:
            f.seek(t.start)
            if f.readinto(buf) != t.nbytes:
                raise InputError(f"{self.files[t.file]}: short read of {name}")
        if not buf:
            return torch.empty(t.shape, dtype=t.dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).reshape(t.shape)

    def bytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def checkpoint_name(module_name: str, family: str) -> str:
    """The name a module tensor has in the checkpoint (transformers' renames undone)."""
    for ckpt, mod in RENAMES.get(family, []):
        module_name = module_name.replace(mod, ckpt)
    return module_name


class CheckpointExperts:
    """Where each routed expert of each MoE layer lies in the checkpoint's files, as the engine's block layout.

    `prefixes[i]` is MoE layer i's experts module path in the model (e.g. `model.layers.3.mlp.experts`);
    `params` the module's fused parameters `{name: (one expert's shape, dtype)}`; `dtype` the dtype the cache
    holds (default: the checkpoint's own)."""

    def __init__(self, ckpt: Checkpoint, family: str, prefixes: list[str], num_experts: int,
                 params: dict[str, tuple[list[int], torch.dtype]], fingerprint: str, dtype: torch.dtype | None = None):
        self.ckpt, self.family, self.num_experts = ckpt, family, num_experts
        self._spans: list[list[list[Span]]] = []
        src_dtype = None
        found: list[list[tuple[str, list[tuple[TensorInfo, int]]]]] = []  # per layer: (param, [(tensor, expert)])
        self.names: set[str] = set()  # checkpoint names of every tensor holding routed experts
        for prefix in prefixes:
            per_param = []
            for pname, (shape, _) in params.items():
                per_param.append((pname, self._locate(prefix, pname, list(shape))))
            found.append(per_param)
            src_dtype = src_dtype or per_param[0][1][0][0].dtype
        self.dtype = dtype or src_dtype
        specs, block = layout([(n, list(s), str(self.dtype).removeprefix("torch.")) for n, (s, _) in params.items()])
        self.meta = StoreMeta(fingerprint, len(prefixes), num_experts, specs, block, str(ckpt.dir))
        off = {t.name: t.offset for t in specs}
        es_dst = torch.empty((), dtype=self.dtype).element_size()
        for per_param in found:
            layer = [[] for _ in range(num_experts)]
            for pname, pieces in per_param:
                dst = [off[pname]] * num_experts  # where each expert's next piece of this tensor lands
                for info, kind in pieces:  # fused: one [E, ...] tensor sliced per expert; else each part in order
                    n_per = info.nbytes // info.shape[0] if kind == -1 else info.nbytes
                    for e in (range(num_experts) if kind == -1 else (kind,)):
                        start = info.start + (e * n_per if kind == -1 else 0)
                        layer[e].append(Span(info.file, start, n_per, dst[e], info.dtype, self.dtype))
                        dst[e] += n_per // info.dtype.itemsize * es_dst
            self._spans.append(layer)

    def _locate(self, prefix: str, pname: str, shape: list[int]) -> list[tuple[TensorInfo, int]]:
        """The checkpoint tensors holding `prefix.pname` for every expert: `[(info, -1)]` for a fused tensor,
        else `[(info, e), ...]` for each expert's parts in order."""
        t = self.ckpt.tensors
        ck = checkpoint_name(prefix, self.family)
        fused = t.get(f"{ck}.{pname}")
        if fused is not None:
            if list(fused.shape) != [self.num_experts, *shape]:
                raise InputError(f"checkpoint tensor {ck}.{pname} has shape {list(fused.shape)}; the model expects "
                                 f"{[self.num_experts, *shape]}")
            self.names.add(f"{ck}.{pname}")
            return [(fused, -1)]
        for names in PARTS.get(pname, ()):
            if f"{ck}.0.{names[0]}.weight" not in t:
                continue
            out = []
            for e in range(self.num_experts):
                rows = 0
                for n in names:
                    key = f"{ck}.{e}.{n}.weight"
                    info = t.get(key)
                    if info is None:
                        raise InputError(f"checkpoint has no tensor {key} (expert {e} of {ck})")
                    rows += info.shape[0]
                    out.append((info, e))
                    self.names.add(key)
                if [rows, *info.shape[1:]] != shape:
                    raise InputError(f"checkpoint experts {ck}.{e}.{'+'.join(names)} make shape "
                                     f"{[rows, *info.shape[1:]]}; the model expects {shape}")
            return out
        raise InputError(f"checkpoint has neither {ck}.{pname} nor per-expert tensors for it "
                         f"({', '.join(f'{ck}.0.{n[0]}.weight' for n in PARTS.get(pname, ()))})")

    def spans(self, layer: int, expert: int) -> list[Span]:
        return self._spans[layer][expert]

    @property
    def files(self) -> list[Path]:
        return self.ckpt.files


class StoreExperts:
    """The repacked store file (`store.write_store`): one aligned block per expert, one read each."""

    def __init__(self, path: str | Path, meta: StoreMeta):
        self.meta, self.files = meta, [Path(path)]

    def spans(self, layer: int, expert: int) -> list[Span]:
        dt = self.meta.tensors[0].torch_dtype
        return [Span(0, self.meta.offset(layer, expert), self.meta.block_bytes, 0, dt, dt)]


def free_disk(path: str | Path) -> int:
    st = os.statvfs(str(path))
    return st.f_bavail * st.f_frsize
