"""Trace replay: compressed time never skips the background work; a tiny replay on the real model
writes a well-formed CSV and summary; the report turns them into tables and a PNG."""

from __future__ import annotations

import csv
import json
import os
import re
import statistics

import pytest

from actors.metrics import SWITCH_OUTCOMES
from bench.plots import plot_switch_latency
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
from bench.report import BEGIN, END, replace_section, report
from bench.results import load_results
from bench.tables import replay_markdown
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


def test_think_time_sends_each_call_after_the_previous_reply_without_waiting_for_background_work():
    clock, log, sleeps = FakeClock(), [], []

    def sleep(s):
        sleeps.append(round(s, 6))
        clock.t += s

    calls = [TraceRecord(t, i % 2, f"prompt {i}", 40) for i, t in enumerate([0.0, 1.0, 1.1, 5.0])]
    for think_ms, want in ((0.0, []), (250.0, [0.25] * 3)):
        log.clear(), sleeps.clear()
        replay_calls(FakeService(clock, log), "tok", ["c0", "c1"], calls, policy="fake", max_tokens=8,
                     max_gap_s=0.5, count_tokens=lambda s: 10, idle=lambda: log.append(("idle",)),
                     clock=clock, sleep=sleep, think_ms=think_ms)
        # the trace's gaps are ignored; background work is waited for only once all calls are sent
        assert [e[0] for e in log] == ["call"] * 4 + ["idle"] and sleeps == pytest.approx(want)
    with pytest.raises(ValueError, match="think_ms"):
        ReplayConfig(think_ms=-1.0)


def test_replay_tuning_switches_are_checked_before_anything_runs():
    from deploy.jobs.replay import main

    assert ReplayConfig(tuning=(("streaming_stores", "false"),)).tuning == (("streaming_stores", "false"),)
    with pytest.raises(ValueError, match="unknown tuning options"):
        ReplayConfig(tuning=(("streamingstores", "false"),))
    for bad in ("streaming_stores", "streaming_stores=maybe"):
        with pytest.raises(SystemExit):
            main(["--tuning", bad, "--out", "unused"])


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
    # the code's commit: this checkout's HEAD (a fresh clone in CI), or "unknown" outside git
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?|unknown", s["code"])
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
    text = replay_markdown(res, "img/x.png")
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


# -- chunk size, experiment sets and their report (pure: no model) ----------------------------------

from bench import grid as G  # noqa: E402
from bench.capacity import capacity_check, max_active_contexts  # noqa: E402
from bench.plots import plot_capacity, plot_grid  # noqa: E402
from bench.replay import check_chunk_tokens  # noqa: E402
from bench.report import SET_MARKERS  # noqa: E402
from bench.results import load_set  # noqa: E402
from bench.tables import capacity_markdown, grid_markdown  # noqa: E402


@pytest.mark.parametrize("n", [4, 8, 16, 32, 64])
def test_chunk_tokens_powers_of_two_from_4_to_64_are_accepted(n):
    assert check_chunk_tokens(n) == n
    assert ReplayConfig(chunk_tokens=n).chunk_tokens == n


@pytest.mark.parametrize("n", [0, 2, 12, 48, 128, True, 16.0])
def test_other_chunk_tokens_are_refused_with_the_valid_sizes(n):
    with pytest.raises(ValueError, match=r"power of two from 4 to 64 \(4, 8, 16, 32, 64\)"):
        ReplayConfig(chunk_tokens=n)


def test_replay_cli_refuses_a_bad_chunk_size_before_loading_the_model(capsys):
    from deploy.jobs.replay import main

    with pytest.raises(SystemExit) as e:
        main(["--chunk-tokens", "12", "--out", "unused"])
    assert e.value.code == 2 and "power of two" in capsys.readouterr().err


def test_sets_have_the_issue_sizes_and_share_runs():
    runs = {name: G.set_runs(name) for name in G.SETS}
    assert {k: len(v) for k, v in runs.items()} == {"grid": 150, "capacity": 75, "ablation": 10, "chunks": 5}
    names = {k: {r.name for r in v} for k, v in runs.items()}
    assert all(len(names[k]) == len(runs[k]) for k in runs)  # a name identifies a run
    assert len(names["grid"] & names["capacity"]) == 25  # budget 2, markov, no throttle
    assert names["ablation"] & names["chunks"] == {"markov-08ctx-b2-disk-c16-llms"}
    assert "markov-08ctx-b2-disk-c16-llms" in names["grid"]
    with pytest.raises(ValueError, match="valid: grid, capacity, ablation, chunks"):
        G.set_runs("fig11")


