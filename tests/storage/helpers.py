"""Synthetic K/V for storage tests: per-channel offsets and spreads like real keys and values."""

from __future__ import annotations

import numpy as np

from storage import codecs

EPS32 = float(np.finfo(np.float32).eps)

SHAPE = (30, 2, 3, 16, 64)  # the default model's chunk: [L, 2, Hkv, T, D]


def synthetic_kv(shape=SHAPE, seed: int = 0, dtype=np.float32) -> np.ndarray:
    """[L, 2, Hkv, T, D] with a per-channel offset, a per-channel spread and a few outliers."""
    rng = np.random.default_rng(seed)
    nl, two, h, t, d = shape
    offset = rng.normal(0, 2, (nl, two, h, 1, d))
    spread = rng.uniform(0.05, 3, (nl, two, h, 1, d))
    kv = offset + spread * rng.standard_normal(shape)
    kv.flat[rng.integers(0, kv.size, 8)] *= 20  # outliers
    return kv.astype(dtype)


def assert_within_quant_bound(x: np.ndarray, enc: codecs.EncodedChunk, y: np.ndarray) -> None:
    """|x - x'| <= s/2 per channel plus a few float32 ulps of the channel's largest |value|."""
    s = codecs.scales(enc)  # [L, 2, H, 1, D]
    err = np.abs(x.astype(np.float64) - y.astype(np.float64))
    amax = np.abs(x).max(axis=3, keepdims=True).astype(np.float64)
    bound = s.astype(np.float64) / 2 + 4 * EPS32 * amax
    worst = float((err - bound).max())
    assert worst <= 0, f"{enc.level}: error exceeds s/2 by {worst}"
