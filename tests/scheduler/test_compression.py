"""Tolerance-aware compression planner: exact optimum (against brute force), ceilings, static mode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.compression import (MAX_GRID, MODES, CompressionConfig, CompressionPlanner, evaluate,
                                   plan_static, plan_tolerance)
from scheduler.errors import UnknownCompressionModeError, UnknownLevelError

# Written out here, not imported, so the brute force below shares no code with the planner.
BITS = {"raw": 32, "fp16": 16, "bf16": 16, "q8": 8, "q4": 4, "q2": 2}
HEAVY = {"raw": 5, "fp16": 4, "bf16": 4, "q8": 3, "q4": 2, "q2": 1}
# fidelity per level: measured (1 - relative RMS error of the codec on real K/V), or the ratio
FIDELITY = {"measured": {"raw": 1.0, "fp16": 0.9998, "bf16": 0.9984, "q8": 0.9978, "q4": 0.964, "q2": 0.82},
            "ratio": {lv: b / 8 for lv, b in BITS.items()}}


def brute_force(d, levels, current, nb, g, weights="ratio"):
    """Every threshold tuple scored in plain Python: [(objective, mean, per-chunk levels), ...]."""
    ranking = sorted(range(nb), key=lambda i: (-d[i], i))
    m = len(levels)
    tuples = [()]
    for _ in range(m - 1):
        tuples = [t + (x,) for t in tuples for x in range(t[-1] if t else 0, nb + 1)]
    out = []
    for ts in tuples:
        assigned = list(current)
        for r, i in enumerate(ranking):
            target = levels[sum(1 for t in ts if t <= r)]
            cur = current[i]
            assigned[i] = target if HEAVY[target] <= HEAVY[cur] else cur
        ratios = [BITS[assigned[i]] / 8 for i in range(nb)]
        obj = sum(FIDELITY[weights][assigned[i]] * d[i] for i in range(nb))
        mean = sum(ratios) / nb if nb else 0.0
        out.append((obj, mean, assigned, ts))
    return out


level_sets = st.sampled_from([("q8", "q4", "q2"), ("q8", "q2"), ("q4", "q2"), ("q8",),
                              ("fp16", "q8", "q4")])
current_level = st.sampled_from([None, "raw", "fp16", "q8", "q4", "q2"])


@st.composite
def contexts(draw):
    n = draw(st.integers(0, 24))
    # few distinct values so ties in density (and in objective) are common
    d = draw(st.lists(st.sampled_from([0.0, 0.01, 0.1, 0.25, 0.3, 0.7, 1.0]) | st.floats(0, 1),
                      min_size=n, max_size=n))
    cur = draw(st.lists(current_level, min_size=n, max_size=n))
    partial = n > 0 and draw(st.booleans())
    g = draw(st.sampled_from([0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.5]) | st.floats(0.05, 2.0))
    return d, cur, partial, g, draw(level_sets), draw(st.sampled_from(sorted(FIDELITY)))


@settings(max_examples=300, deadline=None)
@given(contexts())
def test_plan_is_the_best_feasible_threshold_tuple(ctx):
    d, cur, partial, g, levels, weights = ctx
    plan = plan_tolerance(np.array(d), global_ratio=g, levels=levels, current=cur,
                          partial_last=partial, weights=weights)
    current = ["raw" if c is None else c for c in cur]
    nb = len(d) - 1 if partial else len(d)
    scored = brute_force(d, levels, current, nb, g, weights)
    feasible = [s for s in scored if s[1] <= g + 1e-12]
    assert plan.n_budget == nb
    assert plan.feasible == bool(feasible)
    # the reported numbers are those of the reported levels
    assert plan.objective == pytest.approx(sum(FIDELITY[weights][plan.levels[i]] * d[i] for i in range(nb)),
                                           rel=1e-12, abs=1e-12)
    if nb:
        assert plan.mean_ratio == pytest.approx(sum(BITS[plan.levels[i]] for i in range(nb)) / 8 / nb)
    # the levels are the ones its thresholds give
    by_ts = {s[3]: s for s in scored}
    assert list(plan.levels) == by_ts[plan.thresholds][2]
    if feasible:
        best = max(s[0] for s in feasible)
        assert plan.objective >= best - 1e-9 * (1 + sum(d))
        assert plan.mean_ratio <= g + 1e-12
        # ties (equal fidelity up to rounding): the least mean ratio, then the smallest thresholds
        near = [s for s in feasible if s[0] >= best - 1e-9 * sum(d[:nb])]
        least = min(s[1] for s in near)
        assert plan.mean_ratio == pytest.approx(least, abs=1e-12)
        assert plan.thresholds == min(s[3] for s in near if abs(s[1] - least) <= 1e-12)
    else:  # the lightest plan there is
        assert plan.mean_ratio == pytest.approx(min(s[1] for s in scored))
    # never rises; a partial last chunk keeps its level; changed lists exactly the differences
    for i, lv in enumerate(plan.levels):
        assert HEAVY[lv] <= HEAVY[current[i]]
    if partial:
        assert plan.levels[-1] == current[-1]
    assert plan.changed == tuple(i for i in range(len(d)) if plan.levels[i] != current[i])
    # deterministic
    assert plan_tolerance(np.array(d), global_ratio=g, levels=levels, current=cur,
                          partial_last=partial, weights=weights) == plan


def test_measured_weights_keep_most_chunks_at_4_bits():
    """With weights linear in the bits the optimum at a 50% bound splits the chunks between q8 and
    q2; measured fidelity (q2 loses far more than q4) keeps them at q4 and gives q8 only to a chunk
    far denser than the ones it pushes to q2 (here the attention sink, chunk 0)."""
    d = np.array([40.0, 1.2, 1.1, 1.0, 0.9, 1.05, 0.95, 1.0, 0.8, 1.15, 1.0, 0.85])
    lin = plan_tolerance(d, weights="ratio")
    assert lin.levels.count("q4") <= 1 and lin.levels.count("q2") >= 7
    plan = plan_tolerance(d)
    assert plan.levels[0] == "q8" and plan.levels.count("q4") >= 8 and plan.mean_ratio <= 0.5
    assert plan.levels.count("q2") == 2 and {plan.levels[8], plan.levels[11]} == {"q2"}  # the two least dense
    flat = plan_tolerance(np.ones(12))
    assert flat.levels == ("q4",) * 12  # no density contrast: all at the level the bound allows


def test_densest_chunks_keep_the_most_bits():
    """Weighting by ratio_w (fidelity), not the paper's 1/ratio_w: dense chunks stay at 8 bits."""
    d = np.array([0.01, 0.9, 0.02, 0.5, 0.03, 0.04, 0.2, 0.05])
    plan = plan_tolerance(d)
    assert plan.feasible and plan.mean_ratio <= 0.5
    order = np.argsort(-d, kind="stable")
    ranks = [HEAVY[plan.levels[i]] for i in order]
    assert ranks == sorted(ranks, reverse=True)  # level never heavier further down the ranking
    assert plan.levels[1] == "q8" and plan.levels[0] == "q2"
    # a uniform 4-bit plan meets the same budget but keeps less of the dense chunks
    uniform, _ = evaluate(["q4"] * len(d), d)
    assert plan.objective > uniform


