"""Synthetic K/V for storage tests (per-channel offsets and spreads like real keys and values), and
reads of single chunks through the store's one read API that raise the chunk's error."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from storage import codecs
from storage.chunkstore import ChunkStore
from storage.errors import StorageError

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


def read_one(store: ChunkStore, key: str, index: int, layers: range | None = None) -> codecs.EncodedChunk:
    """Chunk ``index`` (or those layers of it) read with ``store.read`` / ``store.read_layers``;
    raises the error the store yields for it."""
    got = store.read(key, [index]) if layers is None else store.read_layers(key, [index], layers)
    ((i, enc),) = got
    assert i == index
    if isinstance(enc, StorageError):
        raise enc
    return enc


def read_all(store: ChunkStore, key: str, indices: Iterable[int], **kw) -> list[codecs.EncodedChunk]:
    """Whole chunks in the order asked; raises the first chunk's error at its position."""
    out = []
    for _, enc in store.read(key, indices, **kw):
        if isinstance(enc, StorageError):
            raise enc
        out.append(enc)
    return out
