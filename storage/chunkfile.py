"""ChunkStore: crash-safe, checksummed KV chunk records in per-context pack files under a confined root.

Layout: ``<root>/<context key>/<generation:012d>.<lo:08d>-<hi:08d>.kvp``. A pack holds the records of
chunks ``lo..hi`` of one context (format of a record in :mod:`storage.chunkformat`), back to back,
each starting at a multiple of 64 bytes; a pack of one chunk is byte for byte a format-2 chunk file.
Packs are immutable: written once under a temporary name, fsynced, renamed, folder fsynced.

Why packs and not one file per chunk (format 2 until session 12): reading a context back costs a
fixed amount per file (open, read, close, header checks), and on the firecracker VMs measured here
plain reads of the 128 files of a 2048-token context reached only 39-93% of the disk's sequential
read, so the 70% target could not hold with one file per chunk. A write-back writes a call's
modified chunks as one pack, so a prefill's 128 chunks come back with a few large reads: 1.4-4.1x
faster than one pack per chunk in the same runs (docs/benchmarks.md, "Chunk packs").

Generations decide which record of a chunk is current. Each pack has a generation, one above the
highest in its context folder, and the name's range ``lo..hi`` is its authority: for every chunk in
it, the newest pack whose range covers the chunk decides, by holding its record or, if it holds
none, by saying the chunk has no record (an empty ``.kvd`` file of the same naming is a deletion
marker). A write of chunks that are not contiguous becomes one pack per contiguous run. So a rename
is the one step that makes a new version current, for every chunk of the pack at once; there is no
index file to keep in step.

Packs that no longer decide anything are removed: after a write, a delete or on first use of a
context, every pack with no current record whose removal changes no chunk's answer is unlinked (in
rounds, the folder fsynced between them, so an older record never comes back after a crash).
Superseded records inside a pack that still holds current ones take space until compaction: when a
context's current records are in more than ``max_packs`` packs, or it has more superseded than
current bytes (and at least ``compact_min_bytes``), its current records are copied verbatim (their
checksums do not change) into new packs and the old ones are removed. Compaction keeps the pack with the most current bytes unless
that one is itself mostly superseded.

Damage: a pack whose records cannot all be parsed (torn by something other than our writes, flipped
bits in a header, truncated, wrong version, a record of another context or outside the name's range)
is kept on disk and contributes no records; every chunk in its range whose newest readable record is
older than it raises the pack's error (CorruptChunkError, ChunkVersionError, PathConfinementError)
until a newer write replaces the chunk. Payload bytes are checked on every read (crc32 of the whole
payload for a full read, of each layer read for a partial one), so flipped payload bits are found
when the chunk is read, never returned as data.

State: the store keeps, per context it has touched, which record of which pack is current and the
record headers as parsed (so partial reads need no header read). It is built by scanning the
context's packs on first use. One ChunkStore writes a root at a time (the KV swap/IO worker); files
changed behind its back are seen by the next ChunkStore opened on the root, and until then every read
still checks the record's header bytes, the pack's size and the payload checksums.

Paths: a context key must match ``^[0-9a-f]{8,64}$`` and a chunk index is an int, so a client string
never becomes a path; file names are built by the store from numbers; the root is resolved once
(realpath); a context folder is checked with lstat to be a plain folder when the store first uses
it (a symlink is refused, never followed); files are opened with O_NOFOLLOW and created with O_EXCL.

Capacity: ``usage_bytes()`` is the bytes of all pack files (including superseded records not yet
compacted away) and temporaries being written; a write that would leave usage above
``disk_cap_bytes`` (counting the packs it makes removable) raises DiskCapExceededError before
anything is written. Reads can be throttled (token bucket, injectable clock and sleep).

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections import deque
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from storage import chunkformat as fmt
from storage.codecs import EncodedChunk
from storage.errors import (ChunkNotFoundError, CorruptChunkError, DiskCapExceededError,
                            FingerprintMismatchError, InvalidKeyError, PathConfinementError,
                            StorageError)
from storage.fileops import CREATE_FLAGS, READ_FLAGS, FileOps
from storage.throttle import TokenBucket

_PACK_RE = re.compile(r"^(\d{12})\.(\d{8})-(\d{8})\.(kvp|kvd)$")  # .kvd: an empty deletion marker
_LEGACY_RE = re.compile(r"^(\d{8})\.kvc$")  # format-2 stores: one chunk per file, read as packs
_TMP_RE = re.compile(r"^\.\d{8,12}\.[0-9a-f]{8}\.tmp$")
_CHUNK_NAME_RE = re.compile(r"^(\d{8})\.kvc$")  # the registry's name of a chunk (see file_name)
_MAX_INDEX = 10**8 - 1
_MAX_GEN = 10**12 - 1
_ALIGN = fmt.PAYLOAD_ALIGN
_RUN_GAP = 64 * 1024  # read_iter reads across gaps up to this size rather than issue another read
_RUN_BYTES = 8 << 20  # and reads at most this much in one call
_FIRST_RUN_BYTES = 1 << 20  # the first run of read_each is at most this long, the next ones double
# (up to _RUN_BYTES) and then shrink to half of what is left (see _plan)
_PRIME_BYTES = 4096  # the first read of a pack in read_each is this small (see _fetch)


@dataclass(frozen=True, slots=True)
class ChunkStoreConfig:
    """Tunables of one ChunkStore."""

    disk_cap_bytes: int = 0  # refuse writes that would make usage_bytes() exceed this (bytes); 0: no cap
    read_bytes_per_s: float = 0.0  # read throttle, token-bucket rate (bytes/s); 0: off
    read_burst_bytes: int = 256 * 1024  # read throttle bucket depth (bytes)
    max_header_bytes: int = 64 * 1024  # largest chunk header accepted on read (bytes)
    max_record_bytes: int = 64 * 1024 * 1024  # largest decompressed layer record accepted (bytes)
    max_file_bytes: int = 256 * 1024 * 1024  # larger pack files are refused unread (bytes)
    pack_bytes: int = 64 * 1024 * 1024  # a write or compaction starts a new pack past this (bytes)
    max_packs: int = 64  # compact a context whose current records are in more packs than this
    compact_min_bytes: int = 1 << 20  # and one whose superseded bytes exceed both this and its current ones
    lz4_level: int = 0  # lz4 level tried per layer record (0-2 fast, 3-16 high compression, -1 off);
    # a layer is kept compressed only when that saves an eighth of it (<1% of layers of real K/V)
    fsync: bool = True  # fsync file and folder on every write (False only for page-cache benchmarks)


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What the store knows about one chunk's record after writing or reading its header."""

    name: str  # the chunk's name relative to the root, "<context>/<index:08d>.kvc" (see file_name)
    nbytes: int  # bytes of the record on disk
    checksum: str  # crc32 of the header as 8 hex digits: identifies this exact record content
    header: fmt.ChunkHeader  # the parsed header


