"""ChunkStore: one crash-safe, checksummed file per KV chunk under a confined root folder.

Layout: ``<root>/<context key>/<chunk index:08d>.kvc`` (format in :mod:`storage.chunkformat`).

One file per chunk, not per group of chunks. Why: a chunk's level changes on its own (the compression
planner re-quantizes single chunks, and the last partial chunk is rewritten as it fills), so a
rewrite is one atomic rename and never a read-modify-write of its neighbours; deleting a context is
deleting a folder. Grouping would buy little read speed, measured by ``bench/storage_speed.py``
(docs/benchmarks.md): plain reads of the 128 files of a 2048-token context after a prefetch run at
75-110% of the disk's raw sequential bandwidth for one big file, so the files are not the limit;
the checked read is bound by CPU: a crc32 pass (~5 GB/s) plus ~30 us per file (open, read, msgpack
header and its checks), which grouping would cut only for the smallest levels (q2, q4). Reads of a
whole context go through :meth:`ChunkStore.read_iter`, which opens and advises (posix_fadvise
WILLNEED) a window of files ahead of the reads so the disk works on many files while the CPU checks
them; a full-chunk read is one read call into a fresh buffer that the records then live in.

Writes are crash-safe: the file is written under a temporary name in the same folder, fsynced,
renamed over the final name, and the folder is fsynced; a reader sees the old file or the new one,
never a mix. Temporary files left by a crash are removed when a store is opened. Every file
operation goes through an injectable :class:`~storage.fileops.FileOps`.

Paths: a context key must match ``^[0-9a-f]{8,64}$`` and a chunk index is an int, so a client string
never becomes a path; the root is resolved once (realpath) and every context folder is checked with
lstat to be a plain folder (a symlink is refused, never followed); files are opened with O_NOFOLLOW
and created with O_EXCL.

Capacity: ``usage_bytes()`` is the bytes of all chunk files (and temporaries being written); a write
that would leave usage above ``disk_cap_bytes`` raises DiskCapExceededError before anything is
written. (While a chunk is being replaced its old file and the temporary both exist, so the disk
briefly holds up to one chunk file more than the cap.)
Reads can be throttled (token bucket, injectable clock and sleep) to emulate eMMC/SD storage.

This module deliberately knows nothing about which chunks should exist, their state or level
policy (that is the registry and the governor), nor about the model: it stores and returns bytes.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage import chunkformat as fmt
from storage.codecs import EncodedChunk
from storage.errors import (ChunkNotFoundError, CorruptChunkError, DiskCapExceededError,
                            FingerprintMismatchError, InvalidKeyError, PathConfinementError)
from storage.fileops import CREATE_FLAGS, READ_FLAGS, FileOps
from storage.throttle import TokenBucket

_SUFFIX = ".kvc"
_NAME_RE = re.compile(r"^(\d{8})\.kvc$")
_TMP_RE = re.compile(r"^\.(\d{8})\.[0-9a-f]{8}\.tmp$")
_MAX_INDEX = 10**8 - 1
_READ_WINDOW = 64  # chunk files read_iter opens and advises ahead of its reads


@dataclass(frozen=True, slots=True)
class ChunkStoreConfig:
    """Tunables of one ChunkStore."""

    disk_cap_bytes: int = 0  # refuse writes that would make usage_bytes() exceed this (bytes); 0: no cap
    read_bytes_per_s: float = 0.0  # read throttle, token-bucket rate (bytes/s); 0: off
    read_burst_bytes: int = 256 * 1024  # read throttle bucket depth (bytes)
    max_header_bytes: int = 64 * 1024  # largest chunk header accepted on read (bytes)
    max_record_bytes: int = 64 * 1024 * 1024  # largest decompressed layer record accepted (bytes)
    max_file_bytes: int = 256 * 1024 * 1024  # larger chunk files are refused unread (bytes)
    lz4_level: int = 0  # lz4 level tried per layer record (0-2 fast, 3-16 high compression, -1 off);
    # a layer is kept compressed only when that saves an eighth of it (<1% of layers of real K/V)
    fsync: bool = True  # fsync file and folder on every write (False only for page-cache benchmarks)


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What the store knows about one chunk file after writing or reading its header."""

    name: str  # file name relative to the root, "<context>/<index:08d>.kvc"
    nbytes: int  # size of the file (bytes)
    checksum: str  # crc32 of the header as 8 hex digits: identifies this exact file content
    header: fmt.ChunkHeader  # the parsed header


