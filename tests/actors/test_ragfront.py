"""The RAG cache (actors.ragfront.RagCache) over a real knowledge bank, store, embedder and model: exact
reuse along tree paths (also from a fresh cache over the same files), the QA bank's threshold, LFU
eviction under the cap, deletion, and apps kept apart."""

from __future__ import annotations

from dataclasses import replace

import pytest

from actors.messages import CallTimeoutError, KVKey
from actors.rag import node_key, run_rag_call, stream_rag_call
from actors.ragfront import RagCache, RagConfig
from actors.swapio import KVSwapIO
from engine.rag import RagTemplate
from storage.knowledge import KnowledgeBank, KnowledgeConfig
from storage.ragstore import RagStore

DOCS = {
    "paris": "The Eiffel Tower stands in Paris. It was finished in 1889 for the World's Fair and is 330 metres tall.",
    "fuji": "Mount Fuji is the highest mountain in Japan. It is 3,776 metres tall and last erupted in 1707.",
    "nile": "The Nile flows north through eleven countries. It empties into the Mediterranean Sea in Egypt.",
    "amazon": "The Amazon carries more water than any other river. It flows east into the Atlantic Ocean.",
    "everest": "Mount Everest is the highest mountain on Earth, at 8,849 metres, on the border of Nepal and China.",
}
QUESTIONS = [  # retrievals that share prefixes: the tree reuses the head and the passages before a difference
    "How tall is Mount Fuji?",
    "When did Mount Fuji last erupt?",
    "Which mountain is the highest on Earth?",
    "How tall is the Eiffel Tower?",
    "Where does the Nile flow?",
]


class Parts:
    def __init__(self, tmp_path, engine, embedder, **cfg):
        self.io = KVSwapIO(str(tmp_path / "chunks"), KVKey(engine.model.fingerprint or "m"))
        db = str(tmp_path / "registry.db")
        self.bank = KnowledgeBank(db, tokenize=engine.tok.encode, embed=embedder.embed,
                                  config=KnowledgeConfig(chunk_tokens=64))
        self.store = RagStore(db)
        self.calls = []

        def run(call):
            self.calls.append(call)
            return run_rag_call(engine, self.io, call)

        def run_stream(call):
            self.calls.append(call)
            return stream_rag_call(engine, self.io, call)

        self.cache = RagCache(self.bank, self.store, embedder.embed, RagTemplate(engine.tok), run,
                              self.io.delete_context, self.io.key, RagConfig(k=3, **cfg), run_stream=run_stream)

    def add(self, app):
        col = self.bank.create_collection(app, "facts")
        docs = {name: self.bank.add_document(app, col, text, name=name) for name, text in DOCS.items()}
        return col, docs


@pytest.fixture(scope="module")
def naive(tmp_path_factory, engine, embedder):
    """The Naive replies to QUESTIONS (no cache: what every cached reply is checked against), once."""
    p = Parts(tmp_path_factory.mktemp("naive"), engine, embedder, qa_bank=False, kv_tree=False)
    col, _ = p.add("app")
    return {q: p.cache.query("app", col, q, max_tokens=12) for q in QUESTIONS}


