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

Integrity: an expert's checksum is the xxh3_64 digest of its spans' bytes as they lie in the files, in (file,
offset) order (`expert_order`). A repacked store carries one per block; a safetensors checkpoint gets them from
`expertcache verify`, which writes `<checkpoint>/.expertcache-checksums.json` (or, when the checkpoint's folder is
not writable, the same file under the user cache folder: `index_locations`). The index stays the reference when
a file changes: a changed file (size or mtime) is checked against it like any other, so damage written in place
is reported as damage, never silently re-hashed; only `expertcache verify --rebless true` records new bytes as
the reference. When a source has checksums, the disk tier checks every expert it reads against them
(`tiers.DiskTier.read`) and refuses a mismatch naming the layer, expert and file; without any, the engine says
the model is unverified (`integrity`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from expertcache.telemetry.errors import InputError

from expertcache.runtime.storage.store import CHECKSUM, StoreMeta, layout

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# checkpoint name -> module name, per family (transformers' own conversion mapping renames these)
RENAMES = {"mixtral": [(".block_sparse_moe.", ".mlp.")]}
# one fused module tensor <- the per-expert checkpoint tensors concatenated along dim 0, by family naming
PARTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}
CHECKSUM_INDEX = ".expertcache-checksums.json"  # beside the safetensors files; written by `verify.verify`
INDEX_FORMAT, INDEX_VERSION = "expertcache-checksums", 1
# Check every expert read against its checksum when the source has them (a store's table, a checkpoint's index).
# `expertcache bench checksum` (results/bench_checksum.json): 250 MB bf16 checkpoint, 3 MiB experts, disk tier, 1/8
# of E, no predictor, ~9.7 experts read per token: xxh3_64 adds 2.0% of TPOT (hash time x reads), A/B 2.4% and
# -0.0% in two runs of 12 alternated rounds: under the 5% bar, so on by default (`load(verify=False)` opts out).
VERIFY_DEFAULT = True


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
    need = data
    for name, v in header.items():
        need = max(need, data + _check_entry(path, name, v))
    if size < need:
        raise InputError(f"{path} is truncated: {size} bytes, its header needs {need} (re-download or re-save it)")
    return header, data


