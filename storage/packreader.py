"""Reading chunk records back from packs, every byte checked before it is returned.

This module deliberately knows nothing about writing, compaction or which chunks should exist: it
returns the bytes the index says are current, or says why not.

Two reads: whole chunks (:meth:`PackReader.read`) and some layers of chunks
(:meth:`PackReader.read_layers`). Both take the chunks of one context in the order asked and yield
``(index, chunk or the StorageError that chunk raised)``, so one bad chunk never hides the others.

Checks: a pack's size must still be what was scanned or written, a record's header bytes as read
must be those parsed, and payload bytes are checked on every read (crc32 of the whole payload for a
whole chunk, of each layer read for a partial one), so flipped payload bits are found when the chunk
is read, never returned as data. Files changed behind the store's back are seen by the next store
opened on the root; until then these checks still hold.

Whole chunks whose records lie close together in one pack are read with one call of up to 8 MiB, so
a context written by one write-back comes back with a few large reads. The first read of each pack
is a small one: a cold pack read with large reads from its first byte streams slower than one whose
first read is small and starts the kernel's readahead (docs/benchmarks.md, "Chunk packs"). A reader
thread reads the next two runs while this one checks the current run (reads and crc32 release the
GIL); with an executor the runs are read and checked on it instead. Every read goes through the
root's throttle (``read_bytes_per_s``).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np

from storage import chunkformat as fmt
from storage.codecs import EncodedChunk
from storage.errors import (ChunkNotFoundError, CorruptChunkError, FingerprintMismatchError,
                            PathConfinementError, StorageError)
from storage.fileops import READ_FLAGS
from storage.packindex import ChunkMeta, PackIndex, Record, check_index, file_name

RUN_GAP = 64 * 1024  # a whole-chunk read reads across gaps up to this size rather than issue another
RUN_BYTES = 8 << 20  # and reads at most this much in one call
FIRST_RUN_BYTES = 1 << 20  # the first run is at most this long, the next ones double (up to
# RUN_BYTES) and then shrink to half of what is left (see _plan)
PRIME_BYTES = 4096  # the first read of a pack is this small (see _fetch)

#: a planned run: (pack path, [(index, record)], None), or (None, [(index, None)], the lookup's error)
Run = tuple[str | None, list[tuple[int, Record | None]], StorageError | None]
Result = tuple[int, EncodedChunk | StorageError]

_THREAD: ThreadPoolExecutor | None = None
_THREAD_LOCK = threading.Lock()


def _reader_thread() -> ThreadPoolExecutor:
    """The process's one reader thread for whole-chunk reads (it mostly waits on the disk)."""
    global _THREAD
    with _THREAD_LOCK:
        if _THREAD is None:
            _THREAD = ThreadPoolExecutor(1, thread_name_prefix="llmaas-chunk-read")
        return _THREAD


def _check_layers(rec: Record, layers: range) -> None:
    nl = rec.header.shape[0]
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= nl:
        raise ValueError(f"layers must be a non-empty step-1 range within [0, {nl}), got {layers}")


