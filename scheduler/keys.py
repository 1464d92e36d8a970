"""Key types shared by the scheduler's structures: which context, which chunk.

This module deliberately knows nothing about what a chunk holds or where it lives.

Distinct ``NewType``s so a type checker catches a chunk index passed where a context id belongs.
A context id is the registry's opaque string; a chunk index counts 16-token chunks (configurable)
from the start of the context. Beside them, the one validator every structure uses for counts
(bytes, tokens, chunks).
"""

from __future__ import annotations

import operator
from typing import NewType

#: the registry's opaque context id
ContextId = NewType("ContextId", str)
#: position of a chunk in its context (0 = the first ``chunk_tokens`` tokens)
ChunkIndex = NewType("ChunkIndex", int)
#: one chunk of one context
ChunkKey = tuple[ContextId, ChunkIndex]


def chunk_key(ctx: str, index: int) -> ChunkKey:
    """A validated chunk key (a non-empty context id string and a non-negative int index)."""
    if not isinstance(ctx, str) or not ctx:
        raise ValueError(f"context id must be a non-empty str, got {ctx!r}")
    return (ContextId(ctx), ChunkIndex(count("chunk index", index)))


def count(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as a plain int if it is an integer (numpy ones included, bools and floats not)
    ``>= minimum``; ``ValueError`` naming ``name`` otherwise."""
    try:
        i = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        i = None
    if i is None or isinstance(value, bool) or i < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return i