def _check_entry(path: Path, name: str, v) -> int:
    """One header entry is a tensor: a dtype name, a shape of non-negative integers, `data_offsets` [begin, end]
    whose length is the shape's bytes (for the dtypes read here). Returns its end offset."""
    def bad(why):
        raise InputError(f"{path}: safetensors header entry {str(name)[:60]!r} {why} (damaged header)")

    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)
    if not isinstance(v, dict):
        bad("is not an object")
    if not isinstance(v.get("dtype"), str):
        bad("has no dtype")
    shape, offs = v.get("shape"), v.get("data_offsets")
    if not isinstance(shape, list) or not all(is_int(x) and 0 <= x < 1 << 48 for x in shape):
        bad(f"has shape {str(shape)[:40]}, expected a list of non-negative integers")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(is_int(x) for x in offs)
            or not 0 <= offs[0] <= offs[1] < 1 << 62):
        bad(f"has data_offsets {str(offs)[:40]}, expected [begin, end] with 0 <= begin <= end")
    if v["dtype"] in DTYPES:
        numel = 1
        for x in shape:
            numel *= x
        if numel * DTYPES[v["dtype"]].itemsize != offs[1] - offs[0]:
            bad(f"holds {offs[1] - offs[0]} bytes, its shape {shape} of {v['dtype']} needs "
                f"{numel * DTYPES[v['dtype']].itemsize}")
    return offs[1]


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
        if not t.nbytes:
            return torch.empty(t.shape, dtype=t.dtype)
        # torch's allocation (64-byte aligned), not a bytearray's (16 bytes past a page: every 64-byte load of the
        # kernels then straddled two cache lines)
        buf = torch.empty(t.nbytes, dtype=torch.uint8)
        with open(self.files[t.file], "rb") as f:
            f.seek(t.start)
            if f.readinto(memoryview(buf.numpy())) != t.nbytes:
                raise InputError(f"{self.files[t.file]}: short read of {name}")
        return buf.view(t.dtype).reshape(t.shape)

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
        self.prefixes = list(prefixes)
        self.expected: list[list[int | None]] | None = None  # checksums the disk tier checks (`use_index`)
        self.index_state = "not loaded"
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

    # --- checksums -------------------------------------------------------------------------------------------
    @property
    def index_path(self) -> Path:
        """The index that is read: beside the checkpoint, else the user cache's copy, else where one is written."""
        beside, cached = index_locations(self.ckpt.dir)
        if beside.is_file() or not cached.is_file():
            return beside if beside.is_file() or _writable(self.ckpt.dir) else cached
        return cached

    def index_write_path(self) -> Path:
        """Where `verify` writes the index: beside the checkpoint when its folder is writable, else the user cache."""
        beside, cached = index_locations(self.ckpt.dir)
        return beside if _writable(self.ckpt.dir) else cached

    def layout_sha256(self) -> str:
        """sha256 of where every expert's bytes lie (file names, offsets, lengths in checksum order): an index
        made for another reading of the checkpoint (another layout or model class) does not apply."""
        h = hashlib.sha256(json.dumps([p.name for p in self.files]).encode())
        for layer in self._spans:
            for spans in layer:
                h.update(json.dumps([(s.file, s.offset, s.nbytes) for s in expert_order(spans)]).encode())
        return h.hexdigest()

    def file_stamps(self) -> dict[str, dict]:
        """{file name: {size, mtime_ns}}: what an index entry is valid for."""
        out = {}
        for p in self.files:
            st = p.stat()
            out[p.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        return out

    def read_index(self) -> dict | None:
        """The checksum index beside the checkpoint, checked for shape (None when there is none)."""
        p = self.index_path
        if not p.is_file():
            return None
        try:
            d = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise InputError(f"{p}: unreadable checksum index ({str(e).splitlines()[0][:100]}); the reference is "
                             f"lost: `expertcache verify --model {self.ckpt.dir} --rebless true` records the "
                             f"current bytes as the new one") from None
        ok = (isinstance(d, dict) and d.get("format") == INDEX_FORMAT and isinstance(d.get("files"), dict)
              and isinstance(d.get("experts"), list) and all(isinstance(x, list) for x in d["experts"]))
        if not ok:
            raise InputError(f"{p} is not an expertcache checksum index; `expertcache verify --model {self.ckpt.dir} "
                             f"--rebless true` records the current bytes as the reference")
        if d.get("version") != INDEX_VERSION or d.get("algorithm") != CHECKSUM:
            raise InputError(f"{p}: checksum index version {d.get('version')!r} / {d.get('algorithm')!r}, this build "
                             f"reads {INDEX_VERSION} / {CHECKSUM}; re-run `expertcache verify --model {self.ckpt.dir}`")
        return d

    def indexed_checksums(self, index: dict) -> tuple[list[list[int | None]] | None, list[str]]:
        """`(expected, changed)`: each expert's indexed checksum, the reference for every expert even where its file
        changed since the index was made (`changed` names those files: size or mtime differ; a changed file is
        checked, not trusted); `expected` is None when the index is for another layout."""
        if index.get("layout_sha256") != self.layout_sha256():
            return None, [p.name for p in self.files]
        now = self.file_stamps()
        stale = {i for i, p in enumerate(self.files) if index["files"].get(p.name) != now[p.name]}
        rows = index["experts"]
        if len(rows) != len(self._spans) or any(len(r) != self.num_experts for r in rows):
            raise InputError(f"{self.index_path}: checksum index holds {len(rows)} layers, the checkpoint "
                             f"{len(self._spans)} of {self.num_experts} experts; re-run `expertcache verify`")
        out = []
        for i, row in enumerate(rows):
            r = []
            for e, hx in enumerate(row):
                try:
                    r.append(int(hx, 16))
                except (TypeError, ValueError):
                    raise InputError(f"{self.index_path}: checksum of layer {i} expert {e} is {hx!r}, not hex; "
                                     f"re-run `expertcache verify`") from None
            out.append(r)
        return out, sorted(self.files[i].name for i in stale)

    def use_index(self, verify: bool | None = None) -> str:
        """Check every expert read against the checksum index from now on, when there is one (`verify`: None =
        `VERIFY_DEFAULT`, False = never, True = always, with a warning when there is nothing to check against).
        Returns and records the state: off, none, changed (files changed since the index: still checked against
        it, a mismatch refused), other layout, on. `integrity` says it in words."""
        self.expected = None
        if verify is False or (verify is None and not VERIFY_DEFAULT):
            self.index_state = "off"
            return self.index_state
        index = self.read_index()
        if index is None:
            self.index_state = "none"
            if verify:
                warnings.warn(f"no checksum index in {self.ckpt.dir}: experts are read unchecked; build one with "
                              f"`expertcache verify --model {self.ckpt.dir}`", stacklevel=2)
            return self.index_state
        expected, stale = self.indexed_checksums(index)
        if expected is None:
            self.index_state = "other layout"
            warnings.warn(f"{self.index_path} was made for another layout of this checkpoint: experts are read "
                          f"unchecked (unverified); `expertcache verify --model {self.ckpt.dir}` says why",
                          stacklevel=2)
            return self.index_state
        if stale:
            warnings.warn(f"{', '.join(stale)} changed since {self.index_path} was made (size or mtime): its experts "
                          f"are still checked against the index (a mismatch is refused); `expertcache verify --model "
                          f"{self.ckpt.dir}` says whether the bytes changed", stacklevel=2)
        self.expected = expected
        self.index_state = "changed" if stale else "on"
        return self.index_state

    def integrity(self) -> str:
        """The engine's word on this checkpoint's bytes: verified, or unverified and why."""
        return {"on": "verified (every expert read is checked against the checksum index)",
                "changed": "verified (files changed since the checksum index; every expert read is checked "
                           "against it)",
                "none": f"unverified (no checksum index: `expertcache verify --model {self.ckpt.dir}` records one)",
                "other layout": f"unverified (the checksum index is for another layout; see `expertcache "
                                f"verify --model {self.ckpt.dir}`)",
                "off": "unverified (checksum checks turned off)"}.get(self.index_state, "unverified")

    def expected_checksum(self, layer: int, expert: int) -> int | None:
        return None if self.expected is None else self.expected[layer][expert]

    def where(self, layer: int, expert: int) -> str:
        files = sorted({self.files[s.file].name for s in self._spans[layer][expert]})
        return (f"MoE layer {layer} ({self.prefixes[layer]}) expert {expert} in {', '.join(files)} of "
                f"{self.ckpt.dir}")

    remedy = "the checkpoint file is corrupted: re-download or re-save it, then re-run `expertcache verify`"


class StoreExperts:
    """The repacked store file (`store.write_store`): one aligned block per expert, one read each; a version 2
    store carries each block's checksum, checked on every read unless `verify` is False."""

    remedy = "the store file is corrupted: rewrite it"

    def __init__(self, path: str | Path, meta: StoreMeta, verify: bool | None = None):
        self.meta, self.files = meta, [Path(path)]
        on = verify is True or (verify is None and VERIFY_DEFAULT)
        self.expected = meta.checksums if on else None
        if verify and meta.checksums is None:
            warnings.warn(f"{path} is a version {meta.version} store without checksums: experts are read unchecked; "
                          f"rewrite it", stacklevel=2)

    def spans(self, layer: int, expert: int) -> list[Span]:
        dt = self.meta.tensors[0].torch_dtype
        return [Span(0, self.meta.offset(layer, expert), self.meta.block_bytes, 0, dt, dt)]

    def expected_checksum(self, layer: int, expert: int) -> int | None:
        return None if self.expected is None else int(self.expected[layer, expert])

    def integrity(self) -> str:
        if self.expected is not None:
            return "verified (every expert read is checked against the store's checksum table)"
        return "unverified (" + ("a store without checksums: rewrite it" if self.meta.checksums is None else
                                 "checksum checks turned off") + ")"

    def where(self, layer: int, expert: int) -> str:
        return f"MoE layer {layer} expert {expert} in {self.files[0]}"


def user_cache_dir() -> Path:
    """expertcache's folder in the user cache: $EXPERTCACHE_CACHE, else $XDG_CACHE_HOME/expertcache, else
    ~/.cache/expertcache."""
    if os.environ.get("EXPERTCACHE_CACHE"):
        return Path(os.environ["EXPERTCACHE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "expertcache"


def index_locations(folder: str | Path) -> tuple[Path, Path]:
    """(beside the checkpoint, in the user cache) for a checkpoint folder's checksum index. The cached one is
    keyed by the folder's absolute path and its inode, so a folder saved anew in the same place (a new inode) never
    meets the old reference."""
    folder = Path(folder).absolute()
    try:
        st = folder.stat()
        ident = f"{folder}|{st.st_dev}|{st.st_ino}"
    except OSError:
        ident = str(folder)
    key = hashlib.sha256(ident.encode()).hexdigest()[:24]
    return folder / CHECKSUM_INDEX, user_cache_dir() / "checksums" / f"{folder.name[:40]}-{key}.json"


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def expert_order(spans: list[Span]) -> list[Span]:
    """The order an expert's spans are checksummed in (and read in): by file, then offset."""
    return sorted(spans, key=lambda s: (s.file, s.offset))


def free_disk(path: str | Path) -> int:
    st = os.statvfs(str(path))
    return st.f_bavail * st.f_frsize
