"""Baselines and ablations: the registry, each policy's switches, and that ablations differ from
llms in one technique each."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scheduler.compression import CompressionPlanner
from scheduler.errors import UnknownCompressionModeError, UnknownPolicyError, UnknownStrategyError
from scheduler.eviction import ChunkLRU, ContextLRU, EvictionQueue, LCTRU
from scheduler.policies import POLICIES, PolicySet, get_policy

DENSITIES = np.array([0.05, 0.4, 0.1, 0.3, 0.02, 0.6, 0.07, 0.2, 0.9])  # last chunk partial


def test_registry_names():
    assert set(POLICIES) == {"lmk", "swap", "vllm-s", "vllm-sq", "llms", "llms-no-compress",
                             "llms-no-lctru", "llms-no-aot", "llms-no-pipeline"}
    for name, p in POLICIES.items():
        assert p.name == name and get_policy(name) is p
        assert p.description and "\n" not in p.description


def test_unknown_policy_lists_valid_names():
    with pytest.raises(UnknownPolicyError) as e:
        get_policy("vllm")
    assert e.value.code == "unknown_policy" and isinstance(e.value, ValueError)
    assert all(name in str(e.value) for name in POLICIES)


@pytest.mark.parametrize("name,strategy,levels", [
    ("lmk", ContextLRU, {"raw"}),
    ("swap", ContextLRU, {"raw"}),
    ("vllm-s", ChunkLRU, {"raw"}),
    ("vllm-sq", ChunkLRU, {"q8"}),
    ("llms", LCTRU, {"q8", "q4", "q2"}),
    ("llms-no-compress", LCTRU, {"q8"}),
    ("llms-no-lctru", ChunkLRU, {"q8", "q4", "q2"}),
    ("llms-no-aot", LCTRU, {"q8", "q4", "q2"}),
    ("llms-no-pipeline", LCTRU, {"q8", "q4", "q2"}),
])
def test_policy_drives_the_planners(name, strategy, levels):
    p = get_policy(name)
    assert isinstance(p.eviction_strategy(), strategy)
    assert EvictionQueue(p.eviction_strategy()).strategy.granularity == p.granularity
    plan = CompressionPlanner(p.compression_config()).plan(DENSITIES, partial_last=True)
    assert set(plan.levels[:-1]) <= levels and plan.levels[-1] == "raw"
    if p.compression == "tolerance":
        assert plan.mean_ratio <= p.global_ratio and len(set(plan.levels[:-1])) > 1


def test_baselines_switches():
    lmk, swap, vs, vsq, llms = (get_policy(n) for n in ("lmk", "swap", "vllm-s", "vllm-sq", "llms"))
    assert (lmk.granularity, lmk.on_pressure) == ("context", "kill")
    assert (swap.granularity, swap.on_pressure, swap.compression) == ("context", "swap", "none")
    for p in (lmk, swap, vs, vsq):
        assert not p.aot_swap_out and not p.recompute
    assert (vs.granularity, vs.compression) == ("chunk", "none")
    assert (vsq.compression, vsq.static_level) == ("static", "q8")
    assert dataclasses.replace(vsq, name="x", description="", compression="none",
                               static_level="raw") == dataclasses.replace(vs, name="x",
                                                                          description="")
    assert (llms.granularity, llms.compression, llms.eviction) == ("chunk", "tolerance", "lctru")
    assert llms.aot_swap_out and llms.recompute and llms.global_ratio == 0.5


@pytest.mark.parametrize("name,changed", [
    ("llms-no-compress", {"compression", "static_level"}),
    ("llms-no-lctru", {"eviction"}),
    ("llms-no-aot", {"aot_swap_out"}),
    ("llms-no-pipeline", {"recompute"}),
])
def test_each_ablation_switches_off_one_technique(name, changed):
    llms, p = get_policy("llms"), get_policy(name)
    diff = {f.name for f in dataclasses.fields(PolicySet)
            if getattr(p, f.name) != getattr(llms, f.name)} - {"name", "description"}
    assert diff == changed


def test_inconsistent_policies_are_refused():
    llms = get_policy("llms")
    with pytest.raises(ValueError, match="granularity"):
        llms.with_changes(eviction="context-lru")
    with pytest.raises(ValueError, match="killed"):
        get_policy("lmk").with_changes(aot_swap_out=True)
    with pytest.raises(UnknownStrategyError):
        llms.with_changes(eviction="fifo")
    with pytest.raises(UnknownCompressionModeError):
        llms.with_changes(compression="zstd")
    with pytest.raises(ValueError):
        llms.with_changes(on_pressure="drop")
    with pytest.raises(ValueError):
        llms.with_changes(global_ratio=-1.0)
    custom = llms.with_changes(name="llms-r375", global_ratio=0.375)
    assert custom.compression_config().global_ratio == 0.375
    with pytest.raises(dataclasses.FrozenInstanceError):
        llms.recompute = False  # registry entries are shared: they must not change
