"""Knowledge bank search speed: dense and hybrid search over one collection of many chunks.

    python -m bench.knowledge_search [--chunks 10000] [--queries 50] [--dim 384] [--dir PATH]

Fills a fresh knowledge bank (its own SQLite file in a temp folder) with ``--chunks`` chunks of random
words (a whitespace tokenizer; one chunk per paragraph) and random unit ``--dim``-d embeddings (a fake
embedder: no model, so the times are the bank's alone), then times ``--queries`` searches (k = 5) of
each kind and prints the median in milliseconds:

- dense: a query with no words (cosine over the collection's embedding matrix, then the fusion);
- hybrid: three words of the vocabulary (FTS5 BM25 and cosine, fused by reciprocal rank).

The first search after the fill loads the embedding matrix from SQLite; it is timed on its own. This is
a benchmark entry point: it knows nothing the storage package does not export.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib

import numpy as np

from storage.knowledge import KnowledgeBank, KnowledgeConfig

WORDS_PER_CHUNK = 100
DOCUMENT_CHUNKS = 100  # paragraphs per document


class RandomEmbed:
    """Random unit rows, the same for the same text (seeded by its crc32)."""

    def __init__(self, dim: int):
        self.dim = dim

    def __call__(self, texts: list[str]) -> np.ndarray:
        out = np.stack([np.random.default_rng(zlib.crc32(t.encode())).standard_normal(self.dim) for t in texts])
        return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)


def whitespace_tokens(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) & 0x7FFFFFFF for w in text.split()]


def fill(bank: KnowledgeBank, n_chunks: int, vocab: list[str], rng: np.random.Generator) -> str:
    col = bank.create_collection("bench", "docs")
    for d in range(0, n_chunks, DOCUMENT_CHUNKS):
        paras = [" ".join(rng.choice(vocab, WORDS_PER_CHUNK)) + "." for _ in range(min(DOCUMENT_CHUNKS, n_chunks - d))]
        bank.add_document("bench", col, "\n\n".join(paras), name=f"doc{d // DOCUMENT_CHUNKS}")
    return col


def median_ms(fn, queries: list[str]) -> float:
    times = []
    for q in queries:
        t0 = time.perf_counter()
        fn(q)
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.knowledge_search", description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=10_000, help="chunks in the collection (default 10000)")
    p.add_argument("--queries", type=int, default=50, help="searches of each kind (default 50)")
    p.add_argument("--dim", type=int, default=384, help="embedding width (default 384, all-MiniLM-L6-v2's)")
    p.add_argument("--dir", default=None, help="folder for the SQLite file (default: a temp folder)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(20_000)]
    embed = RandomEmbed(args.dim)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        config = KnowledgeConfig(chunk_tokens=128, max_chunks_per_collection=max(20_000, args.chunks))
        with KnowledgeBank(os.path.join(tmp, "kb.db"), tokenize=whitespace_tokens, embed=embed,
                           config=config) as bank:
            t0 = time.perf_counter()
            col = fill(bank, args.chunks, vocab, rng)
            n = bank.collections("bench")[0].chunks
            print(f"filled {n} chunks ({args.dim}-d embeddings) in {time.perf_counter() - t0:.1f} s")
            t0 = time.perf_counter()
            bank.search("bench", col, "?", k=5)
            print(f"first search (loads the {n} x {args.dim} matrix): {1e3 * (time.perf_counter() - t0):.1f} ms")
            dense = ["?" * (1 + i) for i in range(args.queries)]  # no words: the cosine ranking alone
            hybrid = [" ".join(rng.choice(vocab, 3)) for _ in range(args.queries)]
            print(f"dense search:  median {median_ms(lambda q: bank.search('bench', col, q, k=5), dense):.2f} ms "
                  f"over {args.queries} queries")
            print(f"hybrid search: median {median_ms(lambda q: bank.search('bench', col, q, k=5), hybrid):.2f} ms "
                  f"over {args.queries} queries")


if __name__ == "__main__":
    main()
