"""Trace replay: compressed time never skips the background work; a tiny replay on the real model
writes a well-formed CSV and summary; the report turns them into tables and a PNG."""

from __future__ import annotations

import csv
import json
import os
import statistics

import pytest

from actors.metrics import SWITCH_OUTCOMES
from bench.replay import (
    CALLS_CSV,
    CSV_FIELDS,
    SUMMARY_JSON,
    ReplayConfig,
    replay,
    replay_calls,
    reply_tokens,
    run_meta,
    write_results,
)
from bench.report import BEGIN, END, load_results, markdown, plot_switch_latency, replace_section, report
from bench.traces import TraceConfig, TraceRecord, generate_trace

# -- compressed time, with a fake service and clock (no model) -------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeService:
    """Each call takes 0.05 s and leaves 0.3 s of background work, which `idle()` waits for."""

    def __init__(self, clock: FakeClock, log: list) -> None:
        self.clock, self.log = clock, log

    def call(self, token, ctx, prompt, max_tokens):
        self.log.append(("call", ctx, round(self.clock.t, 6)))
        self.clock.t += 0.05
        restore = {"resident": 1, "loaded": 0, "loaded_bytes": 0, "recomputed": 0, "seconds": 0.001}
        return {"restore": restore, "hit": False, "switch_ms": 1.0, "predicted_restore_ms": 1.0,
                "ttft_s": 0.01, "prompt_tokens": 5, "completion_tokens": 1}


def test_compressed_time_waits_for_background_work_and_caps_gaps():
    clock, log, sleeps = FakeClock(), [], []

    def idle():
        log.append(("idle",))
        clock.t += 0.3  # the write-back of the previous call

    def sleep(s):
        sleeps.append(round(s, 6))
        clock.t += s

    times = [0.0, 1.0, 1.1, 5.0]  # trace gaps 1.0, 0.1, 3.9 s
    calls = [TraceRecord(t, i % 2, f"prompt {i}", 40) for i, t in enumerate(times)]
    recs = replay_calls(FakeService(clock, log), "tok", ["c0", "c1"], calls, policy="fake", max_tokens=8,
                        max_gap_s=0.5, count_tokens=lambda s: 10, idle=idle, clock=clock, sleep=sleep)
    # every call comes after the background work of the one before (and of the set-up)
    assert [e[0] for e in log] == ["idle", "call"] * 4 + ["idle"]
    # gaps compressed to min(gap, 0.5 s) but never below the 0.35 s the call and its write-back took
    assert [r.sent_s for r in recs] == pytest.approx([0.0, 0.5, 0.85, 1.35])
    assert sleeps == pytest.approx([0.15, 0.15])
    assert [r.context for r in recs] == [0, 1, 0, 1]


def test_reply_tokens_fill_the_delta_within_bounds():
    rec = TraceRecord(0.0, 0, "p", 40)
    assert reply_tokens(rec, 35, 8) == 5
    assert reply_tokens(rec, 10, 8) == 8  # capped
    assert reply_tokens(rec, 60, 8) == 1  # prompt longer than the delta: still one token


# -- a tiny replay on the real model ----------------------------------------------------------------

POLICIES = ("swap", "llms")
N_CALLS = 10


@pytest.fixture(scope="module")
def results_dir(engine, tmp_path_factory):
    trace = generate_trace(TraceConfig(pattern="markov", contexts=3, calls=N_CALLS, profiles=("sst2",)), seed=1)
    cfg = ReplayConfig(policies=POLICIES, max_tokens=2, history_tokens=(64, 100), max_context_tokens=1024)
    out = tmp_path_factory.mktemp("replay")
    result = replay(trace, cfg, engine, out / "data", progress=False)
    write_results(out / "results", result, trace, run_meta("pytest tiny replay"))
    return out / "results", trace, result


