"""The KV swap/IO worker: reads and writes chunk records (pack files) (docs/design.md §4 step 3, §9).

A plain class around `storage.ChunkStore`; `actors.service` makes it a Ray actor that requests no CPU.
Reads for a restore come out per layer group (`read_groups`) or as batches of whole chunks
(`read_batches`); both are generators, under Ray streaming generators, so a consumer gets group or
batch `k` while `k+1` is still being read. Writes take resident handles; `resolve` turns a list of
handles into their `EncodedChunk`s (identity in one process, `ray_stubs.resolve_chunks` under Ray).

It knows nothing about policies or the model: it moves bytes and reports timings.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import shared_memory
from typing import Any, Callable, Iterator

import numpy as np

from actors.messages import KVKey
from storage.chunkstore import ChunkStore, ChunkStoreConfig
from storage.codecs import EncodedChunk
from storage.errors import StorageError


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """One yield of `read_groups`: some layers of every chunk being loaded."""

    index: int
    """Group number, from 0."""
    layers: range
    """Layers carried."""
    chunks: dict[int, EncodedChunk]
    """Chunk index -> those layers of the chunk."""
    failed: dict[int, str]
    """Chunk index -> error code, for chunks whose file could not be read (recompute them)."""
    read_start: float
    read_end: float
    """time.monotonic() around the reads of this group, seconds."""
    nbytes: int
    """Payload bytes carried."""


@dataclass(frozen=True, slots=True)
class ChunkBatch:
    """One yield of `read_batches`: some whole chunks."""

    index: int
    """Batch number, from 0."""
    chunks: list[tuple[int, EncodedChunk]]
    """(chunk index, chunk), in the order asked."""
    failed: dict[int, str]
    """Chunk index -> error code, for the chunks found unreadable so far (recompute them)."""
    read_start: float
    read_end: float
    """time.monotonic() around the reads of this batch, seconds."""


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Map an existing POSIX shared-memory segment that another process created and owns.

    Python < 3.13 registers an attached segment with this process's resource tracker too, which
    unlinks it when this process dies: a killed worker would take the live owner's segment with it,
    and its restarted self could not attach (FileNotFoundError). So the registration is undone."""
    from multiprocessing import resource_tracker

    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def _sort(results, got: dict[int, EncodedChunk], failed: dict[int, str]) -> None:
    """Put the store's (index, chunk or StorageError) results into `got` and `failed` (error codes)."""
    for i, enc in results:
        if isinstance(enc, StorageError):
            failed[i] = enc.code
        else:
            got[i] = enc


def layer_groups(n_layers: int, group_layers: int) -> list[range]:
    return [range(a, min(n_layers, a + group_layers)) for a in range(0, n_layers, group_layers)]


