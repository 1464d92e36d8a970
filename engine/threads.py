"""Helper threads that may touch torch run it on one thread.

With the OpenMP build of torch, the first parallel op a thread runs gives that thread an OpenMP team
of its own, and the team lives as long as the thread. Measured on this 2-core machine: once a live
helper thread (the executor's write-back) had run one parallel copy, every later parallel op of the
main thread's team ran 30-45% slower in wall time at the same CPU time, for as long as the helper
lived (recompute 5.7 -> 7.9 ms a layer; docs/benchmarks.md, "Helper threads and torch"). Setting the
helper's own thread count to 1 (OpenMP's count is per thread) keeps it out of OpenMP; the main
thread keeps its count.
"""

from __future__ import annotations

import sys


def single_threaded_torch() -> None:
    """Call first in a helper thread (e.g. a ThreadPoolExecutor initializer): torch ops in this
    thread run on it alone. Does nothing in a process that has not imported torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
