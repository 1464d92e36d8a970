"""The one-shot profiling run behind the pipeline planner (LLMS §3.3 i): measure what recomputing x
chunks, reading m bytes of chunk files and de-quantizing k chunks cost on this machine, fit the
linear models T_re(x) and T_io(m) and the per-chunk de-quantization cost of each level (T_dec), and
cache the profile per machine, model, thread count, chunk size and storage throttle.

It runs in a scratch directory with a throwaway context of real K/V, takes a few seconds, and is
reused on later starts (`llmaas profile` runs it again). Tests inject a profile instead. The cache
(:class:`ProfileCache`, JSON files keyed by :class:`ProfileKey`) lives here, beside the one caller
that measures, so that `scheduler.pipeline` stays free of files: it only fits and plans.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.loader import cache_root
from scheduler.pipeline import CostProfile
from storage import codecs
from storage.chunkstore import ChunkStore, ChunkStoreConfig

#: part of a cached profile's identity: bump it when a change makes the measured paths (recompute,
#: chunk reads, de-quantizing) materially faster or slower, so cached profiles are measured again
#: (2: de-quantizing in torch, 1.7-1.9x faster; 3: the compiled kernels of storage/kvquant.c, ~2x again;
#: 4: chunk records in one pack per write-back, read in large runs; 5: reads timed as the median of
#: three after an untimed one, since the first read of a process on a fresh machine built the crc32
#: kernel inside the timing and fitted T_io a 74 ms intercept, 7x every restore's time; 6: with bf16
#: weights, recompute's attention on AMX tiles; 7: and in AVX-512 BF16 dot products on CPUs without
#: the tiles, engine/attention_bf16.c, and int4/int8 recompute's products in bfloat16 on CPUs with them)
PROFILE_VERSION = 7
PROFILE_TOKENS = 1024
RECOMPUTE_POINTS = (1, 2, 4, 8)
IO_LEVELS = ("q2", "q4", "q8", "fp16", "raw")


def machine_id() -> str:
    """This machine as profiles know it: hostname and CPU count."""
    return f"{socket.gethostname()}/{os.cpu_count()}cpu"


@dataclass(frozen=True, slots=True)
class ProfileKey:
    """What a cost profile depends on."""

    machine: str  # machine_id() of the profiled machine
    model: str  # model fingerprint, given by the caller
    throttle_bps: float  # storage read throttle, bytes/s; 0 = none

    @classmethod
    def local(cls, model: str, throttle_bps: float = 0.0) -> ProfileKey:
        """The key for this machine."""
        return cls(machine_id(), model, float(throttle_bps))

    def filename(self) -> str:
        """A file name unique to the key: a readable slug and a hash of the whole key."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{self.machine}_{self.model}")[:80]
        return f"{slug}-{digest[:16]}.json"


