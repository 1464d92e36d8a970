"""The model executor's lock with two priorities: real calls, and the query predictor's idle work.

Real calls take the lock in the order they come (`real`). Low-priority work (`background`) takes it
only when no real call waits, and asks `should_yield` at each layer of a prefill and each token of a
reply: once a real call waits, it stops there and lets go, so a real call waits for at most one such
slice. The lock also keeps when the last real call ran (`last_call`), which is what the predictor's
idleness is measured from.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from actors.messages import PreemptedError


class PriorityLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()  # guards the fields below
        self._waiting = 0
        self.in_flight = 0
        """Real calls running or waiting for the lock."""
        self.last_call = 0.0
        """`time.time()` when the last real call began or ended (0: none yet)."""

    @contextlib.contextmanager
    def real(self) -> Iterator[None]:
        """The lock for a real call; low-priority work holding it lets go at its next slice."""
        with self._count:
            self._waiting += 1
            self.in_flight += 1
            self.last_call = time.time()
        waiting = True
        try:
            with self._lock:
                with self._count:
                    self._waiting -= 1
                    waiting = False
                yield
        finally:
            with self._count:
                self._waiting -= waiting
                self.in_flight -= 1
                self.last_call = time.time()

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """The lock for low-priority work: `PreemptedError` at once when a real call waits."""
        with self._lock:
            if self.should_yield():
                raise PreemptedError("a real call is waiting")
            yield

    def should_yield(self) -> bool:
        """Whether low-priority work must let go now: a real call is waiting for the lock."""
        return self._waiting > 0