def test_equal_densities_rank_by_chunk_index():
    d = np.array([0.5, 0.2, 0.5, 0.2, 0.5, 0.2])
    plan = plan_tolerance(d, global_ratio=0.5)
    for i in range(len(d)):
        for j in range(i + 1, len(d)):
            if d[i] == d[j]:
                assert HEAVY[plan.levels[i]] >= HEAVY[plan.levels[j]], plan.levels


def test_ties_prefer_less_memory_then_smaller_thresholds():
    # all-q4 (0, 4) and q8,q4,q2,q2 (1, 2) keep the same fidelity at the same mean: (0, 4) wins
    plan = plan_tolerance([1.0, 1.0, 1.0, 1.0], global_ratio=0.5)
    assert plan.thresholds == (0, 4) and plan.levels == ("q4",) * 4
    # nothing to keep: spend the least memory
    assert plan_tolerance([0.0] * 5, global_ratio=1.0).levels == ("q2",) * 5


def test_ceilings_hold_chunks_down_and_free_budget_for_others():
    d = np.array([0.9, 0.8, 0.1, 0.1])
    free = plan_tolerance(d, global_ratio=0.5)
    capped = plan_tolerance(d, global_ratio=0.5, current=["q2", None, None, None])
    assert free.levels[0] == "q8"
    assert capped.levels[0] == "q2"  # the densest chunk cannot climb back from q2
    assert capped.feasible and capped.mean_ratio <= 0.5
    assert capped.objective < free.objective
    # the budget chunk 0 cannot use goes to others: chunk 1 is now at least as heavy
    assert HEAVY[capped.levels[1]] >= HEAVY[free.levels[1]]


