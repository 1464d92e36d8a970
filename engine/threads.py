"""Helper threads that may touch torch run it on one thread.

This module deliberately knows nothing about what the helper threads do; it only keeps them out of
OpenMP.

With the OpenMP build of torch, the first parallel op a thread runs gives that thread an OpenMP team
of its own, and the team lives as long as the thread. Once a live helper thread (the executor's
write-back) has run one parallel copy, every later parallel op of the main thread's team runs
markedly slower in wall time at the same CPU time, for as long as the helper lives, when the cores
are few (docs/benchmarks.md, "Helper threads and torch"). Setting the helper's own thread count to 1
(OpenMP's count is per thread) keeps it out of OpenMP; the main thread keeps its count.
"""

from __future__ import annotations

import sys


def single_threaded_torch() -> None:
    """Call first in a helper thread (e.g. a ThreadPoolExecutor initializer): torch ops in this
    thread run on it alone. Does nothing in a process that has not imported torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
