"""The query predictor (the design card's fifth actor): the node's RAG cache (PerCache). It holds the
knowledge bank, the embedding model, the QA bank and the K/V tree (`actors.ragfront.RagCache`), and
drives the one model executor for RAG prompts through its port (`rag_call`). A plain class; on Ray
`actors.ray_actors.PredictorActor` hosts it with one torch thread and no CPU of its own.

The embedding model (all-MiniLM-L6-v2, `engine.embed`) loads on first use: a node that never sees a
RAG request never pays for it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from actors.messages import KVKey
from actors.config import RagConfig
from actors.ragfront import RagAnswer, RagCache


class QueryPredictor:
    def __init__(self, data_dir: str, tokenizer, executor, delete_node: Callable[[str], Any], model_key: KVKey,
                 config: RagConfig | None = None, *, embed: Callable[[list[str]], np.ndarray] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """`tokenizer`: the model's `engine.chat.ChatTokenizer`; `executor`: an `ExecutorPort`;
        `delete_node`: the IO port's `delete_context`; `embed`: an embedding function (default: the
        packaged all-MiniLM-L6-v2, loaded on first use)."""
        from engine.rag import RagTemplate
        from storage.knowledge import KnowledgeBank, KnowledgeConfig
        from storage.ragstore import RagStore

        self._embedder = None
        self._embed_lock = threading.Lock()
        self._embed = embed
        db = str(Path(data_dir) / "registry.db")
        self.bank = KnowledgeBank(db, tokenize=tokenizer.encode, embed=self.embed, clock=clock,
                                  config=KnowledgeConfig(chunk_tokens=(config or RagConfig()).passage_tokens))
        self.store = RagStore(db, clock=clock)
        self.rag = RagCache(self.bank, self.store, self.embed, RagTemplate(tokenizer), executor.rag_call,
                            delete_node, model_key, config, clock=clock)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit rows of `texts` (the OpenAI embeddings route and retrieval use the same model)."""
        if self._embed is not None:
            return self._embed(texts)
        with self._embed_lock:
            if self._embedder is None:
                from engine.embed import Embedder

                self._embedder = Embedder()
        return self._embedder.embed(texts)

    # ---- collections and documents (`storage.knowledge`) ------------------------------------------
    def create_collection(self, app: str, name: str) -> str:
        return self.bank.create_collection(app, name)

    def collections(self, app: str) -> list[dict]:
        return [_info(c) for c in self.bank.collections(app)]

    def delete_collection(self, app: str, collection: str) -> None:
        self.rag.chunks_deleted(app, self.bank.delete_collection(app, collection))
        self.store.delete_collection_qa(app, collection)

    def add_document(self, app: str, collection: str, content: str, name: str = "", kind: str = "text") -> str:
        return self.bank.add_document(app, collection, content, name=name, kind=kind)

    def documents(self, app: str, collection: str) -> list[dict]:
        return [_info(d) for d in self.bank.documents(app, collection)]

    def delete_document(self, app: str, document: str) -> int:
        """Delete a document; its passages' K/V nodes and the answers they gave go with it."""
        gone = self.bank.delete_document(app, document)
        self.rag.chunks_deleted(app, gone)
        return len(gone)

    # ---- queries ------------------------------------------------------------------------------------
    def query(self, app: str, collection: str, question: str, params: dict) -> RagAnswer:
        """Answer `question` over `app`'s `collection` (`RagCache.query`; `params`: `k`, `tau_query`,
        `adapter` and sampling)."""
        return self.rag.query(app, collection, question, **params)

    def close(self) -> None:
        self.bank.close()
        self.store.close()


def _info(record) -> dict:
    return {name: getattr(record, name) for name in record.__slots__}