class KVSwapIO:
    def __init__(
        self,
        root: str,
        key: KVKey | str,
        config: ChunkStoreConfig | None = None,
        *,
        resolve: Callable[[list[Any]], list[EncodedChunk]] = list,
    ) -> None:
        self.key = key if isinstance(key, KVKey) else KVKey(key)
        """The model part of the K/V key (a bare string: a fingerprint); each read and write names the
        context's adapter, and its records carry the whole tag (`KVKey.record_tag`)."""
        self.store = ChunkStore(root, config, fingerprint=self.key.record_tag())
        self.resolve = resolve
        self.bytes_written = 0
        self.bytes_read = 0
        self.observe: Callable[[str, int, float], None] = lambda direction, nbytes, seconds: None
        """Called after each write (`out`) and read (`in`) with the bytes and seconds (metrics)."""
        self._writer: ThreadPoolExecutor | None = None
        """The thread of `write_async` (made on first use), beside the caller's reads."""

    def tag(self, adapter: str = "") -> str:
        """What the records of a context computed under `adapter` ("" for none) carry."""
        return replace(self.key, adapter=adapter).record_tag()

    def write_async(self, ctx: str, todo: list[tuple[int, Any, int]], adapter: str = "") -> Future:
        """`write` on a thread of its own, in the order started: the future of its result. Reads go
        on meanwhile (the chunk store serialises what must be)."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="chunk-writer")
        return self._writer.submit(self.write, ctx, todo, adapter)

    def write(self, ctx: str, todo: list[tuple[int, Any, int]], adapter: str = "") -> list[dict]:
        """Write chunks (index, handle, first token) crash-safely, one pack per run of consecutive
        indices (`ChunkStore.write_many`); returns name/nbytes/checksum each, in order."""
        t0 = time.monotonic()
        encs = self.resolve([h for _i, h, _t in todo])
        metas = self.store.write_many(ctx, [(i, enc, t) for (i, _h, t), enc in zip(todo, encs)],
                                      tag=self.tag(adapter))
        out = [{"name": m.name, "nbytes": m.nbytes, "checksum": m.checksum} for m in metas]
        nbytes = sum(o["nbytes"] for o in out)
        self.bytes_written += nbytes
        self.observe("out", nbytes, time.monotonic() - t0)
        return out

    def read(self, ctx: str, indices: list[int], adapter: str = "") -> tuple[dict[int, EncodedChunk], dict[int, str]]:
        """Read whole chunks; returns (chunks read, {index: error code} for unreadable ones, records
        computed under another adapter among them)."""
        chunks, failed = self.read_stream(ctx, indices, adapter)
        return dict(chunks), failed

    def read_stream(self, ctx: str, indices: list[int], adapter: str = ""
                    ) -> tuple[Iterator[tuple[int, EncodedChunk]], dict[int, str]]:
        """Read whole chunks, yielding each (index, chunk) as soon as it is read and checked; the
        second value fills with {index: error code} of unreadable ones as the iterator runs."""
        failed: dict[int, str] = {}

        def chunks() -> Iterator[tuple[int, EncodedChunk]]:
            t0, nbytes = time.monotonic(), 0
            for i, enc in self.store.read(ctx, indices, tag=self.tag(adapter)):
                if isinstance(enc, StorageError):
                    failed[i] = enc.code
                else:
                    nbytes += enc.nbytes
                    yield i, enc
            self.bytes_read += nbytes
            self.observe("in", nbytes, time.monotonic() - t0)

        return chunks(), failed

    def read_batches(self, ctx: str, indices: list[int], batch: int, adapter: str = "",
                     ahead: int | None = None) -> Iterator[ChunkBatch]:
        """Read whole chunks, yielding them `batch` at a time as soon as they are read and checked
        (under Ray a streaming generator: the consumer decodes batch `k` while `k+1` is read). Here
        a generator reads only as it is consumed; `ahead` is the Ray stub's bound on reading ahead."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        chunks, failed = self.read_stream(ctx, indices, adapter)
        got: list[tuple[int, EncodedChunk]] = []
        k, t0 = 0, time.monotonic()
        for i, enc in chunks:
            got.append((i, enc))
            if len(got) == batch:
                yield ChunkBatch(k, got, dict(failed), t0, time.monotonic())
                got, k, t0 = [], k + 1, time.monotonic()
        if got or failed or k == 0:
            yield ChunkBatch(k, got, dict(failed), t0, time.monotonic())

    def read_groups(self, ctx: str, indices: list[int], groups: list[range], adapter: str = "",
                    ahead: int | None = None) -> Iterator[LayerGroup]:
        """Read the chunks layer group by layer group, yielding each group as soon as it is read
        (`ahead` as for `read_batches`)."""
        failed: dict[int, str] = {}
        tag = self.tag(adapter)
        self.store.prefetch(ctx, indices, tag=tag)
        for g, layers in enumerate(groups):
            t0 = time.monotonic()
            chunks: dict[int, EncodedChunk] = {}
            _sort(self.store.read_layers(ctx, [i for i in indices if i not in failed], layers, tag=tag),
                  chunks, failed)
            nbytes = sum(c.nbytes for c in chunks.values())
            self.bytes_read += nbytes
            self.observe("in", nbytes, time.monotonic() - t0)
            yield LayerGroup(g, layers, chunks, dict(failed), t0, time.monotonic(), nbytes)

    def ping(self, n: int) -> Iterator[int]:
        """`n` tiny items (under Ray, a streaming generator): what handing over one ref costs."""
        for i in range(n):
            yield i

    def ping_payload(self, nbytes: int) -> Iterator[tuple[float, Any]]:
        """One item carrying `nbytes` of payload, as (time.monotonic() when it was ready, payload):
        what handing over a batch of that size costs (the consumer times it from the stamp)."""
        payload = np.ones(nbytes, np.uint8)  # its pages touched before the stamp
        yield time.monotonic(), payload

    def delete(self, ctx: str, index: int) -> None:
        self.store.delete(ctx, index)

    def delete_context(self, ctx: str) -> None:
        self.store.delete_context(ctx)

    def usage_bytes(self) -> int:
        return self.store.usage_bytes()