@dataclass(eq=False, slots=True)
class _Pack:
    name: str  # file name in the context folder
    gen: int  # -1 for a format-2 chunk file
    lo: int
    hi: int  # the chunks this pack decides, lo..hi inclusive
    nbytes: int  # file size
    records: dict[int, _Rec] = field(default_factory=dict)  # every record it holds, current or not
    live: set[int] = field(default_factory=set)  # chunks whose current record is here
    damage: StorageError | None = None  # why its records could not be read (it then has none)

    def covers(self, i: int) -> bool:
        return self.lo <= i <= self.hi


@dataclass(eq=False, slots=True)
class _Rec:
    pack: _Pack
    index: int
    offset: int  # in the pack file
    nbytes: int  # of the record, header and payload
    base: int  # payload start within the record
    head: bytes  # the record's bytes before the payload, as parsed
    header: fmt.ChunkHeader
    checksum: str  # header crc32, 8 hex digits


@dataclass(eq=False, slots=True)
class _Ctx:
    key: str
    dir: str
    packs: dict[str, _Pack] = field(default_factory=dict)
    live: dict[int, _Rec] = field(default_factory=dict)
    damaged: list[_Pack] = field(default_factory=list)  # packs whose records could not be read
    next_gen: int = 0


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


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


_READER: ThreadPoolExecutor | None = None
_READER_LOCK = threading.Lock()


def _reader() -> ThreadPoolExecutor:
    """The process's one reader thread for read_each (it mostly waits on the disk)."""
    global _READER
    with _READER_LOCK:
        if _READER is None:
            _READER = ThreadPoolExecutor(1, thread_name_prefix="llmaas-chunk-read")
        return _READER


def _layout(records: list[list]) -> tuple[list, list[int], int]:
    """Pack layout of records given as lists of byte buffers: (buffers to write, with zero padding
    so every record starts at a multiple of 64, each record's offset, total bytes)."""
    buffers, offsets, o = [], [], 0
    for parts in records:
        if o % _ALIGN:
            buffers.append(bytes(_ALIGN - o % _ALIGN))
            o = _aligned(o)
        offsets.append(o)
        buffers += parts
        o += sum(len(x) for x in parts)
    return buffers, offsets, o


