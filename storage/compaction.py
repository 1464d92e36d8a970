"""Compaction of a context's packs: current records copied verbatim into fresh packs.

This module deliberately knows nothing about payload contents or codecs: it moves records it has
not parsed beyond the headers the index already holds.

Superseded records inside a pack that still holds current ones take space until compaction. A
context is compacted when its current records are in more than ``max_packs`` packs (packs a read
may touch), or when it has more superseded than current bytes (and at least ``compact_min_bytes``).
Its current records are then copied byte for byte (their checksums do not change) into new packs
that tile the range they came from, each written like any other pack (:mod:`storage.packwriter`);
the packs they replace are removed as they stop deciding anything. The pack with the most current
bytes is kept in place unless it is itself mostly superseded. A chunk that a damaged pack taints
is not moved.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from storage.fileops import READ_FLAGS
from storage.packindex import ContextPacks, Pack, PackIndex, Record, aligned, layout, pack_name

if TYPE_CHECKING:
    from storage.packwriter import PackWriter


def _choose(index: PackIndex, c: ContextPacks) -> tuple[list[Record], int, int] | None:
    """(records to move, in index order, and the range lo..hi their new packs decide), or None when
    the context needs no compaction. Hold the index lock."""
    config = index.config
    packs = [p for p in c.packs.values() if p.damage is None and p.live]
    live = {p.name: sum(p.records[i].nbytes for i in p.live) for p in packs}
    total_live = sum(live.values())
    dead = sum(p.nbytes for p in packs) - total_live
    many = len(packs) > config.max_packs
    wasteful = dead > max(total_live, config.compact_min_bytes)
    if not (many or wasteful) or not packs:
        return None
    keep: Pack | None = max(packs, key=lambda p: live[p.name])
    if 2 * live[keep.name] < keep.nbytes or len(packs) == 1:
        keep = None  # the biggest pack is itself mostly superseded: rewrite everything
    chosen = [p for p in packs if p is not keep]
    if not chosen:
        return None
    lo = min(min(p.live) for p in chosen)
    hi = max(max(p.live) for p in chosen)
    moving = [c.live[i] for i in sorted(c.live) if lo <= i <= hi and index.readable(c, c.live[i])]
    return (moving, lo, hi) if moving else None


def _read_verbatim(index: PackIndex, c: ContextPacks, moving: list[Record]) -> dict[int, bytes] | None:
    """The moving records' bytes, pack by pack; None when a pack is gone or short (reads will say
    so; do not compact)."""
    data: dict[int, bytes] = {}
    by_pack: dict[str, list[Record]] = {}
    for r in moving:
        by_pack.setdefault(r.pack.name, []).append(r)
    for name, recs in by_pack.items():
        try:
            fd = index.fs.open(os.path.join(c.dir, name), READ_FLAGS)
        except OSError:
            return None
        try:
            for r in recs:
                data[r.index] = index.fs.pread(fd, r.nbytes, r.offset)
        finally:
            index.fs.close(fd)
    if any(len(data[r.index]) != r.nbytes for r in moving):
        return None
    return data


def maybe_compact(writer: PackWriter, c: ContextPacks) -> bool:
    """Compact context ``c`` if it is fragmented or mostly superseded; whether it was. Hold
    ``writer.lock``."""
    index = writer.index
    with index.lock:
        chosen = _choose(index, c)
    if chosen is None:
        return False
    moving, lo, hi = chosen
    # new packs tile lo..hi (chunks without a current record in it stay without one); each piece's
    # records are read just before its pack is written, so memory holds at most one new pack's bytes
    # (`pack_bytes`), not the context's
    pieces, cur, size = [], [], 0
    for r in moving:
        if cur and size + r.nbytes > index.config.pack_bytes:
            pieces.append(cur)
            cur, size = [], 0
        cur.append(r)
        size += aligned(r.nbytes)
    pieces.append(cur)
    start = lo
    for k, piece in enumerate(pieces):
        data = _read_verbatim(index, c, piece)
        if data is None:  # the packs written so far are current and consistent; the rest stay as they were
            return k > 0
        end = hi if k == len(pieces) - 1 else piece[-1].index
        _write_copy(writer, c, start, end, piece, data)
        data = None  # before the next piece is read
        start = end + 1
    return True


def _write_copy(writer: PackWriter, c: ContextPacks, lo: int, hi: int, recs: list[Record],
                data: dict[int, bytes]) -> None:
    """Write a pack deciding ``lo..hi`` that holds copies of ``recs``. Hold ``writer.lock``."""
    buffers, offsets, nbytes = layout([[data[r.index]] for r in recs])
    gen = writer.reserve(c, nbytes)
    name = pack_name(gen, lo, hi)
    writer.commit_file(c, gen, name, buffers, nbytes)
    p = Pack(name, gen, lo, hi, nbytes)
    for r, off in zip(recs, offsets):
        p.records[r.index] = Record(p, r.index, off, r.nbytes, r.base, r.head, r.header, r.checksum)
    writer.index.install(c, p)
