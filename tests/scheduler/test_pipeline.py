"""Swap-recompute planner: optimal against brute force, monotone in disk speed; cost fits and
their JSON text; the prediction log."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.pipeline import (PROFILE_VERSION, CostProfile, DecodeCost, LinearCost, MissingChunk,
                                RestoreLog, fit_decode, fit_linear, plan_restore)

LEVEL_BYTES = {"raw": 737_280, "fp16": 368_640, "q8": 230_400, "q4": 138_240, "q2": 92_160}


def profile(a=0.004, b=0.003, c=0.0005, d=1 / 50e6, dec=()) -> CostProfile:
    """Recompute: 4 ms + 3 ms/chunk; IO: 0.5 ms + 50 MB/s; de-quantization `dec` (level, s/chunk)."""
    return CostProfile(LinearCost(a, b), LinearCost(c, d), decode=DecodeCost(tuple(dec)))


def t_dec(prof: CostProfile, chunks) -> float:  # de-quantization of `chunks`, written out
    per = dict(prof.decode.per_level)
    return sum(per.get(c.level, max(per.values(), default=0.0)) for c in chunks)


def t(cost: LinearCost, x: float) -> float:  # the cost model written out independently
    return 0.0 if x == 0 else cost.intercept + cost.slope * x


def delay(prof, n_re, loaded, groups) -> float:
    """Eq. 4' written out: reader A = T_io, consumer B = T_re + T_dec(loaded), G groups."""
    a = t(prof.io, sum(c.nbytes for c in loaded)) if loaded else 0.0
    b = t(prof.recompute, n_re) + t_dec(prof, loaded)
    return max(a, b) + min(a, b) / groups


def brute_force(missing, prof, forced, allow, groups):
    """Best Eq. 4' over every subset that recomputes all forced chunks."""
    best = math.inf
    optional = [c for c in missing if c.index not in forced]
    sizes = range(len(optional) + 1) if allow else [0]
    for k in sizes:
        for chosen in itertools.combinations(optional, k):
            loaded = [c for c in optional if c not in chosen]
            best = min(best, delay(prof, len(forced) + k, loaded, groups))
    return best


chunks = st.lists(st.tuples(st.sampled_from(sorted(LEVEL_BYTES)), st.integers(1, 1_000_000)),
                  max_size=9)


@settings(max_examples=300, deadline=None)
@given(chunks, st.data(), st.floats(1e6, 1e9), st.floats(0, 0.05), st.floats(1e-4, 0.02),
       st.booleans(), st.dictionaries(st.sampled_from(["raw", "q8", "q4"]), st.floats(0, 0.01)),
       st.integers(1, 8))
def test_plan_against_all_subsets(raw, data, bps, a, b, allow, dec, groups):
    """Without decode costs the plan is optimal over all subsets; with them (a chunk weighs on both
    stages) it is never worse than loading every optional chunk or recomputing them all, and never
    claims better than the optimum."""
    missing = [MissingChunk(i, lv, n) for i, (lv, n) in enumerate(raw)]
    forced = set(data.draw(st.sets(st.sampled_from(range(len(raw)))) if raw else st.just(set())))
    prof = profile(a=a, b=b, d=1 / bps, dec=sorted(dec.items()))
    plan = plan_restore(missing, prof, must_recompute=forced, allow_recompute=allow, groups=groups)
    assert sorted(plan.load + plan.recompute) == list(range(len(raw)))
    assert set(plan.load).isdisjoint(plan.recompute)
    assert forced <= set(plan.recompute) and plan.forced == len(forced) and plan.groups == groups
    if not allow:
        assert set(plan.recompute) == forced
    loaded = [missing[i] for i in plan.load]
    assert plan.load_bytes == sum(c.nbytes for c in loaded)
    assert plan.t_recompute == pytest.approx(t(prof.recompute, len(plan.recompute)))
    assert plan.t_io == pytest.approx(t(prof.io, plan.load_bytes) if loaded else 0.0)
    assert plan.t_decode == pytest.approx(t_dec(prof, loaded))
    assert plan.predicted == pytest.approx(delay(prof, len(plan.recompute), loaded, groups), rel=1e-12)
    best = brute_force(missing, prof, forced, allow, groups)
    assert plan.predicted >= best * (1 - 1e-12)
    if not any(v > 0 for v in dec.values()):
        assert plan.predicted == pytest.approx(best, rel=1e-12)
    optional = [c for c in missing if c.index not in forced]
    assert plan.predicted <= delay(prof, len(forced), optional, groups) * (1 + 1e-12)
    if allow:
        assert plan.predicted <= delay(prof, len(raw), [], groups) * (1 + 1e-12)


