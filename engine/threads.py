"""Threads and torch: helper threads that may touch torch run it on one thread, and compiled kernels
run their threads on torch's own OpenMP team.

This module deliberately knows nothing about what the helper threads or the kernels do; it only
keeps them out of each other's way.

With the OpenMP build of torch, the first parallel op a thread runs gives that thread an OpenMP team
of its own, and the team lives as long as the thread. Once a live helper thread (the executor's
write-back) has run one parallel copy, every later parallel op of the main thread's team runs
markedly slower in wall time at the same CPU time, for as long as the helper lives, when the cores
are few (docs/benchmarks.md, "Helper threads and torch"). Setting the helper's own thread count to 1
(OpenMP's count is per thread) keeps it out of OpenMP; the main thread keeps its count.
"""

from __future__ import annotations

import sys
from pathlib import Path

from engine import native


def torch_threads(n: int) -> None:
    """Torch ops of the calling thread run on `n` threads from now on. Does nothing in a process that
    has not imported torch.

    Torch's thread count is per thread under OpenMP, and a thread's first op sets it to the process's
    default (the count the last `torch.set_num_threads` gave, in any thread); asking for the count
    first applies that default now, so that it cannot replace `n` later. Only one thread of a process
    should run torch on more than one thread: a second thread's team of two made the first one's
    decode 26% slower on 2 cores, for as long as both threads lived (25.3 against 18.7 tokens/s, its
    team's threads sleeping between ops instead of spinning)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.get_num_threads()
        torch.set_num_threads(n)


def single_threaded_torch() -> None:
    """Call first in a helper thread (e.g. a ThreadPoolExecutor initializer): torch ops in this
    thread run on it alone (`torch_threads(1)`)."""
    torch_threads(1)


def torch_uses_gnu_openmp() -> bool:
    """Whether this torch runs its CPU threads on GNU OpenMP (libgomp), as the Linux pip wheels do."""
    import torch

    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def load_on_torch_team(name: str, source: Path):
    """The C kernel `source` built by engine.native (None: off, or no compiler). Where torch runs on
    GNU OpenMP it is built with -fopenmp, so its threads are torch's own team (the loader maps the
    one libgomp.so.1 already loaded): with threads of its own a kernel shared the cores with torch's
    team, whose threads spin for a while after every torch op, and ran about half as fast
    (docs/benchmarks.md, "Engine speed"). Elsewhere, or when -fopenmp does not build, the kernel
    starts POSIX threads per call."""
    if torch_uses_gnu_openmp():
        return native.load(name, source, native.OPENMP_FLAGS, fallback_flags=native.FAST_FLAGS)
    return native.load(name, source, native.FAST_FLAGS)