def _runs(indices: list[int]) -> list[list[int]]:
    """Sorted distinct indices cut into runs of consecutive values."""
    out: list[list[int]] = []
    for i in indices:
        if out and i == out[-1][-1] + 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class ChunkStore:
    """Chunk records of many contexts under ``root`` (created if missing). Thread-safe."""

    def __init__(self, root: str | os.PathLike, config: ChunkStoreConfig | None = None, *,
                 fingerprint: str, fs: FileOps | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.config = config or ChunkStoreConfig()
        self.fingerprint = fingerprint  # model identity written into and required of every record
        self.fs = fs or FileOps()
        Path(root).mkdir(parents=True, exist_ok=True)
        self.root = os.path.realpath(root)  # every path used lies below this
        self._lock = threading.RLock()  # guards the per-context state, _usage and folder creation
        self._write_lock = threading.Lock()  # one write, delete or compaction at a time
        self._usage = 0  # bytes of pack files and in-flight temporaries
        self._ctxs: dict[str, _Ctx] = {}
        self._bucket = (TokenBucket(self.config.read_bytes_per_s, self.config.read_burst_bytes,
                                    clock, sleep) if self.config.read_bytes_per_s > 0 else None)
        self.compactions = 0  # contexts compacted by this store
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
        """The chunk's name relative to the root, what the registry stores: ``<key>/<index:08d>.kvc``.

        It names the chunk, not a file (the chunk's record lives in one of the context's packs,
        which compaction may change); :meth:`path` gives the pack file."""
        return f"{check_context_key(key)}/{_check_index(index):08d}.kvc"

    def path(self, key: str, index: int) -> str:
        """Absolute path of the pack file holding the chunk's current record (ChunkNotFoundError)."""
        with self._lock:
            rec = self._lookup(self._ctx(key), _check_index(index), key)
            return os.path.join(self._ctxs[key].dir, rec.pack.name)

    def files(self, key: str) -> list[str]:
        """Absolute paths of the context's pack files (empty if it has none)."""
        with self._lock:
            c = self._ctx(key)
            return [] if c is None else [os.path.join(c.dir, n) for n in sorted(c.packs)]

    # -- startup and per-context state ---------------------------------------------------------------

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
                elif _PACK_RE.match(name) or _LEGACY_RE.match(name):
                    self._usage += st.st_size
            if dirty:
                self.fs.fsync_dir(d)
        return removed

    def usage_bytes(self) -> int:
        """Bytes of pack files under the root (plus temporaries being written)."""
        return self._usage

    def _ctx(self, key: str, create: bool = False) -> _Ctx | None:
        """The context's state, scanning its folder on first use (None: no folder). Hold _lock."""
        c = self._ctxs.get(key)
        if c is not None:
            return c
        d = self._context_dir(key, create=create)
        if d is None:
            return None
        c = self._ctxs[key] = _Ctx(key, d)
        for name in self.fs.listdir(d):
            m = _PACK_RE.match(name)
            legacy = _LEGACY_RE.match(name)
            if m:
                gen, lo, hi = int(m.group(1)), int(m.group(2)), int(m.group(3))
            elif legacy:
                gen, lo, hi = -1, int(legacy.group(1)), int(legacy.group(1))
            else:
                continue
            p = _Pack(name, gen, lo, hi, 0)
            try:
                if lo > hi:
                    raise CorruptChunkError(f"pack {name} has an empty range")
                self._scan_pack(c, p)
            except StorageError as e:
                p.damage = e
            except OSError as e:  # ELOOP (a symlink), EACCES, ...: unreadable
                p.damage = PathConfinementError(f"cannot read pack {name}: {e.strerror}")
            c.packs[name] = p
            if p.damage is not None:
                c.damaged.append(p)
            c.next_gen = max(c.next_gen, gen + 1)
        for p in sorted(c.packs.values(), key=lambda p: p.gen):
            self._settle(c, p)
        self._collect(c)
        return c

    def _scan_pack(self, c: _Ctx, p: _Pack) -> None:
        """Parse every record header of a pack file into ``p.records`` (raises on any damage)."""
        fd = self.fs.open(os.path.join(c.dir, p.name), READ_FLAGS)
        try:
            size = p.nbytes = self.fs.fstat(fd).st_size
            if size > self.config.max_file_bytes:
                raise CorruptChunkError(f"pack file of {size} B exceeds the "
                                        f"{self.config.max_file_bytes} B cap")
            if p.name.endswith(".kvd"):
                if size:
                    raise CorruptChunkError(f"deletion marker {p.name} is not empty")
                return
            o = 0
            while True:
                rec = self._parse_record(fd, c.key, p, o, size)
                if not p.covers(rec.index):
                    raise CorruptChunkError(f"pack {p.name} holds chunk {rec.index}, outside "
                                            f"{p.lo}..{p.hi}")
                if rec.index in p.records:
                    raise CorruptChunkError(f"pack {p.name} holds chunk {rec.index} twice")
                p.records[rec.index] = rec
                end = o + rec.nbytes
                if end == size:
                    break
                o = _aligned(end)
                if o >= size:
                    raise CorruptChunkError(f"pack {p.name} has {size - end} B after its last record")
        finally:
            self.fs.close(fd)

    def _parse_record(self, fd: int, key: str, p: _Pack, offset: int, size: int) -> _Rec:
        """Read and check the header of the record at ``offset`` of an open pack of ``size`` bytes."""
        left = size - offset
        head = self._pread(fd, min(left, fmt.PREFIX_NBYTES + 4096), offset)
        m = memoryview(head)
        hlen, crc = fmt.parse_prefix(m, left, self.config.max_header_bytes)
        end = fmt.PREFIX_NBYTES + hlen
        base = fmt.payload_start(hlen)
        if len(m) < base:
            m = memoryview(bytes(m) + self._pread(fd, base - len(m), offset + len(m)))
        if len(m) < base:
            raise CorruptChunkError("file ends inside its header (truncated)")
        h = fmt.parse_header(m[fmt.PREFIX_NBYTES:end], crc, self.config.max_record_bytes)
        fmt.check_padding(m[end:base])
        if h.context != key:
            raise CorruptChunkError(f"pack {p.name} holds a chunk of context {h.context}")
        if h.shape[0] * h.record_nbytes > self.config.max_file_bytes:  # lz4 could expand ~255x
            raise CorruptChunkError(f"chunk records of {h.shape[0] * h.record_nbytes} B exceed the "
                                    f"{self.config.max_file_bytes} B file cap")
        n = base + h.payload_nbytes
        if n > left:
            raise CorruptChunkError(f"pack {p.name} is {size} B, its record at {offset} promises "
                                    f"{offset + n} B (torn or truncated)")
        return _Rec(p, h.index, offset, n, base, bytes(m[:base]), h, f"{crc:08x}")

    def _settle(self, c: _Ctx, p: _Pack) -> None:
        """Make pack ``p`` (newer than every pack settled before it) decide its range. Hold _lock."""
        for i in range(p.lo, p.hi + 1):
            old = c.live.get(i)
            if old is not None and old.pack.gen <= p.gen and old.pack is not p:
                old.pack.live.discard(i)
                del c.live[i]
            if p.damage is None and i in p.records and i not in c.live:
                c.live[i] = p.records[i]
                p.live.add(i)

    def _lookup(self, c: _Ctx | None, i: int, key: str) -> _Rec:
        """The current record of chunk ``i``; raises the damage of a newer damaged pack covering it,
        or ChunkNotFoundError. Hold _lock."""
        rec = None if c is None else c.live.get(i)
        if c is not None and c.damaged:
            gen = -2 if rec is None else rec.pack.gen
            for p in c.damaged:
                if p.covers(i) and p.gen >= gen:
                    raise type(p.damage)(f"chunk {i} of {key}: pack {p.name} is damaged: {p.damage}")
        if rec is None:
            raise ChunkNotFoundError(f"no chunk {i} of context {key}")
        return rec

    def _removable(self, c: _Ctx) -> list[_Pack]:
        """Packs with no current record whose removal changes no chunk's answer. Hold _lock."""
        out = []
        for p in c.packs.values():
            if p.live or p.damage is not None:
                continue
            safe = True
            for i in range(p.lo, p.hi + 1):
                covering = [q for q in c.packs.values() if q.covers(i) and q.gen <= p.gen and q is not p]
                newer = [q for q in c.packs.values() if q.covers(i) and q.gen > p.gen]
                if newer or not covering:
                    continue  # p does not decide i, or nothing older would take over
                prev = max(covering, key=lambda q: q.gen)
                if prev.damage is not None or i in prev.records:
                    safe = False  # an older record (or unknown contents) would come back
                    break
            if safe:
                out.append(p)
        return out

    def _collect(self, c: _Ctx) -> int:
        """Unlink removable packs, in rounds with a folder fsync between. Hold _lock."""
        removed = 0
        while True:
            gone = self._removable(c)
            if not gone:
                return removed
            if removed and self.config.fsync:
                self.fs.fsync_dir(c.dir)  # the previous round's unlinks first
            for p in gone:
                try:
                    self.fs.unlink(os.path.join(c.dir, p.name))
                except FileNotFoundError:
                    pass
                else:
                    self._usage -= p.nbytes
                del c.packs[p.name]
                removed += 1

    # -- writing -------------------------------------------------------------------------------------

    def write(self, key: str, index: int, enc: EncodedChunk, token_start: int) -> ChunkMeta:
        """Write one chunk (all layers of ``enc``) crash-safely, as a pack of its own.

        ``token_start`` is the position of the chunk's first token; the record says
        ``[token_start, token_start + T)``. Replaces the chunk's current record atomically.
        """
        return self.write_many(key, [(index, enc, token_start)])[0]

    def write_many(self, key: str, items: Sequence[tuple[int, EncodedChunk, int]]) -> list[ChunkMeta]:
        """Write chunks ``(index, encoded, token_start)`` of one context: one pack per run of
        consecutive indices (cut at ``pack_bytes``), each crash-safe. Returns a meta per item, in
        order. Each pack replaces the current records of its chunks atomically; a failure leaves the
        packs written before it in place."""
        check_context_key(key)
        by_index: dict[int, tuple[EncodedChunk, int]] = {}
        for index, enc, token_start in items:
            index = _check_index(index)
            if enc.first_layer != 0:
                raise ValueError("write needs every layer of the chunk (first_layer == 0)")
            if index in by_index:
                raise ValueError(f"chunk {index} given twice")
            by_index[index] = (enc, int(token_start))
        metas: dict[int, ChunkMeta] = {}
        with self._write_lock:
            with self._lock:
                c = self._ctx(key, create=True)
            for run in _runs(sorted(by_index)):
                built = [self._build(key, i, *by_index[i]) for i in run]
                start, size = 0, 0
                for k, (head, parts, _, _) in enumerate(built):  # a new pack past pack_bytes
                    n = _aligned(len(head) + sum(len(x) for x in parts))
                    if k > start and size + n > self.config.pack_bytes:
                        metas.update(self._write_pack(c, run[start:k], built[start:k]))
                        start, size = k, 0
                    size += n
                metas.update(self._write_pack(c, run[start:], built[start:]))
            self._maybe_compact(c)
        return [metas[_check_index(i)] for i, _, _ in items]

    def _build(self, key: str, index: int, enc: EncodedChunk, token_start: int
               ) -> tuple[bytes, list, fmt.ChunkHeader, int]:
        """(prefix + header + padding, payload parts, header, header crc) of one record."""
        parts, lens, sums, psum = fmt.store_records(enc, self.config.lz4_level)
        header = fmt.ChunkHeader(
            self.fingerprint, key, index, token_start, token_start + enc.shape[3], enc.level,
            enc.version, enc.dtype, enc.params, tuple(enc.shape), enc.record_nbytes, tuple(lens),
            tuple(sums), psum)
        head, crc = fmt.pack(header)
        return head, parts, header, crc

    def _write_pack(self, c: _Ctx, indices: list[int], built: list) -> dict[int, ChunkMeta]:
        """Write one pack of consecutive chunks (or, with no records, a deletion marker for
        ``indices``) and make it current. Hold _write_lock."""
        buffers, offsets, nbytes = _layout([[head, *parts] for head, parts, _, _ in built])
        recs = [(i, o, len(head) + sum(len(x) for x in parts), len(head), head, header, crc)
                for i, o, (head, parts, header, crc) in zip(indices, offsets, built)]
        with self._lock:
            gen = c.next_gen
            if gen > _MAX_GEN:
                raise CorruptChunkError(f"context {c.key} has run out of pack generations")
            c.next_gen += 1
            freed = self._freed_by(c, indices)
            cap = self.config.disk_cap_bytes
            after = self._usage - freed + nbytes
            if cap and after > cap:
                raise DiskCapExceededError(
                    f"writing {nbytes} B would take the store to {after} B, over its cap of "
                    f"{cap} B")
            self._usage += nbytes  # reserved for the temporary until the rename settles it
        name = f"{gen:012d}.{indices[0]:08d}-{indices[-1]:08d}.{'kvp' if built else 'kvd'}"
        self._commit_file(c, gen, name, buffers, nbytes)
        p = _Pack(name, gen, indices[0], indices[-1], nbytes)
        for i, off, n, base, head, header, crc in recs:
            p.records[i] = _Rec(p, i, off, n, base, head, header, f"{crc:08x}")
        self._install(c, p)
        return {i: ChunkMeta(self.file_name(c.key, i), n, f"{crc:08x}", header)
                for i, off, n, base, head, header, crc in recs}

    def _commit_file(self, c: _Ctx, gen: int, name: str, buffers: list, nbytes: int) -> None:
        """Write ``buffers`` as pack ``name`` crash-safely: a temporary in the folder, fsync, rename,
        fsync of the folder. ``nbytes`` were already added to the usage; taken back on failure."""
        tmp = os.path.join(c.dir, f".{gen:012d}.{secrets.token_hex(4)}.tmp")
        renamed = False
        try:
            fd = self.fs.open(tmp, CREATE_FLAGS, 0o600)
            try:
                if buffers:
                    self.fs.write(fd, buffers)
                if self.config.fsync:
                    self.fs.fsync(fd)
            finally:
                self.fs.close(fd)
            self.fs.rename(tmp, os.path.join(c.dir, name))
            renamed = True
            if self.config.fsync:
                self.fs.fsync_dir(c.dir)
        finally:
            if not renamed:
                with self._lock:
                    self._usage -= nbytes
                try:
                    self.fs.unlink(tmp)
                except FileNotFoundError:
                    pass

    def _install(self, c: _Ctx, p: _Pack) -> None:
        """Make a pack just written current and remove what it made removable."""
        with self._lock:
            c.packs[p.name] = p
            self._settle(c, p)
            self._collect(c)

    def _freed_by(self, c: _Ctx, indices: list[int]) -> int:
        """Bytes of the packs whose every current record a pack over ``indices`` replaces (what it
        makes removable, for the cap check). Hold _lock."""
        lo, hi = indices[0], indices[-1]
        return sum(p.nbytes for p in c.packs.values()
                   if p.live and p.damage is None and all(lo <= i <= hi for i in p.live))

    def _maybe_compact(self, c: _Ctx) -> bool:
        """Copy current records into fresh packs when the context is fragmented or mostly
        superseded (see the module docstring). Hold _write_lock."""
        with self._lock:
            packs = [p for p in c.packs.values() if p.damage is None and p.live]
            live = {p.name: sum(p.records[i].nbytes for i in p.live) for p in packs}
            total_live = sum(live.values())
            dead = sum(p.nbytes for p in packs) - total_live
            many = len(packs) > self.config.max_packs  # packs a read may touch
            wasteful = dead > max(total_live, self.config.compact_min_bytes)
            if not (many or wasteful) or not packs:
                return False
            keep = max(packs, key=lambda p: live[p.name])
            if 2 * live[keep.name] < keep.nbytes or len(packs) == 1:
                keep = None  # the biggest pack is itself mostly superseded: rewrite everything
            chosen = [p for p in packs if p is not keep]
            if not chosen:
                return False
            lo = min(min(p.live) for p in chosen)
            hi = max(max(p.live) for p in chosen)
            moving = [c.live[i] for i in sorted(c.live) if lo <= i <= hi
                      and self._readable(c, c.live[i])]
        if not moving:
            return False
        # read the moving records' bytes verbatim, pack by pack
        data: dict[int, bytes] = {}
        by_pack: dict[str, list[_Rec]] = {}
        for r in moving:
            by_pack.setdefault(r.pack.name, []).append(r)
        for name, recs in by_pack.items():
            try:
                fd = self.fs.open(os.path.join(c.dir, name), READ_FLAGS)
            except OSError:
                return False  # gone behind our back: reads will say so; do not compact
            try:
                for r in recs:
                    data[r.index] = self.fs.pread(fd, r.nbytes, r.offset)
            finally:
                self.fs.close(fd)
        if any(len(data[r.index]) != r.nbytes for r in moving):
            return False
        # new packs tile lo..hi (chunks without a current record in it stay without one)
        pieces, cur, size = [], [], 0
        for r in moving:
            if cur and size + r.nbytes > self.config.pack_bytes:
                pieces.append(cur)
                cur, size = [], 0
            cur.append(r)
            size += _aligned(r.nbytes)
        pieces.append(cur)
        start = lo
        for k, piece in enumerate(pieces):
            end = hi if k == len(pieces) - 1 else piece[-1].index
            self._write_copy(c, start, end, piece, data)
            start = end + 1
        self.compactions += 1
        return True

    def _readable(self, c: _Ctx, r: _Rec) -> bool:
        """Whether no damaged pack newer than ``r``'s covers it (a tainted chunk is not moved)."""
        return not any(p.covers(r.index) and p.gen >= r.pack.gen for p in c.damaged)

    def _write_copy(self, c: _Ctx, lo: int, hi: int, recs: list[_Rec], data: dict[int, bytes]) -> None:
        """Write a pack deciding ``lo..hi`` that holds copies of ``recs``. Hold _write_lock."""
        buffers, offsets, o = _layout([[data[r.index]] for r in recs])
        placed = list(zip(recs, offsets))
        with self._lock:
            gen = c.next_gen
            c.next_gen += 1
            self._usage += o
        name = f"{gen:012d}.{lo:08d}-{hi:08d}.kvp"
        self._commit_file(c, gen, name, buffers, o)
        p = _Pack(name, gen, lo, hi, o)
        for r, off in placed:
            p.records[r.index] = _Rec(p, r.index, off, r.nbytes, r.base, r.head, r.header, r.checksum)
        self._install(c, p)

    # -- reading -------------------------------------------------------------------------------------

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

    def _locate(self, key: str, index: int) -> tuple[_Rec, str]:
        """(current record, pack path) of a chunk, checked for the model fingerprint."""
        index = _check_index(index)
        with self._lock:
            c = self._ctx(key)
            rec = self._lookup(c, index, key)
            path = c.dir + os.sep + rec.pack.name
        if rec.header.fingerprint != self.fingerprint:
            raise FingerprintMismatchError(
                f"chunk {index} of {key} was written for model {rec.header.fingerprint[:64]!r}, "
                f"not {self.fingerprint!r}")
        return rec, path

    def _open(self, rec: _Rec, path: str) -> int:
        """Open a pack and check its size is still what was scanned or written."""
        try:
            fd = self.fs.open(path, READ_FLAGS)
        except FileNotFoundError:
            self._vanished(rec)
            raise ChunkNotFoundError(f"pack {rec.pack.name} of chunk {rec.index} is gone") from None
        except OSError as e:  # ELOOP: the name is a symlink
            raise PathConfinementError(f"cannot open pack {rec.pack.name}: {e.strerror}") from e
        try:
            size = self.fs.fstat(fd).st_size
            if size != rec.pack.nbytes:
                raise CorruptChunkError(f"pack {rec.pack.name} is {size} B, was {rec.pack.nbytes} B "
                                        "(truncated or appended to)")
        except BaseException:
            self.fs.close(fd)
            raise
        return fd

    def _vanished(self, rec: _Rec) -> None:
        """The pack of a current record was removed behind our back: forget it and its records."""
        p = rec.pack
        with self._lock:
            c = self._ctxs.get(rec.header.context)
            if c is None or c.packs.get(p.name) is not p:
                return  # already replaced (compaction) or forgotten
            del c.packs[p.name]
            for i in p.live:
                c.live.pop(i, None)
            p.live.clear()
            self._usage -= p.nbytes

    def _check_head(self, rec: _Rec, m: memoryview) -> None:
        """The record's header bytes as read must be those parsed; else say precisely what is wrong."""
        if m[:rec.base] == rec.head:
            return
        hlen, crc = fmt.parse_prefix(m, len(m), self.config.max_header_bytes)
        h = fmt.parse_header(m[fmt.PREFIX_NBYTES:fmt.PREFIX_NBYTES + hlen], crc,
                             self.config.max_record_bytes)
        fmt.check_padding(m[fmt.PREFIX_NBYTES + hlen:fmt.payload_start(hlen)])
        raise CorruptChunkError(f"chunk {rec.index}: header changed on disk (now chunk {h.index} of "
                                f"{h.context})")

    def _from_record(self, rec: _Rec, buf: np.ndarray) -> EncodedChunk:
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

    def _check_layers(self, rec: _Rec, layers: range) -> None:
        nl = rec.header.shape[0]
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= nl:
            raise ValueError(f"layers must be a non-empty step-1 range within [0, {nl}), "
                             f"got {layers}")

    def _read_part(self, fd: int, rec: _Rec, layers: range) -> EncodedChunk:
        """Layers ``layers`` of a record: one read of their stored bytes, each checked by its crc32."""
        h = rec.header
        a, b = layers.start, layers.stop
        start = rec.offset + rec.base + sum(h.lengths[:a])
        blob = self._pread_array(fd, sum(h.lengths[a:b]), start)
        payload = fmt.records(blob, h, layers, checked=False)
        return EncodedChunk(h.level, h.codec_version, h.dtype, (b - a, *h.shape[1:]), a, h.params,
                            payload)

    def read_meta(self, key: str, index: int) -> ChunkMeta:
        """The chunk's header, after checking its pack's size and the header bytes on disk."""
        rec, path = self._locate(key, index)
        fd = self._open(rec, path)
        try:
            head = self._pread(fd, rec.base, rec.offset)
        finally:
            self.fs.close(fd)
        if len(head) != rec.base:
            raise CorruptChunkError(f"chunk {index}: pack ends inside its header (truncated)")
        self._check_head(rec, memoryview(head))
        return ChunkMeta(self.file_name(key, index), rec.nbytes, rec.checksum, rec.header)

    def read_layers(self, key: str, index: int, layers: range | None = None) -> EncodedChunk:
        """Read layers ``layers`` (a step-1 range; default all) of one chunk, checked.

        A full read is one read call for the record and one crc32 pass over its payload; a partial
        read reads only the records of those layers (one contiguous read), each checked against its
        own crc32. The payload is writable and, when no layer is lz4-compressed, a view of the
        buffer the record was read into.
        """
        for attempt in (0, 1):
            rec, path = self._locate(key, index)
            if layers is not None:
                self._check_layers(rec, layers)
            try:
                fd = self._open(rec, path)
            except ChunkNotFoundError:
                if attempt:
                    raise
                continue  # a compaction replaced the pack since the lookup: look again
            try:
                if layers is None:
                    return self._from_record(rec, self._pread_array(fd, rec.nbytes, rec.offset))
                return self._read_part(fd, rec, layers)
            finally:
                self.fs.close(fd)
        raise AssertionError("unreachable")

    def read(self, key: str, index: int) -> EncodedChunk:
        """Read every layer of one chunk, checked."""
        return self.read_layers(key, index)

    def _plan(self, key: str, indices: list[int]) -> list[tuple[str | None, list, object]]:
        """Cut the requested chunks, in order, into runs of records that lie close together in one
        pack: (pack path, [(index, record)], None) or (None, [(index, None)], the lookup's error)."""
        found: list[tuple[int, _Rec | None, str | None, StorageError | None]] = []
        for i in indices:
            try:
                rec, path = self._locate(key, i)
                found.append((i, rec, path, None))
            except StorageError as e:
                found.append((i, None, None, e))
        # runs grow from _FIRST_RUN_BYTES, so checking starts early, and shrink to half of what is
        # left, so the last check (the one no read hides) is short
        left = sum(r.nbytes for _, r, _, _ in found if r is not None)
        out: list[tuple[str | None, list, object]] = []
        grow = _FIRST_RUN_BYTES
        limit = grow
        for i, rec, path, err in found:
            if rec is None:
                out.append((None, [(i, None)], err))
                continue
            if out and out[-1][0] == path:
                last = out[-1][1][-1][1]
                first = out[-1][1][0][1]
                gap = rec.offset - (last.offset + last.nbytes)
                if 0 <= gap <= _RUN_GAP and rec.offset + rec.nbytes - first.offset <= limit:
                    out[-1][1].append((i, rec))
                    left -= rec.nbytes
                    continue
                grow = min(2 * grow, _RUN_BYTES)
            limit = max(min(grow, left // 2), _FIRST_RUN_BYTES // 4)
            out.append((path, [(i, rec)], None))
            left -= rec.nbytes
        return out

    def _fetch(self, run: tuple, fds: dict[str, int], prime: bool = False
               ) -> np.ndarray | StorageError | None:
        """The bytes of one run, read in one call (``prime``: two, the first of ``_PRIME_BYTES``);
        None when its pack is gone (compacted since the plan), or the error that stopped it.

        Why prime: on the VMs measured here a cold pack read with large reads from its first byte
        ran at 460-500 MB/s, and at 1250-1390 MB/s when a 4 KiB read came first (12 MB pack;
        94 MB: 1100 against 1380-1730), as the kernel's readahead then streams ahead of the large
        reads; posix_fadvise WILLNEED made it slower (415-430 MB/s). docs/benchmarks.md, "Chunk
        packs"."""
        path, items, err = run
        if path is None:
            return err
        first, last = items[0][1], items[-1][1]
        try:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = self._open(first, path)
            n = last.offset + last.nbytes - first.offset
            if self._bucket is not None:
                self._bucket.acquire(n)
            buf = np.empty(n, np.uint8)
            head = _PRIME_BYTES if prime and n > 2 * _PRIME_BYTES else 0
            got = self.fs.pread_into(fd, buf[:head], first.offset) if head else 0
            if got == head:
                got += self.fs.pread_into(fd, buf[got:], first.offset + got)
            return buf[:got]
        except ChunkNotFoundError:
            return None
        except StorageError as e:
            return e

    def _check_run(self, key: str, run: tuple, buf: np.ndarray | StorageError | None
                   ) -> list[tuple[int, EncodedChunk | StorageError]]:
        """The chunks of a fetched run, each checked on its own."""
        items = run[1]
        if buf is None:  # a compaction replaced the pack since the plan: one by one
            return [(i, self._one(key, i)) for i, _ in items]
        if isinstance(buf, StorageError):
            return [(i, buf) for i, _ in items]
        first = items[0][1]
        out: list[tuple[int, EncodedChunk | StorageError]] = []
        for i, rec in items:
            o = rec.offset - first.offset
            try:
                out.append((i, self._from_record(rec, buf[o:o + rec.nbytes])))
            except StorageError as e:
                out.append((i, e))
        return out

    def _one(self, key: str, index: int, layers: range | None = None) -> EncodedChunk | StorageError:
        try:
            return self.read_layers(key, index, layers)
        except StorageError as e:
            return e

    def _advise(self, plan: list, fds: dict[str, int]) -> int:
        """Open the runs' packs and ask the kernel to start reading the runs' bytes."""
        n = 0
        for path, items, _ in plan:
            if path is None:
                continue
            try:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = self._open(items[0][1], path)
            except StorageError:
                continue
            first, last = items[0][1], items[-1][1]
            self.fs.fadvise_willneed(fd, first.offset, last.offset + last.nbytes - first.offset)
            n += len(items)
        return n

    def read_each(self, key: str, indices: Iterable[int], *, executor: Executor | None = None
                  ) -> Iterator[tuple[int, EncodedChunk | StorageError]]:
        """Read whole chunks of one context; yield ``(index, chunk or the StorageError that chunk
        raised)`` in the order asked.

        Chunks whose records lie close together in one pack are read with one call of up to 8 MiB
        (a context written by one write-back is a few large reads; the first read of each pack is
        a small one that starts the kernel's readahead, see :meth:`_fetch`). Each record is
        checked on its own (header bytes, payload crc32) while a reader thread reads the next two
        runs, so checking overlaps the disk (reads and crc32 release the GIL). With ``executor``
        the runs are read and checked in parallel on it instead.
        """
        plan = self._plan(key, list(indices))
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
                        ahead.append(_reader().submit(self._fetch, plan[j], fds, prime[j]))
                    yield from self._check_run(key, plan[k], ahead.popleft().result())
            else:
                def one(k: int) -> list:
                    return self._check_run(key, plan[k], self._fetch(plan[k], fds, prime[k]))

                for got in executor.map(one, range(len(plan))):
                    yield from got
        finally:
            for fd in fds.values():
                self.fs.close(fd)

    def read_iter(self, key: str, indices: Iterable[int], *,
                  executor: Executor | None = None) -> Iterator[EncodedChunk]:
        """Read whole chunks of one context in the order asked (see :meth:`read_each`); the first
        chunk that cannot be read raises its error at its position."""
        for _, got in self.read_each(key, indices, executor=executor):
            if isinstance(got, StorageError):
                raise got
            yield got

    def read_many(self, key: str, indices: Iterable[int], *,
                  executor: Executor | None = None) -> list[EncodedChunk]:
        """Read whole chunks of one context (see :meth:`read_each`), all kept in memory."""
        return list(self.read_iter(key, indices, executor=executor))

    def read_layers_each(self, key: str, indices: Iterable[int], layers: range
                         ) -> Iterator[tuple[int, EncodedChunk | StorageError]]:
        """Layers ``layers`` of several chunks of one context: one read per chunk (its headers were
        parsed when the context was scanned or written), each layer checked by its crc32; yields
        ``(index, chunk or error)`` in the order asked."""
        fds: dict[str, int] = {}
        try:
            for i in indices:
                try:
                    rec, path = self._locate(key, i)
                    self._check_layers(rec, layers)
                    fd = fds.get(path)
                    if fd is None:
                        fd = fds[path] = self._open(rec, path)
                except ChunkNotFoundError:  # gone since the lookup (compaction) or never there
                    yield i, self._one(key, i, layers)
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
                self.fs.close(fd)

    def prefetch(self, key: str, indices: Iterable[int]) -> int:
        """Ask the kernel to start reading these chunks' records (posix_fadvise WILLNEED) and
        return; missing chunks are skipped. Returns the number of chunks advised."""
        plan = self._plan(key, list(indices))
        fds: dict[str, int] = {}
        try:
            return self._advise(plan, fds)
        finally:
            for fd in fds.values():
                self.fs.close(fd)

    def check(self, key: str, index: int, expected_checksum: str | None = None) -> ChunkMeta:
        """Fully verify one chunk (pack size, header, every payload byte); returns its meta.

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
        """Chunk indices of a context that have a current record."""
        with self._lock:
            c = self._ctx(check_context_key(key))
            return [] if c is None else sorted(c.live)

    def delete(self, key: str, index: int) -> bool:
        """Delete one chunk's record; False if it had none. A chunk whose pack holds other current
        records is deleted by an empty deletion marker that decides it (one fsynced empty file),
        so the record does not come back after a restart."""
        index = _check_index(index)
        with self._write_lock:
            with self._lock:
                c = self._ctx(check_context_key(key))
                if c is None or index not in c.live:
                    return False
                rec = c.live.pop(index)
                rec.pack.live.discard(index)
                if rec.pack in self._removable(c):  # its pack decides nothing else: just remove it
                    self._collect(c)
                    if self.config.fsync:
                        self.fs.fsync_dir(c.dir)
                    return True
            try:
                self._write_pack(c, [index], [])
            except BaseException:
                with self._lock:  # the record still decides the chunk on disk
                    if index not in c.live and rec.pack.name in c.packs:
                        c.live[index] = rec
                        rec.pack.live.add(index)
                raise
            self._maybe_compact(c)
        return True

    def delete_context(self, key: str) -> int:
        """Delete every pack of a context and its folder; returns the chunks that had a record."""
        with self._write_lock, self._lock:
            d = self._context_dir(key)
            if d is None:
                return 0
            c = self._ctx(key)
            removed = len(c.live) if c is not None else 0
            for name in self.fs.listdir(d):
                if _PACK_RE.match(name) or _LEGACY_RE.match(name) or _TMP_RE.match(name):
                    p = os.path.join(d, name)
                    try:
                        st = self.fs.lstat(p)
                        self.fs.unlink(p)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode) and not _TMP_RE.match(name):
                        self._usage -= st.st_size
            self._ctxs.pop(key, None)
            try:
                self.fs.rmdir(d)
            except OSError:
                pass  # a foreign file is in the folder: leave it (and the folder) alone
            self.fs.fsync_dir(self.root)
            return removed

    def delete_names(self, names: Iterable[str]) -> int:
        """Delete chunks by the names :meth:`file_name` gives (what the registry stores)."""
        removed = 0
        for name in names:
            key, _, base = name.partition("/")
            m = _CHUNK_NAME_RE.match(base)
            if m is None:
                raise InvalidKeyError(f"not a chunk name: {name[:80]!r}")
            removed += self.delete(key, int(m.group(1)))
        return removed
