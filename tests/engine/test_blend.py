"""Reusing K/V at other slots (CacheBlend, `RagConfig.blend_ratio`): keys turned by RoPE compose with the
rotation they were computed under, and recomputing every row of a span over K/V given to it gives the
span's prefill; a partial recompute takes the first share of each reused span."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import apply_rope
from engine.rag import blend_rows, put_span, shift_keys, shift_span, span_kv
from tests.conftest import SAMPLE_TEXT


@pytest.mark.parametrize("p, delta", [(5, 37), (200, -150), (0, 0)])
def test_shifted_keys_are_the_keys_rotated_at_the_new_position(engine, p, delta):
    model = engine.model
    x = torch.randn(4, model.cfg.n_kv_heads, model.cfg.head_dim)
    pos = torch.arange(p, p + 4)
    at = apply_rope(x, model.cos[pos].unsqueeze(1), model.sin_half[pos].unsqueeze(1))
    want = apply_rope(x, model.cos[pos + delta].unsqueeze(1), model.sin_half[pos + delta].unsqueeze(1))
    got = shift_keys(model.cfg, at.transpose(0, 1), delta).transpose(0, 1)  # [Hkv, T, D] as the cache holds them
    assert (got - want).abs().max().item() < 1e-4  # float32 angles: about position x 6e-8


def _prefill(model, ids):
    cache = model.new_cache(len(ids) + 32)
    logits = model.forward(cache, ids)
    return cache, logits


def test_recomputing_every_row_of_a_span_gives_its_prefill(engine):
    model = engine.model
    doc = engine.tok.encode_document(SAMPLE_TEXT * 2)
    ids = doc[:90]
    ref, ref_logits = _prefill(model, ids)
    # the span [30, 70) from another prompt: computed after other tokens, at other slots
    other, _ = _prefill(model, doc[100:110] + ids[30:70])
    cache = model.new_cache(len(ids) + 32)
    model.forward(cache, ids[:30])
    moved = shift_span(model, span_kv(other, 10, 50), 20)
    put_span(cache, 30, moved)
    assert not np.allclose(span_kv(cache, 30, 70), span_kv(ref, 30, 70), atol=1e-3)  # approximate as placed
    model.recompute_rows(cache, ids, list(range(30, 70)))
    assert np.abs(span_kv(cache, 30, 70) - span_kv(ref, 30, 70)).max() < 1e-4
    logits = model.forward(cache, ids[70:])
    assert (logits - ref_logits).abs().max().item() < 1e-3


def test_blend_rows_recomputes_the_first_share_of_each_span(engine):
    model = engine.model
    doc = engine.tok.encode_document(SAMPLE_TEXT * 2)
    ids = doc[:80]
    cache, _ = _prefill(model, ids[:64])
    before = span_kv(cache, 16, 64)
    n_rows = model.recomputed_rows
    picked = blend_rows(model, cache, ids, [(16, 40), (40, 64)], 0.2)
    assert picked == [16, 17, 18, 19, 20, 40, 41, 42, 43, 44]  # ceil(0.2 x 24) = 5 of each
    assert cache.length == 64 and model.recomputed_rows == n_rows + 10
    # the prefix was exact, so recomputing its rows changes them only by float rounding
    assert np.abs(span_kv(cache, 16, 64) - before).max() < 1e-4
    assert blend_rows(model, cache, ids, [(16, 64)], 0.0) == []
    with pytest.raises(ValueError, match="ascend"):
        model.recompute_rows(cache, ids, [20, 18])
