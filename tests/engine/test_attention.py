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

    import engine.attention as em
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


class _Recorder:
    """A kernel library whose calls append their function's name to `calls` before running."""

    def __init__(self, lib, calls: list) -> None:
        self.lib, self.calls = lib, calls

    def __getattr__(self, name):
        fn = getattr(self.lib, name)
        return lambda *a: (self.calls.append(name), fn(*a))[1]


def test_prefill_and_decode_take_their_native_kernels(engine, monkeypatch):
    """On the CPU in float32 every row goes to a compiled kernel: 16 rows or more to attn_forward (also
    against many keys); fewer (decode, short turns) to attn_rows."""
    import engine.attention as em

    model = engine.model
    lib = em.attention_kernel()
    calls = []
    monkeypatch.setattr(em, "_ATTENTION", [_Recorder(lib, calls)])
    cache = model.new_cache(1024)
    cache.reserve(1000)
    q = torch.randn(64, model.cfg.n_heads, model.cfg.head_dim)
    for rows, pos in [(64, torch.arange(64)), (1, torch.arange(500, 501)), (20, torch.arange(980, 1000))]:
        assert model.compiled_attention
        model._attend_native(0, q[:rows].contiguous(), pos, cache, None)
    assert calls == ["attn_forward", "attn_rows", "attn_forward"]


def _bf16_modes():
    """(engine/attention_bf16.c, the ways it multiplies here: 1 dot products, 2 AMX tiles) or a skip."""
    import engine.attention as em

    lib = em.bf16_attention_kernel()
    if lib is None:
        pytest.skip("no AVX-512 BF16 here (engine/attention_bf16.c answers attn_bf16_init() == 0)")
    return lib, [1, 2] if em.bf16_attention_mode() == "AMX tiles" else [1]


@pytest.mark.parametrize(
    "pos, hkv, group, d",
    [
        (torch.arange(0, 100), 3, 3, 64),  # prefill from the start, the default model's heads
        (torch.arange(37, 100), 3, 3, 64),  # after cached tokens
        (torch.cat((torch.arange(16, 48), torch.arange(64, 96))), 3, 3, 64),  # a recompute's scattered chunks
        (torch.arange(0, 37), 3, 3, 64),  # a last block of fewer rows than a tile
        (torch.arange(5, 50), 2, 7, 128),  # 42 rows a block (a part-filled row tile), two products per tile
    ],
    ids=["prefill", "after-cache", "scattered", "ragged", "group7-d128"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_attention_stays_within_bfloat16_rounding(pos, hkv, group, d, threads):
    """engine/attention_bf16.c, each way it can multiply here (AVX-512 BF16 dot products; AMX tiles
    where the CPU has them), against the naive reference in float64: queries, keys, values and the
    probabilities enter its products rounded to bfloat16 (8-bit mantissa), so outputs are within a few
    parts in a thousand; the density (float32 softmax and sums) within a part in a hundred. The float32
    kernel on the same inputs is checked closer, so the bounds say what the bf16 rounding costs."""
    import engine.attention as em

    lib, modes = _bf16_modes()
    gen = torch.Generator().manual_seed(2)
    s = int(pos[-1]) + 1
    keys = torch.randn(hkv, s + 3, d, generator=gen)  # 3 rows past the last position: never read
    vals = torch.randn(hkv, s + 3, d, generator=gen)
    q = torch.randn(len(pos), hkv * group, d, generator=gen)
    scale = d ** -0.5
    ref_out, ref_col = naive_attend(q, pos, keys[:, :s], vals[:, :s], scale)
    got = {}
    try:
        for name, mode in [(f"bf16 {m}", m) for m in modes] + [("float32", 0)]:
            fn = em.attention_kernel().attn_forward
            if mode:
                assert lib.attn_bf16_init(mode == 2) == mode
                fn = lib.attn_forward_bf16
            out = torch.empty(len(pos), hkv * group * d)
            density = torch.full((s + 8,), 0.5)
            rc = fn(q.data_ptr(), hkv * group * d, pos.data_ptr(), len(pos), keys.data_ptr(), keys.stride(0),
                    vals.data_ptr(), vals.stride(0), hkv, group, d, scale, out.data_ptr(), out.stride(0),
                    density.data_ptr(), threads)
            assert rc == 0
            assert (density[s:] == 0.5).all()  # nothing past the last key
            err = (out.double() - ref_out).norm() / ref_out.norm()
            col = (density[:s].double() - 0.5 - ref_col).abs().max() / ref_col.abs().max()
            got[name] = (float(err), float(col), float((out.double() - ref_out).abs().max()))
    finally:
        lib.attn_bf16_init(1)  # the process's choice again: tiles where granted
    for m in modes:
        assert got[f"bf16 {m}"][0] < 1e-2 and got[f"bf16 {m}"][2] < 3e-2 and got[f"bf16 {m}"][1] < 1e-2, got
        assert got["float32"][0] < 1e-5 and got["float32"][0] < got[f"bf16 {m}"][0] / 10, got


def test_bf16_weights_prefill_in_bf16_attention_where_the_cpu_has_it(engine, monkeypatch):
    """A model of bf16 weights sends 16 rows or more to attn_forward_bf16 when the CPU has bfloat16
    products (AMX or AVX-512 BF16) and to attn_forward otherwise; decode rows stay on attn_rows;
    `bf16_attention=False` switches it off."""
    import engine.attention as em
    from engine.config import EngineConfig
    from engine.model import Transformer

    model = engine.model
    bf16_lib = em.bf16_attention_kernel()
    calls = []
    monkeypatch.setattr(em, "_ATTENTION", [_Recorder(em.attention_kernel(), calls)])
    monkeypatch.setattr(em, "_ATTENTION_BF16", [_Recorder(bf16_lib, calls) if bf16_lib is not None else None,
                                                em.bf16_attention_mode()])
    cache = model.new_cache(128)
    cache.reserve(100)
    q = torch.randn(64, model.cfg.n_heads, model.cfg.head_dim)
    for switch in (True, False):  # the engine's weights, read as the bf16 format's only for the dispatch
        bf16 = Transformer(model.cfg, model.w, EngineConfig(device="cpu", weights="bf16", bf16_attention=switch))
        for rows, pos in [(64, torch.arange(64)), (1, torch.arange(99, 100))]:
            bf16._attend_native(0, q[:rows].contiguous(), pos, cache, None)
    first = "attn_forward_bf16" if bf16_lib is not None else "attn_forward"
    assert calls == [first, "attn_rows", "attn_forward", "attn_rows"]
    assert not model.bf16_attention  # float32 weights keep the float32 kernel
