"""Native kernels: C sources shipped beside the modules that use them, compiled at first use with
the machine's C compiler into the cache folder, and loaded with ctypes.

This module deliberately knows nothing about what a kernel computes or its C signatures (callers
declare those), nor about the model: it is a leaf of the engine package that imports only the
standard library (no torch, no other engine module), so storage can use it and a store-only process
stays light. It is the one place that knows how to build and load C. Users: the codec kernels
(storage/kvquant.c, storage.quantize), the chunk-read checksum (storage/crc32.c,
storage.chunkformat) and the engine's attention kernel (engine/attention.c, engine.model).

Why: hot loops such as the quantized codecs' (storage/kvquant.c) are memory-bound single passes that
numpy and torch can only express as several passes over temporaries; in C each is one pass
(docs/benchmarks.md, "Native codec kernels"). Kernels that must match a reference do its arithmetic
operation for operation (no fused multiply-add), so the bytes are the same either way, and every
caller keeps its numpy/torch path: without a compiler, or with ``LLMAAS_NATIVE=0``, nothing changes
but speed.

Build: ``$CC`` (default ``cc``) with ``-O3 -march=native -shared -fPIC`` (and ``-ffp-contract=off`` for
kernels that must match a reference bit for bit), into
``$LLMAAS_CACHE_DIR/kernels`` (default ``~/.cache/llmaas/kernels``), under a name that hashes the
source, the flags, the compiler and this CPU (``-march=native`` code must not run on
another CPU that shares the cache folder). The library is written under a temporary name and renamed,
so processes that start at once each compile and the last rename wins, never a torn file. A failed
build warns once per process and leaves the fallback in place. ctypes releases the GIL around every
call, so callers may run kernels on several threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

ENV_SWITCH = "LLMAAS_NATIVE"  # "0" turns the native kernels off (the numpy/torch paths run instead)
#: kernels that must reproduce a reference's arithmetic: no fused multiply-add
EXACT_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c11", "-shared", "-fPIC")
#: kernels judged by tolerance (attention): fused multiply-add allowed, threads
FAST_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-std=c11", "-pthread", "-shared", "-fPIC")
#: FAST_FLAGS with OpenMP: the library's threads come from the process's OpenMP runtime (for a torch
#: built with GNU OpenMP, the already loaded libgomp.so.1 and its thread team)
OPENMP_FLAGS = FAST_FLAGS + ("-fopenmp",)
BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    """Whether native kernels may be used in this process (``LLMAAS_NATIVE`` is not "0")."""
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def kernel_dir() -> Path:
    """Where compiled kernels are cached: ``$LLMAAS_CACHE_DIR/kernels`` or ``~/.cache/llmaas/kernels``
    (the model cache's root, as engine.loader.cache_root, not imported so this module stays a leaf)."""
    env = os.environ.get("LLMAAS_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "llmaas") / "kernels"


@functools.cache
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """This CPU's model name and feature flags, read once from /proc/cpuinfo (`flags` on x86, `Features`
    on arm64); the platform's name and no flags where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 16).splitlines()
    except OSError:
        return platform.processor() or platform.machine(), frozenset()

    def field(*names: str) -> str:
        return next((ln.split(":", 1)[1] for ln in lines if ln.split(":")[0].strip() in names), "")

    return field("model name").strip() or platform.machine(), frozenset(field("flags", "Features").split())


def _cpu_identity() -> str:
    """The CPU model and its feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines()[:64]
            if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part", "CPU implementer")]
    return platform.machine() + "\n" + "\n".join(dict.fromkeys(keep))


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc)


def library_path(name: str, source: Path, cc: str, flags: tuple[str, ...] = EXACT_FLAGS) -> Path:
    """The cached library for this source, compiler, flags and CPU. The compiler is identified by its
    real path, size and modification time (no process is started to ask its version)."""
    real = os.path.realpath(cc)
    st = os.stat(real)
    compiler = f"{real}:{st.st_size}:{st.st_mtime_ns}"
    h = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), compiler.encode(), _cpu_identity().encode()):
        h.update(part)
        h.update(b"\0")
    return kernel_dir() / f"{name}-{h.hexdigest()[:16]}.so"


def build(name: str, source: Path, cc: str, flags: tuple[str, ...] = EXACT_FLAGS) -> Path:
    """Compile ``source`` (if not cached) and return the library's path; raises on failure."""
    target = library_path(name, source, cc, flags)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(name: str, source: Path, flags: tuple[str, ...] = EXACT_FLAGS,
         fallback_flags: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """The compiled library ``name`` built from the C file ``source``, or None when native kernels
    are off or cannot be built here (a warning says why, once per process). Built on first use; one
    library per name in a process.
    When the build with ``flags`` fails and ``fallback_flags`` is given, that build is tried quietly
    (e.g. without ``-fopenmp`` where the compiler has no OpenMP runtime)."""
    if not enabled():
        return None
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        cc = _compiler()
        try:
            if cc is None:
                raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')!r} not on PATH)")
            try:
                lib = ctypes.CDLL(str(build(name, source, cc, flags)))
            except Exception:
                if fallback_flags is None:
                    raise
                lib = ctypes.CDLL(str(build(name, source, cc, fallback_flags)))
        except Exception as e:  # any failure leaves the numpy/torch paths in place
            warnings.warn(f"llmaas: native kernels {name!r} unavailable, using the slower numpy/torch path "
                          f"({e}); set {ENV_SWITCH}=0 to skip the build", RuntimeWarning, stacklevel=2)
            lib = None
        _loaded[name] = lib
        return lib
