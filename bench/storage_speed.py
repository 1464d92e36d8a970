"""Storage speed: KV codec encode/decode per level, and chunk-file bandwidth against the raw disk.

    python -m bench.storage_speed [--tokens 2048] [--reps 5] [--threads 2] [--stat median|best]
                                  [--dir PATH] [--synthetic] [--no-heap-retain] [--no-native]
                                  [--pack-per-chunk]

For a context of ``--tokens`` tokens (16-token chunks of the default model's shape [30, 2, 3, 16, 64]):

1. codecs: encode and decode time of all chunks per level, one thread and ``--threads`` threads,
   decoding into the slots of one context buffer [L, 2, Hkv, S, D] (what a restore does); stored
   bytes and the relative RMS error;
2. disk: raw sequential write and cold read bandwidth of one file as large as the raw context (4 MiB
   reads, and 4 MiB reads after a first 4 KiB one; the faster of the two is the baseline);
3. chunk packs per level: the whole context written as one write-back does (``ChunkStore.write_many``:
   one crash-safe pack, fsync of file and folder; ``--pack-per-chunk``: one pack per chunk, the
   layout of format 2's one file per chunk, for A/B), then cold reads (fsync + posix_fadvise
   DONTNEED on every pack before each pass) of the whole context: the pack files alone with no
   checks ("plain", the I/O ceiling of the layout), ChunkStore.read with one and with
   ``--threads`` threads, in bytes on disk per second and as a fraction of the raw sequential read
   bandwidth; and read + decode into the context buffer.

K/V data: real K/V of the default model when ``engine`` and the model are available (a forward
over English text from the standard library's docstrings), else synthetic data with a printed note.
Timings are the median (or best) of ``--reps`` passes. torch is imported when installed and limited
to one thread, as in the service's model processes: the codecs cast float32 <-> float16 in torch
when a process has it (numpy otherwise). The quantized levels run in the compiled kernels of
storage/kvquant.c when they build (``--no-native``: ``LLMAAS_NATIVE=0``, their numpy/torch paths). This is a benchmark entry point: it knows nothing the
storage package does not export.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine import native
from storage import codecs, quantize
from storage.chunkstore import ChunkStore, ChunkStoreConfig
from storage.errors import StorageError

SHAPE = (30, 2, 3, 16, 64)  # the default model's chunk
LEVELS = ("raw", "fp16", "bf16", "q8", "q4", "q2")
KEY = "be0cbe0cbe0cbe0cbe0cbe0cbe0cbe0c"


def real_kv(n_tokens: int) -> np.ndarray | None:
    """[L, 2, Hkv, n_tokens, D] float32 from the default model, or None when it is unavailable."""
    try:
        import pydoc
        import sys

        import torch

        from engine.context import ContextEngine
    except Exception as e:  # noqa: BLE001 - any import failure means "no engine here"
        print(f"note: engine not importable ({type(e).__name__}: {e}); using synthetic K/V")
        return None
    try:
        engine = ContextEngine.load(progress=False)
    except Exception as e:  # noqa: BLE001
        print(f"note: default model unavailable ({type(e).__name__}: {e}); using synthetic K/V")
        return None
    text, ids = "", []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in ("antigravity", "this", "idlelib", "tkinter", "turtle"):
            continue
        try:
            with warnings.catch_warnings():  # deprecated stdlib modules warn on import
                warnings.simplefilter("ignore")
                doc = pydoc.getdoc(__import__(name))
        except Exception:  # noqa: BLE001 - some stdlib modules do not import on every platform
            continue
        text += doc + "\n\n"
        if len(text) > 6 * n_tokens:
            ids = engine.tok.encode_document(text)
            if len(ids) >= n_tokens:
                break
    ids = ids[:n_tokens]
    if len(ids) < n_tokens:
        print("note: not enough local text for real K/V; using synthetic K/V")
        return None
    cache = engine.model.new_cache(n_tokens)
    with torch.inference_mode():
        for s in range(0, n_tokens, 256):
            engine.model.forward(cache, ids[s:s + 256])
    kv = np.concatenate([cache.export_chunk(i) for i in range(cache.n_chunks)], axis=3)
    print(f"K/V: real, default model, {n_tokens} tokens of standard-library docstrings")
    return np.ascontiguousarray(kv, dtype=np.float32)


def synthetic_kv(n_tokens: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    nl, two, h, _, d = SHAPE
    offset = rng.normal(0, 2, (nl, two, h, 1, d))
    spread = rng.uniform(0.05, 3, (nl, two, h, 1, d))
    kv = offset + spread * rng.standard_normal((nl, two, h, n_tokens, d))
    print(f"K/V: synthetic (per-channel offsets and spreads), {n_tokens} tokens")
    return kv.astype(np.float32)


STAT = {"median": lambda ts: float(np.median(ts)), "best": min}  # how repeated timings are summarised


def timed(fn, reps: int, stat=STAT["median"]) -> float:
    """Median (or ``stat``) wall time of ``reps`` runs of fn(), in seconds."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return stat(times)


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_name(path: str) -> str:
    """The block device and file system holding ``path`` (from /proc/mounts)."""
    path = os.path.realpath(path)
    found = ("?", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fs = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                        found[1]):
                    found = (dev, mnt, fs)
    except OSError:
        pass
    return f"{found[0]} ({found[2]} on {found[1]})"


