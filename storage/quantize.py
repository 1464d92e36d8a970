"""The quantized levels q8, q4, q2: channel-wise asymmetric linear quantization, packed into bytes.

This module deliberately knows nothing about the other levels, the codec registry, files or which
level a chunk should get: it maps float arrays to quantized records and back.

For every layer and every (K/V, head, channel d) the chunk's T tokens give ``min`` and ``max``; with
``qmax = 2^bits-1`` (LLMS §3.2 channel-wise linear, MNN-LLM Eq. 1 asymmetric)

    z = fp16 round-down of min,   s = fp16 round-up of (max - z)/qmax   (both stored, fp16)
    q = floor((x - z)/s + 1/2) in [0, qmax],   x' = q*s + z,   so |x - x'| <= s/2

The directed roundings keep every value inside ``[z, z + qmax*s]``, so the bound holds for the
stored parameters; they widen a channel's range by at most 2^-10 max(|min|,|max|) + 2^-24. A chunk
with any |value| >= 65000 keeps float32 parameters (``params == "f32"``, 8 C bytes per layer,
``z = min``, ``s >= max(|min|,|max|) * 2^-16``). A layer record is the parameters (z then s, C
channels each) followed by the values token-major, ``[T, 2, Hkv, D]``; sub-byte values are packed
by splitting a layer's N values into 8/bits contiguous parts and OR-ing the shifted parts into one
byte.

Why the code looks as it does: numpy ops that broadcast over a middle axis run short inner loops
and are much slower than long contiguous ones, so a chunk is first copied token-major
``[T, L*2*H*D]``: the min/max become reductions over the outer axis and the affine map broadcasts
over the outer axis; decode dequantizes token-major and transposes once into the caller's view.
Work arrays come from per-thread scratch. float32 decodes run in torch when the process has loaded
it (on its threads), and where a C compiler is available float32 chunks run in the compiled kernels
of ``storage/kvquant.c`` instead (:mod:`engine.native` builds them): the encode is one pass per
layer while the layer is in cache (min/max, parameters, quantize and pack), the decode one pass
writing ``out``; the same operations in the same order, so the same bytes and values as numpy's
path (tested; docs/benchmarks.md, "Native codec kernels").
"""

from __future__ import annotations

import ctypes
import math
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine import native
from storage.floatcast import params_f32, round_f16, store_f32, torch_if_loaded

if TYPE_CHECKING:
    from storage.codecs import EncodedChunk

#: quantization parameter dtype name (what ``EncodedChunk.params`` says) -> numpy dtype
PARAM_DTYPES: dict[str, np.dtype] = {"f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}
_F32, _F16, _U8, _U32 = np.float32, np.float16, np.uint8, np.uint32
_KVQUANT_C = Path(__file__).with_name("kvquant.c")


class _Scratch(threading.local):
    """Per-thread reusable work arrays.

    Why: a fresh numpy array above glibc's mmap threshold costs a page fault per 4 KiB on first
    touch, a large share of a chunk's encode time for temporaries of a chunk's size.
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


#: use the compiled kernels of storage/kvquant.c for float32 q8/q4/q2 when they build (tests switch it off)
USE_NATIVE = True
_KERNELS: list = []  # [library or None], filled on first use


def kernels():
    """The kvquant library with its signatures declared, or None (off, or no compiler here)."""
    if not USE_NATIVE:
        return None
    if not _KERNELS:
        lib = native.load("kvquant", _KVQUANT_C)
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
        _KERNELS.append(lib)
    return _KERNELS[0]


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



class QuantCodec:
    """Channel-wise asymmetric linear quantization to ``bits`` per value, packed into bytes: the codec
    of level ``q<bits>`` (the interface of :class:`storage.codecs.Codec`)."""

    version = 1

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
            round_f16(z.reshape(nl, -1), pv[:, 0])
            s = np.subtract(mx, z)
            s *= _F32((1.0 + 2.0**-10) / self.qmax)
            s += _F32(2.0**-24)
            round_f16(s.reshape(nl, -1), pv[:, 1])
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
        lib = kernels() if dtype == "float32" and t % self.group == 0 else None
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
        # every big numpy op runs over long contiguous rows (much faster than broadcasting over
        # a middle axis with short inner loops). The records keep this order: [T, 2, H, D].
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
        lib = (kernels() if enc.dtype == "float32" and t % self.group == 0 and out.flags.writeable
               and enc.payload.flags.c_contiguous else None)
        st = _f32_strides(out) if lib is not None else None
        if st is not None:
            payload = enc.payload  # C-contiguous [L, record bytes] (EncodedChunk invariant); read only
            if lib.kvq_dequantize(payload.ctypes.data, payload.shape[1], nl, h, t, d, self.bits,
                                  enc.params == "f32", out.ctypes.data, *st, int(stream)) != 0:
                raise MemoryError("no memory for a layer's quantization parameters")
            return
        pv = enc.payload[:, :p_nbytes].view(pdt)
        torch = (torch_if_loaded(out) if enc.dtype == "float32" and t % self.group == 0
                 and enc.record_nbytes % pdt.itemsize == 0 else None)
        if torch is not None:
            self._decode_torch(torch, enc, out)
            return
        z = params_f32(pv[:, :c])  # [L, C]
        s = params_f32(pv[:, c:])  # [L, C]
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
            store_f32(xv, out, enc.dtype)

    def _decode_torch(self, torch, enc: EncodedChunk, out: np.ndarray) -> None:
        """The float32 decode in torch, straight into ``out``: one broadcast shift and mask unpack
        the packed parts (token ranges, since T is a multiple of the values per byte) into a
        token-major uint8 array, one transposing copy widens it into ``out``, then one
        ``out = out*s + z``.

        Why: numpy's path makes four passes over a float32 scratch copy on one core; this one makes
        two over ``out`` on the process's torch threads, in few enough small ops that a chunk's
        fixed cost stays small.
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

