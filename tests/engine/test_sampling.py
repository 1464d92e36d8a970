"""Sampling and stop handling, on crafted logits (no model)."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import GREEDY_BELOW, BadRequestError, Penalties, SamplingParams, find_stop, holdback, sample


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


def test_penalties_on_crafted_logits():
    """Each penalty by its formula: OpenAI's frequency (per time produced) and presence (once), CTRL's
    repetition penalty on the context's tokens and the reply's (divide positive logits, multiply
    negative ones); the input logits are left as they were."""
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    pen = Penalties(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [0, 1], 5, "cpu")
    for t in (3, 3, 2):
        pen.add(t)
    assert torch.equal(pen.apply(logits), torch.tensor([2.0, -1.0, 0.5 - 0.5 - 0.25, 3.0 - 1.0 - 0.25, -2.0]))
    pen.remove(3)
    assert pen.apply(logits)[3] == 3.0 - 0.5 - 0.25
    rep = Penalties(SamplingParams(repetition_penalty=2.0), [1, 1, 4], 5, "cpu")
    rep.add(3)
    assert torch.equal(rep.apply(logits), torch.tensor([2.0, -2.0, 0.5, 1.5, -4.0]))
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))
    # a penalty moves the greedy choice off a repeated token
    assert sample(rep.apply(logits), SamplingParams(), None) == 0


@pytest.mark.parametrize("bad", [{"frequency_penalty": 2.5}, {"presence_penalty": -3.0},
                                 {"repetition_penalty": 0.0}, {"repetition_penalty": 11.0}])
def test_penalties_out_of_range_are_refused(bad):
    with pytest.raises(BadRequestError):
        SamplingParams(**bad)


def test_no_penalty_by_default():
    assert not SamplingParams().penalized
    assert SamplingParams(presence_penalty=0.1).penalized and SamplingParams(repetition_penalty=1.1).penalized