class PackReader:
    """Checked reads of the chunks ``index`` knows; refuses records of another model."""

    def __init__(self, index: PackIndex, fingerprint: str):
        self.index = index
        self.fingerprint = fingerprint  # model identity every record read must carry

    # -- the two reads -------------------------------------------------------------------------------

    def read(self, key: str, indices: Iterable[int], *, executor: Executor | None = None,
             tag: str | None = None) -> Iterator[Result]:
        """Whole chunks of one context, in the order asked: ``(index, chunk or its error)``.
        ``tag`` is what every record must carry (default: the reader's fingerprint).

        Each record is checked on its own (header bytes, payload crc32). The payload is writable
        and, when no layer is lz4-compressed, a view of the buffer the run was read into.
        """
        tag = tag or self.fingerprint
        plan = self._plan(key, list(indices), tag)
        fds: dict[str, int] = {}
        prime = []
        try:
            for path, items, _ in plan:  # open every pack before any thread uses the dict
                prime.append(path is not None and path not in fds)
                if path is not None and path not in fds:
                    try:
                        fds[path] = self._open(items[0][1], path)
                    except StorageError:
                        pass
            if executor is None:  # read run k+1 in the reader thread while checking run k here
                ahead: deque = deque()
                for k in range(len(plan)):
                    while len(ahead) < 2 and k + len(ahead) < len(plan):
                        j = k + len(ahead)
                        ahead.append(_reader_thread().submit(self._fetch, plan[j], fds, prime[j]))
                    yield from self._check_run(key, plan[k], ahead.popleft().result(), tag)
            else:
                def one(k: int) -> list[Result]:
                    return self._check_run(key, plan[k], self._fetch(plan[k], fds, prime[k]), tag)

                for got in executor.map(one, range(len(plan))):
                    yield from got
        finally:
            for fd in fds.values():
                self.index.fs.close(fd)

    def read_layers(self, key: str, indices: Iterable[int], layers: range, tag: str | None = None
                    ) -> Iterator[Result]:
        """Layers ``layers`` (a non-empty step-1 range; ValueError otherwise) of chunks of one
        context, in the order asked: ``(index, those layers or the chunk's error)``.

        One read per chunk of just those layers' stored bytes (the headers were parsed when the
        context was scanned or written), each layer checked against its own crc32."""
        tag = tag or self.fingerprint
        fds: dict[str, int] = {}
        try:
            for i in indices:
                try:
                    rec, path = self._locate(key, i, tag)
                    _check_layers(rec, layers)
                    fd = fds.get(path)
                    if fd is None:
                        fd = fds[path] = self._open(rec, path)
                except ChunkNotFoundError:  # gone since the lookup (compaction) or never there
                    yield i, self._one(key, i, tag, layers)
                    continue
                except StorageError as e:
                    yield i, e
                    continue
                try:
                    yield i, self._read_part(fd, rec, layers)
                except StorageError as e:
                    yield i, e
        finally:
            for fd in fds.values():
                self.index.fs.close(fd)

    def prefetch(self, key: str, indices: Iterable[int], tag: str | None = None) -> int:
        """Ask the kernel to start reading these chunks' records (posix_fadvise WILLNEED) and
        return; missing chunks are skipped. Returns the number of chunks advised."""
        fds: dict[str, int] = {}
        n = 0
        try:
            for path, items, _ in self._plan(key, list(indices), tag or self.fingerprint):
                if path is None:
                    continue
                try:
                    fd = fds.get(path)
                    if fd is None:
                        fd = fds[path] = self._open(items[0][1], path)
                except StorageError:
                    continue
                first, last = items[0][1], items[-1][1]
                self.index.fs.fadvise_willneed(fd, first.offset, last.offset + last.nbytes - first.offset)
                n += len(items)
            return n
        finally:
            for fd in fds.values():
                self.index.fs.close(fd)

    def check(self, key: str, index: int, expected_checksum: str | None = None, *,
              deep: bool = True, tag: str | None = None) -> ChunkMeta:
        """Verify one chunk and return its meta: its pack's size and its header bytes on disk, and
        with ``deep`` every payload byte.

        Raises ChunkNotFoundError, CorruptChunkError (also when ``expected_checksum`` differs),
        ChunkVersionError or FingerprintMismatchError.
        """
        tag = tag or self.fingerprint
        rec, path = self._locate(key, index, tag)
        fd = self._open(rec, path)
        try:
            head = self.index.pread(fd, rec.base, rec.offset)
        finally:
            self.index.fs.close(fd)
        if len(head) != rec.base:
            raise CorruptChunkError(f"chunk {index}: pack ends inside its header (truncated)")
        self._check_head(rec, memoryview(head))
        meta = ChunkMeta(file_name(key, index), rec.nbytes, rec.checksum, rec.header)
        if expected_checksum is not None and meta.checksum != expected_checksum:
            raise CorruptChunkError(f"chunk {index} of {key} has checksum {meta.checksum}, "
                                    f"expected {expected_checksum}")
        if deep:
            self._read_one(key, index, tag)
        return meta

    # -- one chunk -----------------------------------------------------------------------------------

    def _read_one(self, key: str, index: int, tag: str, layers: range | None = None) -> EncodedChunk:
        """Layers ``layers`` (default all) of one chunk, checked; looks again once when a
        compaction replaced its pack since the lookup."""
        for attempt in (0, 1):
            rec, path = self._locate(key, index, tag)
            if layers is not None:
                _check_layers(rec, layers)
            try:
                fd = self._open(rec, path)
            except ChunkNotFoundError:
                if attempt:
                    raise
                continue  # a compaction replaced the pack since the lookup: look again
            try:
                if layers is None:
                    return self._from_record(rec, self.index.pread_array(fd, rec.nbytes, rec.offset))
                return self._read_part(fd, rec, layers)
            finally:
                self.index.fs.close(fd)
        raise AssertionError("unreachable")

    def _one(self, key: str, index: int, tag: str, layers: range | None = None
             ) -> EncodedChunk | StorageError:
        try:
            return self._read_one(key, index, tag, layers)
        except StorageError as e:
            return e

    def _locate(self, key: str, index: int, tag: str) -> tuple[Record, str]:
        """(current record, pack path) of a chunk, checked for the tag it must carry."""
        index = check_index(index)
        with self.index.lock:
            c = self.index.context(key)
            rec = self.index.lookup(c, index, key)
            path = c.dir + os.sep + rec.pack.name
        if rec.header.fingerprint != tag:
            raise FingerprintMismatchError(
                f"chunk {index} of {key} was written for model {rec.header.fingerprint[:64]!r}, "
                f"not {tag!r}")
        return rec, path

    def _open(self, rec: Record, path: str) -> int:
        """Open a pack and check its size is still what was scanned or written."""
        fs = self.index.fs
        try:
            fd = fs.open(path, READ_FLAGS)
        except FileNotFoundError:
            self.index.vanished(rec)
            raise ChunkNotFoundError(f"pack {rec.pack.name} of chunk {rec.index} is gone") from None
        except OSError as e:  # ELOOP: the name is a symlink
            raise PathConfinementError(f"cannot open pack {rec.pack.name}: {e.strerror}") from e
        try:
            size = fs.fstat(fd).st_size
            if size != rec.pack.nbytes:
                raise CorruptChunkError(f"pack {rec.pack.name} is {size} B, was {rec.pack.nbytes} B "
                                        "(truncated or appended to)")
        except BaseException:
            fs.close(fd)
            raise
        return fd

    def _check_head(self, rec: Record, m: memoryview) -> None:
        """The record's header bytes as read must be those parsed; else say precisely what is wrong."""
        if m[:rec.base] == rec.head:
            return
        config = self.index.config
        hlen, crc = fmt.parse_prefix(m, len(m), config.max_header_bytes)
        h = fmt.parse_header(m[fmt.PREFIX_NBYTES:fmt.PREFIX_NBYTES + hlen], crc,
                             config.max_record_bytes)
        fmt.check_padding(m[fmt.PREFIX_NBYTES + hlen:fmt.payload_start(hlen)])
        raise CorruptChunkError(f"chunk {rec.index}: header changed on disk (now chunk {h.index} of "
                                f"{h.context})")

    def _from_record(self, rec: Record, buf: np.ndarray) -> EncodedChunk:
        """A full record's bytes (a writable array) checked and turned into an EncodedChunk."""
        if len(buf) != rec.nbytes:
            raise CorruptChunkError(f"chunk {rec.index}: pack ends inside its record (truncated)")
        self._check_head(rec, memoryview(buf))
        h = rec.header
        blob = buf[rec.base:]
        if fmt.crc32(blob) != h.payload_checksum:
            raise CorruptChunkError(f"chunk {rec.index}: payload checksum mismatch")
        payload = fmt.records(blob, h, range(h.shape[0]), checked=True)
        return EncodedChunk(h.level, h.codec_version, h.dtype, h.shape, 0, h.params, payload)

    def _read_part(self, fd: int, rec: Record, layers: range) -> EncodedChunk:
        """Layers ``layers`` of a record: one read of their stored bytes, each checked by its crc32."""
        h = rec.header
        a, b = layers.start, layers.stop
        start = rec.offset + rec.base + sum(h.lengths[:a])
        blob = self.index.pread_array(fd, sum(h.lengths[a:b]), start)
        payload = fmt.records(blob, h, layers, checked=False)
        return EncodedChunk(h.level, h.codec_version, h.dtype, (b - a, *h.shape[1:]), a, h.params,
                            payload)

    # -- runs of whole chunks ------------------------------------------------------------------------

    def _plan(self, key: str, indices: list[int], tag: str) -> list[Run]:
        """Cut the requested chunks, in order, into runs of records that lie close together in one
        pack."""
        found: list[tuple[int, Record | None, str | None, StorageError | None]] = []
        for i in indices:
            try:
                rec, path = self._locate(key, i, tag)
                found.append((i, rec, path, None))
            except StorageError as e:
                found.append((i, None, None, e))
        # runs grow from FIRST_RUN_BYTES, so checking starts early, and shrink to half of what is
        # left, so the last check (the one no read hides) is short
        left = sum(r.nbytes for _, r, _, _ in found if r is not None)
        out: list[Run] = []
        grow = FIRST_RUN_BYTES
        limit = grow
        for i, rec, path, err in found:
            if rec is None:
                out.append((None, [(i, None)], err))
                continue
            if out and out[-1][0] == path:
                last = out[-1][1][-1][1]
                first = out[-1][1][0][1]
                gap = rec.offset - (last.offset + last.nbytes)
                if 0 <= gap <= RUN_GAP and rec.offset + rec.nbytes - first.offset <= limit:
                    out[-1][1].append((i, rec))
                    left -= rec.nbytes
                    continue
                grow = min(2 * grow, RUN_BYTES)
            limit = max(min(grow, left // 2), FIRST_RUN_BYTES // 4)
            out.append((path, [(i, rec)], None))
            left -= rec.nbytes
        return out

    def _fetch(self, run: Run, fds: dict[str, int], prime: bool = False
               ) -> np.ndarray | StorageError | None:
        """The bytes of one run, read in one call (``prime``: two, the first of ``PRIME_BYTES``, so
        the kernel's readahead streams ahead of the large read); None when its pack is gone
        (compacted since the plan), or the error that stopped it."""
        path, items, err = run
        if path is None:
            return err
        first, last = items[0][1], items[-1][1]
        fs, bucket = self.index.fs, self.index.bucket
        try:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = self._open(first, path)
            n = last.offset + last.nbytes - first.offset
            if bucket is not None:
                bucket.acquire(n)
            buf = np.empty(n, np.uint8)
            head = PRIME_BYTES if prime and n > 2 * PRIME_BYTES else 0
            got = fs.pread_into(fd, buf[:head], first.offset) if head else 0
            if got == head:
                got += fs.pread_into(fd, buf[got:], first.offset + got)
            return buf[:got]
        except ChunkNotFoundError:
            return None
        except StorageError as e:
            return e

    def _check_run(self, key: str, run: Run, buf: np.ndarray | StorageError | None, tag: str
                   ) -> list[Result]:
        """The chunks of a fetched run, each checked on its own."""
        items = run[1]
        if buf is None:  # a compaction replaced the pack since the plan: one by one
            return [(i, self._one(key, i, tag)) for i, _ in items]
        if isinstance(buf, StorageError):
            return [(i, buf) for i, _ in items]
        first = items[0][1]
        out: list[Result] = []
        for i, rec in items:
            o = rec.offset - first.offset
            try:
                out.append((i, self._from_record(rec, buf[o:o + rec.nbytes])))
            except StorageError as e:
                out.append((i, e))
        return out
