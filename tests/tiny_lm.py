"""A tiny Qwen3-MoE checkpoint with its own byte-level BPE, written in seconds (no hub): for generate/serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import WORDS

# a small chat template in the usual ChatML shape, for the tests that exercise the templated path
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_checkpoint(out: Path, seed: int = 0, chat_template: bool = False, max_positions: int = 4096,
                         family: str = "qwen3_moe", **config) -> Path:
    """`out/` holds config.json + safetensors + tokenizer files that plain `from_pretrained` loads; `config`
    overrides fields of the tiny config of `family` (default Qwen3-MoE; e.g. moe_intermediate_size)."""
    import random

    from expertcache.trainer.tokenizer import train_tokenizer
    from tiny_models import build_model, tiny_config

    r = random.Random(seed)
    texts = [" ".join(r.choice(WORDS) for _ in range(12)) + " é ü 字" for _ in range(200)]
    tok = train_tokenizer(texts, out, vocab_size=320)
    if chat_template:
        tok.chat_template = CHATML
        tok.save_pretrained(str(out))
    cfg = tiny_config(family, vocab_size=len(tok), max_position_embeddings=max_positions,
                      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **config)
    model = build_model(cfg, seed=seed)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out))
    return Path(out)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One torch thread for a module that imports this (a shared 2-core machine); restored after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
