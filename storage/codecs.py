"""KV chunk codecs: pure encode/decode pairs, one per compression level, chosen by name.

This module deliberately knows nothing about files, lz4, headers or which level a chunk should get:
it maps arrays to bytes and back.

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

Quantized levels (:mod:`storage.quantize`): channel-wise asymmetric linear quantization with fp16
(or, for huge values, float32) zero points and scales per layer and channel; the error bound and
record layout are stated there. Float conversions (:mod:`storage.floatcast`) run in torch's
vectorised kernels when the process has already imported torch; this module never imports it, and
the bytes are the same either way. :func:`encode_many` / :func:`decode_many` take an executor:
numpy, torch and the compiled kernels release the GIL.

A ``kv8`` working set (engine/kvformat.py: int8 keys, fp8 e4m3 values, a float32 scale per token and
head) hands over its chunks as uint8 ``[L, 2, Hkv, T, D + 4]``: ``raw`` stores those bytes as they are;
the other levels encode the de-quantized values (converted through torch, imported then) and decode
back into kv8 rows, re-quantized once. An :class:`EncodedChunk`'s ``shape`` is always the logical
``[L, 2, Hkv, T, D]``; :func:`array_shape` gives the array's.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from engine.config import KV8_SCALE_BYTES
from storage.errors import ChunkVersionError, CorruptChunkError, UnknownCodecError
from storage.floatcast import (bf16_bits_to_f32, f16_to_f32, f32_to_bf16_bits, f32_to_f16, store_f32,
                               to_f32, torch_if_loaded)
from storage.quantize import QuantCodec

if sys.byteorder != "little":  # bf16 halves and on-disk records assume little-endian words
    raise ImportError("storage.codecs supports little-endian machines only")

#: compute dtype name -> numpy dtype that carries it (bfloat16 travels as its uint16 bit pattern)
COMPUTE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "kv8": np.dtype(np.uint8),
}
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                np.dtype(np.uint16): "bfloat16", np.dtype(np.uint8): "kv8"}
_F16, _U8, _U16 = np.float16, np.uint8, np.uint16


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
    """Compute dtype name of an array (uint16 means bfloat16 bits, uint8 kv8 rows)."""
    try:
        return _DTYPE_NAMES[kv.dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {kv.dtype}; valid: float32, float16, "
                         "uint16 (bfloat16 bits), uint8 (kv8 rows)") from None


def array_shape(shape: Sequence[int], dtype: str) -> tuple[int, ...]:
    """The shape of the array that carries K/V of logical ``shape`` (``[..., D]``) in ``dtype``."""
    shape = tuple(int(v) for v in shape)
    return shape[:-1] + (shape[-1] + KV8_SCALE_BYTES,) if dtype == "kv8" else shape


def _logical_shape(kv: np.ndarray, dtype: str) -> tuple[int, ...]:
    if dtype != "kv8":
        return kv.shape
    if kv.shape[-1] <= KV8_SCALE_BYTES:
        raise ValueError(f"kv8 rows of {kv.shape[-1]} bytes hold no values")
    return kv.shape[:-1] + (kv.shape[-1] - KV8_SCALE_BYTES,)


def _kv8_to_f32(kv: np.ndarray) -> np.ndarray:
    import torch  # only kv8 chunks encoded at another level come here

    from engine import kvformat

    return kvformat.unpack(torch.from_numpy(np.ascontiguousarray(kv))).numpy()


def _f32_to_kv8(x: np.ndarray, out: np.ndarray) -> None:
    import torch

    from engine import kvformat

    kvformat.pack(torch.from_numpy(x), out=torch.from_numpy(out))


class Codec(Protocol):
    """One level: ``encode`` to per-layer records, ``decode`` into a compute-dtype array."""

    name: str  # the level's name, its key in CODECS
    version: int  # written beside every payload; decode refuses another

    def nominal_bits(self, dtype: str) -> int:
        """Nominal bits per value when the compute dtype is ``dtype``."""

    def record_nbytes(self, layer_shape: tuple[int, ...], dtype: str, params: str = "f16") -> int:
        """Bytes of one layer's record for a layer of ``layer_shape`` [2, Hkv, T, D]."""

    def encode(self, kv: np.ndarray, dtype: str) -> tuple[np.ndarray, str]:
        """kv [L,2,H,T,D] -> (uint8 [L, record_nbytes], params dtype name)."""

    def decode(self, enc: EncodedChunk, out: np.ndarray, stream: bool = False) -> None:
        """Decode into ``out``. ``stream``: the write is much larger than the caches (see
        :func:`decode`); codecs without a native kernel ignore the hint."""


def _copy_records(kv: np.ndarray) -> np.ndarray:
    """The array's own bytes as [L, record bytes], copied: a record never aliases the caller."""
    return np.array(kv, order="C", copy=True).reshape(kv.shape[0], -1).view(_U8)