def test_groups_interpolate_between_serial_and_the_papers_max():
    """G = 1 is no overlap (A + B); many groups approach max(A, B)."""
    missing = [MissingChunk(i, "q8", LEVEL_BYTES["q8"]) for i in range(6)]
    prof = profile(d=1 / 20e6, dec=[("q8", 0.001)])
    one = plan_restore(missing, prof, must_recompute={0}, allow_recompute=False, groups=1)
    many = plan_restore(missing, prof, must_recompute={0}, allow_recompute=False, groups=1000)
    a, b = one.t_io, one.t_recompute + one.t_decode
    assert a > 0 and b > 0
    assert one.predicted == pytest.approx(a + b)
    assert many.predicted == pytest.approx(max(a, b), rel=1e-3)


def test_heaviest_chunks_are_recomputed_first():
    missing = [MissingChunk(i, lv, LEVEL_BYTES[lv])
               for i, lv in enumerate(["q2", "q8", "raw", "q4", "q8", "q2", "fp16", "q4"])]
    plan = plan_restore(missing, profile(d=1 / 20e6), groups=5)
    assert 0 < len(plan.recompute) < len(missing)
    heaviest_loaded = max(LEVEL_BYTES[missing[i].level] for i in plan.load)
    lightest_recomputed = min(LEVEL_BYTES[missing[i].level] for i in plan.recompute)
    assert lightest_recomputed >= heaviest_loaded
    assert 2 in plan.recompute  # the raw one


def test_slower_disk_means_more_recompute():
    missing = [MissingChunk(i, lv, LEVEL_BYTES[lv]) for i, lv in
               enumerate(["q8", "q4", "q2", "raw", "q8", "q4", "q2", "q8"] * 4)]
    counts, delays = [], []
    for bps in [2e9, 5e8, 2e8, 1e8, 5e7, 2e7, 1e7, 5e6, 1e6]:
        plan = plan_restore(missing, profile(d=1 / bps))
        counts.append(len(plan.recompute))
        delays.append(plan.predicted)
    assert counts == sorted(counts) and counts[0] < counts[-1]
    assert delays == sorted(delays)
    assert counts[0] == 0  # a fast disk: load everything


def test_pipeline_off_loads_everything_with_a_file():
    missing = [MissingChunk(i, "raw", LEVEL_BYTES["raw"]) for i in range(6)]
    on = plan_restore(missing, profile(d=1 / 1e6))
    off = plan_restore(missing, profile(d=1 / 1e6), must_recompute={4}, allow_recompute=False)
    assert len(on.recompute) > 1
    assert off.recompute == (4,) and off.load == (0, 1, 2, 3, 5)
    assert off.predicted > on.predicted


def test_nothing_missing_costs_nothing():
    plan = plan_restore([], profile())
    assert plan.load == plan.recompute == () and plan.predicted == 0.0


def test_bad_restore_arguments():
    with pytest.raises(ValueError, match="twice"):
        plan_restore([MissingChunk(1, "q8", 10), MissingChunk(1, "q4", 5)], profile())
    with pytest.raises(ValueError, match="not missing"):
        plan_restore([MissingChunk(1, "q8", 10)], profile(), must_recompute={2})
    with pytest.raises(ValueError):
        plan_restore([MissingChunk(0, "q8", -1)], profile())


# -- cost models -----------------------------------------------------------------------------------


def test_linear_cost_is_zero_without_work():
    c = LinearCost(0.5, 2.0)
    assert c(0) == 0.0 and c(3) == 6.5
    assert list(c.many(np.array([0, 1, 2]))) == [0.0, 2.5, 4.5]
    with pytest.raises(ValueError):
        LinearCost(-1.0, 1.0)


