"""Retrieval-augmented prompts assembled from token ids, and calls that start from K/V computed before.

This module deliberately knows nothing about trees, files or Ray: `RagTemplate.build` gives the ids and
the span of each passage; `put_span` and `span_kv` move K/V between a working set's slots and arrays;
the call is `ContextEngine.generate` on a `ContextEngine.throwaway` context whose first slots were filled.

A RAG prompt is the chat template around a fixed system prompt and one user turn that holds the
retrieved passages, in retrieval order, then the question. It is assembled from token ids, not from
one string tokenized whole: the head (system turn and the user turn's opening), each passage's own ids
(as the knowledge bank stored them) followed by a separator, then the question and the template's
tail. So a passage's ids are the same in every prompt that retrieves it, and its K/V depends only on
what comes before it: the K/V tree (PerCache §4.1.1) keys a node by that path and reuses it exactly.

A passage cached after another prefix can be reused approximately (CacheBlend; `RagConfig.blend_ratio`):
`shift_span` moves its K/V to this prompt's slots (keys turned by RoPE), and `blend_rows` recomputes
the first share of its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.chat import SENTINEL, ChatTokenizer
from engine.kvcache import KVCache
from engine.model import apply_rope, rope_angles

RAG_SYSTEM_PROMPT = ("Answer the question using the passages below. If they do not hold the answer, "
                     "say so in one sentence.")
"""The system turn of every RAG prompt (fixed: the head's K/V is the same for every query)."""
PASSAGES_OPENING = "Passages:\n\n"
"""What the user turn starts with, before the first passage."""
SEPARATOR = "\n\n"
"""What follows each passage (part of its span, so spans tile the prompt)."""
QUESTION_OPENING = "Question: "


@dataclass(frozen=True, slots=True)
class RagPrompt:
    """A RAG prompt's ids and where each passage lies in them."""

    ids: list[int]
    """Every id of the prompt, up to and including the assistant header."""
    head: int
    """Ids before the first passage: the system turn and the user turn's opening."""
    spans: list[tuple[int, int]]
    """`[start, end)` of each passage (its ids and the separator after it), in retrieval order; they
    tile `[head, question)` with no gap."""

    @property
    def question(self) -> int:
        """Where the question (and the template's tail) starts."""
        return self.spans[-1][1] if self.spans else self.head


class RagTemplate:
    """Builds RAG prompts for one tokenizer and system prompt."""

    def __init__(self, tok: ChatTokenizer, system_prompt: str = RAG_SYSTEM_PROMPT) -> None:
        text = tok.render([{"role": "system", "content": system_prompt},
                           {"role": "user", "content": SENTINEL}], True)
        before, _, after = text.partition(SENTINEL)
        if SENTINEL in after:
            raise ValueError("the chat template repeats the user turn's content")
        self.tok = tok
        self.system_prompt = system_prompt
        self.head_ids = tok.encode(before + PASSAGES_OPENING)
        """The fixed head: the same ids (and K/V) for every query."""
        self.separator_ids = tok.encode(SEPARATOR)
        self.tail = after
        """The template after the user turn's content, the assistant header included."""

    def build(self, passages: list[list[int]], question: str) -> RagPrompt:
        """The prompt for `question` over `passages` (each a passage's token ids, in retrieval order)."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("the question must be a non-empty string")
        ids = list(self.head_ids)
        spans = []
        for p in passages:
            start = len(ids)
            ids += list(p) + self.separator_ids
            spans.append((start, len(ids)))
        ids += self.tok.encode(QUESTION_OPENING + question + self.tail)
        return RagPrompt(ids, len(self.head_ids), spans)


def span_kv(cache: KVCache, start: int, end: int) -> np.ndarray:
    """A copy of slots `[start, end)` as `[L, 2, Hkv, end - start, D]`, as the working set stores them
    (bfloat16 as uint16 bits, kv8 as its rows): what a chunk record's raw level holds."""
    if not 0 <= start < end <= cache.length:
        raise ValueError(f"slots [{start}, {end}) are not computed (the cache holds {cache.length})")
    v = cache.kv[:, :, :, start:end].detach().to("cpu")
    return (v.view(torch.uint16) if v.dtype == torch.bfloat16 else v).contiguous().numpy().copy()


def put_span(cache: KVCache, start: int, kv: np.ndarray) -> None:
    """Write `kv` (as `span_kv` gives it) into slots `[start, start + T)`, which must be the next ones
    (`cache.length == start`): the cache then holds them as computed."""
    n = kv.shape[3]
    if cache.length != start:
        raise ValueError(f"K/V for slot {start} given while the cache holds {cache.length} slots")
    first = cache.reserve(n)
    t = torch.from_numpy(np.ascontiguousarray(kv))
    if t.dtype == torch.uint16 and cache.kv.dtype == torch.bfloat16:  # bfloat16 bits
        t = t.view(torch.bfloat16)
    view = cache.kv[:, :, :, first:first + n]
    if tuple(t.shape) != tuple(view.shape):
        cache.truncate(start)
        raise ValueError(f"K/V of shape {tuple(t.shape)} does not fit slots of shape {tuple(view.shape)}")
    view.copy_(t.to(view.device))


def shift_keys(cfg, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """Keys `[..., T, D]` of a model of config `cfg` rotated by RoPE as if computed `delta` positions
    later (negative: earlier): rotations compose, so K at position `p + delta` is K at `p` turned by
    `delta`. Values carry no position."""
    cos, sin = rope_angles(cfg, torch.tensor([float(delta)]), keys.device)
    d = keys.shape[-1]
    turned = apply_rope(keys.reshape(-1, 1, d), cos.to(keys.dtype).view(1, 1, d),
                        sin[:, : d // 2].to(keys.dtype).view(1, 1, d // 2))
    return turned.view(keys.shape)


def shift_span(model, kv: np.ndarray, delta: int) -> np.ndarray:
    """A span's float32 K/V (as `span_kv` gives it) moved `delta` slots later (negative: earlier): its
    keys turned (`shift_keys`), its values as they are."""
    if kv.dtype != np.float32:
        raise ValueError(f"only float32 K/V can be moved to other slots, not {kv.dtype}")
    out = kv.copy()
    keys = torch.from_numpy(out[:, 0])  # [L, Hkv, T, D], a view of `out`
    keys.copy_(shift_keys(model.cfg, keys, delta))
    return out


def blend_rows(model, cache: KVCache, ids: list[int], spans: list[tuple[int, int]], ratio: float,
               adapter=None) -> list[int]:
    """CacheBlend's selective recompute over K/V reused from other prompts (`spans`, `[start, end)`,
    placed in the cache): the first `ratio` of each span's tokens are recomputed through every layer
    (`Transformer.recompute_rows`), where a passage meets the text before it. Returns their positions.

    Chosen by measurement (`python -m bench.rag_blend`, docs/benchmarks.md "RAG cache"): against the
    exact prompt's reply, recomputing each passage's first tokens came closest, ahead of CacheBlend's
    tokens of most K/V deviation at layer 1; the tokens of most information density (the attention the
    rest of the prompt pays them, or that the donor's prompt paid) did no better than a random choice."""
    rows = [p for a, b in spans for p in range(a, a + min(b - a, int(np.ceil(ratio * (b - a)))))]
    model.recompute_rows(cache, ids, rows, adapter=adapter)
    return rows
