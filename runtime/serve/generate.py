"""Streaming text generation on a loaded causal LM, with or without the offload engine.

    gen = Generation(model, tokenizer, prompt_ids, SamplingParams(max_tokens=64, stop=["\\n\\n"]))
    for text in gen:            # text deltas as they decode
        print(text, end="")
    gen.finish_reason, gen.completion_tokens, gen.summary()

One decode loop serves `expertcache generate` and `expertcache serve`: prefill, then one token per forward call
over the model's KV cache. Every forward goes through `model`'s own modules, so when an engine is attached
(`model.expertcache`, see `loader.load`) each MoE layer runs the engine's decode step, exactly as in
`bench decode`. The loop checks a `threading.Event` between tokens: setting it stops the decode at the next
token (the server sets it when a client disconnects).
"""

from __future__ import annotations

import copy
import threading
import time

import torch

from expertcache.telemetry.errors import InputError

from expertcache.runtime.serve.decode import Batch
from expertcache.runtime.serve.request import SamplingParams, chat_prompt, encode, eos_ids, user_prompt


# --- the decode loop -----------------------------------------------------------------------------------------

class _Detok:
    """Incremental detokenisation: emits text once the bytes decoded so far form whole characters (a byte-level
    BPE splits a UTF-8 character over up to 4 tokens; bytes still invalid after that are shown as U+FFFD),
    decoding a short window, not the whole output."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def push(self, token: int | None = None) -> str:
        """The new text after `token` (None: everything still held back, at the end)."""
        if token is not None:
            self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if token is not None and after.endswith("\ufffd") and len(self.ids) - self.read < 4:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


def _logprob_rows(logits: torch.Tensor, ids: list[int], n: int) -> list[tuple]:
    """For each row of `logits [R, V]`: (the token `ids[r]`, its logprob, [(token, logprob)] of the n most likely)."""
    if not ids:
        return []
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(ids, dtype=torch.long, device=logp.device)[:, None])[:, 0].tolist()
    top = logp.topk(n, dim=-1) if n else None
    return [(t, lp, list(zip(top.indices[j].tolist(), top.values[j].tolist())) if top is not None else [])
            for j, (t, lp) in enumerate(zip(ids, chosen))]


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that begins some stop string: not shown until it is decided."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


class Generation:
    """One request: iterate for text deltas; afterwards `finish_reason` (stop | length | cancelled),
    `prompt_tokens`, `completion_tokens`, `token_times` (perf_counter at each token), `text`, and the engine's
    counters over the decode (`stats`, from the first generated token on: prefill excluded, as in METRICS.md)."""

    def __init__(self, model, tokenizer, prompt_ids: list[int], params: SamplingParams,
                 cancel: threading.Event | None = None):
        params.check(model.get_input_embeddings().num_embeddings)
        from expertcache.telemetry.hf import check_context

        check_context(model, len(prompt_ids), params.max_tokens)  # the one decode loop of generate and serve
        self.model, self.tokenizer, self.params = model, tokenizer, params
        self.prompt_ids = list(prompt_ids)
        self.cancel = cancel or threading.Event()
        self.engine = getattr(model, "expertcache", None)
        self.finish_reason: str | None = None
        self.text, self.completion_ids, self.token_times = "", [], []
        self.completion_next: int | None = None  # the token the next step feeds
        self.token_scores: list = []  # with logprobs: (token, logprob, [(token, logprob) top n]) per decoded token
        self.prompt_scores: list = []  # with echo and logprobs: the same for the prompt (the first has none)
        self.shared = False  # decoded in a batch with other requests: the engine's counters are theirs too
        self.t_start = self.t_first = None
        self._stats0 = self._stats1 = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.completion_ids)

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after the repetition penalty (prompt and output tokens, as transformers and vLLM apply it),
        the presence and frequency penalties (output tokens, as OpenAI defines them) and `logit_bias`."""
        p = self.params
        x = logits.float().clone()
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(self.prompt_ids) | set(self.completion_ids)), dtype=torch.long,
                                device=x.device)
            if seen.numel():
                v = x[seen]
                x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.completion_ids:
            ids, counts = torch.tensor(self.completion_ids, dtype=torch.long).unique(return_counts=True)
            x[ids.to(x.device)] -= (p.frequency_penalty * counts + p.presence_penalty).to(x.device, x.dtype)
        for tok, b in p.logit_bias.items():
            x[tok] += b
        return x

    def _next_token(self, logits: torch.Tensor, gen: torch.Generator | None) -> int:
        """`logits [V]` -> one token id: argmax at temperature 0, else sampling (top-k, min-p, then nucleus)."""
        p = self.params
        if p.adjusts:
            logits = self._adjusted(logits)
        if p.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)  # [V]
        if 0 < p.top_k < probs.shape[-1]:
            kth = probs.topk(p.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros(()))
        if p.min_p > 0:
            probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros(()))
        if p.top_k > 0 or p.min_p > 0:
            probs = probs / probs.sum()
        if p.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # the smallest prefix whose mass reaches top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))

    # --- one sequence's part of the decode loop (decode.Batch calls these) ---------------------------------

    @property
    def prompt_logprobs(self) -> bool:
        """Whether the prompt's own tokens are scored (echo with logprobs): the prefill then keeps every position."""
        return self.params.echo and self.params.logprobs is not None

    def _begin(self) -> None:
        p = self.params
        self._stops, self._eos = list(p.stop), set() if p.ignore_eos else eos_ids(self.model, self.tokenizer)
        self._gen = None
        if p.temperature > 0:
            device = self.model.get_input_embeddings().weight.device
            self._gen = torch.Generator(device=device)
            self._gen.manual_seed(p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        # no tokenizer (the benchmarks' passes): token ids only, no text
        self._detok = _Detok(self.tokenizer) if self.tokenizer is not None else None
        self._shown, self._cut = 0, False
        self.t_start = time.perf_counter()

    def _score_prompt(self, logits: torch.Tensor) -> None:
        """Logprobs of the prompt's tokens 1.. from the prefill's logits `[prompt, V]` (the first has none)."""
        self.prompt_scores = [(self.prompt_ids[0], None, None)] + _logprob_rows(
            logits[:-1], self.prompt_ids[1:], self.params.logprobs or 0)

    def _accept(self, logits: torch.Tensor) -> str:
        """The next token from `logits [V]` (the model's, before any penalty); returns the text to show now and
        sets `finish_reason` when this sequence is done."""
        p = self.params
        tok = self._next_token(logits, self._gen)
        if p.logprobs is not None:  # of the model's distribution (before penalties and temperature), as vLLM
            self.token_scores += _logprob_rows(logits[None], [tok], p.logprobs)
        self.token_times.append(time.perf_counter())
        if self.engine is not None and self._stats0 is None:
            self._stats0 = copy.copy(self.engine.stats)
        if tok in self._eos:
            self.finish_reason = "stop"
            return ""
        self.completion_ids.append(tok)
        self.completion_next = tok
        piece = self._add(self._detok.push(tok), self._stops) if self._detok is not None else ""
        if self.finish_reason is None and len(self.completion_ids) >= p.max_tokens:
            self.finish_reason = "length"
        return piece

    def _end(self) -> str:
        """The tail held back for UTF-8 or a stop prefix (nothing when cancelled); the engine's counters closed."""
        piece = ""
        if self.finish_reason != "cancelled" and not self._cut and self._detok is not None:
            piece = self._add(self._detok.push(None), self._stops, final=True)
        if self.engine is not None:
            self._stats1 = copy.copy(self.engine.stats)
        return piece

    def __iter__(self):
        """Decode alone (a batch of one), yielding text as it comes; the `cancel` event stops it at the next token."""
        batch = Batch(self.model)
        if self.cancel.is_set():
            self._begin()
            self.finish_reason = "cancelled"
            self._end()
            return
        yield from batch.admit(self)
        while self.finish_reason is None:
            if self.cancel.is_set():
                batch.cancel([self])
                break
            for _, piece in batch.step():
                if piece:
                    yield piece

    def _add(self, new: str, stops: list[str], final: bool = False) -> str:
        """Append decoded text; cut it at the first stop string; return what may be shown now (not a suffix
        that could still turn into a stop string, unless `final`)."""
        self.text += new
        cut = min((i for i in (self.text.find(s, self._shown) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.finish_reason, self._cut = "stop", True
            end = cut
        else:
            end = len(self.text) - (0 if final else _held_back(self.text, stops))
        piece = self.text[self._shown:end] if end > self._shown else ""
        self._shown = max(self._shown, end)
        return piece

    @property
    def stats(self):
        """The engine's counters over the decode steps (None without an engine, before the first token, or when
        other requests shared the batch: the counters then belong to all of them; /metrics has the totals)."""
        if self._stats0 is None or self._stats1 is None or self.shared:
            return None
        return self._stats1 - self._stats0

    def summary(self) -> dict:
        """tokens, tokens/s over decode (prefill excluded), TPOT, and the engine's figures per decoded token."""
        t = self.token_times
        decode_s = t[-1] - t[0] if len(t) > 1 else 0.0
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "finish_reason": self.finish_reason,
               "prefill_s": (t[0] - self.t_start) if t else None,
               "decode_tokens_per_s": (len(t) - 1) / decode_s if decode_s > 0 else None,
               "tpot_s": decode_s / (len(t) - 1) if len(t) > 1 else None}
        s = self.stats
        if s is not None:
            d = s.per_token(self.engine.traffic_expert_bytes, max(len(t) - 1, 1))
            out.update(hit_rate=d["hit_rate"] if s.accesses else None,
                       adjusted_hit_rate=d["adjusted_hit_rate"] if s.accesses else None,
                       bytes_moved_per_token=d["bytes_moved_per_token"], stall_per_token_s=d["stall_per_token_s"])
        return out


def summary_line(summary: dict, engine=None) -> str:
    """One line for people: `32 tokens, 41.2 tok/s, hit rate 0.81 (adjusted 0.66), 12.0 KiB moved/token`."""
    parts = [f"{summary['completion_tokens']} tokens"]
    tps = summary.get("decode_tokens_per_s")
    parts.append(f"{tps:.1f} tok/s" if tps else "- tok/s")
    if engine is None:
        parts.append("plain model (every expert in memory)")
    else:
        hr = summary.get("hit_rate")
        parts.append(f"hit rate {hr:.2f} (adjusted {summary['adjusted_hit_rate']:.2f})" if hr is not None
                     else "hit rate -")
        parts.append(f"{_human_bytes(summary.get('bytes_moved_per_token', 0))} moved/token")
        d = engine.describe()
        auto = " (auto)" if str(d.get("tier_choice") or "").startswith("auto") else ""
        parts.append(f"tier {d.get('tier', engine.cfg.tier)}{auto}, {engine.capacity}/{engine.adapter.num_experts} "
                     f"experts resident per layer")
        if str(d.get("integrity", "")).startswith("unverified"):
            parts.append(d["integrity"])
    return "[" + ", ".join(parts) + "]"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


# --- the terminal ----------------------------------------------------------------------------------------------

def print_stream(model, tokenizer, prompt_ids: list[int], params: SamplingParams, out, err) -> Generation:
    """Decode `prompt_ids`, writing the text to `out` as it comes and then the summary line to `err`."""
    g = Generation(model, tokenizer, prompt_ids, params)
    for piece in g:
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    err.write(summary_line(g.summary(), g.engine) + "\n")
    err.flush()
    return g


def generate_text(model, tokenizer, prompt: str | None, params: SamplingParams, chat: bool = False,
                  raw: bool = False, out=None, err=None, read=input) -> int:
    """`expertcache generate`: one prompt (through the chat template unless `raw` or the tokenizer has none), or
    with `chat` an interactive loop that keeps the conversation (`read` gives each user turn; EOF, an empty line
    or /exit ends it)."""
    import sys

    out, err = out or sys.stdout, err or sys.stderr
    templated = bool(getattr(tokenizer, "chat_template", None)) and not raw
    if not chat:
        if prompt is None:
            raise InputError("generate needs a prompt (or --chat for an interactive loop)")
        text, _ = user_prompt(tokenizer, prompt, raw)
        print_stream(model, tokenizer, encode(tokenizer, text, templated), params, out, err)
        return 0
    if not templated:  # the plain transcript: a base model would go on to write the user's next turn
        params = SamplingParams(**{**params.__dict__, "stop": [*params.stop, "\nuser:"]})
    messages = []
    if prompt:
        messages.append({"role": "system", "content": prompt})
    while True:
        try:
            user = read("> ")
        except EOFError:
            break
        if not user.strip() or user.strip() == "/exit":
            break
        messages.append({"role": "user", "content": user})
        text = chat_prompt(tokenizer, messages)
        g = print_stream(model, tokenizer, encode(tokenizer, text, templated=templated), params, out, err)
        messages.append({"role": "assistant", "content": g.text})
    return 0


def generate_many(model, tokenizer, prompts: list[str], params: SamplingParams, max_batch: int = 8,
                  templated: bool = False, on_done=None) -> tuple[list[Generation], float]:
    """Decode every prompt through the one decode loop, up to `max_batch` sequences together: a finished one leaves
    the batch and the next prompt joins it (continuous batching, as `serve`). `on_done(i, generation)` as each
    finishes. Returns the generations in prompt order and the wall time."""
    gens = [Generation(model, tokenizer, encode(tokenizer, p, templated), copy.copy(params)) for p in prompts]
    batch, queue, t0 = Batch(model, max_batch), list(range(len(gens))), time.perf_counter()
    index = {id(g): i for i, g in enumerate(gens)}
    while queue or len(batch):
        while queue and batch.can_join():
            g = gens[queue.pop(0)]
            batch.admit(g)
            if g.finish_reason is not None and on_done:
                on_done(index[id(g)], g)
        for g, _ in batch.step():
            if g.finish_reason is not None and on_done:
                on_done(index[id(g)], g)
    return gens, time.perf_counter() - t0


@torch.no_grad()
def timed_greedy(model, prompt: torch.Tensor, n_new: int, engine=None, warmup: int = 0, at_mark=None):
    """The benchmarks' pass: `prompt [1, L]` decoded greedily for exactly `n_new` tokens through the decode loop
    (no detokenization). Returns (perf_counter at each new token, output ids `[1, L + n_new]`, the engine's
    counters over the decode steps after the first `warmup` ones, the steps between `times[warmup]` and `times[-1]`
    (None without an engine; `engine`: one not attached as `model.expertcache`)). `at_mark()`, when given, is
    called at `times[warmup]`, where the timed steps begin (a benchmark reads its own counters there)."""
    import copy

    g = Generation(model, None, prompt[0].tolist(), SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))
    if engine is not None:
        g.engine = engine
    batch = Batch(model)
    batch.admit(g)
    mark = None  # the engine's counters at times[warmup]
    marked = False
    while g.finish_reason is None:
        batch.step()
        if not marked and len(g.token_times) > warmup:
            marked = True
            if warmup and engine is not None:
                mark = copy.copy(engine.stats)
            if at_mark is not None:
                at_mark()
    out = torch.tensor([g.prompt_ids + g.completion_ids], dtype=torch.long, device=prompt.device)
    stats = g.stats
    if mark is not None and stats is not None:
        stats = copy.copy(engine.stats) - mark
    return g.token_times, out, stats
