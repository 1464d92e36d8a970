"""The knowledge bank: per-app collections of documents, split into token-bounded chunks and searched by
hybrid retrieval: BM25 (SQLite FTS5) and cosine over embeddings, fused by reciprocal rank (PerCache §4.2.2).

This module deliberately knows nothing about the model, K/V caches or prompts: the LLM's tokenizer
(chunk length is counted in its tokens; its ids are stored per chunk), the embedder and the clock are
injected. Callers key K/V nodes and QA entries by chunk id.

Its own ``kb_`` tables in any SQLite file (the registry's, or one alone), on its own connection (WAL,
``synchronous=FULL``, foreign keys on). A public method that writes is one ``BEGIN IMMEDIATE``
transaction, one that reads one deferred transaction (a snapshot). Tokenizing and embedding run before
the write transaction opens, so a slow embedder never holds the write lock. ::

    kb_meta         key PK, value (the schema version of the kb_ tables)
    kb_collections  id PK (hex), app, name, created, generation (moves with every change of its chunks:
                    the in-memory embedding matrix is reloaded when it did); UNIQUE (app, name)
    kb_documents    id PK (hex), collection ->, name, sha256 (of the content as given), kind, nbytes,
                    created; UNIQUE (collection, sha256)
    kb_chunks       id INTEGER PK AUTOINCREMENT (stable, never reused), document ->, collection ->,
                    ordinal, text, tokens (int32 LE blob), n_tokens, embedding (float32 LE blob)
    kb_fts          FTS5 over kb_chunks.text (external content), kept in step by triggers

BM25 statistics are those of the whole FTS table (all apps); the ranking is then restricted to one
collection.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import html.parser
import re
import secrets
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

from storage.errors import InvalidKeyError, StorageError
from storage.registry import _token_blob, _tokens
from storage.sqlitedb import SqliteTables

ChunkId = NewType("ChunkId", int)
"""Id of a knowledge chunk (not a K/V chunk of a context): stable, never reused."""

SCHEMA_VERSION = 1
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kb_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS kb_collections (
        id TEXT PRIMARY KEY, app TEXT NOT NULL, name TEXT NOT NULL, created REAL NOT NULL,
        generation INTEGER NOT NULL DEFAULT 0, UNIQUE (app, name))""",
    """CREATE TABLE IF NOT EXISTS kb_documents (
        id TEXT PRIMARY KEY, collection TEXT NOT NULL REFERENCES kb_collections(id) ON DELETE CASCADE,
        name TEXT NOT NULL, sha256 TEXT NOT NULL,
        kind TEXT NOT NULL CHECK (kind IN ('text', 'markdown', 'html')),
        nbytes INTEGER NOT NULL, created REAL NOT NULL, UNIQUE (collection, sha256))""",
    """CREATE TABLE IF NOT EXISTS kb_chunks (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        document TEXT NOT NULL REFERENCES kb_documents(id) ON DELETE CASCADE,
        collection TEXT NOT NULL REFERENCES kb_collections(id) ON DELETE CASCADE,
        ordinal INTEGER NOT NULL CHECK (ordinal >= 0), text TEXT NOT NULL, tokens BLOB NOT NULL,
        n_tokens INTEGER NOT NULL, embedding BLOB NOT NULL, UNIQUE (document, ordinal))""",
    "CREATE INDEX IF NOT EXISTS kb_chunks_by_collection ON kb_chunks(collection, id)",
    "CREATE VIRTUAL TABLE IF NOT EXISTS kb_fts USING fts5(text, content='kb_chunks', content_rowid='id')",
    """CREATE TRIGGER IF NOT EXISTS kb_chunks_fts_insert AFTER INSERT ON kb_chunks BEGIN
        INSERT INTO kb_fts(rowid, text) VALUES (new.id, new.text); END""",
    """CREATE TRIGGER IF NOT EXISTS kb_chunks_fts_delete AFTER DELETE ON kb_chunks BEGIN
        INSERT INTO kb_fts(kb_fts, rowid, text) VALUES ('delete', old.id, old.text); END""",
)


class KnowledgeError(StorageError):
    """Base of the knowledge bank's errors."""

    code = "knowledge_error"


class CollectionNotFoundError(KnowledgeError):
    """No such collection, or it belongs to another app (the two are indistinguishable on purpose)."""

    code = "collection_not_found"


