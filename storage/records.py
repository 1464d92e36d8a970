"""The registry's records: what `storage.registry.Registry` stores and returns (apps' contexts,
chunk rows, loaded adapters), and its configuration.

This module deliberately knows nothing about SQLite, policies or KV data: plain values only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class ChunkState(str, enum.Enum):
    """Where a chunk's KV lives."""

    RESIDENT = "resident"  # memory pool only
    SWAPPED = "swapped"  # chunk file only
    BOTH = "both"  # memory pool, with a clean copy in a file
    MISSING = "missing"  # nowhere: recompute from the token ids

    @property
    def on_disk(self) -> bool:
        return self in (ChunkState.SWAPPED, ChunkState.BOTH)


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    """Tunables of the registry."""

    chunk_tokens: int = 16  # tokens per chunk (tokens); chunk i covers [i*n, (i+1)*n)
    max_contexts_per_app: int = 0  # contexts one app may hold (contexts); 0: unlimited
    busy_timeout_s: float = 10.0  # wait for another connection's write lock (seconds)


@dataclass(frozen=True, slots=True)
class ContextSummary:
    """A context without its tokens and text."""

    id: str  # opaque hex id
    app: str  # owner app name
    n_tokens: int  # tokens so far (tokens)
    created: float  # clock seconds
    last_used: float  # clock seconds
    adapter: str = ""  # key (name@digest) of the LoRA adapter its K/V is computed under; "" for none


@dataclass(frozen=True, slots=True)
class ContextRecord:
    """A context row with everything recompute needs."""

    id: str  # opaque hex id
    app: str  # owner app name
    system_prompt: str
    token_ids: np.ndarray  # int32 [n_tokens], read-only: the source of truth for recompute
    text: str  # decoded text of everything so far (for display; never re-tokenized)
    created: float  # clock seconds
    last_used: float  # clock seconds
    adapter: str = ""  # key (name@digest) of the LoRA adapter its K/V is computed under; "" for none


@dataclass(frozen=True, slots=True)
class AdapterRow:
    """A LoRA adapter the node loads at start (engine.lora)."""

    name: str  # what callers select it by
    path: str  # its directory, relative to the adapter root
    key: str  # name@digest of its files when it was added
    created: float  # clock seconds


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One chunk row."""

    context: str  # context id
    index: int  # chunk index
    state: ChunkState
    level: str  # codec level of the (resident or stored) copy
    file: str | None  # chunk file name relative to the store root, when state.on_disk
    checksum: str | None  # the file's checksum (ChunkMeta.checksum), when state.on_disk
    nbytes: int  # bytes of the file (0 when none)
    density: float  # information density (LLMS Eq. 1)
    last_use: float  # clock seconds
    pinned: bool = False  # pinned exact: never lowered below raw


@dataclass(frozen=True, slots=True)
class ChunkRow:
    """A chunk row to write (:meth:`Registry.upsert_chunks`); density None keeps the stored one."""

    index: int
    state: ChunkState | str
    level: str
    file: str | None = None
    checksum: str | None = None
    nbytes: int = 0
    density: float | None = None
    pinned: bool = False  # pinned exact: never lowered below raw (the caller keeps it so)


@dataclass(slots=True)
class VerifyReport:
    """What :meth:`Registry.verify` found (chunk keys are (context id, chunk index))."""

    checked: int = 0  # rows that named a file
    missing: list[tuple[str, int]] = field(default_factory=list)  # file gone: marked for recompute
    corrupt: list[tuple[str, int, str]] = field(default_factory=list)  # (ctx, idx, error code)
    adopted: list[tuple[str, int]] = field(default_factory=list)  # a valid newer file was adopted
    orphans: list[str] = field(default_factory=list)  # files no row names (caller may delete)

    @property
    def marked(self) -> int:
        return len(self.missing) + len(self.corrupt)
