"""Property-based fuzzing of every parser that reads a file handed to us: any byte string, and mutations of valid
files (truncation, byte flips, spliced bytes), gives either a valid object or an `InputError` (subclasses count),
never another exception. The whole file runs in well under a minute on one core (EXAMPLES below)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from expertcache.telemetry.errors import InputError  # noqa: E402
from helpers import REPO, distinct_ids  # noqa: E402

# examples per property; EXPERTCACHE_FUZZ_SCALE=20 runs twenty times as many (a longer hunt, not for CI), and
# `make test-fast` sets 0.2 (30-40 each: the edit loop's quick look; `make test` and CI run the full count)
_SCALE = float(os.environ.get("EXPERTCACHE_FUZZ_SCALE", "1") or 1)
EXAMPLES = {k: max(10, round(v * _SCALE)) for k, v in {"bytes": 150, "mutate": 150, "yaml": 200}.items()}
FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])


def _mutations(valid: bytes):
    """Valid bytes, then truncated, with bytes flipped, overwritten or spliced in (a few edits at once)."""
    n = len(valid)
    edit = st.one_of(
        st.tuples(st.just("cut"), st.integers(0, n)),
        st.tuples(st.just("flip"), st.integers(0, max(0, n - 1)), st.integers(1, 255)),
        st.tuples(st.just("set"), st.integers(0, max(0, n - 1)), st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("insert"), st.integers(0, n), st.binary(min_size=1, max_size=16)),
        # the first bytes hold the headers/lengths: mutate them more often
        st.tuples(st.just("flip"), st.integers(0, min(n - 1, 64) if n else 0), st.integers(1, 255)),
    )

    def apply(edits):
        b = bytearray(valid)
        for e in edits:
            if e[0] == "cut":
                del b[e[1]:]
            elif e[0] == "flip" and e[1] < len(b):
                b[e[1]] ^= e[2]
            elif e[0] == "set" and e[1] < len(b):
                b[e[1]:e[1] + len(e[2])] = e[2]
            elif e[0] == "insert":
                b[e[1]:e[1]] = e[2]
        return bytes(b)
    return st.lists(edit, min_size=1, max_size=4).map(apply)


def _accepts_or_input_error(fn, *args):
    """`fn(*args)` returns, or raises InputError: anything else fails the property."""
    try:
        return fn(*args)
    except InputError:
        return None


class _Files(dict):
    def __repr__(self):  # hypothesis prints the fixture with each failing example: keep it short
        return "files"


# --- valid files, made once ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import torch
    from safetensors.torch import save_file

    from expertcache.runtime.storage.store import write_random_store
    from expertcache.telemetry.parquet_trace import TraceMeta, TraceWriter

    root = tmp_path_factory.mktemp("fuzz")
    rng = np.random.default_rng(0)
    meta = TraceMeta(model="m", family="qwen3_moe", num_layers=2, moe_layers=[0, 1], num_experts=8, top_k=2)
    with TraceWriter(root / "t.parquet", meta) as w:
        n = 16
        w.write(seq_id=np.zeros(n, np.int32), pos=np.arange(n, dtype=np.int32) // 2,
                layer=np.tile(np.asarray([0, 1], np.int16), n // 2), phase="decode", domain="code",
                token=np.zeros(n, np.int32), ids=distinct_ids(rng, 8, (n, 2)), weights=np.ones((n, 2), np.float16))
    ids = distinct_ids(rng, 8, (2, 6, 2)).astype(np.int32)
    with open(root / "s.bin", "wb") as f:
        for t0 in range(0, 6, 3):
            for layer in range(2):
                f.write(struct.pack("<iii", layer, 3, 2) + ids[layer, t0:t0 + 3].astype("<i4").tobytes())
    np.savez(root / "t.npz", experts=ids, meta=json.dumps({"num_experts": 8, "model": "m"}))
    save_file({"a.weight": torch.randn(4, 3), "b.bias": torch.zeros(5, dtype=torch.bfloat16)}, root / "x.safetensors")
    write_random_store(root / "e.store", 1, 2, [("down_proj", [4, 4], "float32")])
    return _Files({k: (root / name).read_bytes() for k, name in
            (("trace", "t.parquet"), ("stream", "s.bin"), ("npz", "t.npz"), ("safetensors", "x.safetensors"),
             ("store", "e.store"))} | {"root": root})


def _write(files, name: str, data: bytes) -> Path:
    p = files["root"] / "cases" / name
    p.parent.mkdir(exist_ok=True)
    p.write_bytes(data)
    return p


# --- (a) the Parquet trace reader ----------------------------------------------------------------------------

def _read_trace(path):
    from expertcache.telemetry.parquet_trace import info, read_meta, read_trace

    m = _accepts_or_input_error(read_meta, path)
    t = _accepts_or_input_error(read_trace, path)
    if t is not None:
        assert m is not None
        _accepts_or_input_error(info, path)
        if t.num_rows:  # what every consumer does next: the routing matrix
            _accepts_or_input_error(t.routing)


@settings(max_examples=EXAMPLES["bytes"], **FUZZ)
@given(data=st.binary(max_size=2048))
def test_trace_reader_any_bytes(files, data):
    _read_trace(_write(files, "t.parquet", b"PAR1" + data if data[:1] == b"\0" else data))


@settings(max_examples=EXAMPLES["mutate"], **FUZZ)
@given(data=st.data())
def test_trace_reader_mutated_trace(files, data):
    _read_trace(_write(files, "t.parquet", data.draw(_mutations(files["trace"]))))


# --- (b) the llama.cpp importers: the binary stream and its .npz form ----------------------------------------

def _import(files, name, data):
    from expertcache.telemetry.llamacpp import import_trace

    src = _write(files, name, data)
    out = files["root"] / "cases" / "imported.parquet"
    r = _accepts_or_input_error(import_trace, src, out, 8 if name.endswith(".bin") else None)
    if r is not None:
        _read_trace(out)  # what was imported reads back


@settings(max_examples=EXAMPLES["bytes"], **FUZZ)
@given(data=st.binary(max_size=1024))
def test_llamacpp_stream_any_bytes(files, data):
    _import(files, "s.bin", data)


@settings(max_examples=EXAMPLES["mutate"], **FUZZ)
@given(data=st.data())
def test_llamacpp_stream_mutated(files, data):
    _import(files, "s.bin", data.draw(_mutations(files["stream"])))


@settings(max_examples=EXAMPLES["bytes"], **FUZZ)
@given(data=st.binary(max_size=1024))
def test_llamacpp_npz_any_bytes(files, data):
    _import(files, "t.npz", data)


@settings(max_examples=EXAMPLES["mutate"], **FUZZ)
@given(data=st.data())
def test_llamacpp_npz_mutated(files, data):
    _import(files, "t.npz", data.draw(_mutations(files["npz"])))


@settings(max_examples=EXAMPLES["mutate"], **FUZZ)
@given(experts=st.one_of(
    st.builds(lambda s, v: np.full(s, v, np.int64), st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 3)),
              st.integers(-70000, 70000)),
    st.builds(lambda s: np.zeros(s, np.float32), st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 2))),
    st.builds(lambda n: np.zeros((1,) * n, np.int16), st.integers(0, 5))),
    meta=st.one_of(st.none(), st.dictionaries(st.sampled_from(["num_experts", "model", "x"]),
                                              st.one_of(st.integers(-3, 70000), st.text(max_size=4), st.none(),
                                                        st.floats(allow_nan=True)), max_size=3).map(json.dumps),
                   st.text(max_size=8)))
def test_llamacpp_npz_any_arrays(files, experts, meta):
    """Well-formed .npz files holding ill-formed content: shapes, dtypes, ids out of range, odd metadata."""
    import io

    buf = io.BytesIO()
    np.savez(buf, experts=experts, **({} if meta is None else {"meta": meta}))
    _import(files, "t.npz", buf.getvalue())


# --- (c) the safetensors header parser and the store header reader -------------------------------------------

def _read_header(path):
    from expertcache.runtime.storage.checkpoint import Checkpoint, read_header

    h = _accepts_or_input_error(read_header, path)
    if h is not None:
        header, data = h
        assert isinstance(header, dict) and data >= 8
        ck = path.parent / "ckpt"
        ck.mkdir(exist_ok=True)
        (ck / "model.safetensors").write_bytes(path.read_bytes())
        c = _accepts_or_input_error(Checkpoint, ck)
        if c is not None:
            for name in list(c.tensors)[:4]:
                _accepts_or_input_error(c.read, name)


@settings(max_examples=EXAMPLES["bytes"], **FUZZ)
@given(data=st.one_of(st.binary(max_size=512),
                      # a plausible length prefix before arbitrary JSON-ish text: past the first check
                      st.text(max_size=200).map(lambda t: struct.pack("<Q", len(t.encode())) + t.encode())))
def test_safetensors_header_any_bytes(files, data):
    _read_header(_write(files, "x.safetensors", data))


@settings(max_examples=EXAMPLES["mutate"], **FUZZ)
@given(data=st.data())
def test_safetensors_header_mutated(files, data):
    _read_header(_write(files, "x.safetensors", data.draw(_mutations(files["safetensors"]))))


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                     max_leaves=12)


@settings(max_examples=EXAMPLES["mutate"], **FUZZ)
@given(entries=st.dictionaries(st.text(max_size=8), _JSON, max_size=3), pad=st.integers(0, 64))
def test_safetensors_header_any_json(files, entries, pad):
    """A well-framed header whose JSON is anything: every field's type and range is checked."""
    raw = json.dumps(entries).encode()
    _read_header(_write(files, "x.safetensors", struct.pack("<Q", len(raw)) + raw + b"\0" * pad))


