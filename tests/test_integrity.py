"""Expert checksums: a store's table, a checkpoint's index (`expertcache verify`), checked on every disk read; flipped
bytes inside an expert (header intact) are found by verify and refused by load / read, naming layer, expert, file."""

import json
import os
import warnings

import pytest
import torch

from expertcache.runtime import EngineConfig, load
from expertcache.runtime.storage.checkpoint import CHECKSUM_INDEX, StoreExperts, expert_order
from expertcache.runtime.storage.loader import expert_source
from expertcache.runtime.storage.store import read_store_meta, write_store
from expertcache.runtime.storage.tiers import DiskTier, SlotPool
from expertcache.runtime.storage.verify import verify
from expertcache.telemetry.errors import InputError
from tiny_models import FAMILIES, build_model, tiny_config


def _flip(path, offset, keep_mtime=True):
    """Flip one byte at `offset` in place; the mtime kept (bit rot, a bad sector: nothing touches the stamp)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _write_at(path, offset, data, keep_mtime=True):
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def ckpt(tmp_path_factory, request):
    fam = getattr(request, "param", "qwen3_moe")
    d = tmp_path_factory.mktemp(f"ckpt-{fam}")
    build_model(tiny_config(fam), seed=2, dtype=torch.bfloat16).save_pretrained(d)
    return d


def test_store_records_a_checksum_per_block_and_a_flipped_byte_is_refused_on_read(tmp_path):
    model = build_model(tiny_config("qwen3_moe"), seed=1).eval()
    path = tmp_path / "e.store"
    write_store(model, path)
    meta = read_store_meta(path)
    assert meta.version == 2 and meta.checksums.shape == (meta.num_layers, meta.num_experts)
    assert meta.file_bytes() == path.stat().st_size
    assert verify(path)["ok"]
    _flip(path, meta.offset(1, 5) + meta.tensors[-1].offset + 7)
    rep = verify(path)
    assert not rep["ok"] and rep["mismatches"] == 1
    assert (rep["mismatch_list"][0]["layer"], rep["mismatch_list"][0]["expert"]) == (1, 5)
    meta = read_store_meta(path)  # the header is intact: the store still opens
    pool = SlotPool(meta, 2)
    tier = DiskTier(StoreExperts(path, meta))
    try:
        tier.read(1, 4, pool, 0)  # its neighbours read fine
        with pytest.raises(InputError, match=r"checksum mismatch: MoE layer 1 expert 5 in .*e\.store"):
            tier.read(1, 5, pool, 1)
    finally:
        tier.close()
    unchecked = DiskTier(StoreExperts(path, meta, verify=False))
    try:
        unchecked.read(1, 5, pool, 1)  # opted out: read as is
    finally:
        unchecked.close()


def test_a_truncated_or_damaged_store_header_is_one_line(tmp_path):
    model = build_model(tiny_config("qwen3_moe"), seed=1).eval()
    path = tmp_path / "e.store"
    write_store(model, path)
    raw = path.read_bytes()
    (tmp_path / "t.store").write_bytes(raw[:-4096])  # the checksum table cut off
    with pytest.raises(InputError, match="truncated or damaged"):
        read_store_meta(tmp_path / "t.store")
    head = json.loads(raw[:65536].rstrip(b"\0"))
    head["checksum"]["offset"] += 8
    bad = json.dumps(head).encode()
    (tmp_path / "h.store").write_bytes(bad + b"\0" * (65536 - len(bad)) + raw[65536:])
    with pytest.raises(InputError, match="checksum entry"):
        read_store_meta(tmp_path / "h.store")


@pytest.mark.parametrize("ckpt", FAMILIES, indirect=True)
def test_verify_indexes_a_checkpoint_then_finds_a_flipped_byte_and_load_refuses_it(ckpt):
    rep = verify(ckpt)
    assert rep["ok"] and rep["index"]["before"] == "none" and rep["index"]["after"] == "written"
    assert (ckpt / CHECKSUM_INDEX).is_file() and rep["experts"] == 2 * 8 and rep["non_expert_tensors"] > 0
    again = verify(ckpt)
    assert again["ok"] and again["index"]["before"] == "valid" and again["checked_against_index"] == 16
    src = expert_source(ckpt)
    s = expert_order(src.spans(1, 3))[-1]
    _flip(src.files[s.file], s.offset + s.nbytes // 2)
    rep = verify(ckpt)
    assert not rep["ok"] and rep["mismatches"] == 1 and rep["index"]["after"].startswith("unchanged")
    assert rep["verdict"] == "damaged"
    m = rep["mismatch_list"][0]
    assert (m["layer"], m["expert"]) == (1, 3) and src.files[s.file].name in m["where"]
    # load reads every expert into host memory: the damaged one is refused, named
    with pytest.raises(InputError, match=rf"checksum mismatch: MoE layer 1 \(.*\) expert 3 in "
                                         rf"{src.files[s.file].name}"):
        load(ckpt, capacity=8, tier="host")
    # the disk tier refuses it when it is read, and reads the others (the weight checks off: their sample at start
    # would read it first)
    m = load(ckpt, engine=EngineConfig(capacity=2, tier="disk", integrity="off"))
    eng = m.expertcache
    pool = SlotPool(eng.meta, 1)
    try:
        eng.tier.read(1, 2, pool, 0)
        with pytest.raises(InputError, match="MoE layer 1 .* expert 3 in"):
            eng.tier.read(1, 3, pool, 0)
    finally:
        eng.close()
    # opted out of both checks: loads as is
    load(ckpt, verify=False, engine=EngineConfig(capacity=8, tier="host", integrity="off")).expertcache.close()


def test_an_in_place_edit_after_verify_is_damage_not_a_new_reference(ckpt, capsys):
    """#24 finding 1: the mtime moves with an in-place write; verify used to re-hash the file, write that as the
    reference and say ok. Now the index stays the reference: verify reports the damage (exit 1, the verdict on
    stderr), the engine refuses the expert, and only --rebless records the new bytes."""
    from expertcache.recipes.cli import main

    verify(ckpt)
    index_before = (ckpt / CHECKSUM_INDEX).read_bytes()
    src = expert_source(ckpt)
    s = src.spans(0, 0)[0]
    _flip(src.files[s.file], s.offset + 2, keep_mtime=False)  # a deliberate edit: the mtime moves
    rep = verify(ckpt)
    assert not rep["ok"] and rep["verdict"] == "damaged" and rep["index"]["before"] == "changed"
    assert rep["mismatches"] == 1 and (rep["mismatch_list"][0]["layer"], rep["mismatch_list"][0]["expert"]) == (0, 0)
    assert (ckpt / CHECKSUM_INDEX).read_bytes() == index_before  # never silently re-hashed
    assert not verify(ckpt)["ok"]  # and so not on the second run either
    capsys.readouterr()
    assert main(["verify", "--model", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "verify: DAMAGED: 1 expert(s) differ from the checksum reference" in err and "expert 0" in err
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(InputError, match=r"checksum mismatch: MoE layer 0 \(.*\) expert 0"):
            load(ckpt, capacity=8, tier="host")  # refused, not served
    assert any("changed since" in str(x.message) for x in w)
    rep = verify(ckpt, rebless=True)  # the change is ours: recorded as the reference on request
    assert rep["ok"] and rep["index"]["after"].startswith("re-blessed")
    again = verify(ckpt)
    assert again["ok"] and again["verdict"] == "ok" and again["index"]["before"] == "valid"
    m = load(ckpt, capacity=8, tier="host")
    assert m.expertcache.source.index_state == "on" and m.expertcache.integrity().startswith("verified")
    m.expertcache.close()


def test_a_copy_with_new_mtimes_matches_its_reference_and_only_refreshes_stamps(ckpt):
    verify(ckpt)
    src = expert_source(ckpt)
    for f in src.files:
        os.utime(f, ns=(1, 10**18))  # touched (or copied without -p): same bytes
    rep = verify(ckpt)
    assert rep["ok"] and rep["verdict"] == "ok" and rep["index"]["before"] == "changed"
    assert rep["index"]["after"].startswith("stamps refreshed")
    assert verify(ckpt)["index"]["before"] == "valid"


def test_verify_finds_non_finite_weights_and_does_not_index_them(ckpt):
    src = expert_source(ckpt)
    nan_bf16 = b"\xc0\x7f"
    s = src.spans(0, 6)[0]
    _write_at(src.files[s.file], s.offset + 64, nan_bf16)
    norm = src.ckpt.tensors["model.norm.weight"]
    _write_at(src.files[norm.file], norm.start, nan_bf16 * 2)
    rep = verify(ckpt)
    assert not rep["ok"] and rep["non_finite"] == 2
    where = {(x.get("layer"), x.get("expert"), x.get("tensor")) for x in rep["non_finite_list"]}
    assert where == {(0, 6, None), (None, None, "model.norm.weight")}
    assert rep["index"]["after"].startswith("not written") and not (ckpt / CHECKSUM_INDEX).exists()


def test_a_damaged_index_is_one_line_and_only_rebless_rebuilds_it(ckpt):
    verify(ckpt)
    (ckpt / CHECKSUM_INDEX).write_text("{oops")
    with pytest.raises(InputError, match="unreadable checksum index.*--rebless true"):
        load(ckpt, capacity=2)
    rep = verify(ckpt)  # the reference is lost: the current bytes are not blessed without being asked
    assert not rep["ok"] and rep["verdict"] == "unverified" and rep["index"]["before"] == "unreadable"
    assert rep["index"]["after"].startswith("not written") and "--rebless true" in rep["index"]["blocked"]
    rep = verify(ckpt, rebless=True)
    assert rep["ok"] and rep["index"]["after"].startswith("re-blessed")
    load(ckpt, capacity=2).expertcache.close()


def test_verify_refuses_what_is_not_a_model(tmp_path):
    with pytest.raises(InputError, match="no such checkpoint"):
        verify(tmp_path / "nope")
    (tmp_path / "x.store").write_bytes(b"\0" * 100)
    with pytest.raises(InputError, match="not an expertcache expert store"):
        verify(tmp_path / "x.store")


def _scale_layer_experts(ckpt, layer: int, factor: float):
    """Every expert of MoE `layer` multiplied by `factor` in place (bf16): what an exponent flip does to them."""
    src = expert_source(ckpt)
    for e in range(src.num_experts):
        for s in src.spans(layer, e):
            with open(src.files[s.file], "rb") as f:
                f.seek(s.offset)
                raw = bytearray(f.read(s.nbytes))
            t = torch.frombuffer(raw, dtype=torch.uint8).view(s.src_dtype) * factor
            _write_at(src.files[s.file], s.offset, t.contiguous().view(torch.uint8).numpy().tobytes())


def test_an_exponent_flip_in_an_unverified_checkpoint_is_flagged_and_served_as_unverified(ckpt, capsys):
    """#24 finding 2: a fresh checkpoint has no reference; layer 0's experts 2^14 times larger (still finite)
    used to pass the first verify, which then wrote its index from the damaged bytes."""
    from expertcache.recipes.cli import main
    from expertcache.runtime.serve.generate import summary_line

    m = load(ckpt, capacity=2, tier="disk")  # served without a reference: it says so
    try:
        assert m.expertcache.integrity().startswith("unverified (no checksum index")
        assert m.expertcache.describe()["integrity"].startswith("unverified")
        line = summary_line({"completion_tokens": 1, "hit_rate": 0.5, "adjusted_hit_rate": 0.5}, m.expertcache)
        assert "unverified (no checksum index" in line
    finally:
        m.expertcache.close()
    _scale_layer_experts(ckpt, 0, 2.0 ** 14)
    rep = verify(ckpt)
    assert not rep["ok"] and rep["verdict"] == "damaged" and rep["non_finite"] == 0 and rep["mismatches"] == 0
    flagged = {(o["layer"], o["expert"]) for o in rep["outlier_list"]}
    assert flagged == {(0, e) for e in range(8)} and all(o["ratio"] > 1000 for o in rep["outlier_list"])
    assert rep["index"]["after"].startswith("not written") and not (ckpt / CHECKSUM_INDEX).exists()
    capsys.readouterr()
    assert main(["verify", "--model", str(ckpt)]) == 1
    assert "verify: DAMAGED: " in capsys.readouterr().err


def test_a_healthy_fresh_checkpoint_is_unverified_then_ok(ckpt, capsys):
    from expertcache.recipes.cli import main

    assert main(["verify", "--model", str(ckpt)]) == 0
    err = capsys.readouterr().err
    assert "verify: UNVERIFIED: no checksum reference existed" in err and "index written" in err
    rep = verify(ckpt)
    assert rep["ok"] and rep["verdict"] == "ok" and rep["outliers"] == 0


def test_verify_on_read_only_storage_keeps_its_index_in_the_user_cache(ckpt, tmp_path, monkeypatch):
    """#24 finding 9: a shared, read-only model folder: verify used to die writing its index beside it."""
    import expertcache.runtime.storage.checkpoint as ck

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    mode = ckpt.stat().st_mode
    os.chmod(ckpt, 0o555)
    try:
        if os.access(ckpt, os.W_OK):  # root ignores the mode bits: say the folder is read-only
            monkeypatch.setattr(ck, "_writable", lambda folder: False)
        rep = verify(ckpt)
        assert rep["ok"] and "not writable" in rep["index"]["after"] and not (ckpt / CHECKSUM_INDEX).exists()
        cached = list((tmp_path / "cache" / "checksums").glob("[!.]*.json"))  # not the output marker
        assert len(cached) == 1 and rep["index"]["path"] == str(cached[0])
        again = verify(ckpt)
        assert again["verdict"] == "ok" and again["checked_against_index"] == 16
        m = load(ckpt, capacity=2, tier="disk")  # the engine finds the cached index too
        assert m.expertcache.source.index_state == "on"
        m.expertcache.close()
    finally:
        os.chmod(ckpt, mode)
    src = expert_source(ckpt)
    s = src.spans(1, 1)[0]
    _flip(src.files[s.file], s.offset + 4)
    os.chmod(ckpt, 0o555)
    try:
        rep = verify(ckpt)
        assert not rep["ok"] and rep["mismatches"] == 1
    finally:
        os.chmod(ckpt, mode)


def test_verify_of_a_relative_folder_writes_its_index_beside_it_and_says_so(ckpt, monkeypatch):
    """#46: `verify --model runs/x/model` wrote the index into the folder and said the folder was not writable
    (the relative path was compared with the index's absolute one)."""
    monkeypatch.chdir(ckpt.parent)
    rep = verify(ckpt.name)
    assert rep["ok"] and (ckpt / CHECKSUM_INDEX).is_file()
    assert rep["index"]["after"] == "written", rep["index"]


def test_verify_of_a_relative_folder_through_the_cli_is_not_an_output_folder_claim(ckpt, monkeypatch):
    """The output-folder rule claimed the checkpoint's own folder when its path was relative (the index's folder
    compared unresolved): `expertcache verify --model ck` was refused as "not an output of verify"."""
    from expertcache.recipes.cli import main

    monkeypatch.chdir(ckpt.parent)
    assert main(["verify", "--model", ckpt.name]) == 0
    assert (ckpt / CHECKSUM_INDEX).is_file()
    assert not any(p.name.startswith(".expertcache-output") for p in ckpt.iterdir())  # the folder is not claimed
