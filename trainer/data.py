"""Packed token blocks per (split, domain) and the Lightning data module that serves them.

Documents of one domain are joined with EOS and cut into blocks of `seq_len` tokens, so every block has one
domain label (traces and per-domain perplexity need that). The train order is a pure function of
(seed, step): batch `s` is the same whether the run went straight through or resumed at step `s`.
"""

from __future__ import annotations


import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from expertcache.telemetry.corpus import DOMAINS, packed_blocks

from .specs import DataSpec  # noqa: F401 - re-exported


class Blocks(Dataset):
    def __init__(self, blocks: np.ndarray, domain_ids: np.ndarray):
        self.blocks = torch.from_numpy(blocks.astype(np.int64))  # [n, seq_len]
        self.domain_ids = torch.from_numpy(domain_ids.astype(np.int64))  # [n]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "domain": self.domain_ids[i]}


class StepBatchSampler(Sampler):
    """Infinite batches; batch `s` = slice `s` of a seeded permutation stream. Starts at `start_step()`. Under
    data parallelism each rank takes its contiguous share of every global batch, so W processes see exactly the
    batches one process would."""

    def __init__(self, n: int, batch_size: int, seed: int, start_step=lambda: 0, rank: int = 0, world: int = 1):
        if n < batch_size:
            raise ValueError(f"only {n} training blocks for batch_size={batch_size}; build a larger corpus")
        if batch_size % world:
            raise ValueError(f"data.batch_size={batch_size} does not split evenly across {world} devices")
        self.n, self.batch_size, self.seed, self.start_step = n, batch_size, seed, start_step
        self.rank, self.world = rank, world

    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def batch(self, step: int) -> list[int]:
        per_epoch = self.n // self.batch_size
        epoch, j = divmod(step, per_epoch)
        return self._perm(epoch)[j * self.batch_size:(j + 1) * self.batch_size].tolist()

    def __iter__(self):
        step = self.start_step()
        share = self.batch_size // self.world
        while True:
            yield self.batch(step)[self.rank * share:(self.rank + 1) * share]
            step += 1


class CorpusDataModule(L.LightningDataModule):
    def __init__(self, spec: DataSpec, seed: int = 0):
        super().__init__()
        self.spec, self.seed = spec, seed
        self.train: Blocks | None = None
        self.val: dict[str, Blocks] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.train is not None:
            return
        s = self.spec
        parts, labels = [], []
        for i, dom in enumerate(DOMAINS):
            b = packed_blocks(s.corpus, s.tokenizer, "train", dom, s.seq_len)
            parts.append(b)
            labels.append(np.full(len(b), i))
        self.train = Blocks(np.concatenate(parts), np.concatenate(labels))
        for i, dom in enumerate(DOMAINS):
            b = packed_blocks(s.corpus, s.tokenizer, "validation", dom, s.seq_len)
            # An evenly spread, fixed subset, so every validation sees the same tokens.
            take = min(len(b), s.val_batches * s.batch_size)
            idx = np.linspace(0, len(b) - 1, take).astype(int) if take else np.zeros(0, dtype=int)
            self.val[dom] = Blocks(b[idx], np.full(take, i))

    def _current_step(self) -> int:
        return self.trainer.global_step if self.trainer is not None else 0

    def train_dataloader(self):
        t = self.trainer
        rank, world = (t.global_rank, t.world_size) if t is not None else (0, 1)
        sampler = StepBatchSampler(len(self.train), self.spec.batch_size, self.seed, self._current_step, rank, world)
        return DataLoader(self.train, batch_sampler=sampler, num_workers=0)

    def val_dataloader(self):
        return [DataLoader(self.val[d], batch_size=self.spec.batch_size, shuffle=False) for d in DOMAINS
                if len(self.val[d])]

    def val_domains(self) -> list[str]:
        return [d for d in DOMAINS if len(self.val[d])]
