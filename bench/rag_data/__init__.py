"""Frozen data for the RAG cache benchmark: three users' knowledge and the questions they ask.

Modelled on "PerCache: Predictive Hierarchical Cache for RAG Applications on Mobile Devices": each
user owns a small personal knowledge base, and asks few questions, spread out in time. Some
questions paraphrase an earlier one (a QA bank can answer them from the first); others mean
something else but are answered from the same passages (reusing those passages' attention state
helps).

- ``corpus/<user>/<topic>.txt``: a user's documents, unmodified topic texts of the Python manual
  (CPython's ``pydoc_data.topics``; source and licence in ``corpus/LICENSE.txt``).
- ``questions.json`` ("main") and ``heldout.json`` ("heldout", which no tuning may look at): per
  user, questions ``{"id", "text", "group", "topic", "answer_hint", "near_group"}`` and the asking
  ``order``. ``group`` names a paraphrase group (null for a distinct question); a distinct question's
  ``near_group`` is the group whose topic it shares; ``answer_hint`` is a phrase the correct answer
  contains, found in the topic's text.

Standard library only; everything is read from the files on each call.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CORPUS = ROOT / "corpus"
QUESTION_FILES = {"main": "questions.json", "heldout": "heldout.json"}


def users() -> list[str]:
    """The users, sorted: one folder each under ``corpus/``."""
    return sorted(p.name for p in CORPUS.iterdir() if p.is_dir())


def _user_dir(user: str) -> Path:
    if user not in users():
        raise KeyError(f"unknown user {user!r}; known: {users()}")
    return CORPUS / user


def documents(user: str) -> list[tuple[str, str]]:
    """(topic name, text) of each of the user's documents, sorted by name."""
    return sorted((p.stem, p.read_text(encoding="utf-8")) for p in _user_dir(user).glob("*.txt"))


def load(which: str = "main") -> dict:
    """The whole question file: ``{"held_out", "description", "users": {user: {"questions", "order"}}}``."""
    if which not in QUESTION_FILES:
        raise ValueError(f"which must be one of {sorted(QUESTION_FILES)}, not {which!r}")
    return json.loads((ROOT / QUESTION_FILES[which]).read_text(encoding="utf-8"))


def questions(user: str, which: str = "main") -> list[dict]:
    """The user's questions in asking order."""
    _user_dir(user)
    entry = load(which)["users"][user]
    by_id = {q["id"]: q for q in entry["questions"]}
    return [by_id[qid] for qid in entry["order"]]


def groups(user: str, which: str = "main") -> dict[str, list[str]]:
    """Paraphrase group -> ids of its questions, in asking order."""
    out: dict[str, list[str]] = {}
    for q in questions(user, which):
        if q["group"] is not None:
            out.setdefault(q["group"], []).append(q["id"])
    return out


def describe() -> None:
    """Print per user: documents, their bytes, and questions and groups of each question set."""
    for user in users():
        docs = documents(user)
        size = sum(len(text.encode("utf-8")) for _, text in docs)
        sets = ", ".join(
            f"{which}: {len(questions(user, which))} questions, {len(groups(user, which))} groups"
            for which in QUESTION_FILES
        )
        print(f"{user}: {len(docs)} documents, {size} bytes; {sets}")