def _read_store(path):
    from expertcache.runtime.storage.checkpoint import StoreExperts
    from expertcache.runtime.storage.store import read_store_meta
    from expertcache.runtime.storage.verify import verify

    meta = _accepts_or_input_error(read_store_meta, path)
    if meta is not None:
        StoreExperts(path, meta)
        rep = _accepts_or_input_error(verify, path)
        assert rep is None or isinstance(rep["ok"], bool)


@settings(max_examples=EXAMPLES["bytes"], **FUZZ)
@given(data=st.binary(max_size=512))
def test_store_any_bytes(files, data):
    _read_store(_write(files, "e.store", data))


@settings(max_examples=EXAMPLES["mutate"], **FUZZ)
@given(data=st.data())
def test_store_mutated_header(files, data):
    """Mutations of the 64 KiB header region (the JSON and its padding) and cuts anywhere."""
    valid = files["store"]
    head = valid[:512]
    tail = valid[512:]
    mutated = data.draw(_mutations(head))
    if len(mutated) == len(head) or data.draw(st.booleans()):
        mutated = mutated[:512].ljust(512, b"\0") + tail
    _read_store(_write(files, "e.store", mutated))


@settings(max_examples=EXAMPLES["mutate"], **FUZZ)
@given(fields=st.dictionaries(st.sampled_from(["magic", "version", "fingerprint", "num_layers", "num_experts",
                                               "block_bytes", "source", "tensors", "checksum"]), _JSON, max_size=5))
