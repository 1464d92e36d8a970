"""Weights larger than their memory limit: small fragments resident, large ones streamed per block from
the memory-mapped weight file, the next block's read ahead while the current one computes (HyperGen
§3.1; the split is `scheduler/fragments.py:plan_fragments`).

This module deliberately knows nothing about the model's arithmetic, contexts or processes: it maps
the stages of a forward pass to address ranges of mapped arrays and moves those ranges in and out of
this process's memory.

The engine's weights are read-only views of a file mapped shared (engine/loader.py:read_safetensors,
engine/weightcache.py), so a page of them is in one of three states: in this process's memory
(what a budget counts), in the page cache only, or on disk only. Streaming therefore never copies a
weight and cannot change a result: `WeightPager.use` is called as each stage starts, releases the
stages that are neither running nor next (madvise DONTNEED: out of this process; a later touch faults
them back in from the page cache or the disk) and asks a background thread to bring the next stage in
(madvise POPULATE_READ: its pages read and mapped while this stage computes). Without read ahead a
stage is brought in the same way when it starts, in line (one call for its pages rather than a fault
per page as the compute touches them). A resident fragment is
brought in once at start and never released. `drop_cache` also drops a released stage's pages from
the page cache (posix_fadvise DONTNEED), so the next pass reads them from the disk: the cold reads a
machine with little memory would see, for measuring.

A weight that the engine copied at load (a dtype conversion, `EngineConfig.copy_weights`, a device
other than the CPU) is not a view of the file, so it cannot be streamed: `WeightPager.of_model`
refuses such a configuration with a clear error rather than count memory it does not control.
"""

from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from engine.kvspill import MADV_DONTNEED, MADV_POPULATE_READ, advise, mapped_rss
from scheduler.fragments import Fragment, FragmentPlan, plan_fragments


@dataclass(frozen=True, slots=True)
class Span:
    """One mapped array: its address range in this process and its place in its file."""

    address: int
    nbytes: int
    path: str
    offset: int
    """Byte offset of the array in `path`."""


def array_span(a: np.ndarray) -> Span | None:
    """Where a memory-mapped array lives (None when it is not a view of an `np.memmap`)."""
    root = a
    while root is not None and not isinstance(root, np.memmap):
        root = root.base if isinstance(root.base, np.ndarray) else None
    while isinstance(root, np.memmap) and isinstance(root.base, np.memmap):  # a slice of a memmap is one too
        root = root.base
    if not isinstance(root, np.memmap) or root.filename is None:
        return None
    return Span(a.ctypes.data, a.nbytes, root.filename, root.offset + a.ctypes.data - root.ctypes.data)


def stage_fragments(arrays: dict[str, np.ndarray], n_layers: int) -> list[Fragment]:
    """The fragments of a model's engine-layout arrays: every array of block `i` is used by stage `i`;
    the final norm and the LM head by stage `n_layers`. A separate embedding table is read a few rows
    per token (it stays on flash, as MNN-LLM §4.1 has it) and is no fragment; a tied model's table is
    its LM head."""
    tied = not any(k == "lm_head" or k.startswith("lm_head.") for k in arrays)
    out = []
    for name, a in arrays.items():
        if name.startswith("layers."):
            stage = int(name.split(".", 2)[1])
        elif name == "norm" or name.startswith("lm_head") or (name == "embed" and tied):
            stage = n_layers
        else:
            continue
        out.append(Fragment(name, stage, int(a.nbytes)))
    return out


def _held_tensors(obj, seen: set[int]):
    """Every tensor reachable from the engine's weight objects (engine.model.Weights, its layers, the
    engine's Linear and Embedding classes, lists of them); nothing else is looked into."""
    if id(obj) in seen or obj is None:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _held_tensors(x, seen)
        return
    if not type(obj).__module__.startswith("engine."):
        return
    names = set()
    for cls in type(obj).__mro__:
        names.update(getattr(cls, "__slots__", ()))
    names.update(getattr(obj, "__dict__", {}))
    for name in names:
        yield from _held_tensors(getattr(obj, name, None), seen)


