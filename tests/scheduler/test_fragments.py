"""Size-aware fragment placement (HyperGen §3.1): smallest first up to the limit, the rest streamed by
stage, and the streaming window over consecutive stages, on hand-computed cases."""

import pytest

from scheduler.fragments import Fragment, plan_fragments


def blocks(n: int) -> list[Fragment]:
    """`n` blocks of a norm (1), a bias (2), a matrix (10) and a larger one (40); a head of 100."""
    out = []
    for i in range(n):
        out += [Fragment(f"layers.{i}.norm", i, 1), Fragment(f"layers.{i}.bias", i, 2),
                Fragment(f"layers.{i}.wqkv", i, 10), Fragment(f"layers.{i}.w_up", i, 40)]
    return out + [Fragment("norm", n, 1), Fragment("lm_head", n, 100)]


def test_smallest_fragments_first_until_the_limit():
    plan = plan_fragments(blocks(3), resident_limit=45, stages=4)
    # sizes ascending: 1 x4 (three norms and the final norm), 2 x3, 10 x3 -> 4 + 6 + 30 = 40; the next is 40
    assert plan.resident == ("layers.0.norm", "layers.1.norm", "layers.2.norm", "norm",
                             "layers.0.bias", "layers.1.bias", "layers.2.bias",
                             "layers.0.wqkv", "layers.1.wqkv", "layers.2.wqkv")
    assert plan.resident_bytes == 40
    assert plan.streamed == (("layers.0.w_up",), ("layers.1.w_up",), ("layers.2.w_up",), ("lm_head",))
    assert plan.streamed_bytes == 3 * 40 + 100
    # consecutive pairs, cyclic: 40+40, 40+40, 40+100, 100+40 (the head, then block 0 of the next pass)
    assert plan.window_bytes == 140
    assert plan.peak_bytes == 180
    assert plan_fragments(blocks(3), resident_limit=45, stages=4, read_ahead=False).window_bytes == 100


def test_the_limit_is_never_passed_and_a_fragment_is_whole():
    frags = blocks(2)
    total = sum(f.nbytes for f in frags)
    for limit in range(0, total + 2):
        plan = plan_fragments(frags, limit, stages=3)
        assert plan.resident_bytes <= limit
        streamed = [n for names in plan.streamed for n in names]
        assert sorted(plan.resident + tuple(streamed)) == sorted(f.name for f in frags)
        assert plan.resident_bytes + plan.streamed_bytes == total
        if streamed:  # what stays out is larger than the room left
            smallest_out = min(f.nbytes for f in frags if f.name in streamed)
            assert plan.resident_bytes + smallest_out > limit


def test_everything_resident_streams_nothing():
    plan = plan_fragments(blocks(2), resident_limit=10**9, stages=3)
    assert plan.streamed == ((), (), ())
    assert plan.streamed_bytes == plan.window_bytes == 0


def test_nothing_resident_and_the_window_of_one_stage():
    plan = plan_fragments([Fragment("a", 0, 5), Fragment("b", 0, 7)], resident_limit=0, stages=1)
    assert plan.resident == ()
    assert plan.streamed == (("a", "b"),)
    assert plan.window_bytes == 12  # one stage: no other to read ahead


def test_ties_are_broken_by_name():
    frags = [Fragment("layers.1.b", 1, 4), Fragment("layers.0.a", 0, 4), Fragment("layers.0.c", 0, 4)]
    assert plan_fragments(frags, 8, stages=2).resident == ("layers.0.a", "layers.0.c")


@pytest.mark.parametrize("args, message", [
    (([Fragment("a", 2, 1)], 0, 2), "outside"),
    (([Fragment("a", 0, -1)], 0, 1), "negative"),
    (([], -1, 1), "resident_limit"),
    (([], 0, 0), "stages"),
])
def test_bad_input_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        plan_fragments(*args)


def test_the_plan_describes_itself_in_mebibytes():
    mib = 1 << 20
    plan = plan_fragments([Fragment("a", 0, mib), Fragment("b", 1, 3 * mib)], resident_limit=2 * mib, stages=2)
    assert plan.describe() == ("1.0 MiB of weights resident (1 smallest fragments), 3.0 MiB streamed per "
                               "forward pass, at most 4.0 MiB in memory")