def check_context_key(key: str) -> str:
    """Return ``key`` if it is a valid context key (lowercase hex, 8-64 chars)."""
    if not isinstance(key, str) or not fmt.CONTEXT_KEY_RE.match(key):
        raise InvalidKeyError("context key must match ^[0-9a-f]{8,64}$")
    return key


def _check_index(index: int) -> int:
    is_int = type(index) is int or isinstance(index, np.integer)  # not bool, float or str
    if not is_int or not 0 <= index <= _MAX_INDEX:
        raise InvalidKeyError(f"chunk index must be an int in [0, {_MAX_INDEX}]")
    return int(index)


class ChunkStore:
    """Chunk files of many contexts under ``root`` (created if missing). Thread-safe."""

    def __init__(self, root: str | os.PathLike, config: ChunkStoreConfig | None = None, *,
                 fingerprint: str, fs: FileOps | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.config = config or ChunkStoreConfig()
        self.fingerprint = fingerprint  # model identity written into and required of every file
        self.fs = fs or FileOps()
        Path(root).mkdir(parents=True, exist_ok=True)
        self.root = os.path.realpath(root)  # every path used lies below this
        self._lock = threading.Lock()  # guards _usage and folder creation
        self._usage = 0  # bytes of chunk files and in-flight temporaries
        self._bucket = (TokenBucket(self.config.read_bytes_per_s, self.config.read_burst_bytes,
                                    clock, sleep) if self.config.read_bytes_per_s > 0 else None)
        self.removed_temporaries = self._startup_scan()  # stale temp files deleted at open

    # -- paths ---------------------------------------------------------------------------------------

    def _context_dir(self, key: str, create: bool = False) -> str | None:
        """The context's folder, checked to be a real folder under the root (None if absent)."""
        d = os.path.join(self.root, check_context_key(key))
        try:
            st = self.fs.lstat(d)
        except FileNotFoundError:
            if not create:
                return None
            with self._lock:
                try:
                    self.fs.mkdir(d)
                except FileExistsError:
                    pass
                else:
                    self.fs.fsync_dir(self.root)  # the new folder's entry must survive a crash
            st = self.fs.lstat(d)
        # lstat, so a symlink is not a folder; the key has no separators and the root is a real
        # path, so a plain folder here is inside the root (no realpath per call needed).
        if not stat.S_ISDIR(st.st_mode):
            raise PathConfinementError(f"{key} is not a plain folder under the store root")
        return d

    @staticmethod
    def file_name(key: str, index: int) -> str:
        """File name of a chunk relative to the root (what the registry stores)."""
        return f"{check_context_key(key)}/{_check_index(index):08d}{_SUFFIX}"

    def path(self, key: str, index: int) -> str:
        """Absolute path of a chunk file (it may not exist)."""
        return os.path.join(self.root, self.file_name(key, index))

    # -- startup -------------------------------------------------------------------------------------

    def _startup_scan(self) -> list[str]:
        """Remove stale temporaries, total the usage. Foreign entries are left alone and uncounted."""
        removed = []
        for key in sorted(self.fs.listdir(self.root)):
            if not fmt.CONTEXT_KEY_RE.match(key):
                continue
            try:
                d = self._context_dir(key)
            except PathConfinementError:
                continue  # never descend into a symlinked folder
            dirty = False
            for name in self.fs.listdir(d):
                p = os.path.join(d, name)
                st = self.fs.lstat(p)
                if not stat.S_ISREG(st.st_mode):
                    continue
                if _TMP_RE.match(name):
                    self.fs.unlink(p)
                    removed.append(f"{key}/{name}")
                    dirty = True
                elif _NAME_RE.match(name):
                    self._usage += st.st_size
            if dirty:
                self.fs.fsync_dir(d)
        return removed

    def usage_bytes(self) -> int:
        """Bytes of chunk files under the root (plus temporaries being written)."""
        return self._usage

    # -- writing -------------------------------------------------------------------------------------

    def write(self, key: str, index: int, enc: EncodedChunk, token_start: int) -> ChunkMeta:
        """Write chunk ``index`` of context ``key`` (all layers of ``enc``) crash-safely.

        ``token_start`` is the position of the chunk's first token; the file records
        ``[token_start, token_start + T)``. Replaces an existing file atomically.
        """
        index = _check_index(index)
        if enc.first_layer != 0:
            raise ValueError("write needs every layer of the chunk (first_layer == 0)")
        parts, lens, sums, psum = fmt.store_records(enc, self.config.lz4_level)
        pos = sum(lens)
        header = fmt.ChunkHeader(
            self.fingerprint, check_context_key(key), index, int(token_start),
            int(token_start) + enc.shape[3], enc.level, enc.version, enc.dtype, enc.params,
            tuple(enc.shape), enc.record_nbytes, tuple(lens), tuple(sums), psum)
        head, crc = fmt.pack(header)
        nbytes = len(head) + pos
        d = self._context_dir(key, create=True)
        final = os.path.join(d, f"{index:08d}{_SUFFIX}")
        with self._lock:
            old = self._existing_size(final)
            cap = self.config.disk_cap_bytes
            after = self._usage - old + nbytes
            if cap and after > cap:
                raise DiskCapExceededError(
                    f"writing {nbytes} B would take the store to {after} B, over its cap of "
                    f"{cap} B")
            self._usage += nbytes  # reserved for the temporary until the rename settles it
        tmp = os.path.join(d, f".{index:08d}.{secrets.token_hex(4)}.tmp")
        renamed = False
        try:
            fd = self.fs.open(tmp, CREATE_FLAGS, 0o600)
            try:
                self.fs.write(fd, [head, *parts])
                if self.config.fsync:
                    self.fs.fsync(fd)
            finally:
                self.fs.close(fd)
            self.fs.rename(tmp, final)
            renamed = True
            if self.config.fsync:
                self.fs.fsync_dir(d)
        finally:
            with self._lock:
                if renamed:
                    self._usage -= old
                else:
                    self._usage -= nbytes
            if not renamed:
                try:
                    self.fs.unlink(tmp)
                except FileNotFoundError:
                    pass
        return ChunkMeta(self.file_name(key, index), nbytes, f"{crc:08x}", header)

    def _existing_size(self, path: str) -> int:
        try:
            st = self.fs.lstat(path)
        except FileNotFoundError:
            return 0
        if not stat.S_ISREG(st.st_mode):
            raise PathConfinementError(f"{os.path.basename(path)} is not a regular file")
        return st.st_size

    # -- reading -------------------------------------------------------------------------------------

    def _open(self, key: str, index: int) -> tuple[int, str]:
        d = self._context_dir(key)
        if d is None:
            raise ChunkNotFoundError(f"no chunk {index} of context {key}")
        p = os.path.join(d, f"{_check_index(index):08d}{_SUFFIX}")
        try:
            return self.fs.open(p, READ_FLAGS), p
        except FileNotFoundError:
            raise ChunkNotFoundError(f"no chunk {index} of context {key}") from None
        except OSError as e:  # ELOOP: the name is a symlink
            raise PathConfinementError(f"cannot open chunk {index} of {key}: {e.strerror}") from e

    def _pread(self, fd: int, n: int, offset: int) -> bytes:
        if self._bucket is not None:
            self._bucket.acquire(n)
        return self.fs.pread(fd, n, offset)

    def _pread_array(self, fd: int, n: int, offset: int) -> np.ndarray:
        """``n`` bytes at ``offset`` read into a fresh writable uint8 array (shorter at EOF)."""
        if self._bucket is not None:
            self._bucket.acquire(n)
        buf = np.empty(n, np.uint8)
        return buf[:self.fs.pread_into(fd, buf, offset)]

    def _header(self, fd: int, key: str, index: int, whole: bool
                ) -> tuple[fmt.ChunkHeader, int, int, str, np.ndarray | bytes]:
        """(header, payload offset, file size, checksum hex, bytes read) of an open chunk file.

        With ``whole`` the entire file is read in one call into a writable array (one I/O for a
        full-chunk read, and the records are used in place); otherwise the prefix and a typical
        header are read speculatively.
        """
        size = self.fs.fstat(fd).st_size
        if size > self.config.max_file_bytes:
            raise CorruptChunkError(f"chunk file of {size} B exceeds the {self.config.max_file_bytes}"
                                    " B cap")
        if whole:
            head = self._pread_array(fd, size, 0)
        else:
            head = self._pread(fd, min(size, fmt.PREFIX_NBYTES + 4096), 0)
        m = memoryview(head)  # slicing a memoryview is cheaper than slicing the numpy array
        hlen, crc = fmt.parse_prefix(m, size, self.config.max_header_bytes)
        end = fmt.PREFIX_NBYTES + hlen
        base = fmt.payload_start(hlen)
        if len(m) < base:
            m = memoryview(bytes(m) + self._pread(fd, base - len(m), len(m)))
        if len(m) < base:
            raise CorruptChunkError("file ends inside its header (truncated)")
        h = fmt.parse_header(m[fmt.PREFIX_NBYTES:end], crc, self.config.max_record_bytes)
        fmt.check_padding(m[end:base])
        if h.fingerprint != self.fingerprint:
            raise FingerprintMismatchError(
                f"chunk {index} of {key} was written for model {h.fingerprint[:64]!r}, "
                f"not {self.fingerprint!r}")
        if h.context != key or h.index != index:
            raise CorruptChunkError(f"file of chunk {index} of {key} holds chunk {h.index} of "
                                    f"{h.context}")
        if h.shape[0] * h.record_nbytes > self.config.max_file_bytes:  # lz4 could expand ~255x
            raise CorruptChunkError(f"chunk records of {h.shape[0] * h.record_nbytes} B exceed the "
                                    f"{self.config.max_file_bytes} B file cap")
        if base + h.payload_nbytes != size:
            raise CorruptChunkError(f"file is {size} B, header promises "
                                    f"{base + h.payload_nbytes} B (torn or truncated)")
        return h, base, size, f"{crc:08x}", head

    def read_meta(self, key: str, index: int) -> ChunkMeta:
        """Parse and check the header (and the file size) without reading the payload."""
        fd, _ = self._open(key, index)
        try:
            h, _, size, checksum, _ = self._header(fd, key, index, whole=False)
        finally:
            self.fs.close(fd)
        return ChunkMeta(self.file_name(key, index), size, checksum, h)

    def read_layers(self, key: str, index: int, layers: range | None = None) -> EncodedChunk:
        """Read layers ``layers`` (a step-1 range; default all) of one chunk, checked.

        A full read is one read call for the whole file and one crc32 pass over its payload; a
        partial read reads the header and then only the records of those layers (one contiguous
        read), each checked against its own crc32. The payload is writable and, when no layer is
        lz4-compressed, a view of the buffer the file was read into.
        """
        fd, _ = self._open(key, index)
        try:
            return self._read_fd(fd, key, index, layers)
        finally:
            self.fs.close(fd)

    def _read_fd(self, fd: int, key: str, index: int, layers: range | None) -> EncodedChunk:
        """read_layers on an open chunk file (the caller closes it)."""
        whole = layers is None
        h, base, size, _, head = self._header(fd, key, index, whole=whole)
        nl = h.shape[0]
        layers = range(nl) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= nl:
            raise ValueError(f"layers must be a non-empty step-1 range within [0, {nl}), "
                             f"got {layers}")
        a, b = layers.start, layers.stop
        if whole:
            blob = head[base:]  # the whole payload: its size was checked against the header
            if zlib.crc32(blob) != h.payload_checksum:
                raise CorruptChunkError("payload checksum mismatch")
        else:
            start = sum(h.lengths[:a])
            blob = self._pread_array(fd, sum(h.lengths[a:b]), base + start)
        payload = fmt.records(blob, h, layers, checked=whole)
        shape = (b - a, *h.shape[1:])
        return EncodedChunk(h.level, h.codec_version, h.dtype, shape, a, h.params, payload)

    def read(self, key: str, index: int) -> EncodedChunk:
        """Read every layer of one chunk, checked."""
        return self.read_layers(key, index)

    def prefetch(self, key: str, indices: Iterable[int]) -> int:
        """Ask the kernel to start reading these chunk files (posix_fadvise WILLNEED) and return.

        Reads that follow find the data in the page cache or in flight, so the disk works on
        many files at once instead of one synchronous read per file. Missing files are skipped;
        returns the number of files advised.
        """
        n = 0
        for i in indices:
            try:
                fd, _ = self._open(key, i)
            except ChunkNotFoundError:
                continue
            try:
                self.fs.fadvise_willneed(fd)
                n += 1
            finally:
                self.fs.close(fd)
        return n

    def read_iter(self, key: str, indices: Iterable[int], *,
                  executor: Executor | None = None) -> Iterator[EncodedChunk]:
        """Read whole chunks of one context in order, prefetching ahead; yield each.

        Files are opened and advised (posix_fadvise WILLNEED) in windows of
        ``_READ_WINDOW`` chunks, one window ahead of the reads, and each file is read through the
        descriptor that advised it (one open per file; at most two windows of descriptors open).
        A consumer that decodes and drops each chunk before the next keeps memory flat (and the
        allocator reuses the same pages); with ``executor`` the reads of a window run in
        parallel (the read and the crc32 release the GIL). A missing file raises
        ChunkNotFoundError at its position.
        """
        indices = list(indices)
        windows = [indices[w:w + _READ_WINDOW] for w in range(0, len(indices), _READ_WINDOW)]
        ahead: dict[int, int] = {}
        current: dict[int, int] = {}
        try:
            ahead = self._open_advised(key, windows[0]) if windows else {}
            for w, window in enumerate(windows):
                current, ahead = ahead, {}
                if w + 1 < len(windows):
                    ahead = self._open_advised(key, windows[w + 1])

                def one(i: int, fds: dict[int, int] = current) -> EncodedChunk:
                    fd = fds.pop(i, None)
                    if fd is None:  # missing (read raises ChunkNotFoundError) or asked twice
                        return self.read(key, i)
                    try:
                        return self._read_fd(fd, key, i, None)
                    finally:
                        self.fs.close(fd)

                if executor is None:
                    for i in window:
                        yield one(i)
                else:
                    yield from executor.map(one, window)
        finally:
            for fd in [*current.values(), *ahead.values()]:
                self.fs.close(fd)

    def _open_advised(self, key: str, indices: list[int]) -> dict[int, int]:
        """Open the existing files of ``indices`` and advise the kernel to read them; {index: fd}."""
        fds: dict[int, int] = {}
        try:
            for i in indices:
                if i in fds:  # the same chunk twice in one window: the second read opens it anew
                    continue
                try:
                    fd, _ = self._open(key, i)
                except ChunkNotFoundError:
                    continue
                fds[i] = fd
                self.fs.fadvise_willneed(fd)
        except BaseException:
            for fd in fds.values():
                self.fs.close(fd)
            raise
        return fds

    def read_many(self, key: str, indices: Iterable[int], *,
                  executor: Executor | None = None) -> list[EncodedChunk]:
        """Read whole chunks of one context (see :meth:`read_iter`), all kept in memory."""
        return list(self.read_iter(key, indices, executor=executor))

    def check(self, key: str, index: int, expected_checksum: str | None = None) -> ChunkMeta:
        """Fully verify one chunk file (header, size, every frame); returns its meta.

        Raises ChunkNotFoundError, CorruptChunkError (also when ``expected_checksum`` differs),
        ChunkVersionError or FingerprintMismatchError.
        """
        meta = self.read_meta(key, index)
        if expected_checksum is not None and meta.checksum != expected_checksum:
            raise CorruptChunkError(f"chunk {index} of {key} has checksum {meta.checksum}, "
                                    f"expected {expected_checksum}")
        self.read_layers(key, index)
        return meta

    # -- listing and deleting ------------------------------------------------------------------------

    def contexts(self) -> list[str]:
        """Context keys that have a folder under the root."""
        return sorted(k for k in self.fs.listdir(self.root) if fmt.CONTEXT_KEY_RE.match(k))

    def indices(self, key: str) -> list[int]:
        """Chunk indices of a context that have a file."""
        d = self._context_dir(key)
        if d is None:
            return []
        return sorted(int(m.group(1)) for n in self.fs.listdir(d) if (m := _NAME_RE.match(n)))

    def delete(self, key: str, index: int) -> bool:
        """Delete one chunk file; False if it did not exist."""
        d = self._context_dir(key)
        if d is None:
            return False
        p = os.path.join(d, f"{_check_index(index):08d}{_SUFFIX}")
        with self._lock:
            try:
                size = self._existing_size(p)
                self.fs.unlink(p)
            except FileNotFoundError:
                return False
            self._usage -= size
        self.fs.fsync_dir(d)
        return True

    def delete_context(self, key: str) -> int:
        """Delete every chunk file of a context and its folder; returns the files removed."""
        d = self._context_dir(key)
        if d is None:
            return 0
        removed = 0
        for name in self.fs.listdir(d):
            if _NAME_RE.match(name) or _TMP_RE.match(name):
                p = os.path.join(d, name)
                with self._lock:
                    try:
                        size = self._existing_size(p)
                        self.fs.unlink(p)
                    except FileNotFoundError:
                        continue
                    if _NAME_RE.match(name):
                        self._usage -= size
                        removed += 1
        try:
            self.fs.rmdir(d)
        except OSError:
            pass  # a foreign file is in the folder: leave it (and the folder) alone
        self.fs.fsync_dir(self.root)
        return removed

    def delete_names(self, names: Iterable[str]) -> int:
        """Delete chunk files by their relative names (as returned by the registry)."""
        removed = 0
        for name in names:
            key, _, base = name.partition("/")
            m = _NAME_RE.match(base)
            if m is None:
                raise InvalidKeyError(f"not a chunk file name: {name[:80]!r}")
            removed += self.delete(key, int(m.group(1)))
        return removed
