"""Contexts (LLMS Table 1): multi-turn calls, incremental prefill, overflow, information density."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.context import ContextEngine, PromptTooLongError, UnknownContextError
from engine.sampling import BadRequestError
from tests.engine.test_parity import check_logits

TURNS = ["Hello! Please name a color.", "Now name a fruit of that color.", "Say both again, in one line."]


def test_three_calls_match_template_and_transformers(engine, hf_model):
    ctx = engine.new_ctx("You are a helpful assistant.")
    for i, prompt in enumerate(TURNS):
        pending_before = len(ctx.token_ids) - ctx.cache.length
        computed_before = ctx.prefilled_tokens
        r = engine.call(ctx, prompt, max_tokens=24)
        assert r.text and r.completion_tokens == len(r.token_ids) <= 24
        # only the new tokens were prefilled: pending ids plus the new user turn
        assert r.prefilled_tokens == pending_before + r.prompt_tokens
        assert r.cached_tokens == ctx.cache.length - r.prefilled_tokens - (r.completion_tokens - 1)
        assert ctx.prefilled_tokens - computed_before == r.prefilled_tokens + r.completion_tokens - 1
        if i == 0:
            assert r.cached_tokens == 0
        else:
            assert r.cached_tokens > 0 and r.prefilled_tokens < len(ctx.token_ids) // 2
    expected = engine.tok.conversation_ids(ctx.conv)
    assert ctx.token_ids == expected
    seq = ctx.token_ids
    with torch.inference_mode():
        ref = hf_model(torch.tensor([seq], device=engine.model.device)).logits[0].float()
    got = engine.model.forward(engine.model.new_cache(len(seq)), seq, all_logits=True)
    check_logits(got, ref, seq, hf_model, "three calls")
    # the context's own KV equals a fresh prefill of the same ids
    fresh = engine.model.new_cache(len(seq))
    engine.model.forward(fresh, seq[: ctx.cache.length])
    assert (fresh.k[:, :, : ctx.cache.length] - ctx.cache.k[:, :, : ctx.cache.length]).abs().max() < 1e-4
    engine.delete_ctx(ctx)
    with pytest.raises(UnknownContextError):
        engine.get(ctx.id)


def test_greedy_call_is_deterministic_and_sampling_is_seeded(engine):
    a, b = engine.new_ctx(), engine.new_ctx()
    assert engine.call(a, "Tell me a fact about owls.", max_tokens=12).token_ids == engine.call(
        b, "Tell me a fact about owls.", max_tokens=12
    ).token_ids
    runs = [
        engine.call(engine.new_ctx(), "Invent a word.", max_tokens=10, temperature=1.2, top_p=0.95, seed=s).token_ids
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stop_strings_max_tokens_and_streaming(engine):
    ctx = engine.new_ctx()
    full = engine.call(engine.new_ctx(), "Count from 1 to 20, separated by commas.", max_tokens=40)
    assert "5" in full.text
    stream = engine.stream(ctx, "Count from 1 to 20, separated by commas.", max_tokens=40, stop=["5"])
    deltas = list(stream)
    r = stream.result
    assert "".join(deltas) == r.text
    assert r.finish_reason == "stop" and "5" not in r.text
    assert full.text.startswith(r.text)
    short = engine.call(engine.new_ctx(), "Write a long story.", max_tokens=3)
    assert short.finish_reason == "length" and short.completion_tokens == 3


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 0},
        {"max_tokens": -5},
        {"max_tokens": 2.5},
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"seed": -1},
        {"stop": [""]},
    ],
)
def test_bad_parameters_are_rejected_before_anything_changes(engine, params):
    ctx = engine.new_ctx()
    before = list(ctx.token_ids)
    with pytest.raises(BadRequestError):
        engine.stream(ctx, "hi", **params)
    assert ctx.token_ids == before and not ctx.conv.turns


def test_overflow_keeps_sink_and_newest_chunks(resolved_model, engine):
    small = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=128))
    ctx = small.new_ctx()
    prompts = ["Describe the ocean in detail.", "Describe mountains in detail.", "Describe deserts in detail."]
    sink = None
    dropped = 0
    for p in prompts:
        r = small.call(ctx, p, max_tokens=40)
        sink = sink or ctx.token_ids[:16]
        assert ctx.cache.length <= 128
        # the reply says what the model saw and what the overflow rule cut
        assert r.context_tokens == r.cached_tokens + r.prefilled_tokens <= 128
        dropped += r.dropped_tokens
    assert ctx.overflows >= 1 and dropped == ctx.dropped_tokens > 0
    # after overflow the first chunk is still the context's original first chunk (the attention sink)
    assert ctx.token_ids[:16] == sink
    assert len(ctx.token_ids) <= 128
    # the kept sequence's KV equals a fresh prefill of the same ids (positions consistent)
    n = ctx.cache.length
    fresh = engine.model.new_cache(n)
    engine.model.forward(fresh, ctx.token_ids[:n])
    assert (fresh.k[:, :, :n] - ctx.cache.k[:, :, :n]).abs().max() < 1e-4
    # and recompute of chunks there stays exact
    k0 = ctx.cache.k[:, :, :n].clone()
    for i in (0, 2):
        ctx.cache.drop_chunk(i)
    engine.model.recompute(ctx.cache, ctx.token_ids, [0, 2])
    assert (ctx.cache.k[:, :, :n] - k0).abs().max() < 1e-4
    with pytest.raises(PromptTooLongError):
        small.stream(ctx, "word " * 200)


def test_a_turn_longer_than_what_overflow_keeps_is_kept_whole(engine):
    """A new turn may take the limit less three chunks: overflow then keeps the sink and the whole turn
    (older turns go, and the reply says how many tokens), and the K/V is a fresh prefill's; one token
    more is refused before anything changes."""
    limit = 256
    small = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=limit))
    ctx = small.new_ctx("Be brief.")
    small.call(ctx, "Name a colour.", max_tokens=6)
    small.call(ctx, "Describe the ocean in detail.", max_tokens=48)
    sink = ctx.token_ids[:16]
    words = 150
    while len(small.tok.user_turn_ids(ctx.conv, "word " * (words + 1))) + 1 <= small.tail_room():
        words += 1
    prompt = "word " * words
    turn = small.tok.user_turn_ids(ctx.conv, prompt)
    assert int(limit * 0.75) - 16 < len(turn) <= small.tail_room() == limit - 48  # past the old 75% rule
    assert len(ctx.token_ids) + len(turn) > limit  # so the call overflows
    before = list(ctx.token_ids)
    with pytest.raises(PromptTooLongError):
        small.stream(ctx, "word " * (words + 1))
    assert ctx.token_ids == before
    r = small.call(ctx, prompt, max_tokens=4)
    assert r.dropped_tokens > 0 and ctx.token_ids[:16] == sink
    kept = ctx.token_ids
    at = next(i for i in range(16, len(kept)) if kept[i : i + len(turn)] == turn)  # the whole turn, in order
    assert at - 16 < 16 + 8  # before it at most a chunk of older ids and the last reply's closing ids
    n = ctx.cache.length
    fresh = engine.model.new_cache(n)
    engine.model.forward(fresh, kept[:n])
    assert (fresh.k[:, :, :n] - ctx.cache.k[:, :, :n]).abs().max() < 1e-4


def test_overflow_tail_selection(engine):
    small = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=64))
    ctx = small.new_ctx()
    ctx.token_ids = list(range(1000, 1070))  # 70 ids, over the limit of 64
    small._overflow(ctx)
    # first chunk + newest whole chunks, at most 75% of the limit (48 tokens)
    assert ctx.token_ids[:16] == list(range(1000, 1016))
    assert ctx.token_ids[16:] == list(range(1048, 1070))
    assert len(ctx.token_ids) <= 48


def naive_density(hf_eager, seq, n_heads, n_layers):
    """Eq. 1 with full attention matrices: mean over rows >= col, heads and layers."""
    with torch.inference_mode():
        att = hf_eager(torch.tensor([seq]), output_attentions=True).attentions  # L x [1, H, S, S]
    a = torch.stack([x[0].double() for x in att])  # [L, H, S, S]
    col = a.sum(dim=(0, 1, 2))  # summed over layers, heads, rows
    s = len(seq)
    rows = torch.arange(s, 0, -1, dtype=torch.float64)  # rows at or after each column
    return (col / rows / (n_heads * n_layers)).numpy()


def test_density_matches_naive_full_matrix(resolved_model, engine):
    from transformers import AutoModelForCausalLM

    hf_eager = AutoModelForCausalLM.from_pretrained(
        str(resolved_model.directory), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ctx = engine.new_ctx()
    engine.call(ctx, "Explain what a hash table is.", max_tokens=8)
    engine.call(ctx, "And a linked list?", max_tokens=8)  # density is a running sum across calls
    n = ctx.cache.length
    assert len(ctx.density) == n
    ref = naive_density(hf_eager, ctx.token_ids[:n], engine.model.cfg.n_heads, engine.model.cfg.n_layers)
    got = ctx.density.token_density()
    assert np.allclose(got, ref, rtol=1e-4, atol=1e-6), np.abs(got - ref).max()
    chunks = ctx.density.chunk_density(16)
    assert np.allclose(chunks[0], ref[:16].mean()) and len(chunks) == -(-n // 16)
    # recompute never updates density
    before = ctx.density.sums.copy()
    ctx.cache.drop_chunk(1)
    engine.model.recompute(ctx.cache, ctx.token_ids, [1])
    assert np.array_equal(ctx.density.sums, before)


def test_abandoned_stream_leaves_the_context_as_it_was(engine):
    ctx = engine.new_ctx()
    engine.call(ctx, "Name a bird.", max_tokens=8)
    before = (list(ctx.token_ids), len(ctx.conv.turns), ctx.cache.length, ctx.density.sums.copy())
    stream = iter(engine.stream(ctx, "Write a long poem about the sea.", max_tokens=50))
    next(stream)
    next(stream)
    stream.close()  # the client went away mid-reply
    assert ctx.token_ids == before[0] and len(ctx.conv.turns) == before[1]
    assert ctx.cache.length == before[2] and np.array_equal(ctx.density.sums, before[3])
    # the context still works and gives what an undisturbed twin gives
    twin = engine.new_ctx()
    engine.call(twin, "Name a bird.", max_tokens=8)
    assert engine.call(ctx, "Name a fish.", max_tokens=8).token_ids == engine.call(twin, "Name a fish.", max_tokens=8).token_ids


def test_a_long_prefill_reports_its_progress_when_asked(engine):
    """`stream(..., progress=True)`: a prefill of 128 tokens or more sends one `PrefillProgress` per
    layer before the first text delta; a short one, or a stream not asking, sends none; the reply is
    the same either way."""
    from engine.context import PROGRESS_MIN_TOKENS, PrefillProgress

    long_prompt = "Summarise this: " + " ".join(f"item {i}," for i in range(80))
    replies = {}
    for progress in (True, False):
        ctx = engine.new_ctx()
        items = list(engine.stream(ctx, long_prompt, progress=progress, max_tokens=6))
        marks = [i for i in items if isinstance(i, PrefillProgress)]
        first_text = next(k for k, i in enumerate(items) if isinstance(i, str))
        replies[progress] = "".join(i for i in items if isinstance(i, str))
        if progress:
            n = engine.model.cfg.n_layers
            assert [m.layers_done for m in marks] == list(range(1, n + 1)) and marks[0].layers == n
            assert marks[0].tokens >= PROGRESS_MIN_TOKENS and first_text == n  # all before the first delta
            short = list(engine.stream(ctx, "And now?", progress=True, max_tokens=4))
            assert not any(isinstance(i, PrefillProgress) for i in short)
            # a stream closed halfway through a prefill leaves the context as it was
            ids, length = list(ctx.token_ids), ctx.cache.length
            stream = iter(engine.stream(ctx, long_prompt, progress=True, max_tokens=4))
            assert isinstance(next(stream), PrefillProgress) and ctx.cache.length > length
            stream.close()
            assert ctx.token_ids == ids and ctx.cache.length == length
        else:
            assert not marks
        engine.delete_ctx(ctx)
    assert replies[True] == replies[False]