class CollectionExistsError(KnowledgeError):
    """The app already has a collection of that name."""

    code = "collection_exists"


class DocumentNotFoundError(KnowledgeError):
    """No such document, or it belongs to another app."""

    code = "document_not_found"


class KnowledgeChunkNotFoundError(KnowledgeError):
    """No such knowledge chunk, or it belongs to another app."""

    code = "knowledge_chunk_not_found"


class DocumentTooLargeError(KnowledgeError):
    """The document is over ``max_document_bytes`` (a capacity error); nothing was stored."""

    code = "document_too_large"


class CollectionFullError(KnowledgeError):
    """The chunks would take the collection past ``max_chunks_per_collection``; nothing was stored."""

    code = "collection_full"


class EmptyDocumentError(KnowledgeError, ValueError):
    """The document has no text (empty, whitespace only, or HTML with no text)."""

    code = "empty_document"


class UnknownDocumentKindError(KnowledgeError, ValueError):
    """No text extractor for that kind (:data:`EXTRACTORS`); the message lists the valid kinds."""

    code = "unknown_document_kind"


@dataclass(frozen=True, slots=True)
class KnowledgeConfig:
    """Tunables of the knowledge bank."""

    chunk_tokens: int = 128  # most LLM tokens in one chunk (tokens)
    max_document_bytes: int = 1 << 20  # UTF-8 size of one document as given, before stripping (bytes)
    max_chunks_per_collection: int = 20_000  # chunks one collection may hold (chunks)
    rrf_k: int = 60  # the constant of reciprocal rank fusion (ranks); 60 as in the RRF paper
    candidates: int = 50  # best chunks of each ranker that enter the fusion (chunks); at least k of search
    cached_collections: int = 8  # embedding matrices kept in memory, least recently searched out (collections)
    busy_timeout_s: float = 10.0  # wait for another connection's write lock (seconds)

    def __post_init__(self) -> None:  # 8: one character may take 4 byte-level tokens, a chunk must hold it
        if self.chunk_tokens < 8 or min(self.max_document_bytes, self.max_chunks_per_collection,
                                         self.candidates, self.cached_collections, self.rrf_k + 1) < 1:
            raise ValueError(f"chunk_tokens must be >= 8 and the other limits positive: {self}")


@dataclass(frozen=True, slots=True)
class CollectionInfo:
    """A collection with its sizes."""

    id: str  # opaque hex id
    app: str  # owner app name
    name: str  # unique within the app
    created: float  # clock seconds
    documents: int  # documents in it
    chunks: int  # chunks in it


@dataclass(frozen=True, slots=True)
class DocumentInfo:
    """A document row with its chunk count (the text lives in its chunks)."""

    id: str  # opaque hex id
    collection: str  # collection id
    name: str  # title given when it was added ("" for none)
    sha256: str  # hex sha256 of the UTF-8 content as given (before stripping)
    kind: str  # "text", "markdown" or "html"
    nbytes: int  # UTF-8 size of the content as given (bytes)
    created: float  # clock seconds
    chunks: int  # chunks it was split into


@dataclass(frozen=True, slots=True)
class KnowledgeChunk:
    """One chunk of a document."""

    id: ChunkId  # stable id (K/V cache nodes are keyed by it)
    document: str  # document id
    collection: str  # collection id
    ordinal: int  # position in its document, from 0
    text: str  # the slice of the document's text it covers
    token_ids: np.ndarray  # int32 [n], read-only: tokenize(text) of the LLM's tokenizer


@dataclass(frozen=True, slots=True)
class Hit:
    """One search result."""

    chunk: ChunkId  # chunk id
    document: str  # document id
    ordinal: int  # position in its document
    text: str  # the chunk's text
    token_ids: np.ndarray  # int32 [n], read-only: the chunk's LLM token ids
    bm25_rank: int | None  # 1-based rank by BM25 among the candidates; None when not among them
    dense_rank: int | None  # 1-based rank by cosine among the candidates; None when not among them
    score: float  # fused RRF score: sum of 1 / (rrf_k + rank) over the rankers that ranked it


@dataclass(slots=True)
class _Matrix:
    """A collection's embeddings in memory, valid while its generation has not moved."""

    generation: int  # kb_collections.generation when loaded
    ids: np.ndarray  # int64 [n] chunk ids, ascending
    vectors: np.ndarray  # float32 [n, dim] unit rows, row i of chunk ids[i]


