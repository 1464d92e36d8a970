"""Chunked KV: dropping, restoring from bytes, and recomputing interleaved chunks (LLMS Fig. 7)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.conftest import SAMPLE_TEXT

N_TOKENS = 101  # six full chunks and a partial seventh
CONT = 12  # greedy tokens after the context: K/V within 1e-4 is checked beside them


@pytest.fixture(scope="module")
def base(engine):
    """A prefilled context and the `CONT` greedy tokens that follow it undisturbed."""
    ids = engine.tok.encode_document(SAMPLE_TEXT)[:N_TOKENS]
    cache = engine.model.new_cache(N_TOKENS + 40)
    logits = engine.model.forward(cache, ids)
    k0 = cache.k[:, :, :N_TOKENS].clone()
    v0 = cache.v[:, :, :N_TOKENS].clone()
    cont = greedy(engine, clone_cache(engine, cache), logits, CONT)
    return ids, cache, logits, k0, v0, cont


def clone_cache(engine, cache):
    c = engine.model.new_cache(cache.capacity)
    c.kv.copy_(cache.kv)
    c.length = cache.length
    c.missing = set(cache.missing)
    return c


def greedy(engine, cache, logits, n):
    out = []
    for _ in range(n):
        t = int(logits.argmax())
        out.append(t)
        logits = engine.model.forward(cache, [t])
    return out


def subsets(n_chunks, rng):
    full = n_chunks - 1  # index of the last full chunk (the partial one is after it)
    yield [0, full - 1]
    yield [1, 3]  # interleaved: chunks 2 and 4 of 6, counting from one
    yield [0, 2, 4, n_chunks - 1]
    yield sorted(rng.sample(range(n_chunks), 3))


def test_recompute_restores_kv_and_output(engine, base):
    ids, cache, logits, k0, v0, cont = base
    rng = random.Random(7)
    n = cache.n_chunks
    assert n == 7 and cache.chunk_range(6) == (96, 101)
    for chunks in subsets(n, rng):
        c = clone_cache(engine, cache)
        for i in chunks:
            c.drop_chunk(i)
        assert c.missing == set(chunks)
        assert torch.isnan(c.k[:, :, : c.length]).any()
        before = engine.model.recomputed_rows
        engine.model.recompute(c, ids, chunks)
        rows = sum(e - s for s, e in (c.chunk_range(i) for i in chunks))
        assert engine.model.recomputed_rows - before == rows  # only the missing rows were computed
        assert not c.missing
        kerr = (c.k[:, :, :N_TOKENS] - k0).abs().max().item()
        verr = (c.v[:, :, :N_TOKENS] - v0).abs().max().item()
        assert kerr < 1e-4 and verr < 1e-4, f"chunks {chunks}: K err {kerr:.2e}, V err {verr:.2e}"
        assert greedy(engine, c, logits, CONT) == cont, f"continuation differs after recomputing {chunks}"


def test_layer_by_layer_recompute_with_streamed_loads(engine, base):
    """The recompute worker's pattern: chunks to load arrive one layer at a time, interleaved with the
    per-layer recompute of other chunks; the result equals the original K/V."""
    ids, cache, logits, k0, v0, cont = base
    c = clone_cache(engine, cache)
    loaded = {i: cache.export_chunk(i) for i in (1, 4)}
    for i in (0, 1, 3, 4, 6):
        c.drop_chunk(i)
    job = engine.model.recompute_start(c, ids, [0, 3, 6])
    for layer in range(engine.model.cfg.n_layers):
        for i, kv in loaded.items():  # as the recompute worker decodes a layer group into its slots
            s, e = c.chunk_range(i)
            c.kv[layer, :, :, s:e] = torch.from_numpy(kv[layer])
        engine.model.recompute_layer(c, job, layer)
    c.mark_present(loaded)
    assert not c.missing
    assert (c.k[:, :, :N_TOKENS] - k0).abs().max().item() < 1e-4
    assert (c.v[:, :, :N_TOKENS] - v0).abs().max().item() < 1e-4
    with pytest.raises(RuntimeError):
        engine.model.recompute_layer(c, job, 0)  # layers run in order, once


def test_raw_bytes_round_trip_is_bit_exact(engine, base):
    ids, cache, logits, k0, v0, cont = base
    c = clone_cache(engine, cache)
    blobs = {}
    for i in range(c.n_chunks):
        arr = c.export_chunk(i)
        assert arr.shape == (30, 2, 3, c.chunk_range(i)[1] - c.chunk_range(i)[0], 64)
        blobs[i] = (arr.tobytes(), arr.dtype, arr.shape)
        c.drop_chunk(i)
    for i, (raw, dt, shape) in blobs.items():
        c.put_chunk(i, np.frombuffer(raw, dtype=dt).reshape(shape).copy())
    assert torch.equal(c.k[:, :, :N_TOKENS], k0) and torch.equal(c.v[:, :, :N_TOKENS], v0)
    assert greedy(engine, c, logits, CONT) == cont


def test_forward_refuses_missing_chunks_and_bad_shapes(engine, base):
    ids, cache, *_ = base
    c = clone_cache(engine, cache)
    c.drop_chunk(2)
    with pytest.raises(RuntimeError, match="missing"):
        engine.model.forward(c, [1])
    with pytest.raises(KeyError):
        c.export_chunk(2)
    with pytest.raises(ValueError, match="shape"):
        c.put_chunk(2, np.zeros((30, 2, 3, 8, 64), dtype=np.float32))
    with pytest.raises(IndexError):
        c.chunk_range(7)
