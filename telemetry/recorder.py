"""Record every MoE layer's routing on a live HF model with forward hooks on its routers (no model surgery).

The hook keeps references to the router's own outputs (logits, weights, ids) and, on request, to its input
(the hidden state entering the layer's MoE block); conversion to NumPy happens once per batch, outside the
forward, so recording ids + weights costs little more than the forward itself (`expertcache bench telemetry`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .adapters import Adapter, adapter_for
from .errors import InputError
from .parquet_trace import TraceMeta, TraceWriter


class Recorder:
    """Context manager: while open, every forward appends one entry per MoE layer to `calls`."""

    def __init__(self, model, hidden: bool = False, logits: bool = False):
        self.model = model
        self.adapter: Adapter = adapter_for(model)
        self.layers = self.adapter.moe_layers(model)
        self.hidden, self.logits = hidden, logits
        self._buf: dict[int, list] = {L.index: [] for L in self.layers}
        self._handles = []

    def _hook(self, index: int):
        buf = self._buf[index]
        want_h, want_l = self.hidden, self.logits

        def hook(module, args, output):
            lg, w, ids = output
            buf.append((ids, w, lg if want_l else None, args[0] if want_h else None))
        return hook

    def __enter__(self) -> "Recorder":
        for L in self.layers:
            self._handles.append(L.router.register_forward_hook(self._hook(L.index)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def clear(self) -> None:
        for v in self._buf.values():
            v.clear()

    def take(self) -> dict[int, list]:
        """Per layer, one (ids, weights, logits|None, hidden|None) per forward call since the last take()."""
        out = {i: list(v) for i, v in self._buf.items()}
        self.clear()
        return out

    def meta(self, model_id: str, **kw) -> TraceMeta:
        a = self.adapter
        return TraceMeta(model=model_id, family=a.family, num_layers=a.num_layers,
                         moe_layers=[L.index for L in self.layers], num_experts=a.num_experts, top_k=a.top_k,
                         hidden_size=a.hidden_size, dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
                         **kw)


def _cat(parts, width_dtype):
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]).to(width_dtype).cpu().numpy()


def rows_from_calls(calls: dict[int, list], call_tokens: list[tuple[np.ndarray, np.ndarray]], want_logits: bool,
                    want_hidden: bool) -> dict[str, np.ndarray]:
    """Assemble trace rows ordered by (seq, pos, layer).

    `call_tokens[j] = (seq_ids, positions)` for forward call j, flattened in the router's token order
    (batch-major); every layer saw the same calls."""
    layers = sorted(calls)
    seq = np.concatenate([s for s, _ in call_tokens])
    pos = np.concatenate([p for _, p in call_tokens])
    n_tok = len(seq)
    per = {}
    for i in layers:
        entries = calls[i]
        if len(entries) != len(call_tokens):
            raise RuntimeError(f"layer {i} saw {len(entries)} forwards, expected {len(call_tokens)}")
        per[i] = {"ids": _cat([e[0] for e in entries], torch.int32),  # the writer checks the range, stores int16
                  "weights": _cat([e[1] for e in entries], torch.float16)}
        if want_logits:
            per[i]["logits"] = _cat([e[2] for e in entries], torch.float16)
        if want_hidden:
            per[i]["hidden"] = _cat([e[3] for e in entries], torch.float16)
        if len(per[i]["ids"]) != n_tok:
            raise RuntimeError(f"layer {i} routed {len(per[i]['ids'])} tokens, expected {n_tok}")
    order = np.lexsort((pos, seq))  # tokens by (seq, pos)
    n_l = len(layers)
    out = {"seq_id": np.repeat(seq[order], n_l), "pos": np.repeat(pos[order], n_l),
           "layer": np.tile(np.asarray(layers, np.int16), n_tok)}
    for key in per[layers[0]]:
        stacked = np.stack([per[i][key][order] for i in layers], axis=1)  # [tokens, layers, width]
        out[key] = stacked.reshape(n_tok * n_l, -1)
    return out


@torch.no_grad()
def record_blocks(model, blocks: np.ndarray, writer: TraceWriter, domain: str, prompt_len: int,
                  decode_tokens: int, batch_size: int, seq_offset: int = 0, progress=None) -> int:
    """Prefill `blocks[:, :prompt_len]` and greedily decode `decode_tokens` tokens through `model.generate`,
    recording both phases. One row group per batch. Returns the number of sequences recorded."""
    if blocks.shape[1] < prompt_len:
        raise InputError(f"blocks have {blocks.shape[1]} tokens, prompt_len is {prompt_len}")
    from .hf import check_context

    check_context(model, prompt_len, decode_tokens, "prompt_len", "decode_tokens")
    model.eval()
    with Recorder(model, hidden=writer.with_hidden, logits=writer.with_logits) as rec:
        for start in range(0, len(blocks), batch_size):
            prompt = torch.from_numpy(blocks[start:start + batch_size, :prompt_len].astype(np.int64)).to(model.device)
            b = prompt.shape[0]
            seq_ids = np.arange(seq_offset + start, seq_offset + start + b, dtype=np.int32)
            rec.clear()
            if decode_tokens > 0:
                # the last generated token is never fed back, so decode_tokens + 1 new tokens give decode_tokens
                # decode forwards (positions prompt_len .. prompt_len + decode_tokens - 1)
                n_new = decode_tokens + 1
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new,
                                     min_new_tokens=n_new, do_sample=False, pad_token_id=model.config.pad_token_id)
                tokens = out[:, :prompt_len + decode_tokens].cpu().numpy()
            else:
                model(input_ids=prompt, use_cache=False)
                tokens = prompt.cpu().numpy()
            calls = rec.take()
            n_calls = len(next(iter(calls.values())))
            call_tokens = [(np.repeat(seq_ids, prompt_len), np.tile(np.arange(prompt_len, dtype=np.int32), b))]
            for j in range(1, n_calls):
                call_tokens.append((seq_ids, np.full(b, prompt_len + j - 1, dtype=np.int32)))
            rows = rows_from_calls(calls, call_tokens, writer.with_logits, writer.with_hidden)
            phase = np.where(rows["pos"] < prompt_len, "prefill", "decode")
            tok = tokens[rows["seq_id"] - seq_ids[0], rows["pos"]]
            writer.write(rows["seq_id"], rows["pos"], rows["layer"], phase, domain, tok, rows["ids"],
                         rows["weights"], rows.get("logits"), rows.get("hidden"))
            if progress is not None:
                progress(b)
    return len(blocks)


from .hf import DTYPE_NAMES as DTYPES  # noqa: E402 - the one dtype map


def _dtype(name: str):
    """The dtype the recording runs in: `auto` is the checkpoint's own (the routing it is served with); the
    trace's metadata names it."""
    from .hf import parse_dtype

    return parse_dtype(name, "--dtype") or "auto"


