"""The one decode loop: a prefill per sequence, then one forward per step for every running sequence together.

    batch = Batch(model, max_rows=8)
    pieces = batch.admit(gen)          # prefill `gen`'s prompt alone, choose its first token, join the batch
    for gen, piece in batch.step():    # one token for every running sequence, in one forward
        ...

`Generation` (generate.py) is one sequence's state: its sampling, stop strings, text and timing. A `Batch` is the
running set and its KV cache. `Generation.__iter__` (`expertcache generate`) is a batch of one; the server's
scheduler (serve.py) admits requests into a batch between steps, so requests join and leave it every step. The
step-wise evaluation, the lm-eval model and the benchmarks call `forward`, where the transformers KV-cache argument
rename is handled once.

How sequences of different lengths share one forward: each row's KV cache is left-padded to the longest, a 2-D
attention mask marks the padding, and each row's position is its own length (`position_ids`), so every row attends
to its own tokens only, at its own positions. When the rows that needed the widest padding leave, the columns no
row uses are dropped. With every expert resident the offload engine's layer step serves the union of the batch's
experts, each expert's weights read once for all the rows that chose it.

Models whose KV cache is not a plain growing one (sliding-window layers, e.g. GPT-OSS) decode one sequence at a
time: `Batch.batchable` is False for them and the scheduler keeps one row.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def _cache_kw(forward_cls) -> str:
    # transformers 5.x renamed the KV-cache argument `past_key_values` -> `cache` (the old name is deprecated there);
    # earlier 5.x releases only know the old one
    return "cache" if "cache" in inspect.signature(forward_cls.forward).parameters else "past_key_values"


def forward(model, ids: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None, logits_to_keep: int | None = None):
    """One forward of `ids [B, T]` through `cache` (None: the model makes one; it is returned as `out.cache`).
    `logits_to_keep`: 1 for the last position only (decode), 0 or None for every position."""
    kw = _cache_kw(type(model))
    extra = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
    if attention_mask is not None:
        extra["attention_mask"] = attention_mask
    if position_ids is not None:
        extra["position_ids"] = position_ids
    out = model(input_ids=ids, **{kw: cache}, use_cache=True, **extra)
    out.cache = getattr(out, kw)
    return out


def _plain_layers(cache) -> bool:
    """Whether every layer of `cache` is a plain growing KV layer (rows can be padded, joined and dropped)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _pad_left(cache, n: int) -> None:
    if n:
        for layer in cache.layers:
            layer.keys = F.pad(layer.keys, (0, 0, n, 0))
            layer.values = F.pad(layer.values, (0, 0, n, 0))