def test_infeasible_budget_puts_everything_at_the_lightest_level():
    plan = plan_tolerance([0.3, 0.2, 0.1], global_ratio=0.2)
    assert not plan.feasible
    assert plan.levels == ("q2", "q2", "q2") and plan.mean_ratio == 0.25


def test_partial_last_chunk_is_raw_and_outside_the_budget():
    d = [0.1, 0.2, 0.3, 0.99]
    plan = plan_tolerance(d, partial_last=True)
    assert plan.levels[-1] == "raw" and plan.n_budget == 3
    assert plan.mean_ratio <= 0.5
    assert plan.objective == pytest.approx(evaluate(plan.levels, d, partial_last=True)[0])


def test_empty_context():
    plan = plan_tolerance([])
    assert plan.levels == () and plan.feasible and plan.mean_ratio == 0.0
    with pytest.raises(ValueError):
        plan_tolerance([], partial_last=True)


def test_512_chunks_plan():
    rng = np.random.default_rng(0)
    d = rng.gamma(0.5, size=512)
    plan = plan_tolerance(d, partial_last=True)
    assert plan.feasible and plan.mean_ratio <= 0.5 and len(plan.levels) == 512
    # every density is > 0, so an optimum leaves less slack than one more q2 -> q4 step (t2 + 1)
    assert plan.mean_ratio > 0.5 - 0.25 / 511


def test_too_many_chunks_for_exact_enumeration():
    n = int(MAX_GRID ** 0.5) + 1
    with pytest.raises(ValueError, match="enumeration"):
        plan_tolerance(np.ones(n))


@pytest.mark.parametrize("bad", [[0.1, -0.2], [np.nan], [[0.1, 0.2]], [np.inf]])
def test_bad_densities(bad):
    with pytest.raises(ValueError):
        plan_tolerance(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="current levels"):
        plan_tolerance([0.1, 0.2], current=["q8"])
    with pytest.raises(UnknownLevelError):
        plan_tolerance([0.1], current=["int8"])
    with pytest.raises(ValueError, match="heaviest first"):
        plan_tolerance([0.1], levels=("q2", "q8"))
    with pytest.raises(ValueError, match="global_ratio"):
        plan_tolerance([0.1], global_ratio=0.0)


def test_static_plans():
    cur = ["q4", None, "raw", "q8", None]
    sq = plan_static("q8", 5, current=cur, partial_last=True)
    assert sq.levels == ("q4", "q8", "q8", "q8", "raw")  # q4 never rises; partial stays raw
    assert sq.changed == (1, 2) and sq.thresholds == () and sq.global_ratio is None
    assert sq.mean_ratio == pytest.approx((0.5 + 1 + 1 + 1) / 4)
    lossless = plan_static("raw", 3)
    assert lossless.levels == ("raw",) * 3 and lossless.changed == () and lossless.mean_ratio == 4.0
    with pytest.raises(ValueError):
        plan_static("q8", 2, densities=[0.1])


def test_planner_modes_through_the_registry():
    d = np.array([0.3, 0.1, 0.6, 0.2])
    assert set(MODES) == {"tolerance", "static", "none"}
    tol = CompressionPlanner(CompressionConfig()).plan(d)
    assert tol == plan_tolerance(d)
    sq = CompressionPlanner(CompressionConfig(mode="static", static_level="q8")).plan(d)
    assert sq.levels == ("q8",) * 4 and sq.objective == pytest.approx(FIDELITY["measured"]["q8"] * d.sum())
    lin = CompressionPlanner(CompressionConfig(weights="ratio")).plan(d)
    assert lin == plan_tolerance(d, weights="ratio") and lin.objective == pytest.approx(
        sum(BITS[lv] / 8 * x for lv, x in zip(lin.levels, d)))
    with pytest.raises(ValueError, match="measured"):
        CompressionConfig(weights="cubic")
    none = CompressionPlanner(CompressionConfig(mode="none", dtype="float16")).plan(d, ["q4"] * 4)
    assert none.levels == ("q4",) * 4 and none.mode == "none"
    assert CompressionPlanner(CompressionConfig(mode="none", dtype="float16")).plan(d).mean_ratio == 2.0
    with pytest.raises(UnknownCompressionModeError) as e:
        CompressionConfig(mode="lossy")
    assert all(name in str(e.value) for name in MODES)