def test_store_any_header_fields(files, fields):
    """A store header whose fields hold anything (the magic and version right, or not)."""
    head = json.loads(files["store"][:65536].rstrip(b"\0"))
    head.update(fields)
    raw = json.dumps(head).encode()[:65535]
    _read_store(_write(files, "e.store", raw + b"\0" * (65536 - len(raw)) + files["store"][65536:]))


# --- (d) the recipe loader on arbitrary YAML ----------------------------------------------------------------

RECIPES = [REPO / "recipes" / "smoke.yaml", REPO / "recipes" / "base-tiny.yaml",
           *sorted((REPO / "recipes" / "cache-aware").glob("*.yaml"))]


def _recipe_classes():
    from expertcache.trainer.cache_aware import CacheAwareRecipe
    from expertcache.trainer.pretrain import PretrainRecipe

    return [PretrainRecipe, CacheAwareRecipe]


def _load(files, text: str, overrides=()):
    from expertcache.trainer.config import load_recipe

    p = files["root"] / "cases" / "r.yaml"
    p.parent.mkdir(exist_ok=True)
    p.write_bytes(text.encode("utf-8", "surrogatepass"))  # lone surrogates too: invalid UTF-8 on disk
    for cls in _recipe_classes():
        _accepts_or_input_error(load_recipe, cls, p, list(overrides))


@settings(max_examples=EXAMPLES["yaml"], **FUZZ)
@given(text=st.text(max_size=300))
def test_recipe_loader_any_text(files, text):
    _load(files, text)


_KEYS = st.sampled_from(["train", "data", "model", "locality", "routers", "quality", "eval", "sweep", "frontier",
                         "mode", "max_steps", "lr", "seq_len", "batch_size", "kind", "weight", "variants",
                         "reroute", "capacity", "values", "key", "out_dir", "base", "name", "temporal", "spatio"])
_YAMLISH = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8),
                        lambda c: st.lists(c, max_size=3) | st.dictionaries(_KEYS | st.text(max_size=4), c,
                                                                            max_size=4)
                        | st.dictionaries(st.integers(-3, 3), c, max_size=2),
                        max_leaves=16)


@settings(max_examples=EXAMPLES["yaml"], **FUZZ)
@given(doc=st.dictionaries(_KEYS, _YAMLISH, max_size=5))
def test_recipe_loader_structured_yaml(files, doc):
    """Mappings that look like recipes (real section and key names) holding values of any type."""
    _load(files, yaml.safe_dump(doc))


@settings(max_examples=EXAMPLES["yaml"], **FUZZ)
@given(which=st.sampled_from(RECIPES), data=st.data())
def test_recipe_loader_mutated_recipes(files, which, data):
    text = which.read_text()
    lines = text.splitlines()
    i = data.draw(st.integers(0, max(0, len(lines) - 1)))
    repl = data.draw(st.one_of(st.text(max_size=30),
                               _YAMLISH.map(lambda v: lines[i].split(":")[0] + ": " + json.dumps(v)
                                            if lines else "")))
    lines[i:i + 1] = [repl]
    overrides = data.draw(st.lists(st.builds(lambda k, v: f"{k}={v}", st.from_regex(r"[a-z_.]{0,20}", fullmatch=True),
                                             st.text(max_size=10)), max_size=2))
    _load(files, "\n".join(lines), overrides)
