"""The scheduler's local level table agrees with storage.codecs, and its helpers order levels."""

from __future__ import annotations

import pytest

from scheduler import levels as L
from scheduler.errors import UnknownLevelError
from storage import codecs as C

FULL_CHUNK = (30, 2, 3, 16, 64)  # [L, 2, Hkv, T, D] of the default model


def test_same_level_names_as_storage():
    assert set(L.RANK) == set(C.CODECS)
    assert set(L.LEVELS) == set(C.CODECS)


@pytest.mark.parametrize("dtype", sorted(C.COMPUTE_DTYPES))
@pytest.mark.parametrize("level", sorted(C.CODECS))
def test_nominal_bits_agree_with_storage(level, dtype):
    assert L.nominal_bits(level, dtype) == C.nominal_bits(level, dtype)
    assert L.ratio(level, dtype) == C.nominal_bits(level, dtype) / 8


def test_rank_orders_levels_by_stored_bytes_in_float32():
    """Heavier rank <=> more stored bytes per full chunk (LCTRU's 'heaviest first')."""
    size = {lv: C.stored_nbytes(lv, FULL_CHUNK, "float32") for lv in C.CODECS}
    for a in C.CODECS:
        for b in C.CODECS:
            if L.rank(a) > L.rank(b):
                assert size[a] > size[b], (a, b)
            elif L.rank(a) == L.rank(b):
                assert size[a] == size[b], (a, b)


def test_levels_heaviest_first_and_defaults():
    ranks = [L.rank(lv) for lv in L.LEVELS]
    assert ranks == sorted(ranks, reverse=True)
    assert [L.ratio(lv) for lv in L.DEFAULT_PLAN_LEVELS] == [1.0, 0.5, 0.25]


def test_lighter_never_rises():
    assert L.lighter("q8", "q4") == "q4"
    assert L.lighter("q4", "q8") == "q4"
    assert L.lighter("q8", "raw") == "q8"
    assert L.lighter("fp16", "bf16") == "fp16"  # equal rank: the first


def test_unknown_level_lists_valid_names():
    with pytest.raises(UnknownLevelError) as e:
        L.rank("q3")
    assert e.value.code == "unknown_level"
    for name in L.LEVELS:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="compute dtype"):
        L.nominal_bits("raw", "float64")


@pytest.mark.parametrize("bad", [(), ("q4", "q8"), ("q8", "q8"), ("fp16", "bf16"), ("q8", "x")])
def test_check_plan_levels_refuses_bad_lists(bad):
    with pytest.raises(ValueError):
        L.check_plan_levels(bad)
