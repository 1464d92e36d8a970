"""Next-token choice: greedy, temperature, top-p, seeded, repetition penalties; plus the checks that end
a reply.

Pure functions over a logits vector and the reply's text (stop strings), and one reply's penalty counts
(`Penalties`); the engine owns the loop.
This module deliberately knows nothing about the model, the tokenizer or contexts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_STOP_STRINGS = 16


class BadRequestError(ValueError):
    """A caller passed an invalid argument; `code` is stable for the HTTP edge."""

    code = "invalid_request"


GREEDY_BELOW = 1e-6
"""Temperatures under this are greedy: dividing logits by less overflows float32 for no change in the
choice (at 1e-6 the best token already takes all the mass)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    """Most tokens to generate in one reply."""
    temperature: float = 0.0
    """Under `GREEDY_BELOW` (0 included) greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    seed: int | None = None
    """Seed for sampling; None draws from the OS."""
    stop: tuple[str, ...] = ()
    """Strings that end the reply; the reply text excludes them."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once for every time the reply has produced it so far;
    in [-2, 2]."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token the reply has produced so far; in [-2, 2]."""
    repetition_penalty: float = 1.0
    """The multiplicative penalty of CTRL (Keskar et al., 2019) as transformers and vLLM apply it: the
    logit of every token in the context or the reply so far is divided by it where positive and
    multiplied by it where negative; 1 is off, above 1 discourages repeats; in (0, 10]."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise BadRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise BadRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise BadRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise BadRequestError(f"seed must be a non-negative integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stop):
            raise BadRequestError(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings")
        object.__setattr__(self, "stop", stop)
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                raise BadRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < float(self.repetition_penalty) <= 10.0:
            raise BadRequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")

    @property
    def penalized(self) -> bool:
        """Whether any repetition penalty changes the logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self, device) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Choose one token id from `logits` `[V]`."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly better tokens
        sorted_p[before >= params.top_p] = 0.0  # keeps the token that crosses top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


class Penalties:
    """The repetition penalties of one reply (`SamplingParams.frequency_penalty`, `presence_penalty`,
    `repetition_penalty`), applied to each step's logits before the choice (and before the temperature,
    as vLLM orders them). Counts the reply's tokens as they are chosen; `remove` takes back a token
    counted for a guess that was not kept (lookup decoding)."""

    __slots__ = ("params", "counts", "context")

    def __init__(self, params: SamplingParams, context_ids: list[int], vocab_size: int, device) -> None:
        self.params = params
        self.counts = torch.zeros(vocab_size, device=device)
        """Times the reply produced each token so far."""
        self.context = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        """Tokens of the context before the reply (the repetition penalty's prompt)."""
        if params.repetition_penalty != 1.0 and context_ids:
            self.context[torch.tensor(context_ids, device=device)] = True

    def add(self, token: int) -> None:
        self.counts[token] += 1

    def remove(self, token: int) -> None:
        self.counts[token] -= 1

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` `[V]` penalized (a new float32 tensor)."""
        p, out = self.params, logits.float().clone()
        produced = self.counts > 0
        if p.repetition_penalty != 1.0:
            seen = self.context | produced
            hit = out[seen]
            out[seen] = torch.where(hit > 0, hit / p.repetition_penalty, hit * p.repetition_penalty)
        if p.frequency_penalty:
            out.sub_(self.counts * p.frequency_penalty)
        if p.presence_penalty:
            out.sub_(produced.float() * p.presence_penalty)
        return out


def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index where the earliest stop string begins in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def holdback(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` to withhold from a stream: the longest suffix that could
    begin a stop string, and an incomplete UTF-8 sequence (decoded as U+FFFD)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if s.startswith(text[-k:]):
                n = max(n, k)
                break
    if text.endswith("\ufffd"):
        n = max(n, len(text) - len(text.rstrip("\ufffd")))
    return n