def test_fit_recovers_known_coefficients():
    xs = [1, 2, 4, 8, 16, 32]
    exact = fit_linear([(x, 0.004 + 0.0025 * x) for x in xs])
    assert exact.intercept == pytest.approx(0.004, rel=1e-9)
    assert exact.slope == pytest.approx(0.0025, rel=1e-9)
    rng = np.random.default_rng(7)
    noisy_pts = [(m, 0.0005 + m / 80e6 + rng.normal(0, 1e-5)) for m in np.linspace(1e5, 5e7, 40)]
    noisy = fit_linear(noisy_pts)
    assert noisy.slope == pytest.approx(1 / 80e6, rel=0.02)
    assert noisy.intercept == pytest.approx(0.0005, abs=5e-5)


def test_fit_is_the_best_non_negative_line():
    pts = [(1, 0.5), (2, 3.5), (3, 6.0), (4, 9.5)]  # unconstrained intercept is negative
    fit = fit_linear(pts)
    assert fit.intercept >= 0 and fit.slope >= 0

    def sse(a, b):
        return sum((a + b * x - y) ** 2 for x, y in pts)

    grid = min(sse(a, b) for a in np.linspace(0, 2, 201) for b in np.linspace(0, 4, 401))
    assert sse(fit.intercept, fit.slope) <= grid + 1e-12
    falling = fit_linear([(1, 3.0), (2, 2.0), (3, 1.0)])  # slope would be negative
    assert falling.slope == 0 and falling.intercept == pytest.approx(2.0)


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="distinct"):
        fit_linear([(4, 1.0), (4, 1.1)])
    with pytest.raises(ValueError):
        fit_linear([(1, float("nan")), (2, 1.0)])


def test_decode_cost_per_chunk_decides_what_to_recompute():
    """Reading is nearly free but every loaded chunk must be de-quantized: when that costs more per
    chunk than recomputing one more chunk adds, the planner recomputes; without, it loads; and the
    chunks it recomputes are the dearest to load (here q2, the slowest to de-quantize)."""
    missing = [MissingChunk(i, lv, LEVEL_BYTES[lv]) for i, lv in enumerate(["q2", "raw", "q2", "q8"])]
    cheap = plan_restore(missing, profile(a=0.0, b=0.002, d=1e-12))
    assert cheap.recompute == () and cheap.load == (0, 1, 2, 3)
    prof = profile(a=0.0, b=0.002, d=1e-12, dec=[("q2", 0.005), ("q8", 0.001), ("raw", 0.0005)])
    dear = plan_restore(missing, prof)
    assert dear.recompute == (0, 2) and dear.load == (1, 3)
    assert dear.t_decode == pytest.approx(0.0005 + 0.001)  # the raw and q8 chunks loaded


def test_fit_decode_per_level():
    fit = fit_decode([("q2", 8, 0.0024), ("q2", 32, 0.0096), ("raw", 8, 0.0011), ("raw", 32, 0.0045)])
    assert fit.chunk("q2") == pytest.approx(0.0003)
    assert fit.chunk("raw") == pytest.approx((8 * 0.0011 + 32 * 0.0045) / (64 + 1024))
    assert fit.chunk("q4") == fit.chunk("q2")  # not measured: the dearest measured level
    assert fit([ "q2", "raw", "q2"]) == pytest.approx(2 * fit.chunk("q2") + fit.chunk("raw"))
    assert DecodeCost().chunk("q8") == 0.0
    with pytest.raises(ValueError):
        fit_decode([("q2", 0, 0.1)])
    with pytest.raises(ValueError):
        fit_decode([("q2", 4, float("nan"))])
    with pytest.raises(Exception, match="level"):
        fit_decode([("q3", 4, 0.1)])
    with pytest.raises(ValueError):
        DecodeCost((("q8", -1.0),))


def test_profile_json_round_trip():
    prof = CostProfile.fit([(1, 0.01), (2, 0.013), (8, 0.031)], [(1e6, 0.02), (4e6, 0.08)],
                           [("q8", 8, 0.002), ("q8", 32, 0.008), ("q2", 8, 0.003)])
    back = CostProfile.from_json(prof.to_json())
    assert back == prof and back.decode.chunk("q2") > back.decode.chunk("q8") > 0
    assert json.loads(prof.to_json())["version"] == PROFILE_VERSION
    doc = json.loads(prof.to_json())
    doc["version"] = PROFILE_VERSION + 1
    with pytest.raises(ValueError, match="version"):
        CostProfile.from_json(json.dumps(doc))
    with pytest.raises(ValueError, match="malformed"):
        CostProfile.from_json(json.dumps({"version": PROFILE_VERSION}))
    old = json.loads(prof.to_json())
    old["version"] = 1  # a version-1 profile (T_io with decoding folded in) is re-measured
    with pytest.raises(ValueError, match="version"):
        CostProfile.from_json(json.dumps(old))


