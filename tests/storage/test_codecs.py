"""Round trips of every KV codec level, their documented error bounds and stored sizes."""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import codecs, floatcast
from storage.errors import ChunkVersionError, UnknownCodecError
from tests.storage.helpers import SHAPE, assert_within_quant_bound, synthetic_kv

QUANT = ("q8", "q4", "q2")


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits by truncation (any valid bf16 pattern will do as input)."""
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def assert_scale_not_inflated(x: np.ndarray, enc: codecs.EncodedChunk) -> None:
    """The stored scale is the nominal (max-min)/qmax up to the documented fp16 widening."""
    qmax = (1 << codecs.nominal_bits(enc.level)) - 1
    mn, mx = x.min(axis=3, keepdims=True), x.max(axis=3, keepdims=True)
    amax = np.maximum(np.abs(mn), np.abs(mx)).astype(np.float64)
    nominal = (mx.astype(np.float64) - mn) / qmax
    widened = (nominal + (amax * 2.0**-9 + 2.0**-22) / qmax) * 1.003 + 2.0**-23
    s = codecs.scales(enc).astype(np.float64)
    assert (s >= nominal * (1 - 1e-6)).all()
    assert (s <= widened).all()


# -- registry ------------------------------------------------------------------------------------------


def test_unknown_codec_lists_valid_names():
    with pytest.raises(UnknownCodecError) as e:
        codecs.codec("q3")
    assert isinstance(e.value, ValueError) and e.value.code == "unknown_codec"
    for name in ("raw", "fp16", "bf16", "q8", "q4", "q2"):
        assert name in str(e.value)
    with pytest.raises(UnknownCodecError):
        codecs.encode(synthetic_kv((1, 2, 1, 16, 8)), "int8")


def test_nominal_bits_for_the_planner():
    assert [codecs.nominal_bits(lv) for lv in ("raw", "fp16", "bf16", "q8", "q4", "q2")] == [
        32, 16, 16, 8, 4, 2]
    assert codecs.nominal_bits("raw", "float16") == 16 and codecs.nominal_bits("raw", "bfloat16") == 16


def test_stored_bytes_match_documented_table_and_payloads():
    documented = {"raw": 24576, "fp16": 12288, "bf16": 12288, "q8": 7680, "q4": 4608, "q2": 3072}
    kv = synthetic_kv()
    for level, per_layer in documented.items():
        assert codecs.stored_nbytes(level, SHAPE) == 30 * per_layer
        enc = codecs.encode(kv, level)
        assert enc.nbytes == codecs.stored_nbytes(level, SHAPE)
        assert enc.record_nbytes == per_layer
    # real bits per value: 10, 6, 4 for q8, q4, q2 (fp16 scales and zero points included)
    values = np.prod(SHAPE)
    assert [codecs.stored_nbytes(q, SHAPE) * 8 / values for q in QUANT] == [10.0, 6.0, 4.0]


# -- lossless ------------------------------------------------------------------------------------------


def special_values(kv: np.ndarray) -> np.ndarray:
    kv = kv.copy()
    kv.flat[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-45, 3.0e4]
    return kv


def test_raw_is_bit_exact_in_every_compute_dtype():
    x32 = special_values(synthetic_kv())
    for kv in (x32, x32.astype(np.float16), to_bf16_bits(x32)):
        enc = codecs.encode(kv, "raw")
        out = codecs.decode(enc)
        assert out.dtype == kv.dtype and out.tobytes() == kv.tobytes()


def test_raw_payload_does_not_alias_the_input():
    kv = synthetic_kv((2, 2, 1, 16, 8))
    enc = codecs.encode(kv, "raw")
    kv += 1
    assert not np.array_equal(codecs.decode(enc), kv)


def test_fp16_and_bf16_are_bit_exact_from_their_own_dtype():
    x = synthetic_kv()
    h = x.astype(np.float16)
    assert codecs.decode(codecs.encode(h, "fp16")).tobytes() == h.tobytes()
    b = to_bf16_bits(x)
    assert codecs.decode(codecs.encode(b, "bf16")).tobytes() == b.tobytes()


def test_fp16_error_bound_from_float32():
    x = synthetic_kv()
    x.flat[:6] = [1e-7, -3e-6, 6.0e-5, 65504.0, -0.0, 2.0**-14]
    y = codecs.decode(codecs.encode(x, "fp16"))
    err = np.abs(y.astype(np.float64) - x)
    normal = np.abs(x) >= 2.0**-14
    assert (err[normal] <= 2.0**-11 * np.abs(x[normal])).all()
    assert (err[~normal] <= 2.0**-25).all()
    # round to nearest even, bit for bit what numpy's own (scalar) cast gives
    np.testing.assert_array_equal(codecs.encode(x, "fp16").payload.view(np.float16).reshape(x.shape),
                                  x.astype(np.float16))


def test_fp16_overflow_saturates_to_inf():
    x = np.full((1, 2, 1, 2, 4), 70000.0, np.float32)
    x[0, 1] = -1e9
    y = codecs.decode(codecs.encode(x, "fp16"))
    assert np.isposinf(y[0, 0]).all() and np.isneginf(y[0, 1]).all()


def test_bf16_error_bound_from_float32():
    x = synthetic_kv()
    y = codecs.decode(codecs.encode(x, "bf16"))
    assert (np.abs(y.astype(np.float64) - x) <= 2.0**-8 * np.abs(x)).all()
    assert not np.array_equal(y, x)  # lossy from float32


# -- quantized -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", QUANT)
@pytest.mark.parametrize("t", [16, 5, 1])
def test_quant_round_trip_within_bound(level, t):
    x = synthetic_kv((30, 2, 3, t, 64), seed=t)
    enc = codecs.encode(x, level)
    assert enc.params == "f16" and enc.nbytes == codecs.stored_nbytes(level, x.shape)
    y = codecs.decode(enc)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert_within_quant_bound(x, enc, y)
    assert_scale_not_inflated(x, enc)


def test_quant_error_shrinks_with_bits():
    x = synthetic_kv()
    errs = [float(np.abs(codecs.decode(codecs.encode(x, lv)) - x).mean()) for lv in QUANT]
    assert errs[0] < errs[1] / 8 and errs[1] < errs[2] / 2


@pytest.mark.parametrize("level", QUANT)
def test_quant_uses_every_code_and_hits_the_extremes(level):
    """Per channel the min maps to code 0 and the max to qmax (the range is not wasted)."""
    x = synthetic_kv((2, 2, 1, 16, 8))
    y = codecs.decode(codecs.encode(x, level))
    s = codecs.scales(codecs.encode(x, level))
    assert (np.abs(y.min(axis=3, keepdims=True) - x.min(axis=3, keepdims=True)) <= s / 2 + 1e-6).all()
    assert (np.abs(y.max(axis=3, keepdims=True) - x.max(axis=3, keepdims=True)) <= s / 2 + 1e-6).all()


def test_constant_and_zero_channels():
    x = np.zeros((2, 2, 1, 16, 8), np.float32)
    x[1] = 3.25
    for level in QUANT:
        y = codecs.decode(codecs.encode(x, level))
        assert np.abs(y - x).max() <= 1e-5


def test_large_values_fall_back_to_float32_params():
    x = synthetic_kv((2, 2, 3, 16, 64))
    x[1, 0, 0, 3, 5] = 1e6
    for level in QUANT:
        enc = codecs.encode(x, level)
        assert enc.params == "f32"
        assert enc.nbytes == codecs.stored_nbytes(level, x.shape, params="f32")
        assert_within_quant_bound(x, enc, codecs.decode(enc))


def test_quant_refuses_non_finite_values():
    x = synthetic_kv((1, 2, 1, 16, 8))
    for bad in (np.nan, np.inf):
        x.flat[3] = bad
        for level in QUANT:
            with pytest.raises(ValueError, match="finite"):
                codecs.encode(x, level)


@pytest.mark.parametrize("level", ("raw", "fp16", "bf16") + QUANT)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_other_compute_dtypes(level, dtype):
    x32 = synthetic_kv((4, 2, 3, 16, 64))
    kv = x32.astype(np.float16) if dtype == "float16" else to_bf16_bits(x32)
    ref = kv.astype(np.float32) if dtype == "float16" else bf16_to_f32(kv)
    enc = codecs.encode(kv, level)
    assert enc.dtype == dtype
    y = codecs.decode(enc)
    assert y.dtype == kv.dtype
    y32 = y.astype(np.float32) if dtype == "float16" else bf16_to_f32(y)
    rel = {"float16": 2.0**-11, "bfloat16": 2.0**-8}[dtype]  # the output dtype's own rounding
    if level in QUANT:
        s = codecs.scales(enc)
        mag = np.maximum(np.abs(ref), np.abs(y32))
        assert (np.abs(y32 - ref) <= s / 2 + rel * mag + 1e-6).all()
    else:
        step = {"raw": 0, "fp16": 2.0**-11, "bf16": 2.0**-8}[level]
        assert (np.abs(y32 - ref) <= (step + rel) * np.abs(ref) + 1e-6).all()


# -- decode into the caller's array -------------------------------------------------------------------


@pytest.mark.parametrize("level", ("raw", "fp16", "bf16") + QUANT)
def test_decode_writes_into_a_strided_view(level):
    """A chunk decodes straight into its slot of a context buffer [L, 2, H, S, D]."""
    x = synthetic_kv()
    buf = np.full((30, 2, 3, 64, 64), np.nan, np.float32)
    out = buf[:, :, :, 16:32]
    assert not out.flags.c_contiguous
    ret = codecs.decode(codecs.encode(x, level), out=out)
    assert ret is out
    np.testing.assert_array_equal(buf[:, :, :, 16:32], codecs.decode(codecs.encode(x, level)))
    assert np.isnan(buf[:, :, :, :16]).all() and np.isnan(buf[:, :, :, 32:]).all()


def test_decode_rejects_a_wrong_out():
    enc = codecs.encode(synthetic_kv((2, 2, 1, 16, 8)), "q4")
    with pytest.raises(ValueError):
        codecs.decode(enc, out=np.empty((2, 2, 1, 16, 8), np.float16))
    with pytest.raises(ValueError):
        codecs.decode(enc, out=np.empty((2, 2, 1, 15, 8), np.float32))


@pytest.mark.parametrize("level", ("raw", "q8", "q2"))
def test_a_run_of_layers_decodes_alone(level):
    x = synthetic_kv()
    enc = codecs.encode(x, level)
    part = replace(enc, shape=(4, *enc.shape[1:]), first_layer=7, payload=enc.payload[7:11].copy())
    np.testing.assert_array_equal(codecs.decode(part), codecs.decode(enc)[7:11])


def test_version_mismatch_is_refused():
    enc = codecs.encode(synthetic_kv((1, 2, 1, 16, 8)), "q8")
    with pytest.raises(ChunkVersionError):
        codecs.decode(replace(enc, version=enc.version + 1))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_and_numpy_casts_give_the_same_bytes(monkeypatch, dtype):
    """Processes with torch cast float32 <-> float16 in torch, store-only processes in numpy: the
    bytes written and the values decoded are the same either way (both round to nearest even)."""
    torch = pytest.importorskip("torch")
    x32 = synthetic_kv()
    x32.flat[:8] = [70000.0, -1e9, 65519.0, 65520.0, 2.0**-25, 3 * 2.0**-25, -0.0, 1e-30]
    x32.flat[8:200] = np.float16(x32.flat[8:200]) + np.float32(2.0**-12)  # exact fp16 ties
    as_dtype = {"float32": lambda a: a, "float16": lambda a: a.astype(np.float16),
                "bfloat16": to_bf16_bits}[dtype]
    with np.errstate(over="ignore"):
        kv = as_dtype(x32)
    kvq = as_dtype(np.clip(x32, -6e4, 6e4))  # quantized levels need finite values
    got = {}
    for use in (True, False):
        monkeypatch.setattr(floatcast, "USE_TORCH", use)
        assert (floatcast.torch_if_loaded(kv) is not None) == use and torch is not None
        for level in ("fp16",) + QUANT:
            enc = codecs.encode(kvq if level in QUANT else kv, level)
            out = np.empty((30, 2, 3, 48, 64), kv.dtype)[:, :, :, 8:24]  # a strided slot
            codecs.decode(enc, out=out)
            got[use, level] = (enc.payload.tobytes(), out.tobytes())
    for level in ("fp16",) + QUANT:
        assert got[True, level] == got[False, level], level


@pytest.mark.parametrize("level", ["fp16", "raw", *QUANT])
def test_read_only_payloads_decode_to_the_same_values(level):
    """torch warns when it wraps a read-only array (a payload out of the object store): fp16 and raw
    stay on numpy, the quantized levels copy the small payload first; same values either way."""
    pytest.importorskip("torch")  # the quantized levels decode in torch once the process has it
    enc = codecs.encode(synthetic_kv(), level)
    ro = enc.payload.copy()
    ro.flags.writeable = False
    assert floatcast.torch_if_loaded(ro) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable array" warning from torch
        got = codecs.decode(replace(enc, payload=ro), out=np.empty((30, 2, 3, 48, 64), np.float32)[:, :, :, 8:24])
    np.testing.assert_array_equal(got, codecs.decode(enc))


def test_encode_many_in_threads_equals_one_by_one():
    kvs = [synthetic_kv((30, 2, 3, 16, 64), seed=s) for s in range(6)]
    with ThreadPoolExecutor(2) as ex:
        for level in ("fp16", "q4"):
            par = codecs.encode_many(kvs, level, executor=ex)
            seq = codecs.encode_many(kvs, level)
            assert all(np.array_equal(a.payload, b.payload) for a, b in zip(par, seq))
            outs = [np.empty_like(k) for k in kvs]
            codecs.decode_many(par, outs, executor=ex)
            assert all(np.array_equal(o, codecs.decode(e)) for o, e in zip(outs, seq))


@settings(max_examples=40, deadline=None)
@given(nl=st.integers(1, 3), h=st.integers(1, 3), t=st.integers(1, 17), d=st.sampled_from([2, 6, 64]),
       scale=st.floats(1e-3, 1e3), offset=st.floats(-1e3, 1e3), seed=st.integers(0, 2**16),
       level=st.sampled_from(QUANT))
def test_quant_bound_property(nl, h, t, d, scale, offset, seed, level):
    x = (offset + scale * np.random.default_rng(seed).standard_normal((nl, 2, h, t, d))).astype(
        np.float32)
    enc = codecs.encode(x, level)
    assert_within_quant_bound(x, enc, codecs.decode(enc))


# -- real K/V of the default model ------------------------------------------------------------------------


def test_real_kv_round_trips(real_kv):
    """Real keys and values (outlier channels, per-head offsets) at every level."""
    assert real_kv.dtype == np.float32 and real_kv.shape[3] % 16 == 0 and real_kv.shape[3] >= 64
    chunks = [np.ascontiguousarray(real_kv[:, :, :, s:s + 16])
              for s in range(0, real_kv.shape[3], 16)]
    rel = {}
    for level in ("raw", "fp16", "bf16") + QUANT:
        num = den = 0.0
        for x in chunks:
            enc = codecs.encode(x, level)
            y = codecs.decode(enc)
            if level == "raw":
                assert y.tobytes() == x.tobytes()
            elif level in QUANT:
                assert_within_quant_bound(x, enc, y)
                assert_scale_not_inflated(x, enc)
            num += float(((y - x) ** 2).sum())
            den += float((x**2).sum())
        rel[level] = (num / den) ** 0.5
    assert rel["raw"] == 0 and rel["fp16"] < 1e-3 and rel["bf16"] < 5e-3
    assert rel["q8"] < 0.01 < rel["q2"] and rel["q8"] < rel["q4"] < rel["q2"]


def test_kv8_rows_store_as_they_are_and_lower_once_with_compounding_error(real_kv, tmp_path):
    """A kv8 working set's chunks (uint8 rows of D + 4: engine/kvformat.py): `raw` keeps their bytes,
    sized by the logical shape, through a chunk file too; q4 and q2 encode the de-quantized values and
    decode back into rows. The errors against the float K/V compound about as independent noise does
    (q4 keys 0.031 from float, 0.034 from kv8, against sqrt(0.031^2 + 0.011^2) = 0.033)."""
    import torch

    from engine import kvformat
    from storage.chunkstore import ChunkStore

    rows = kvformat.pack(torch.from_numpy(real_kv)).numpy()  # [L, 2, Hkv, T, D + 4]
    chunks = [np.ascontiguousarray(rows[:, :, :, s:s + 16]) for s in range(0, rows.shape[3], 16)]
    logical = chunks[0].shape[:-1] + (real_kv.shape[-1],)
    enc = codecs.encode(chunks[0], "raw")
    assert enc.dtype == "kv8" and enc.shape == logical and enc.payload.tobytes() == chunks[0].tobytes()
    assert codecs.stored_nbytes("raw", logical, "kv8") == chunks[0].nbytes == enc.nbytes
    assert codecs.nominal_bits("raw", "kv8") == 8
    store = ChunkStore(tmp_path, fingerprint="fp;kv=kv8")
    store.write("0123abcd", 0, enc, 0)
    [(_, back)] = list(store.read("0123abcd", [0]))
    assert np.array_equal(codecs.decode(back), chunks[0])

    def rel(y, part):
        x = real_kv[:, part]
        return float(np.linalg.norm(y[:, part] - x) / np.linalg.norm(x))

    kv8_err = [rel(kvformat.unpack(torch.from_numpy(rows)).numpy(), p) for p in (0, 1)]
    for level in ("q4", "q2"):
        encs = [codecs.encode(c, level) for c in chunks]
        assert all(e.dtype == "kv8" and e.shape == logical for e in encs)
        assert encs[0].nbytes == codecs.stored_nbytes(level, logical, "kv8")
        back = np.concatenate([codecs.decode(e) for e in encs], axis=3)
        assert back.dtype == np.uint8 and back.shape == rows.shape
        from_kv8 = kvformat.unpack(torch.from_numpy(back)).numpy()
        from_float = np.concatenate([codecs.decode(codecs.encode(np.ascontiguousarray(real_kv[:, :, :, s:s + 16]),
                                                                 level)) for s in range(0, real_kv.shape[3], 16)], axis=3)
        for part in (0, 1):
            alone, compound = rel(from_float, part), rel(from_kv8, part)
            assert alone < compound < 1.25 * (alone**2 + kv8_err[part] ** 2) ** 0.5, (level, part, alone, compound)
