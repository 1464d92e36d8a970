"""Float conversions the codecs share: float32 <-> float16 and bfloat16 bits, with a torch fast path.

This module deliberately knows nothing about codecs, levels or chunk shapes: it converts arrays.

bfloat16 travels as its uint16 bit pattern (numpy has no bfloat16). numpy converts between float32
and float16 one value at a time, while torch uses vectorised instructions; so when the process has
already imported torch (every process that runs the model has) the casts run in torch's kernels.
This module never imports torch itself, so a store-only process stays light. Both paths round to
nearest even, so their bytes are identical (tested). Arrays torch cannot wrap without a warning or
an error (read-only, unaligned, odd strides) stay on numpy.
"""

from __future__ import annotations

import sys

import numpy as np

_F32, _F16, _U16, _U32 = np.float32, np.float16, np.uint16, np.uint32

#: use torch for float32 <-> float16 casts when the process has imported it (tests switch it off)
USE_TORCH = True


def torch_if_loaded(*arrays: np.ndarray):
    """The torch module when this process has already imported it and may wrap ``arrays``, else None."""
    if not USE_TORCH:
        return None
    t = sys.modules.get("torch")
    if t is None or not all(_wrappable(a) for a in arrays):
        return None
    return t


def _wrappable(a: np.ndarray) -> bool:
    """torch.from_numpy takes it: writable, aligned, non-negative whole-element strides."""
    return (a.flags.writeable and a.flags.aligned
            and all(st >= 0 and st % a.itemsize == 0 for st in a.strides))


def bf16_bits_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bit patterns -> float32 values (exact); ``out`` float32 of the same shape."""
    if out is None:
        out = np.empty(bits.shape, _F32)
    np.left_shift(bits, _U32(16), out=out.view(_U32), dtype=_U32)
    return out


def f32_to_bf16_bits(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding half away from zero (|err| <= 2^-8 |x|)."""
    if out is None:
        out = np.empty(x.shape, _U16)
    # Adding half a bf16 ulp to the magnitude bits then truncating rounds to nearest (ties away).
    t = np.add(x.view(_U32), _U32(0x8000), dtype=_U32)
    np.right_shift(t, _U32(16), out=out, casting="unsafe")
    return out


def f32_to_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> a new C-contiguous float16 array, rounding to nearest even (inf on overflow)."""
    t = torch_if_loaded(x)
    if t is None:
        with np.errstate(over="ignore"):  # overflow to inf is the documented result
            return x.astype(_F16, order="C")
    return t.from_numpy(x).to(t.float16, memory_format=t.contiguous_format).numpy()


def f16_to_f32(h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float16 -> float32 (exact) into ``out`` (any strides) or a new array."""
    if out is None:
        out = np.empty(h.shape, _F32)
    t = torch_if_loaded(h, out)
    if t is None:
        np.copyto(out, h, casting="same_kind")
    else:
        t.from_numpy(out).copy_(t.from_numpy(h))
    return out


def to_f32(kv: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 array with the values of ``kv`` in compute dtype ``dtype`` (no copy when already
    float32)."""
    if dtype == "float32":
        return kv
    if dtype == "float16":
        return f16_to_f32(kv)
    return bf16_bits_to_f32(kv)


def round_f16(x: np.ndarray, dst: np.ndarray) -> None:
    """Store float32 ``x`` as float16 into ``dst`` (rounding to nearest even), then replace ``x``
    by the stored values (exact), so the caller computes with exactly what was stored."""
    t = torch_if_loaded(x, dst)
    if t is None:
        np.copyto(dst, x, casting="same_kind")
        np.copyto(x, dst)
    else:
        tx = t.from_numpy(x)
        td = t.from_numpy(dst)
        td.copy_(tx)
        tx.copy_(td)


def params_f32(p: np.ndarray) -> np.ndarray:
    """Stored quantization parameters (float16 or float32) as a new float32 array."""
    return f16_to_f32(p) if p.dtype == _F16 else p.astype(_F32)


def store_f32(x: np.ndarray, out: np.ndarray, dtype: str) -> None:
    """Write float32 values ``x`` into ``out`` in compute dtype ``dtype``."""
    if dtype == "bfloat16":
        f32_to_bf16_bits(x, out=out)
    else:
        np.copyto(out, x, casting="same_kind")
