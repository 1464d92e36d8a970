"""The query predictor's Ray actor: `actors.predictor.QueryPredictor` (the RAG cache) with the probe,
its metrics and a concurrency group for the catalogue. It knows the other actors only by their stubs
(`actors.ray_stubs`); the shell every actor shares (`Health`, `restarted`) is in `actors.ray_actors`,
the wiring in `actors.ray_service`.
"""

from __future__ import annotations

import contextlib

import ray

from actors.config import ServiceConfig, private_files
from actors.predictor import QueryPredictor
from actors.ray_actors import Health, restarted
from actors.ray_stubs import SwapIOStub, peer


def _in_group(group: str, method):
    """`method` (of a base class) as an actor method of the concurrency group `group` (not through
    `functools.wraps`: Ray then reads the group from the wrapped function, which has none)."""
    @ray.method(concurrency_group=group)
    def call(self, *args, **kwargs):
        return method(self, *args, **kwargs)
    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class PredictorActor(QueryPredictor, Health):
    """The query predictor actor (the RAG cache, `actors.predictor.QueryPredictor`): no CPU of its own and
    one torch thread for the embedding model; the model runs in the executor, through its port."""

    GROUPS = {"catalogue": 1}
    """Listing collections and documents, creating a collection and embedding do not wait for a RAG
    answer; what changes what a query reads (adding or deleting documents) stays in order with queries."""
    collections = _in_group("catalogue", QueryPredictor.collections)
    documents = _in_group("catalogue", QueryPredictor.documents)
    create_collection = _in_group("catalogue", QueryPredictor.create_collection)
    embed = _in_group("catalogue", QueryPredictor.embed)

    def __init__(self, config: ServiceConfig, model_dir: str, key, prefix: str) -> None:
        import torch

        from actors.ray_stubs import ExecutorStub, resolved_items
        from engine.chat import ChatTokenizer

        from actors.metrics import Metrics, init_predictor_series

        torch.set_num_threads(1)
        private_files()
        super().__init__(config.data_dir, ChatTokenizer(model_dir), ExecutorStub(peer(prefix, "executor")),
                         SwapIOStub(peer(prefix, "io")).delete_context, key, config.rag, resolve_stream=resolved_items)
        self.metrics = m = Metrics()
        m.start("predictor", config.data_dir)
        restarted("predictor", config.data_dir, m)
        init_predictor_series(m)
        self._count_bytes()
        self.start()

    def tick(self, now: float | None = None) -> list[dict]:
        done = super().tick(now)
        for r in done:
            self.metrics.predicted.inc(len(r["questions"]))
            self.metrics.predictor_seconds.inc(r["model_s"])
        return done

    def query(self, app: str, collection: str, question: str, params: dict):
        a = super().query(app, collection, question, params)
        self._observe_answer(a)
        return a

    def query_stream(self, app: str, collection: str, question: str, params: dict):
        """Streaming generator: text deltas, then the `RagAnswer`."""
        with contextlib.closing(super().query_stream(app, collection, question, params)) as items:
            for item in items:
                if not isinstance(item, str):
                    self._observe_answer(item)
                yield item

    def _observe_answer(self, a) -> None:
        m = self.metrics
        m.rag_queries.labels(a.level).inc()
        m.qa_hits.inc(a.level == "qa_bank")
        m.tree_hits.inc(a.level == "kv_tree")
        m.tree_tokens.inc(a.reused_tokens)
        m.blended_tokens.inc(a.blended_tokens)
        m.retrieved_tokens.inc(a.retrieved_tokens)
        self._count_bytes()

    def _count_bytes(self) -> None:
        for level, n in self.store.total_bytes().items():
            self.metrics.rag_bytes.labels(level).set(n)
