"""The RAG cache benchmark's pure parts (bench.rag): ROUGE-L, the pooled statistics, the paraphrase
baseline, the floors and the results section. No model, no data directory."""

from __future__ import annotations

import pytest

from bench import rag
from bench.markdown import markers, replace_block
from bench.rag import NAIVE, Query, Run


def q(qid: str, answer: str, level: str = "miss", e2e: float = 1.0, reused: int = 0, retrieved: int = 100,
      group: str = "", ids=(1, 2)) -> Query:
    return Query(qid, group, level, e2e, reused, retrieved if level != "qa_bank" else 0, 0, answer,
                 token_ids=[] if level == "qa_bank" else list(ids))


def test_rouge_l_is_lcs_f1_over_lower_cased_words():
    assert rag.words("The RuntimeError, raised!") == ["the", "runtimeerror", "raised"]
    assert rag.lcs("a b c d".split(), "a c d e".split()) == 3
    assert rag.rouge_l_f1("a b c d", "A, c... D e") == pytest.approx(0.75)
    assert rag.rouge_l_f1("same words", "same words") == 1.0
    assert rag.rouge_l_f1("", "anything") == 0.0 and rag.rouge_l_f1("x", "") == 0.0


def test_percentile_is_linear_between_ranks():
    assert rag.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert rag.percentile([7.0], 0.9) == 7.0


def runs() -> list[Run]:
    """One user: Naive, an exact-reuse system, PerCache (one QA answer), and RAGCache+MeanCache."""
    naive = [q("a1", "x raises y", group="g"), q("a2", "x raises z", group="g"), q("d", "other")]
    exact = [q("a1", "x raises y", reused=50), q("a2", "x raises z", ids=(1, 3)), q("d", "other")]
    ours = [q("a1", "x raises y", e2e=0.5, reused=60), q("a2", "x raises y", "qa_bank", e2e=0.1),
            q("d", "other", e2e=0.6, reused=40)]
    both = [q("a1", "x raises y", e2e=0.9, reused=10), q("a2", "x raises y", "qa_bank", e2e=0.1), q("d", "other")]
    return [Run("main", "u", NAIVE, "", naive), Run("main", "u", rag.EXACT, "", exact),
            Run("main", "u", rag.OURS, "", ours, idle_model_s=3.0, cache_bytes={"kv_tree": 10, "qa_bank": 2}),
            Run("main", "u", rag.NO_PREDICTION, "", both), Run("main", "u", rag.OURS, "stride=1", ours)]


def test_stats_pool_latency_hits_quality_and_token_identity():
    score = rag.rouge_l_f1
    rs = runs()
    ref = rag.reference(rs)
    assert set(ref) == {("u", "a1"), ("u", "a2"), ("u", "d")}  # Naive's, default knobs only
    s = rag.stats([rs[2]], ref, score)
    assert s["queries"] == 3 and s["mean_s"] == pytest.approx(1.2 / 3)
    assert s["qa_hit"] == pytest.approx(1 / 3) and s["kv_hit"] == pytest.approx(100 / 200)
    assert s["qa_served"] == 1 and s["qa_rouge_l"] == pytest.approx(score("x raises z", "x raises y"))
    assert s["cache_bytes"] == 12 and s["idle_model_s"] == 3.0
    e = rag.stats([rs[1]], ref, score)
    assert (e["identical"], e["compared"]) == (2, 3)  # a2's ids differ
    assert rag.paraphrase_baseline(ref, score) == pytest.approx(score("x raises y", "x raises z"))


def test_floors_pass_fail_and_missing():
    summary = rag.summarise(runs(), rag.rouge_l_f1)["main"]
    assert list(summary["sensitivity"]) == ["stride=1"]
    got = {f["name"]: f["ok"] for f in summary["floors"]}
    # PerCache 0.4 s against the best other (RAGCache+MeanCache, 0.667 s): 40% lower; K/V 50% vs 5%
    assert got == {"latency": True, "prediction": True, "quality": True, "exact reuse": False}
    alone = rag.floors({rag.OURS: summary["systems"][rag.OURS]}, None)
    assert [f["ok"] for f in alone] == [None, None, None, None]
    # PerCache's ablation runs by default but is never the baseline the latency floor compares against
    ablation = "PerCache-no-QA-bank"
    assert ablation in rag.DEFAULT_SYSTEMS and ablation not in rag.BASELINES and "RAGCache+SC" in rag.BASELINES
    faster = dict(summary["systems"][rag.OURS], mean_s=0.1)
    (latency, *_) = rag.floors({**summary["systems"], ablation: faster}, summary["paraphrase_rouge_l"])
    assert latency["ok"] and rag.NO_PREDICTION in latency["detail"]


