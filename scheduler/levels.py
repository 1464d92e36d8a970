"""Compression levels as the scheduler sees them: names, nominal bits, and which is heavier.

This module deliberately knows nothing about how a level is encoded or which level a chunk should get.

The scheduler needs three facts about a level, never its bytes on the wire:

* its **nominal bits** per value (``raw`` is the compute dtype's width), which give the LLMS
  compression **ratio** relative to 8-bit: ``ratio = bits / 8`` (q8 1.0, q4 0.5, q2 0.25);
* its **weight rank** (heaviest first: ``raw`` > ``fp16`` = ``bf16`` > ``q8`` > ``q4`` > ``q2``), which
  orders LCTRU eviction and says which way is "down" (a level only ever goes down; the way back up
  is recompute);
* whether a name is valid at all.

The table is a deliberate local copy of what ``storage.codecs`` knows (``nominal_bits``), so that
planners import nothing from the storage layer; ``tests/scheduler/test_levels.py`` asserts that the
two agree for every level and compute dtype. Stored byte sizes (with scales and zero points) come
from the caller, which has them from the chunk files.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.errors import UnknownLevelError

#: nominal bits per value of the fixed-width levels (``raw`` depends on the compute dtype)
_FIXED_BITS: dict[str, int] = {"fp16": 16, "bf16": 16, "q8": 8, "q4": 4, "q2": 2}
#: nominal bits of ``raw`` per compute dtype name (bfloat16 travels as uint16 bits; ``kv8`` is a
#: quantized working set's own rows: int8 keys, fp8 values, a scale per token and head)
RAW_BITS: dict[str, int] = {"float32": 32, "float16": 16, "bfloat16": 16, "kv8": 8}
#: weight rank per level: higher is heavier (more stored bytes per chunk), evicted first by LCTRU
RANK: dict[str, int] = {"raw": 5, "fp16": 4, "bf16": 4, "q8": 3, "q4": 2, "q2": 1}
#: every level name, heaviest first
LEVELS: tuple[str, ...] = tuple(sorted(RANK, key=lambda name: -RANK[name]))
#: the LLMS levels (ratios 8/8, 4/8, 2/8), heaviest first
DEFAULT_PLAN_LEVELS: tuple[str, ...] = ("q8", "q4", "q2")
#: measured fidelity of each level: 1 - the relative RMS error of its codec on real K/V of the
#: default model (SmolLM2-135M, 2048 tokens of standard-library text, float32; `python -m
#: bench.storage_speed`; docs/benchmarks.md, "Storage"). The compression planner weighs density by
#: it. q4 keeps 96% and q2 82%: halving the bits from q4 costs four times what halving them from q8
#: does, which a weight linear in the bits (the ratio) cannot express.
FIDELITY: dict[str, float] = {"raw": 1.0, "fp16": 1 - 2.0e-4, "bf16": 1 - 1.6e-3, "q8": 1 - 2.2e-3,
                              "q4": 1 - 3.6e-2, "q2": 1 - 1.8e-1}


def check_level(level: str) -> str:
    """``level`` itself if it names a level; :class:`UnknownLevelError` listing the names otherwise."""
    if level not in RANK:
        raise UnknownLevelError("level", level, LEVELS)
    return level


def rank(level: str) -> int:
    """Weight rank of ``level`` (higher = heavier)."""
    try:
        return RANK[level]
    except (KeyError, TypeError):
        raise UnknownLevelError("level", level, LEVELS) from None


def nominal_bits(level: str, dtype: str = "float32") -> int:
    """Nominal bits per value of ``level`` when the compute dtype is ``dtype``."""
    check_level(level)
    if level == "raw":
        try:
            return RAW_BITS[dtype]
        except KeyError:
            raise ValueError(f"unknown compute dtype {dtype!r}; valid: "
                             f"{', '.join(sorted(RAW_BITS))}") from None
    return _FIXED_BITS[level]


def ratio(level: str, dtype: str = "float32") -> float:
    """LLMS compression ratio of ``level``: nominal bits relative to 8-bit (q4 -> 0.5)."""
    return nominal_bits(level, dtype) / 8.0


def fidelity(level: str) -> float:
    """Measured fidelity of ``level`` (see :data:`FIDELITY`): 1 for lossless, lower when lossier."""
    check_level(level)
    return FIDELITY[level]


def lighter(a: str, b: str) -> str:
    """The lighter (more compressed) of two levels; ``a`` on equal rank.

    Used for "never rises": a chunk targeted at ``a`` but already at ``b`` ends at ``lighter(a, b)``.
    """
    return a if rank(a) <= rank(b) else b


def check_plan_levels(levels: Iterable[str]) -> tuple[str, ...]:
    """Validate a planner's level list: non-empty, known names, strictly heaviest first."""
    out = tuple(levels)
    if not out:
        raise ValueError("at least one compression level is needed")
    ranks = [rank(lv) for lv in out]
    if any(r1 <= r2 for r1, r2 in zip(ranks, ranks[1:])):
        raise ValueError(f"levels must be strictly heaviest first (distinct ranks), got {out}")
    return out