def read_prompts(path: str | Path, field: str = "text", limit: int = 0) -> list[str]:
    """A prompts file: `.jsonl` (one JSON object per line, the prompt under `field`) or plain text (one prompt
    per non-empty line); or a folder holding a local `datasets` dataset (`save_to_disk`; a DatasetDict's first
    split, or the one named `path:split`), the prompt in column `field`. `limit` > 0 keeps the first ones."""
    import json

    split = None
    if not Path(path).exists() and ":" in str(path):
        path, split = str(path).rsplit(":", 1)
    path = Path(path)
    if path.is_dir():
        return _dataset_prompts(path, split, field, limit)
    if not path.is_file():
        raise InputError(f"--prompts {path}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise InputError(f"--prompts {path} is not UTF-8 text") from None
    out = []
    if path.suffix == ".jsonl":
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"--prompts {path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise InputError(f"--prompts {path}:{i}: no string field {field!r} (choose it with --field)")
            if row[field].strip():
                out.append(row[field])
    else:
        out = [ln for ln in lines if ln.strip()]
    if not out:
        raise InputError(f"--prompts {path} holds no prompt text")
    return out[:limit] if limit > 0 else out


def _dataset_prompts(path: Path, split: str | None, field: str, limit: int) -> list[str]:
    """Prompts from a local `datasets` dataset written by `save_to_disk` (Arrow files: nothing in it executes)."""
    import datasets

    if not any((path / f).is_file() for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
        raise InputError(f"--prompts {path} is a folder but not a saved `datasets` dataset (no dataset_dict.json or "
                         f"state.json); give a .txt or .jsonl file, or a folder written by save_to_disk")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged dataset folder is bad input, said in one line
        raise InputError(f"--prompts {path}: not a readable `datasets` dataset ({type(e).__name__})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is not None and split not in ds:
            raise InputError(f"--prompts {path}: no split {split!r}; it has {', '.join(ds)}")
        ds = ds[split or next(iter(ds))]
    if field not in ds.column_names:
        raise InputError(f"--prompts {path}: no column {field!r} (choose it with --field); it has "
                         f"{', '.join(ds.column_names)}")
    out = [x for x in ds[field] if isinstance(x, str) and x.strip()]
    if not out:
        raise InputError(f"--prompts {path} holds no prompt text in column {field!r}")
    return out[:limit] if limit > 0 else out


def record_prompts(model_dir: str | Path, prompts: list[str], out: str | Path, prompt_len: int = 128,
                   decode_tokens: int = 64, domain: str = "prompts", hidden: bool = False, logits: bool = False,
                   dtype: str = "auto", source: str = "", open_model=None) -> dict:
    """Record a HF checkpoint's routing on the user's own prompts (each: at most `prompt_len` tokens, prefill and
    `decode_tokens` greedy steps; one sequence each) into a Parquet trace that analyze and fit-policy read.
    `open_model`: a callable returning the model to record (e.g. the runtime's `load()`, experts offloaded);
    None: the whole checkpoint read into memory (`load_causal_lm`)."""
    from expertcache.telemetry.progress import Progress

    from .hf import check_context, load_causal_lm, load_tokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise InputError(f"no HF checkpoint at {model_dir} (expected {model_dir / 'config.json'})")
    tok = load_tokenizer(str(model_dir))
    model = open_model() if open_model is not None else load_causal_lm(model_dir, dtype=_dtype(dtype))
    ids = [tok(p, add_special_tokens=False)["input_ids"][:prompt_len] for p in prompts]
    ids = [x for x in ids if x]
    if not ids:
        raise InputError("no prompt has a token after tokenization")
    vocab = model.get_input_embeddings().num_embeddings
    if max(max(x) for x in ids) >= vocab:
        raise InputError(f"the tokenizer of {model_dir} gives ids beyond the model's vocabulary ({vocab})")
    check_context(model, max(len(x) for x in ids), decode_tokens, "--prompt_len", "--decode_tokens")
    meta = Recorder(model).meta(str(model_dir), tokenizer=str(model_dir), corpus=source, split="",
                                extra={"prompt_len": prompt_len, "decode_tokens": decode_tokens, "greedy": True,
                                       "prompts": len(ids)})
    with TraceWriter(out, meta, with_logits=logits, with_hidden=hidden, inputs=(model_dir,)) as w, Progress() as prog:
        task = prog.add_task("recording prompts", total=len(ids))
        for i, x in enumerate(ids):
            record_blocks(model, np.asarray([x], dtype=np.int64), w, domain, len(x), decode_tokens, 1, seq_offset=i,
                          progress=lambda b: prog.advance(task, b))
        rows = w.rows
    from .parquet_trace import read_meta

    return {"trace": str(out), "sequences": len(ids), "rows": rows, "domains": [domain],
            "meta": read_meta(out).__dict__}


def record_corpus(model_dir: str | Path, corpus: str, tokenizer: str | None, split: str, out: str | Path,
                  prompt_len: int = 128, decode_tokens: int = 64, batch_size: int = 8, max_seqs: int = 16,
                  domains: list[str] | None = None, hidden: bool = False, logits: bool = False,
                  dtype: str = "auto", open_model=None) -> dict:
    """Record a HF checkpoint on `max_seqs` held-out blocks per domain of our corpus into a Parquet trace
    (`open_model`: as in `record_prompts`)."""
    from expertcache.telemetry.progress import Progress

    from .corpus import DOMAINS, packed_blocks

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise InputError(f"no HF checkpoint at {model_dir} (expected {model_dir / 'config.json'})")
    own = (model_dir / "tokenizer.json").is_file()
    if tokenizer and own and Path(tokenizer).resolve() != model_dir.resolve():
        from .hf import load_tokenizer

        if load_tokenizer(str(tokenizer)).get_vocab() != load_tokenizer(str(model_dir)).get_vocab():
            raise InputError(f"--tokenizer {tokenizer} is not the tokenizer of {model_dir} (their vocabularies "
                             f"differ); leave --tokenizer out to use the checkpoint's own")
    tokenizer = tokenizer or str(model_dir)
    from .hf import load_causal_lm

    model = open_model() if open_model is not None else load_causal_lm(model_dir, dtype=_dtype(dtype))
    from .hf import check_context

    check_context(model, prompt_len, decode_tokens, "--prompt_len", "--decode_tokens")  # before any block is read
    domains = list(domains or DOMAINS)
    picked = {}
    for dom in domains:
        blocks = packed_blocks(corpus, tokenizer, split, dom, prompt_len)
        if not len(blocks):
            raise InputError(f"split {split!r} has no {dom} text long enough for prompt_len={prompt_len}")
        idx = np.linspace(0, len(blocks) - 1, min(max_seqs, len(blocks))).astype(int)
        picked[dom] = blocks[idx]
    meta = Recorder(model).meta(str(model_dir), tokenizer=str(tokenizer), corpus=str(corpus), split=split,
                                extra={"prompt_len": prompt_len, "decode_tokens": decode_tokens, "greedy": True})
    n = 0
    with TraceWriter(out, meta, with_logits=logits, with_hidden=hidden, inputs=(model_dir, tokenizer)) as w, \
            Progress() as prog:
        task = prog.add_task("recording", total=sum(len(v) for v in picked.values()))
        for dom, blocks in picked.items():
            n += record_blocks(model, blocks, w, dom, prompt_len, decode_tokens, batch_size, seq_offset=n,
                               progress=lambda b: prog.advance(task, b))
        rows = w.rows
    from .parquet_trace import read_meta

    return {"trace": str(out), "sequences": n, "rows": rows, "domains": domains,
            "meta": read_meta(out).__dict__}  # as written, its footer's status (partial false) included