# -- prediction log --------------------------------------------------------------------------------


def test_restore_log_median_abs_log_error():
    log = RestoreLog()
    assert log.median_abs_log_error() is None
    for p, m in [(0.010, 0.020), (0.010, 0.010), (0.020, 0.010), (0.010, 0.011), (0.05, 0.5)]:
        log.record(p, m)
    errors = sorted(abs(math.log(m / p)) for p, m in log.pairs)
    assert log.median_abs_log_error() == pytest.approx(errors[2]) == pytest.approx(math.log(2))
    with pytest.raises(ValueError):
        log.record(0.0, 0.1)


def test_restore_log_keeps_the_latest():
    log = RestoreLog(max_records=2)
    for m in (1.0, 2.0, 4.0):
        log.record(1.0, m)
    assert log.pairs == ((1.0, 2.0), (1.0, 4.0)) and len(log) == 2


def test_layer_group_size_keeps_ref_cost_under_a_tenth_of_the_read():
    from scheduler.pipeline import ReadRate, layer_group_size

    # 30 layers, 1 ms per ref, 3 MB at 1 ns/B: 0.1 ms of reading per layer -> 100 layers' worth: all in one
    assert layer_group_size(30, 1e-3, 1e-9, 3_000_000) == 30
    # 100 MB/s reads of 6 MB: 2 ms a layer; a group must take >= 10 ms -> 5 layers
    assert layer_group_size(30, 1e-3, 1e-8, 6_000_000) == 5
    for n_layers, per_ref, rate, nbytes in [(30, 5e-4, 1.25e-7, 400_000), (24, 2e-3, 3e-9, 90_000_000), (7, 1e-4, 1e-6, 10_000)]:
        k = layer_group_size(n_layers, per_ref, rate, nbytes)
        read = rate * nbytes / n_layers * k
        assert 1 <= k <= n_layers
        assert k == n_layers or per_ref <= 0.1 * read + 1e-12  # the ref is under a tenth of the group's read
        assert k == 1 or per_ref > 0.1 * read / k * (k - 1) - 1e-12  # and one layer fewer would not be
    assert layer_group_size(30, 1e-3, 1e-8, 0) == 30  # nothing loaded
    assert layer_group_size(30, 0.0, 1e-8, 10**6) == 30  # unknown cost
    r = ReadRate(0.0)
    r.observe(0.5, 1_000_000)
    assert r.s_per_byte == 5e-7
    r.observe(1.0, 1_000_000)
    assert 5e-7 < r.s_per_byte < 1e-6


# -- online correction of the cost models -----------------------------------------------------------


def _run_restores(online, base, true_factor, overhead, n, missing, resident_levels, groups=5):
    """Plan `n` restores with the online-corrected profile on a machine whose stages cost
    `true_factor[stage]` times the base profile's and whose whole restore costs `overhead` times the
    stage formula; returns (predicted, measured, plan) of each."""
    from scheduler.pipeline import pipeline_delay, restore_shape

    out = []
    for _ in range(n):
        prof = online.profile(base)
        plan = plan_restore(missing, prof, groups=groups)
        res = prof.decode(resident_levels)
        stages = {"io": plan.t_io, "decode": plan.t_decode + res, "recompute": plan.t_recompute}
        corrected = plan.predicted + res
        shape = restore_shape(len(resident_levels), len(plan.load), len(plan.recompute))
        predicted = online.predict(shape, corrected)
        # the truth: each stage as the base profile has it, times the machine's factor
        true = {s: v / online.factor(s) * true_factor[s] for s, v in stages.items()}
        measured = overhead * (float(pipeline_delay(true["io"], true["recompute"] + plan.t_decode / online.factor("decode")
                                                    * true_factor["decode"], groups))
                               + res / online.factor("decode") * true_factor["decode"])
        online.observe(shape, stages, true, corrected, measured)
        out.append((predicted, measured, plan))
    return out