def raw_disk(directory: str, nbytes: int, reps: int, stat) -> tuple[float, float]:
    """(sequential write B/s incl. fsync, cold sequential read B/s with 4 MiB reads, the same after
    a first 4 KiB read, which starts the kernel's readahead: faster on the VMs measured) of one
    nbytes file."""
    path = os.path.join(directory, "raw.bin")
    block = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(nbytes // len(block)):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)

    buf = np.empty(4 << 20, np.uint8)

    def read(prime: bool):
        fd = os.open(path, os.O_RDONLY)
        try:
            o = os.preadv(fd, [buf[:4096]], 0) if prime else 0
            while n := os.preadv(fd, [buf], o):
                o += n
        finally:
            os.close(fd)

    def cold_read(prime: bool):
        drop_cache(path)
        t0 = time.perf_counter()
        read(prime)
        return time.perf_counter() - t0

    size = nbytes // len(block) * len(block)
    w = timed(write, reps, stat)
    plain = stat([cold_read(False) for _ in range(reps)])
    primed = stat([cold_read(True) for _ in range(reps)])
    os.unlink(path)
    return size / w, size / plain, size / primed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.storage_speed", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="context length in tokens (default 2048)")
    p.add_argument("--reps", type=int, default=5, help="passes per measurement")
    p.add_argument("--stat", choices=sorted(STAT), default="median",
                   help="summary of the passes (default median: robust on a shared machine)")
    p.add_argument("--threads", type=int, default=2, help="threads for the parallel codec rows")
    p.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder "
                   "under the current directory)")
    p.add_argument("--synthetic", action="store_true", help="use synthetic K/V even if the model is here")
    p.add_argument("--no-heap-retain", action="store_true", help="leave glibc's malloc as it is (the service's "
                   "actor processes keep freed memory for reuse, storage.heap; this is what they do without it)")
    p.add_argument("--no-native", action="store_true", help="run the quantized codecs on their numpy/torch "
                   "paths instead of the compiled kernels of storage/kvquant.c (as on a machine without a C compiler: "
                   "LLMAAS_NATIVE=0, so the crc32 kernel is off too)")
    p.add_argument("--pack-per-chunk", action="store_true", help="write each chunk as a pack of its own "
                   "(the one-file-per-chunk layout of format 2) instead of one pack per write-back")
    args = p.parse_args(argv)
    if args.tokens % 16:
        p.error("--tokens must be a multiple of 16")
    stat = STAT[args.stat]

    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {os.cpu_count()} cores, {platform.machine()}, {platform.platform()}")
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.no_heap_retain:
        print("heap: glibc defaults (freed MB-sized buffers go back to the kernel)")
    else:
        from storage.heap import retain_freed_memory

        on = retain_freed_memory()
        print(f"heap: {'freed memory kept for reuse, as in the service actors (storage.heap)' if on else 'defaults (mallopt unavailable)'}")
    if args.no_native:
        os.environ[native.ENV_SWITCH] = "0"  # before any kernel is loaded
    print(f"quantized codecs: {'compiled kernels (storage/kvquant.c)' if quantize.kernels() else 'numpy/torch'}")
    kv = None if args.synthetic else real_kv(args.tokens)
    if kv is None:
        kv = synthetic_kv(args.tokens)
    try:
        import torch

        torch.set_num_threads(1)  # as the service's model processes; "1 thread" means one
        print("float32 <-> float16 casts: torch (1 intra-op thread)")
    except ImportError:
        print("float32 <-> float16 casts: numpy (torch not installed)")
    chunks = [np.ascontiguousarray(kv[:, :, :, s:s + 16]) for s in range(0, args.tokens, 16)]
    n = len(chunks)
    raw_nbytes = kv.nbytes
    print(f"context: {n} chunks of {list(SHAPE)}, {raw_nbytes / 1e6:.1f} MB raw float32\n")

    buf = np.empty_like(kv)  # the context buffer a restore decodes into
    outs = [buf[:, :, :, 16 * i:16 * (i + 1)] for i in range(n)]
    pool = ThreadPoolExecutor(args.threads)
    print(f"codecs ({n} chunks; ms for the whole context; {args.stat} of {args.reps})")
    print(f"{'level':6s} {'enc 1t':>8s} {'enc %dt' % args.threads:>8s} {'dec 1t':>8s} "
          f"{'dec %dt' % args.threads:>8s} {'stored MB':>10s} {'bits/val':>9s} {'rel RMS err':>12s}")
    encoded = {}
    for level in LEVELS:
        e1 = timed(lambda: codecs.encode_many(chunks, level), args.reps, stat)
        e2 = timed(lambda: codecs.encode_many(chunks, level, executor=pool), args.reps, stat)
        encs = codecs.encode_many(chunks, level)
        encoded[level] = encs
        d1 = timed(lambda: codecs.decode_many(encs, outs), args.reps, stat)
        d2 = timed(lambda: codecs.decode_many(encs, outs, executor=pool), args.reps, stat)
        stored = sum(e.nbytes for e in encs)
        err = float(np.sqrt(((buf - kv) ** 2).sum() / (kv**2).sum()))
        print(f"{level:6s} {e1 * 1e3:8.1f} {e2 * 1e3:8.1f} {d1 * 1e3:8.1f} {d2 * 1e3:8.1f} "
              f"{stored / 1e6:10.2f} {stored * 8 / kv.size:9.2f} {err:12.2e}")

    root = tempfile.mkdtemp(prefix="storage-bench-", dir=args.dir or os.getcwd())
    try:
        print(f"\ndisk: {disk_name(root)}")
        seq_w, seq_plain, seq_primed = raw_disk(root, raw_nbytes, args.reps, stat)
        seq_r = max(seq_plain, seq_primed)  # the baseline: the faster of the two ways
        print(f"raw sequential: write+fsync {seq_w / 1e6:.0f} MB/s, cold read {seq_plain / 1e6:.0f} MB/s "
              f"with 4 MiB reads, {seq_primed / 1e6:.0f} MB/s after a first 4 KiB read "
              f"({raw_nbytes / 1e6:.0f} MB file); baseline {seq_r / 1e6:.0f} MB/s\n")
        layout = f"{n} packs of one chunk" if args.pack_per_chunk else "one pack per write-back"
        print(f"chunk packs ({layout}, fsync per pack and folder; cold reads of the whole context "
              f"with ChunkStore.read; {args.stat} of {args.reps})")
        print(f"{'level':6s} {'MB disk':>8s} {'write ms':>9s} {'write MB/s':>11s} {'plain ms':>9s} "
              f"{'of raw':>7s} {'read ms':>8s} "
              f"{'MB/s':>6s} {'of raw':>7s} {'read %dt' % args.threads:>8s} {'MB/s':>6s} {'of raw':>7s} "
              f"{'read+dec ms':>12s}")
        for level in LEVELS:
            # one pack per chunk is kept as written (no compaction), as format 2's one file per chunk
            cfg = ChunkStoreConfig(max_packs=10**9) if args.pack_per_chunk else ChunkStoreConfig()
            store = ChunkStore(os.path.join(root, level), cfg, fingerprint="bench")
            encs = encoded[level]

            def write():
                if args.pack_per_chunk:
                    for i, e in enumerate(encs):
                        store.write(KEY, i, e, 16 * i)
                else:
                    store.write_many(KEY, [(i, e, 16 * i) for i, e in enumerate(encs)])

            wt = timed(write, args.reps, stat)
            disk = store.usage_bytes()
            paths = store.files(KEY)

            def cold(fn):
                for q in paths:
                    drop_cache(q)
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0

            rbuf = np.empty(4 << 20, np.uint8)

            def plain():  # the same files with no checks, read as the raw file is: the layout's ceiling
                for q in paths:
                    fd = os.open(q, os.O_RDONLY)
                    try:
                        o = os.preadv(fd, [rbuf[:4096]], 0)
                        while k := os.preadv(fd, [rbuf], o):
                            o += k
                    finally:
                        os.close(fd)

            r0 = stat([cold(plain) for _ in range(args.reps)])
            def read(executor=None):
                for _, enc in store.read(KEY, range(n), executor=executor):
                    if isinstance(enc, StorageError):
                        raise enc

            def restore():  # read and decode each chunk into its slot, as a restore does
                for i, enc in store.read(KEY, range(n)):
                    if isinstance(enc, StorageError):
                        raise enc
                    codecs.decode(enc, outs[i])

            r1 = stat([cold(read) for _ in range(args.reps)])
            r2 = stat([cold(lambda: read(pool)) for _ in range(args.reps)])
            rd = stat([cold(restore) for _ in range(args.reps)])
            print(f"{level:6s} {disk / 1e6:8.2f} {wt * 1e3:9.1f} {disk / wt / 1e6:11.0f} "
                  f"{r0 * 1e3:9.1f} {disk / r0 / seq_r:7.0%} {r1 * 1e3:8.1f} {disk / r1 / 1e6:6.0f} {disk / r1 / seq_r:7.0%} "
                  f"{r2 * 1e3:8.1f} {disk / r2 / 1e6:6.0f} {disk / r2 / seq_r:7.0%} {rd * 1e3:12.1f}")
            store.delete_context(KEY)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        pool.shutdown()
    print(f"\nload average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