def test_the_section_has_every_system_floor_and_setting_and_fits_its_markers():
    summary = rag.summarise(runs(), rag.rouge_l_f1)
    meta = {"command": "python -m bench.rag --limit 3", "date": "2026-01-01", "machine": "test box", "runtime_s": 90.0,
            "users": ["u"], "k": 3, "max_tokens": 32, "tau_query": 0.85, "stride": 5, "gap_s": 600.0,
            "idle_after_s": 120.0, "budget_s": 600.0, "tree_cap_mib": 512, "rouge": "LCS"}
    text = rag.markdown(summary, meta)
    assert "`python -m bench.rag --limit 3`" in text and "test box" in text and "1.5 min" in text
    assert "K/V tree cap 512 MiB per user" in text
    for name in (NAIVE, rag.EXACT, rag.OURS, rag.NO_PREDICTION, "stride=1", "PASS latency", "FAIL exact reuse"):
        assert name in text, name
    begin, end = markers(rag.NAME)
    doc = replace_block("# Benchmarks\n", text, begin, end, rag.HEADING)
    assert rag.HEADING in doc and replace_block(doc, "new", begin, end, rag.HEADING).count(begin) == 1


def test_sensitivity_sweeps_are_chosen_by_name():
    import argparse

    args = argparse.Namespace(stride=5, tau_query=0.85, caps_mib=[128, 512, 2048], sensitivity=["tau_query"],
                              rounds_per_gap=0)
    assert [s for s, _ in rag.sensitivity_settings(args)] == [f"tau_query={t}" for t in (0.6, 0.7, 0.8, 0.9, 0.95)]
    args.sensitivity = []  # named none: every sweep
    assert len(rag.sensitivity_settings(args)) == 4 + 5 + 3 + 2
    args.sensitivity = ["rounds_per_gap"]
    assert rag.sensitivity_settings(args) == [("rounds_per_gap=1", {"rounds_per_gap": 1}),
                                              ("rounds_per_gap=4", {"rounds_per_gap": 4})]


def test_a_groups_systems_alternate_question_by_question_and_every_run_closes():
    from bench.rag_session import run_group

    asked: list[tuple[str, int]] = []

    class Stand:  # Session's interface: questions, ask(i), close()
        def __init__(self, engine, embedder, user, which, system, args, setting="", **knobs):
            self.system, self.questions = system, ["q0", "q1", "q2"]

        def ask(self, i):
            asked.append((self.system, i))

        def close(self):
            return Run("main", "u", self.system, "", [])

    runs = run_group(None, None, "u", "main", [("A", "", {}), ("B", "", {}), ("C", "", {})], None, session=Stand)
    assert [r.system for r in runs] == ["A", "B", "C"]
    # every question on every system before the next question, the first system turned each time
    assert asked == [("A", 0), ("B", 0), ("C", 0), ("B", 1), ("C", 1), ("A", 1), ("C", 2), ("A", 2), ("B", 2)]


@pytest.mark.parametrize("most, rounds", [(4, 4), (0, 6)])
def test_idle_time_runs_rounds_while_due_up_to_the_cap_and_the_deadline(most, rounds):
    from bench.rag_session import Clock, idle

    class Predictor:  # tick's interface: the rounds done at `now`; 10 model-s each, 6 due in all
        def __init__(self):
            self.ticks: list[float] = []

        def tick(self, now):
            self.ticks.append(now)
            if len(self.ticks) > 6:
                return []
            return [{"model_s": 10.0, "questions": ["q"] * 5}]

    pred, out = Predictor(), Run("main", "u", rag.OURS, "", [])
    idle(pred, Clock(0.0), out, 100.0, 1000.0, most)
    assert out.rounds == rounds and out.idle_model_s == 10.0 * rounds and out.predicted == 5 * rounds
    assert pred.ticks[:rounds] == [100.0 + 10.0 * i for i in range(rounds)]  # the clock moves by model time
    assert len(pred.ticks) == (rounds if most else rounds + 1)  # a cap stops ticking; no cap asks until none is due
    # the deadline ends idle time whatever is still due
    pred, out = Predictor(), Run("main", "u", rag.OURS, "", [])
    idle(pred, Clock(0.0), out, 100.0, 125.0, most)
    assert out.rounds == 3 and pred.ticks == [100.0, 110.0, 120.0]