class ProfileCache:
    """Fitted profiles as JSON files under ``root``, one per :class:`ProfileKey`.

    ``get`` treats a missing, unreadable, other-version or other-key file as a miss (``None``): the
    caller profiles again and ``put`` replaces it atomically (temp file, fsync, rename).
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def path(self, key: ProfileKey) -> Path:
        """Where ``key``'s profile lives (whether or not it exists)."""
        return self.root / key.filename()

    def get(self, key: ProfileKey) -> CostProfile | None:
        """The cached profile of ``key``, or ``None`` (a miss; see the class docstring)."""
        try:
            doc = json.loads(self.path(key).read_text())
            if doc.get("key") != json.loads(json.dumps(asdict(key))):
                return None
            return CostProfile.from_json(json.dumps(doc["profile"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def put(self, key: ProfileKey, profile: CostProfile) -> Path:
        """Store ``profile`` as ``key``'s, replacing any older one atomically; returns its path."""
        self.root.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"key": asdict(key), "profile": json.loads(profile.to_json())},
                          sort_keys=True, indent=1)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".profile-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return self.path(key)


def measure(model, *, read_bytes_per_s: float = 0.0, tokens: int = PROFILE_TOKENS, progress: bool = True) -> CostProfile:
    """Profile `model` (an `engine.model.Transformer`) with chunk files under a scratch directory."""
    import torch

    c = model.engine_cfg.chunk_tokens
    rng = np.random.default_rng(0)
    ids = rng.integers(100, min(model.cfg.vocab_size, 30000), tokens).tolist()
    cache = model.new_cache(tokens)
    model.forward(cache, ids)

    def sync() -> None:  # off the CPU the device runs behind the host: time what it did, not the launch
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
    n = cache.n_chunks
    rec = []
    cache.drop_chunk(n - 1)
    model.recompute(cache, ids, [n - 1])  # untimed: the first recompute pays one-off allocations
    for x in RECOMPUTE_POINTS:  # the newest chunks: the longest prefix, the dearest case
        chunks = list(range(n - x, n))
        for i in chunks:
            cache.drop_chunk(i)
        sync()
        t = time.perf_counter()
        model.recompute(cache, ids, chunks)
        sync()
        rec.append((x, time.perf_counter() - t))
        if progress:
            print(f"llmaas profile: recompute {x} chunks {rec[-1][1] * 1000:.0f} ms", file=sys.stderr)
    io, dec = [], []
    dtype = cache.storage_name
    from actors.restore import host_view

    kv = host_view(cache)

    def decode(encs) -> None:
        for i, enc in enumerate(encs):
            s, e = cache.chunk_range(i)
            if kv is not None:
                codecs.decode(enc, out=kv[:, :, :, s:e])
            else:  # as a restore does off the CPU: decoded on the host, copied in
                cache.put_chunk(i, codecs.decode(enc))
        sync()

    with tempfile.TemporaryDirectory() as tmp:
        store = ChunkStore(tmp, ChunkStoreConfig(read_bytes_per_s=read_bytes_per_s, fsync=False), fingerprint="profile")
        for level in IO_LEVELS:
            key = f"{abs(hash(level)) & 0xFFFFFFFF:08x}"
            encs = [codecs.encode(cache.export_chunk(i), level, dtype=dtype) for i in range(min(n, 32))]
            sizes = [m.nbytes for m in store.write_many(key, [(i, e, i * c) for i, e in enumerate(encs)])]
            for _ in store.read(key, range(len(encs))):  # untimed: the first read of a process
                pass  # builds the crc32 kernel (~0.6 s on a machine without its cached build)
            for k in (8, len(encs)):  # two counts per level: chunks and bytes vary independently
                io.append((sum(sizes[:k]), _median_of_3(lambda: deque(store.read(key, range(k)), maxlen=0))))
                dec.append((level, k, _median_of_3(lambda: decode(encs[:k]))))
            if progress:
                print(f"llmaas profile: {len(encs)} chunks at {level}: read {sum(sizes) / 1e6:.1f} MB "
                      f"{io[-1][1] * 1000:.1f} ms, de-quantize {dec[-1][2] * 1000:.1f} ms", file=sys.stderr)
    return CostProfile.fit(rec, io, dec)


def _median_of_3(fn) -> float:
    """Seconds of the middle of three calls of `fn`."""
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[1]


def profile_key(fingerprint: str, threads: int, chunk_tokens: int, read_bytes_per_s: float,
                device: str = "cpu", dtype: str = "float32", weights: str = "fp32",
                weights_resident: int | None = None) -> ProfileKey:
    """The cache identity of a profile (this machine is part of `ProfileKey.local`). The thread count
    is part of it (a 1-thread recompute worker costs twice a 2-thread one), so are the chunk size
    (T_re counts chunks, T_dec costs a chunk), the device and compute dtype the model runs in, the
    weight format (recompute runs its products), the resident limit of streamed weights
    (`EngineConfig.weights_resident_bytes`: a recompute then reads the others in), and PROFILE_VERSION."""
    where = "" if (device, dtype) == ("cpu", "float32") else f"-{device}-{dtype}"
    where += "" if weights == "fp32" else f"-w{weights}"
    where += "" if weights_resident is None else f"-r{int(weights_resident)}"
    return ProfileKey.local(f"{fingerprint}-t{threads}-c{chunk_tokens}{where}-v{PROFILE_VERSION}", read_bytes_per_s)


def load_or_measure(model, fingerprint: str, *, read_bytes_per_s: float = 0.0, refresh: bool = False,
                    root: Path | None = None, progress: bool = True) -> CostProfile:
    """The cached profile for this machine, model and throttle; measured and cached when missing."""
    import torch

    cache = ProfileCache(root or cache_root() / "profiles")
    key = profile_key(fingerprint, torch.get_num_threads(), model.engine_cfg.chunk_tokens, read_bytes_per_s,
                      model.device.type, str(model.dtype).removeprefix("torch."), model.weight_format,
                      model.engine_cfg.weights_resident_bytes)
    prof = None if refresh else cache.get(key)
    if prof is None:
        prof = measure(model, read_bytes_per_s=read_bytes_per_s, progress=progress)
        cache.put(key, prof)
    return prof
