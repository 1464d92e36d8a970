"""RAG store: K/V tree rows, the QA bank and predictor state per app and adapter; isolation between apps,
the vectors cache across connections, reopening, and sharing one SQLite file with the registry and the
knowledge bank."""

from __future__ import annotations

import json
import sqlite3
import zlib

import numpy as np
import pytest

from scheduler.ragtree import ROW_FIELDS as TREE_ROW_FIELDS
from scheduler.ragtree import KVTree
from storage.errors import InvalidKeyError, StorageError
from storage.knowledge import KnowledgeBank
from storage.ragstore import (ROW_FIELDS, SOURCE_BYTES, QAEntryNotFoundError, RagStore, RagStoreConfig,
                              RagStoreError, TreeRows)
from storage.registry import Registry

DIM = 8


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "registry.db")


@pytest.fixture
def store(path):
    with RagStore(path, clock=Clock()) as s:
        yield s


def vec(seed: int, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(dim)


def sample_tree() -> KVTree:
    tree = KVTree()
    tree.insert([7, 8, 9], tokens=[10, 11, 12], nbytes=[100, 110, 120], now=5.0)  # nodes 0, 1, 2
    tree.insert([7, 3], tokens=4, nbytes=40, now=6.0)  # node 3 under node 0
    tree.touch(tree.match([7, 8]), now=7.0)
    return tree


# -- K/V tree ----------------------------------------------------------------------------------------


def test_row_fields_are_the_trees():
    assert ROW_FIELDS == TREE_ROW_FIELDS


def test_tree_rows_round_trip(store):
    assert store.load_tree("app", "") == TreeRows([], 0, 0) and store.trees("app") == []
    tree = sample_tree()
    tree.remove(2)  # next_id stays 4: id 2 must not be handed out again
    store.upsert_nodes("app", "", list(reversed(tree.to_rows())), tree.next_id)
    saved = store.load_tree("app", "")
    assert saved.rows == tree.to_rows() and [r["node_id"] for r in saved.rows] == [0, 1, 3]
    assert saved.next_id == 4 and saved.head_nbytes == 0 and saved.rows[0]["parent"] is None
    back = KVTree.from_rows(saved.rows, saved.next_id)
    assert back.to_rows() == tree.to_rows() and back.next_id == 4

    store.set_head("app", "", 512)
    assert store.tree_bytes("app", "") == 100 + 110 + 40 + 512
    assert store.count_hits("app", "", [0, 3, 99], now=50.0) == 2
    rows = {r["node_id"]: r for r in store.load_tree("app", "").rows}
    assert (rows[0]["hits"], rows[0]["last_use"], rows[3]["hits"], rows[1]["hits"]) == (2, 50.0, 1, 1)

    store.upsert_nodes("app", "", [{**rows[1], "nbytes": 1}], next_id=2)  # replace; next_id never moves back
    assert store.delete_nodes("app", "", [3, 42]) == 1
    saved = store.load_tree("app", "")
    assert [(r["node_id"], r["nbytes"]) for r in saved.rows] == [(0, 100), (1, 1)]
    assert (saved.next_id, saved.head_nbytes) == (4, 512) and store.tree_bytes("app", "") == 613


def test_trees_are_per_adapter(store):
    store.upsert_nodes("app", "lora@1", sample_tree().to_rows(), 4)
    store.set_head("app", "", 64)
    assert store.trees("app") == ["", "lora@1"]
    assert store.load_tree("app", "").rows == [] and store.tree_bytes("app", "") == 64
    assert store.delete_tree("app", "lora@1") == 4 and store.trees("app") == [""]
    assert store.load_tree("app", "lora@1") == TreeRows([], 0, 0)


def test_bad_tree_rows_store_nothing(store):
    good = sample_tree().to_rows()
    for bad in ({**good[1], "tokens": 0}, {**good[1], "parent": 5}, {**good[1], "hits": 1.5},
                {k: v for k, v in good[1].items() if k != "nbytes"}):
        with pytest.raises(ValueError):
            store.upsert_nodes("app", "", [good[0], bad], 4)
    with pytest.raises(InvalidKeyError):
        store.upsert_nodes("", "", good, 4)
    assert store.load_tree("app", "") == TreeRows([], 0, 0)


# -- QA bank -----------------------------------------------------------------------------------------


def test_qa_add_list_vectors_answer_hits_delete(store):
    a = store.add_qa("app", "col", "", "What is X?", vec(1) * 3, None, [5, 2, 9], predicted=True)
    b = store.add_qa("app", "col", "", "Why Y?", vec(2), "Because.", [2])
    c = store.add_qa("app", "col", "lora@1", "Who Z?", vec(3), "Zed.", [7])
    assert a < b < c
    rows = store.qa_entries("app", "col", "")
    assert [r.id for r in rows] == [a, b] and rows[0].chunks == (5, 2, 9) and rows[0].predicted
    assert rows[0].answer is None and rows[0].hits == 0 and rows[0].created == rows[0].last_use
    assert rows[0].nbytes == len("What is X?") + 4 * DIM + 3 * SOURCE_BYTES
    assert (rows[1].answer, rows[1].predicted, rows[1].adapter) == ("Because.", False, "")

    ids, vectors = store.qa_vectors("app", "col", "")
    assert ids.tolist() == [a, b] and vectors.dtype == np.float32 and vectors.shape == (2, DIM)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1) and np.allclose(vectors[0], vec(1) / np.linalg.norm(vec(1)))
    assert not vectors.flags.writeable and store.qa_vectors("app", "col", "")[1] is vectors  # cached

    store.set_answer("app", a, "It is x.")
    store.count_qa_hit("app", a, now=77.0)
    entry = store.qa_entry("app", a)
    assert (entry.answer, entry.hits, entry.last_use) == ("It is x.", 1, 77.0)
    assert entry.nbytes == rows[0].nbytes + len("It is x.")
    assert store.qa_bytes("app") == sum(r.nbytes for r in store.qa_entries("app", "col", "")) + \
        store.qa_entry("app", c).nbytes

    assert store.qa_using_chunks("app", [2]) == [a, b] and store.qa_using_chunks("app", [9, 7]) == [a, c]
    assert store.qa_using_chunks("app", [np.int64(4)]) == []
    assert store.delete_qa("app", [a, 12345]) == 1
    assert store.qa_using_chunks("app", [2, 5]) == [b]
    assert store.qa_vectors("app", "col", "")[0].tolist() == [b]  # the delete reloaded the cache
    with pytest.raises(QAEntryNotFoundError):
        store.set_answer("app", a, "gone")


