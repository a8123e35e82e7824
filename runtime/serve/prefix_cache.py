"""Prompt reuse: the KV of earlier sequences kept by their token ids, so a request that starts the same way (a chat's
next turn, a shared system prompt) prefills only what is new.

    cache = PrefixCache(max_bytes=2**30)
    cache.insert(ids, [(k, v), ...])          # per layer `[1, H, len(ids), D]`, cloned in
    n, kv = cache.lookup(prompt_ids)          # the longest cached prefix (n tokens, n < len(prompt_ids)) and its KV

Entries are whole sequences (a prompt after its prefill, prompt + output when it finishes); an index of their
block-aligned prefixes (`BLOCK` tokens, hashed as a chain like vLLM's block hashes) finds the entry sharing the most
whole blocks with a prompt, and the match then extends token by token inside that entry (its tokens are checked, so
a hash collision never reuses the wrong KV). Position p's keys and values depend only on tokens 0..p (causal
attention), so any entry's first n positions are the KV of any prompt with the same first n tokens.

Bounded by bytes, least recently used evicted first; `max_bytes` may change (the server shrinks it while the running
batch needs the room, `serve.Decoder`). All calls come from one thread (the decode worker).
"""

from __future__ import annotations

import collections

import torch

BLOCK = 16  # tokens per indexed prefix block: a prompt shares less than this with every entry -> no reuse


class _Entry:
    __slots__ = ("tokens", "kv", "nbytes", "keys")

    def __init__(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], keys: list[int]):
        self.tokens, self.kv, self.keys = tokens, kv, keys
        self.nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def _block_keys(ids: list[int], limit: int | None = None) -> list[int]:
    """Chained hashes of `ids`' whole blocks: key j stands for ids[:(j + 1) * BLOCK]."""
    n = len(ids) if limit is None else min(limit, len(ids))
    out, h = [], 0
    for j in range(n // BLOCK):
        h = hash((h, tuple(ids[j * BLOCK:(j + 1) * BLOCK])))
        out.append(h)
    return out


def _common(a: list[int], b: list[int], start: int, end: int) -> int:
    """The first position in [start, end) where `a` and `b` differ (end when none)."""
    i = start
    while i < end and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Token-id sequences -> their per-layer KV, LRU within `max_bytes`; `hits`, `misses`, `reused_tokens` count the
    lookups."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # LRU first
        self.index: dict[int, set[int]] = {}  # block key -> ids of the entries holding that prefix
        self.nbytes = 0
        self.hits = self.misses = self.reused_tokens = self.evicted = 0
        self._next = 0

    def __len__(self) -> int:
        return len(self.entries)

    def _best(self, ids: list[int], limit: int) -> tuple[int, int | None]:
        """(tokens shared, entry id) with the entry sharing the most of `ids[:limit]` (whole blocks first)."""
        best = None
        for key in _block_keys(ids, limit):
            found = self.index.get(key)
            if not found:
                break
            best = found
        if not best:
            return 0, None
        # the entry of the deepest block reached that shares the most tokens (checked: a hash collision matches 0)
        n, eid = 0, None
        for e in best:
            t = self.entries[e].tokens
            m = _common(t, ids, 0, min(len(t), limit))
            if m > n:
                n, eid = m, e
        return n, eid

    def lookup(self, ids: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """The longest cached prefix of `ids` that leaves at least one token to prefill (its logits choose the first
        new token): (n, per-layer (keys, values) `[1, H, n, D]` views of the entry, not to be written into) or
        (0, None). Counts a hit or a miss and marks the entry recently used."""
        n, eid = self._best(ids, len(ids) - 1)
        if eid is None or n < BLOCK:
            self.misses += 1
            return 0, None
        self.entries.move_to_end(eid)
        self.hits += 1
        self.reused_tokens += n
        return n, [(k[:, :, :n], v[:, :, :n]) for k, v in self.entries[eid].kv]

    def insert(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Keep the KV `kv` (per layer `[1, H, >= len(ids), D]`, its first len(ids) positions those of `ids`),
        cloned. Skipped (False) when shorter than a block, larger than the whole bound, or already covered by an
        entry that starts with `ids`; entries that `ids` extends are dropped (the new one covers them)."""
        ids = list(ids)
        L = len(ids)
        if L < BLOCK or self.max_bytes <= 0:
            return False
        n, eid = self._best(ids, L)
        if eid is not None and n == L:  # an entry already holds this whole sequence's KV
            self.entries.move_to_end(eid)
            return False
        per = sum(k[:, :, :1].numel() * k.element_size() * 2 for k, _ in kv)  # bytes per position, keys and values
        if L * per > self.max_bytes:
            return False
        keys = _block_keys(ids)
        for key in keys:  # entries that are prefixes of `ids`: the new entry holds their KV too
            for e in list(self.index.get(key, ())):
                t = self.entries[e].tokens
                if len(t) <= L and t == ids[:len(t)]:
                    self._drop(e)
        e = _Entry(ids, [(k[:, :, :L].clone(memory_format=torch.contiguous_format),
                          v[:, :, :L].clone(memory_format=torch.contiguous_format)) for k, v in kv], keys)
        eid, self._next = self._next, self._next + 1
        self.entries[eid] = e
        for key in keys:
            self.index.setdefault(key, set()).add(eid)
        self.nbytes += e.nbytes
        self.trim()
        return True

    def trim(self, max_bytes: int | None = None) -> None:
        """Evict least recently used entries until the cache holds at most `max_bytes` (default: its bound;
        a value given becomes the bound)."""
        if max_bytes is not None:
            self.max_bytes = int(max_bytes)
        while self.entries and self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.evicted += 1

    def _drop(self, eid: int) -> None:
        e = self.entries.pop(eid)
        for key in e.keys:
            s = self.index.get(key)
            if s is not None:
                s.discard(eid)
                if not s:
                    del self.index[key]
        self.nbytes -= e.nbytes
