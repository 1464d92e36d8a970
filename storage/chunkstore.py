"""ChunkStore: crash-safe, checksummed KV chunk records in per-context pack files under a confined root.

This module deliberately knows nothing about which chunks should exist, their state or level
policy (that is the registry and the governor), nor about the model: it stores and returns bytes.

The one object callers use; the work is done by its parts:

- :mod:`storage.packindex`: file names, the pack layout, and which record of each chunk is current
  (generations, deletion markers, damaged packs), built by scanning a context's folder on first use
- :mod:`storage.packwriter`: new packs written crash-safely (temporary, fsync, rename, folder fsync),
  deletes, the disk cap
- :mod:`storage.compaction`: current records copied verbatim into fresh packs when a context's
  records are spread over too many packs or mostly superseded
- :mod:`storage.packreader`: the two checked reads, whole chunks and some layers of chunks

Why packs and not one file per chunk: reading a context back costs a fixed amount per file (open,
read, close, header checks), so a file per chunk keeps reads well below the disk's sequential rate.
A write-back writes a call's modified chunks as one pack, so a prefill's chunks come back with a few
large reads (docs/benchmarks.md, "Chunk packs").

Paths: a context key must match ``^[0-9a-f]{8,64}$`` and a chunk index is an int, so a client string
never becomes a path; file names are built from numbers; the root is resolved once (realpath).

Capacity: ``usage_bytes()`` is the bytes of all pack files (including superseded records not yet
compacted away) and temporaries being written; writes past ``disk_cap_bytes`` are refused before
anything is written. Reads can be throttled (token bucket, injectable clock and sleep). One
ChunkStore writes a root at a time (the KV swap/IO worker).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from storage import chunkformat as fmt
from storage.codecs import EncodedChunk
from storage.errors import InvalidKeyError, StorageError
from storage.fileops import FileOps
from storage.packindex import (CHUNK_NAME_RE, ChunkMeta, PackIndex, check_context_key, check_index,
                               file_name)
from storage.packreader import PackReader
from storage.packwriter import PackWriter
from storage.throttle import TokenBucket


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
    # a layer is kept compressed only when that saves an eighth of it (rare for real K/V)
    fsync: bool = True  # fsync file and folder on every write (False only for page-cache benchmarks)


class ChunkStore:
    """Chunk records of many contexts under ``root`` (created if missing). Thread-safe."""

    def __init__(self, root: str | os.PathLike, config: ChunkStoreConfig | None = None, *,
                 fingerprint: str, fs: FileOps | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.config = config or ChunkStoreConfig()
        self.fingerprint = fingerprint  # model identity written into and required of every record
        Path(root).mkdir(parents=True, exist_ok=True)
        self.root = os.path.realpath(root)  # every path used lies below this
        bucket = (TokenBucket(self.config.read_bytes_per_s, self.config.read_burst_bytes, clock, sleep)
                  if self.config.read_bytes_per_s > 0 else None)
        self._index = PackIndex(self.root, self.config, fs or FileOps(), bucket)
        self._writer = PackWriter(self._index, fingerprint)
        self._reader = PackReader(self._index, fingerprint)
        self.removed_temporaries = self._index.scan_root()  # stale temp files deleted at open

    @property
    def compactions(self) -> int:
        """Contexts compacted by this store."""
        return self._writer.compactions

    # -- names and listing ---------------------------------------------------------------------------

    @staticmethod
    def file_name(key: str, index: int) -> str:
        """The chunk's name relative to the root, what the registry stores: ``<key>/<index:08d>.kvc``.

        It names the chunk, not a file (see :func:`storage.packindex.file_name`); :meth:`path`
        gives the pack file."""
        return file_name(key, index)

    def path(self, key: str, index: int) -> str:
        """Absolute path of the pack file holding the chunk's current record (ChunkNotFoundError)."""
        with self._index.lock:
            c = self._index.context(key)
            rec = self._index.lookup(c, check_index(index), key)
            return os.path.join(c.dir, rec.pack.name)

    def files(self, key: str) -> list[str]:
        """Absolute paths of the context's pack files (empty if it has none)."""
        with self._index.lock:
            c = self._index.context(key)
            return [] if c is None else [os.path.join(c.dir, n) for n in sorted(c.packs)]

    def usage_bytes(self) -> int:
        """Bytes of pack files under the root (plus temporaries being written)."""
        return self._index.usage

    def contexts(self) -> list[str]:
        """Context keys that have a folder under the root."""
        return sorted(k for k in self._index.fs.listdir(self.root) if fmt.CONTEXT_KEY_RE.match(k))

    def indices(self, key: str) -> list[int]:
        """Chunk indices of a context that have a current record."""
        with self._index.lock:
            c = self._index.context(check_context_key(key))
            return [] if c is None else sorted(c.live)

    # -- writing and deleting ------------------------------------------------------------------------

    def write(self, key: str, index: int, enc: EncodedChunk, token_start: int) -> ChunkMeta:
        """Write one chunk (all layers of ``enc``) crash-safely, as a pack of its own.

        ``token_start`` is the position of the chunk's first token; the record says
        ``[token_start, token_start + T)``. Replaces the chunk's current record atomically.
        """
        return self.write_many(key, [(index, enc, token_start)])[0]

    def write_many(self, key: str, items: Sequence[tuple[int, EncodedChunk, int]], *, tag: str | None = None
                   ) -> list[ChunkMeta]:
        """Write chunks ``(index, encoded, token_start)`` of one context: one pack per run of
        consecutive indices, each crash-safe; a meta per item, in order (see
        :meth:`storage.packwriter.PackWriter.write_many`). Each record carries ``tag`` (what it was
        computed under, `actors.messages.KVKey.record_tag`; default the store's fingerprint), and
        every read must name the same."""
        return self._writer.write_many(key, items, tag)

    def delete(self, key: str, index: int) -> bool:
        """Delete one chunk's record so that it stays deleted after a restart; False if it had none."""
        return self._writer.delete(key, index)

    def delete_context(self, key: str) -> int:
        """Delete every pack of a context and its folder; returns the chunks that had a record."""
        return self._writer.delete_context(key)

    def delete_names(self, names: Iterable[str]) -> int:
        """Delete chunks by the names :meth:`file_name` gives (what the registry stores)."""
        removed = 0
        for name in names:
            key, _, base = name.partition("/")
            m = CHUNK_NAME_RE.match(base)
            if m is None:
                raise InvalidKeyError(f"not a chunk name: {name[:80]!r}")
            removed += self.delete(key, int(m.group(1)))
        return removed

    # -- reading -------------------------------------------------------------------------------------

    def read(self, key: str, indices: Iterable[int], *, executor: Executor | None = None,
             tag: str | None = None) -> Iterator[tuple[int, EncodedChunk | StorageError]]:
        """Whole chunks of one context, checked, in the order asked: yields ``(index, chunk or the
        StorageError that chunk raised)``. With ``executor`` runs are read and checked on it. A
        record whose tag is not ``tag`` (default the store's fingerprint) is FingerprintMismatchError."""
        return self._reader.read(key, indices, executor=executor, tag=tag)

    def read_layers(self, key: str, indices: Iterable[int], layers: range, *, tag: str | None = None
                    ) -> Iterator[tuple[int, EncodedChunk | StorageError]]:
        """Layers ``layers`` (a non-empty step-1 range) of chunks of one context, each layer checked,
        in the order asked: yields ``(index, those layers or the chunk's StorageError)``."""
        return self._reader.read_layers(key, indices, layers, tag)

    def prefetch(self, key: str, indices: Iterable[int], *, tag: str | None = None) -> int:
        """Ask the kernel to start reading these chunks' records and return at once; missing chunks
        (and records under another tag) are skipped. Returns the number of chunks advised."""
        return self._reader.prefetch(key, indices, tag)

    def check(self, key: str, index: int, expected_checksum: str | None = None, *,
              deep: bool = True, tag: str | None = None) -> ChunkMeta:
        """Verify one chunk (pack size and header bytes; with ``deep`` every payload byte) and return
        its meta; raises its StorageError, CorruptChunkError when ``expected_checksum`` differs."""
        return self._reader.check(key, index, expected_checksum, deep=deep, tag=tag)