def test_entry_ids_are_never_reused(store):
    a = store.add_qa("app", "col", "", "q", vec(1), "x", [])
    store.delete_qa("app", [a])
    assert store.add_qa("app", "col", "", "q", vec(1), "x", []) > a


def test_width_mismatch_is_refused_and_stores_nothing(store):
    store.add_qa("app", "col", "", "q", vec(1), "a", [1])
    before = store.qa_bytes("app")
    with pytest.raises(ValueError, match="width"):
        store.add_qa("app", "col", "", "other", vec(2, DIM + 1), "b", [2])
    for bad in (np.zeros(DIM), np.full(DIM, np.nan), np.ones((2, DIM))):
        with pytest.raises(ValueError):
            store.add_qa("app", "col", "", "bad", bad, None, [3])
    assert [r.question for r in store.qa_entries("app", "col", "")] == ["q"] and store.qa_bytes("app") == before
    assert store.qa_using_chunks("app", [2, 3]) == []
    store.add_qa("app", "col", "lora@1", "wide", vec(2, DIM + 1), None, [])  # another bank, its own width


def test_vectors_cache_sees_another_connections_writes(path, store):
    a = store.add_qa("app", "col", "", "q1", vec(1), "a", [1])
    assert store.qa_vectors("app", "col", "")[0].tolist() == [a]
    with RagStore(path, clock=Clock()) as other:
        b = other.add_qa("app", "col", "", "q2", vec(2), "b", [2])
        assert store.qa_vectors("app", "col", "")[0].tolist() == [a, b]
        other.delete_qa("app", [a])
        ids, vectors = store.qa_vectors("app", "col", "")
        assert ids.tolist() == [b] and np.allclose(vectors[0], vec(2) / np.linalg.norm(vec(2)))
        other.delete_collection_qa("app", "col")
        assert store.qa_vectors("app", "col", "")[0].tolist() == []
        c = other.add_qa("app", "col", "", "q3", vec(3), "c", [3])
        assert store.qa_vectors("app", "col", "")[0].tolist() == [c]