@pytest.mark.parametrize("mode", ["tolerance", "static", "none"])
def test_pinned_chunks_stay_raw_outside_the_budget(mode):
    planner = CompressionPlanner(CompressionConfig(mode=mode))
    d = [0.9, 0.01, 0.5, 0.02, 0.3, 0.7]
    plan = planner.plan(d, partial_last=True, pinned=[1, 3])
    assert plan.levels[1] == plan.levels[3] == "raw" and plan.levels[-1] == "raw"  # pinned, partial
    rest = planner.plan([d[i] for i in (0, 2, 4, 5)], partial_last=True)  # the others, planned alone
    assert [plan.levels[i] for i in (0, 2, 4, 5)] == list(rest.levels) and plan.mean_ratio == rest.mean_ratio
    assert set(plan.changed) == {i for i in (0, 2, 4, 5) if plan.levels[i] != "raw"}
    # a pinned last chunk takes the partial chunk's place; everything pinned leaves everything raw
    assert planner.plan(d, partial_last=True, pinned=[5]).levels[5] == "raw"
    assert planner.plan(d, pinned=range(6)).levels == ("raw",) * 6


def test_a_pinned_chunk_must_be_raw_and_one_of_the_chunks():
    planner = CompressionPlanner()
    with pytest.raises(ValueError, match="never lowered"):
        planner.plan([0.1, 0.2], current=["q4", None], pinned=[0])
    with pytest.raises(ValueError, match="not one of"):
        planner.plan([0.1, 0.2], pinned=[2])


def test_room_plans_nothing_lower_while_memory_holds_everything_raw():
    planner = CompressionPlanner()
    d = [0.9, 0.01, 0.5, 0.02, 0.3, 0.7]
    for room in (4.0, 9.5):  # float32 raw is 32 bits: ratio 4
        plan = planner.plan(d, room=room)
        assert plan.levels == ("raw",) * 6 and plan.changed == ()
        # ... and never raises a level: lowered chunks stay where they are
        assert planner.plan(d, ["q4", None, "q8", None, None, "q2"], room=room).levels == (
            "q4", "raw", "q8", "raw", "raw", "q2")
    # the baselines keep their one level whatever memory allows
    sq = CompressionPlanner(CompressionConfig(mode="static", static_level="q8"))
    assert sq.plan(d, room=4.0).levels == ("q8",) * 6


@given(st.lists(st.floats(0, 1), min_size=1, max_size=24), st.floats(1.0, 4.0, exclude_min=True))
@settings(max_examples=200, deadline=None)
def test_room_between_q8_and_raw_keeps_the_densest_raw_within_the_bound(d, room):
    plan = CompressionPlanner().plan(d, room=room)
    assert set(plan.levels) <= {"raw", "q8"} and plan.mean_ratio <= room + 1e-9
    raw = [i for i, lv in enumerate(plan.levels) if lv == "raw"]
    q8 = [i for i, lv in enumerate(plan.levels) if lv == "q8"]
    # as many raw as fit (each raw chunk costs 3 more than a q8 one), and the densest of them
    assert len(raw) == int((room - 1.0) * len(d) / 3.0 + 1e-9)
    assert all(d[i] >= d[j] for i in raw for j in q8)


def test_rising_pressure_lowers_the_least_dense_first_down_to_the_configured_ratio():
    planner = CompressionPlanner()  # configured ratio 0.5
    d = np.array([0.9, 0.01, 0.5, 0.02, 0.3, 0.7, 0.05, 0.4])
    means, plans = [], []
    for room in (4.0, 2.5, 1.0, 0.75, 0.5, 0.3, 0.1):
        p = planner.plan(d, room=room)
        means.append(p.mean_ratio)
        plans.append(p)
        assert p.mean_ratio <= max(room, 0.5) + 1e-9
    assert means == sorted(means, reverse=True) and means[0] == 4.0
    # at or past full pressure the plan is the configured one
    assert plans[-1] == plans[-2] == planner.plan(d)
    # between q8 and the configured ratio: the tolerance enumeration at that bound
    assert plans[3] == plan_tolerance(d, global_ratio=0.75)
    # the least dense chunk is never heavier than the densest
    for p in plans:
        assert BITS[p.levels[1]] <= BITS[p.levels[0]]
