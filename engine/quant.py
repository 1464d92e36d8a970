"""Low-bit weight formats (MNN-LLM §4.2): what each format stores, and conversion into it.

This module deliberately knows nothing about torch, the model's layout, files or kernels: it turns
float matrices, or a GGUF file's Q4_0/Q4_1/Q8_0 blocks, into quantized values with their scales and
back, in numpy, one matrix (or one slice of rows) at a time.

The stored ("portable") values do not depend on the torch version or the CPU; kernels that want
another layout repack them at load (`engine.qlinear`).

- int4: group-wise asymmetric along the input dimension, `w = q * scale + min` with `q` in 0..15 and one
  float16 `scale` and `min` per row and group of `group` inputs (the last group of a row may be
  shorter). Values are packed two to a byte in blocks of 32 inputs: byte `i` of a block holds input
  `i` in its low nibble and input `i + 16` in its high nibble. That is GGUF's Q4_0/Q4_1 block layout,
  so those tensors repack without touching a value (`int4_from_gguf`). A symmetric int4 matrix (Q4_0's
  `w = (q - 8) * scale`) stores no minimums (`min` None: each is `-8 scale`), 18 bytes a block of 32
  instead of 20.
- int8: per output row symmetric, `w = q * scale` with `q` in -127..127 and one float32 `scale` a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
"""The formats `--weights` accepts; fp32 is the checkpoint as converted."""
HEAD_FORMATS = ("int8", "fp32")
"""What the LM head may be stored as under int8/int4 layers."""
BLOCK = 32
"""Inputs per packed int4 block (16 bytes)."""
GGUF_Q4_0, GGUF_Q4_1, GGUF_Q8_0 = 2, 3, 8
"""ggml type ids of the blocks read here."""
_GGUF_BLOCK_BYTES = {GGUF_Q4_0: 18, GGUF_Q4_1: 20, GGUF_Q8_0: 34}


class WeightFormatError(ValueError):
    code = "bad_weight_format"


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How the engine stores its weights."""

    name: str = "fp32"
    """One of `WEIGHT_FORMATS`."""
    group: int = 32
    """int4: inputs per scale and minimum (a multiple of 32)."""
    head: str = "int8"
    """int8/int4: the LM head's format (MNN-LLM §4.2 keeps it at int8: it weighs more on accuracy)."""
    calibrated: bool = False
    """int4: the layers' matrices quantized by GPTQ on calibration text (engine/gptq.py) instead of
    rounding each value to its nearest step (`-gptq` in the tag)."""

    def __post_init__(self) -> None:
        if self.name not in WEIGHT_FORMATS:
            raise WeightFormatError(f"unknown weight format {self.name!r}; valid: {', '.join(WEIGHT_FORMATS)}")
        if self.group < BLOCK or self.group % BLOCK:
            raise WeightFormatError(f"int4 group size {self.group} is not a positive multiple of {BLOCK}")
        if self.head not in HEAD_FORMATS:
            raise WeightFormatError(f"unknown head format {self.head!r}; valid: {', '.join(HEAD_FORMATS)}")
        if self.calibrated and self.name != "int4":
            raise WeightFormatError("only int4 is calibrated (-gptq)")

    @property
    def quantized(self) -> bool:
        return self.name in ("int8", "int4")

    @property
    def tag(self) -> str:
        """The format's name in cache files and KV keys: `fp32`, `bf16`, `int8`, `int4-g32`; a head
        other than int8 adds `-hfp32`."""
        if not self.quantized:
            return self.name
        tag = self.name if self.name == "int8" else f"int4-g{self.group}"
        tag = tag if self.head == "int8" else f"{tag}-h{self.head}"
        return f"{tag}-gptq" if self.calibrated else tag

    @classmethod
    def parse(cls, text: str) -> "WeightFormat":
        """`int4`, `int4-g128`, `int4-g32-hfp32`, `int4-g128-gptq`, `int8`, `bf16`, `fp32` (the inverse of
        `tag`)."""
        name, *rest = text.strip().lower().split("-")
        group, head, calibrated = 32, "int8", False
        for part in rest:
            if part == "gptq" and name == "int4":
                calibrated = True
            elif part.startswith("g") and part[1:].isdigit() and name == "int4":
                group = int(part[1:])
            elif part.startswith("h") and name in ("int8", "int4"):
                head = part[1:]
            else:
                raise WeightFormatError(f"cannot read weight format {text!r} (e.g. int4, int4-g128, int8, bf16)")
        return cls(name, group, head, calibrated)