def test_the_vectors_cache_is_bounded(path):
    with RagStore(path, clock=Clock(), config=RagStoreConfig(cached_banks=2)) as s:
        for i in range(4):
            s.add_qa("app", f"col{i}", "", "q", vec(i), "a", [])
            s.qa_vectors("app", f"col{i}", "")
        assert len(s._vectors) == 2
    with pytest.raises(ValueError):
        RagStoreConfig(cached_banks=0)


def test_delete_collection_qa_takes_every_adapter(store):
    store.add_qa("app", "col", "", "q", vec(1), "a", [1])
    store.add_qa("app", "col", "lora@1", "q", vec(1), "a", [1])
    keep = store.add_qa("app", "other", "", "q", vec(1), "a", [1])
    assert store.delete_collection_qa("app", "col") == 2 and store.delete_collection_qa("app", "col") == 0
    assert store.qa_using_chunks("app", [1]) == [keep] and store.qa_entries("app", "col", "lora@1") == []


# -- isolation, state, reopening ---------------------------------------------------------------------


def test_apps_are_isolated(store):
    mine = store.add_qa("mine", "col", "", "q", vec(1), "a", [1])
    theirs = store.add_qa("theirs", "col", "", "q", vec(2), "b", [1])
    store.upsert_nodes("theirs", "", sample_tree().to_rows(), 4)
    store.set_head("theirs", "", 9)
    store.save_state("theirs", "abstract", "{}")
    assert store.load_tree("mine", "") == TreeRows([], 0, 0) and store.tree_bytes("mine", "") == 0
    assert store.trees("mine") == [] and store.load_state("mine", "abstract") is None
    assert store.count_hits("mine", "", [0, 1]) == 0 and store.delete_nodes("mine", "", [0, 1]) == 0
    assert [r.id for r in store.qa_entries("mine", "col", "")] == [mine]
    assert store.qa_vectors("mine", "col", "")[0].tolist() == [mine] and store.qa_using_chunks("mine", [1]) == [mine]
    for call in (lambda: store.set_answer("mine", theirs, "x"), lambda: store.count_qa_hit("mine", theirs),
                 lambda: store.qa_entry("mine", theirs), lambda: store.count_qa_hit("mine", 999)):
        with pytest.raises(QAEntryNotFoundError) as e:
            call()
        assert e.value.code == "qa_entry_not_found" and isinstance(e.value, StorageError)
    assert store.delete_qa("mine", [theirs]) == 0 and store.delete_collection_qa("mine", "nope") == 0
    assert store.qa_entry("theirs", theirs).answer == "b" and store.qa_entry("theirs", theirs).hits == 0
    assert len(store.load_tree("theirs", "").rows) == 4


def test_predictor_state(store):
    assert store.load_state("app", "predictor") is None
    store.save_state("app", "predictor", json.dumps({"abstract": "cats", "recent": ["a"]}))
    store.save_state("app", "predictor", json.dumps({"abstract": "dogs"}))
    store.save_state("app", "idle", "[]")
    assert json.loads(store.load_state("app", "predictor")) == {"abstract": "dogs"}
    assert store.load_state("app", "idle") == "[]"
    store.save_state("other", "idle", "{}")
    assert store.state_apps("predictor") == ["app"] and store.state_apps("idle") == ["app", "other"]
    with pytest.raises(ValueError):
        store.save_state("app", "predictor", {"not": "text"})