class _Raw:
    """The compute dtype's own bytes: bit-exact."""

    name = "raw"
    version = 1

    def nominal_bits(self, dtype: str) -> int:
        return COMPUTE_DTYPES[dtype].itemsize * 8

    def record_nbytes(self, layer_shape, dtype, params=""):
        return math.prod(array_shape(layer_shape, dtype)) * COMPUTE_DTYPES[dtype].itemsize

    def encode(self, kv, dtype):
        return _copy_records(kv), ""

    def decode(self, enc, out, stream=False):
        src = enc.payload.view(COMPUTE_DTYPES[enc.dtype]).reshape(array_shape(enc.shape, enc.dtype))
        t = torch_if_loaded(out, src) if enc.dtype == "float32" else None
        if t is None:
            np.copyto(out, src)
        else:  # torch copies on the process's threads (faster on several cores), numpy on one
            t.from_numpy(out).copy_(t.from_numpy(src))


class _Half:
    """16-bit floats: ``fp16`` (IEEE half) or ``bf16`` (float32's top half); bit-exact from itself."""

    version = 1

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
        x = to_f32(kv, dtype)
        buf = f32_to_f16(x) if self.name == "fp16" else f32_to_bf16_bits(x)
        return buf.reshape(kv.shape[0], -1).view(_U8), ""

    def decode(self, enc, out, stream=False):
        src = enc.payload.view(_U16).reshape(enc.shape)
        if enc.dtype == self.native:
            np.copyto(out, src.view(COMPUTE_DTYPES[self.native]))
        elif self.name == "fp16" and enc.dtype == "float32":
            f16_to_f32(src.view(_F16), out=out)
        elif self.name == "bf16" and enc.dtype == "float32":
            bf16_bits_to_f32(src, out=out)
        else:  # fp16 <-> bfloat16 compute: through float32
            x = f16_to_f32(src.view(_F16)) if self.name == "fp16" else bf16_bits_to_f32(src)
            store_f32(x, out, enc.dtype)


#: the one registry of levels, by name
CODECS: dict[str, Codec] = {c.name: c for c in (
    _Raw(), _Half("fp16", "float16"), _Half("bf16", "bfloat16"), QuantCodec(8), QuantCodec(4),
    QuantCodec(2))}


def codec(level: str) -> Codec:
    """The codec registered under ``level``; UnknownCodecError lists the valid names."""
    try:
        return CODECS[level]
    except (KeyError, TypeError):
        raise UnknownCodecError(
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
    """Encode ``kv`` [L,2,Hkv,T,D] (compute dtype; uint16 = bfloat16 bits; kv8 rows) at ``level``."""
    c = codec(level)
    dtype = dtype or dtype_name(kv)
    if COMPUTE_DTYPES.get(dtype) != kv.dtype:
        raise ValueError(f"dtype {dtype!r} does not match array dtype {kv.dtype}")
    shape = _check_shape(_logical_shape(kv, dtype))
    if dtype == "kv8" and c.name != "raw":
        payload, params = c.encode(_kv8_to_f32(kv), "float32")
    else:
        payload, params = c.encode(kv, dtype)
    return EncodedChunk(c.name, c.version, dtype, shape, first_layer, params,
                        np.ascontiguousarray(payload))


def decode(enc: EncodedChunk, out: np.ndarray | None = None, *, stream: bool = False) -> np.ndarray:
    """Decode into ``out`` (shape ``enc.shape``, compute dtype; any strides) and return it.

    ``stream``: a hint that ``out`` belongs to a write much larger than the caches (a whole context
    into a working set); the quantized levels' native kernel then writes past the caches with
    non-temporal stores (the same values), which pays only for large writes (docs/benchmarks.md,
    "Context switching")."""
    c = codec(enc.level)
    if enc.version != c.version:
        raise ChunkVersionError(f"{enc.level} payload version {enc.version}; this code reads "
                                f"version {c.version}")
    want = COMPUTE_DTYPES[enc.dtype]
    if enc.payload.dtype != _U8 or enc.payload.shape != (
            enc.shape[0], c.record_nbytes(enc.shape[1:], enc.dtype, enc.params or "f16")):
        raise CorruptChunkError(f"{enc.level} payload of shape {enc.payload.shape} does not fit "
                                f"chunk shape {enc.shape}")
    shape = array_shape(enc.shape, enc.dtype)
    if out is None:
        out = np.empty(shape, want)
    elif out.shape != shape or out.dtype != want:
        raise ValueError(f"out must be {want} {shape}, got {out.dtype} {out.shape}")
    if enc.dtype == "kv8" and c.name != "raw":  # re-quantized once from the level's values
        x = np.empty(enc.shape, np.float32)
        c.decode(replace(enc, dtype="float32"), x)
        _f32_to_kv8(x, out)
    else:
        c.decode(enc, out, stream=stream)
    return out


def scales(enc: EncodedChunk) -> np.ndarray:
    """Per-channel scales [L,2,H,1,D] of a quantized chunk; max abs error is half of them."""
    c = codec(enc.level)
    if not isinstance(c, QuantCodec):
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