class WeightPager:
    """Pages a model's streamed fragments in and out around the stages of its forward passes."""

    def __init__(self, plan: FragmentPlan, spans: dict[str, Span], *, prefetch: bool = True,
                 drop_cache: bool = False) -> None:
        self.plan = plan
        self.prefetch = prefetch
        """Read the next stage ahead on a background thread (False: each stage is read in line as it starts)."""
        self.drop_cache = drop_cache
        """Also drop released stages from the page cache (cold reads; for measuring)."""
        self.stages = len(plan.streamed)
        self._streamed = [[spans[n] for n in names] for names in plan.streamed]
        self._resident = [spans[n] for n in plan.resident]
        self._addresses = sorted(s.address for s in spans.values())
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._mapped: set[int] = set()  # streamed stages brought in and not released
        self._pending: dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-read-ahead") if prefetch else None
        self.current: int | None = None
        self.events: collections.deque = collections.deque(maxlen=4096)
        """("use" | "read" | "release", stage) in the order they happened (the read as it begins)."""
        self.bytes_read = 0
        """Streamed bytes brought in so far (read ahead, or in line at `use`)."""
        for sp in self._resident:
            advise(sp.address, sp.nbytes, MADV_POPULATE_READ, inner=False)

    @classmethod
    def of_model(cls, arrays: dict[str, np.ndarray], weights, n_layers: int, resident_limit: int, *,
                 prefetch: bool = True, drop_cache: bool = False) -> "WeightPager":
        """The pager of a model loaded from `arrays` into `weights` (engine.model.Weights), keeping at
        most `resident_limit` bytes of fragments resident. ValueError when a streamed fragment is not
        used in place from its mapped file."""
        frags = stage_fragments(arrays, n_layers)
        plan = plan_fragments(frags, resident_limit, n_layers + 1, read_ahead=prefetch)
        held = {t.data_ptr() for t in _held_tensors(weights, set()) if t.device.type == "cpu"}
        spans = {}
        for f in frags:
            span = array_span(arrays[f.name])
            streamed = f.name not in plan.resident
            if streamed and (span is None or span.address not in held):
                raise ValueError(
                    f"weight {f.name} is not used in place from its mapped file, so it cannot be streamed: "
                    "streaming needs the weights as stored (float32 weights under float32 compute, or "
                    "int4/int8 weights with copy_weights off) on the CPU")
            if span is not None:
                spans[f.name] = span
        resident = tuple(n for n in plan.resident if n in spans)
        plan = FragmentPlan(resident, plan.streamed, plan.resident_bytes, plan.streamed_bytes, plan.window_bytes)
        return cls(plan, spans, prefetch=prefetch, drop_cache=drop_cache)

    # ---- the stages of a pass ----------------------------------------------------------------------
    def use(self, stage: int) -> None:
        """Stage `stage` is about to run: release the streamed stages that are neither it nor the next,
        make sure its own read (if one was started ahead) is done, and start reading the next one."""
        with self._lock:
            if stage == self.current:
                return
            self.current = stage
            nxt = (stage + 1) % self.stages
            for s in sorted(self._mapped - {stage, nxt}):
                self._release(s)
            fut = self._pending.pop(stage, None)
            self.events.append(("use", stage))
            in_line = stage not in self._mapped
            if in_line:
                self._mapped.add(stage)
                self.bytes_read += self._stage_bytes(stage)
            if self.prefetch and nxt != stage and nxt not in self._mapped and self._streamed[nxt]:
                self._mapped.add(nxt)
                self.bytes_read += self._stage_bytes(nxt)
                self._pending[nxt] = self._pool.submit(self.read, nxt)
            if fut is not None:
                fut.result()
            elif in_line:
                self.read(stage)

    def read(self, stage: int) -> None:
        """Bring a stage's streamed fragments into this process's memory (what the read ahead runs)."""
        self.events.append(("read", stage))
        for sp in self._streamed[stage]:
            advise(sp.address, sp.nbytes, MADV_POPULATE_READ, inner=False)

    def _release(self, stage: int) -> None:
        fut = self._pending.pop(stage, None)
        if fut is not None:  # not released under a read still bringing it in
            fut.result()
        self._mapped.discard(stage)
        self.events.append(("release", stage))
        for sp in self._streamed[stage]:
            advise(sp.address, sp.nbytes, MADV_DONTNEED, inner=True)
            if self.drop_cache:
                fd = self._fds.get(sp.path)
                if fd is None:
                    fd = self._fds[sp.path] = os.open(sp.path, os.O_RDONLY)
                os.posix_fadvise(fd, sp.offset, sp.nbytes, os.POSIX_FADV_DONTNEED)

    def release_all(self) -> None:
        """Take every streamed stage out of memory (the next pass reads each again)."""
        with self._lock:
            for s in sorted(self._mapped):
                self._release(s)
            self.current = None

    # ---- measuring -----------------------------------------------------------------------------------
    def mapped_bytes(self) -> int:
        """Bytes of the weights' mappings in this process's memory now (`Rss` of the mappings that hold
        them, from /proc/self/smaps)."""
        addrs = self._addresses

        def holds(lo: int, hi: int, _path: str) -> bool:
            i = int(np.searchsorted(addrs, lo))
            return i < len(addrs) and addrs[i] < hi

        return mapped_rss(holds)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _stage_bytes(self, stage: int) -> int:
        return sum(sp.nbytes for sp in self._streamed[stage])


__all__ = ["Span", "WeightPager", "array_span", "stage_fragments"]
