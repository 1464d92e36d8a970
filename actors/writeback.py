"""Writes ahead of time in flight: the memory governor starts a call's chunk writes and goes on with the
next call's plan instead of waiting for the IO worker's writes and fsyncs (docs/design.md §4, step 5).

This module only keeps the list: which writes are in flight and which chunks each one holds. The
governor decides when to wait for one (a chunk it is about to evict, drop or delete) and applies what a
finished write returns (file names and sizes) to its books. A write is anything with `done()` and
`result()`: a `concurrent.futures.Future` from the IO worker's writer thread in one process, or the
future of a Ray object ref.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol


class Pending(Protocol):
    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...


@dataclass(slots=True, eq=False)
class Write:
    """One `SwapIOPort.write_async` in flight."""

    ctx: str
    """The context whose chunks it writes."""
    todo: list[tuple[int, Any, int]]
    """(chunk index, resident handle, first token) as sent."""
    pending: Pending
    """Its result: one {name, nbytes, checksum} per chunk of `todo`, in order."""


class WritesInFlight:
    """Writes started and not yet applied, by the chunks they hold (a chunk is in at most one)."""

    def __init__(self) -> None:
        self._by_chunk: dict[tuple[str, int], Write] = {}
        self._writes: list[Write] = []

    def __len__(self) -> int:
        return len(self._writes)

    def __contains__(self, key: object) -> bool:
        return key in self._by_chunk

    def start(self, ctx: str, todo: list[tuple[int, Any, int]], pending: Pending) -> Write:
        w = Write(ctx, todo, pending)
        for i, _h, _t in todo:
            if (ctx, i) in self._by_chunk:
                raise ValueError(f"chunk {ctx}/{i} is already being written")
        for i, _h, _t in todo:
            self._by_chunk[(ctx, i)] = w
        self._writes.append(w)
        return w

    def of(self, ctx: str, indices: Iterable[int] | None = None) -> list[Write]:
        """The writes holding any of `ctx`'s chunks `indices` (all of its chunks when None)."""
        if indices is None:
            return [w for w in self._writes if w.ctx == ctx]
        found = {id(w): w for i in indices if (w := self._by_chunk.get((ctx, i))) is not None}
        return [w for w in self._writes if id(w) in found]  # oldest first

    def finished(self) -> list[Write]:
        """The writes whose result is in, oldest first."""
        return [w for w in self._writes if w.pending.done()]

    def all(self) -> list[Write]:
        return list(self._writes)

    def remove(self, w: Write) -> None:
        """`w` was applied (or failed): its chunks are free for another write."""
        self._writes.remove(w)
        for i, _h, _t in w.todo:
            if self._by_chunk.get((w.ctx, i)) is w:
                del self._by_chunk[(w.ctx, i)]
