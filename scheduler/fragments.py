"""Which weight fragments stay resident and which are streamed per block (HyperGen §3.1, size-aware
parameter partitioning).

This module deliberately knows nothing about tensors, files or the model's code: it is a decision over
names and sizes; the engine measures the fragments and pages them (engine/weightpager.py).

A *fragment* is one array of the model's weights used by one stage of a forward pass: each weight
matrix, scale, norm and bias of each transformer block (stage ``i`` for block ``i``), and the final
norm and LM head (the last stage, ``n_layers``). HyperGen sorts all fragments in ascending order of
size and keeps the smallest in fast memory until an allocation limit is reached ("smallest first":
the norms and biases of every block cost little and would otherwise be read once per block per
pass); the others are *streamed*: brought in before their stage runs, the next stage's read ahead
while the current one computes, and released after it. :func:`plan_fragments` makes that split.

What streaming costs in memory beyond the resident fragments is its *window*: the streamed bytes of
the stage that runs plus those of the stage read ahead (without read ahead, of the one that runs). A forward pass runs the stages in order and
the next pass starts again at block 0, so the stage after the last is the first (a decode loop
wraps around); the window is the largest sum over two consecutive stages, cyclically.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Fragment:
    name: str
    """The array's name in the engine's layout (`layers.3.wqkv`, `layers.3.wqkv.scale`, `lm_head`)."""
    stage: int
    """The stage that uses it: block index, or the number of blocks for the final norm and LM head."""
    nbytes: int
    """Its size as stored (what being resident costs)."""


@dataclass(frozen=True, slots=True)
class FragmentPlan:
    resident: tuple[str, ...]
    """Fragments kept in memory for the process's life, smallest first."""
    streamed: tuple[tuple[str, ...], ...]
    """Per stage, the fragments brought in before it runs and released after it."""
    resident_bytes: int
    """Bytes of the resident fragments (at most the limit)."""
    streamed_bytes: int
    """Bytes of all streamed fragments: what one forward pass reads in."""
    window_bytes: int
    """Most streamed bytes mapped at once: the largest two consecutive stages (cyclically)."""

    @property
    def peak_bytes(self) -> int:
        """The weights' memory at most: resident plus the streaming window."""
        return self.resident_bytes + self.window_bytes

    def describe(self) -> str:
        """One line for a log: what stays, what streams, and the most the weights take."""
        mib = 1 << 20
        return (f"{self.resident_bytes / mib:.1f} MiB of weights resident ({len(self.resident)} smallest "
                f"fragments), {self.streamed_bytes / mib:.1f} MiB streamed per forward pass, at most "
                f"{self.peak_bytes / mib:.1f} MiB in memory")


def plan_fragments(fragments: list[Fragment], resident_limit: int, stages: int, *,
                   read_ahead: bool = True) -> FragmentPlan:
    """Keep fragments resident smallest first (ties by name, so the plan is reproducible) while their sum
    stays within `resident_limit` bytes; stream the rest, grouped by their stage (`stages` of them).
    Without `read_ahead` a stage is brought in only when it runs, so the window is one stage."""
    if resident_limit < 0:
        raise ValueError("resident_limit must be >= 0")
    if stages < 1:
        raise ValueError("stages must be >= 1")
    for f in fragments:
        if not 0 <= f.stage < stages:
            raise ValueError(f"fragment {f.name} of stage {f.stage} outside 0..{stages - 1}")
        if f.nbytes < 0:
            raise ValueError(f"fragment {f.name} has a negative size")
    resident: list[str] = []
    used = 0
    order = sorted(fragments, key=lambda f: (f.nbytes, f.name))
    cut = len(order)
    for i, f in enumerate(order):
        if used + f.nbytes > resident_limit:  # every later fragment is at least as large
            cut = i
            break
        resident.append(f.name)
        used += f.nbytes
    per_stage: list[list[str]] = [[] for _ in range(stages)]
    stage_bytes = [0] * stages
    for f in order[cut:]:
        per_stage[f.stage].append(f.name)
        stage_bytes[f.stage] += f.nbytes
    ahead = read_ahead and stages > 1
    window = max(stage_bytes[i] + (stage_bytes[(i + 1) % stages] if ahead else 0) for i in range(stages))
    return FragmentPlan(
        resident=tuple(resident),
        streamed=tuple(tuple(sorted(names)) for names in per_stage),
        resident_bytes=used,
        streamed_bytes=sum(stage_bytes),
        window_bytes=window,
    )


__all__ = ["Fragment", "FragmentPlan", "plan_fragments"]