# ---- int4 -----------------------------------------------------------------------------------------


def groups_of(k: int, group: int) -> int:
    """Scales per row of `k` inputs."""
    return -(-k // group)


def _check_cols(k: int) -> None:
    if k % BLOCK:
        raise WeightFormatError(f"input width {k} is not a multiple of {BLOCK}: cannot store it as int4")


def _group_extrema(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row and group minimum and maximum of `w` `[n, k]` (the last group may be shorter)."""
    n, k = w.shape
    full = k // group
    mins, maxs = [], []
    if full:
        g = w[:, : full * group].reshape(n, full, group)
        mins.append(g.min(axis=2))
        maxs.append(g.max(axis=2))
    if k % group:
        tail = w[:, full * group :]
        mins.append(tail.min(axis=1, keepdims=True))
        maxs.append(tail.max(axis=1, keepdims=True))
    return np.concatenate(mins, axis=1), np.concatenate(maxs, axis=1)


CLIP_STEPS = tuple((a, b) for a in (0.0, 0.05, 0.1, 0.15, 0.2) for b in (0.0, 0.05, 0.1, 0.15, 0.2))
"""(low, high) fractions of a group's range clipped off, tried by `quantize_int4`'s search."""


def _group_sums(v: np.ndarray, group: int) -> np.ndarray:
    """Per row and group sums of `v` `[n, k]` (the last group may be shorter): `[n, G]`."""
    n, k = v.shape
    full = k // group
    parts = [v[:, : full * group].reshape(n, full, group).sum(axis=2)] if full else []
    if k % group:
        parts.append(v[:, full * group :].sum(axis=1, keepdims=True))
    return np.concatenate(parts, axis=1)


def _expand(per_group: np.ndarray, k: int, group: int) -> np.ndarray:
    """`[n, G]` per-group values repeated over their inputs: `[n, k]`."""
    return np.repeat(per_group, group, axis=1)[:, :k]


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values 0..15 `[n, k]` -> the block layout `[n, k / 2]` uint8."""
    n, k = q.shape
    b = q.astype(np.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """The block layout `[n, k / 2]` -> values 0..15 `[n, k]` uint8."""
    n, half = packed.shape
    b = packed.reshape(n, half // (BLOCK // 2), 1, BLOCK // 2)
    return np.concatenate((b & 15, b >> 4), axis=2).reshape(n, 2 * half)


def quantize_int4(w: np.ndarray, group: int = 32, *, search: bool = True, importance: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float `w` `[n, k]` -> (packed `[n, k/2]` uint8, scale `[n, G]` float16, min `[n, G]` float16).

    Each group's range is its minimum to maximum, or (`search`) that range clipped at either end by
    the fractions in `CLIP_STEPS`, whichever gives the group the least squared error: an outlier
    then costs its own rounding instead of coarsening every other value's. `importance` `[k]` weighs
    each input's squared error in that search (engine.gptq passes the inputs' second moments, so a
    range fits the inputs that carry the signal). The scale and minimum are rounded to float16 first
    and the values quantized against the rounded ones."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise WeightFormatError(f"int4 quantizes matrices, not shape {w.shape}")
    _check_cols(w.shape[1])
    if not np.isfinite(w).all():
        raise WeightFormatError("weights hold NaN or infinity: cannot quantize them")
    k = w.shape[1]
    mn, mx = _group_extrema(w, group)
    best = None
    for a, b in CLIP_STEPS if search else ((0.0, 0.0),):
        span = mx - mn
        scale = ((span * (1.0 - a - b)) / 15.0).astype(np.float16)
        lo = (mn + a * span).astype(np.float16)
        if not (np.isfinite(scale).all() and np.isfinite(lo).all()):
            raise WeightFormatError("weights beyond float16's range: cannot store int4 scales for them")
        safe = np.where(scale > 0, scale, np.float16(1.0)).astype(np.float32)
        lo32 = _expand(lo.astype(np.float32), k, group)
        s32 = _expand(safe, k, group)
        q = np.clip(np.rint((w - lo32) / s32), 0, 15)
        sq = (q * s32 + lo32 - w) ** 2
        err = _group_sums(sq if importance is None else sq * importance[None, :], group)
        if best is None:
            best = [q, scale, lo, err]
            continue
        better = err < best[3]
        best[0] = np.where(_expand(better, k, group), q, best[0])
        best[1] = np.where(better, scale, best[1])
        best[2] = np.where(better, lo, best[2])
        best[3] = np.minimum(err, best[3])
    return pack_nibbles(best[0]), best[1], best[2]


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, lo: np.ndarray | None, group: int) -> np.ndarray:
    """The float32 weights `[n, k]` an int4 triple stands for (`lo` None: symmetric)."""
    q = unpack_nibbles(packed).astype(np.float32)
    k = q.shape[1]
    s = scale.astype(np.float32)
    return q * _expand(s, k, group) + _expand(-8.0 * s if lo is None else lo.astype(np.float32), k, group)


def symmetric_minimums(scale: np.ndarray) -> np.ndarray:
    """The float16 minimums a symmetric int4 matrix's scales stand for (`-8 scale`, exact in float16)."""
    return (scale * np.float16(-8.0)).astype(np.float16)


def int4_from_gguf(raw: np.ndarray, ggml_type: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF tensor's Q4_0 or Q4_1 rows (`raw`: `[n, k / 32 * block bytes]` uint8) as an int4 triple
    of group 32, without re-quantizing: the blocks already are this layout. Q4_1 stores `q * d + m`
    (scale `d`, min `m`); Q4_0 stores `(q - 8) * d`: a symmetric triple (scale `d`, min None)."""
    if ggml_type not in (GGUF_Q4_0, GGUF_Q4_1):
        raise WeightFormatError(f"ggml type {ggml_type} is not Q4_0 or Q4_1")
    _check_cols(k)
    n, nb = raw.shape[0], k // BLOCK
    blocks = np.ascontiguousarray(raw).reshape(n, nb, _GGUF_BLOCK_BYTES[ggml_type])
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).reshape(n, nb)
    if ggml_type == GGUF_Q4_1:
        m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16).reshape(n, nb)
        qs = blocks[:, :, 4:20]
    else:
        m = None
        qs = blocks[:, :, 2:18]
    return np.ascontiguousarray(qs).reshape(n, k // 2), d.copy(), m


def dequantize_gguf(raw: np.ndarray, ggml_type: int, k: int) -> np.ndarray:
    """Float32 rows of a Q4_0, Q4_1 or Q8_0 GGUF tensor (as llama.cpp and the gguf package read them)."""
    if ggml_type == GGUF_Q8_0:
        n, nb = raw.shape[0], k // BLOCK
        blocks = np.ascontiguousarray(raw).reshape(n, nb, 34)
        d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).astype(np.float32)  # [n, nb, 1]
        qs = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).astype(np.float32)
        return (qs * d).reshape(n, k)
    return dequantize_int4(*int4_from_gguf(raw, ggml_type, k), BLOCK)


def gguf_row_bytes(ggml_type: int, k: int) -> int | None:
    """Bytes a row of `k` inputs takes in a GGUF tensor of this type (None: a type not read here)."""
    size = _GGUF_BLOCK_BYTES.get(ggml_type)
    return None if size is None or k % BLOCK else k // BLOCK * size


# ---- int8 -----------------------------------------------------------------------------------------


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float `w` `[n, k]` -> (q `[n, k]` int8, scale `[n]` float32), symmetric per row."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise WeightFormatError(f"int8 quantizes matrices, not shape {w.shape}")
    if not np.isfinite(w).all():
        raise WeightFormatError("weights hold NaN or infinity: cannot quantize them")
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale.astype(np.float32)[:, None]


def stored_bytes(fmt: WeightFormat, n: int, k: int, *, head: bool = False) -> int:
    """Bytes one `[n, k]` matrix takes stored in `fmt` (the LM head in the head's format; int4 with its
    minimums: a symmetric matrix takes `2 n G` fewer)."""
    name = fmt.head if head and fmt.quantized else fmt.name
    if name == "int8":
        return n * k + 4 * n
    if name == "int4":
        return n * k // 2 + 4 * n * groups_of(k, fmt.group)
    return n * k * (2 if name == "bf16" else 4)


__all__ = [
    "WEIGHT_FORMATS", "HEAD_FORMATS", "BLOCK", "WeightFormat", "WeightFormatError", "quantize_int4",
    "dequantize_int4", "symmetric_minimums", "int4_from_gguf", "dequantize_gguf", "quantize_int8", "dequantize_int8",
    "pack_nibbles", "unpack_nibbles", "groups_of", "gguf_row_bytes", "stored_bytes",
]