def test_max_active_contexts_walks_up_to_the_first_count_over_the_bound():
    m = max_active_contexts({2: 4.0, 4: 8.0, 8: 12.0, 12: 30.0, 16: 9.0}, 10.0)
    assert (m.count, m.at_limit, m.complete) == (4, False, True)
    assert m.interpolated == pytest.approx(4 + (10 - 8) / (12 - 8) * 4)  # 6.0; 16 does not count
    assert m.label(2) == "4 (6.0)"
    top = max_active_contexts({2: 1.0, 4: 2.0, 8: 3.0}, 10.0)
    assert (top.count, top.at_limit, top.label(2)) == (8, True, ">=8")
    none = max_active_contexts({2: 11.0, 4: 20.0}, 10.0)
    assert (none.count, none.interpolated, none.label(2)) == (0, 0.0, "<2")
    gap = max_active_contexts({2: 1.0, 4: None, 8: 3.0}, 10.0)
    assert (gap.count, gap.complete, gap.label(2)) == (2, False, "2*")


def test_capacity_check_applies_the_targets_only_when_a_baseline_holds_two_contexts():
    mc = max_active_contexts
    counts = {"swap": mc({2: 5, 4: 9, 8: 20}, 10), "vllm-sq": mc({2: 5, 4: 12, 8: 20}, 10),
              "llms": mc({2: 1, 4: 2, 8: 5, 12: 20}, 10)}  # swap 4+4*(1/11)=4.36, llms 8+4*(5/15)=9.33
    assert capacity_check(counts, 10.0) == ("2.14x (swap)", ">= 2x: met")
    ratio, verdict = capacity_check(counts, 25.0)  # the same counts against the 25 ms target
    assert ratio == "2.14x (swap)" and verdict == ">= 3x: missed"
    few = {"swap": mc({2: 50, 4: 90}, 10), "llms": mc({2: 1, 4: 2, 8: 30}, 10)}
    assert capacity_check(few, 10.0) == ("-", "no baseline meets it at 2 contexts: counts only")


def _fake_set(out, name, runs, mean_of, missing=()):
    """A manifest for `runs` and a summary.json per run not in `missing`, switch_ms from `mean_of`."""
    opts = G.GridOptions(calls=4, history_tokens=(100, 200))
    meta = {"command": f"python -m bench.grid --set {name}", "date": "2026-11-22T00:00:00+00:00",
            "machine": {"cpu_count": 2, "machine": "x86_64", "platform": "Linux"}}
    budget = {"rule": "test", "reference_contexts": 16, "average_context_tokens": 150.0,
              "average_context_q8_bytes": 2e6}
    G.write_manifest(out, name, runs, opts, meta, budget)
    for r in runs:
        if r.name in missing:
            continue
        ms = mean_of(r)
        pol = {"calls": 4, "mean_switch_ms": ms, "median_switch_ms": ms, "p95_switch_ms": 2 * ms,
               "outcomes": {"hit": 1, "resident": 0, "swap": 3, "recompute": 0}, "loaded_mb": 1.0,
               "recomputed_chunks": 0}
        d = out / r.name
        d.mkdir(parents=True)
        (d / SUMMARY_JSON).write_text(json.dumps({"format": "llmaas-replay", "date": meta["date"],
                                                  "policies": {r.policy: pol}}))
    return load_set(out, name)


FACTOR = {"lmk": 100.0, "swap": 4.0, "vllm-s": 5.0, "vllm-sq": 3.0, "llms": 1.0}


