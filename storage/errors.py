"""Exception types of the storage layer.

Every error a caller may want to tell apart carries a stable ``code`` string (the HTTP edge maps it
to a status; logs and metrics use it as a label). Three tiers: capacity and corruption
are our own types below; caller bugs (a wrong shape, a bad argument type) are ``ValueError`` /
``TypeError``; broken internal invariants are ``RuntimeError``.

This module deliberately knows nothing about files, codecs or SQL: it only names failures.
"""

from __future__ import annotations


class StorageError(Exception):
    """Base of every storage-layer error; ``code`` is stable across releases."""

    code = "storage_error"


# -- chunk files ---------------------------------------------------------------------------------


class ChunkNotFoundError(StorageError):
    """No chunk record exists for the (context key, chunk index) asked for."""

    code = "chunk_not_found"


class CorruptChunkError(StorageError):
    """A chunk file is torn, truncated, bit-flipped or otherwise not what its header promises."""

    code = "chunk_corrupt"


class ChunkVersionError(CorruptChunkError):
    """A chunk file (or codec payload) has a format or codec version this code cannot read."""

    code = "chunk_version"


class FingerprintMismatchError(StorageError):
    """A chunk file was written for another model (its fingerprint differs from the store's)."""

    code = "chunk_fingerprint"


class DiskCapExceededError(StorageError):
    """A write would take the store past its configured disk cap (a capacity error)."""

    code = "disk_cap_exceeded"


class DiskFullError(StorageError):
    """The file system under the data directory has no room left (ENOSPC) or its quota is spent
    (EDQUOT), met by a chunk write or a registry transaction (SQLite's "database or disk is full").
    The write that met it changed nothing already stored; it succeeds again once space is freed."""

    code = "disk_full"


class PathConfinementError(StorageError):
    """A path would leave the store root, or a symlink was found where a file or folder must be."""

    code = "path_confinement"


class InvalidKeyError(StorageError, ValueError):
    """A context key or chunk index is malformed (never turned into a path)."""

    code = "invalid_key"


# -- codecs ----------------------------------------------------------------------------------------


class UnknownCodecError(StorageError, ValueError):
    """No codec is registered under a level name (:data:`storage.codecs.CODECS`); the message lists
    the valid names. (The scheduler's own check of level names raises
    ``scheduler.errors.UnknownLevelError``; storage does not import the scheduler.)"""

    code = "unknown_codec"


# -- registry --------------------------------------------------------------------------------------


class RegistryError(StorageError):
    """Base of registry errors (the SQLite context registry)."""

    code = "registry_error"


class UnknownAppError(RegistryError):
    """No app with that name or token."""

    code = "unknown_app"


class AppExistsError(RegistryError):
    """An app with that name already exists."""

    code = "app_exists"


class ContextLimitError(RegistryError):
    """The app already holds its maximum number of contexts (a capacity error)."""

    code = "context_limit"


class UnknownContextError(RegistryError):
    """No such context, or it belongs to another app (the two are indistinguishable on purpose)."""

    code = "unknown_context"


class UnknownChunkError(RegistryError):
    """No chunk row for that (context, chunk index)."""

    code = "unknown_chunk"


class UnknownAdapterError(RegistryError, LookupError):
    """No LoRA adapter of that name is loaded."""

    code = "unknown_adapter"


class AdapterExistsError(RegistryError):
    """An adapter of that name is already loaded."""

    code = "adapter_exists"


class AdapterInUseError(RegistryError):
    """The adapter cannot be removed: contexts are computed under it."""

    code = "adapter_in_use"
