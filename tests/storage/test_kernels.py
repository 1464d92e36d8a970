"""The compiled storage kernels (built by engine.native): storage/kvquant.c gives the same bytes and
values as the numpy reference at every quantized level, storage/crc32.c the same numbers as zlib, and
the codecs fall back cleanly without a compiler."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import native
from storage import codecs, floatcast, quantize
from tests.storage.helpers import assert_within_quant_bound, synthetic_kv

QUANT = ("q8", "q4", "q2")


@pytest.fixture(scope="module")
def kernels():
    """The kernels must build on the test machine (CI has a C compiler); LLMAAS_NATIVE=0 skips."""
    if not native.enabled():
        pytest.skip("native kernels switched off (LLMAAS_NATIVE=0)")
    lib = quantize.kernels()
    assert lib is not None, "storage/kvquant.c did not build here (see the RuntimeWarning)"
    assert lib.kvq_encode_f16 is not None, "the compiler has no _Float16: the fused encode is missing"
    return lib


def both(monkeypatch, kv: np.ndarray, level: str, out_shape) -> dict[bool, tuple]:
    """(params, payload bytes, decoded bytes) with the kernels on and with the numpy reference."""
    got = {}
    for use in (True, False):
        monkeypatch.setattr(quantize, "USE_NATIVE", use)
        monkeypatch.setattr(floatcast, "USE_TORCH", use)  # the reference: numpy only
        enc = codecs.encode(kv, level)
        out = np.full(out_shape, np.nan, np.float32)[:, :, :, 8 : 8 + kv.shape[3]]  # a strided slot
        codecs.decode(enc, out=out)
        got[use] = (enc.params, enc.payload.tobytes(), out.tobytes())
    return got


@pytest.mark.parametrize("level", QUANT)
def test_kernels_match_the_reference_bytes_and_values(monkeypatch, kernels, level):
    x = synthetic_kv()
    # ties and edge values: exact fp16 ties, signed zeros, subnormals, a constant channel
    x.flat[:6] = [-0.0, 0.0, 2.0**-25, 3 * 2.0**-25, -1e-30, 64999.0]
    x.flat[6:300] = np.float16(x.flat[6:300]) + np.float32(2.0**-12)
    x[3, 1, 2, :, 7] = 1.25
    ctx = np.zeros((30, 2, 3, 48, 64), np.float32)
    ctx[:, :, :, 16:32] = x
    src = ctx[:, :, :, 16:32]  # a strided chunk of a context buffer, as the executor exports it
    got = both(monkeypatch, src, level, (30, 2, 3, 48, 64))
    assert got[True][0] == "f16"
    assert got[True] == got[False]


@pytest.mark.parametrize("level", QUANT)
def test_float32_parameters_match_the_reference(monkeypatch, kernels, level):
    """A value of 65000 or more needs float32 parameters: the fused encode hands the chunk back and
    the two-pass kernels (min/max, numpy parameters, quantize) encode it."""
    x = synthetic_kv((4, 2, 3, 16, 64), seed=3)
    x.flat[:3] = [70000.0, -1e9, 65520.0]
    got = both(monkeypatch, x, level, (4, 2, 3, 48, 64))
    assert got[True][0] == "f32"
    assert got[True] == got[False]


def test_nan_is_refused_on_both_paths(monkeypatch, kernels):
    x = synthetic_kv((2, 2, 1, 16, 8))
    x[1, 0, 0, 5, 3] = np.nan
    for use in (True, False):
        monkeypatch.setattr(quantize, "USE_NATIVE", use)
        with pytest.raises(ValueError, match="inf or nan"):
            codecs.encode(x, "q4")


@settings(max_examples=40, deadline=None)
@given(nl=st.integers(1, 3), h=st.integers(1, 4), t=st.sampled_from([4, 8, 12, 16, 32]),
       d=st.sampled_from([1, 6, 8, 64, 72]), scale=st.floats(1e-4, 1e4), offset=st.floats(-1e4, 1e4),
       seed=st.integers(0, 2**16), level=st.sampled_from(QUANT))
def test_kernels_match_the_reference_on_any_shape(kernels, nl, h, t, d, scale, offset, seed, level):
    x = (offset + scale * np.random.default_rng(seed).standard_normal((nl, 2, h, t, d))).astype(np.float32)
    got = {}
    try:
        for use in (True, False):
            quantize.USE_NATIVE = floatcast.USE_TORCH = use
            enc = codecs.encode(x, level)
            got[use] = (enc.params, enc.payload.tobytes(), codecs.decode(enc).tobytes())
    finally:
        quantize.USE_NATIVE = floatcast.USE_TORCH = True
    assert got[True] == got[False]


def _aligned_f32(shape, offset_floats: int = 0) -> np.ndarray:
    """A float32 array of `shape` whose data starts on a 64-byte boundary plus `offset_floats`."""
    n = int(np.prod(shape))
    raw = np.empty(n + 32, np.float32)
    skip = (-raw.ctypes.data % 64) // 4 + offset_floats
    return raw[skip : skip + n].reshape(shape)


@pytest.mark.parametrize("level", QUANT)
@pytest.mark.parametrize("params", ["f16", "f32"])
def test_streaming_stores_give_the_same_values(kernels, level, params):
    """decode(stream=True) writes past the caches where the output is aligned to a vector, and falls
    back to ordinary stores where it is not: the values are the same bit for bit either way, into a
    working-set slice (strided) or a whole array, and nothing outside the slice is touched."""
    x = synthetic_kv((3, 2, 3, 16, 64), seed=5)
    if params == "f32":
        x.flat[0] = 70000.0  # needs float32 parameters
    enc = codecs.encode(x, level)
    assert enc.params == params
    ref = codecs.decode(enc).tobytes()
    for offset in (0, 1):  # aligned: non-temporal stores; one float off: the ordinary loop
        ws = _aligned_f32((3, 2, 3, 64, 64), offset)
        ws[:] = -7.0
        got = codecs.decode(enc, out=ws[:, :, :, 16:32], stream=True)
        assert np.ascontiguousarray(got).tobytes() == ref
        assert (ws[:, :, :, :16] == -7.0).all() and (ws[:, :, :, 32:] == -7.0).all()
    whole = _aligned_f32(enc.shape)
    assert codecs.decode(enc, out=whole, stream=True).tobytes() == ref


def test_read_only_payload_decodes_in_place(kernels):
    """A payload straight out of the object store is read-only: the kernel reads it without a copy."""
    enc = codecs.encode(synthetic_kv(), "q2")
    ro = enc.payload.copy()
    ro.flags.writeable = False
    from dataclasses import replace

    np.testing.assert_array_equal(codecs.decode(replace(enc, payload=ro)), codecs.decode(enc))


def test_missing_compiler_falls_back_to_the_reference(monkeypatch, tmp_path):
    """Without a compiler the quantized codecs run their numpy/torch path (engine.native warns)."""
    monkeypatch.setenv("LLMAAS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(quantize, "_KERNELS", [])
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert quantize.kernels() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quantize.kernels() is None  # remembered: no second warning, no second attempt
        x = synthetic_kv((2, 2, 3, 16, 64))
        enc = codecs.encode(x, "q8")  # the numpy/torch path
        assert_within_quant_bound(x, enc, codecs.decode(enc))


# -- crc32 (storage/crc32.c) --------------------------------------------------------------------------


def test_crc32_is_zlibs_on_every_length_offset_and_start(monkeypatch):
    """Every length 0-700 (the fold needs 128 bytes: both sides of it), unaligned starts, running
    values, and large buffers: the same number as zlib.crc32, and the same with the kernel off."""
    import zlib

    from storage import chunkformat as fmt

    if not native.enabled():
        pytest.skip("native kernels switched off (LLMAAS_NATIVE=0)")
    monkeypatch.setattr(fmt, "_NATIVE_CRC_MIN", 0)  # the kernel even for short inputs
    fn = fmt._crc_fn()
    if fn is None:
        pytest.skip("no carry-less multiply on this CPU: zlib.crc32 is used")
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for n in [*range(701), 4096, 65535, 1 << 19]:
        for off in (0, 1, 13):
            part = data[off:off + n]
            for start in (0, 0xFFFFFFFF, 0x1234567):
                assert fmt.crc32(part, start) == zlib.crc32(part.tobytes(), start), (n, off, start)
    assert fmt.crc32(memoryview(data.tobytes())) == zlib.crc32(data)  # bytes-like inputs too
    monkeypatch.setattr(fmt, "USE_NATIVE_CRC", False)
    assert fmt.crc32(data) == zlib.crc32(data)