def test_a_partial_grid_renders_blanks_and_says_how_many_runs_are_missing(tmp_path):
    runs = G.set_runs("grid", contexts=(2, 4))
    gone = {runs[0].name, runs[7].name, runs[-1].name}
    sr = _fake_set(tmp_path, "grid", runs, lambda r: FACTOR[r.policy] * r.contexts, missing=gone)
    text = grid_markdown(sr, "img/grid.png")
    assert f"**3 of {len(runs)} runs missing**" in text
    assert text.count("| contexts | lmk | swap | vllm-s | vllm-sq | llms |") == 6  # 3 patterns x 2 throttles
    first = text.split("**Markov, no read throttle**")[1].splitlines()
    assert first[4] == "| 2 |  | 8.0 | 10.0 | 6.0 | 2.0 | 3.0x |"  # lmk's run is missing: a blank cell
    assert "| 4 | 400.0 | 16.0 | 20.0 | 12.0 | 4.0 | 3.0x |" in text
    png = plot_grid(sr, tmp_path / "img" / "grid.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    begin, end = SET_MARKERS["grid"]
    doc = replace_section("# Benchmarks\n", text, begin, end, "## Grid")
    assert doc.index("## Grid") < doc.index(begin) < doc.index("| contexts") < doc.index(end)


def test_capacity_renders_counts_ratios_and_targets(tmp_path):
    # switch_ms = factor * contexts / budget: with budget 2, llms meets 10 ms up to 20 contexts
    runs = G.set_runs("capacity", contexts=(2, 4, 8))
    sr = _fake_set(tmp_path, "capacity", runs, lambda r: FACTOR[r.policy] * r.contexts / r.budget_contexts,
                   missing={G.RunSpec("markov", 8, "llms", 4.0).name})
    text = capacity_markdown(sr, "img/cap.png")
    rows = {line.split(" | ")[0] + " | " + line.split(" | ")[1]: line for line in text.splitlines()
            if line.startswith("| 1 (") or line.startswith("| 2 (") or line.startswith("| 4 (")}
    # budget 1, 10 ms: lmk 100n, swap 4n, vllm-s 5n, vllm-sq 3n, llms n against 10 ms
    assert rows["| 1 (2 MB) | 10 ms"].split(" | ")[2:7] == ["<2", "2 (2.5)", "2", "2 (3.3)", ">=8"]
    assert ">=2.40x (vllm-sq)" in rows["| 1 (2 MB) | 10 ms"]
    assert "4*" in rows["| 4 (8 MB) | 10 ms"]  # llms' 8-context run is missing: a lower bound
    assert "1 of 75 runs missing" not in text and f"**1 of {len(runs)} runs missing**" in text
    png = plot_capacity(sr, tmp_path / "img" / "cap.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _FakeRunner:
    """run_sets' view of a Runner: writes a summary per run; raises KeyboardInterrupt at run `stop`."""

    def __init__(self, out, opts, stop=None):
        self.out, self.opts, self.stop, self.ran = out, opts, stop, []
        self.budget = {"rule": "test", "average_context_q8_bytes": 1e6, "average_context_tokens": 100.0}

    def budget_bytes(self, spec):
        return int(spec.budget_contexts * 1e6)

    def run(self, spec, set_name):
        if len(self.ran) == self.stop:
            raise KeyboardInterrupt
        self.ran.append(spec.name)
        t = {"calls": self.opts.calls, "seed": self.opts.seed, "pattern": spec.pattern, "contexts": spec.contexts}
        s = {"format": "llmaas-replay", "trace": t, "max_tokens": self.opts.max_tokens,
             "history_tokens_range": list(self.opts.history_tokens), "max_context_tokens": self.opts.max_context_tokens,
             "throttle_mbps": spec.throttle_mbps, "chunk_tokens": spec.chunk_tokens,
             "kv_budget_bytes": self.budget_bytes(spec), "policies": {spec.policy: {}}}
        (self.out / spec.name).mkdir(parents=True)
        (self.out / spec.name / SUMMARY_JSON).write_text(json.dumps(s))
        return {"mean_switch_ms": 1.0, "loaded_mb": 0.0, "recomputed_chunks": 0}


def test_run_sets_resumes_after_an_interruption_and_refuses_other_options(tmp_path):
    opts = G.GridOptions(calls=3)
    kw = {"contexts": (2,), "at_contexts": 2, "throttle_mbps": 50.0, "meta": {"command": "c", "date": "d"}}
    first = _FakeRunner(tmp_path, opts, stop=3)
    with pytest.raises(KeyboardInterrupt):
        G.run_sets(["ablation", "chunks"], first, print_fn=lambda s: None, **kw)
    assert len(first.ran) == 3 and G.manifest_path(tmp_path, "chunks").exists()
    lines = []
    second = _FakeRunner(tmp_path, opts)
    assert G.run_sets(["ablation", "chunks"], second, print_fn=lines.append, **kw) == 10 + 4 - 3
    assert not set(first.ran) & set(second.ran)
    assert lines[0].startswith("14 runs in ablation, chunks: 3 done, 11 to run")
    assert lines[1].endswith("done, skipped") and "left" in lines[-1]
    with pytest.raises(G.GridError, match="calls 3 \\(want 4\\)"):
        G.run_sets(["chunks"], _FakeRunner(tmp_path, G.GridOptions(calls=4)), print_fn=lambda s: None, **kw)


def test_eta_scales_the_priors_by_what_runs_took():
    eta = G.Eta(G.GridOptions(calls=10, history_tokens=(100, 300)))
    a, b = G.RunSpec("markov", 4, "llms", 2.0), G.RunSpec("markov", 4, "lmk", 2.0)
    assert eta.prior(a) == pytest.approx(4 * 200 * G.PRIOR_S_PER_HISTORY_TOKEN + 10 * 1.5)
    assert eta.prior(b) > eta.prior(a)
    eta.observe(a, 2 * eta.prior(a))
    assert eta.remaining([a, b]) == pytest.approx(2 * (eta.prior(a) + eta.prior(b)))
    assert G.hms(3725) == "1h02m" and G.hms(307) == "5m07s" and G.hms(42) == "42s"


def test_markdown_block_goes_at_the_end_of_its_heading_and_is_replaced_in_place():
    from bench.markdown import replace_block

    doc = "# Benchmarks\n\n## A\n\ntext a\n\n### A.1\n\nsub\n\n## B\n\ntext b\n"
    once = replace_block(doc, "new", "<!-- x:begin -->", "<!-- x:end -->", "## A")
    assert once.index("sub") < once.index("<!-- x:begin -->\nnew\n<!-- x:end -->") < once.index("## B")
    again = replace_block(once, "newer", "<!-- x:begin -->", "<!-- x:end -->", "## A")
    assert again == once.replace("\nnew\n", "\nnewer\n")
    with pytest.raises(ValueError, match="unbalanced"):
        replace_block("<!-- x:end -->", "t", "<!-- x:begin -->", "<!-- x:end -->", "## A")
