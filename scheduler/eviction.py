"""Eviction queues over the pool's resident chunks: LCTRU (LLMS §3.4 ii), chunk LRU, context LRU.

This module deliberately knows nothing about disks, buffers, clocks or budgets: times and sizes are
given to it, and it answers which chunks to evict, in order; the caller evicts them.

An :class:`EvictionQueue` tracks every resident chunk as ``key -> (level, nbytes, last_use)`` and,
asked to free ``need_bytes``, returns the chunk keys to evict, in order. Which order is a tiny
*strategy* object returning a sort key (SGLang style), chosen by name through :data:`STRATEGIES`:

===============  =======  ==============================================================
name             unit     pops first
===============  =======  ==============================================================
``lctru``        chunk    heaviest level (raw > fp16/bf16 > q8 > q4 > q2), then least
                          recently used: the paper's concatenated per-ratio sub-queues
``lru``          chunk    least recently used (``vllm-s``, ``vllm-sq``, ``llms-no-lctru``)
``context-lru``  context  every resident chunk of the least recently used context (``swap``,
                          ``lmk``); a context's last use is its latest touch's ``last_use``
===============  =======  ==============================================================

Ties fall back to the unit itself (context id, then chunk index), so the order is deterministic.
Chunks of a *locked* context (a call is using it) are never returned; locks nest (a count per
context) and may be taken before the context has any resident chunk.

Why a heap with lazy invalidation and not a deque or an ordered dict: a touch can move any entry
anywhere (a re-used chunk goes to the back, a re-quantized chunk moves to a lighter sub-queue, and
``last_use`` comes from the caller, not necessarily increasing), and removing from the middle of a
heap is O(n). So a touch pushes a fresh heap item carrying the unit's new ``version`` and leaves the
old item in place; a popped item whose unit is gone or whose version is older is skipped.

Invariants (checked by :meth:`EvictionQueue.check`):

* every live unit has exactly one heap item with its current ``version`` and sort key; any other
  item is stale (versions come from one queue-wide counter, so a unit removed and added again
  never matches an item of its earlier life);
* the heap holds at most ``2 * units + 64`` items after any operation (it is rebuilt from the live
  units when it grows past that, which keeps pushes amortised O(log n));
* ``resident_bytes`` equals the sum of tracked chunks' ``nbytes``, and each context's ``nbytes``
  the sum over its chunks.

Complexity: ``touch`` O(log n) amortised, ``remove`` O(1) (its item goes stale); ``pop_victims`` O((v + s + k) log n) for v
victims, s stale items and k items of locked contexts that happen to lie ahead of the victims (they
are set aside and pushed back). ``pop_victims`` checks first that the unlocked bytes suffice and
raises :class:`NotEnoughEvictableError` without touching the queue when they do not.

Popped victims leave the queue: the caller evicts them (their clean copy is on disk ahead of time
under ``llms``, or the caller writes it now) and updates its own byte counts.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from scheduler import levels as L
from scheduler.errors import (NotEnoughEvictableError, NotLockedError, UnknownChunkKeyError,
                              UnknownStrategyError)
from scheduler.keys import ChunkIndex, ChunkKey, ContextId, chunk_key, count

#: heap slack before a rebuild: at most ``2 * live units + _SLACK`` items are kept
_SLACK = 64


@dataclass(slots=True)
class ChunkEntry:
    """One resident chunk as the queue sees it."""

    level: str  # level of the resident copy (a key of scheduler.levels.RANK)
    nbytes: int  # resident bytes as stored (compressed, with scales), bytes
    last_use: float  # when a call last used it, seconds on the caller's clock
    version: int = 0  # queue-wide sequence number of its live heap item; other items are stale
    sort_key: tuple | None = None  # key of its live heap item (chunk strategies only)


@dataclass(slots=True)
class ContextEntry:
    """The resident part of one context."""

    last_use: float  # latest last_use of any touch of its chunks, seconds
    nbytes: int = 0  # sum of its tracked chunks' nbytes, bytes
    chunks: set[ChunkIndex] = field(default_factory=set)  # indices of its tracked chunks
    version: int = 0  # queue-wide sequence number of its live heap item (context strategies only)
    sort_key: tuple | None = None  # key of its live heap item (context strategies only)


class EvictionStrategy(Protocol):
    """Orders eviction units: smaller ``key`` is evicted first."""

    name: ClassVar[str]  # registry name
    granularity: ClassVar[str]  # "chunk": units are chunk keys; "context": units are context ids

    def key(self, entry: Any) -> tuple:
        """Sort key of a unit from its :class:`ChunkEntry` or :class:`ContextEntry`."""
        ...


class LCTRU:
    """Least Compression-Tolerable and Recently Used: heaviest level first, then oldest use."""

    name: ClassVar[str] = "lctru"
    granularity: ClassVar[str] = "chunk"

    def key(self, entry: ChunkEntry) -> tuple:
        return (-L.rank(entry.level), entry.last_use)


class ChunkLRU:
    """Least recently used chunk first, whatever its level."""

    name: ClassVar[str] = "lru"
    granularity: ClassVar[str] = "chunk"

    def key(self, entry: ChunkEntry) -> tuple:
        return (entry.last_use,)


class ContextLRU:
    """Least recently used context first; all its resident chunks go together."""

    name: ClassVar[str] = "context-lru"
    granularity: ClassVar[str] = "context"

    def key(self, entry: ContextEntry) -> tuple:
        return (entry.last_use,)


#: eviction strategy name -> class
STRATEGIES: dict[str, type] = {cls.name: cls for cls in (LCTRU, ChunkLRU, ContextLRU)}


def get_strategy(name: str) -> EvictionStrategy:
    """A new strategy by registry name; :class:`UnknownStrategyError` lists the valid names."""
    try:
        return STRATEGIES[name]()
    except (KeyError, TypeError):
        raise UnknownStrategyError("eviction strategy", name, STRATEGIES) from None


class EvictionQueue:
    """Resident chunks ordered for eviction by one strategy (see the module docstring)."""

    def __init__(self, strategy: EvictionStrategy | str = "lctru") -> None:
        self.strategy: EvictionStrategy = (get_strategy(strategy) if isinstance(strategy, str)
                                           else strategy)
        if self.strategy.granularity not in ("chunk", "context"):
            raise ValueError(f"strategy granularity must be 'chunk' or 'context', "
                             f"got {self.strategy.granularity!r}")
        self._by_context = self.strategy.granularity == "context"
        self._chunks: dict[ChunkKey, ChunkEntry] = {}  # every tracked (resident) chunk
        self._contexts: dict[ContextId, ContextEntry] = {}  # every context with a tracked chunk
        self._heap: list[tuple[tuple, Any, int]] = []  # (sort key, unit, version); may hold stale
        self._locks: dict[ContextId, int] = {}  # lock count per locked context (> 0)
        self._bytes = 0  # sum of tracked chunks' nbytes, bytes
        self._seq = 0  # last version handed out (versions are unique across the queue's life)

    # -- queries -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, key: object) -> bool:
        return key in self._chunks

    @property
    def resident_bytes(self) -> int:
        """Bytes of all tracked chunks."""
        return self._bytes

    @property
    def evictable_bytes(self) -> int:
        """Bytes of tracked chunks of unlocked contexts (what ``pop_victims`` could free)."""
        locked = sum(self._contexts[c].nbytes for c in self._locks if c in self._contexts)
        return self._bytes - locked

    def contexts(self) -> list[ContextId]:
        """Contexts with at least one tracked chunk (the set eviction chooses from, locked or not)."""
        return list(self._contexts)

    def chunks_of(self, ctx: str) -> list[ChunkKey]:
        """Tracked chunk keys of ``ctx`` in chunk order."""
        e = self._contexts.get(ContextId(ctx))
        return [] if e is None else [(ContextId(ctx), i) for i in sorted(e.chunks)]

    def order(self) -> list[ChunkKey]:
        """Every unlocked chunk in the order ``pop_victims`` would return them (no mutation;
        O(n log n); what tests check the strategies against)."""
        live = sorted((e.sort_key, u) for u, e in self._units().items()
                      if self._ctx_of(u) not in self._locks)
        return [k for _, u in live for k in self._victims_of(u)]

    # -- updates -----------------------------------------------------------------------------------

    def touch(self, key: ChunkKey, level: str, nbytes: int, last_use: float) -> None:
        """Track ``key`` as resident at ``level`` with ``nbytes``, last used at ``last_use`` (seconds).

        Adds the chunk or updates it (a use, a re-quantization to a lighter level, a restore).
        """
        ctx, idx = chunk_key(*key)
        L.check_level(level)
        nbytes = count("nbytes", nbytes)
        last_use = float(last_use)
        if not math.isfinite(last_use):
            raise ValueError(f"last_use must be finite seconds, got {last_use!r}")
        key = (ctx, idx)
        c = self._contexts.get(ctx)
        if c is None:
            c = self._contexts[ctx] = ContextEntry(last_use)
        e = self._chunks.get(key)
        if e is None:
            e = self._chunks[key] = ChunkEntry(level, nbytes, last_use)
            c.chunks.add(idx)
        else:
            c.nbytes -= e.nbytes
            self._bytes -= e.nbytes
            e.level, e.nbytes, e.last_use = level, nbytes, last_use
        c.nbytes += nbytes
        self._bytes += nbytes
        c.last_use = max(c.last_use, last_use)
        self._refresh(ctx if self._by_context else key)

    def remove(self, key: ChunkKey) -> ChunkEntry:
        """Stop tracking ``key`` (freed or evicted by the caller); returns its last entry."""
        key = chunk_key(*key)
        if key not in self._chunks:
            raise UnknownChunkKeyError(f"chunk {key!r} is not in the eviction queue")
        return self._drop(key)  # under context-lru the context keeps its place: its last use stands

    def lock(self, ctx: str) -> None:
        """Forbid evicting ``ctx``'s chunks until the matching ``unlock`` (locks nest)."""
        if not isinstance(ctx, str) or not ctx:
            raise ValueError(f"context id must be a non-empty str, got {ctx!r}")
        self._locks[ContextId(ctx)] = self._locks.get(ContextId(ctx), 0) + 1

    def unlock(self, ctx: str) -> None:
        """Release one lock of ``ctx``; :class:`NotLockedError` when it holds none."""
        n = self._locks.get(ContextId(ctx), 0)
        if n <= 0:
            raise NotLockedError(f"context {ctx!r} is not locked")
        if n == 1:
            del self._locks[ContextId(ctx)]
        else:
            self._locks[ContextId(ctx)] = n - 1

    def pop_victims(self, need_bytes: int, skip: Callable[[ChunkKey], bool] | None = None) -> list[ChunkKey]:
        """Remove and return chunks, in eviction order, until at least ``need_bytes`` are freed.

        Returns ``[]`` for ``need_bytes <= 0``. Raises :class:`NotEnoughEvictableError` (the queue
        unchanged) when all unlocked chunks together hold fewer than ``need_bytes``. Under a
        context strategy whole contexts are taken, so more than asked may be freed. ``skip``: units
        holding a chunk it names are passed over and stay, as locked ones do (the caller's chunks
        not safe to drop yet); then the chunks returned may free less than ``need_bytes``.
        """
        if need_bytes <= 0:
            return []
        avail = self.evictable_bytes
        if avail < need_bytes:
            raise NotEnoughEvictableError(
                f"need {need_bytes} B but unlocked resident chunks hold {avail} B "
                f"({len(self._locks)} contexts locked)", needed=int(need_bytes), available=avail)
        victims: list[ChunkKey] = []
        skipped: list[tuple[tuple, Any, int]] = []
        freed = 0
        units = self._units()
        while freed < need_bytes:
            if not self._heap:
                if skip is not None:
                    break
                raise RuntimeError(f"eviction heap ran dry with {freed} of {need_bytes} B freed but "
                                   f"{avail} B counted evictable")
            item = heapq.heappop(self._heap)
            _, unit, version = item
            e = units.get(unit)
            if e is None or e.version != version:
                continue  # stale
            if self._ctx_of(unit) in self._locks or skip is not None and any(map(skip, self._victims_of(unit))):
                skipped.append(item)
                continue
            for k in self._victims_of(unit):
                freed += self._drop(k).nbytes
                victims.append(k)
        for item in skipped:
            heapq.heappush(self._heap, item)
        return victims

    def check(self) -> None:
        """Verify the invariants in the module docstring; ``RuntimeError`` when one is broken."""
        total = sum(e.nbytes for e in self._chunks.values())
        if total != self._bytes:
            raise RuntimeError(f"resident_bytes {self._bytes} != sum of entries {total}")
        for ctx, c in self._contexts.items():
            mine = {k[1] for k in self._chunks if k[0] == ctx}
            if not c.chunks or mine != c.chunks:
                raise RuntimeError(f"context {ctx!r} lists chunks {sorted(c.chunks)}, "
                                   f"table has {sorted(mine)}")
            if c.nbytes != sum(self._chunks[(ctx, i)].nbytes for i in c.chunks):
                raise RuntimeError(f"context {ctx!r} nbytes {c.nbytes} != sum of its chunks")
        if any(k[0] not in self._contexts for k in self._chunks):
            raise RuntimeError("a tracked chunk has no context entry")
        units = self._units()
        live = [(u, v) for _, u, v in self._heap if u in units and units[u].version == v]
        if len(live) != len(units) or {u for u, _ in live} != set(units):
            raise RuntimeError(f"{len(live)} live heap items for {len(units)} units")
        for key, u, v in self._heap:
            if u in units and units[u].version == v and key != self.strategy.key(units[u]):
                raise RuntimeError(f"heap item of {u!r} carries a stale sort key")
        if len(self._heap) > 2 * len(units) + _SLACK:
            raise RuntimeError(f"heap holds {len(self._heap)} items for {len(units)} units")
        if any(n <= 0 for n in self._locks.values()):
            raise RuntimeError("a lock count is not positive")

    # -- internals ---------------------------------------------------------------------------------

    def _units(self) -> dict:
        return self._contexts if self._by_context else self._chunks

    def _ctx_of(self, unit: Any) -> ContextId:
        return unit if self._by_context else unit[0]

    def _victims_of(self, unit: Any) -> list[ChunkKey]:
        return self.chunks_of(unit) if self._by_context else [unit]

    def _refresh(self, unit: Any) -> None:
        """Push a heap item for ``unit`` if its sort key changed (or it has none yet)."""
        e = self._units()[unit]
        k = self.strategy.key(e)
        if k == e.sort_key:
            return
        self._seq += 1  # queue-wide, so a re-added unit never reuses a stale item's version
        e.version = self._seq
        e.sort_key = k
        heapq.heappush(self._heap, (k, unit, e.version))
        if len(self._heap) > 2 * len(self._units()) + _SLACK:
            self._heap = [(u.sort_key, name, u.version) for name, u in self._units().items()]
            heapq.heapify(self._heap)

    def _drop(self, key: ChunkKey) -> ChunkEntry:
        """Untrack one chunk (its heap item, if any, goes stale); drop an emptied context."""
        e = self._chunks.pop(key)
        c = self._contexts[key[0]]
        c.chunks.discard(key[1])
        c.nbytes -= e.nbytes
        self._bytes -= e.nbytes
        if not c.chunks:
            del self._contexts[key[0]]
        return e
