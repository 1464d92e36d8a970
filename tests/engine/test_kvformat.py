"""The kv8 working set (keys int8, values fp8 e4m3, one scale per token and head; engine/kvformat.py):
its rows, the attention that reads them (the compiled kernel's own de-quantize against a reference on
the de-quantized values), chunk moves on bytes, and the default model's perplexity beside float."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine import kvformat
from engine.kvcache import KVCache
from tests.engine.test_attention import naive_attend


def _cache(model, n, fmt="kv8"):
    return KVCache(model.cfg, chunk_tokens=16, device=model.device, dtype=model.dtype, capacity=n, kv_format=fmt)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_rows_pack_within_their_rounding_and_repack_to_the_same_bytes(magnitude):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=gen) * magnitude * torch.rand(4096, 1, generator=gen)
    x[7] = 0  # a row of zeros packs to zeros
    k, v = kvformat.pack_keys(x), kvformat.pack_values(x)
    assert k.shape == v.shape == (4096, 68) and k.dtype == torch.uint8
    xk, xv = kvformat.unpack_keys(k), kvformat.unpack_values(v)
    amax = x.abs().amax(-1, keepdim=True)
    assert ((xk - x).abs() <= amax / 254 * 1.0001 + 1e-30).all()  # int8: half a step of max/127
    assert ((xv - x).abs() <= amax / 448 * 2 ** -4 * 1.0001 + x.abs() * 2 ** -4 + 1e-30).all()  # 3 mantissa bits
    rel_v = float((xv - x).norm() / x.norm())
    assert 0.005 < rel_v < 0.04, rel_v  # e4m3's rounding, really applied
    assert not xk[7].any() and not xv[7].any()
    assert torch.equal(kvformat.pack_keys(xk), k) and torch.equal(kvformat.pack_values(xv), v)


def test_the_kernels_fp8_decode_is_exact_for_every_code(engine):
    """Every e4m3 code (subnormals included) read by attn_rows_kv8 equals torch's conversion: one key
    row of ones and one-hot queries make the output the value row itself."""
    model = engine.model
    if not model.compiled_attention:
        pytest.skip("the compiled attention kernel does not run here")
    cfg = model.cfg
    d = cfg.head_dim
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 0x7f and 0xff are NaN
    cache = _cache(model, 16)
    cache.reserve(1)
    rows = cache.kv[0, :, :, :1]  # [2, Hkv, 1, D + 4]
    rows[0, :, :, :d] = 0  # keys all zero: one key, probability 1
    kvformat.scales(rows)[...] = 1.0
    got = []
    for start in range(0, len(codes), d):
        chunk = codes[start : start + d]
        vals = torch.zeros(d, dtype=torch.uint8)
        vals[: len(chunk)] = chunk
        rows[1, :, 0, :d] = vals
        out = model._attend_native(0, torch.randn(1, cfg.n_heads, d), torch.tensor([0]), cache, None)
        got.append(out[0, :d][: len(chunk)])
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.cat(got), want)


@pytest.mark.parametrize(
    "pos",
    [torch.arange(0, 300), torch.cat((torch.arange(16, 48), torch.arange(200, 216))), torch.tensor([299]),
     torch.arange(290, 300)],
    ids=["prefill", "scattered", "decode", "short"],
)
@pytest.mark.parametrize("native", [True, False])
def test_attention_over_kv8_matches_the_reference_on_its_values(engine, pos, native, monkeypatch):
    """Both attention paths over a kv8 working set equal the full-matrix reference computed on the
    de-quantized keys and values: the de-quantize inside attn_rows_kv8 and the one-layer de-quantize
    before attn_forward or the torch kernel add only float32 rounding."""
    model = engine.model
    cfg = model.cfg
    monkeypatch.setattr(model.engine_cfg, "native_attention", native)
    gen = torch.Generator().manual_seed(3)
    cache = _cache(model, 320)
    cache.reserve(300)
    k = torch.randn(cfg.n_kv_heads, 300, cfg.head_dim, generator=gen) * 3
    v = torch.randn(cfg.n_kv_heads, 300, cfg.head_dim, generator=gen)
    cache.write(1, k, v, torch.arange(300), True)
    keys, vals = cache.layer_kv(1, 300)
    assert float((keys - k).abs().max()) < 0.2 and keys.dtype == torch.float32
    q = torch.randn(len(pos), cfg.n_heads, cfg.head_dim, generator=gen) * 3
    s_all = int(pos[-1]) + 1
    ref_out, ref_col = naive_attend(q, pos, keys[:, :s_all], vals[:, :s_all], model.scale)
    density = torch.zeros(320)
    if native and model.compiled_attention:
        out = model._attend_native(1, q, pos, cache, density)
    else:
        out = model._attend(1, q, pos, cache, density)
    assert torch.allclose(out.double(), ref_out, atol=3e-5)
    assert torch.allclose(density[:s_all].double(), ref_col, rtol=1e-5, atol=1e-5)


def test_a_kv8_working_set_takes_about_a_quarter_and_moves_chunks_as_bytes(engine):
    model = engine.model
    ids = list(range(100, 141))
    f, q = _cache(model, 48, "float"), _cache(model, 48)
    model.forward(f, ids)
    logits = model.forward(q, ids)
    assert q.nbytes() / f.nbytes() == (model.cfg.head_dim + 4) / (4 * model.cfg.head_dim)  # 26.6% at D = 64
    assert q.storage_name == "kv8" and f.storage_name == "float32"
    with pytest.raises(TypeError, match="layer_kv"):
        q.k
    exported = q.export_chunk(1)
    assert exported.dtype == np.uint8 and exported.shape[-1] == model.cfg.head_dim + 4
    # swapped out and back as bytes, or as its de-quantized values (packed again): the same bytes
    q.drop_chunk(1)
    with pytest.raises(RuntimeError, match="missing"):
        model.forward(q, [5])
    poisoned = _cache(model, 48)
    poisoned.kv.copy_(q.kv)
    poisoned.length = q.length
    assert torch.isnan(poisoned.layer_kv(0, 41)[0][:, 16:32]).all()
    q.put_chunk(1, exported)
    assert np.array_equal(q.export_chunk(1), exported)
    q.put_chunk(1, kvformat.unpack(torch.from_numpy(exported)).numpy())
    assert np.array_equal(q.export_chunk(1), exported)
    # a wrapped uint8 buffer is a kv8 working set
    w = KVCache.wrap(model.cfg, q.kv, chunk_tokens=16)
    assert w.kv_format == "kv8" and w.dtype == torch.float32
    # recompute writes the same rows a prefill wrote, and the next token follows as before
    q.drop_chunk(0)
    model.recompute(q, ids, [0])
    assert np.array_equal(q.export_chunk(1), exported)
    assert torch.allclose(model.forward(q, [7]), model.forward(_refill(model, ids), [7]), atol=1e-4)
    assert int(logits.argmax()) == int(model.forward(_cache(model, 48, "float"), ids).argmax())


def _refill(model, ids):
    c = _cache(model, 48)
    model.forward(c, ids)
    return c


def test_perplexity_of_the_kv8_working_set_beside_float(engine):
    """Perplexity on the benchmark suite's real text (three windows of 384 tokens, every layer's
    attention reading its keys and values back from kv8): 19.92 in float32 and 19.96 in kv8 (+0.2%)
    were measured; the bound is +1%."""
    from bench.accuracy import real_text_ids, window_starts

    model = engine.model
    ids = real_text_ids(engine.tok)
    width = 384
    ppl = {}
    for fmt in ("float", "kv8"):
        nll, count = 0.0, 0
        for s in window_starts(len(ids), 3, width):
            window = ids[s : s + width]
            logits = model.forward(_cache(model, width, fmt), window, all_logits=True)
            lp = torch.log_softmax(logits[:-1].float(), dim=-1)
            nll -= float(lp.gather(1, torch.tensor(window[1:]).unsqueeze(1)).sum())
            count += width - 1
        ppl[fmt] = math.exp(nll / count)
    assert ppl["kv8"] != ppl["float"] and ppl["kv8"] <= ppl["float"] * 1.01, ppl  # it really ran, within +1%