class _HTMLText(html.parser.HTMLParser):
    """Visible text of an HTML page: script and style dropped, block elements as paragraph breaks,
    whitespace collapsed outside <pre>."""

    BLOCKS = frozenset("address article aside blockquote body caption dd div dl dt figcaption figure footer form "
                       "h1 h2 h3 h4 h5 h6 header hr li main nav ol p pre section table td th title tr ul".split())
    SKIP = frozenset({"script", "style", "template", "noscript"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []  # text of finished blocks
        self._buf: list[str] = []  # text of the block being read
        self._skip = 0  # depth inside SKIP elements
        self._pre = 0  # depth inside <pre>

    def _flush(self) -> None:
        text = "".join(self._buf).strip("\n" if self._pre else None)
        if text.strip():
            self.paragraphs.append(text)
        self._buf.clear()

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in self.SKIP:
            self._skip += 1
        elif tag == "br":
            self._buf.append("\n")
        elif tag in self.BLOCKS:
            self._flush()
            self._pre += tag == "pre"

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self._skip = max(0, self._skip - 1)
        elif tag in self.BLOCKS:
            self._flush()
            self._pre = max(0, self._pre - (tag == "pre"))

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self._buf.append(data if self._pre else re.sub(r"\s+", " ", data))


def html_to_text(content: str) -> str:
    """The visible text of an HTML document, one paragraph per block element."""
    parser = _HTMLText()
    parser.feed(content)
    parser.close()
    parser._flush()
    return "\n\n".join(parser.paragraphs)


def plain_text(content: str) -> str:
    """Plain text and Markdown as they are (Markdown reads fine to a model), line ends made ``\\n``."""
    return content.replace("\r\n", "\n").replace("\r", "\n").strip()


EXTRACTORS: dict[str, Callable[[str], str]] = {"text": plain_text, "markdown": plain_text, "html": html_to_text}
"""Document kind -> the function that turns its content into the text that is chunked."""


_PARAGRAPH = re.compile(r"\n[ \t]*\n\s*")  # a blank line
_SENTENCE = re.compile(r"(?<=[.!?\u2026])\s+|\s*\n\s*")  # whitespace after . ! ? ..., or a line break
_WORD = re.compile(r"\s+")

Span = tuple[int, int]


def _between(text: str, sep: re.Pattern, start: int, end: int) -> list[Span]:
    """The non-blank pieces of text[start:end] between matches of ``sep``, trimmed, as absolute spans."""
    out, pos = [], start
    for m in [*sep.finditer(text, start, end), None]:
        piece = text[pos:m.start() if m else end]
        a, b = pos + len(piece) - len(piece.lstrip()), pos + len(piece.rstrip())
        if a < b:
            out.append((a, b))
        pos = m.end() if m else end
    return out


def _pieces(text: str, tokenize: Callable[[str], list[int]], limit: int) -> list[tuple[Span, int]]:
    """(span, token count) of the pieces of ``text`` that each fit ``limit`` (see split_text)."""
    out = []

    def split(span: Span, levels: tuple[re.Pattern, ...]) -> None:
        n = len(tokenize(text[span[0]:span[1]]))
        if n <= limit:
            out.append((span, n))
        elif levels:
            for sub in _between(text, levels[0], *span):
                split(sub, levels[1:])
        else:
            out.extend(_characters(text, span, tokenize, limit))

    for para in _between(text, _PARAGRAPH, 0, len(text)):
        split(para, (_SENTENCE, _WORD))
    return out


def _characters(text: str, span: Span, tokenize, limit: int) -> list[tuple[Span, int]]:
    """A word too long for one chunk, cut into the longest prefixes that fit (binary search)."""
    out, a = [], span[0]
    while a < span[1]:
        b = a + bisect.bisect_right(range(a + 1, span[1] + 1), limit, key=lambda b: len(tokenize(text[a:b])))
        if b == a:
            raise RuntimeError(f"one character takes more than {limit} tokens")
        out.append(((a, b), len(tokenize(text[a:b]))))
        a = b
    return out


def split_text(text: str, tokenize: Callable[[str], list[int]], limit: int) -> list[tuple[str, list[int]]]:
    """(chunk text, its token ids) of ``text`` in order, each of at most ``limit`` tokens. Pieces that each
    fit: paragraphs, else sentences, else words, else characters (there is no decoder: "token boundaries"
    are word, then character boundaries), packed greedily: a chunk is the text they span, its ids
    ``tokenize(chunk)``; from the sum of the pieces' counts, one piece fewer or more until exact."""
    pieces = _pieces(text, tokenize, limit)

    def span(i: int, j: int) -> str:  # the text of pieces i .. j-1
        return text[pieces[i][0][0]:pieces[j - 1][0][1]]

    chunks: list[tuple[str, list[int]]] = []
    i = 0
    while i < len(pieces):
        j, total = i + 1, pieces[i][1]
        while j < len(pieces) and total + pieces[j][1] <= limit:
            total += pieces[j][1]
            j += 1
        ids = list(tokenize(span(i, j)))
        while len(ids) > limit:  # piece i alone fits, so this stops at j = i + 1
            j -= 1
            ids = list(tokenize(span(i, j)))
        while j < len(pieces) and len(more := list(tokenize(span(i, j + 1)))) <= limit:
            j, ids = j + 1, more
        chunks.append((span(i, j), ids))
        i = j
    return chunks


_TERM = re.compile(r"[^\W_]+")  # letters and digits: what FTS5's unicode61 tokenizer keeps
MAX_QUERY_TERMS = 64
"""Distinct query terms given to FTS5 at most (a bound on the cost of one query)."""


def fts_query(text: str) -> str:
    """A user's query as an FTS5 expression that cannot be a syntax error: its words, each quoted, OR-ed
    (``"a" OR "b"``); "" when it has none. FTS5 operators in the text become plain words."""
    terms = list(dict.fromkeys(t.lower() for t in _TERM.findall(text)))[:MAX_QUERY_TERMS]
    return " OR ".join(f'"{t}"' for t in terms)


def fuse(rankings: Sequence[Sequence[int]], k: int = 60) -> list[tuple[int, float]]:
    """Reciprocal rank fusion ("Reciprocal Rank Fusion outperforms Condorcet and individual Rank Learning
    Methods"): an id scores sum(1 / (k + rank)) over the rankings holding it; best first, ties by id."""
    scores: dict[int, float] = collections.defaultdict(float)
    for ranking in rankings:
        for rank, ident in enumerate(ranking, 1):
            scores[ident] += 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))