def test_answers_from_cached_nodes_are_those_of_the_whole_prefill(tmp_path, engine, embedder, naive):
    p = Parts(tmp_path, engine, embedder, qa_bank=False)
    col, _ = p.add("app")
    got = [p.cache.query("app", col, q, max_tokens=12) for q in QUESTIONS]
    for q, a in zip(QUESTIONS, got):
        assert a.token_ids == naive[q].token_ids, q
        assert [s["chunk"] for s in a.sources] == [s["chunk"] for s in naive[q].sources]
    assert got[0].level == "miss" and got[0].reused_tokens == 0
    assert sum(a.reused_chunks for a in got) > 0  # shared prefixes were reused...
    assert all(a.reused_tokens <= a.retrieved_tokens for a in got)
    assert any(a.level == "kv_tree" for a in got[1:])
    # ...and a fresh cache over the same files (a restart: nothing in memory) reuses every node from disk
    again = Parts(tmp_path, engine, embedder, qa_bank=False)
    for q in QUESTIONS:
        a = again.cache.query("app", col, q, max_tokens=12)
        assert a.token_ids == naive[q].token_ids and a.level == "kv_tree", q
        assert a.reused_tokens == a.retrieved_tokens  # the whole path was cached
    assert all(c.save == [] for c in again.calls)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_passages_path_cached_in_idle_time_is_reused_exactly_by_a_question_it_heads(tmp_path, engine, embedder,
                                                                                     naive, depth):
    p = Parts(tmp_path, engine, embedder, qa_bank=False, passage_depth=depth)
    col, _ = p.add("app")
    q = QUESTIONS[0]
    first = naive[q].sources[0]["chunk"]
    path = p.cache.passage_path("app", col, first)
    assert len(path) == depth and path[0] == first and len(set(path)) == depth
    assert p.cache.cache_passage("app", col, first) and not p.cache.cache_passage("app", col, first)  # once
    nodes = p.cache.tree("app").match(path)
    assert len(nodes) == depth and all(n.nbytes > 0 for n in nodes) and not p.calls[-1].decode
    a = p.cache.query("app", col, q, max_tokens=12)
    retrieved = [s["chunk"] for s in naive[q].sources]
    shared = next((i for i, (x, y) in enumerate(zip(path, retrieved)) if x != y), min(len(path), len(retrieved)))
    assert shared == depth  # the question retrieves the passage's nearest next: every cached node counts
    assert a.reused_chunks == shared and a.level == "kv_tree" and a.token_ids == naive[q].token_ids
    off = Parts(tmp_path / "off", engine, embedder, kv_tree=False)
    assert not off.cache.cache_passage("app", col, first) and off.calls == []
    none = Parts(tmp_path / "none", engine, embedder, passage_depth=0)
    assert not none.cache.cache_passage("app", col, first) and none.calls == []
    with pytest.raises(ValueError, match="passage_depth"):
        RagConfig(passage_depth=-1)


def test_blending_takes_other_paths_nodes_and_with_everything_recomputed_answers_as_the_whole_prefill(
        tmp_path, engine, embedder, naive):
    p = Parts(tmp_path, engine, embedder, qa_bank=False, blend_ratio=1.0)
    col, _ = p.add("app")
    got = [p.cache.query("app", col, q, max_tokens=12) for q in QUESTIONS]
    assert [a.token_ids for a in got] == [naive[q].token_ids for q in QUESTIONS]
    blended = [(a, c) for a, c in zip(got, p.calls) if c.blend]
    assert blended and all(a.blended_tokens == a.recomputed_tokens > 0 and a.level == "kv_tree"
                           and "blend" in a.latency and c.save == [] for a, c in blended)
    tree = p.cache.tree("app")  # blended passages made no nodes: every node's records are on disk
    assert all(p.io.store.indices(node_key(replace(p.io.key, app="app"), tree.path_of(n.node_id))) for n in tree)
    q = QUESTIONS[[c.blend != [] for c in p.calls].index(True)]  # a path blended once: next time exact...
    second = p.cache.query("app", col, q, max_tokens=12)
    assert not p.calls[-1].blend and p.calls[-1].save and second.blended_tokens == 0
    third = p.cache.query("app", col, q, max_tokens=12)  # ...and then reused exactly
    assert third.reused_tokens == third.retrieved_tokens and third.token_ids == naive[q].token_ids
    with pytest.raises(ValueError, match="blend_ratio"):
        RagConfig(blend_ratio=1.5)


def test_the_qa_bank_answers_a_similar_question_at_once_and_not_a_different_one(tmp_path, engine, embedder):
    p = Parts(tmp_path, engine, embedder, tau_query=0.9)
    col, _ = p.add("app")
    first = p.cache.query("app", col, "How tall is Mount Fuji?", max_tokens=12)
    assert first.level == "miss"
    same = p.cache.query("app", col, "How tall is Mount Fuji?", max_tokens=12)
    assert same.level == "qa_bank" and same.answer == first.answer and same.similarity >= 0.9
    assert len(p.calls) == 1  # no prefill, no decode
    other = p.cache.query("app", col, "Where does the Amazon river flow?", max_tokens=12)
    assert other.level != "qa_bank" and len(p.calls) == 2
    below = p.cache.query("app", col, "How tall is Mount Fuji?", tau_query=1.01, max_tokens=12)
    assert below.level != "qa_bank"
    empty = p.bank.create_collection("app", "empty")  # nothing to retrieve: the question alone
    nothing = p.cache.query("app", empty, "How tall is Mount Fuji?", max_tokens=4)
    assert nothing.level == "miss" and nothing.sources == [] and nothing.retrieved_tokens == 0


