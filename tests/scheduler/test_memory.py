"""Memory accountant: budget, all-or-nothing admission, invariants, and the admit-by-evicting loop
the governor will run with an eviction queue."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.errors import (ContextTooLongError, DuplicateChunkKeyError, NotEnoughEvictableError,
                              PoolBudgetError, UnknownChunkKeyError)
from scheduler.eviction import EvictionQueue
from scheduler.memory import MemoryAccountant, MemoryConfig


def test_config_validation_and_derived_fields():
    cfg = MemoryConfig(pool_bytes=1000, max_contexts_per_app=4, max_context_tokens=100)
    assert cfg.max_chunks_per_context == 7  # 6 full chunks of 16 and a partial one
    for bad in [dict(pool_bytes=-1), dict(pool_bytes=10, chunk_tokens=0),
                dict(pool_bytes=10, max_context_tokens=0), dict(pool_bytes=1.5)]:
        with pytest.raises(ValueError):
            MemoryConfig(**bad)


def test_allocate_up_to_the_budget_then_refuse_without_change():
    acc = MemoryAccountant(MemoryConfig(pool_bytes=1000))
    acc.allocate(("a", 0), 600)
    acc.allocate(("a", 1), 400)
    assert acc.used_bytes == 1000 and acc.free_bytes == 0 and acc.bytes_to_free(0) == 0
    assert acc.bytes_to_free(250) == 250
    with pytest.raises(PoolBudgetError) as e:
        acc.allocate(("b", 0), 1)
    assert e.value.code == "kv_pool_budget" and (e.value.needed, e.value.available) == (1, 0)
    assert acc.used_bytes == 1000 and ("b", 0) not in acc and len(acc) == 2
    acc.check()


def test_allocate_many_is_all_or_nothing():
    acc = MemoryAccountant(MemoryConfig(pool_bytes=100))
    acc.allocate(("a", 0), 10)
    with pytest.raises(PoolBudgetError):
        acc.allocate_many([(("b", 0), 50), (("b", 1), 50)])
    with pytest.raises(DuplicateChunkKeyError):
        acc.allocate_many([(("b", 0), 5), (("b", 0), 5)])
    with pytest.raises(DuplicateChunkKeyError):
        acc.allocate_many([(("b", 0), 5), (("a", 0), 5)])
    assert acc.used_bytes == 10 and len(acc) == 1 and acc.context_bytes("b") == 0
    acc.allocate_many([(("b", 0), 45), (("b", 1), 45)])
    assert acc.used_bytes == 100 and acc.chunks_of("b") == [("b", 0), ("b", 1)]
    acc.check()


def test_resize_release_and_release_context():
    acc = MemoryAccountant(MemoryConfig(pool_bytes=1000))
    acc.allocate_many([(("a", 0), 400), (("a", 1), 400), (("b", 0), 100)])
    assert acc.resize(("a", 0), 100) == -300  # re-quantized raw -> q8
    assert acc.used_bytes == 600 and acc.context_bytes("a") == 500
    with pytest.raises(PoolBudgetError):
        acc.resize(("b", 0), 600)  # would need 1100
    assert acc.nbytes(("b", 0)) == 100
    assert acc.resize(("b", 0), 500) == 400
    assert acc.release(("a", 1)) == 400
    assert acc.release_context("b") == 500 and acc.context_bytes("b") == 0
    assert acc.used_bytes == 100 and len(acc) == 1
    with pytest.raises(UnknownChunkKeyError):
        acc.release(("a", 1))
    assert acc.release_context("nobody") == 0
    acc.check()


def test_context_length_limit():
    acc = MemoryAccountant(MemoryConfig(pool_bytes=1, max_context_tokens=2048))
    acc.check_context_length(2048)
    with pytest.raises(ContextTooLongError) as e:
        acc.check_context_length(2049)
    assert e.value.code == "context_too_long" and e.value.available == 2048


def test_check_catches_a_broken_counter():
    acc = MemoryAccountant(MemoryConfig(pool_bytes=100))
    acc.allocate(("a", 0), 10)
    acc._used += 1  # simulate a bug
    with pytest.raises(RuntimeError, match="counters"):
        acc.check()
    acc._used -= 1
    acc._ctx_bytes["a"] = 11
    with pytest.raises(RuntimeError, match="total"):
        acc.check()


ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from("ab"), st.integers(0, 3), st.integers(0, 400)),
    st.tuples(st.just("resize"), st.sampled_from("ab"), st.integers(0, 3), st.integers(0, 400)),
    st.tuples(st.just("release"), st.sampled_from("ab"), st.integers(0, 3)),
    st.tuples(st.just("drop"), st.sampled_from("ab")),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_matches_a_dict(program):
    budget = 1000
    acc = MemoryAccountant(MemoryConfig(pool_bytes=budget))
    model: dict = {}
    for op in program:
        key = (op[1], op[2]) if len(op) > 2 else None
        if op[0] == "alloc":
            if key in model:
                with pytest.raises(DuplicateChunkKeyError):
                    acc.allocate(key, op[3])
            elif sum(model.values()) + op[3] > budget:
                with pytest.raises(PoolBudgetError):
                    acc.allocate(key, op[3])
            else:
                acc.allocate(key, op[3])
                model[key] = op[3]
        elif op[0] == "resize":
            if key not in model:
                with pytest.raises(UnknownChunkKeyError):
                    acc.resize(key, op[3])
            elif sum(model.values()) - model[key] + op[3] > budget:
                with pytest.raises(PoolBudgetError):
                    acc.resize(key, op[3])
            else:
                acc.resize(key, op[3])
                model[key] = op[3]
        elif op[0] == "release":
            if key in model:
                assert acc.release(key) == model.pop(key)
            else:
                with pytest.raises(UnknownChunkKeyError):
                    acc.release(key)
        else:
            freed = sum(n for k, n in model.items() if k[0] == op[1])
            assert acc.release_context(op[1]) == freed
            model = {k: n for k, n in model.items() if k[0] != op[1]}
        acc.check()
        assert acc.used_bytes == sum(model.values()) and len(acc) == len(model)
        for c in "ab":
            assert acc.context_bytes(c) == sum(n for k, n in model.items() if k[0] == c)


def test_admit_by_evicting_with_a_queue():
    """The governor's loop: ask how much to free, pop victims, release them, allocate."""
    acc = MemoryAccountant(MemoryConfig(pool_bytes=1000))
    q = EvictionQueue("lctru")
    t = 0.0
    for ctx, sizes in [("a", [300, 100]), ("b", [200, 200]), ("c", [150])]:
        for i, n in enumerate(sizes):
            t += 1
            acc.allocate((ctx, i), n)
            q.touch((ctx, i), "raw" if n >= 300 else "q8", n, t)
    q.lock("b")  # b is being called
    need = acc.bytes_to_free(400)
    assert need == 350
    victims = q.pop_victims(need)
    assert victims == [("a", 0), ("a", 1)]  # the raw chunk first, then the oldest q8 one
    acc.release_many(victims)
    acc.allocate(("b", 2), 400)
    assert acc.used_bytes == 950
    with pytest.raises(NotEnoughEvictableError):  # only c (150 B) is unlocked
        q.pop_victims(acc.bytes_to_free(300))
    acc.check()
    q.check()