class Batch:
    """The running sequences and their shared KV cache. `admit` and `step` return the text each sequence shows
    now; a sequence whose `finish_reason` is set has left the batch (its tail is in the pieces returned)."""

    def __init__(self, model, max_rows: int = 1):
        self.model, self.max_rows = model, max(1, int(max_rows))
        self.rows: list = []  # Generation, in batch order
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 = a real token, 0 = left padding
        self.batchable: bool | None = None  # known after the first prefill
        self.trace = None  # a `telemetry.live_trace.LiveTrace`: every forward's routing recorded
        self.prefix_cache = None  # a `prefix_cache.PrefixCache`: prompts start from their longest cached prefix
        self.prefill_chunk: int | None = None  # prompt tokens per prefill forward (None: the whole prompt in one)
        self.device = model.get_input_embeddings().weight.device

    def __len__(self) -> int:
        return len(self.rows)

    def can_join(self) -> bool:
        if not self.rows:
            return True
        return bool(self.batchable) and len(self.rows) < self.max_rows

    def columns(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def start(self, g) -> "Prefill":
        """Begin `g`'s prefill: its longest cached prefix (`prefix_cache`) taken as it is, the rest left for
        `Prefill.advance`. Prompts whose every position is scored (echo with logprobs) are prefilled whole."""
        g._begin()
        return Prefill(self, g)

    def admit(self, g) -> list[str]:
        """Prefill `g`'s prompt alone (in `prefill_chunk`-token forwards after its cached prefix), choose its first
        token, and add it to the running rows unless it is already finished. Returns the text it shows."""
        job = self.start(g)
        while not job.advance():
            pass
        return self.finish(job)

    @torch.no_grad()
    def finish(self, job: "Prefill") -> list[str]:
        """A prefill done (`job.advance()` returned True): the first token chosen, the prompt's KV kept in the prefix
        cache, the row joined. Returns the text it shows."""
        g, cache = job.g, job.cache
        if g.prompt_logprobs:
            g._score_prompt(torch.cat(job.logits) if len(job.logits) > 1 else job.logits[0])
        pieces = []
        if g.params.max_tokens > 0:
            pieces.append(g._accept(job.last))
        else:
            g.finish_reason = "length"  # echo with max_tokens 0: the prompt scored, nothing decoded
        if self.batchable is None:
            self.batchable = _plain_layers(cache)
        if self.prefix_cache is not None and self.batchable:
            self.prefix_cache.insert(g.prompt_ids, [(layer.keys, layer.values) for layer in cache.layers])
        if g.finish_reason is not None:
            pieces.append(g._end())
            return [p for p in pieces if p]
        self._join(g, cache, len(g.prompt_ids))
        return [p for p in pieces if p]

    def _join(self, g, cache, length: int) -> None:
        row_mask = torch.ones(1, length, dtype=torch.long, device=self.device)
        if not self.rows:
            self.rows, self.cache, self.mask = [g], cache, row_mask
            return
        width = self.columns()
        if length < width:
            _pad_left(cache, width - length)
            row_mask = F.pad(row_mask, (width - length, 0))
        elif length > width:
            _pad_left(self.cache, length - width)
            self.mask = F.pad(self.mask, (length - width, 0))
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        self.mask = torch.cat([self.mask, row_mask])
        self.rows.append(g)

    @torch.no_grad()
    def step(self) -> list[tuple[object, str]]:
        """One token for every running row: (generation, text shown) for each row that has something to show or
        has finished."""
        if not self.rows:
            return []
        ids = torch.tensor([[g.completion_next] for g in self.rows], dtype=torch.long, device=self.device)
        if len(self.rows) > 1:  # the engine's counters over this step belong to every row
            for g in self.rows:
                g.shared = True
        # rows of different lengths (padding): each row's position is its own length, and the mask goes in
        padded = not bool(self.mask.all())
        positions = self.mask.sum(1, keepdim=True) if padded else None  # [B, 1]
        self.mask = F.pad(self.mask, (0, 1), value=1)
        engine = getattr(self.model, "expertcache", None)
        if engine is not None:  # its prefetch guard tells a batch's decode step from a prefill
            engine.decode_rows = len(self.rows)
        try:
            out = forward(self.model, ids, self.cache, self.mask if padded else None, positions, logits_to_keep=1)
        finally:
            if engine is not None:
                engine.decode_rows = None
        self.cache = out.cache
        if self.trace is not None:  # each row fed its last token, at position (its length - 1)
            self.trace.forward_done("decode", [(g, [g.prompt_tokens + g.completion_tokens - 1], [g.completion_next])
                                               for g in self.rows])
        events, keep = [], []
        for i, g in enumerate(self.rows):
            piece = g._accept(out.logits[i, -1])
            if g.finish_reason is not None:
                piece += g._end()
                events.append((g, piece))
            else:
                keep.append(i)
                if piece:
                    events.append((g, piece))
        if len(keep) < len(self.rows):
            if self.prefix_cache is not None and self.batchable:
                self._save([i for i in range(len(self.rows)) if i not in set(keep)])
            self._keep(keep)
        return events

    def _save(self, rows: list[int]) -> None:
        """Keep the KV of the finished `rows` (prompt and output, as fed) in the prefix cache: a chat's next turn
        starts with them."""
        width = self.columns()
        for i in rows:
            g, n = self.rows[i], int(self.mask[i].sum())  # left padding: the row's positions are the last n columns
            ids = (g.prompt_ids + g.completion_ids)[:n]
            self.prefix_cache.insert(ids, [(layer.keys[i:i + 1, :, width - n:], layer.values[i:i + 1, :, width - n:])
                                           for layer in self.cache.layers])

    def cancel(self, rows: list) -> list[tuple[object, str]]:
        """Remove `rows` (cancelled by their clients): finish_reason "cancelled", nothing more shown."""
        gone = {id(g) for g in rows}
        for g in rows:
            g.finish_reason = "cancelled"
            g._end()
        self._keep([i for i, g in enumerate(self.rows) if id(g) not in gone])
        return [(g, "") for g in rows]

    def _keep(self, keep: list[int]) -> None:
        if not keep:
            self.rows, self.cache, self.mask = [], None, None
            return
        self.rows = [self.rows[i] for i in keep]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]
        unused = int((self.mask.sum(0) == 0).long().cumprod(0).sum())  # leading columns that are padding in every row
        if unused:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, unused:]
                layer.values = layer.values[:, :, unused:]
            self.mask = self.mask[:, unused:]

    def fail(self) -> list:
        """Drop every row (an error in a step: the cache may be half-updated). Returns them."""
        rows, self.rows, self.cache, self.mask = self.rows, [], None, None
        return rows


class Prefill:
    """One prompt's prefill in steps (`Batch.start`): its cached prefix first, then `advance` forwards the rest,
    at most `Batch.prefill_chunk` tokens at a time, so a scheduler can run the batch's decode steps between them.
    `reused` and `prefilled` count the prompt's tokens each way."""

    def __init__(self, batch: Batch, g):
        self.batch, self.g = batch, g
        self.cache, self.logits, self.last = None, [], None
        self.pos = self.reused = 0
        pc = batch.prefix_cache
        if pc is not None and batch.batchable is not False and not g.prompt_logprobs:
            n, kv = pc.lookup(g.prompt_ids)
            if n:
                from transformers.cache_utils import DynamicCache

                self.cache = DynamicCache(ddp_cache_data=kv)  # (copied into the cache's own tensors)
                self.pos = self.reused = n

    @property
    def prefilled(self) -> int:
        return self.pos - self.reused

    @property
    def left(self) -> int:
        return len(self.g.prompt_ids) - self.pos

    @torch.no_grad()
    def advance(self, budget: int | None = None) -> bool:
        """One forward of the prompt's next tokens (at most `prefill_chunk`, and at most `budget`); True once the
        whole prompt is in the KV cache (`last`: the logits that choose the first token)."""
        b, g = self.batch, self.g
        n = self.left
        if b.prefill_chunk:
            n = min(n, b.prefill_chunk)
        if budget is not None:
            n = min(n, max(1, budget))
        ids = torch.tensor([g.prompt_ids[self.pos:self.pos + n]], dtype=torch.long, device=b.device)  # [1, n]
        out = forward(b.model, ids, self.cache, logits_to_keep=0 if g.prompt_logprobs else 1)
        if b.trace is not None:
            b.trace.forward_done("prefill", [(g, range(self.pos, self.pos + n), g.prompt_ids[self.pos:self.pos + n])])
        self.cache, self.pos = out.cache, self.pos + n
        if g.prompt_logprobs:
            self.logits.append(out.logits[0])
        self.last = out.logits[0, -1]
        return self.left == 0
