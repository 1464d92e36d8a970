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


@pytest.mark.parametrize(
    "pos",
    [
        torch.arange(0, 300),  # prefill from the start: many items, every row-tile boundary inside a head group
        torch.arange(120, 300),  # prefill after cached tokens
        torch.cat((torch.arange(16, 48), torch.arange(64, 96), torch.arange(200, 216))),  # scattered chunks
        torch.arange(0, 37),  # rows not a multiple of the 16-row block, keys not of the 16-key tile
        torch.tensor([299]),  # decode: one row against every key (attn_rows)
        torch.arange(290, 300),  # a short turn (attn_rows)
        torch.arange(255, 275),  # 20 rows against many keys (attn_rows)
        torch.tensor([5]),  # one row, fewer keys than a vector
    ],
    ids=["prefill", "after-cache", "scattered", "ragged", "decode", "short", "few-rows", "tiny"],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("build", ["default", "pthreads"])
def test_native_attention_matches_full_matrix(engine, pos, threads, build, monkeypatch):
    """engine/attention.c against the naive reference: output and density column sums, on one thread
    and on two (each thread keeps its own column sums), in the build the engine loads (OpenMP on
    torch's team here) and in the POSIX-threads build used where -fopenmp is not available."""
    import ctypes
    from pathlib import Path

    import engine.model as em
    from engine import native
    from engine.threads import torch_uses_gnu_openmp

    model = engine.model
    cfg = model.cfg
    lib = em.attention_kernel()
    assert lib is not None, "engine/attention.c did not build here (see the RuntimeWarning)"
    if build == "default":
        assert lib.attn_openmp() == int(torch_uses_gnu_openmp())
    else:
        source = Path(em.__file__).with_name("attention.c")
        lib = em.declare_attention(ctypes.CDLL(str(native.build("attention", source, native._compiler(), native.FAST_FLAGS))))
        assert lib.attn_openmp() == 0
        monkeypatch.setattr(em, "_ATTENTION", [lib])
    gen = torch.Generator().manual_seed(1)
    cache = model.new_cache(320)
    cache.reserve(300)
    cache.k[2, :, :300] = torch.randn(cfg.n_kv_heads, 300, cfg.head_dim, generator=gen) * 3
    cache.v[2, :, :300] = torch.randn(cfg.n_kv_heads, 300, cfg.head_dim, generator=gen)
    qk = torch.randn(len(pos), cfg.n_heads + cfg.n_kv_heads, cfg.head_dim, generator=gen) * 3
    q = qk[:, : cfg.n_heads]  # a view with the K heads beside it, as the layer passes it
    s_all = int(pos[-1]) + 1
    ref_out, ref_col = naive_attend(q, pos, cache.k[2, :, :s_all], cache.v[2, :, :s_all], model.scale)
    density = torch.full((320,), 0.5)  # the kernel adds into what is there
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = model._attend_native(2, q, pos, cache, density)
    finally:
        torch.set_num_threads(saved)
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    assert torch.allclose(density[:s_all].double() - 0.5, ref_col, rtol=1e-5, atol=1e-5)
    assert (density[s_all:] == 0.5).all()


def test_prefill_and_decode_take_their_native_kernels(engine, monkeypatch):
    """On the CPU in float32 every row goes to a compiled kernel: 16 rows or more to attn_forward (also
    against many keys); fewer (decode, short turns) to attn_rows."""
    import engine.model as em

    model = engine.model
    lib = em.attention_kernel()
    calls = []

    class Recorder:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            return lambda *a: (calls.append(name), fn(*a))[1]

    monkeypatch.setattr(em, "_ATTENTION", [Recorder()])
    cache = model.new_cache(1024)
    cache.reserve(1000)
    q = torch.randn(64, model.cfg.n_heads, model.cfg.head_dim)
    for rows, pos in [(64, torch.arange(64)), (1, torch.arange(500, 501)), (20, torch.arange(980, 1000))]:
        assert model.compiled_attention
        model._attend_native(0, q[:rows].contiguous(), pos, cache, None)
    assert calls == ["attn_forward", "attn_rows", "attn_forward"]
