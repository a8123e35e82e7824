"""Byte-level BPE tokenizer trained on the corpus' train split, saved so plain `AutoTokenizer` loads it."""

from __future__ import annotations

from pathlib import Path

from expertcache.telemetry.errors import InputError

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_tokenizer(texts, out_dir: str | Path, vocab_size: int = 8192):
    """Train on an iterable of strings; write a `PreTrainedTokenizerFast` to `out_dir` and return it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise InputError(f"vocab_size={vocab_size}: a byte-level BPE needs at least 256 byte tokens + specials")
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, bos_token=EOS, pad_token=PAD,
                                  unk_token=None, model_max_length=1 << 30)
    from expertcache.telemetry.atomic import atomic_dir

    with atomic_dir(out_dir) as tmp:
        tok.save_pretrained(str(tmp))
    return tok


