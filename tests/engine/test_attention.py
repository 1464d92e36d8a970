"""The blockwise attention kernel against a naive full-matrix reference: output and density column sums,
over several row blocks (a triangle mask per block), a prefill after cached tokens, and the scattered
rows of a recompute."""

from __future__ import annotations

import pytest
import torch


def naive_attend(q, pos, keys, vals, scale):
    """q `[n, Hq, D]` at positions `pos`; keys, vals `[Hkv, S, D]` -> (out `[n, Hq D]`, column sums `[S]`)."""
    n, hq, d = q.shape
    g = hq // keys.shape[0]
    k = keys.repeat_interleave(g, 0).double()  # [Hq, S, D]
    v = vals.repeat_interleave(g, 0).double()
    s = (q.transpose(0, 1).double() @ k.transpose(1, 2)) * scale  # [Hq, n, S]
    visible = torch.arange(keys.shape[1]).unsqueeze(0) <= pos.unsqueeze(1)  # [n, S]
    p = s.masked_fill(~visible, float("-inf")).softmax(-1)
    return (p @ v).transpose(0, 1).reshape(n, hq * d), p.sum(dim=(0, 1))


@pytest.mark.parametrize(
    "pos",
    [
        torch.arange(0, 100),  # prefill from the start: 7 blocks of 15 rows, each with a triangle mask
        torch.arange(37, 100),  # prefill after cached tokens
        torch.cat((torch.arange(16, 32), torch.arange(64, 90))),  # recompute of scattered chunks
    ],
    ids=["prefill", "after-cache", "scattered"],
)
def test_blockwise_attention_matches_full_matrix(engine, pos):
    model = engine.model
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(128)
    cache.reserve(100)
    cache.k[0, :, :100] = torch.randn(cfg.n_kv_heads, 100, cfg.head_dim, generator=gen) * 3
    cache.v[0, :, :100] = torch.randn(cfg.n_kv_heads, 100, cfg.head_dim, generator=gen)
    q = torch.randn(len(pos), cfg.n_heads, cfg.head_dim, generator=gen) * 3
    s_all = int(pos[-1]) + 1
    ref_out, ref_col = naive_attend(q, pos, cache.k[0, :, :s_all], cache.v[0, :, :s_all], model.scale)
    density = torch.zeros(128)
    saved = model.engine_cfg.attention_block_rows
    model.engine_cfg.attention_block_rows = 16
    try:
        out = model._attend(0, q, pos, cache, density)
    finally:
        model.engine_cfg.attention_block_rows = saved
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    assert torch.allclose(density[:s_all].double(), ref_col, rtol=1e-5, atol=1e-6)
    assert not density[s_all:].any()
