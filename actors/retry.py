"""Calling a Ray actor while it restarts: one retry rule, for blocking and for asyncio callers.

Our actors rebuild their state from the registry and the chunk files when Ray restarts them, so a
call refused because the actor is restarting (`ActorUnavailableError`) is safe to send again; one
that reached the actor and failed there is not retried. Past the deadline (`restart_wait_s`) the
caller gets `ActorRestartingError` (code `unavailable`: the HTTP front answers 503).

What this module deliberately does not know: which actor or method it calls.
"""

from __future__ import annotations

import asyncio
import time

import ray

from actors.config import restart_wait_s


class ActorRestartingError(RuntimeError):
    """An actor stayed unavailable past the retry deadline."""

    code = "unavailable"


class _Backoff:
    """Delays 0.05 s doubling to 1 s, until `deadline_s` (None: `restart_wait_s()`) has passed."""

    def __init__(self, deadline_s: float | None) -> None:
        wait = restart_wait_s() if deadline_s is None else deadline_s
        self.delay, self.end = 0.05, time.monotonic() + wait

    def next_delay(self, error: BaseException) -> float:
        if time.monotonic() > self.end:
            raise ActorRestartingError("a service actor is restarting; retry") from error
        delay, self.delay = self.delay, min(1.0, self.delay * 2)
        return delay


def call(method, *args, deadline_s: float | None = None, **kwargs):
    """`ray.get(method.remote(*args, **kwargs))`, sent again while the actor restarts."""
    backoff = _Backoff(deadline_s)
    while True:
        try:
            return ray.get(method.remote(*args, **kwargs))
        except ray.exceptions.ActorUnavailableError as e:
            time.sleep(backoff.next_delay(e))


async def acall(method, *args, deadline_s: float | None = None, **kwargs):
    """`await method.remote(*args, **kwargs)`, sent again while the actor restarts."""
    backoff = _Backoff(deadline_s)
    while True:
        try:
            return await method.remote(*args, **kwargs)
        except ray.exceptions.ActorUnavailableError as e:
            await asyncio.sleep(backoff.next_delay(e))
