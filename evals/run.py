"""`expertcache eval`: the local tasks through `lm_eval.simple_evaluate` and the step-wise token perplexity, for
one checkpoint under one runtime policy; one JSON with both (and lm-eval's own results JSON beside it)."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from expertcache.runtime.engine.config import EngineConfig
from expertcache.telemetry.atomic import write_json
from expertcache.telemetry.errors import InputError

from .served import label, open_model, served_engine
from .taskdata import (DEFAULT_TASKS, DOMAINS, GENERATION_TASKS, LOCAL_TASKS, PPL_BLOCKS, TASK_DOCS,
                       build_task_data, lm_eval_tasks, task_docs_built, write_task_yamls)


def stepwise_blocks(corpus: str, tokenizer: str, split: str, seq_len: int, per_domain: int) -> dict[str, np.ndarray]:
    from expertcache.telemetry.corpus import packed_blocks

    out = {}
    for d in DOMAINS:
        b = packed_blocks(corpus, tokenizer, split, d, seq_len)
        if len(b):
            out[d] = b[np.linspace(0, len(b) - 1, min(per_domain, len(b))).astype(int)]
    return out


def file_blocks(path: str | Path, tokenizer: str, seq_len: int, n_blocks: int, field: str = "text"
                ) -> dict[str, np.ndarray]:
    """Step-wise blocks from the user's own text: `path` is plain text (documents separated by blank lines) or
    JSONL (the text under `field`); each document tokenized with the model's tokenizer and ended with EOS, all
    packed into blocks of `seq_len` tokens, `n_blocks` spread evenly over them (domain: the file's stem)."""
    import json as _json

    from expertcache.telemetry.hf import load_tokenizer

    p = Path(path)
    if not p.is_file():
        raise InputError(f"--ppl_file {p}: no such file")
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--ppl_file {p}: not readable UTF-8 text ({e.__class__.__name__})") from None
    if p.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = _json.loads(line)
            except ValueError:
                raise InputError(f"--ppl_file {p}:{i}: not JSON") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise InputError(f"--ppl_file {p}:{i}: no string field {field!r} (choose it with --ppl_field)")
            docs.append(row[field])
    else:
        docs = [d for d in raw.split("\n\n")]
    docs = [d for d in docs if d.strip()]
    tok = load_tokenizer(tokenizer)
    ids: list[int] = []
    for enc in tok(docs, add_special_tokens=False)["input_ids"] if docs else []:
        ids.extend(enc)
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    n = len(ids) // seq_len
    if n == 0:
        raise InputError(f"--ppl_file {p} holds {len(ids)} tokens: not one block of --seq_len {seq_len}")
    blocks = np.asarray(ids[:n * seq_len], dtype=np.int32).reshape(n, seq_len)
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in p.stem) or "user"
    return {name: blocks[np.linspace(0, n - 1, min(n_blocks, n)).astype(int)]}


