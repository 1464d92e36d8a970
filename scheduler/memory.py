"""Memory accounting for the KV pool: how many bytes are resident, per chunk, against the budget.

The pool's budget counts resident chunks **as stored** (compressed, with scales and zero points:
what the memory governor actually holds), not their dequantized size; the active context's working
set (dequantized for attention) is a separate, bounded buffer outside this budget (DESIGN.md §3).

:class:`MemoryAccountant` is a counter keyed by chunk: ``allocate`` / ``resize`` / ``release``
keep ``used_bytes`` equal to the sum of tracked chunks, ``bytes_to_free(n)`` says how much must be
evicted before ``n`` more bytes fit, and an allocation past the budget raises
:class:`PoolBudgetError` (stable code ``kv_pool_budget``) without changing anything. The caller
decides what to evict (``scheduler.eviction``) and does it; then it allocates.

:class:`MemoryConfig` also carries the two other limits of DESIGN.md §3: the per-app number of
contexts ``K`` (enforced where contexts are created: the registry takes it as
``RegistryConfig.max_contexts_per_app``) and the maximum context length in tokens
(:meth:`MemoryAccountant.check_context_length`, :class:`ContextTooLongError`).

This module deliberately knows nothing about buffers, levels or eviction order: it only counts. The
actors separately verify the count against the buffers they actually hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.errors import (ContextTooLongError, DuplicateChunkKeyError, PoolBudgetError,
                              UnknownChunkKeyError)
from scheduler.keys import ChunkIndex, ChunkKey, ContextId, chunk_key, count


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """Limits of the KV memory pool on one node."""

    pool_bytes: int
    """budget of resident chunks as stored (compressed), bytes"""
    max_contexts_per_app: int = 0
    """K: contexts one app may hold (contexts); 0 = unlimited; enforced by the registry"""
    max_context_tokens: int = 8192
    """longest a context may grow (tokens); the default model's position limit"""
    chunk_tokens: int = 16
    """tokens per KV chunk (tokens)"""

    def __post_init__(self) -> None:
        count("pool_bytes", self.pool_bytes)
        count("max_contexts_per_app", self.max_contexts_per_app)
        count("max_context_tokens", self.max_context_tokens, 1)
        count("chunk_tokens", self.chunk_tokens, 1)

    @property
    def max_chunks_per_context(self) -> int:
        """Chunks of a context at its maximum length, a partial last one included (chunks)."""
        return -(-self.max_context_tokens // self.chunk_tokens)


class MemoryAccountant:
    """Resident bytes per chunk key against :attr:`MemoryConfig.pool_bytes`.

    Invariants (checked by :meth:`check`): ``used_bytes`` equals the sum of tracked chunks' bytes and
    each context's total the sum over its chunks; ``used_bytes <= pool_bytes``; every size >= 0.
    """

    __slots__ = ("config", "_chunks", "_ctx_bytes", "_count", "_used")

    def __init__(self, config: MemoryConfig) -> None:
        self.config = config
        self._chunks: dict[ContextId, dict[ChunkIndex, int]] = {}  # bytes per chunk, by context;
        # a context appears only while it has a tracked chunk
        self._ctx_bytes: dict[ContextId, int] = {}  # sum over each context's chunks, bytes
        self._count = 0  # tracked chunks
        self._used = 0  # sum over all tracked chunks, bytes

    # -- queries -----------------------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        """The pool budget (``config.pool_bytes``), bytes."""
        return self.config.pool_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of all tracked chunks."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Bytes that can still be allocated without evicting."""
        return self.config.pool_bytes - self._used

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: object) -> bool:
        try:
            ctx, idx = key  # type: ignore[misc]
            return idx in self._chunks.get(ctx, ())
        except (TypeError, ValueError):
            return False

    def nbytes(self, key: ChunkKey) -> int:
        """Tracked bytes of one chunk."""
        try:
            return self._chunks[key[0]][key[1]]
        except (KeyError, TypeError, IndexError):
            raise UnknownChunkKeyError(f"chunk {key!r} is not accounted") from None

    def context_bytes(self, ctx: str) -> int:
        """Tracked bytes of all of ``ctx``'s chunks (0 when none)."""
        return self._ctx_bytes.get(ContextId(ctx), 0)

    def chunks_of(self, ctx: str) -> list[ChunkKey]:
        """Tracked chunk keys of ``ctx`` in chunk order."""
        return [(ContextId(ctx), i) for i in sorted(self._chunks.get(ContextId(ctx), ()))]

    def bytes_to_free(self, nbytes: int) -> int:
        """Bytes to evict before ``nbytes`` more fit in the budget (0 when they already fit).

        May exceed ``used_bytes`` when ``nbytes`` alone is over the budget: no eviction can help,
        and the eviction queue will say so with a capacity error.
        """
        nbytes = count("nbytes", nbytes)
        return max(0, self._used + nbytes - self.config.pool_bytes)

    def check_context_length(self, n_tokens: int) -> None:
        """:class:`ContextTooLongError` when a context of ``n_tokens`` is over the limit."""
        n_tokens = count("n_tokens", n_tokens)
        limit = self.config.max_context_tokens
        if n_tokens > limit:
            raise ContextTooLongError(f"context of {n_tokens} tokens is over the limit of {limit}",
                                      needed=n_tokens, available=limit)

    # -- updates -----------------------------------------------------------------------------------

    def allocate(self, key: ChunkKey, nbytes: int) -> None:
        """Account a newly resident chunk; :class:`PoolBudgetError` (nothing changed) if over budget."""
        self.allocate_many([(key, nbytes)])

    def allocate_many(self, items: Iterable[tuple[ChunkKey, int]]) -> None:
        """Account several new chunks at once, all or nothing (a restore admits a context's chunks)."""
        batch: dict[ChunkKey, int] = {}
        for key, nbytes in items:
            key = chunk_key(*key)
            nbytes = count("nbytes", nbytes)
            if key in self or key in batch:
                raise DuplicateChunkKeyError(f"chunk {key!r} is already accounted")
            batch[key] = nbytes
        total = sum(batch.values())
        self._admit(total, f"allocating {len(batch)} chunks of {total} B")
        for (ctx, idx), nbytes in batch.items():
            self._chunks.setdefault(ctx, {})[idx] = nbytes
            self._ctx_bytes[ctx] = self._ctx_bytes.get(ctx, 0) + nbytes
        self._count += len(batch)
        self._used += total

    def resize(self, key: ChunkKey, nbytes: int) -> int:
        """Change a tracked chunk's size (re-quantized lighter, or recomputed at a heavier level).

        Growth is checked against the budget like an allocation. Returns the change in bytes.
        """
        ctx, idx = chunk_key(*key)
        nbytes = count("nbytes", nbytes)
        old = self.nbytes((ctx, idx))
        delta = nbytes - old
        if delta > 0:
            self._admit(delta, f"growing chunk {(ctx, idx)!r} from {old} B to {nbytes} B")
        self._chunks[ctx][idx] = nbytes
        self._ctx_bytes[ctx] += delta
        self._used += delta
        return delta

    def release(self, key: ChunkKey) -> int:
        """Stop accounting a chunk (evicted, killed or deleted); returns its bytes."""
        ctx, idx = chunk_key(*key)
        nbytes = self.nbytes((ctx, idx))
        mine = self._chunks[ctx]
        del mine[idx]
        if mine:
            self._ctx_bytes[ctx] -= nbytes
        else:
            del self._chunks[ctx], self._ctx_bytes[ctx]
        self._count -= 1
        self._used -= nbytes
        return nbytes

    def release_many(self, keys: Iterable[ChunkKey]) -> int:
        """Release several chunks (each must be tracked); returns the bytes freed."""
        return sum(self.release(k) for k in keys)

    def release_context(self, ctx: str) -> int:
        """Release every chunk of ``ctx``; returns the bytes freed (0 when it had none)."""
        return self.release_many(self.chunks_of(ctx))

    def check(self) -> None:
        """Verify the invariants; ``RuntimeError`` when one is broken."""
        if set(self._chunks) != set(self._ctx_bytes):
            raise RuntimeError("contexts with chunks and contexts with totals differ")
        count = used = 0
        for ctx, mine in self._chunks.items():
            if not mine:
                raise RuntimeError(f"context {ctx!r} is listed with no chunk")
            if any(n < 0 for n in mine.values()):
                raise RuntimeError(f"a chunk of {ctx!r} is accounted below 0 B")
            if sum(mine.values()) != self._ctx_bytes[ctx]:
                raise RuntimeError(f"context {ctx!r} total {self._ctx_bytes[ctx]} B != sum of "
                                   f"its chunks {sum(mine.values())} B")
            count += len(mine)
            used += sum(mine.values())
        if (count, used) != (self._count, self._used):
            raise RuntimeError(f"counters ({self._count} chunks, {self._used} B) != tracked "
                               f"({count} chunks, {used} B)")
        if self._used > self.config.pool_bytes:
            raise RuntimeError(f"used_bytes {self._used} over the budget {self.config.pool_bytes}")

    # -- internals ---------------------------------------------------------------------------------

    def _admit(self, nbytes: int, what: str) -> None:
        if self._used + nbytes > self.config.pool_bytes:
            raise PoolBudgetError(
                f"{what} would use {self._used + nbytes} B of a {self.config.pool_bytes} B pool; "
                f"free {self.bytes_to_free(nbytes)} B first", needed=nbytes,
                available=self.free_bytes)

