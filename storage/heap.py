"""Keep freed heap memory for reuse instead of handing it back to the kernel (glibc `mallopt`).

Why: on the machines measured here (a firecracker VM), a page fault costs ~1.4 us, so every fresh
megabyte a process touches costs ~0.35 ms. glibc serves allocations above its mmap threshold (128 KiB,
raised dynamically up to 32 MiB) with fresh mappings and trims the heap's free top beyond its trim
threshold, so a process that allocates and frees MB-sized buffers again and again (chunk payloads,
codec outputs, file read buffers) faults them in every time. Encoding a whole 2048-token context
(128 chunks) on one thread, `python -m bench.storage_speed` against `--no-heap-retain`, 2026-11-22,
two runs each: raw 43-45 -> 15 ms, bf16 33-34 -> 21, q8 42-43 -> 35-36, q4 45-47 -> 40, fp16 and q2
unchanged; on Ray, switching ~5% faster (docs/benchmarks.md, "Heap retention").

The price is resident memory: up to `trim_mib` of freed memory at the heap's top stays with the process
(freed blocks inside the heap are reused either way). The service's actor processes call
`retain_freed_memory()` at start; `LLMAAS_HEAP_RETAIN_MIB=0` turns it off, another value sets the
retained amount. Plain Python, no torch; a no-op where `mallopt` does not exist (musl, macOS).
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
DEFAULT_RETAIN_MIB = 128
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit


def retain_freed_memory(trim_mib: int | None = None) -> bool:
    """Serve allocations up to 32 MiB from the heap and keep up to `trim_mib` MiB of freed memory at
    its top (default: `LLMAAS_HEAP_RETAIN_MIB`, else 128). Returns whether the settings took effect."""
    if trim_mib is None:
        raw = os.environ.get("LLMAAS_HEAP_RETAIN_MIB", "")
        try:
            trim_mib = int(raw) if raw else DEFAULT_RETAIN_MIB
        except ValueError:
            raise ValueError(f"LLMAAS_HEAP_RETAIN_MIB must be a whole number of MiB, not {raw!r}") from None
    if trim_mib <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    trim = min(trim_mib, 1 << 10) << 20
    return mallopt(M_MMAP_THRESHOLD, min(MMAP_THRESHOLD_MAX, trim)) == 1 and mallopt(M_TRIM_THRESHOLD, trim) == 1


def freeze_startup_objects() -> int:
    """Collect garbage once and move every object alive now out of the cyclic collector's sight
    (`gc.freeze`); returns how many were frozen. Call it at the end of a long-lived process's start.

    Why: a process holding torch, Ray and a model tracks ~320 thousand objects, and a full (oldest
    generation) collection walks them all: 120 ms on the 2-core test VM, a pause that lands inside
    whichever call is running when the collector decides to run one (the actors' start-up alone
    triggered three, of 80-119 ms). Frozen, they are never walked again (a full collection then took
    under 0.01 ms); objects made later are collected as usual. docs/benchmarks.md, "Context
    switching", session 19."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
