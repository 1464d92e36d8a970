"""KV chunk codecs: pure encode/decode pairs, one per compression level, chosen by name.

A chunk's KV is ``kv: [L, 2, Hkv, T, D]`` (layers, K/V, kv heads, tokens, head dim) in the compute
dtype: ``float32``, ``float16``, or ``bfloat16`` carried as a ``uint16`` view. ``encode`` turns it into
an :class:`EncodedChunk` whose payload is ``L`` equal-size per-layer records, so one layer can be
stored, read and decoded without the others. ``decode`` writes straight into a caller-provided array
in the compute dtype (decode time counts in context-switch latency), which may be a strided view.

Levels (the registry :data:`CODECS`; every level has a ``version`` written beside its payload):

=====  ============  =================================================  =========================
level  nominal bits  error bound (per element x, decoded x')            record bytes per layer
=====  ============  =================================================  =========================
raw    32/16/16 [1]  bit-exact                                          N * itemsize
fp16   16            |x-x'| <= 2^-11 |x| for |x| in [2^-14, 65504],     2 N
                     <= 2^-25 below; |x| >= 65520 becomes inf [3]
bf16   16            |x-x'| <= 2^-8 |x| (normal floats) [4]             2 N
q8     8             |x-x'| <= s/2, s the channel's scale [2]           N     + 4 C (fp16 params)
q4     4             same, s = range/15                                 N / 2 + 4 C
q2     2             same, s = range/3                                  N / 4 + 4 C
=====  ============  =================================================  =========================

``N = 2*Hkv*T*D`` values and ``C = 2*Hkv*D`` channels per layer. [1] raw keeps the compute dtype:
32 bits for float32, 16 for float16/bfloat16. [2] plus float32 rounding: a few ulps of the
channel's largest magnitude ``max(|min|, |max|)`` (``q*s + z`` is computed in float32). [3] rounding
is to nearest, ties to even (IEEE, as numpy's and torch's casts). [4] rounding is to nearest, ties
away from zero. fp16 and bf16 are bit-exact from their own compute dtype.

At T=16 with the default model (Hkv=3, D=64: N=6144, C=384) a layer record is 24576 B raw fp32,
12288 B fp16/bf16, 7680 B q8, 4608 B q4, 3072 B q2: real bits per value 32, 16, 10, 6, 4 against
nominal 32, 16, 8, 4, 2 (:func:`stored_nbytes` against :func:`nominal_bits`); against the LLMS 8-bit
baseline, nominal ratios 8/8, 4/8, 2/8 are real ratios 10/8, 6/8, 4/8.

Quantized levels (LLMS §3.2 channel-wise linear, MNN-LLM Eq. 1 asymmetric): for every layer and
every (K/V, head, channel d) the chunk's T tokens give ``min`` and ``max``; with ``qmax = 2^bits-1``

    z = fp16 round-down of min,   s = fp16 round-up of (max - z)/qmax   (both stored, fp16)
    q = floor((x - z)/s + 1/2) in [0, qmax],   x' = q*s + z,   so |x - x'| <= s/2

The directed roundings keep every value inside ``[z, z + qmax*s]``, so the bound holds for the
stored parameters; they widen a channel's range by at most ~2^-10 max(|min|,|max|) + 2^-24. A chunk
with any |value| >= 65000 keeps float32 parameters (``EncodedChunk.params == "f32"``, 8 C bytes per
layer, ``z = min``, ``s >= max(|min|,|max|) * 2^-16``). Records of quantized levels are token-major,
``[T, 2, Hkv, D]`` after the parameters; sub-byte values are packed by splitting a layer's N values
into 8/bits contiguous parts and OR-ing the shifted parts into one byte (vectorised numpy shifts).

Speed (why the code looks as it does; target: a 2048-token context, 128 chunks, encoded or decoded
in under 50 ms): numpy ops that broadcast over a middle axis run 64-value inner loops and are ~3x
slower than long contiguous ones, so the quantized levels first copy a chunk token-major
``[T, L*2*H*D]``: the min/max become reductions over the outer axis and the affine map broadcasts
over the outer axis; decode dequantizes token-major and transposes once into the caller's view.
Work arrays come from per-thread scratch (a fresh large array costs a page fault per 4 KiB).
numpy converts between float32 and float16 one value at a time (~2.5 ns each), so when the process
has imported torch (every process that runs the model has; this module never imports it) those
casts run in torch's vectorised kernels: the fp16 level (~5x faster) and the fp16 scales and zero
points of the quantized levels (~40 us less per chunk), and float32 decodes of raw and quantized
chunks, which run on the process's torch threads (q8/q4/q2/raw 0.12/0.15/0.16/0.07 ms a chunk on
2 cores against numpy's 0.28/0.32/0.34/0.145). The bytes are the same either way.
Where a C compiler is available, float32 q8/q4/q2 run in the compiled kernels of
``storage/kvquant.c`` instead (:mod:`storage.native`): the encode is one pass per layer while the
layer is in cache (min/max, parameters, quantize and pack), the decode one pass writing ``out``; the
same operations in the same order, so the same bytes and values as numpy's path (tested), ~2x faster
than the numpy/torch paths on one thread (docs/benchmarks.md, "Native codec kernels").
:func:`encode_many` / :func:`decode_many` take an executor: numpy, torch and the kernels release the
GIL.

This module deliberately knows nothing about files, lz4, headers or which level a chunk should get:
it maps arrays to bytes and back.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from storage import native
from storage.errors import ChunkVersionError, CorruptChunkError, UnknownLevelError

if sys.byteorder != "little":  # bf16 halves and on-disk records assume little-endian words
    raise ImportError("storage.codecs supports little-endian machines only")

#: compute dtype name -> numpy dtype that carries it (bfloat16 travels as its uint16 bit pattern)
COMPUTE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                np.dtype(np.uint16): "bfloat16"}
PARAM_DTYPES: dict[str, np.dtype] = {"f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}
_F32, _F16, _U8, _U16, _U32 = np.float32, np.float16, np.uint8, np.uint16, np.uint32


class _Scratch(threading.local):
    """Per-thread reusable work arrays.

    Why: a fresh numpy array above glibc's mmap threshold costs a page fault per 4 KiB on first
    touch, which for a chunk's temporaries (~0.4-0.7 MB each) was half of the q8 encode time.
    Contents never outlive one encode/decode call, so sharing within a thread is safe.
    """

    def __init__(self) -> None:
        self.arrays: dict[tuple, np.ndarray] = {}

    def get(self, tag: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        key = (tag, shape, np.dtype(dtype))
        a = self.arrays.get(key)
        if a is None:
            if len(self.arrays) > 64:  # many distinct shapes (partial chunks): start over
                self.arrays.clear()
            a = self.arrays[key] = np.empty(shape, dtype)
        return a


_scratch = _Scratch()


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    """One chunk (or a run of its layers) encoded at one level.

    Invariant: ``payload`` is C-contiguous uint8 ``[shape[0], record_nbytes]``; row ``i`` is the record
    of layer ``first_layer + i`` and depends on no other row.
    """

    level: str  # codec name, a key of CODECS
    version: int  # codec version that wrote the payload
    dtype: str  # compute dtype name of the source (and of decode's output), a key of COMPUTE_DTYPES
    shape: tuple[int, int, int, int, int]  # [L, 2, Hkv, T, D] of the layers carried
    first_layer: int  # index in the full chunk of the first carried layer
    params: str  # dtype of quantization scales/zero points: "f16", "f32", or "" (no params)
    payload: np.ndarray  # uint8 [L, record_nbytes]

    @property
    def record_nbytes(self) -> int:
        """Bytes of one layer's record."""
        return int(self.payload.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of all carried records."""
        return int(self.payload.nbytes)

    def layer(self, i: int) -> memoryview:
        """Record of the ``i``-th carried layer (zero-copy)."""
        return self.payload[i].data


def dtype_name(kv: np.ndarray) -> str:
    """Compute dtype name of an array (uint16 means bfloat16 bits)."""
    try:
        return _DTYPE_NAMES[kv.dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {kv.dtype}; valid: float32, float16, "
                         "uint16 (bfloat16 bits)") from None


# -- float conversions shared by the codecs ------------------------------------------------------------


def _bf16_bits_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bit patterns -> float32 values (exact); ``out`` float32 of the same shape."""
    if out is None:
        out = np.empty(bits.shape, _F32)
    np.left_shift(bits, _U32(16), out=out.view(_U32), dtype=_U32)
    return out


def _f32_to_bf16_bits(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding half away from zero (|err| <= 2^-8 |x|)."""
    if out is None:
        out = np.empty(x.shape, _U16)
    # Adding half a bf16 ulp to the magnitude bits then truncating rounds to nearest (ties away).
    t = np.add(x.view(_U32), _U32(0x8000), dtype=_U32)
    np.right_shift(t, _U32(16), out=out, casting="unsafe")
    return out


#: use torch for float32 <-> float16 casts when the process has imported it (tests switch it off)
USE_TORCH = True


def _torch(*arrays: np.ndarray):
    """The torch module when this process has already imported it and may wrap ``arrays``, else None.

    Why: numpy converts between float32 and float16 one value at a time (~2.5 ns each; ~60 ms for a
    2048-token context) while torch uses vectorised F16C instructions (~10x faster). Every process
    that computes with the model has torch; storage itself never imports it (a store-only process
    stays light and uses numpy). Both paths round to nearest even, so their bytes are identical
    (tested). Arrays torch cannot wrap without a warning or an error (read-only, unaligned,
    odd strides) stay on numpy.
    """
    if not USE_TORCH:
        return None
    t = sys.modules.get("torch")
    if t is None or not all(_wrappable(a) for a in arrays):
        return None
    return t


#: use the compiled kernels of storage/kvquant.c for float32 q8/q4/q2 when they build (tests switch it off)
USE_NATIVE = True
_kvq_lib: list = []  # [library or None], filled on first use


def _kvq():
    """The kvquant library with its signatures declared, or None (off, or no compiler here)."""
    if not USE_NATIVE:
        return None
    if not _kvq_lib:
        lib = native.load("kvquant")
        if lib is not None:
            i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
            lib.kvq_minmax.argtypes = (ptr, *(i64,) * 8, ptr, ptr)
            lib.kvq_minmax.restype = c_int
            lib.kvq_quantize.argtypes = (ptr, *(i64,) * 8, ptr, ptr, c_int, ptr, i64, i64)
            lib.kvq_quantize.restype = None
            lib.kvq_dequantize.argtypes = (ptr, *(i64,) * 5, c_int, c_int, ptr, *(i64,) * 4, c_int)
            lib.kvq_dequantize.restype = c_int
            try:  # compilers without a half-precision type build no fused encode
                lib.kvq_encode_f16.argtypes = (ptr, *(i64,) * 8, c_int, ptr, i64)
                lib.kvq_encode_f16.restype = c_int
            except AttributeError:
                lib.kvq_encode_f16 = None
        _kvq_lib.append(lib)
    return _kvq_lib[0]


def _f32_strides(a: np.ndarray) -> tuple[int, ...] | None:
    """Element strides of a float32 [L, 2, H, T, D] array the kernels can walk (D contiguous), or None."""
    if a.dtype != _F32 or not a.flags.aligned or a.strides[4] != 4 or any(st % 4 for st in a.strides):
        return None
    return tuple(st // 4 for st in a.strides[:4])


def _inv_bias(z: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """1/s and 1/2 - z/s as the quantizer uses them (x*inv + bias, each float32 op rounded): one
    definition for the numpy path and the kernels' two-pass path, so their bytes cannot drift apart
    (kvq_encode_f16 in storage/kvquant.c repeats the same three operations in C)."""
    inv = np.divide(_F32(1.0), s)
    bias = np.multiply(z, inv)
    np.subtract(_F32(0.5), bias, out=bias)
    return inv, bias


def _wrappable(a: np.ndarray) -> bool:
    """torch.from_numpy takes it: writable, aligned, non-negative whole-element strides."""
    return (a.flags.writeable and a.flags.aligned
            and all(st >= 0 and st % a.itemsize == 0 for st in a.strides))


def _f32_to_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> a new C-contiguous float16 array, rounding to nearest even (inf on overflow)."""
    t = _torch(x)
    if t is None:
        with np.errstate(over="ignore"):  # overflow to inf is the documented result
            return x.astype(_F16, order="C")
    return t.from_numpy(x).to(t.float16, memory_format=t.contiguous_format).numpy()


def _f16_to_f32(h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float16 -> float32 (exact) into ``out`` (any strides) or a new array."""
    if out is None:
        out = np.empty(h.shape, _F32)
    t = _torch(h, out)
    if t is None:
        np.copyto(out, h, casting="same_kind")
    else:
        t.from_numpy(out).copy_(t.from_numpy(h))
    return out


def _copy_records(kv: np.ndarray) -> np.ndarray:
    """The array's own bytes as [L, record bytes], copied: a record never aliases the caller."""
    return np.array(kv, order="C", copy=True).reshape(kv.shape[0], -1).view(_U8)


def _to_f32(kv: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 array with the values of ``kv`` (no copy when already float32)."""
    if dtype == "float32":
        return kv
    if dtype == "float16":
        return _f16_to_f32(kv)
    return _bf16_bits_to_f32(kv)


def _round_f16(x: np.ndarray, dst: np.ndarray) -> None:
    """Store float32 ``x`` as float16 into ``dst`` (rounding to nearest even), then replace ``x``
    by the stored values (exact), so the caller computes with exactly what was stored."""
    t = _torch(x, dst)
    if t is None:
        np.copyto(dst, x, casting="same_kind")
        np.copyto(x, dst)
    else:
        tx = t.from_numpy(x)
        td = t.from_numpy(dst)
        td.copy_(tx)
        tx.copy_(td)


def _params_f32(p: np.ndarray) -> np.ndarray:
    """Stored quantization parameters (float16 or float32) as a new float32 array."""
    return _f16_to_f32(p) if p.dtype == _F16 else p.astype(_F32)


def _store_f32(x: np.ndarray, out: np.ndarray, dtype: str) -> None:
    """Write float32 values ``x`` into ``out`` in compute dtype ``dtype``."""
    if dtype == "bfloat16":
        _f32_to_bf16_bits(x, out=out)
    else:
        np.copyto(out, x, casting="same_kind")


# -- codecs ----------------------------------------------------------------------------------------


class _Codec:
    """One level: ``encode`` to per-layer records, ``decode`` into a compute-dtype array."""

    name: str = ""
    version: int = 1

    def nominal_bits(self, dtype: str) -> int:
        raise NotImplementedError

    def record_nbytes(self, layer_shape: tuple[int, ...], dtype: str, params: str = "f16") -> int:
        raise NotImplementedError

    def encode(self, kv: np.ndarray, dtype: str) -> tuple[np.ndarray, str]:
        """kv [L,2,H,T,D] -> (uint8 [L, record_nbytes], params dtype name)."""
        raise NotImplementedError

    def decode(self, enc: EncodedChunk, out: np.ndarray, stream: bool = False) -> None:
        """Decode into ``out``. ``stream``: the write is much larger than the caches (see
        :func:`decode`); codecs without a native kernel ignore the hint."""
        raise NotImplementedError


class _Raw(_Codec):
    """The compute dtype's own bytes: bit-exact."""

    name = "raw"

    def nominal_bits(self, dtype: str) -> int:
        return COMPUTE_DTYPES[dtype].itemsize * 8

    def record_nbytes(self, layer_shape, dtype, params=""):
        return math.prod(layer_shape) * COMPUTE_DTYPES[dtype].itemsize

    def encode(self, kv, dtype):
        return _copy_records(kv), ""

    def decode(self, enc, out, stream=False):
        src = enc.payload.view(COMPUTE_DTYPES[enc.dtype]).reshape(enc.shape)
        t = _torch(out, src) if enc.dtype == "float32" else None
        if t is None:
            np.copyto(out, src)
        else:  # torch copies on the process's threads (1.4x faster on 2 cores), numpy on one
            t.from_numpy(out).copy_(t.from_numpy(src))


class _Half(_Codec):
    """16-bit floats: ``fp16`` (IEEE half) or ``bf16`` (float32's top half); bit-exact from itself."""

    def __init__(self, name: str, native: str):
        self.name = name
        self.native = native  # the compute dtype this level stores bit-exactly

    def nominal_bits(self, dtype):
        return 16

    def record_nbytes(self, layer_shape, dtype, params=""):
        return math.prod(layer_shape) * 2

    def encode(self, kv, dtype):
        if dtype == self.native:
            return _copy_records(kv), ""
        x = _to_f32(kv, dtype)
        buf = _f32_to_f16(x) if self.name == "fp16" else _f32_to_bf16_bits(x)
        return buf.reshape(kv.shape[0], -1).view(_U8), ""

    def decode(self, enc, out, stream=False):
        src = enc.payload.view(_U16).reshape(enc.shape)
        if enc.dtype == self.native:
            np.copyto(out, src.view(COMPUTE_DTYPES[self.native]))
        elif self.name == "fp16" and enc.dtype == "float32":
            _f16_to_f32(src.view(_F16), out=out)
        elif self.name == "bf16" and enc.dtype == "float32":
            _bf16_bits_to_f32(src, out=out)
        else:  # fp16 <-> bfloat16 compute: through float32
            x = _f16_to_f32(src.view(_F16)) if self.name == "fp16" else _bf16_bits_to_f32(src)
            _store_f32(x, out, enc.dtype)


class _Quant(_Codec):
    """Channel-wise asymmetric linear quantization to ``bits`` per value, packed into bytes."""

    def __init__(self, bits: int):
        self.bits, self.name = bits, f"q{bits}"
        self.qmax = (1 << bits) - 1
        self.group = 8 // bits  # values per byte

    def nominal_bits(self, dtype):
        return self.bits

    def _packed(self, n: int) -> int:
        return -(-n // self.group)

    def record_nbytes(self, layer_shape, dtype, params="f16"):
        _, h, _, d = layer_shape
        return 2 * 2 * h * d * PARAM_DTYPES[params].itemsize + self._packed(math.prod(layer_shape))

    def params(self, mn: np.ndarray, mx: np.ndarray, nl: int, packed_nbytes: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
        """Zero points and scales from per-channel min and max [nl*C] (see module docstring).

        Returns (records, z, s, parameter dtype name): new records uint8 [nl, record bytes] with z
        and s stored in their parameter area (``packed_nbytes`` per layer left for the values),
        and z, s as float32 [nl*C], exactly the stored values.
        """
        c = len(mn) // nl
        amax = np.negative(mn)
        np.maximum(amax, mx, out=amax)  # max(|min|, |max|) since min <= max
        big = float(amax.max())
        if big < 65000.0:  # also False for nan
            buf = np.empty((nl, 4 * c + packed_nbytes), _U8)
            pv = buf[:, :4 * c].view(_F16).reshape(nl, 2, c)  # [nl, z|s, C]
            # Directed fp16 rounding without nextafter: a margin of 2^-10 |v| + 2^-24 exceeds half
            # an fp16 ulp (2^-11 |v| normal, 2^-25 subnormal), so round-to-nearest of v - margin is
            # <= v and of s + margin is >= s. Each is rounded straight into the records and read
            # back, so z and s are exactly the stored values.
            z = amax
            z *= _F32(2.0**-10)
            z += _F32(2.0**-24)
            np.subtract(mn, z, out=z)
            _round_f16(z.reshape(nl, -1), pv[:, 0])
            s = np.subtract(mx, z)
            s *= _F32((1.0 + 2.0**-10) / self.qmax)
            s += _F32(2.0**-24)
            _round_f16(s.reshape(nl, -1), pv[:, 1])
            return buf, z, s, "f16"
        if not np.isfinite(big):
            raise ValueError("KV chunk holds inf or nan; quantized levels need finite values")
        buf = np.empty((nl, 8 * c + packed_nbytes), _U8)
        s = np.maximum((mx - mn) * _F32(1.0 / self.qmax), amax * _F32(2.0**-16))
        pv = buf[:, :8 * c].view(_F32).reshape(nl, 2, c)
        pv[:, 0] = mn.reshape(nl, c)
        pv[:, 1] = s.reshape(nl, c)
        return buf, mn, s, "f32"

    def encode(self, kv, dtype):
        nl, _, h, t, d = kv.shape
        c = 2 * h * d  # channels per layer
        n = t * c  # values per layer
        lib = _kvq() if dtype == "float32" and t % self.group == 0 else None
        st = _f32_strides(kv) if lib is not None else None
        if st is not None:
            buf = np.empty((nl, 4 * c + self._packed(n)), _U8)
            if lib.kvq_encode_f16 is not None and not lib.kvq_encode_f16(
                    kv.ctypes.data, nl, h, t, d, *st, self.bits, buf.ctypes.data, buf.shape[1]):
                return buf, "f16"
            mn, mx = np.empty(nl * c, _F32), np.empty(nl * c, _F32)
            if not lib.kvq_minmax(kv.ctypes.data, nl, h, t, d, *st, mn.ctypes.data, mx.ctypes.data):
                buf, z, s, params = self.params(mn, mx, nl, self._packed(n))
                inv, bias = _inv_bias(z, s)
                lib.kvq_quantize(kv.ctypes.data, nl, h, t, d, *st, inv.ctypes.data, bias.ctypes.data,
                                 self.bits, buf.ctypes.data, buf.shape[1], 2 * c * PARAM_DTYPES[params].itemsize)
                return buf, params
            # a NaN: the reference path below reports it
        # Token-major working copy X [T, L*2*H*D]: the min/max over tokens becomes a reduction over
        # the outer axis, and the per-channel affine map broadcasts over the outer axis too, so
        # every big numpy op runs over long contiguous rows (3x faster than broadcasting over
        # a middle axis with 64-value inner loops). The records keep this order: [T, 2, H, D].
        x5 = _scratch.get("xt", (t, nl, 2, h, d), _F32)
        if dtype == "bfloat16":
            np.left_shift(kv.transpose(3, 0, 1, 2, 4), _U32(16), out=x5.view(_U32), dtype=_U32)
        else:
            np.copyto(x5, kv.transpose(3, 0, 1, 2, 4), casting="same_kind")
        x = x5.reshape(t, nl * c)
        mn = np.minimum.reduce(x, axis=0)
        mx = np.maximum.reduce(x, axis=0)
        buf, z, s, params = self.params(mn, mx, nl, self._packed(n))
        p_nbytes = 2 * c * PARAM_DTYPES[params].itemsize

        inv, bias = _inv_bias(z, s)
        x *= inv
        x += bias  # x = (x - z)/s + 1/2, in [0, qmax + 1); the cast to uint8 truncates, i.e. floors
        # (adding straight into a uint8 output is slower: numpy buffers mixed-dtype loops)
        xq = x.reshape(t, nl, c).transpose(1, 0, 2)  # [L, T, C] view
        dst = buf[:, p_nbytes:]
        if self.bits == 8:
            np.copyto(dst.reshape(nl, t, c), xq, casting="unsafe")
            return buf, params
        g = self.group
        if t % g == 0:  # the g contiguous parts of a record are token ranges: pack token-major
            qt = _scratch.get("qt", (t, nl, c), _U8)
            np.copyto(qt.reshape(t, nl * c), x, casting="unsafe")
            parts = qt.reshape(g, t // g, nl, c)
            acc = _scratch.get("acc", (t // g, nl, c), _U8)
            np.copyto(acc, parts[g - 1])
            for k in range(g - 2, -1, -1):  # acc = (((p3 << 2 | p2) << 2 | p1) << 2) | p0
                acc <<= _U8(self.bits)
                acc |= parts[k]
            np.copyto(dst.reshape(nl, t // g, c), acc.transpose(1, 0, 2))
            return buf, params
        q = _scratch.get("q", (nl, dst.shape[1] * g), _U8)
        if q.shape[1] != n:
            q[:, n:] = 0
        np.copyto(q[:, :n].reshape(nl, t, c), xq, casting="unsafe")
        parts = q.reshape(nl, g, -1)
        np.copyto(dst, parts[:, g - 1])
        for k in range(g - 2, -1, -1):
            np.left_shift(dst, self.bits, out=dst)
            np.bitwise_or(dst, parts[:, k], out=dst)
        return buf, params

    def decode(self, enc, out, stream: bool = False):
        nl, _, h, t, d = enc.shape
        c = 2 * h * d
        n = t * c
        pdt = PARAM_DTYPES[enc.params]
        p_nbytes = 2 * c * pdt.itemsize
        lib = (_kvq() if enc.dtype == "float32" and t % self.group == 0 and out.flags.writeable
               and enc.payload.flags.c_contiguous else None)
        st = _f32_strides(out) if lib is not None else None
        if st is not None:
            payload = enc.payload  # C-contiguous [L, record bytes] (EncodedChunk invariant); read only
            if lib.kvq_dequantize(payload.ctypes.data, payload.shape[1], nl, h, t, d, self.bits,
                                  enc.params == "f32", out.ctypes.data, *st, int(stream)) != 0:
                raise MemoryError("no memory for a layer's quantization parameters")
            return
        pv = enc.payload[:, :p_nbytes].view(pdt)
        torch = (_torch(out) if enc.dtype == "float32" and t % self.group == 0
                 and enc.record_nbytes % pdt.itemsize == 0 else None)
        if torch is not None:
            self._decode_torch(torch, enc, out)
            return
        z = _params_f32(pv[:, :c])  # [L, C]
        s = _params_f32(pv[:, c:])  # [L, C]
        packed = enc.payload[:, p_nbytes:]
        if self.bits == 8:
            q = packed
        else:
            parts = _scratch.get("parts", (nl, self.group, packed.shape[1]), _U8)
            mask = _U8(self.qmax)
            for g in range(self.group):
                np.right_shift(packed, _U8(g * self.bits), out=parts[:, g])
                if g < self.group - 1:
                    np.bitwise_and(parts[:, g], mask, out=parts[:, g])
            q = parts.reshape(nl, -1)[:, :n]
        # Same trick as encode: dequantize token-major [T, L, C] so the affine map broadcasts over
        # the outer axis, then one transposing copy into the caller's [L, 2, H, T, D] view (a
        # strided slot of a context buffer is touched once, write-only). Widening uint8 inside the
        # multiply is slower than this separate copy (numpy's mixed-dtype loops are buffered).
        x = _scratch.get("xt", (t, nl, 2, h, d), _F32).reshape(t, nl, c)  # shared with encode
        np.copyto(x, q.reshape(nl, t, c).transpose(1, 0, 2))
        x *= s
        x += z
        xv = x.reshape(t, nl, 2, h, d).transpose(1, 2, 3, 0, 4)
        if enc.dtype == "float32":
            np.copyto(out, xv)
        else:
            _store_f32(xv, out, enc.dtype)

    def _decode_torch(self, torch, enc: EncodedChunk, out: np.ndarray) -> None:
        """The float32 decode in torch, straight into ``out``: one broadcast shift and mask unpack
        the packed parts (token ranges, since T is a multiple of the values per byte) into a
        token-major uint8 array, one transposing copy widens it into ``out``, then one
        ``out = out*s + z``.

        Why: numpy's path makes four passes over a float32 scratch copy on one core (~0.28 ms a
        q8 chunk); this one makes two over ``out`` on the process's torch threads (~0.15 ms on
        2 cores, ~0.25 on one), and few enough small ops that a chunk's fixed cost stays ~25 us.
        Same arithmetic (a product, then a sum, each rounded), so the same values as numpy's path
        (tested).
        """
        nl, _, h, t, d = enc.shape
        payload = enc.payload
        if not payload.flags.writeable:  # object store, mapped file: copy the small payload
            payload = _scratch.get("payload", payload.shape, _U8)
            np.copyto(payload, enc.payload)
        p = torch.from_numpy(payload)
        p_nbytes = payload.shape[1] - self._packed(t * 2 * h * d)
        zs = p[:, :p_nbytes].view(torch.float16 if enc.params == "f16" else torch.float32)
        zs = zs.view(nl, 2, 2, h, 1, d).float()  # [L, z|s, K/V, H, 1, D]
        packed = p[:, p_nbytes:]
        if self.bits < 8:  # [L, parts, N/parts]: part k holds tokens k*T/parts .. (k+1)*T/parts
            packed = (packed.unsqueeze(1) >> _shifts(torch, self.bits)) & self.qmax
        o = torch.from_numpy(out)
        o.copy_(packed.reshape(nl, t, 2, h, d).permute(0, 2, 3, 1, 4))
        torch.addcmul(zs[:, 0], o, zs[:, 1], out=o)

    def scales(self, enc: EncodedChunk) -> np.ndarray:
        """Stored per-channel scales [L,2,H,1,D] as float32 (the error bound is half of them)."""
        nl, _, h, _, d = enc.shape
        pdt = PARAM_DTYPES[enc.params]
        c = 2 * h * d
        return enc.payload[:, : 2 * c * pdt.itemsize].view(pdt)[:, c:].astype(_F32).reshape(
            nl, 2, h, 1, d)


_SHIFT_TENSORS: dict[int, object] = {}


def _shifts(torch, bits: int):
    """uint8 [1, 8/bits, 1] tensor of the bit offsets of a byte's packed values (cached)."""
    t = _SHIFT_TENSORS.get(bits)
    if t is None:
        t = _SHIFT_TENSORS[bits] = torch.arange(0, 8, bits, dtype=torch.uint8).view(1, 8 // bits, 1)
    return t


#: the one registry of levels, by name
CODECS: dict[str, _Codec] = {c.name: c for c in (
    _Raw(), _Half("fp16", "float16"), _Half("bf16", "bfloat16"), _Quant(8), _Quant(4), _Quant(2))}


def codec(level: str) -> _Codec:
    """The codec registered under ``level``; UnknownLevelError lists the valid names."""
    try:
        return CODECS[level]
    except (KeyError, TypeError):
        raise UnknownLevelError(
            f"unknown KV level {level!r}; valid levels: {', '.join(CODECS)}") from None


def _check_shape(shape: Sequence[int]) -> tuple[int, int, int, int, int]:
    if len(shape) != 5 or shape[1] != 2 or min(shape) < 1:
        raise ValueError(f"KV chunk shape must be [L, 2, Hkv, T, D] with positive sizes, got {shape}")
    return tuple(int(v) for v in shape)  # type: ignore[return-value]


def nominal_bits(level: str, dtype: str = "float32") -> int:
    """Nominal bits per value (raw: the compute dtype's width) for the compression planner."""
    return codec(level).nominal_bits(dtype)


def stored_nbytes(level: str, shape: Sequence[int], dtype: str = "float32",
                  params: str = "f16") -> int:
    """Payload bytes of a chunk of ``shape`` at ``level`` including scales and zero points.

    This is before lz4 (which gains little on quantized data) and without the file header.
    """
    shape = _check_shape(shape)
    return shape[0] * codec(level).record_nbytes(shape[1:], dtype, params)


def encode(kv: np.ndarray, level: str, *, dtype: str | None = None,
           first_layer: int = 0) -> EncodedChunk:
    """Encode ``kv`` [L,2,Hkv,T,D] (compute dtype; uint16 = bfloat16 bits) at ``level``."""
    c = codec(level)
    shape = _check_shape(kv.shape)
    dtype = dtype or dtype_name(kv)
    if COMPUTE_DTYPES[dtype] != kv.dtype:
        raise ValueError(f"dtype {dtype!r} does not match array dtype {kv.dtype}")
    payload, params = c.encode(kv, dtype)
    return EncodedChunk(c.name, c.version, dtype, shape, first_layer, params,
                        np.ascontiguousarray(payload))


def decode(enc: EncodedChunk, out: np.ndarray | None = None, *, stream: bool = False) -> np.ndarray:
    """Decode into ``out`` (shape ``enc.shape``, compute dtype; any strides) and return it.

    ``stream``: a hint that ``out`` belongs to a write much larger than the caches (a whole context
    into a working set); the quantized levels' native kernel then writes past the caches with
    non-temporal stores (the same values). On the 2-core Xeon test VM a 74 MB decode took 4.2 ms
    that way against 8.2 ms with ordinary stores, while below ~32 MB ordinary stores win
    (docs/benchmarks.md, "Context switching", session 17)."""
    c = codec(enc.level)
    if enc.version != c.version:
        raise ChunkVersionError(f"{enc.level} payload version {enc.version}; this code reads "
                                f"version {c.version}")
    want = COMPUTE_DTYPES[enc.dtype]
    if enc.payload.dtype != _U8 or enc.payload.shape != (
            enc.shape[0], c.record_nbytes(enc.shape[1:], enc.dtype, enc.params or "f16")):
        raise CorruptChunkError(f"{enc.level} payload of shape {enc.payload.shape} does not fit "
                                f"chunk shape {enc.shape}")
    if out is None:
        out = np.empty(enc.shape, want)
    elif out.shape != tuple(enc.shape) or out.dtype != want:
        raise ValueError(f"out must be {want} {tuple(enc.shape)}, got {out.dtype} {out.shape}")
    c.decode(enc, out, stream=stream)
    return out


def scales(enc: EncodedChunk) -> np.ndarray:
    """Per-channel scales [L,2,H,1,D] of a quantized chunk; max abs error is half of them."""
    c = codec(enc.level)
    if not isinstance(c, _Quant):
        raise ValueError(f"level {enc.level!r} has no scales")
    return c.scales(enc)


def _map(fn: Callable, items: Iterable, executor: Executor | None) -> list:
    return list(map(fn, items) if executor is None else executor.map(fn, items))


def encode_many(kvs: Iterable[np.ndarray], level: str, *, executor: Executor | None = None,
                dtype: str | None = None) -> list[EncodedChunk]:
    """Encode several chunks, in parallel over ``executor`` (e.g. a 2-thread pool) when given."""
    return _map(lambda kv: encode(kv, level, dtype=dtype), kvs, executor)


def decode_many(encs: Sequence[EncodedChunk], outs: Sequence[np.ndarray], *,
                executor: Executor | None = None) -> list[np.ndarray]:
    """Decode several chunks into their ``outs``, in parallel over ``executor`` when given."""
    if len(encs) != len(outs):
        raise ValueError(f"{len(encs)} chunks but {len(outs)} outputs")
    return _map(lambda pair: decode(*pair), zip(encs, outs), executor)
