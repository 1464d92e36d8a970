"""Sampling and stop handling, on crafted logits (no model)."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import GREEDY_BELOW, BadRequestError, SamplingParams, find_stop, holdback, sample


def test_greedy_and_top_p_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert sample(logits, SamplingParams(), None) == 0
    sp = SamplingParams(temperature=1.0, top_p=0.7, seed=3)
    g = sp.generator("cpu")
    seen = {sample(logits, sp, g) for _ in range(400)}
    assert seen == {0, 1}  # 0.5 < 0.7 so token 1 crosses the mass and is kept; 2 and 3 never
    sp = SamplingParams(temperature=1.0, top_p=1.0, seed=3)
    g = sp.generator("cpu")
    assert {sample(logits, sp, g) for _ in range(400)} == {0, 1, 2, 3}


def test_seed_reproducible():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(temperature=0.8, seed=42)
    a = [sample(logits, sp, g) for g in [sp.generator("cpu")] for _ in range(20)]
    b = [sample(logits, sp, g) for g in [sp.generator("cpu")] for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_stop_and_holdback():
    assert find_stop("hello world", ("wor", "lo")) == 3
    assert find_stop("hello", ("x",)) == -1
    assert holdback("the end is ne", ("near",)) == 2
    assert holdback("abc", ("zzz",)) == 0
    assert holdback("caf\ufffd", ()) == 1


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="x").stop == ("x",)
    with pytest.raises(BadRequestError):
        SamplingParams(stop=["a"] * 17)


@pytest.mark.parametrize("t", [0.0, 1e-45, 1e-39, 1e-30, 1e-7])
def test_tiny_temperatures_are_greedy(t):
    """Every temperature the schema accepts gives a token; those under GREEDY_BELOW the greedy one
    (dividing by 1e-39 would overflow float32 into NaNs)."""
    logits = torch.tensor([30.0, 29.0, -5.0, 31.0])
    p = SamplingParams(temperature=t, seed=1)
    assert p.greedy and p.generator("cpu") is None and sample(logits, p, None) == 3
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
