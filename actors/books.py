"""The memory governor's books: a row per chunk of a context, a book per context, and its configuration.

Plain data: what the governor knows of each chunk (its level, its resident handle, its file) and how
that reads as a registry row, and how a context's book reads in `GET /v1/contexts/{id}`. The governor
alone changes them (`actors.governor`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from storage.registry import ChunkRow, ChunkState


@dataclass(slots=True)
class Chunk:
    """The governor's row for one chunk of one context."""

    level: str
    """Level of the resident handle or, when not resident, of the file."""
    handle: Any = None
    """Resident copy (opaque), or None."""
    nbytes: int = 0
    """Bytes of the resident copy as stored (0 when not resident)."""
    file: str | None = None
    """Chunk file name when a valid file holds this chunk's current content."""
    file_nbytes: int = 0
    """Size of that file in bytes."""
    checksum: str | None = None
    density: float = 0.0
    """Information density (LLMS Eq. 1)."""
    pinned_exact: bool = False
    """Never lowered below raw by any policy (`MemoryGovernor.pin_exact`)."""

    def written(self, meta: dict) -> int:
        """A write of this chunk ended with `meta` (the IO worker's name, nbytes, checksum): its file.
        Returns the bytes written."""
        self.file, self.file_nbytes, self.checksum = meta["name"], meta["nbytes"], meta["checksum"]
        return self.file_nbytes

    def row(self, index: int) -> ChunkRow:
        """This chunk as the registry stores it (its state from where its copies are)."""
        if self.file and self.handle is not None:
            state = ChunkState.BOTH
        elif self.file:
            state = ChunkState.SWAPPED
        elif self.handle is not None:
            state = ChunkState.RESIDENT
        else:
            state = ChunkState.MISSING
        return ChunkRow(index, state, self.level, self.file, self.checksum, self.file_nbytes, self.density,
                        self.pinned_exact)


@dataclass(slots=True)
class CtxBook:
    """The governor's book of one context."""

    app: str
    adapter: str = ""
    """Key of the LoRA adapter the context is computed under ("" for none): its records carry it."""
    kv_tokens: int = 0
    """Tokens of the context that have chunks (K/V computed at least once)."""
    chunks: dict[int, Chunk] = field(default_factory=dict)
    request_id: str | None = None
    """The request id of the last committed call: a call retried with it appends nothing."""


def describe_context(row, state: dict, book: CtxBook, chunk_tokens: int, *, busy: bool,
                     working_set: tuple[int | None] | None = None) -> dict:
    """What `GET /v1/contexts/{id}` shows of a context: its registry row (`storage.records.ContextRecord`),
    the executor's saved state (turns), its book (chunks by where they are and their level), and
    whether the executor's working set holds its K/V (`working_set`: (the first layer streamed out of
    memory, None when every layer is in memory), or None when it does not hold it)."""
    resident: dict[str, int] = {}
    swapped: dict[str, int] = {}
    for ch in book.chunks.values():
        if ch.handle is not None:
            resident[ch.level] = resident.get(ch.level, 0) + 1
        elif ch.file is not None:
            swapped[ch.level] = swapped.get(ch.level, 0) + 1
    n_chunks = -(-book.kv_tokens // chunk_tokens) if book.kv_tokens else 0
    system_prompt = state.get("system_prompt", row.system_prompt or None)
    turns = state.get("turns") or []
    if not turns and system_prompt is not None:
        turns = [{"role": "system", "text": system_prompt}]
    return {
        "id": row.id, "app": row.app, "system_prompt": system_prompt, "adapter": row.adapter.split("@")[0] or None,
        "tokens": int(len(row.token_ids)), "kv_tokens": book.kv_tokens,
        "created": row.created, "last_used": row.last_used, "busy": busy,
        "turns": [{"role": t["role"], "text": t["text"]} for t in turns],
        "chunks": {"total": n_chunks, "resident": resident, "swapped": swapped,
                   "to_recompute": max(0, n_chunks - sum(resident.values()) - sum(swapped.values()))},
        "working_set": {"held": working_set is not None,
                        "streamed_from_layer": working_set[0] if working_set is not None else None},
    }


@dataclass(slots=True)
class GovernorConfig:
    """What `actors.governor.MemoryGovernor` is built with (`actors.service.components` derives it)."""

    pool_bytes: int = 256 << 20
    """KV memory pool budget: bytes of resident chunks as stored (compressed)."""
    chunk_tokens: int = 16
    """Tokens per chunk."""
    policy: str = "llms"
    """Policy set name (scheduler.policies.POLICIES)."""
    dtype: str = "float32"
    """Compute dtype of the K/V (codec naming)."""
    pipeline_groups: int = 1
    """Layer groups a restore streams from the reader to the consumer (the G of Eq. 4',
    scheduler/pipeline.py); 1 plans with no overlap. Set by the service from its restorer."""
    raw_chunk_bytes: int = 0
    """Bytes of one full chunk's K/V at `raw` (the model's layers x K and V x KV heads x head size x
    chunk tokens x the dtype's size). It measures pressure (`room`): while the contexts in the pool
    fit at raw, nothing is lowered. 0: unknown, every plan at the policy's configured ratio."""
