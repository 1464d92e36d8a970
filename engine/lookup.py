"""Draft tokens for lookup decoding: the tokens that followed the reply's last few tokens where they
occurred before in the context (its prompt, passages and earlier turns). Plain numpy; this module
deliberately knows nothing about the model, the tokenizer or the cache.

Replies copy spans of their prompt (a name, a sentence of a retrieved passage, a line of code), so the
tokens that followed the same few tokens earlier are a cheap guess at what comes next; the engine
checks a whole guess in one pass of the model and keeps the part that greedy decoding would have
produced (`engine.context.ContextEngine`, `EngineConfig.lookup_draft`). This is llama.cpp's lookup
decoding and the prompt lookup of transformers' `generate`; a guess that is wrong costs one pass
of a few rows instead of one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_NGRAM = 3
"""Longest suffix of the sequence looked up; shorter ones are tried when it does not occur."""
MIN_NGRAM = 2
"""Shortest suffix looked up: a single token occurs too often to predict what follows it."""


@dataclass(slots=True)
class LookupStats:
    """What lookup decoding did, summed over calls."""

    passes: int = 0
    """Passes of the model that checked a guess."""
    guessed: int = 0
    """Tokens guessed."""
    kept: int = 0
    """Guessed tokens that greedy decoding chose, each a pass of the model saved."""


def draft(ids: Sequence[int], n_tokens: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to `n_tokens` tokens that followed the longest suffix of `ids` (at most `max_ngram` tokens,
    at least `min_ngram`) at its latest earlier occurrence in `ids`; [] when it has none."""
    if n_tokens <= 0 or len(ids) < min_ngram:
        return []
    seq = np.asarray(ids, dtype=np.int64)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        found = _follows(seq, seq[-n:], n_tokens)
        if found:
            return found
    return []


def _follows(seq: np.ndarray, tail: np.ndarray, n_tokens: int) -> list[int]:
    """The tokens after the latest occurrence of `tail` in `seq` that has any after it (so never a
    suffix of `seq`: the sequence's own tail is not a guess)."""
    n = len(tail)
    if len(seq) <= n:
        return []
    hits = np.flatnonzero(seq[: len(seq) - n] == tail[0])  # starts with a token after the n-gram
    for j in range(1, n):
        if len(hits) == 0:
            return []
        hits = hits[seq[hits + j] == tail[j]]
    if len(hits) == 0:
        return []
    at = int(hits[-1]) + n
    return seq[at : at + n_tokens].tolist()