def test_online_costs_follow_a_slower_machine_and_replan():
    from scheduler.pipeline import OnlineCosts

    # recomputing: 2 ms + 1 ms a chunk; de-quantizing q2: 0.5 ms a chunk; reading: fast
    base = CostProfile.fit([(1, 0.003), (8, 0.010)], [(1e6, 0.0005), (2e7, 0.0072)], [("q2", 8, 0.004)])
    missing = [MissingChunk(i, "q2", LEVEL_BYTES["q2"]) for i in range(30)]
    resident = ["q2"] * 10
    online = OnlineCosts()
    assert online.profile(base) is base  # nothing observed: the profile as measured
    truth = {"io": 1.0, "decode": 3.0, "recompute": 1.0}  # de-quantizing got 3x dearer (a busy machine)
    runs = _run_restores(online, base, truth, 1.1, 40, missing, resident)
    first_p, first_m, first_plan = runs[0]
    assert not first_plan.recompute  # as profiled, loading everything is best
    assert abs(math.log(first_m / first_p)) > math.log(2)  # the profile alone is off by more than 2x
    for p, m, _ in runs[-5:]:
        assert abs(math.log(m / p)) < 0.03
    assert online.factor("decode") == pytest.approx(3.0, rel=0.02)
    assert online.factor("io") == pytest.approx(1.0) and online.factor("recompute") == pytest.approx(1.0)
    # planning follows: dearer de-quantizing makes recomputing relatively cheaper
    assert len(runs[-1][2].recompute) > 0
    st = online.state()
    assert st["observed"] == 40 and st["stages"]["decode"] == pytest.approx(3.0, rel=0.02)
    assert set(st["residual"]) <= {"ml", "mlr", "mr"} and st["residual"]


def test_online_residual_is_kept_per_restore_shape():
    from scheduler.pipeline import OnlineCosts

    online = OnlineCosts(window=5)
    for _ in range(20):
        online.observe("m", {"decode": 0.01}, {"decode": 0.01}, 0.01, 0.013)  # 30 % overhead
        online.observe("ml", {"io": 0.01, "decode": 0.01}, {"io": 0.01, "decode": 0.01}, 0.02, 0.02)
    assert online.predict("m", 0.01) == pytest.approx(0.013, rel=1e-3)
    assert online.predict("ml", 0.02) == pytest.approx(0.02, rel=1e-3)
    assert online.predict("lr", 0.05) == 0.05  # a shape never seen: no residual
    assert online.factor("decode") == pytest.approx(1.0)


def test_online_costs_ignore_tiny_stages_and_clamp_outliers():
    from scheduler.pipeline import OnlineCosts

    online = OnlineCosts(window=9, min_stage_s=1e-3, max_factor=4.0)
    online.observe("r", {"recompute": 0.001}, {"recompute": 0.0005}, 0.001, 0.001)  # under the floor
    assert online.factor("recompute") == 1.0
    online.observe("r", {"recompute": 0.01}, {"recompute": 10.0}, 0.01, 10.0)  # one 1000x outlier
    # clamped to 4x, then the median with the profile's own "no correction": half way, in logs
    assert online.factor("recompute") == pytest.approx(2.0)
    # the shape's residual saw one ordinary restore (the first) before the outlier: the median keeps it
    assert online.predict("r", 0.01) == pytest.approx(0.01)
    for bad in ({"window": 0}, {"window": 2.5}, {"max_factor": 1.0}):
        with pytest.raises(ValueError):
            OnlineCosts(**bad)


def test_online_costs_ignore_a_lone_slow_restore_and_follow_a_lasting_change():
    """A restore now and then 3x slower (a slow read, a busy neighbour) leaves the estimate where it was; a
    change that lasts is followed within window // 2 + 1 restores."""
    from scheduler.pipeline import OnlineCosts

    online = OnlineCosts(window=9)

    def steady(f: float) -> None:  # planned with the factor in force, as the governor does
        p = 0.01 * online.factor("io")
        online.observe("l", {"io": p}, {"io": 0.01 * f}, p, 0.01 * f)

    for k in range(30):
        steady(3.0 if k % 7 == 6 else 1.2)
    assert online.factor("io") == pytest.approx(1.2)
    assert online.predict("l", 0.01 * online.factor("io")) == pytest.approx(0.012)
    for _ in range(5):  # the machine got 2x slower for good: 5 of the last 9 say so
        steady(2.4)
    assert online.factor("io") == pytest.approx(2.4)
