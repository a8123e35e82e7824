"""The read side of our corpus, shared by every area: its domains, `load_corpus` and the packed
token blocks of a split. The corpus is built by the trainer (`expertcache data build`, trainer/corpus.py);
telemetry records on it, the runtime takes prompts from it, evals builds tasks from it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .atomic import write_npy
from .hf import load_tokenizer
from .errors import InputError

DOMAINS = ("code", "prose", "math")
MANIFEST = "corpus.json"


class CorpusError(InputError):
    """A corpus folder that is missing or not one `expertcache data build` wrote."""


def load_corpus(path: str | Path):
    """The `DatasetDict` written by `build_corpus`, with a clear error if `path` is not one."""
    import datasets

    path = Path(path)
    if not (path / MANIFEST).is_file() or not (path / "arrow").is_dir():
        raise CorpusError(f"no corpus at {path} (expected {path / MANIFEST} and {path / 'arrow'}); "
                          f"build one with `expertcache data build --out "
                          f"{path.parent if path.name == 'corpus' else path}`"
                          + (" (it writes corpus/ and tokenizer/ there)" if path.name == "corpus" else ""))
    return datasets.load_from_disk(str(path / "arrow"))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _fingerprint(tokenizer_dir: Path) -> str:
    """The packed blocks' cache key: every file that decides how text becomes ids. tokenizer.json alone is not
    enough: tokenizer_config.json's class can replace its pre-tokenizer (transformers' `Qwen2Tokenizer` splits with
    Qwen2's pattern whatever tokenizer.json says), and two tokenizers that differ only there once shared a cache."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = tokenizer_dir / name
        h.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"-") + b"\0")
    return h.hexdigest()[:16]


def packed_blocks(corpus_dir: str | Path, tokenizer_dir: str | Path, split: str, domain: str,
                  seq_len: int) -> np.ndarray:
    """[n_blocks, seq_len] int32 token blocks, cached as .npy under the corpus (keyed by tokenizer and length)."""
    corpus_dir, tokenizer_dir = Path(corpus_dir), Path(tokenizer_dir)
    tok = load_tokenizer(tokenizer_dir)
    cache = corpus_dir / "packed" / _fingerprint(tokenizer_dir) / f"{split}-{domain}-L{seq_len}.npy"
    if cache.is_file():
        return np.load(cache, allow_pickle=False)
    ds = load_corpus(corpus_dir)[split]
    texts = [t for t, d in zip(ds["text"], ds["domain"]) if d == domain]
    ids: list[int] = []
    for enc in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tok.eos_token_id)
    n = len(ids) // seq_len
    blocks = np.asarray(ids[: n * seq_len], dtype=np.int32).reshape(n, seq_len)
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_npy(cache, blocks)
    return blocks
