"""RAG prompts from token ids, and calls that start from K/V computed in another call (engine.rag)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.rag import RagTemplate, put_span, span_kv
from engine.sampling import SamplingParams

PASSAGES = [
    "The Eiffel Tower in Paris was finished in 1889 for the World's Fair.",
    "Mount Fuji is the highest mountain in Japan, at 3,776 metres.",
    "The Nile flows north through eleven countries into the Mediterranean Sea.",
]


def _run(engine, ctx, max_tokens=16):
    stream = engine.generate(ctx, SamplingParams(max_tokens=max_tokens))
    for _ in stream:
        pass
    return stream.result


def test_a_prompt_is_its_head_then_each_passage_then_the_question(engine):
    t = RagTemplate(engine.tok)
    passages = [engine.tok.encode(p) for p in PASSAGES]
    pr = t.build(passages, "How tall is Mount Fuji?")
    assert pr.ids[:pr.head] == t.head_ids and pr.spans[0][0] == pr.head
    for (a, b), p in zip(pr.spans, passages):  # a passage's ids are its own, then the separator
        assert pr.ids[a:b] == p + t.separator_ids
    assert all(pr.spans[i][1] == pr.spans[i + 1][0] for i in range(len(pr.spans) - 1))
    text = engine.tok.decode(pr.ids)
    assert text.index("Eiffel") < text.index("Fuji") < text.index("Nile") < text.index("How tall")
    assert engine.tok.decode(pr.ids[pr.question:]).startswith("Question: How tall is Mount Fuji?")
    with pytest.raises(ValueError):
        t.build(passages, "  ")


def test_a_call_from_reused_passage_kv_equals_the_prompt_prefilled_whole(engine):
    """K/V of the head and the first passages, taken from one call, let another call over the same
    prefix prefill only the rest; the reply is token for token the one of a whole prefill."""
    t = RagTemplate(engine.tok)
    passages = [engine.tok.encode(p) for p in PASSAGES]
    first = t.build(passages, "When was the Eiffel Tower finished?")
    ctx = engine.throwaway(first.ids, 16)
    _run(engine, ctx)
    head = span_kv(ctx.cache, 0, first.head)
    nodes = [span_kv(ctx.cache, a, b) for a, b in first.spans]

    second = t.build(passages[:2] + [engine.tok.encode("Rivers are long.")], "How tall is Mount Fuji?")
    whole = _run(engine, engine.throwaway(second.ids, 16))
    assert whole.cached_tokens == 0
    reused = engine.throwaway(second.ids, 16)
    put_span(reused.cache, 0, head)
    for (a, _b), kv in zip(second.spans[:2], nodes[:2]):
        put_span(reused.cache, a, kv)
    got = _run(engine, reused)
    assert got.token_ids == whole.token_ids
    assert got.cached_tokens == second.spans[1][1] and got.prefilled_tokens == len(second.ids) - second.spans[1][1]


def test_put_span_refuses_kv_that_does_not_fit(engine):
    ctx = engine.throwaway(list(range(40)), 0)
    kv = np.zeros((engine.model.cfg.n_layers, 2, engine.model.cfg.n_kv_heads, 8, engine.model.cfg.head_dim),
                  np.float32)
    with pytest.raises(ValueError):
        put_span(ctx.cache, 8, kv)  # not the next slot
    with pytest.raises(ValueError):
        put_span(ctx.cache, 0, kv[:, :, :, :, :3])  # wrong head dim: nothing taken
    assert ctx.cache.length == 0
    put_span(ctx.cache, 0, kv)
    assert ctx.cache.length == 8 and np.array_equal(span_kv(ctx.cache, 0, 8), kv)
