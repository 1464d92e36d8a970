"""Live tensor bytes of a forward pass, step by step: what the prefill memory estimate
(scheduler/prefill.py) is checked against.

This module deliberately knows nothing about budgets or plans: it counts.

`TensorTracker` is a `TorchDispatchMode`: every tensor an operation returns while it is active, in a
storage none of its inputs has (not a view, not written in place), has its storage counted once,
until the storage is freed (a finalizer on the storage's Python object, which
torch keeps while the storage lives). So the count is the bytes of tensors made under the tracker
and still alive, exact at the granularity of operations, not RSS (which at these sizes is allocator
noise). Storages made before it (weights, the working set) are not counted; `ignore` names any that
an operation might return as new. Memory a compiled kernel
allocates with `malloc` is not seen (the estimate counts it from the kernel's sizes).

`mark(name)` closes a step: it records the highest count since the previous mark and the count now
(`Transformer.step_hook` calls it after each step of a block: `qkv`, `attention`, `mlp`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True, slots=True)
class TrackedStep:
    name: str
    """The step's name as marked."""
    layer: int
    """The block it belongs to (-1 outside blocks)."""
    peak: int
    """Most bytes alive at once since the previous mark."""
    retained: int
    """Bytes alive at the mark."""


class TensorTracker(TorchDispatchMode):
    def __init__(self, ignore=()) -> None:
        super().__init__()
        self.live = 0
        """Bytes of counted storages alive now."""
        self.peak = 0
        """Most bytes alive since the last mark."""
        self.steps: list[TrackedStep] = []
        self._counted: set[int] = set()
        self._ignored = {id(t.untyped_storage()) for t in ignore}
        self._keep = [t.untyped_storage() for t in ignore]  # ids stay theirs while held

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:  # new, not a view or in place
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._counted or key in self._ignored:
            return
        n = st.nbytes()
        if n == 0:
            return
        self._counted.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._freed, key, n)

    def _freed(self, key: int, n: int) -> None:
        self._counted.discard(key)
        self.live -= n

    def mark(self, name: str, layer: int = -1) -> None:
        self.steps.append(TrackedStep(name, layer, self.peak, self.live))
        self.peak = self.live
