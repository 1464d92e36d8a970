"""The RAG cache's persistent state (PerCache §4.1): the K/V tree's rows, the QA bank and the query
predictor's state, per app and, for the tree and the QA bank, per adapter ("" for the base model).

This module deliberately knows nothing about K/V tensors, the tree's invariants, matching, eviction
or prediction: the tree (``scheduler.ragtree.KVTree``) gives and takes plain rows, the QA bank's
policies (``scheduler.ragcache``) get entries and vectors, and the predictor stores opaque JSON text.
Where the K/V bytes live (the chunk store) is the caller's business; a node row only records their size.
Knowledge chunk ids are those of :mod:`storage.knowledge`, but nothing here refers to its tables, so
the store works on a file of its own.

Its own ``rag_`` tables in any SQLite file (the registry's and the knowledge bank's, or one alone), on
its own connection (WAL, ``synchronous=FULL``, foreign keys on). A public method that writes is one
``BEGIN IMMEDIATE`` transaction, one that reads one deferred transaction (a snapshot). Every method
takes the app and matches rows on it: another app's rows are invisible, its entry ids "not found". ::

    rag_meta        key PK, value (the schema version of the rag_ tables)
    rag_trees       (app, adapter) PK, next_id (the tree's next node id; never moves back),
                    head_nbytes (bytes of the stored K/V of the prompt's fixed head; 0: not stored)
    rag_nodes       (app, adapter) -> rag_trees, node_id, parent (NULL: a child of the root), chunk_id,
                    tokens, nbytes, hits, last_use; PK (app, adapter, node_id)
    rag_banks       id PK AUTOINCREMENT (never reused: it keys the in-memory vectors), app, collection,
                    adapter, generation (moves when entries are added or deleted); UNIQUE (app,
                    collection, adapter)
    rag_qa          id PK AUTOINCREMENT (the entry id; never reused), bank ->, question, embedding
                    (float32 LE blob, a unit row), answer (NULL until decoded), predicted, hits,
                    last_use, created, nbytes
    rag_qa_sources  (entry ->, ord) PK, chunk (a knowledge chunk id); indexed by chunk
    rag_state       (app, name) PK, blob (JSON text), updated

A bank is the QA entries of one (app, knowledge collection, adapter); its embeddings all have the
width of its first entry's while it holds any.
"""

from __future__ import annotations

import collections
import json
import math
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NewType

import numpy as np

from storage.errors import InvalidKeyError, StorageError
from storage.knowledge import _check_name
from storage.sqlitedb import SqliteTables

EntryId = NewType("EntryId", int)
"""Id of a QA bank entry: stable, never reused."""

