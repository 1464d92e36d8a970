"""The one-shot profiling run behind the pipeline planner (LLMS §3.3 i): measure what recomputing x
chunks and reading-and-decoding m bytes of chunk files cost on this machine, fit the linear models
T_re(x) and T_io(m), and cache the profile per machine, model and storage throttle.

It runs in a scratch directory with a throwaway context of real K/V, takes a few seconds, and is
reused on later starts (`llmaas profile` runs it again). Tests inject a profile instead.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.loader import cache_root
from scheduler.pipeline import CostProfile, ProfileCache, ProfileKey
from storage import codecs
from storage.chunkfile import ChunkStore, ChunkStoreConfig

PROFILE_TOKENS = 1024
RECOMPUTE_POINTS = (1, 2, 4, 8)
IO_LEVELS = ("q2", "q4", "q8", "raw")


def measure(model, *, read_bytes_per_s: float = 0.0, tokens: int = PROFILE_TOKENS, progress: bool = True) -> CostProfile:
    """Profile `model` (an `engine.model.Transformer`) with chunk files under a scratch directory."""
    c = model.engine_cfg.chunk_tokens
    rng = np.random.default_rng(0)
    ids = rng.integers(100, min(model.cfg.vocab_size, 30000), tokens).tolist()
    cache = model.new_cache(tokens)
    model.forward(cache, ids)
    n = cache.n_chunks
    rec = []
    for x in RECOMPUTE_POINTS:  # the newest chunks: the longest prefix, the dearest case
        chunks = list(range(n - x, n))
        for i in chunks:
            cache.drop_chunk(i)
        t = time.perf_counter()
        model.recompute(cache, ids, chunks)
        rec.append((x, time.perf_counter() - t))
        if progress:
            print(f"llmaas profile: recompute {x} chunks {rec[-1][1] * 1000:.0f} ms", file=sys.stderr)
    io = []
    dtype = {4: "float32", 2: "bfloat16"}.get(cache.kv.element_size(), "float32")
    with tempfile.TemporaryDirectory() as tmp:
        store = ChunkStore(tmp, ChunkStoreConfig(read_bytes_per_s=read_bytes_per_s, fsync=False), fingerprint="profile")
        kv = cache.kv.numpy() if cache.device.type == "cpu" else None
        for level in IO_LEVELS:
            key = f"{abs(hash(level)) & 0xFFFFFFFF:08x}"
            nchunks = min(n, 32)
            encs = [codecs.encode(cache.export_chunk(i), level, dtype=dtype) for i in range(nchunks)]
            nbytes = sum(store.write(key, i, e, i * c).nbytes for i, e in enumerate(encs))
            t = time.perf_counter()
            store.prefetch(key, range(nchunks))
            for i in range(nchunks):
                enc = store.read(key, i)
                s, e = cache.chunk_range(i)
                if kv is not None:
                    codecs.decode(enc, out=kv[:, :, :, s:e])
                else:
                    codecs.decode(enc)
            io.append((nbytes, time.perf_counter() - t))
            if progress:
                print(f"llmaas profile: read+decode {nbytes / 1e6:.1f} MB at {level} "
                      f"{io[-1][1] * 1000:.0f} ms", file=sys.stderr)
    return CostProfile.fit(rec, io)


def load_or_measure(model, fingerprint: str, *, read_bytes_per_s: float = 0.0, refresh: bool = False,
                    root: Path | None = None, progress: bool = True) -> CostProfile:
    """The cached profile for this machine, model and throttle; measured and cached when missing."""
    import torch

    cache = ProfileCache(root or cache_root() / "profiles")
    # the thread count is part of the identity: a 1-thread recompute worker costs twice a 2-thread one
    key = ProfileKey.local(f"{fingerprint}-t{torch.get_num_threads()}", read_bytes_per_s)
    prof = None if refresh else cache.get(key)
    if prof is None:
        prof = measure(model, read_bytes_per_s=read_bytes_per_s, progress=progress)
        cache.put(key, prof)
    return prof
