"""A working set larger than its memory budget: K/V (and a long prefill's hidden state) in a file mapped
shared, whose pages leave memory once written to disk and come back when read (HyperGen §3.2's severe
case on a host with one memory: the file is the host side; MNN-LLM §4.1's per-layer reads with
prefetch for decoding such a context).

This module deliberately knows nothing about chunk records, policies or processes: it maps a file,
writes ranges of it back to disk and unmaps them from this process, and reads ranges ahead.

Pages of the mapping are in one of three states: mapped here (in this process's memory: what a budget
counts), written and unmapped (clean page cache the kernel may reclaim at any time, or only on disk),
or never touched (a hole of the sparse file). `MappedFile.resident_bytes` measures the first from
`/proc/self/smaps`, not from an estimate. A range leaves the budget by `MappedFile.write_out` (msync:
on disk) and then `MappedFile.unmap` (madvise DONTNEED: the next read faults it back in from the page
cache or the disk); `MappedFile.drop_cache` also drops the clean pages from the page cache (for
measuring cold reads).

`LayerPager` drives this for a `KVCache` whose buffer is such a file, one layer at a time: layers below
`resident` stay mapped; a forward pass `enter`s each other layer (its pages read ahead while the
previous layer computes) and `leave`s it (written and unmapped on a background thread while the next
layer computes: the overlap of the write with the compute). `RowSpill` does the same for row ranges
of the prefill's hidden state.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

import numpy as np
import torch

PAGE = mmap.PAGESIZE


class MappedFile:
    """`nbytes` of the file at `path` mapped shared, read and write (`create`: a new sparse file, owner
    only; else an existing one of at least that size, as another process made it)."""

    def __init__(self, path: str | os.PathLike, nbytes: int, *, create: bool = True) -> None:
        self.path = os.fspath(path)
        self.nbytes = int(nbytes)
        flags = os.O_RDWR | ((os.O_CREAT | os.O_TRUNC) if create else 0)
        self.fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(self.fd, self.nbytes)
            elif os.fstat(self.fd).st_size < self.nbytes:
                raise ValueError(f"{self.path} holds {os.fstat(self.fd).st_size} bytes, not {self.nbytes}")
            self.mm = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
        """The whole mapping as bytes; views of it are the tensors handed out."""

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """A view `shape` of `dtype` starting `offset` bytes in."""
        n = dtype.itemsize
        for s in shape:
            n *= s
        if offset % dtype.itemsize or offset + n > self.nbytes:
            raise ValueError(f"a {shape} {dtype} view at {offset} does not fit {self.nbytes} bytes")
        return self.base[offset : offset + n].view(dtype).view(shape)

    def _pages(self, offset: int, nbytes: int) -> tuple[int, int]:
        lo = offset // PAGE * PAGE
        hi = min(self.nbytes, -(-(offset + nbytes) // PAGE) * PAGE)
        return lo, max(0, hi - lo)

    def write_out(self, offset: int, nbytes: int) -> None:
        """Write the range's dirty pages to disk and wait (msync)."""
        lo, n = self._pages(offset, nbytes)
        if n:
            self.mm.flush(lo, n)

    def unmap(self, offset: int, nbytes: int) -> None:
        """Take the range's pages out of this process (madvise DONTNEED; on a shared file mapping a dirty
        page stays dirty in the page cache, so nothing is lost: `write_out` first to leave it clean)."""
        lo, n = self._pages(offset, nbytes)
        if n:
            self.mm.madvise(mmap.MADV_DONTNEED, lo, n)

    def read_ahead(self, offset: int, nbytes: int) -> None:
        """Ask the kernel to start reading the range (madvise WILLNEED; returns before it is in)."""
        lo, n = self._pages(offset, nbytes)
        if n:
            self.mm.madvise(mmap.MADV_WILLNEED, lo, n)

    def drop_cache(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Drop the range's clean pages from the page cache too (posix_fadvise DONTNEED): the next read
        goes to the disk."""
        lo, n = self._pages(offset, self.nbytes - offset if nbytes is None else nbytes)
        if n:
            os.posix_fadvise(self.fd, lo, n, os.POSIX_FADV_DONTNEED)

    def copy_out(self, view: np.ndarray) -> np.ndarray:
        """A copy of `view` (an array over this mapping, any strides) read from the file with `pread`,
        not through the mapping. The page cache holds what the mapping wrote, so the copy is exact; and
        nothing is mapped: a read through the mapping maps whole folios around each page it touches (a
        720 KiB chunk of a 30-layer working set mapped 57 MiB on ext4, 2026-11-28), which stay in this
        process, and so in a budget, until unmapped."""
        start = view.__array_interface__["data"][0] - self.base.data_ptr()
        last = start + sum((n - 1) * st for n, st in zip(view.shape, view.strides)) + view.itemsize
        if view.size and (start < 0 or last > self.nbytes or min(view.strides, default=0) < 0):
            raise ValueError(f"the view at {start} (to {last}) is not one of this mapping's {self.nbytes} bytes")
        out = np.empty(view.shape, view.dtype)
        if not view.size:
            return out
        k, inner = view.ndim, view.itemsize  # the innermost dims laid out contiguously: read in one piece
        while k and view.strides[k - 1] == inner:
            k -= 1
            inner *= view.shape[k]
        dst = memoryview(out.reshape(-1).view(np.uint8))
        for n, idx in enumerate(np.ndindex(*view.shape[:k])):
            off = start + sum(i * st for i, st in zip(idx, view.strides))
            piece = dst[n * inner : (n + 1) * inner]
            while piece:
                got = os.preadv(self.fd, [piece], off)
                if got <= 0:
                    raise OSError(errno.EIO, f"{self.path}: read {got} bytes at {off}")
                piece, off = piece[got:], off + got
        return out

    def resident_bytes(self) -> int:
        """Bytes of the mapping in this process's memory now (its `Rss` in `/proc/self/smaps`)."""
        start = self.base.data_ptr()
        return mapped_rss(lambda lo, hi, _path: lo <= start < hi)

    def unlink(self) -> None:
        """Remove the file's name; the mapping itself goes with the last view of it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


MADV_WILLNEED, MADV_DONTNEED, MADV_POPULATE_READ = 3, 4, 22
_LIBC: list = []  # [libc with madvise declared], loaded on first use


def _libc():
    """This process's C library, with madvise's argument types declared (loaded on first use)."""
    if not _LIBC:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _LIBC.append(libc)
    return _LIBC[0]


def advise(address: int, nbytes: int, advice: int, *, inner: bool) -> None:
    """madvise(2) on the pages of the bytes `[address, address + nbytes)` of this process: every page
    they touch, or (`inner`) only the pages wholly inside them, so that dropping those never touches a
    neighbour's bytes. POPULATE_READ falls back to WILLNEED on a kernel before 5.14. OSError otherwise."""
    if inner:
        lo, hi = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    else:
        lo, hi = address // PAGE * PAGE, -(-(address + nbytes) // PAGE) * PAGE
    if hi <= lo:
        return
    if _libc().madvise(lo, hi - lo, advice) != 0:
        import ctypes

        err = ctypes.get_errno()
        if advice == MADV_POPULATE_READ and err == errno.EINVAL:  # before 5.14: ask, and return
            _LIBC[0].madvise(lo, hi - lo, MADV_WILLNEED)
            return
        raise OSError(err, f"madvise({advice}): {os.strerror(err)}")


TRIM_SWITCH = "LLMAAS_TRIM_HEAP"  # "0" turns `trim_heap` off


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim(0)`): after a long
    prompt's prefill, its freed hidden state and transients stay in the process's private memory
    otherwise, as the allocator's high-water mark. False where the C library has no such call, or
    with `LLMAAS_TRIM_HEAP=0`."""
    trim = getattr(_libc(), "malloc_trim", None) if os.environ.get(TRIM_SWITCH) != "0" else None
    if trim is None:
        return False
    trim(0)
    return True


def mapped_rss(select) -> int:
    """Bytes in this process's memory of the mappings `select(start, end, path)` picks (their `Rss` in
    `/proc/self/smaps`; `path` may end in " (deleted)")."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: range, perms, ..., path
                a, _, b = head.partition("-")
                fields = line.split(None, 5)
                try:
                    inside = select(int(a, 16), int(b, 16), fields[5].strip() if len(fields) > 5 else "")
                except ValueError:
                    inside = False
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


class _Background:
    """One thread that writes ranges out and reads them ahead, in order; each job's future is kept by
    (kind, index) so a later user of the same range waits for it. Records (kind, index, start, end)
    events.
    `overlap` False runs every job in the caller's thread instead (what the overlap buys is measured
    against it: bench/long_prompt.py)."""

    def __init__(self, name: str, overlap: bool = True) -> None:
        self.overlap = overlap
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.jobs: dict[tuple[str, object], Future] = {}
        self.events: list[tuple[str, object, float, float]] = []
        self.before_write = None
        """Tests: called as `before_write(index)` on the background thread before a write begins (a gate)."""

    def submit(self, kind: str, index, fn) -> None:
        def job():
            if kind == "write" and self.before_write is not None:
                self.before_write(index)
            a = time.monotonic()
            fn()
            self.events.append((kind, index, a, time.monotonic()))

        if not self.overlap:
            job()
            return
        self.jobs[(kind, index)] = self.pool.submit(job)

    def wait(self, kind: str, index) -> None:
        fut = self.jobs.pop((kind, index), None)
        if fut is not None:
            fut.result()

    def settle(self) -> None:
        for kind, index in list(self.jobs):
            self.wait(kind, index)


class LayerPager:
    """Which layers of a mapped `KVCache` (`engine.kvcache.KVCache.mapped`) stay in memory, and the
    per-layer traffic of a forward pass over the others."""

    def __init__(self, file: MappedFile, n_layers: int, layer_bytes: int, row_bytes: int, spill_dir: str) -> None:
        self.file = file
        self.n_layers = n_layers
        self.layer_bytes = layer_bytes
        """Bytes of one layer's slab `[2, Hkv, capacity, D]` in the file."""
        self.row_bytes = row_bytes
        """Bytes of one token's K/V in one layer."""
        self.spill_dir = spill_dir
        """Where a prefill's hidden state is spilled (`RowSpill`)."""
        self.resident = n_layers
        """Layers `[0, resident)` stay mapped; the others are streamed (read per layer, written and
        unmapped after it). `n_layers`: nothing streamed."""
        self.bg = _Background("kvpager")
        self.spill_hidden = False
        """A partitioned prefill keeps its hidden state in a `RowSpill` (set per call, as `resident`)."""
        self.written_bytes = 0
        """Bytes of K/V rows written out of memory, a counter (the "moved to the host side" metric)."""

    def slab_bytes(self, tokens: int) -> int:
        """One layer's K/V of a context of `tokens` tokens (at most the whole slab): what a prefill's plan
        counts for a streamed layer of it (scheduler/prefill.py), and so what a batch that writes or
        reads the context's chunks beside the resident layers may hold."""
        return min(self.layer_bytes, max(1, tokens) * self.row_bytes)

    @property
    def overlap(self) -> bool:
        """Streamed layers (and spilled rows) are written out on the background thread while the next
        layer computes; False: in line, which is what the overlap is measured against."""
        return self.bg.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.bg.settle()
        self.bg.overlap = bool(on)

    @property
    def streaming(self) -> bool:
        return self.resident < self.n_layers

    @property
    def events(self) -> list:
        """("read" | "write", layer, start, end) of the background thread, for tests and the benchmark."""
        return self.bg.events

    def span(self, layer: int) -> tuple[int, int]:
        return layer * self.layer_bytes, self.layer_bytes

    def set_resident(self, layers: int) -> None:
        """Keep `layers` layers mapped from now on; layers no longer kept are written and unmapped."""
        layers = max(0, min(self.n_layers, int(layers)))
        was, self.resident = self.resident, layers
        for layer in range(layers, was):
            self.leave(layer, 0)
        self.bg.settle()

    def enter(self, layer: int) -> None:
        """A forward pass is about to compute `layer`: wait for an earlier write of it, and start reading
        the next streamed layer."""
        if layer < self.resident:
            return
        self.bg.wait("write", layer)
        nxt = layer + 1
        if nxt < self.n_layers and nxt >= self.resident:
            self.bg.wait("write", nxt)  # its last write, before it is read again
            self.bg.submit("read", nxt, lambda: self.file.read_ahead(*self.span(nxt)))

    def leave(self, layer: int, written: int) -> None:
        """`layer` is done for this pass: a streamed layer is written out and unmapped on the background
        thread (`written`: the bytes of K/V rows the pass changed in it, for the counter)."""
        if layer < self.resident:
            return
        self.bg.jobs.pop(("read", layer), None)  # a read ahead done or moot by now
        off, n = self.span(layer)
        self.written_bytes += written

        def out() -> None:
            self.file.write_out(off, n)
            self.file.unmap(off, n)

        self.bg.submit("write", layer, out)

    def settle(self) -> None:
        """Wait for every pending write and read."""
        self.bg.settle()

    def release(self, layers: Iterable[int]) -> None:
        """The streamed ones among `layers` were filled outside a forward pass (a restore): write their
        pages to disk and unmap them (as `leave` does) and wait, so a restore holds no more of them than
        it is filling."""
        layers = list(layers)
        for layer in layers:
            self.leave(layer, 0)
        for layer in layers:
            self.bg.wait("write", layer)

    def unmap_streamed(self) -> None:
        """Unmap every streamed layer (after a reader such as a write-back faulted them in; they are
        clean, so nothing is written). Safe beside a forward pass on another thread: a page it still
        reads comes back from the page cache."""
        for layer in range(self.resident, self.n_layers):
            self.file.unmap(*self.span(layer))


class RowSpill:
    """A prefill's hidden state `[n, hidden]` in a mapped file of its own (HyperGen's spill when it alone
    does not fit the budget): a forward pass `enter`s a partition's rows, computes, and `leave`s them
    (written and unmapped on a background thread while the next partition computes)."""

    def __init__(self, directory: str, rows: int, width: int, dtype: torch.dtype, overlap: bool = True) -> None:
        import tempfile

        fd, path = tempfile.mkstemp(prefix="hidden-", suffix=".spill", dir=directory)
        os.close(fd)
        self.row_bytes = width * dtype.itemsize
        self.file = MappedFile(path, max(PAGE, rows * self.row_bytes))
        self.file.unlink()  # the mapping keeps it until this spill is gone
        self.x = self.file.tensor((rows, width), dtype)
        self.bg = _Background("rowspill", overlap)

    def enter(self, r0: int, r1: int) -> torch.Tensor:
        self.bg.wait("write", (r0, r1))
        return self.x[r0:r1]

    def leave(self, r0: int, r1: int) -> None:
        off, n = r0 * self.row_bytes, (r1 - r0) * self.row_bytes

        def out() -> None:
            self.file.write_out(off, n)
            self.file.unmap(off, n)

        self.bg.submit("write", (r0, r1), out)

    def close(self) -> None:
        self.bg.settle()
        self.bg.pool.shutdown()