SCHEMA_VERSION = 1
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS rag_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS rag_trees (
        app TEXT NOT NULL, adapter TEXT NOT NULL, next_id INTEGER NOT NULL DEFAULT 0 CHECK (next_id >= 0),
        head_nbytes INTEGER NOT NULL DEFAULT 0 CHECK (head_nbytes >= 0),
        PRIMARY KEY (app, adapter)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS rag_nodes (
        app TEXT NOT NULL, adapter TEXT NOT NULL, node_id INTEGER NOT NULL CHECK (node_id >= 0),
        parent INTEGER CHECK (parent IS NULL OR parent < node_id), chunk_id INTEGER NOT NULL,
        tokens INTEGER NOT NULL CHECK (tokens >= 1), nbytes INTEGER NOT NULL CHECK (nbytes >= 0),
        hits INTEGER NOT NULL CHECK (hits >= 0), last_use REAL NOT NULL,
        PRIMARY KEY (app, adapter, node_id),
        FOREIGN KEY (app, adapter) REFERENCES rag_trees(app, adapter) ON DELETE CASCADE) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS rag_banks (
        id INTEGER PRIMARY KEY AUTOINCREMENT, app TEXT NOT NULL, collection TEXT NOT NULL,
        adapter TEXT NOT NULL, generation INTEGER NOT NULL DEFAULT 0, UNIQUE (app, collection, adapter))""",
    """CREATE TABLE IF NOT EXISTS rag_qa (
        id INTEGER PRIMARY KEY AUTOINCREMENT, bank INTEGER NOT NULL REFERENCES rag_banks(id) ON DELETE CASCADE,
        question TEXT NOT NULL, embedding BLOB NOT NULL, answer TEXT,
        predicted INTEGER NOT NULL CHECK (predicted IN (0, 1)), hits INTEGER NOT NULL DEFAULT 0,
        last_use REAL NOT NULL, created REAL NOT NULL, nbytes INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS rag_qa_by_bank ON rag_qa(bank, id)",
    """CREATE TABLE IF NOT EXISTS rag_qa_sources (
        entry INTEGER NOT NULL REFERENCES rag_qa(id) ON DELETE CASCADE, ord INTEGER NOT NULL,
        chunk INTEGER NOT NULL, PRIMARY KEY (entry, ord)) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS rag_qa_sources_by_chunk ON rag_qa_sources(chunk, entry)",
    """CREATE TABLE IF NOT EXISTS rag_state (
        app TEXT NOT NULL, name TEXT NOT NULL, blob TEXT NOT NULL, updated REAL NOT NULL,
        PRIMARY KEY (app, name)) WITHOUT ROWID""",
)

ROW_FIELDS = ("node_id", "parent", "chunk_id", "tokens", "nbytes", "hits", "last_use")
"""The keys of one K/V tree row, as ``scheduler.ragtree.KVTree.to_rows`` gives them (storage does not
import the scheduler, so the tuple is repeated here; a test checks the two agree)."""

SOURCE_BYTES = 8
"""Bytes one source chunk id counts for in an entry's ``nbytes`` (an int64)."""

MAX_ADAPTER_KEY = 256
"""Longest adapter key (characters)."""


class RagStoreError(StorageError):
    """Base of the RAG store's errors."""

    code = "rag_store_error"


class QAEntryNotFoundError(RagStoreError, LookupError):
    """No such QA entry, or it belongs to another app (the two are indistinguishable on purpose)."""

    code = "qa_entry_not_found"


@dataclass(frozen=True, slots=True)
class RagStoreConfig:
    """Tunables of the RAG store."""

    cached_banks: int = 8  # QA banks whose vectors are kept in memory, least recently read out (banks)
    busy_timeout_s: float = 10.0  # wait for another connection's write lock (seconds)

    def __post_init__(self) -> None:
        if self.cached_banks < 1 or not self.busy_timeout_s >= 0:
            raise ValueError(f"cached_banks must be positive and busy_timeout_s non-negative: {self}")


@dataclass(frozen=True, slots=True)
class TreeRows:
    """A stored K/V tree: what ``KVTree.from_rows(rows, next_id)`` rebuilds, plus the head's size."""

    rows: list[dict[str, Any]]  # one dict per node (keys ROW_FIELDS), ascending node_id: parents first
    next_id: int  # the id the tree's next new node gets (never below the highest row's + 1 as saved)
    head_nbytes: int  # bytes of the stored K/V of the prompt's fixed head; 0 when not stored (bytes)


@dataclass(frozen=True, slots=True)
class QAEntryRow:
    """One QA bank entry (its embedding is in :meth:`RagStore.qa_vectors`)."""

    id: EntryId  # stable id, never reused
    collection: str  # the knowledge collection whose chunks it was answered from
    adapter: str  # the adapter key its answer was decoded under ("" for the base model)
    question: str  # the query's text
    answer: str | None  # the decoded answer; None: not decoded (a predicted query only prefilled)
    chunks: tuple[int, ...]  # knowledge chunk ids its query retrieved, in retrieval order
    predicted: bool  # made by the query predictor, not asked by a user
    hits: int  # user queries it answered (the LFU count)
    last_use: float  # when stored or last answered a query (clock seconds)
    created: float  # when stored (clock seconds)
    nbytes: int  # question + answer (UTF-8) + embedding + SOURCE_BYTES per chunk (bytes)


@dataclass(slots=True)
class _Vectors:
    """A bank's embeddings in memory, valid while its generation has not moved."""

    generation: int  # rag_banks.generation when loaded
    ids: np.ndarray  # int64 [n] entry ids, ascending, read-only
    vectors: np.ndarray  # float32 [n, dim] unit rows, row i of entry ids[i], read-only


def _int(what: str, value, low: int = 0) -> int:
    """``value`` as an int of at least ``low``; ValueError for anything else (bools, floats included)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {value!r}") from None
    if n < low:
        raise ValueError(f"{what} must be >= {low}, got {n}")
    return n


def _ids(what: str, values: Iterable[int]) -> str:
    """Ids as a JSON array, for ``IN (SELECT value FROM json_each(?))`` (no bound on their number)."""
    return json.dumps([_int(what, v) for v in values])


def _check_adapter(adapter) -> None:
    if not isinstance(adapter, str) or len(adapter) > MAX_ADAPTER_KEY or not adapter.isprintable():
        raise InvalidKeyError(f"adapter key must be a printable str of at most {MAX_ADAPTER_KEY} characters")


def _node(row: dict[str, Any]) -> tuple:
    """A tree row's values in ROW_FIELDS order, checked; ValueError names the bad field."""
    missing = set(ROW_FIELDS) - row.keys()
    if missing:
        raise ValueError(f"K/V tree row {dict(row)!r} lacks {sorted(missing)}")
    node = _int("node_id", row["node_id"])
    parent = None if row["parent"] is None else _int("parent", row["parent"])
    if parent is not None and parent >= node:
        raise ValueError(f"K/V node {node} has parent {parent}: a parent's id is lower")
    last_use = float(row["last_use"])
    if not math.isfinite(last_use):
        raise ValueError(f"K/V node {node} has last_use {last_use}")
    return (node, parent, _int("chunk_id", row["chunk_id"]), _int("tokens", row["tokens"], 1),
            _int("nbytes", row["nbytes"]), _int("hits", row["hits"]), last_use)


def _unit(embedding) -> np.ndarray:
    """One embedding as a float32 unit row [dim]; ValueError when not 1-D, empty, non-finite or zero."""
    v = np.asarray(embedding, dtype=np.float64)
    norm = float(np.linalg.norm(v)) if v.ndim == 1 and v.size else 0.0
    if not (norm > 0 and math.isfinite(norm)):
        raise ValueError(f"embedding must be a finite non-zero vector [dim], got shape {v.shape}")
    return (v / norm).astype(np.float32)


def _entry_bytes(question: str, answer: str | None, dim: int, n_chunks: int) -> int:
    return (len(question.encode("utf-8")) + (len(answer.encode("utf-8")) if answer is not None else 0)
            + 4 * dim + SOURCE_BYTES * n_chunks)


class RagStore(SqliteTables):
    """The RAG cache's tree rows, QA bank and predictor state of many apps in one SQLite file.
    Thread-safe (one connection, one lock). Another app's QA entry is "not found", as a missing one."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.time, config: RagStoreConfig | None = None):
        self.config = config or RagStoreConfig()
        self._clock = clock
        self._vectors: collections.OrderedDict[int, _Vectors] = collections.OrderedDict()  # LRU by read
        super().__init__(path, busy_timeout_s=self.config.busy_timeout_s, schema=_SCHEMA, meta="rag_meta",
                         version=SCHEMA_VERSION, error=RagStoreError, what="RAG store")

    def _now(self, now: float | None) -> float:
        t = self._clock() if now is None else float(now)
        if not math.isfinite(t):
            raise ValueError(f"now must be finite, got {t}")
        return t

    # -- K/V tree ------------------------------------------------------------------------------------

    def _tree_row(self, app: str, adapter: str) -> None:
        """Make the (app, adapter) tree row when missing (its nodes reference it)."""
        self._q("INSERT OR IGNORE INTO rag_trees (app, adapter) VALUES (?, ?)", (app, adapter))

    def load_tree(self, app: str, adapter: str) -> TreeRows:
        """The stored tree of (app, adapter); no rows, next_id 0 and no head when none is stored."""
        with self._transaction(write=False):
            head = self._q("SELECT next_id, head_nbytes FROM rag_trees WHERE app=? AND adapter=?",
                           (app, adapter)).fetchone()
            rows = self._q(f"SELECT {', '.join(ROW_FIELDS)} FROM rag_nodes WHERE app=? AND adapter=? "
                           "ORDER BY node_id", (app, adapter)).fetchall()
        next_id, head_nbytes = head or (0, 0)
        return TreeRows([dict(zip(ROW_FIELDS, r)) for r in rows], next_id, head_nbytes)

    def upsert_nodes(self, app: str, adapter: str, rows: Sequence[dict[str, Any]], next_id: int) -> None:
        """Insert or replace the nodes of ``rows`` (keys ROW_FIELDS, as ``KVTree.to_rows`` gives them) and
        record ``next_id``, all or nothing. next_id never moves back: a lower one than stored is ignored,
        so a stale writer cannot make a removed node's id be handed out again. The tree's shape is not
        checked here (``KVTree.from_rows`` does on load); a row with a bad value is a ValueError."""
        _check_name("app name", app)
        _check_adapter(adapter)
        values = [(app, adapter, *_node(r)) for r in rows]
        next_id = _int("next_id", next_id)
        with self._transaction(write=True):
            self._tree_row(app, adapter)
            self._db.executemany("INSERT OR REPLACE INTO rag_nodes (app, adapter, node_id, parent, chunk_id, tokens, "
                                 "nbytes, hits, last_use) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", values)
            self._q("UPDATE rag_trees SET next_id = max(next_id, ?) WHERE app=? AND adapter=?", (next_id, app, adapter))

    def delete_nodes(self, app: str, adapter: str, node_ids: Iterable[int]) -> int:
        """Delete those nodes (unknown ids are skipped; children are not deleted with their parent: the
        caller names them); returns how many were deleted."""
        ids = _ids("node id", node_ids)
        with self._transaction(write=True):
            return self._q("DELETE FROM rag_nodes WHERE app=? AND adapter=? AND node_id IN "
                           "(SELECT value FROM json_each(?))", (app, adapter, ids)).rowcount

    def set_head(self, app: str, adapter: str, nbytes: int) -> None:
        """Record the size of the stored K/V of the prompt's fixed head (0: not stored), bytes."""
        _check_name("app name", app)
        _check_adapter(adapter)
        nbytes = _int("head nbytes", nbytes)
        with self._transaction(write=True):
            self._tree_row(app, adapter)
            self._q("UPDATE rag_trees SET head_nbytes=? WHERE app=? AND adapter=?", (nbytes, app, adapter))

    def count_hits(self, app: str, adapter: str, node_ids: Iterable[int], now: float | None = None) -> int:
        """One more hit for each of those nodes, last used at ``now`` (clock seconds; the store's clock when
        None); unknown ids are skipped. Returns how many nodes were counted."""
        ids, t = _ids("node id", set(node_ids)), self._now(now)
        with self._transaction(write=True):
            return self._q("UPDATE rag_nodes SET hits = hits + 1, last_use=? WHERE app=? AND adapter=? AND node_id "
                           "IN (SELECT value FROM json_each(?))", (t, app, adapter, ids)).rowcount

    def tree_bytes(self, app: str, adapter: str) -> int:
        """Bytes of the tree's nodes plus its stored head, bytes."""
        with self._transaction(write=False):
            return self._q("SELECT (SELECT COALESCE(SUM(nbytes), 0) FROM rag_nodes WHERE app=?1 AND adapter=?2) + "
                           "(SELECT COALESCE(SUM(head_nbytes), 0) FROM rag_trees WHERE app=?1 AND adapter=?2)",
                           (app, adapter)).fetchone()[0]

    def trees(self, app: str) -> list[str]:
        """The adapter keys the app has a stored tree for (a head or nodes, now or before), sorted."""
        with self._transaction(write=False):
            return [r[0] for r in self._q("SELECT adapter FROM rag_trees WHERE app=? ORDER BY adapter", (app,))]

    def delete_tree(self, app: str, adapter: str) -> int:
        """Delete the (app, adapter) tree, its head and next_id with it; returns the nodes deleted."""
        with self._transaction(write=True):
            n = self._q("SELECT COUNT(*) FROM rag_nodes WHERE app=? AND adapter=?", (app, adapter)).fetchone()[0]
            self._q("DELETE FROM rag_trees WHERE app=? AND adapter=?", (app, adapter))  # nodes by cascade
        return n

    # -- QA bank -------------------------------------------------------------------------------------

    def _changed(self, banks: Iterable[int]) -> None:
        """The banks' sets of vectors changed: move their generations (other connections see it)."""
        for bank in banks:
            self._q("UPDATE rag_banks SET generation = generation + 1 WHERE id=?", (bank,))
            self._vectors.pop(bank, None)

    def add_qa(self, app: str, collection: str, adapter: str, question: str, embedding, answer: str | None,
               chunks: Sequence[int], *, predicted: bool = False) -> EntryId:
        """Store an entry in the (app, collection, adapter) bank; returns its id. ``embedding`` ([dim], any
        non-zero norm) is stored as a unit row; ``answer`` None for a query only prefilled; ``chunks`` the
        knowledge chunk ids its query retrieved, in order. An embedding of another width than the bank's
        entries is a ValueError, and nothing is stored."""
        _check_name("app name", app)
        _check_name("collection id", collection)
        _check_adapter(adapter)
        if not isinstance(question, str) or not (answer is None or isinstance(answer, str)):
            raise ValueError("question must be a str, answer a str or None")
        vector = _unit(embedding)
        sources = [_int("chunk id", c) for c in chunks]
        nbytes = _entry_bytes(question, answer, vector.shape[0], len(sources))
        with self._transaction(write=True):
            self._q("INSERT OR IGNORE INTO rag_banks (app, collection, adapter) VALUES (?, ?, ?)",
                    (app, collection, adapter))
            bank = self._bank(app, collection, adapter)[0]
            width = self._q("SELECT length(embedding) / 4 FROM rag_qa WHERE bank=? LIMIT 1", (bank,)).fetchone()
            if width and width[0] != vector.shape[0]:  # another embedding model: cosines would be noise
                raise ValueError(f"embedding of width {vector.shape[0]}; the bank's are {width[0]} wide")
            t = self._clock()
            entry = self._q("INSERT INTO rag_qa (bank, question, embedding, answer, predicted, last_use, created, "
                            "nbytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (bank, question, vector.astype("<f4").tobytes(), answer, int(bool(predicted)), t, t,
                             nbytes)).lastrowid
            self._db.executemany("INSERT INTO rag_qa_sources VALUES (?, ?, ?)",
                                 [(entry, i, c) for i, c in enumerate(sources)])
            self._changed([bank])
        return EntryId(entry)

    def _bank(self, app: str, collection: str, adapter: str) -> tuple[int, int] | None:
        """(id, generation) of the bank, None when there is none."""
        return self._q("SELECT id, generation FROM rag_banks WHERE app=? AND collection=? AND adapter=?",
                       (app, collection, adapter)).fetchone()

    def _entry(self, app: str, entry: int) -> tuple:
        """(bank, question, embedding width, source count) of the app's entry (an int already checked);
        QAEntryNotFoundError when it is missing or another app's."""
        row = self._q("SELECT q.bank, q.question, length(q.embedding) / 4, "
                      "(SELECT COUNT(*) FROM rag_qa_sources s WHERE s.entry = q.id) "
                      "FROM rag_qa q JOIN rag_banks b ON b.id = q.bank WHERE q.id=? AND b.app=?",
                      (entry, app)).fetchone()
        if row is None:
            raise QAEntryNotFoundError("unknown QA entry")  # another app's entry looks the same
        return row

    def set_answer(self, app: str, entry: int, answer: str | None) -> None:
        """Store (or replace: a refreshed answer) the entry's decoded answer; None drops it, leaving a
        query whose K/V stays cached. Its nbytes follows."""
        if not (answer is None or isinstance(answer, str)):
            raise ValueError("answer must be a str or None")
        entry = _int("entry id", entry)
        with self._transaction(write=True):
            _, question, dim, n_chunks = self._entry(app, entry)
            self._q("UPDATE rag_qa SET answer=?, nbytes=? WHERE id=?",
                    (answer, _entry_bytes(question, answer, dim, n_chunks), entry))

    def count_qa_hit(self, app: str, entry: int, now: float | None = None) -> None:
        """One more hit for the entry, last used at ``now`` (clock seconds; the store's clock when None)."""
        entry, t = _int("entry id", entry), self._now(now)
        with self._transaction(write=True):
            self._entry(app, entry)
            self._q("UPDATE rag_qa SET hits = hits + 1, last_use=? WHERE id=?", (t, entry))

    _ENTRY_SQL = ("SELECT q.id, b.collection, b.adapter, q.question, q.answer, q.predicted, q.hits, q.last_use, "
                  "q.created, q.nbytes FROM rag_qa q JOIN rag_banks b ON b.id = q.bank ")

    def _rows(self, where: str, args: tuple) -> list[QAEntryRow]:
        rows = self._q(self._ENTRY_SQL + f"WHERE {where} ORDER BY q.id", args).fetchall()
        sources: dict[int, list[int]] = collections.defaultdict(list)
        for entry, chunk in self._q("SELECT s.entry, s.chunk FROM rag_qa_sources s WHERE s.entry IN "
                                    "(SELECT value FROM json_each(?)) ORDER BY s.entry, s.ord",
                                    (json.dumps([r[0] for r in rows]),)):
            sources[entry].append(chunk)
        return [QAEntryRow(EntryId(r[0]), r[1], r[2], r[3], r[4], tuple(sources[r[0]]), bool(r[5]), *r[6:])
                for r in rows]

    def qa_entries(self, app: str, collection: str, adapter: str) -> list[QAEntryRow]:
        """The bank's entries, ascending id (oldest first)."""
        with self._transaction(write=False):
            return self._rows("b.app=? AND b.collection=? AND b.adapter=?", (app, collection, adapter))

    def qa_entry(self, app: str, entry: int) -> QAEntryRow:
        """One of the app's entries, by id (e.g. the one ``qa_vectors`` matched)."""
        with self._transaction(write=False):
            rows = self._rows("q.id=? AND b.app=?", (_int("entry id", entry), app))
        if not rows:
            raise QAEntryNotFoundError("unknown QA entry")
        return rows[0]

    def qa_vectors(self, app: str, collection: str, adapter: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [n], embeddings float32 [n, dim] unit rows; row i of entry ids[i]), ascending id, both
        read-only; ``[0, 0]`` when the bank holds none. Kept in memory per bank and reloaded when its
        generation moved, by this connection or another."""
        with self._transaction(write=False):
            bank = self._bank(app, collection, adapter)
            if bank is None:
                return np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
            v = self._loaded(*bank)
        return v.ids, v.vectors

    def _loaded(self, bank: int, generation: int) -> _Vectors:
        """The bank's vectors, loaded when missing or stale (its generation moved)."""
        v = self._vectors.get(bank)
        if v is None or v.generation != generation:
            rows = self._q("SELECT id, embedding FROM rag_qa WHERE bank=? ORDER BY id", (bank,)).fetchall()
            ids = np.fromiter((r[0] for r in rows), np.int64, len(rows))
            vectors = (np.frombuffer(b"".join(r[1] for r in rows), "<f4").reshape(len(rows), -1)
                       if rows else np.zeros((0, 0), np.float32))
            ids.flags.writeable = vectors.flags.writeable = False  # shared by every caller until reloaded
            v = _Vectors(generation, ids, vectors)
            self._vectors[bank] = v
        self._vectors.move_to_end(bank)
        while len(self._vectors) > self.config.cached_banks:
            self._vectors.popitem(last=False)
        return v

    def delete_qa(self, app: str, entries: Iterable[int]) -> int:
        """Delete those of the app's entries (unknown and other apps' ids are skipped); returns how many."""
        ids = _ids("entry id", entries)
        with self._transaction(write=True):
            where = ("FROM rag_qa WHERE id IN (SELECT value FROM json_each(?)) "
                     "AND bank IN (SELECT id FROM rag_banks WHERE app=?)")
            self._changed([r[0] for r in self._q(f"SELECT DISTINCT bank {where}", (ids, app)).fetchall()])
            return self._q(f"DELETE {where}", (ids, app)).rowcount  # sources by cascade

    def qa_using_chunks(self, app: str, chunk_ids: Iterable[int]) -> list[EntryId]:
        """The app's entries whose sources include any of those knowledge chunks, ascending id."""
        ids = _ids("chunk id", chunk_ids)
        with self._transaction(write=False):
            return [EntryId(r[0]) for r in self._q(
                "SELECT DISTINCT s.entry FROM rag_qa_sources s JOIN rag_qa q ON q.id = s.entry "
                "JOIN rag_banks b ON b.id = q.bank WHERE s.chunk IN (SELECT value FROM json_each(?)) AND b.app=? "
                "ORDER BY s.entry", (ids, app))]

    def qa_bytes(self, app: str) -> int:
        """Bytes of all the app's entries (every collection and adapter), bytes."""
        with self._transaction(write=False):
            return self._q("SELECT COALESCE(SUM(q.nbytes), 0) FROM rag_qa q JOIN rag_banks b ON b.id = q.bank "
                           "WHERE b.app=?", (app,)).fetchone()[0]

    def total_bytes(self) -> dict[str, int]:
        """Bytes of every app's cache by level: `kv_tree` (nodes and heads), `qa_bank` (entries)."""
        with self._transaction(write=False):
            tree = self._q("SELECT (SELECT COALESCE(SUM(nbytes), 0) FROM rag_nodes) + "
                           "(SELECT COALESCE(SUM(head_nbytes), 0) FROM rag_trees)").fetchone()[0]
            qa = self._q("SELECT COALESCE(SUM(nbytes), 0) FROM rag_qa").fetchone()[0]
        return {"kv_tree": tree, "qa_bank": qa}

    def delete_collection_qa(self, app: str, collection: str) -> int:
        """Delete the app's entries of that collection, under every adapter; returns how many."""
        with self._transaction(write=True):
            return self._delete_banks("app=? AND collection=?", (app, collection))

    def _delete_banks(self, where: str, args: tuple) -> int:
        banks = [r[0] for r in self._q(f"SELECT id FROM rag_banks WHERE {where}", args).fetchall()]
        n = self._q(f"SELECT COUNT(*) FROM rag_qa WHERE bank IN (SELECT id FROM rag_banks WHERE {where})",
                    args).fetchone()[0]
        self._q(f"DELETE FROM rag_banks WHERE {where}", args)  # entries and sources by cascade
        for bank in banks:  # bank ids are never reused: a stale cache entry could only waste memory
            self._vectors.pop(bank, None)
        return n

    # -- predictor state -----------------------------------------------------------------------------

    def save_state(self, app: str, name: str, blob: str) -> None:
        """Store (or replace) the app's state of that name: JSON text the query predictor keeps."""
        _check_name("app name", app)
        _check_name("state name", name)
        if not isinstance(blob, str):
            raise ValueError(f"state must be a str (JSON text), got {type(blob).__name__}")
        with self._transaction(write=True):
            self._q("INSERT OR REPLACE INTO rag_state VALUES (?, ?, ?, ?)", (app, name, blob, self._clock()))

    def load_state(self, app: str, name: str) -> str | None:
        """The app's state of that name, None when none was saved."""
        with self._transaction(write=False):
            row = self._q("SELECT blob FROM rag_state WHERE app=? AND name=?", (app, name)).fetchone()
        return row[0] if row else None

    def state_apps(self, name: str) -> list[str]:
        """The apps with a saved state of that name, sorted."""
        with self._transaction(write=False):
            return [r[0] for r in self._q("SELECT app FROM rag_state WHERE name=? ORDER BY app", (name,))]

    # -- apps ----------------------------------------------------------------------------------------

    def delete_app(self, app: str) -> None:
        """Delete every tree, QA entry and state of ``app``, all or nothing (nothing when it has none)."""
        with self._transaction(write=True):
            self._q("DELETE FROM rag_trees WHERE app=?", (app,))  # nodes by cascade
            self._delete_banks("app=?", (app,))
            self._q("DELETE FROM rag_state WHERE app=?", (app,))
