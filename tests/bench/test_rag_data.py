"""RAG benchmark data: the loader returns what the files hold, and the question sets are well formed.

Every question is answerable from its user's corpus (its answer hint occurs in the named topic's
text), ids are unique, paraphrase groups hold at least three questions that are never asked back to
back, the asking order lists every question once, and the held-out set shares no id, wording or fact
with the main set. Files only: no model, no network.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from bench import rag_data

ROOT = Path(rag_data.__file__).resolve().parent
WHICH = ("main", "heldout")
FILES = {"main": ROOT / "questions.json", "heldout": ROOT / "heldout.json"}
# per set: (paraphrase groups, distinct questions) per user, and the group sizes allowed
SHAPE = {"main": (8, 8, (3, 4)), "heldout": (4, 4, (3, 3))}


def _raw(which: str) -> dict:
    return json.loads(FILES[which].read_text(encoding="utf-8"))


def _norm(text: str) -> str:
    """Lower case, double quotes and asterisks dropped (the manual's markup), whitespace collapsed."""
    return " ".join(re.sub(r'["*]', "", text).split()).lower()


def test_users_are_the_corpus_folders_and_the_question_files_users():
    folders = sorted(p.name for p in (ROOT / "corpus").iterdir() if p.is_dir())
    assert rag_data.users() == folders == ["user0", "user1", "user2"]
    for which in WHICH:
        assert sorted(_raw(which)["users"]) == folders


def test_documents_are_the_files_sorted():
    for user in rag_data.users():
        files = sorted((ROOT / "corpus" / user).glob("*.txt"))
        expected = sorted((p.stem, p.read_text(encoding="utf-8")) for p in files)
        docs = rag_data.documents(user)
        assert docs == expected
        assert [name for name, _ in docs] == sorted(name for name, _ in docs)
        assert len(docs) == 8


def test_corpus_sizes_and_text_form():
    total = 0
    for user in rag_data.users():
        for name, text in rag_data.documents(user):
            size = len(text.encode("utf-8"))
            assert 2_000 <= size <= 20_480, (user, name, size)
            assert text == text.rstrip() + "\n", (user, name)
            total += size
    assert total < 250_000
    licence = (ROOT / "corpus" / "LICENSE.txt").read_text(encoding="utf-8")
    assert "pydoc_data" in licence and "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="snapshot taken from Python 3.11.7")
def test_corpus_is_the_unmodified_pydoc_text():
    from pydoc_data.topics import topics

    for user in rag_data.users():
        for name, text in rag_data.documents(user):
            assert text == topics[name].rstrip() + "\n", (user, name)


def test_questions_are_the_file_in_asking_order_and_groups_follow():
    for which in WHICH:
        raw = _raw(which)
        for user in rag_data.users():
            entry = raw["users"][user]
            qs = rag_data.questions(user, which)
            assert [q["id"] for q in qs] == entry["order"]
            assert sorted(qs, key=lambda q: q["id"]) == sorted(entry["questions"], key=lambda q: q["id"])
            expected: dict[str, list[str]] = {}
            for qid in entry["order"]:
                group = next(q["group"] for q in entry["questions"] if q["id"] == qid)
                if group is not None:
                    expected.setdefault(group, []).append(qid)
            assert rag_data.groups(user, which) == expected
    with pytest.raises(ValueError):
        rag_data.questions("user0", "train")
    with pytest.raises(KeyError):
        rag_data.documents("nobody")


def test_held_out_marking():
    assert _raw("main")["held_out"] is False
    assert _raw("heldout")["held_out"] is True
    assert "no tuning" in _raw("heldout")["description"].lower()


def test_ids_unique_and_shape():
    for which in WHICH:
        n_groups, n_distinct, (low, high) = SHAPE[which]
        ids = [q["id"] for u in rag_data.users() for q in rag_data.questions(u, which)]
        assert len(ids) == len(set(ids)), which
        for user in rag_data.users():
            qs = rag_data.questions(user, which)
            assert all(set(q) == {"id", "text", "group", "topic", "answer_hint", "near_group"} for q in qs)
            grouped = rag_data.groups(user, which)
            assert len(grouped) == n_groups
            assert all(low <= len(members) <= high for members in grouped.values()), grouped
            distinct = [q for q in qs if q["group"] is None]
            assert len(distinct) == n_distinct
            assert all(q["id"].startswith(user.replace("user", "u") + "-") for q in qs)
            for group, members in grouped.items():
                assert all(m.startswith(group + "-") for m in members)
                assert members == sorted(members), "a group's paraphrases are asked in id order"
            texts = [q["text"] for q in qs]
            assert len(texts) == len(set(texts))


def test_groups_share_topic_and_hint_and_distinct_questions_share_a_groups_topic():
    for which in WHICH:
        for user in rag_data.users():
            qs = rag_data.questions(user, which)
            by_group: dict[str, set] = {}
            for q in qs:
                if q["group"] is not None:
                    assert q["near_group"] is None
                    by_group.setdefault(q["group"], set()).add((q["topic"], q["answer_hint"]))
            assert all(len(v) == 1 for v in by_group.values()), by_group
            for q in qs:
                if q["group"] is None:
                    topic, hint = next(iter(by_group[q["near_group"]]))
                    assert q["topic"] == topic, q["id"]
                    assert q["answer_hint"] != hint, q["id"]


def test_every_answer_is_in_the_named_topic_of_that_users_corpus():
    for which in WHICH:
        for user in rag_data.users():
            docs = dict(rag_data.documents(user))
            for q in rag_data.questions(user, which):
                assert q["topic"] in docs, (user, q["id"], q["topic"])
                assert _norm(q["answer_hint"]) in _norm(docs[q["topic"]]), (user, q["id"], q["answer_hint"])


def test_order_lists_every_question_once_and_never_asks_paraphrases_back_to_back():
    for which in WHICH:
        for user in rag_data.users():
            entry = _raw(which)["users"][user]
            assert sorted(entry["order"]) == sorted(q["id"] for q in entry["questions"])
            assert len(entry["order"]) == len(set(entry["order"]))
            group_of = {q["id"]: q["group"] for q in entry["questions"]}
            seq = [group_of[qid] for qid in entry["order"]]
            for a, b in zip(seq, seq[1:]):
                assert a is None or a != b, (which, user, a)


def test_held_out_set_is_disjoint_from_the_main_set():
    for user in rag_data.users():
        main = rag_data.questions(user, "main")
        held = rag_data.questions(user, "heldout")
        assert not {q["id"] for q in main} & {q["id"] for q in held}
        assert not {q["group"] for q in main if q["group"]} & {q["group"] for q in held if q["group"]}
        assert not {_norm(q["text"]) for q in main} & {_norm(q["text"]) for q in held}
        facts = {(q["topic"], _norm(q["answer_hint"])) for q in main}
        assert not facts & {(q["topic"], _norm(q["answer_hint"])) for q in held}