def test_tiny_replay_writes_one_csv_row_per_call_per_policy(results_dir):
    d, trace, result = results_dir
    with open(d / CALLS_CSV, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_FIELDS
    assert len(rows) == len(POLICIES) * N_CALLS
    for p in POLICIES:
        mine = [r for r in rows if r["policy"] == p]
        assert [int(r["call"]) for r in mine] == list(range(N_CALLS))
        assert [int(r["context"]) for r in mine] == [c.context_id for c in trace.records]
    assert all(float(r["switch_ms"]) > 0 for r in rows)
    assert all(float(r["e2e_ms"]) >= float(r["switch_ms"]) for r in rows)
    assert {r["outcome"] for r in rows} <= set(SWITCH_OUTCOMES)
    assert all(1 <= int(r["completion_tokens"]) <= 2 for r in rows)
    # the budget holds a quarter of the contexts: swap must read chunk files back at least once
    assert sum(int(r["loaded_bytes"]) for r in rows if r["policy"] == "swap") > 0
    # a restore has a plan and a measurement; a hit has neither
    for r in rows:
        restored = r["outcome"] != "hit"
        assert (float(r["predicted_restore_ms"]) > 0) == restored
        assert (float(r["measured_restore_ms"]) > 0) == restored


def test_tiny_replay_summary_matches_the_csv(results_dir):
    d, trace, result = results_dir
    s = json.loads((d / SUMMARY_JSON).read_text())
    assert list(s["policies"]) == list(POLICIES)
    assert s["kv_budget_bytes"] == result.kv_budget_bytes > 0
    assert s["machine"]["cpu_count"] == os.cpu_count()
    assert s["command"] == "pytest tiny replay" and s["date"]
    assert s["trace"] == {"pattern": "markov", "contexts": 3, "calls": N_CALLS, "trace_calls": N_CALLS,
                          "rate_per_s": trace.config.rate_per_s, "seed": 1, "file": "trace.jsonl"}
    for p in POLICIES:
        sw = [r.switch_ms for r in result.records[p]]
        x = s["policies"][p]
        assert x["calls"] == N_CALLS
        assert sum(x["outcomes"].values()) == N_CALLS
        assert x["mean_switch_ms"] == pytest.approx(statistics.mean(sw))
        assert x["median_switch_ms"] == pytest.approx(statistics.median(sw))
        assert min(sw) <= x["p95_switch_ms"] <= max(sw)
        restores = N_CALLS - x["outcomes"]["hit"]
        assert x["restore_pred_n"] == restores
        assert (x["restore_pred_error"] is None) == (restores == 0)


def test_report_makes_a_table_and_a_png(results_dir, tmp_path):
    d, _, _ = results_dir
    res = load_results(d)
    text = markdown(res, "img/x.png")
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| policy | mean switch_ms")
    for p in POLICIES:
        row = next(line for line in table if line.startswith(f"| {p} |"))
        assert f"{res.summary['policies'][p]['mean_switch_ms']:.1f}" in row
    assert "| swap |" in text.split("divided by `llms`")[1]  # the ratio table
    png = plot_switch_latency(res, tmp_path / "img" / "fig9.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    import matplotlib.image

    h, w, _ = matplotlib.image.imread(png).shape
    assert h > 200 and w > 300


def test_report_writes_between_markers_and_keeps_the_rest(results_dir, tmp_path):
    d, _, _ = results_dir
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nbefore\n\n{BEGIN}\nold table\n{END}\n\nafter\n")
    text = report([d], tmp_path / "img", tmp_path)
    once = replace_section(doc.read_text(), text)
    assert "old table" not in once
    assert once.startswith("# Benchmarks\n\nbefore\n\n") and once.endswith(f"{END}\n\nafter\n")
    assert once.count(BEGIN) == 1 and "](img/replay-markov-3ctx.png)" in once
    assert (tmp_path / "img" / "replay-markov-3ctx.png").exists()
    assert replace_section(once, text) == once  # idempotent
    fresh = replace_section("# Benchmarks\n", text)
    assert "## Trace replay" in fresh and fresh.index(BEGIN) > fresh.index("## Trace replay")