def test_the_qa_bank_keeps_to_a_querys_sampling(tmp_path, engine, embedder):
    """The bank's answers are greedy: a penalized or sampled query gets (and stores) its own; a stored
    answer longer than a query's max_tokens is cut to it."""
    p = Parts(tmp_path, engine, embedder, tau_query=0.9)
    col, _ = p.add("app")
    q = "How tall is Mount Fuji?"
    first = p.cache.query("app", col, q, max_tokens=12)
    for sampling in ({"repetition_penalty": 1.3}, {"temperature": 0.7, "seed": 1}, {"stop": ["metres"]}):
        other = p.cache.query("app", col, q, max_tokens=12, **sampling)
        assert other.level != "qa_bank", sampling
    assert [e.answer for e in p.store.qa_entries("app", col, "")] == [first.answer]
    short = p.cache.query("app", col, q, max_tokens=3)
    assert short.level == "qa_bank" and short.finish_reason == "length"
    assert engine.tok.encode(first.answer)[:3] == engine.tok.encode(short.answer) != engine.tok.encode(first.answer)
    assert len(p.calls) == 4  # the first query and the three of other sampling, none for the short one


def test_a_streamed_answer_comes_token_by_token_and_a_stream_closed_early_stores_nothing(tmp_path, engine, embedder):
    p = Parts(tmp_path, engine, embedder, tau_query=0.9)
    col, _ = p.add("app")
    q = QUESTIONS[0]
    stream = p.cache.query_stream("app", col, q, max_tokens=12)
    assert isinstance(next(stream), str)
    stream.close()  # the client went away after the first delta: the model's call stopped
    assert len(p.cache.tree("app")) == 0 and len(p.store.qa_vectors("app", col, "")[0]) == 0
    assert p.io.usage_bytes() == 0  # not even the head's records
    *deltas, answer = p.cache.query_stream("app", col, q, max_tokens=12)
    assert answer.level == "miss" and len(deltas) > 1 and "".join(deltas) == answer.answer
    exact = p.cache.query("app", col, q, max_tokens=12, tau_query=1.01)  # not streamed, from the cached nodes
    assert exact.level == "kv_tree" and exact.token_ids == answer.token_ids
    *deltas, hit = p.cache.query_stream("app", col, q, max_tokens=12)
    assert hit.level == "qa_bank" and deltas == [answer.answer]  # a stored answer comes in one piece
    n_calls, n_nodes = len(p.calls), len(p.cache.tree("app"))
    with pytest.raises(CallTimeoutError):  # past its deadline the call stops before its first node
        list(p.cache.query_stream("app", col, QUESTIONS[2], max_tokens=12, deadline=0.0))
    assert len(p.calls) == n_calls + 1 and len(p.cache.tree("app")) == n_nodes


def test_apps_share_no_nodes_and_no_answers(tmp_path, engine, embedder):
    p = Parts(tmp_path, engine, embedder)
    cols = {app: p.add(app)[0] for app in ("a", "b")}
    p.cache.query("a", cols["a"], QUESTIONS[0], max_tokens=8)
    b = p.cache.query("b", cols["b"], QUESTIONS[0], max_tokens=8)
    assert b.level == "miss" and b.reused_tokens == 0  # app a's answer and nodes are not b's
    call_a, call_b = p.calls
    assert call_b.load == [] and not {n.key for n in call_a.save} & {n.key for n in call_b.save}
    assert len(p.cache.tree("a")) == len(p.cache.tree("b")) == 3


