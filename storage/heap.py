"""Keep freed heap memory for reuse instead of handing it back to the kernel (glibc `mallopt`).

This module deliberately knows nothing about chunks, codecs or files: it sets a process-wide
allocator knob, and the caller decides when.

Why: every fresh page a process touches costs a page fault. glibc serves allocations above its mmap
threshold (128 KiB, raised dynamically up to 32 MiB) with fresh mappings and trims the heap's free
top beyond its trim threshold, so a process that allocates and frees MB-sized buffers again and
again (chunk payloads, codec outputs, file read buffers) faults them in every time
(`python -m bench.storage_speed --no-heap-retain` shows the difference; docs/benchmarks.md, "Heap
retention").

The price is resident memory: up to `trim_mib` of freed memory at the heap's top stays with the process
(freed blocks inside the heap are reused either way). The service's actors do not call it: their
switches bought nothing measurable with it (docs/benchmarks.md, "Tuning at the edge"); it stays for
`bench.storage_speed`, which measures the storage layer with and without it.
`LLMAAS_HEAP_RETAIN_MIB=0` turns it off, another value sets the retained amount. Plain Python, no torch; a no-op where `mallopt` does not exist (musl, macOS).
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