def blocks_sha256(blocks: dict[str, np.ndarray]) -> str:
    """sha256 over the step-wise blocks' token ids (domain, shape, int32 little-endian ids, in domain order): two
    evals with the same hash measured perplexity on exactly the same tokens."""
    h = hashlib.sha256()
    for d in sorted(blocks):
        b = np.ascontiguousarray(blocks[d], dtype="<i4")
        h.update(f"{d}:{'x'.join(map(str, b.shape))};".encode())
        h.update(b.tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(model_dir: str | Path) -> dict:
    """{'vocab_sha256', 'vocab_size'}: sha256 of the tokenizer's vocabulary (token -> id, added tokens included,
    sorted), so a re-saved tokenizer with the same vocabulary matches and a different one does not."""
    from expertcache.telemetry.hf import load_tokenizer

    vocab = load_tokenizer(model_dir).get_vocab()
    blob = json.dumps(sorted(vocab.items()), ensure_ascii=False, separators=(",", ":")).encode()
    return {"vocab_sha256": hashlib.sha256(blob).hexdigest(), "vocab_size": len(vocab)}


# per-document scores the gate pairs: lm-eval metric -> the filter whose samples carry it
DOC_METRICS = {"acc": "none", "exact_match": "answer", "bits_per_byte": "none"}


def per_document(samples: dict) -> dict:
    """lm-eval's logged samples -> {task: {'doc_id': [...], 'docs_sha256': hash of the documents in doc_id order,
    'acc' | 'exact_match': [0/1 per document], 'bpb_ll': [nats], 'bpb_bytes': [bytes]}} (the gate's paired
    intervals: both runs must list the same documents)."""
    out = {}
    for task, rows in (samples or {}).items():
        by_doc: dict[int, dict] = {}
        for s in rows:
            for metric, filt in DOC_METRICS.items():
                if metric in s and s.get("filter", "none") == filt:
                    by_doc.setdefault(int(s["doc_id"]), {"hash": str(s.get("doc_hash", ""))})[metric] = s[metric]
        if not by_doc:
            continue
        ids = sorted(by_doc)
        t: dict = {"doc_id": ids, "docs_sha256": hashlib.sha256(
            "\n".join(f"{i}:{by_doc[i]['hash']}" for i in ids).encode()).hexdigest()}
        for metric in ("acc", "exact_match"):
            if all(metric in by_doc[i] for i in ids):
                t[metric] = [float(by_doc[i][metric]) for i in ids]
        if all("bits_per_byte" in by_doc[i] for i in ids):
            t["bpb_ll"] = [float(by_doc[i]["bits_per_byte"][0]) for i in ids]
            t["bpb_bytes"] = [int(by_doc[i]["bits_per_byte"][1]) for i in ids]
        out[task] = t
    return out


def evaluate(model_dir: str | Path, corpus: str = "data/corpus", engine: EngineConfig | None = None, tasks=DEFAULT_TASKS,
             out: str | Path | None = None, task_dir: str | Path | None = None, limit: int | None = None,
             ppl_blocks: int = PPL_BLOCKS, seq_len: int = 128, split: str = "test",
             batch_size: int = 8, include_path: str | Path | None = None, dtype: str = "fp32",
             device: str = "cpu", progress=None, ppl_file: str | Path | None = None, ppl_field: str = "text",
             stepwise: str = "auto", accuracy: str = "token") -> dict:
    import lm_eval

    from .stepwise import check_method, stepwise_perplexity

    import expertcache.evals.lm  # noqa: F401 - registers the "expertcache" lm-eval model

    from expertcache.runtime.storage.loader import parse_device, parse_dtype, resolve

    model_dir = resolve(model_dir)  # a local checkpoint or a cached hub id; a one-line error otherwise
    parse_dtype(dtype)
    device = parse_device(device)
    serve = served_engine(model_dir, engine)  # a quantized checkpoint is always served by the engine
    method = check_method(stepwise, serve is not None and serve.lossy)
    from .replay import check_replayable

    check_replayable(serve, accuracy)  # `replay`: the reroute rule replayed in lm-eval's batched forwards
    generating = [t for t in tasks or () if t in GENERATION_TASKS]
    if accuracy == "replay" and generating:
        raise InputError(f"--accuracy replay scores loglikelihood tasks; {generating[0]} generates text, which is "
                         f"served token by token: leave it out of --tasks or use --accuracy token")
    t0 = time.time()
    task_dir = Path(task_dir or Path(out or "runs/eval").parent / "task-data")
    if any(t in LOCAL_TASKS for t in tasks or ()):
        # the local ec_* tasks' documents (only these need the corpus): as many per task as --limit asks, where the
        # held-out text has them (2,000 by default); a folder built for fewer, or by an older version, is built again
        from expertcache.telemetry.atomic import own_dir

        own_dir(task_dir, "eval", legacy=lambda p: (p / "math_em.jsonl").is_file())  # never a folder of other files
        if not (task_dir / "math_em.jsonl").is_file() or (limit or TASK_DOCS) > task_docs_built(task_dir):
            build_task_data(corpus, task_dir, split, per_domain=max(TASK_DOCS, limit or 0))
        elif not (task_dir / "lm_eval_tasks").is_dir():
            write_task_yamls(task_dir)
    task_list, manager = lm_eval_tasks(list(tasks), task_dir, include_path) if tasks else (None, None)
    # step-wise token perplexity (the gate's Δppl), the engine attached, tokens in order
    from expertcache.telemetry.hf import check_context, load_config

    # every block is decoded in order, one position per token: checked on the config, before the model is opened
    check_context(load_config(model_dir), seq_len, 0, f"--seq_len {seq_len}")
    model, engine = open_model(model_dir, serve, dtype, device)
    step, blocks = None, {}
    if ppl_blocks > 0:
        try:
            blocks = file_blocks(ppl_file, str(model_dir), seq_len, ppl_blocks, ppl_field) if ppl_file is not None \
                else stepwise_blocks(corpus, str(model_dir), split, seq_len, ppl_blocks)
        except InputError:
            if engine is not None:
                engine.close()
            raise
        step = stepwise_perplexity(model, blocks, progress, method)
        step["blocks_sha256"] = blocks_sha256(blocks)
        step["source"] = str(ppl_file) if ppl_file is not None else f"{corpus} ({split})"
    integrity = None
    if engine is not None:
        if step is not None:
            step["engine"] = engine.stats.to_dict(engine.traffic_expert_bytes)
        integrity = engine.integrity()
        if integrity.startswith("unverified"):
            print(f"eval: the served checkpoint is {integrity}", file=sys.stderr)
        engine.close()
    from .gate import EVAL_FORMAT_VERSION

    notes = [f"{d}: {len(b)} blocks of {seq_len} tokens in " + (str(ppl_file) if ppl_file else f"the {split} split")
             + f", {ppl_blocks} asked" for d, b in blocks.items() if len(b) < ppl_blocks]
    if step is None:
        notes.append("no step-wise perplexity (--ppl_blocks 0): a gate on this eval decides on accuracy alone")
    res = {"format_version": EVAL_FORMAT_VERSION, "model": str(model_dir), "policy": label(serve),
           "engine": None if serve is None else asdict(serve), "integrity": integrity, "split": split,
           "dtype": dtype, "device": device,
           "tokenizer": tokenizer_fingerprint(model_dir), "tasks": list(tasks or []), "limit": limit,
           "stepwise": step, "stepwise_blocks": {d: list(b.shape) for d, b in blocks.items()},
           # how lm-eval's documents met the policy: one token at a time through the engine, or the rule replayed
           "accuracy_method": accuracy if serve is not None and serve.lossy else "batched"}
    if tasks:
        args = {"pretrained": str(model_dir), "batch_size": batch_size, "dtype": dtype, "device": device}
        if serve is not None:  # the resolved configuration as it is, not parsed again from its fields' text
            args["engine"] = serve
        if accuracy == "replay":
            args["accuracy"] = "replay"
        r = lm_eval.simple_evaluate(model="expertcache", model_args=args,
                                    tasks=task_list, limit=limit, log_samples=True, task_manager=manager,
                                    bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
        res["lm_eval"] = {t: {k: v for k, v in m.items() if isinstance(v, (int, float, str))}
                          for t, m in r["results"].items()}
        res["lm_eval_versions"] = r.get("versions", {})
        res["lm_eval_samples"] = {t: {k: int(v) for k, v in n.items() if isinstance(v, (int, float))}
                                  for t, n in (r.get("n-samples") or {}).items() if isinstance(n, dict)}
        res["lm_eval_docs"] = per_document(r.pop("samples", None))
        res["n_documents"] = {t: len(d["doc_id"]) for t, d in res["lm_eval_docs"].items()}
        notes += [f"{t}: {n} documents, {limit} asked (the task data has no more)"
                  for t, n in res["n_documents"].items() if limit and n < limit]
        notes += [f"{t}: {n} documents, {TASK_DOCS} wanted (the held-out text has no more)" for t, n in
                  res["n_documents"].items() if not limit and t in LOCAL_TASKS and not t.startswith("ec_ppl_")
                  and n < TASK_DOCS]
        if out:
            margs = (r.get("config") or {}).get("model_args")
            if isinstance(margs, dict) and serve is not None:  # the engine's fields, as the eval JSON records them
                r["config"]["model_args"] = {**margs, "engine": asdict(serve)}
            write_json(Path(out).with_suffix(".lm_eval.json"), r)
    res["n_blocks"] = {d: len(b) for d, b in blocks.items()}  # the samples the gate's intervals rest on
    res["sample_notes"] = notes  # where the held-out text gave fewer blocks or documents than asked
    res["seconds"] = round(time.time() - t0, 1)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_json(out, res)  # atomic: an interrupted eval never leaves a half-written result
    return res
