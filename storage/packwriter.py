"""Writing chunk records into new pack files, crash-safely, and deleting chunks and contexts.

This module deliberately knows nothing about reading payloads back or about which chunks should
exist: it makes the bytes it is given durable. One write, delete or compaction runs at a time
(``PackWriter.lock``).

Packs are immutable: a pack is written once under a temporary name in its context folder, fsynced,
renamed to its final name, and the folder fsynced; the rename is the one step that makes its
records current (:mod:`storage.packindex`). A write of chunks that are not contiguous becomes one
pack per contiguous run, cut at ``pack_bytes``; a chunk whose pack holds other current records is
deleted by an empty deletion marker that decides it. After each write or delete the packs that no
longer decide anything are removed and the context may be compacted (:mod:`storage.compaction`).

Capacity: a write that would leave usage above ``disk_cap_bytes`` (counting the packs it makes
removable) raises DiskCapExceededError before anything is written; the bytes of a temporary count
from before it is created until the rename settles them or a failure takes them back. A write or
deletion marker that meets a full file system (ENOSPC, EDQUOT) raises DiskFullError: its temporary
is removed and the records current before it stay current. Deleting a context writes nothing, so it
works on a full file system (it is how space comes back); compaction, which writes before it frees,
is skipped there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import threading
from collections.abc import Iterator, Sequence

from storage import chunkformat as fmt
from storage import compaction
from storage.codecs import EncodedChunk
from storage.errors import CorruptChunkError, DiskCapExceededError, DiskFullError
from storage.fileops import CREATE_FLAGS, NO_SPACE
from storage.packindex import (LEGACY_RE, MAX_GEN, PACK_RE, TMP_RE, ChunkMeta, ContextPacks, Pack,
                               PackIndex, Record, aligned, check_context_key, check_index, file_name,
                               layout, pack_name)


def _runs(indices: list[int]) -> list[list[int]]:
    """Sorted distinct indices cut into runs of consecutive values."""
    out: list[list[int]] = []
    for i in indices:
        if out and i == out[-1][-1] + 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


@contextlib.contextmanager
def _disk_full(what: str) -> Iterator[None]:
    """Raise DiskFullError for an OSError that says the file system has no room (NO_SPACE)."""
    try:
        yield
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        raise DiskFullError(f"the chunk store's file system is full ({os.strerror(e.errno)}) while "
                            f"{what}; free space (delete contexts) and retry") from e


class PackWriter:
    """Writes and deletes under the root of ``index``; ``fingerprint`` goes into every record."""

    def __init__(self, index: PackIndex, fingerprint: str):
        self.index = index
        self.fingerprint = fingerprint  # model identity written into every record
        self.lock = threading.Lock()  # one write, delete or compaction at a time
        self.compactions = 0  # contexts compacted by this writer

    def write_many(self, key: str, items: Sequence[tuple[int, EncodedChunk, int]], tag: str | None = None
                   ) -> list[ChunkMeta]:
        """Write chunks ``(index, encoded, token_start)`` of one context, each record carrying ``tag``
        (default: the writer's fingerprint; readers refuse another): one pack per run of
        consecutive indices (cut at ``pack_bytes``), each crash-safe. Returns a meta per item, in
        order. Each pack replaces the current records of its chunks atomically; a failure leaves the
        packs written before it in place."""
        check_context_key(key)
        by_index: dict[int, tuple[EncodedChunk, int]] = {}
        for index, enc, token_start in items:
            index = check_index(index)
            if enc.first_layer != 0:
                raise ValueError("write needs every layer of the chunk (first_layer == 0)")
            if index in by_index:
                raise ValueError(f"chunk {index} given twice")
            by_index[index] = (enc, int(token_start))
        metas: dict[int, ChunkMeta] = {}
        pack_bytes = self.index.config.pack_bytes
        with self.lock, _disk_full(f"writing chunks of context {key}"):
            with self.index.lock:
                c = self.index.context(key, create=True)
            for run in _runs(sorted(by_index)):
                built = [self._build(key, i, *by_index[i], tag or self.fingerprint) for i in run]
                start, size = 0, 0
                for k, (head, parts, _, _) in enumerate(built):  # a new pack past pack_bytes
                    n = aligned(len(head) + sum(len(x) for x in parts))
                    if k > start and size + n > pack_bytes:
                        metas.update(self._write_pack(c, run[start:k], built[start:k]))
                        start, size = k, 0
                    size += n
                metas.update(self._write_pack(c, run[start:], built[start:]))
            self._maybe_compact(c)
        return [metas[check_index(i)] for i, _, _ in items]

    def delete(self, key: str, index: int) -> bool:
        """Delete one chunk's record; False if it had none. A chunk whose pack holds other current
        records is deleted by an empty deletion marker that decides it (one fsynced empty file),
        so the record does not come back after a restart."""
        index = check_index(index)
        with self.lock, _disk_full(f"deleting chunk {index} of context {key}"):
            with self.index.lock:
                c = self.index.context(check_context_key(key))
                if c is None or index not in c.live:
                    return False
                rec = c.live.pop(index)
                rec.pack.live.discard(index)
                if rec.pack in self.index.removable(c):  # its pack decides nothing else: remove it
                    self.index.collect(c)
                    if self.index.config.fsync:
                        self.index.fs.fsync_dir(c.dir)
                    return True
            try:
                self._write_pack(c, [index], [])
            except BaseException:
                with self.index.lock:  # the record still decides the chunk on disk
                    if index not in c.live and rec.pack.name in c.packs:
                        c.live[index] = rec
                        rec.pack.live.add(index)
                raise
            self._maybe_compact(c)
        return True

    def delete_context(self, key: str) -> int:
        """Delete every pack of a context and its folder; returns the chunks that had a record."""
        index, fs = self.index, self.index.fs
        with self.lock, index.lock:
            d = index.context_dir(key)
            if d is None:
                return 0
            c = index.context(key)
            removed = len(c.live) if c is not None else 0
            for name in fs.listdir(d):
                if PACK_RE.match(name) or LEGACY_RE.match(name) or TMP_RE.match(name):
                    p = os.path.join(d, name)
                    try:
                        st = fs.lstat(p)
                        fs.unlink(p)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode) and not TMP_RE.match(name):
                        index.usage -= st.st_size
            index.forget(key)
            try:
                fs.rmdir(d)
            except OSError:
                pass  # a foreign file is in the folder: leave it (and the folder) alone
            fs.fsync_dir(index.root)
            return removed

    # -- one pack ------------------------------------------------------------------------------------

    def _build(self, key: str, index: int, enc: EncodedChunk, token_start: int, tag: str
               ) -> tuple[bytes, list, fmt.ChunkHeader, int]:
        """(prefix + header + padding, payload parts, header, header crc) of one record."""
        parts, lens, sums, psum = fmt.store_records(enc, self.index.config.lz4_level)
        header = fmt.ChunkHeader(
            tag, key, index, token_start, token_start + enc.shape[3], enc.level,
            enc.version, enc.dtype, enc.params, tuple(enc.shape), enc.record_nbytes, tuple(lens),
            tuple(sums), psum)
        head, crc = fmt.pack(header)
        return head, parts, header, crc

    def _write_pack(self, c: ContextPacks, indices: list[int], built: list) -> dict[int, ChunkMeta]:
        """Write one pack of consecutive chunks (or, with no records, a deletion marker for
        ``indices``) and make it current. Hold ``self.lock``."""
        buffers, offsets, nbytes = layout([[head, *parts] for head, parts, _, _ in built])
        recs = [(i, o, len(head) + sum(len(x) for x in parts), len(head), head, header, crc)
                for i, o, (head, parts, header, crc) in zip(indices, offsets, built)]
        gen = self.reserve(c, nbytes, replaces=indices)
        name = pack_name(gen, indices[0], indices[-1], marker=not built)
        self.commit_file(c, gen, name, buffers, nbytes)
        p = Pack(name, gen, indices[0], indices[-1], nbytes)
        for i, off, n, base, head, header, crc in recs:
            p.records[i] = Record(p, i, off, n, base, head, header, f"{crc:08x}")
        self.index.install(c, p)
        return {i: ChunkMeta(file_name(c.key, i), n, f"{crc:08x}", header)
                for i, off, n, base, head, header, crc in recs}

    def reserve(self, c: ContextPacks, nbytes: int, replaces: list[int] | None = None) -> int:
        """Take the context's next generation and count ``nbytes`` (a pack about to be written) in
        the usage. With ``replaces``, the consecutive chunks the pack will decide, refuse first when
        the usage would end above the disk cap (DiskCapExceededError)."""
        index = self.index
        with index.lock:
            gen = c.next_gen
            if gen > MAX_GEN:
                raise CorruptChunkError(f"context {c.key} has run out of pack generations")
            c.next_gen += 1
            cap = index.config.disk_cap_bytes
            if replaces is not None and cap:
                after = index.usage - self._freed_by(c, replaces) + nbytes
                if after > cap:
                    raise DiskCapExceededError(
                        f"writing {nbytes} B would take the store to {after} B, over its cap of "
                        f"{cap} B")
            index.usage += nbytes  # reserved for the temporary until the rename settles it
        return gen

    def commit_file(self, c: ContextPacks, gen: int, name: str, buffers: list, nbytes: int) -> None:
        """Write ``buffers`` as pack ``name`` crash-safely: a temporary in the folder, fsync, rename,
        fsync of the folder. ``nbytes`` were already added to the usage; taken back on failure."""
        fs, fsync = self.index.fs, self.index.config.fsync
        tmp = os.path.join(c.dir, f".{gen:012d}.{secrets.token_hex(4)}.tmp")
        renamed = False
        try:
            fd = fs.open(tmp, CREATE_FLAGS, 0o600)
            try:
                if buffers:
                    fs.write(fd, buffers)
                if fsync:
                    fs.fsync(fd)
            finally:
                fs.close(fd)
            fs.rename(tmp, os.path.join(c.dir, name))
            renamed = True
            if fsync:
                fs.fsync_dir(c.dir)
        finally:
            if not renamed:
                with self.index.lock:
                    self.index.usage -= nbytes
                try:
                    fs.unlink(tmp)
                except FileNotFoundError:
                    pass

    @staticmethod
    def _freed_by(c: ContextPacks, indices: list[int]) -> int:
        """Bytes of the packs whose every current record a pack over ``indices`` replaces (what it
        makes removable, for the cap check). Hold the index lock."""
        lo, hi = indices[0], indices[-1]
        return sum(p.nbytes for p in c.packs.values()
                   if p.live and p.damage is None and all(lo <= i <= hi for i in p.live))

    def _maybe_compact(self, c: ContextPacks) -> None:
        """Compact ``c`` if it needs it. On a full file system compaction waits for a later write
        (what it wrote so far is current and consistent); the write or delete before it stands."""
        try:
            compacted = compaction.maybe_compact(self, c)
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            return
        if compacted:
            self.compactions += 1
