"""A token-bucket byte-rate limiter, used to emulate slow eMMC/SD-class storage on a fast disk.

The clock and the sleep function are passed in, so a test can drive time exactly and a benchmark
can use the real ones. This module deliberately knows nothing about files: callers ask for a number
of bytes before moving them and are delayed so that, over any long run, bytes / elapsed <= rate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class TokenBucket:
    """Allow ``rate`` bytes/s on average with bursts of at most ``burst`` bytes.

    Invariant: ``tokens <= burst``. A request larger than the tokens available drives ``tokens``
    negative and sleeps until the debt is repaid, so big reads are paced as well as small ones.
    Thread-safe: concurrent callers share one budget.
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float],
                 sleep: Callable[[float], None]):
        if rate <= 0 or burst < 0:
            raise ValueError(f"rate must be > 0 bytes/s and burst >= 0 bytes, got {rate}, {burst}")
        self.rate = float(rate)  # bytes per second
        self.burst = float(burst)  # bytes
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)  # bytes available now; negative means debt
        self._last = clock()  # clock reading (seconds) when _tokens was computed
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> float:
        """Take ``nbytes`` from the bucket, sleeping as needed; returns the seconds slept."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait
