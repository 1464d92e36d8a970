"""The pack files of a chunk store's root and which record of each chunk is current.

This module deliberately knows nothing about writing records, checking payloads or when to compact:
it names files, parses their headers and answers which record decides a chunk.

Layout: ``<root>/<context key>/<generation:012d>.<lo:08d>-<hi:08d>.kvp``. A pack holds the records of
chunks ``lo..hi`` of one context (format of a record in :mod:`storage.chunkformat`), back to back,
each starting at a multiple of 64 bytes; a pack of one chunk is byte for byte a format-2 chunk file
(``<index:08d>.kvc``, still read as a pack of generation -1).

Generations decide which record of a chunk is current. Each pack has a generation, one above the
highest in its context folder, and the name's range ``lo..hi`` is its authority: for every chunk in
it, the newest pack whose range covers the chunk decides, by holding its record or, if it holds
none, by saying the chunk has no record (an empty ``.kvd`` file of the same naming is a deletion
marker). So a rename is the one step that makes a new version current, for every chunk of the pack
at once; there is no index file to keep in step. A pack that no longer decides anything is removed
(:meth:`PackIndex.collect`), in rounds with the folder fsynced between them, so an older record
never comes back after a crash.

Damage: a pack whose records cannot all be parsed (torn by something other than our writes, flipped
bits in a header, truncated, wrong version, a record of another context or outside the name's range)
is kept on disk and contributes no records; every chunk in its range whose newest readable record is
older than it raises the pack's error (CorruptChunkError, ChunkVersionError, PathConfinementError)
until a newer write replaces the chunk.

State: :class:`PackIndex` keeps, per context it has touched, which record of which pack is current
and the record headers as parsed (so partial reads need no header read), built by scanning the
context's folder on first use. Folders are checked with lstat to be plain folders (a symlink is
refused, never followed) and files are opened with O_NOFOLLOW.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from storage import chunkformat as fmt
from storage.errors import (ChunkNotFoundError, CorruptChunkError, InvalidKeyError,
                            PathConfinementError, StorageError)
from storage.fileops import READ_FLAGS, FileOps
from storage.throttle import TokenBucket

if TYPE_CHECKING:
    from storage.chunkstore import ChunkStoreConfig

PACK_RE = re.compile(r"^(\d{12})\.(\d{8})-(\d{8})\.(kvp|kvd)$")  # .kvd: an empty deletion marker
LEGACY_RE = re.compile(r"^(\d{8})\.kvc$")  # format-2 stores: one chunk per file, read as packs
TMP_RE = re.compile(r"^\.\d{8,12}\.[0-9a-f]{8}\.tmp$")
CHUNK_NAME_RE = re.compile(r"^(\d{8})\.kvc$")  # the registry's name of a chunk (see file_name)
MAX_INDEX = 10**8 - 1
MAX_GEN = 10**12 - 1
ALIGN = fmt.PAYLOAD_ALIGN


def check_context_key(key: str) -> str:
    """Return ``key`` if it is a valid context key (lowercase hex, 8-64 chars)."""
    if not isinstance(key, str) or not fmt.CONTEXT_KEY_RE.match(key):
        raise InvalidKeyError("context key must match ^[0-9a-f]{8,64}$")
    return key


def check_index(index: int) -> int:
    """Return ``index`` as an int if it is a valid chunk index (an int in [0, MAX_INDEX])."""
    is_int = type(index) is int or isinstance(index, np.integer)  # not bool, float or str
    if not is_int or not 0 <= index <= MAX_INDEX:
        raise InvalidKeyError(f"chunk index must be an int in [0, {MAX_INDEX}]")
    return int(index)


def file_name(key: str, index: int) -> str:
    """The chunk's name relative to the root, what the registry stores: ``<key>/<index:08d>.kvc``.

    It names the chunk, not a file: the chunk's record lives in one of the context's packs, which
    compaction may change."""
    return f"{check_context_key(key)}/{check_index(index):08d}.kvc"


def pack_name(gen: int, lo: int, hi: int, marker: bool = False) -> str:
    """File name of the pack of generation ``gen`` deciding chunks ``lo..hi`` (a deletion marker's
    with ``marker``)."""
    return f"{gen:012d}.{lo:08d}-{hi:08d}.{'kvd' if marker else 'kvp'}"


def aligned(n: int) -> int:
    """``n`` rounded up to the record alignment (64 bytes)."""
    return -(-n // ALIGN) * ALIGN


def layout(records: list[list]) -> tuple[list, list[int], int]:
    """Pack layout of records given as lists of byte buffers: (buffers to write, with zero padding
    so every record starts at a multiple of 64, each record's offset, total bytes)."""
    buffers, offsets, o = [], [], 0
    for parts in records:
        if o % ALIGN:
            buffers.append(bytes(ALIGN - o % ALIGN))
            o = aligned(o)
        offsets.append(o)
        buffers += parts
        o += sum(len(x) for x in parts)
    return buffers, offsets, o


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What the store knows about one chunk's record after writing or reading its header."""

    name: str  # the chunk's name relative to the root, "<context>/<index:08d>.kvc" (see file_name)
    nbytes: int  # bytes of the record on disk
    checksum: str  # crc32 of the header as 8 hex digits: identifies this exact record content
    header: fmt.ChunkHeader  # the parsed header


@dataclass(eq=False, slots=True)
class Pack:
    """One pack file of a context folder, as scanned or written."""

    name: str  # file name in the context folder
    gen: int  # generation; -1 for a format-2 chunk file
    lo: int  # first chunk this pack decides
    hi: int  # last chunk this pack decides (inclusive)
    nbytes: int  # file size (bytes)
    records: dict[int, Record] = field(default_factory=dict)  # every record it holds, current or not
    live: set[int] = field(default_factory=set)  # chunks whose current record is here
    damage: StorageError | None = None  # why its records could not be read (it then has none)

    def covers(self, i: int) -> bool:
        return self.lo <= i <= self.hi


@dataclass(eq=False, slots=True)
class Record:
    """One chunk record inside a pack, its header parsed."""

    pack: Pack  # the pack holding it
    index: int  # chunk index
    offset: int  # of the record in the pack file (bytes)
    nbytes: int  # of the record, header and payload (bytes)
    base: int  # payload start within the record (bytes)
    head: bytes  # the record's bytes before the payload, as parsed
    header: fmt.ChunkHeader  # the parsed header
    checksum: str  # header crc32, 8 hex digits


@dataclass(eq=False, slots=True)
class ContextPacks:
    """The packs of one context folder and which record of each chunk is current."""

    key: str  # context key
    dir: str  # absolute path of its folder
    packs: dict[str, Pack] = field(default_factory=dict)  # by file name
    live: dict[int, Record] = field(default_factory=dict)  # chunk index -> current record
    damaged: list[Pack] = field(default_factory=list)  # packs whose records could not be read
    next_gen: int = 0  # generation of the next pack written


class PackIndex:
    """Which pack record is current for every chunk of the contexts touched under one root, and the
    bytes of pack files under it. Callers hold ``lock`` around every method that says so."""

    def __init__(self, root: str, config: ChunkStoreConfig, fs: FileOps, bucket: TokenBucket | None):
        self.root = root  # a real path: every path used lies below it
        self.config = config
        self.fs = fs
        self.bucket = bucket  # the read throttle every read under the root goes through (None: off)
        self.lock = threading.RLock()  # guards contexts, usage and folder creation
        self.usage = 0  # bytes of pack files and in-flight temporaries
        self.contexts: dict[str, ContextPacks] = {}

    # -- throttled reads -----------------------------------------------------------------------------

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        """``n`` bytes at ``offset`` (shorter at EOF), after the throttle allows them."""
        if self.bucket is not None:
            self.bucket.acquire(n)
        return self.fs.pread(fd, n, offset)

    def pread_array(self, fd: int, n: int, offset: int) -> np.ndarray:
        """``n`` bytes at ``offset`` read into a fresh writable uint8 array (shorter at EOF)."""
        if self.bucket is not None:
            self.bucket.acquire(n)
        buf = np.empty(n, np.uint8)
        return buf[:self.fs.pread_into(fd, buf, offset)]

    # -- folders -------------------------------------------------------------------------------------

    def scan_root(self) -> list[str]:
        """Remove stale temporaries, total the usage; returns the temporaries removed, as
        ``<key>/<name>``. Foreign entries are left alone and uncounted."""
        removed = []
        for key in sorted(self.fs.listdir(self.root)):
            if not fmt.CONTEXT_KEY_RE.match(key):
                continue
            try:
                d = self.context_dir(key)
            except PathConfinementError:
                continue  # never descend into a symlinked folder
            dirty = False
            for name in self.fs.listdir(d):
                p = os.path.join(d, name)
                st = self.fs.lstat(p)
                if not stat.S_ISREG(st.st_mode):
                    continue
                if TMP_RE.match(name):
                    self.fs.unlink(p)
                    removed.append(f"{key}/{name}")
                    dirty = True
                elif PACK_RE.match(name) or LEGACY_RE.match(name):
                    self.usage += st.st_size
            if dirty:
                self.fs.fsync_dir(d)
        return removed

    def context_dir(self, key: str, create: bool = False) -> str | None:
        """The context's folder, checked to be a real folder under the root (None if absent)."""
        d = os.path.join(self.root, check_context_key(key))
        try:
            st = self.fs.lstat(d)
        except FileNotFoundError:
            if not create:
                return None
            with self.lock:
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

    def context(self, key: str, create: bool = False) -> ContextPacks | None:
        """The context's state, scanning its folder on first use (None: no folder). Hold lock."""
        c = self.contexts.get(key)
        if c is not None:
            return c
        d = self.context_dir(key, create=create)
        if d is None:
            return None
        c = self.contexts[key] = ContextPacks(key, d)
        for name in self.fs.listdir(d):
            m = PACK_RE.match(name)
            legacy = LEGACY_RE.match(name)
            if m:
                gen, lo, hi = int(m.group(1)), int(m.group(2)), int(m.group(3))
            elif legacy:
                gen, lo, hi = -1, int(legacy.group(1)), int(legacy.group(1))
            else:
                continue
            p = Pack(name, gen, lo, hi, 0)
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
            self.settle(c, p)
        self.collect(c)
        return c

    def forget(self, key: str) -> None:
        """Drop the context's state (its folder was removed). Hold lock."""
        self.contexts.pop(key, None)

    # -- parsing -------------------------------------------------------------------------------------

    def _scan_pack(self, c: ContextPacks, p: Pack) -> None:
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
                o = aligned(end)
                if o >= size:
                    raise CorruptChunkError(f"pack {p.name} has {size - end} B after its last record")
        finally:
            self.fs.close(fd)

    def _parse_record(self, fd: int, key: str, p: Pack, offset: int, size: int) -> Record:
        """Read and check the header of the record at ``offset`` of an open pack of ``size`` bytes."""
        left = size - offset
        head = self.pread(fd, min(left, fmt.PREFIX_NBYTES + 4096), offset)
        m = memoryview(head)
        hlen, crc = fmt.parse_prefix(m, left, self.config.max_header_bytes)
        end = fmt.PREFIX_NBYTES + hlen
        base = fmt.payload_start(hlen)
        if len(m) < base:
            m = memoryview(bytes(m) + self.pread(fd, base - len(m), offset + len(m)))
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
        return Record(p, h.index, offset, n, base, bytes(m[:base]), h, f"{crc:08x}")

    # -- which record decides ------------------------------------------------------------------------

    def settle(self, c: ContextPacks, p: Pack) -> None:
        """Make pack ``p`` (newer than every pack settled before it) decide its range. Hold lock."""
        for i in range(p.lo, p.hi + 1):
            old = c.live.get(i)
            if old is not None and old.pack.gen <= p.gen and old.pack is not p:
                old.pack.live.discard(i)
                del c.live[i]
            if p.damage is None and i in p.records and i not in c.live:
                c.live[i] = p.records[i]
                p.live.add(i)

    def lookup(self, c: ContextPacks | None, i: int, key: str) -> Record:
        """The current record of chunk ``i``; raises the damage of a newer damaged pack covering it,
        or ChunkNotFoundError. Hold lock."""
        rec = None if c is None else c.live.get(i)
        if c is not None and c.damaged:
            gen = -2 if rec is None else rec.pack.gen
            for p in c.damaged:
                if p.covers(i) and p.gen >= gen:
                    raise type(p.damage)(f"chunk {i} of {key}: pack {p.name} is damaged: {p.damage}")
        if rec is None:
            raise ChunkNotFoundError(f"no chunk {i} of context {key}")
        return rec

    @staticmethod
    def readable(c: ContextPacks, r: Record) -> bool:
        """Whether no damaged pack newer than ``r``'s covers it (a tainted chunk is not moved)."""
        return not any(p.covers(r.index) and p.gen >= r.pack.gen for p in c.damaged)

    def removable(self, c: ContextPacks) -> list[Pack]:
        """Packs with no current record whose removal changes no chunk's answer. Hold lock."""
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

    def collect(self, c: ContextPacks) -> int:
        """Unlink removable packs, in rounds with a folder fsync between. Hold lock."""
        removed = 0
        while True:
            gone = self.removable(c)
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
                    self.usage -= p.nbytes
                del c.packs[p.name]
                removed += 1

    def install(self, c: ContextPacks, p: Pack) -> None:
        """Make a pack just renamed into place current and remove what it made removable."""
        with self.lock:
            c.packs[p.name] = p
            self.settle(c, p)
            self.collect(c)

    def vanished(self, rec: Record) -> None:
        """The pack of a current record was removed behind our back: forget it and its records."""
        p = rec.pack
        with self.lock:
            c = self.contexts.get(rec.header.context)
            if c is None or c.packs.get(p.name) is not p:
                return  # already replaced (compaction) or forgotten
            del c.packs[p.name]
            for i in p.live:
                c.live.pop(i, None)
            p.live.clear()
            self.usage -= p.nbytes
