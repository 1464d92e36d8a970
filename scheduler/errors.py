"""Exception types of the scheduler (policies and planners).

This module deliberately knows nothing about chunks, bytes or policies: it only names failures.

Every error a caller may want to tell apart carries a stable ``code`` string (the HTTP edge maps it
to a status; logs and metrics use it as a label). Three tiers: capacity errors and
misuse we can name are the types below; plain caller bugs (a negative size, a wrong type) are
``ValueError`` / ``TypeError``; broken internal invariants are ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Iterable


class SchedulerError(Exception):
    """Base of every scheduler error; ``code`` is stable across releases."""

    code = "scheduler_error"


# -- capacity --------------------------------------------------------------------------------------


class CapacityError(SchedulerError):
    """A request needs more memory than can be made available.

    ``needed`` and ``available`` are in bytes, so the caller can report or retry without parsing
    the message.
    """

    code = "capacity"

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed  # what the request asked for, bytes
        self.available = available  # what could be had, bytes


class NotEnoughEvictableError(CapacityError):
    """Even evicting every unlocked resident chunk would not free the bytes asked for."""

    code = "not_enough_evictable"


# -- misuse ----------------------------------------------------------------------------------------


class UnknownNameError(SchedulerError, ValueError):
    """A name looked up in one of the scheduler's registries is not there; the message lists the
    valid names."""

    code = "unknown_name"

    def __init__(self, kind: str, name: object, valid: Iterable[str]) -> None:
        self.valid = tuple(sorted(valid))  # the registry's names
        super().__init__(f"unknown {kind} {name!r}; valid: {', '.join(self.valid)}")


class UnknownLevelError(UnknownNameError):
    """A compression level name is not one the scheduler knows."""

    code = "unknown_level"


class UnknownStrategyError(UnknownNameError):
    """An eviction strategy name is not in :data:`scheduler.eviction.STRATEGIES`."""

    code = "unknown_eviction_strategy"


class UnknownCompressionModeError(UnknownNameError):
    """A compression mode name is not in :data:`scheduler.compression.MODES`."""

    code = "unknown_compression_mode"


class UnknownPolicyError(UnknownNameError):
    """A policy name is not in :data:`scheduler.policies.POLICIES`."""

    code = "unknown_policy"


class UnknownChunkKeyError(SchedulerError, KeyError):
    """A chunk key is not tracked by the structure asked about."""

    code = "unknown_chunk_key"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class NotLockedError(SchedulerError, ValueError):
    """``unlock`` of a context that holds no lock."""

    code = "not_locked"