def top_cosine(vectors: np.ndarray, ids: np.ndarray, query: np.ndarray, n: int) -> list[int]:
    """Ids of the ``n`` rows of ``vectors`` (unit rows, float32 [N, dim]) nearest ``query`` ([dim]) by
    cosine, best first; equal scores by ascending id, also at the cut."""
    scores = vectors @ query  # [N]
    if len(scores) > n:
        cut = np.partition(scores, len(scores) - n)[len(scores) - n]  # the n-th best score
        keep = np.flatnonzero(scores >= cut)  # every tie at the cut, so the id order decides
        scores, ids = scores[keep], ids[keep]
    return ids[np.lexsort((ids, -scores))][:n].tolist()


def _unit_rows(vectors, n: int) -> np.ndarray:
    """``embed``'s answer for n texts as float32 [n, dim] unit rows (re-normalised: a dot is a cosine)."""
    v = np.asarray(vectors, dtype=np.float32)
    if v.ndim != 2 or v.shape[0] != n or v.shape[1] < 1 or not np.isfinite(v).all():
        raise ValueError(f"embed must return finite float rows [{n}, dim], got shape {v.shape}")
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def _check_name(what: str, name) -> None:
    if not isinstance(name, str) or not 1 <= len(name) <= 128 or not name.isprintable():
        raise InvalidKeyError(f"{what} must be 1-128 printable characters")


