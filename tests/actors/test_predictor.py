"""The query predictor (actors.predictor): idle detection on an injected clock, rounds that populate the
caches through the real path, yielding to a real call (by the order of events, with gates), its state
across a restart, and the priority lock on its own."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from actors.config import RagConfig
from actors.messages import KVKey, PreemptedError, RagCall
from actors.predictor import QueryPredictor, mains_power, parse_questions
from scheduler.ragcache import IdlePolicy
from actors.priority import PriorityLock
from actors.rag import run_rag_call
from actors.swapio import KVSwapIO

DOCS = ["Mount Fuji is the highest mountain in Japan. It is 3,776 metres tall and last erupted in 1707.",
        "The Nile flows north through eleven countries. It empties into the Mediterranean Sea in Egypt."]


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Executor:
    """`ExecutorPort.rag_call` and `activity` over the session's engine, as the executor runs them; a
    background call stops when `stop` says so (the priority lock's `should_yield`)."""

    def __init__(self, engine, io) -> None:
        self.engine, self.io = engine, io
        self.calls: list[RagCall] = []
        self.last, self.running = 0.0, 0
        self.stop = lambda: False

    def rag_call(self, call):
        self.calls.append(call)
        return run_rag_call(self.engine, self.io, call, should_stop=self.stop if call.background else None)

    def activity(self):
        return self.last, self.running


def predictor(tmp_path, engine, embedder, clock, idle=None, **cfg):
    io = KVSwapIO(str(tmp_path / "chunks"), KVKey(engine.model.fingerprint or "m"))
    ex = Executor(engine, io)
    config = RagConfig(k=2, max_tokens=6, idle_after_s=30, stride=2, **cfg)
    p = QueryPredictor(str(tmp_path), engine.tok, ex, io.delete_context, io.key, config, embed=embedder.embed,
                       clock=clock, power=lambda: None, idle=idle)
    return p, ex


def test_it_predicts_only_when_idle_and_due_and_fills_both_levels(tmp_path, engine, embedder):
    clock = Clock()
    p, ex = predictor(tmp_path, engine, embedder, clock)
    col = p.create_collection("app", "facts")
    for d in DOCS:
        p.add_document("app", col, d)
    assert p.tick(clock.t + 1) == [] and ex.calls == []  # the documents' quiet period has not passed
    ex.last, ex.running = clock.t + 50, 1  # a real call runs: busy
    assert p.tick(clock.t + 100) == []
    ex.running = 0  # it ended at +50: idle from +80 (idle_after_s 30)
    assert p.tick(clock.t + 79) == []
    (done,) = p.tick(clock.t + 81)
    assert done["kind"] == "knowledge" and done["collection"] == col and not done.get("preempted")
    assert all(c.background for c in ex.calls)  # every model call of the round was low priority
    assert 1 <= len(done["questions"]) <= 2, done
    # the predicted questions went through the real path: K/V tree and QA bank, marked as the
    # predictor's; prefilled only while the round covers passages (answers_after_coverage)
    entries = p.store.qa_entries("app", col, "")
    assert {e.question for e in entries} == set(done["questions"]) and all(e.predicted for e in entries)
    assert all(e.answer is None for e in entries) and len(p.rag.tree("app")) >= 1
    # every passage of the round heads a path of the passages nearest it (passage_depth 2: it and the
    # other one), whatever its question retrieved
    ids = [c.id for c in p.bank.chunks_after("app", col, 0, 10)]
    assert len(ids) == 2 and [p.rag.passage_path("app", col, c) for c in ids] == [ids, ids[::-1]]
    assert all(len(p.rag.tree("app").match(p.rag.passage_path("app", col, c))) == 2 for c in ids)
    queries = [c for c in ex.calls if c.save or c.load]
    assert len(queries) == len(done["questions"]) + done.get("passage_paths", 0)
    assert [c.decode for c in ex.calls[-len(entries):]] == [False] * len(entries)
    spent = p.idle.spent_today("app", clock.t + 90)
    assert spent > 0
    # no round is due: the conversion decodes them (the scheduler says decoding pays at tau_query 0.85),
    # each path's K/V read back from the tree
    (answers,) = p.tick(clock.t + 90)
    assert answers["kind"] == "answers" and sorted(answers["questions"]) == sorted(done["questions"])
    entries = p.store.qa_entries("app", col, "")
    assert all(e.answer and e.predicted for e in entries) and p.rag.unanswered("app") == []
    assert p.idle.spent_today("app", clock.t + 90) > spent
    assert p.tick(clock.t + 95) == []  # nothing new is due


def first_round(tmp_path, engine, embedder, clock, **cfg):
    """A predictor over DOCS after its first knowledge round: the predictor, its executor, the
    collection and what the round did."""
    p, ex = predictor(tmp_path, engine, embedder, clock, **cfg)
    col = p.create_collection("app", "facts")
    for d in DOCS:
        p.add_document("app", col, d)
    (done,) = p.tick(clock.t + 100)
    return p, ex, col, done


def test_percaches_own_rules_answer_at_once_and_cache_no_passage_alone(tmp_path, engine, embedder):
    clock = Clock()
    p, ex, col, done = first_round(tmp_path, engine, embedder, clock, answers_after_coverage=False,
                                   passage_depth=0)
    entries = p.store.qa_entries("app", col, "")
    assert done["kind"] == "knowledge" and {e.question for e in entries} == set(done["questions"])
    assert "passage_paths" not in done
    assert len([c for c in ex.calls if c.save or c.load]) == len(done["questions"])
    assert entries and all(e.answer for e in entries) and p.tick(clock.t + 110) == []


def test_without_a_qa_bank_nothing_predicted_is_decoded(tmp_path, engine, embedder):
    p, ex, col, done = first_round(tmp_path, engine, embedder, Clock(), qa_bank=False, answers_after_coverage=False)
    queries = [c for c in ex.calls if c.save or c.load]  # the predicted questions' (the rest write text)
    assert done["questions"] and queries and not any(c.decode for c in queries)
    assert len(p.rag.tree("app")) >= 1 and p.store.qa_entries("app", col, "") == []


def test_without_predicted_tree_idle_work_answers_into_the_qa_bank_only(tmp_path, engine, embedder):
    # PerCache's RAGCache + Sleep-time Compute baseline: the tree fills from real queries alone
    clock = Clock()
    p, ex, col, done = first_round(tmp_path, engine, embedder, clock, predict_tree=False)
    entries = p.store.qa_entries("app", col, "")
    assert done["questions"] and "passage_paths" not in done and len(p.rag.tree("app")) == 0
    assert not any(c.save or c.load for c in ex.calls)  # nothing loaded from or saved to the tree
    assert {e.question for e in entries} == set(done["questions"]) and all(e.answer for e in entries)
    clock.t += 200
    real = p.query("app", col, "Which sea does the Nile flow into?", {"max_tokens": 6, "tau_query": 1.01})
    # (no stored answer may serve it) its path enters the tree
    assert real.level == "miss" and len(p.rag.tree("app")) >= 1


def test_idle_time_decodes_the_answers_a_new_document_made_stale(tmp_path, engine, embedder):
    clock = Clock()
    no_rounds = IdlePolicy(idle_after_s=30, abstract_quiet_s=1e9, stride=2)  # only the stale answer to do
    p, ex = predictor(tmp_path, engine, embedder, clock, idle=no_rounds)
    col = p.create_collection("app", "facts")
    p.add_document("app", col, DOCS[0])
    assert p.query("app", col, "How tall is Mount Fuji?", {"max_tokens": 6}).level == "miss"
    p.add_document("app", col, "Mount Fuji was measured again in 2026: it is 3,777 metres tall.")
    assert [e.question for e in p.rag.unanswered("app")] == ["How tall is Mount Fuji?"]
    n = len(ex.calls)
    (done,) = p.tick(clock.t + 100)
    assert done["kind"] == "answers" and done["questions"] == ["How tall is Mount Fuji?"]
    assert p.rag.unanswered("app") == [] and len(ex.calls) == n + 1 and ex.calls[-1].background
    (entry,) = p.store.qa_entries("app", col, "")
    assert entry.answer and not entry.predicted
    assert p.tick(clock.t + 200) == []


@pytest.mark.parametrize("asked_meanwhile", [False, True])
def test_once_the_tree_cap_grows_idle_time_prefills_the_evicted_paths_again(tmp_path, engine, embedder,
                                                                            asked_meanwhile):
    """The Fuji path's nodes are evicted under a small cap; after a restart with a larger one, idle time
    prefills the path again. `asked_meanwhile`: the re-prefill is listed, a real call takes the
    executor back first, and the user's own question along the path brings its nodes back; the listed
    re-prefill is then dropped, not run."""
    clock = Clock()
    no_rounds = IdlePolicy(idle_after_s=30, abstract_quiet_s=1e9, history_quiet_s=1e9, stride=2)
    p, ex = predictor(tmp_path, engine, embedder, clock, idle=no_rounds)
    col = p.create_collection("app", "facts")
    for d in DOCS:
        p.add_document("app", col, d)
    fuji = p.query("app", col, "How tall is Mount Fuji?", {"max_tokens": 6})
    tree = p.rag.tree("app")
    path_bytes = sum(n.nbytes for n in tree)  # the head is not a node of the tree
    p.rag.config = replace(p.rag.config, tree_cap_bytes=p.rag._heads[("app", "")] + path_bytes)
    assert p.tick(clock.t + 100) == []  # the first look only notes the cap
    nile = p.query("app", col, "Where does the Nile flow into the sea?", {"max_tokens": 6})
    assert [s["chunk"] for s in nile.sources] == [s["chunk"] for s in fuji.sources][::-1]  # another path
    (evicted,) = p.rag.evicted("app")  # the Fuji path's nodes made room for the Nile path's
    assert p.tick(clock.t + 200) == [] and p.rag.evicted("app") == [evicted]  # the cap did not grow
    p.close()
    q, ex = predictor(tmp_path, engine, embedder, clock, idle=no_rounds)  # a restart with the default cap (larger)
    before = {e.id: e.answer for e in q.store.qa_entries("app", col, "")}
    if asked_meanwhile:
        ex.stop = lambda: True  # a real call arrives at the re-prefill's first slice
        (cut,) = q.tick(clock.t + 250)
        assert cut.get("preempted") and q.known["app"]["reprefill"] == [evicted.entry_id]
        ex.stop = lambda: False
        asked = q.query("app", col, "How tall is Mount Fuji?", {"max_tokens": 6, "tau_query": 1.01})
        assert asked.token_ids == fuji.token_ids and q.rag.evicted("app") == []  # the path is whole again
        n = len(ex.calls)
        assert q.tick(clock.t + 300) == [] and len(ex.calls) == n  # nothing prefilled twice
        assert q.known["app"]["reprefill"] == []
        q.close()
        return
    (done,) = q.tick(clock.t + 300)
    assert done["prefilled"] == ["How tall is Mount Fuji?"] and done["questions"] == []
    assert [(c.decode, c.background) for c in ex.calls] == [(False, True)]
    assert q.rag.evicted("app") == [] and {e.id: e.answer for e in q.store.qa_entries("app", col, "")} == before
    assert q.tick(clock.t + 400) == [] and q.known["app"]["reprefill"] == []
    hit = q.query("app", col, "How tall is Mount Fuji?", {"max_tokens": 6, "tau_query": 1.01})
    assert hit.level == "kv_tree" and hit.reused_tokens == hit.retrieved_tokens and hit.token_ids == fuji.token_ids
    q.close()


def test_a_real_call_takes_the_executor_back_and_the_round_stays_pending(tmp_path, engine, embedder):
    clock = Clock()
    p, ex = predictor(tmp_path, engine, embedder, clock)
    col = p.create_collection("app", "facts")
    p.add_document("app", col, DOCS[0])
    checks = []
    ex.stop = lambda: checks.append(1) or len(checks) > 3  # a real call arrives at the fourth slice
    (done,) = p.tick(clock.t + 100)
    assert done["preempted"] and done["questions"] == [] and len(checks) == 4
    assert p.store.qa_entries("app", col, "") == [] and len(p.rag.tree("app")) == 0
    ex.stop = lambda: False
    (again,) = p.tick(clock.t + 200)  # still due: it runs in the next idle period
    assert again["kind"] == "knowledge" and not again.get("preempted")


def test_knowledge_rounds_go_on_until_every_passage_has_its_question(tmp_path, engine, embedder):
    """Stride 1: one passage a round, in the order they arrived; the cursor survives a restart; a
    deleted collection leaves nothing pending."""
    clock = Clock()
    one = IdlePolicy(idle_after_s=30, history_quiet_s=1e9, stride=1)
    p, ex = predictor(tmp_path, engine, embedder, clock, idle=one, answers_after_coverage=False)
    col = p.create_collection("app", "facts")
    for d in DOCS:
        p.add_document("app", col, d)
    first, second = p.bank.chunks_after("app", col, 0, 2)
    (done,) = p.tick(clock.t + 100)
    assert done["kind"] == "knowledge" and len(done["questions"]) <= 1
    prompts = [engine.tok.decode(c.ids) for c in ex.calls[:2]]  # the abstract's, then the question's
    assert all(first.text in t and second.text not in t for t in prompts)
    assert p.known["app"]["collections"][col]["cursor"] == first.id and p.known["app"]["pending"] == {col: True}
    p.close()
    p, ex = predictor(tmp_path, engine, embedder, clock, idle=one,  # a restart between the rounds
                      answers_after_coverage=False)
    (done,) = p.tick(clock.t + 200)
    assert done["kind"] == "knowledge" and p.known["app"]["collections"][col]["cursor"] == second.id
    prompts = [engine.tok.decode(c.ids) for c in ex.calls[:2]]  # the abstract (with round 1's terms) aside
    assert all(second.text in t and first.text not in t for t in (prompts[0], prompts[1].split("Passage:")[1]))
    assert p.known["app"]["pending"] == {} and p.tick(clock.t + 300) == []  # every passage had its round
    p.add_document("app", col, "The Danube flows east through ten countries into the Black Sea.")
    assert p.known["app"]["pending"] == {col: True}
    p.delete_collection("app", col)
    assert p.known["app"]["pending"] == {} and col not in p.known["app"]["collections"]
    assert p.tick(clock.t + 400) == []
    p.close()


def test_its_state_survives_a_restart(tmp_path, engine, embedder):
    clock = Clock()
    p, _ = predictor(tmp_path, engine, embedder, clock)
    col = p.create_collection("app", "facts")
    p.add_document("app", col, DOCS[0])
    for q in ("How tall is Mount Fuji?", "When did Fuji erupt?", "Where is Mount Fuji?"):
        p.query("app", col, q, {"max_tokens": 4})
    p.close()
    q, _ = predictor(tmp_path, engine, embedder, clock)
    assert q.known["app"]["pending"] == {col: True}
    assert q.known["app"]["recent"][col] == ["How tall is Mount Fuji?", "When did Fuji erupt?", "Where is Mount Fuji?"]
    assert q.idle.to_dict()["apps"] == p.idle.to_dict()["apps"]
    assert q.idle.due_abstract("app", clock.t + 100) and q.idle.due_history("app", clock.t + 100)
    q.close()


def test_the_priority_lock_lets_low_priority_work_go_at_the_next_slice():
    """By the order of events: background work holds the lock and runs slices; a real call comes and
    waits; the work stops at its next slice; the real call runs."""
    lock, events = PriorityLock(), []
    started, waiting, release = threading.Event(), threading.Event(), threading.Event()

    def background():
        try:
            with lock.background():
                for i in range(1000):
                    events.append(f"slice {i}")
                    started.set()
                    if i == 2:
                        waiting.wait(10)  # the real call is waiting from here on
                    if lock.should_yield():
                        raise PreemptedError("yield")
        except PreemptedError:
            events.append("yielded")

    def real():
        with lock.real():
            events.append("real call runs")
            release.wait(10)

    bg = threading.Thread(target=background)
    bg.start()
    started.wait(10)
    rc = threading.Thread(target=real)
    rc.start()
    while not lock.should_yield():
        pass
    events.append("real call waits")
    waiting.set()
    bg.join(10)
    release.set()
    rc.join(10)
    assert events[-2:] == ["yielded", "real call runs"] and "slice 3" not in events
    assert lock.in_flight == 0 and lock.last_call > 0
    # work that gets the lock while a real call waits for it gives it up before its first slice
    lock._waiting = 1  # as `real` counts a call blocked on the lock
    with pytest.raises(PreemptedError):
        with lock.background():
            events.append("never")
    assert "never" not in events and not lock._lock.locked()


def test_questions_are_parsed_from_numbered_or_bulleted_lines():
    text = "1. How tall is Fuji?\n- When did it erupt?\n\nok\n2) how tall is fuji?\n* Where is the Nile?"
    assert parse_questions(text, 5) == ["How tall is Fuji?", "When did it erupt?", "Where is the Nile?"]
    assert parse_questions(text, 1) == ["How tall is Fuji?"]
    said = ('The user\'s documents are about:\n\nThe user might ask: "What is the purpose of coroutines?"\n'
            "Question: Why use with?\nWhat does the docs: section say?")  # the default model's habits
    assert parse_questions(said, 5) == ["What is the purpose of coroutines?", "Why use with?",
                                        "What does the docs: section say?"]


def test_mains_power_from_sysfs(tmp_path):
    assert mains_power(str(tmp_path / "none")) is None
    for name, kind, online in (("BAT0", "Battery", None), ("AC", "Mains", "0")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "type").write_text(kind + "\n")
        if online is not None:
            (tmp_path / name / "online").write_text(online + "\n")
    assert mains_power(str(tmp_path)) is False
    (tmp_path / "AC" / "online").write_text("1\n")
    assert mains_power(str(tmp_path)) is True
