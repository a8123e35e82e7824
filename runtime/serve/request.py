"""What a request asks for, in the decode loop's terms: its sampling parameters (`SamplingParams`, checked; the
checkpoint's own defaults from `checkpoint_sampling`) and its prompt's token ids (`chat_prompt`, `user_prompt`,
`encode`), for `expertcache generate`, `serve` and the Python API alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from expertcache.telemetry.errors import InputError

MAX_LOGPROBS = 20  # the most alternatives per position a request may ask for (vLLM's default limit)
# the message roles a chat request may carry: OpenAI's (it answers 400 for any other; `function` is its deprecated
# name for `tool`)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# what a chat template must render at start (`check_chat_template`): the turns every template accepts (some refuse
# a system turn, some turns that do not alternate user/assistant)
SAMPLE_CONVERSATION = ({"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."},
                       {"role": "user", "content": "And 3 + 3?"})


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # the text ends before the first occurrence of any of these
    seed: int | None = None
    ignore_eos: bool = False  # decode max_tokens even past an end-of-sequence token (benchmarks, tests)
    top_k: int = 0  # keep the k most likely tokens (0: off)
    min_p: float = 0.0  # keep tokens at least min_p x the most likely one's probability (0: off)
    repetition_penalty: float = 1.0  # > 1: logits of tokens in the prompt or output divided (positive) or multiplied
    presence_penalty: float = 0.0  # subtracted once from each token already in the output (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output (OpenAI's)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    logprobs: int | None = None  # the chosen token's logprob and the n most likely (0: the chosen one only)
    echo: bool = False  # the prompt is part of the output (its logprobs too, when logprobs is set)

    def check(self, vocab_size: int | None = None) -> None:
        least = 0 if self.echo else 1  # echo with max_tokens 0 scores the prompt alone
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < least:
            raise InputError(f"max_tokens={self.max_tokens!r}; expected an integer >= {least}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InputError(f"logprobs={self.logprobs!r}; expected an integer 0..{MAX_LOGPROBS}")
        if not 0 <= self.temperature <= 2:
            raise InputError(f"temperature={self.temperature}; expected 0..2")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p={self.top_p}; expected 0 < top_p <= 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InputError(f"stop={self.stop!r}; expected non-empty strings")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"top_k={self.top_k!r}; expected an integer >= 0 (0: off)")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"min_p={self.min_p}; expected 0..1")
        if not 0 < self.repetition_penalty <= 10:
            raise InputError(f"repetition_penalty={self.repetition_penalty}; expected 0 < r <= 10 (1: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InputError(f"{name}={getattr(self, name)}; expected -2..2")
        for tok, b in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0 or (vocab_size and tok >= vocab_size):
                raise InputError(f"logit_bias names token {tok!r}; expected token ids in [0, {vocab_size or 'vocab'})")
            if not -100 <= b <= 100:
                raise InputError(f"logit_bias[{tok}]={b}; expected -100..100")

    @property
    def adjusts(self) -> bool:
        """Whether anything changes the logits before the choice (penalties, biases)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1 or bool(self.presence_penalty) \
            or bool(self.frequency_penalty)


def checkpoint_sampling(model) -> dict:
    """The sampling defaults the checkpoint's `generation_config.json` sets (only what it sets, not transformers'
    own defaults): `do_sample: false` -> temperature 0 (greedy); else its temperature, top_p, top_k and
    repetition_penalty. Requests and flags that name a value override these."""
    gc = getattr(model, "generation_config", None)
    if gc is None:
        return {}
    try:
        d = gc.to_diff_dict()
    except Exception:  # noqa: BLE001 - an odd config gives no defaults rather than no answer
        return {}
    if d.get("do_sample") is False:
        return {"temperature": 0.0}
    out = {k: d[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")
           if isinstance(d.get(k), (int, float)) and not isinstance(d.get(k), bool)}
    if d.get("do_sample") is not True:  # transformers decodes greedily unless do_sample is set
        out = {"temperature": 0.0} if out else {}
    return out


# --- prompts ---------------------------------------------------------------------------------------------------

def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The tokenizer's chat template (generation prompt added) when it has one; otherwise a plain transcript
    `role: content` per line ending in `assistant:` (base checkpoints such as the quickstart's have no template)."""
    if not messages:
        raise InputError("messages is empty; expected at least one {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"message {m!r}; expected {{'role': str, 'content': str}}")
        if m["role"] not in ROLES:
            raise InputError(f"messages[{i}].role {m['role']!r}; expected one of {', '.join(ROLES)}")
    if getattr(tokenizer, "chat_template", None):
        from jinja2.exceptions import TemplateError

        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as e:  # the template's own refusal (`raise_exception`) of these messages: the request's
            raise InputError(f"the chat template refuses these messages: {' '.join(str(e).split())[:200]}") from None
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def check_chat_template(tokenizer, where: str = "the tokenizer's chat template") -> None:
    """A chat template (`where` names it) that cannot render `SAMPLE_CONVERSATION`, or renders it without the
    user's words, would fail every chat request (HTTP 500): refused once, at start, in one line."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return
    if not isinstance(template, str):
        raise InputError(f"{where} is a {type(template).__name__}; expected one Jinja template")
    try:
        text = tokenizer.apply_chat_template(list(SAMPLE_CONVERSATION), add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - the template is user code: a syntax error, an undefined name, a raise
        raise InputError(f"{where} cannot render a sample conversation (user, assistant, user): "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(text, str) or SAMPLE_CONVERSATION[-1]["content"] not in text:
        raise InputError(f"{where} renders a sample conversation without its last user message "
                         f"({SAMPLE_CONVERSATION[-1]['content']!r}): not a chat template")


def user_prompt(tokenizer, prompt: str, raw: bool = False) -> tuple[str, bool]:
    """(the text to encode, whether it is templated): one user turn through the tokenizer's chat template when it
    has one and `raw` is not asked for; the prompt as it is otherwise."""
    templated = bool(getattr(tokenizer, "chat_template", None)) and not raw
    return (chat_prompt(tokenizer, [{"role": "user", "content": prompt}]) if templated else prompt), templated


def encode(tokenizer, text: str, templated: bool = False) -> list[int]:
    """Token ids of `text`; a chat template already holds its special tokens, so none are added to it."""
    ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
    if not ids:
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos is None:
            raise InputError("the prompt is empty and the tokenizer has no BOS/EOS token to start from")
        ids = [bos]
    return list(ids)


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                model.config.get_text_config().eos_token_id, tokenizer.eos_token_id):
        if src is not None:
            ids.update(src if isinstance(src, (list, tuple)) else [src])
    return ids