def test_nodes_past_the_cap_are_evicted_least_used_first_with_their_records(tmp_path, engine, embedder):
    p = Parts(tmp_path, engine, embedder, qa_bank=False)
    col, _ = p.add("app")
    p.cache.query("app", col, QUESTIONS[0], max_tokens=4)
    tree = p.cache.tree("app")
    per_node = max(n.nbytes for n in tree)
    p.cache.config = replace(p.cache.config, tree_cap_bytes=p.cache._heads[("app", "")] + 4 * per_node)
    for q in QUESTIONS[1:]:
        p.cache.query("app", col, q, max_tokens=4)
        assert tree.bytes() <= 4 * per_node
    key = replace(p.io.key, app="app")
    live = {node_key(key, tree.path_of(n.node_id)) for n in tree}
    written = {n.key for c in p.calls for n in c.save}
    assert live and live < written
    for k in written - live - {node_key(key, ())}:
        assert p.io.store.indices(k) == []  # an evicted node's records are gone
    for k in live:
        assert p.io.store.indices(k)
    assert {r["node_id"] for r in p.store.load_tree("app", "").rows} == {n.node_id for n in tree}


def test_deleting_a_document_drops_its_nodes_and_the_answers_it_gave(tmp_path, engine, embedder):
    p = Parts(tmp_path, engine, embedder)
    col, docs = p.add("app")
    p.cache.query("app", col, "How tall is Mount Fuji?", max_tokens=8)
    tree = p.cache.tree("app")
    n_before = len(tree)
    gone = p.bank.delete_document("app", docs["fuji"])
    p.cache.chunks_deleted("app", gone)
    assert len(tree) < n_before and not {int(n.chunk_id) for n in tree} & set(gone)
    again = p.cache.query("app", col, "How tall is Mount Fuji?", max_tokens=8)
    assert again.level != "qa_bank"  # the stored answer came from the deleted passage
    assert all(s["document"] != docs["fuji"] for s in again.sources)


def test_a_later_document_that_ranks_for_a_stored_question_makes_its_answer_stale(tmp_path, engine, embedder):
    p = Parts(tmp_path, engine, embedder, tau_query=0.9)
    col, _ = p.add("app")
    p.cache.query("app", col, "How tall is Mount Fuji?", max_tokens=8)
    p.cache.query("app", col, "Where does the Amazon flow?", max_tokens=8)
    unrelated = p.bank.add_document("app", col, "Bread is baked from flour, water, salt and yeast.")
    assert p.cache.refresh("app", col, [c.id for c in p.bank.chunks("app", unrelated)]) == []
    news = p.bank.add_document("app", col, "Mount Fuji was measured again in 2026: it is 3,777 metres tall.")
    (stale,) = p.cache.refresh("app", col, [c.id for c in p.bank.chunks("app", news)])
    assert p.store.qa_entry("app", stale).question == "How tall is Mount Fuji?"
    assert [e.id for e in p.cache.unanswered("app")] == [stale]
    again = p.cache.query("app", col, "How tall is Mount Fuji?", max_tokens=8, replaces=stale)
    assert again.level != "qa_bank" and news in {s["document"] for s in again.sources}
    assert p.cache.unanswered("app") == [] and {e.question for e in p.store.qa_entries("app", col, "")} == {
        "How tall is Mount Fuji?", "Where does the Amazon flow?"}
    assert p.cache.query("app", col, "How tall is Mount Fuji?", max_tokens=8).level == "qa_bank"


def test_a_real_query_does_not_wait_for_a_background_one(tmp_path, engine, embedder):
    """Idle work holds no lock of the cache while its model call runs: a real query goes through (the
    executor's priority lock then makes the model call itself yield; tests/actors/test_predictor.py)."""
    import threading

    p = Parts(tmp_path, engine, embedder, qa_bank=False)
    col, _ = p.add("app")
    gate, inside = threading.Event(), threading.Event()
    run = p.cache.run

    def held(call):
        if call.background:
            inside.set()
            assert gate.wait(60)
        return run(call)

    p.cache.run = held
    bg = threading.Thread(target=p.cache.query, args=("app", col, QUESTIONS[0]),
                          kwargs={"background": True, "max_tokens": 4})
    bg.start()
    assert inside.wait(60)
    real = p.cache.query("app", col, QUESTIONS[1], max_tokens=4)  # while the background call is held
    assert real.token_ids and bg.is_alive()
    gate.set()
    bg.join(60)
    assert not bg.is_alive() and len(p.cache.tree("app")) >= 3