class KnowledgeBank(SqliteTables):
    """Collections, documents and chunks of many apps in one SQLite file, with hybrid search. Thread-safe
    (one connection, one lock). Another app's collection, document or chunk is "not found", as a missing one."""

    def __init__(self, path: str, *, tokenize: Callable[[str], list[int]],
                 embed: Callable[[list[str]], np.ndarray], clock: Callable[[], float] = time.time,
                 config: KnowledgeConfig | None = None):
        self.config = config or KnowledgeConfig()
        self._tokenize = tokenize
        self._embed = embed
        self._clock = clock
        self._matrices: collections.OrderedDict[str, _Matrix] = collections.OrderedDict()  # LRU by search
        super().__init__(path, busy_timeout_s=self.config.busy_timeout_s, schema=_SCHEMA, meta="kb_meta",
                         version=SCHEMA_VERSION, error=KnowledgeError, what="knowledge")

    def _generation(self, app: str, collection: str) -> int:
        """The collection's generation; CollectionNotFoundError when it is missing or another app's."""
        row = self._q("SELECT generation FROM kb_collections WHERE id=? AND app=?", (collection, app)).fetchone()
        if row is None:
            raise CollectionNotFoundError("unknown collection")
        return row[0]

    def _changed(self, collection: str) -> None:
        self._q("UPDATE kb_collections SET generation = generation + 1 WHERE id=?", (collection,))
        self._matrices.pop(collection, None)

    # -- collections ---------------------------------------------------------------------------------

    def create_collection(self, app: str, name: str) -> str:
        """Create an empty collection for ``app``; returns its id (32 hex digits)."""
        _check_name("app name", app)
        _check_name("collection name", name)
        ident = secrets.token_hex(16)
        with self._transaction(write=True):
            try:
                self._q("INSERT INTO kb_collections (id, app, name, created) VALUES (?, ?, ?, ?)",
                        (ident, app, name, self._clock()))
            except sqlite3.IntegrityError:
                raise CollectionExistsError(f"app {app!r} has a collection named {name!r}") from None
        return ident

    def collections(self, app: str) -> list[CollectionInfo]:
        """The app's collections, oldest first."""
        with self._transaction(write=False):
            rows = self._q(
                "SELECT k.id, k.app, k.name, k.created, "
                "(SELECT COUNT(*) FROM kb_documents d WHERE d.collection = k.id), "
                "(SELECT COUNT(*) FROM kb_chunks c WHERE c.collection = k.id) "
                "FROM kb_collections k WHERE k.app=? ORDER BY k.created, k.id", (app,)).fetchall()
        return [CollectionInfo(*r) for r in rows]

    def delete_collection(self, app: str, collection: str) -> list[ChunkId]:
        """Delete a collection with its documents and chunks; returns the deleted chunk ids."""
        with self._transaction(write=True):
            self._generation(app, collection)
            return self._delete_collections("k.id=?", (collection,))

    def delete_app(self, app: str) -> list[ChunkId]:
        """Delete every collection of ``app`` (nothing when it has none); returns the deleted chunk ids."""
        with self._transaction(write=True):
            return self._delete_collections("k.app=?", (app,))

    def _delete_collections(self, where: str, args: tuple) -> list[ChunkId]:
        for (collection,) in self._q(f"SELECT id FROM kb_collections k WHERE {where}", args).fetchall():
            self._matrices.pop(collection, None)
        ids = [r[0] for r in self._q(f"SELECT c.id FROM kb_chunks c JOIN kb_collections k ON k.id = c.collection "
                                     f"WHERE {where} ORDER BY c.id", args)]
        self._q(f"DELETE FROM kb_collections AS k WHERE {where}", args)
        return ids

    # -- documents -----------------------------------------------------------------------------------

    def add_document(self, app: str, collection: str, content: str, *, name: str = "",
                     kind: str = "text") -> str:
        """Split, embed and store a document; returns its id. Adding content identical (sha256) to a
        document already in the collection changes nothing and returns that document's id (its name
        and kind stay as first given). Refused, with nothing stored: unknown kind, content over
        ``max_document_bytes``, no text, or more chunks than the collection has room for."""
        if kind not in EXTRACTORS:
            raise UnknownDocumentKindError(f"unknown document kind {kind!r}; valid: {sorted(EXTRACTORS)}")
        if not isinstance(content, str) or not isinstance(name, str) or len(name) > 1024:
            raise ValueError("content must be a str, name a str of at most 1024 characters")
        raw = content.encode("utf-8")
        if len(raw) > self.config.max_document_bytes:
            raise DocumentTooLargeError(f"document of {len(raw)} bytes; the limit is {self.config.max_document_bytes}")
        digest = hashlib.sha256(raw).hexdigest()
        with self._transaction(write=False):  # cheap checks first: a re-add costs no embedding
            self._generation(app, collection)
            if (existing := self._by_hash(collection, digest)) is not None:
                return existing
            self._check_room(collection, 1)
        text = EXTRACTORS[kind](content)
        if not text.strip():
            raise EmptyDocumentError("the document has no text")
        chunks = split_text(text, self._tokenize, self.config.chunk_tokens)
        vectors = _unit_rows(self._embed([t for t, _ in chunks]), len(chunks))  # before the write lock
        rows = [(collection, i, t, _token_blob(np.asarray(ids, dtype=np.int64)), len(ids), v.astype("<f4").tobytes())
                for i, ((t, ids), v) in enumerate(zip(chunks, vectors))]
        doc = secrets.token_hex(16)
        with self._transaction(write=True):
            self._generation(app, collection)
            if (existing := self._by_hash(collection, digest)) is not None:  # added meanwhile
                return existing
            self._check_room(collection, len(rows))
            width = self._q("SELECT length(embedding) / 4 FROM kb_chunks WHERE collection=? LIMIT 1",
                            (collection,)).fetchone()
            if width and width[0] != vectors.shape[1]:  # another embedding model: cosines would be noise
                raise ValueError(f"embeddings of width {vectors.shape[1]}; the collection's are {width[0]} wide")
            self._q("INSERT INTO kb_documents VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (doc, collection, name, digest, kind, len(raw), self._clock()))
            self._db.executemany("INSERT INTO kb_chunks (document, collection, ordinal, text, tokens, n_tokens, "
                                 "embedding) VALUES (?, ?, ?, ?, ?, ?, ?)", [(doc, *r) for r in rows])
            self._changed(collection)
        return doc

    def _by_hash(self, collection: str, digest: str) -> str | None:
        row = self._q("SELECT id FROM kb_documents WHERE collection=? AND sha256=?", (collection, digest)).fetchone()
        return row[0] if row else None

    def _check_room(self, collection: str, n: int) -> None:
        have = self._q("SELECT COUNT(*) FROM kb_chunks WHERE collection=?", (collection,)).fetchone()[0]
        if have + n > (limit := self.config.max_chunks_per_collection):
            raise CollectionFullError(f"the collection holds {have} chunks; {n} more would pass its limit, {limit}")

    def delete_document(self, app: str, document: str) -> list[ChunkId]:
        """Delete a document and its chunks (and their full-text rows); returns the deleted chunk ids, for
        the caller to drop what it derived from them (K/V nodes, QA entries)."""
        with self._transaction(write=True):
            collection = self._document_collection(app, document)
            ids = [r[0] for r in self._q("SELECT id FROM kb_chunks WHERE document=? ORDER BY id", (document,))]
            self._q("DELETE FROM kb_documents WHERE id=?", (document,))
            self._changed(collection)
        return ids

    def _document_collection(self, app: str, document: str) -> str:
        row = self._q("SELECT d.collection FROM kb_documents d JOIN kb_collections k ON k.id = d.collection "
                      "WHERE d.id=? AND k.app=?", (document, app)).fetchone()
        if row is None:
            raise DocumentNotFoundError("unknown document")  # another app's document looks the same
        return row[0]

    def documents(self, app: str, collection: str) -> list[DocumentInfo]:
        """The collection's documents, oldest first, with their chunk counts."""
        with self._transaction(write=False):
            self._generation(app, collection)
            rows = self._q("SELECT d.id, d.collection, d.name, d.sha256, d.kind, d.nbytes, d.created, "
                           "(SELECT COUNT(*) FROM kb_chunks c WHERE c.document = d.id) FROM kb_documents d "
                           "WHERE d.collection=? ORDER BY d.created, d.id", (collection,)).fetchall()
        return [DocumentInfo(*r) for r in rows]

    # -- chunks --------------------------------------------------------------------------------------

    _CHUNK_SQL = ("SELECT c.id, c.document, c.collection, c.ordinal, c.text, c.tokens FROM kb_chunks c "
                  "JOIN kb_collections k ON k.id = c.collection ")

    def chunk(self, app: str, chunk: ChunkId) -> KnowledgeChunk:
        """One chunk of the app, by id."""
        with self._transaction(write=False):
            row = self._q(self._CHUNK_SQL + "WHERE c.id=? AND k.app=?", (chunk, app)).fetchone()
        if row is None:
            raise KnowledgeChunkNotFoundError("unknown knowledge chunk")
        return KnowledgeChunk(*row[:5], _tokens(row[5]))

    def chunks(self, app: str, document: str) -> list[KnowledgeChunk]:
        """A document's chunks, in order."""
        with self._transaction(write=False):
            self._document_collection(app, document)
            rows = self._q(self._CHUNK_SQL + "WHERE c.document=? ORDER BY c.ordinal", (document,)).fetchall()
        return [KnowledgeChunk(*r[:5], _tokens(r[5])) for r in rows]

    def chunks_after(self, app: str, collection: str, after: int = 0, limit: int = 1) -> list[KnowledgeChunk]:
        """Up to ``limit`` of the collection's chunks with ids above ``after``, in the order they were
        added (ids are never reused, so the last id seen is a cursor that survives deletions)."""
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        with self._transaction(write=False):
            self._generation(app, collection)
            rows = self._q(self._CHUNK_SQL + "WHERE c.collection=? AND c.id>? ORDER BY c.id LIMIT ?",
                           (collection, int(after), limit)).fetchall()
        return [KnowledgeChunk(*r[:5], _tokens(r[5])) for r in rows]

    # -- search --------------------------------------------------------------------------------------

    def search(self, app: str, collection: str, query: str, k: int = 5, vector: np.ndarray | None = None) -> list[Hit]:
        """The ``k`` chunks of the collection that best answer ``query``: BM25 and cosine rankings (the
        best ``max(k, candidates)`` of each) fused by reciprocal rank; equal scores by ascending chunk
        id. A query with no words gets the cosine ranking alone; FTS5 syntax in it is plain text.
        ``vector``: the query's embedding when the caller has it already."""
        if not isinstance(query, str) or not isinstance(k, int) or k < 1:
            raise ValueError(f"search takes a str query and a positive int k, got {type(query).__name__}, {k!r}")
        q = _unit_rows(self._embed([query]) if vector is None else np.asarray(vector)[None], 1)[0]  # before the lock
        match = fts_query(query)
        n = max(k, self.config.candidates)
        with self._transaction(write=False):
            generation = self._generation(app, collection)
            bm25 = [r[0] for r in self._q(
                "SELECT c.id FROM kb_fts JOIN kb_chunks c ON c.id = kb_fts.rowid WHERE kb_fts MATCH ? "
                "AND c.collection=? ORDER BY bm25(kb_fts), c.id LIMIT ?", (match, collection, n))] if match else []
            m = self._matrix(collection, generation)
            if len(m.ids) and m.vectors.shape[1] != q.shape[0]:
                raise ValueError(f"query embedding of width {q.shape[0]}; the collection's are {m.vectors.shape[1]}")
            dense = top_cosine(m.vectors, m.ids, q, n) if len(m.ids) else []
            fused = fuse([bm25, dense], self.config.rrf_k)[:k]
            rows = {r[0]: r for r in self._q(
                "SELECT id, document, ordinal, text, tokens FROM kb_chunks WHERE id IN "
                f"({','.join('?' * len(fused))})", tuple(i for i, _ in fused))}
        bm25_rank = {c: r for r, c in enumerate(bm25, 1)}
        dense_rank = {c: r for r, c in enumerate(dense, 1)}
        return [Hit(ChunkId(c), rows[c][1], rows[c][2], rows[c][3], _tokens(rows[c][4]),
                    bm25_rank.get(c), dense_rank.get(c), score) for c, score in fused]

    def _matrix(self, collection: str, generation: int) -> _Matrix:
        """The collection's embedding matrix, loaded when missing or stale (its generation moved)."""
        m = self._matrices.get(collection)
        if m is None or m.generation != generation:
            rows = self._q("SELECT id, embedding FROM kb_chunks WHERE collection=? ORDER BY id",
                           (collection,)).fetchall()
            ids = np.fromiter((r[0] for r in rows), np.int64, len(rows))
            vectors = (np.frombuffer(b"".join(r[1] for r in rows), "<f4").reshape(len(rows), -1)
                       if rows else np.zeros((0, 0), np.float32))
            m = _Matrix(generation, ids, vectors)
            self._matrices[collection] = m
        self._matrices.move_to_end(collection)
        while len(self._matrices) > self.config.cached_collections:
            self._matrices.popitem(last=False)
        return m
