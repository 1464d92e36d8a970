"""Baselines and ablations as configurations of one system (docs/design.md §5, LLMS §4 and §5.3).

This module deliberately knows nothing about how the switches are carried out: no queues, files or
actors here, only names and values.

A :class:`PolicySet` is a handful of switches; the memory governor and the workers read them and
call the matching planners (``scheduler.compression``, ``scheduler.eviction``,
``scheduler.pipeline``). Every benchmark runs the same trace under each name of :data:`POLICIES`:

====================  =========================================================================
name                  behaviour
====================  =========================================================================
``lmk``               under pressure kill whole contexts, LRU; a killed context is recomputed
                      from its token ids when called
``swap``              swap whole contexts to disk, lossless, on demand; read back whole
``vllm-s``            16-token chunks swapped lossless, chunk LRU, swap-out on demand
``vllm-sq``           as ``vllm-s``, every chunk q8 (the paper's SmoothQuant INT8)
``llms``              raw while the pool holds it, then tolerance-aware q8/q4/q2 down to the
                      global ratio; LCTRU, ahead-of-time swap-out, IO + recompute pipeline
``llms-no-compress``  ``llms`` with every chunk q8 (compression off = the 8-bit default LLMS
                      starts from, §4: KV is stored INT8 by default)
``llms-no-lctru``     ``llms`` with chunk LRU eviction
``llms-no-aot``       ``llms`` swapping out on demand, at eviction time
``llms-no-pipeline``  ``llms`` loading every chunk that has a file, recomputing none by choice
====================  =========================================================================

Whatever the policy, a chunk with no usable file (killed, never written, corrupt) is recomputed:
``recompute=False`` only forbids *choosing* recompute to shorten a restore.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler import levels as L
from scheduler.compression import MODES, CompressionConfig
from scheduler.errors import UnknownCompressionModeError, UnknownPolicyError
from scheduler.eviction import EvictionStrategy, get_strategy

#: eviction units, and what happens to an evicted unit
GRANULARITIES = ("context", "chunk")
ON_PRESSURE = ("kill", "swap")


@dataclass(frozen=True, slots=True)
class PolicySet:
    """The switches that make one baseline or ablation."""

    name: str
    """registry name (a key of :data:`POLICIES` for the built-in ones)"""
    description: str
    """one line for reports and ``--help``"""
    granularity: str
    """``context``: a context is evicted and restored whole; ``chunk``: chunk by chunk"""
    on_pressure: str
    """``kill``: evicted KV is dropped (recomputed when needed); ``swap``: it is kept on disk"""
    compression: str
    """a compression mode: ``none`` (lossless), ``static`` (one level), ``tolerance`` (LLMS)"""
    eviction: str
    """an eviction strategy name (``scheduler.eviction.STRATEGIES``)"""
    aot_swap_out: bool
    """write modified chunks to disk after each call, before any pressure (LLMS §3.4 i); else on
    demand when they are evicted"""
    recompute: bool
    """the restore planner may recompute chunks that have a file, in parallel with IO (Eq. 4)"""
    static_level: str = "raw"
    """``static`` compression: every chunk's level"""
    global_ratio: float = 0.5
    """``tolerance`` compression: bound on the mean ratio (nominal bits / 8)"""
    levels: tuple[str, ...] = L.DEFAULT_PLAN_LEVELS
    """``tolerance`` compression: the levels, heaviest first"""

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.on_pressure not in ON_PRESSURE:
            raise ValueError(f"on_pressure must be one of {ON_PRESSURE}, got {self.on_pressure!r}")
        if self.compression not in MODES:
            raise UnknownCompressionModeError("compression mode", self.compression, MODES)
        strategy = get_strategy(self.eviction)
        if strategy.granularity != self.granularity:
            raise ValueError(f"policy {self.name!r}: eviction {self.eviction!r} works on "
                             f"{strategy.granularity}s but granularity is {self.granularity!r}")
        if self.on_pressure == "kill" and (self.aot_swap_out or self.compression != "none"):
            raise ValueError(f"policy {self.name!r}: killed contexts are never written or "
                             "compressed; use aot_swap_out=False and compression='none'")
        self.compression_config()  # validates levels, static_level and global_ratio

    def compression_config(self, dtype: str = "float32") -> CompressionConfig:
        """The compression planner's configuration under this policy, for compute dtype ``dtype``. The
        tolerance levels are those lighter than ``raw`` in that dtype (a ``kv8`` working set's chunks
        are already 8-bit: q4 and q2 remain)."""
        raw = L.nominal_bits("raw", dtype)
        levels = tuple(lv for lv in self.levels if L.nominal_bits(lv, dtype) < raw)
        return CompressionConfig(mode=self.compression, global_ratio=self.global_ratio,
                                 levels=levels, static_level=self.static_level, dtype=dtype)

    def eviction_strategy(self) -> EvictionStrategy:
        """A new eviction strategy object for this policy's queue."""
        return get_strategy(self.eviction)

    def with_changes(self, **changes) -> PolicySet:
        """A validated copy with some switches changed (for a custom ablation)."""
        return replace(self, **changes)


_LLMS = PolicySet(
    name="llms", description="tolerance-aware q8/q4/q2, LCTRU, ahead-of-time swap-out, IO+recompute",
    granularity="chunk", on_pressure="swap", compression="tolerance", eviction="lctru",
    aot_swap_out=True, recompute=True)

#: policy name -> switches; ``get_policy`` is the lookup
POLICIES: dict[str, PolicySet] = {p.name: p for p in (
    PolicySet(name="lmk", description="kill whole contexts LRU under pressure; recompute when called",
              granularity="context", on_pressure="kill", compression="none", eviction="context-lru",
              aot_swap_out=False, recompute=False),
    PolicySet(name="swap", description="swap whole contexts to disk losslessly; read back whole",
              granularity="context", on_pressure="swap", compression="none", eviction="context-lru",
              aot_swap_out=False, recompute=False),
    PolicySet(name="vllm-s", description="16-token chunks swapped lossless on demand, chunk LRU",
              granularity="chunk", on_pressure="swap", compression="none", eviction="lru",
              aot_swap_out=False, recompute=False),
    PolicySet(name="vllm-sq", description="as vllm-s with every chunk q8",
              granularity="chunk", on_pressure="swap", compression="static", static_level="q8",
              eviction="lru", aot_swap_out=False, recompute=False),
    _LLMS,
    replace(_LLMS, name="llms-no-compress", compression="static", static_level="q8",
            description="llms with every chunk q8 (no tolerance-aware compression)"),
    replace(_LLMS, name="llms-no-lctru", eviction="lru",
            description="llms with chunk LRU instead of LCTRU"),
    replace(_LLMS, name="llms-no-aot", aot_swap_out=False,
            description="llms swapping out on demand at eviction time"),
    replace(_LLMS, name="llms-no-pipeline", recompute=False,
            description="llms loading every chunk with a file, no chosen recompute"),
)}


def get_policy(name: str) -> PolicySet:
    """The policy registered as ``name``; :class:`UnknownPolicyError` lists the valid names."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise UnknownPolicyError("policy", name, POLICIES) from None