def test_delete_app_removes_only_that_app(store):
    for app in ("gone", "kept"):
        store.upsert_nodes(app, "", sample_tree().to_rows(), 4)
        store.set_head(app, "lora@1", 8)
        store.add_qa(app, "col", "", "q", vec(1), "a", [1])
        store.qa_vectors(app, "col", "")
        store.save_state(app, "predictor", "{}")
    before = store.total_bytes()
    store.delete_app("gone")
    after = store.total_bytes()  # every app's bytes by level: halved
    assert after == {"kv_tree": store.tree_bytes("kept", "") + store.tree_bytes("kept", "lora@1"),
                     "qa_bank": store.qa_bytes("kept")}
    assert {k: 2 * v for k, v in after.items()} == before and after["kv_tree"] > 0 and after["qa_bank"] > 0
    assert store.trees("gone") == [] and store.qa_bytes("gone") == 0 and store.load_state("gone", "predictor") is None
    assert store.qa_vectors("gone", "col", "")[0].size == 0 and store.qa_using_chunks("gone", [1]) == []
    assert store.trees("kept") == ["", "lora@1"] and len(store.load_tree("kept", "").rows) == 4
    assert len(store.qa_entries("kept", "col", "")) == 1 and store.load_state("kept", "predictor") == "{}"
    db = sqlite3.connect(store_path(store))
    try:
        assert db.execute("SELECT COUNT(*) FROM rag_qa_sources").fetchone()[0] == 1  # the cascade reached them
        assert db.execute("SELECT COUNT(*) FROM rag_nodes WHERE app='gone'").fetchone()[0] == 0
    finally:
        db.close()


def store_path(store: RagStore) -> str:
    return store._db.execute("PRAGMA database_list").fetchone()[2]


def test_reopen_keeps_everything(path):
    with RagStore(path, clock=Clock()) as s:
        s.upsert_nodes("app", "", sample_tree().to_rows(), 4)
        s.set_head("app", "", 32)
        entry = s.add_qa("app", "col", "", "q", vec(1), None, [4, 2], predicted=True)
        s.set_answer("app", entry, "later")
        s.save_state("app", "predictor", '{"v": 1}')
        tree, rows, vectors = s.load_tree("app", ""), s.qa_entries("app", "col", ""), s.qa_vectors("app", "col", "")
    with RagStore(path, clock=Clock()) as s:
        assert s.load_tree("app", "") == tree and s.qa_entries("app", "col", "") == rows
        ids, again = s.qa_vectors("app", "col", "")
        assert ids.tolist() == vectors[0].tolist() and np.array_equal(again, vectors[1])
        assert s.load_state("app", "predictor") == '{"v": 1}' and s.qa_using_chunks("app", [2]) == [entry]
        assert s.add_qa("app", "col", "", "q2", vec(2), "b", []) > entry


def test_another_schema_version_is_refused(path):
    RagStore(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE rag_meta SET value='99' WHERE key='schema'")
    db.commit()
    db.close()
    with pytest.raises(RagStoreError, match="schema 99"):
        RagStore(path)


# -- one file, three owners --------------------------------------------------------------------------


def tokenize(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) & 0x7FFFFFFF for w in text.split()]


def embed(texts: list[str]) -> np.ndarray:
    return np.stack([vec(zlib.crc32(t.encode())) for t in texts])


def test_shares_the_file_with_the_registry_and_the_knowledge_bank(path):
    registry = Registry(path, clock=Clock())
    bank = KnowledgeBank(path, tokenize=tokenize, embed=embed, clock=Clock())
    store = RagStore(path, clock=Clock())
    registry.create_app("app")
    ctx = registry.create_context("app", "You are terse.")
    col = bank.create_collection("app", "docs")
    bank.add_document("app", col, "Shared file, three owners.")
    chunk = bank.search("app", col, "owners", k=1)[0].chunk
    entry = store.add_qa("app", col, "", "Who owns it?", embed(["Who owns it?"])[0], "Three.", [chunk])
    store.upsert_nodes("app", "", [{"node_id": 0, "parent": None, "chunk_id": chunk, "tokens": 4, "nbytes": 64,
                                    "hits": 0, "last_use": 1.0}], 1)
    with registry.transaction():  # the registry's write lock: the store's writer waits for it, then runs
        registry.touch(ctx)
    store.count_qa_hit("app", entry)
    for owner in (registry, bank, store):
        owner.close()
    with Registry(path) as registry, KnowledgeBank(path, tokenize=tokenize, embed=embed) as bank, \
            RagStore(path) as store:
        assert registry.list_contexts("app")[0].id == ctx and bank.collections("app")[0].id == col
        assert store.qa_using_chunks("app", [chunk]) == [entry] and store.qa_entry("app", entry).hits == 1
        assert store.tree_bytes("app", "") == 64
        tables = {r[0] for r in store._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"apps", "contexts", "kb_chunks", "rag_meta", "rag_trees", "rag_nodes", "rag_qa",
                "rag_qa_sources", "rag_state"} <= tables
