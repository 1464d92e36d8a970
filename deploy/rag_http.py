"""The RAG routes of the HTTP API (docs/design.md §6): collections of an app's documents, questions over
them answered through the query predictor's RAG cache (PerCache), and OpenAI-style embeddings. A mixin
of `deploy.serve_app.Ingress`, which provides `_app`, `_do`, `_timeout`, `_events`, `_first` and the
predictor's actor handle (`predictor`).

(No `from __future__ import annotations` here, as in `deploy.serve_app`: FastAPI must see the route
annotations as real types.)
"""

import re
import time
import uuid

from fastapi import Request

from deploy.api_docs import ACTORS, APP, BODY, CALL_HEADERS, WRITES, responses
from deploy.api_models import APIError, CollectionBody, DocumentBody, EmbeddingsBody, RagQueryBody, Sampling
from deploy.http_parts import api, outcome, sse_response

_ID = re.compile(r"[0-9a-f]{32}")
COLLECTION = ("collection_not_found",)
"""Routes on a collection id: unknown, malformed, or another app's (404)."""
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
SSE_RAG = ('Server-Sent Events with `"stream": true`: `data: {"delta": TEXT}` as the answer is decoded (an answer '
           'from the QA bank in one event), then `data: {"done": true, ...}` with the fields of the JSON '
           'reply, then `data: [DONE]`.')
TIMEOUT_HEADER = {"parameters": [p for p in CALL_HEADERS["parameters"] if p["name"] == "X-Request-Timeout"]}


def _check(ident: str, code: str) -> str:
    """Collection and document ids are 32 lowercase hex digits (server-made): anything else is unknown."""
    if not isinstance(ident, str) or _ID.fullmatch(ident) is None:
        raise APIError(code, "no such " + code.split("_")[0])
    return ident


def rag_reply(a: dict) -> dict:
    """The JSON reply of a RAG query from its `actors.ragfront.RagAnswer` (as a dict)."""
    return {"answer": a["answer"], "finish_reason": a["finish_reason"], "sources": a["sources"],
            "cache": {"level": a["level"], "chunks_reused": a["reused_chunks"], "tokens_reused": a["reused_tokens"],
                      "retrieved_tokens": a["retrieved_tokens"], "similarity": a["similarity"],
                      "tokens_blended": a.get("blended_tokens", 0), "tokens_recomputed": a.get("recomputed_tokens", 0)},
            "latency": a["latency"],
            "usage": {"prompt_tokens": a["prompt_tokens"], "completion_tokens": len(a["token_ids"]),
                      "total_tokens": a["prompt_tokens"] + len(a["token_ids"])}}


class RagRoutes:
    # ---- collections --------------------------------------------------------------------------------
    @api.post("/v1/rag/collections", status_code=201, tags=["rag"],
              responses=responses(*APP, *BODY, *ACTORS, *WRITES, "collection_exists"))
    async def create_collection(self, body: CollectionBody, request: Request):
        """A new, empty collection of the app's documents."""
        app = await self._app(request)
        ident = await self._do(self.predictor.create_collection, app, body.name)
        return {"id": ident, "name": body.name, "documents": 0, "chunks": 0}

    @api.get("/v1/rag/collections", tags=["rag"], responses=responses(*APP, *ACTORS))
    async def list_collections(self, request: Request):
        app = await self._app(request)
        return {"collections": await self._do(self.predictor.collections, app)}

    @api.delete("/v1/rag/collections/{collection}", tags=["rag"],
                responses=responses(*APP, *ACTORS, *WRITES, *COLLECTION))
    async def delete_collection(self, collection: str, request: Request):
        """Delete a collection, its documents, and the cached K/V and answers that came from them."""
        app = await self._app(request)
        await self._do(self.predictor.delete_collection, app, _check(collection, "collection_not_found"))
        return {"id": collection, "deleted": True}

    # ---- documents ----------------------------------------------------------------------------------
    @api.post("/v1/rag/collections/{collection}/documents", status_code=201, tags=["rag"], responses=responses(
        *APP, *BODY, *ACTORS, *WRITES, *COLLECTION, "document_too_large", "collection_full", "empty_document"))
    async def add_document(self, collection: str, body: DocumentBody, request: Request):
        """Split a document into passages, embed and store them (one transaction; the same text again
        is the same document)."""
        app = await self._app(request)
        col = _check(collection, "collection_not_found")
        ident = await self._do(self.predictor.add_document, app, col, body.content, body.name, body.kind)
        docs = await self._do(self.predictor.documents, app, col)
        return next(d for d in docs if d["id"] == ident)

    @api.get("/v1/rag/collections/{collection}/documents", tags=["rag"],
             responses=responses(*APP, *ACTORS, *COLLECTION))
    async def list_documents(self, collection: str, request: Request):
        app = await self._app(request)
        return {"documents": await self._do(self.predictor.documents, app, _check(collection, "collection_not_found"))}

    @api.delete("/v1/rag/collections/{collection}/documents/{document}", tags=["rag"],
                responses=responses(*APP, *ACTORS, *WRITES, *COLLECTION, "document_not_found"))
    async def delete_document(self, collection: str, document: str, request: Request):
        """Delete a document with the cached K/V and answers that came from its passages."""
        app = await self._app(request)
        _check(collection, "collection_not_found")
        chunks = await self._do(self.predictor.delete_document, app, _check(document, "document_not_found"))
        return {"id": document, "deleted": True, "chunks": chunks}

    # ---- questions ----------------------------------------------------------------------------------
    @api.post("/v1/rag/collections/{collection}/query", tags=["rag"], openapi_extra=TIMEOUT_HEADER, responses=responses(
        *APP, *BODY, *ACTORS, *WRITES, *COLLECTION, "timeout", "overloaded", "prompt_too_long", stream=SSE_RAG))
    async def query(self, collection: str, body: RagQueryBody, request: Request):
        """Answer a question over the collection: from the QA bank when a stored question is at least
        `tau_query` similar, else from its retrieved passages, reusing their cached K/V where the
        retrieval path allows. `cache` says which level served it. With `"stream": true` the reply
        comes as Server-Sent Events, the answer's text as it is decoded, then the done event."""
        app = await self._app(request)
        col = _check(collection, "collection_not_found")
        events = self._events(self._timeout(request), self.predictor.query_stream, app, col, body.query,
                              params=body.params())
        head, events = await self._first(events)
        if body.stream:
            return sse_response(head, events, lambda d: {"delta": d}, lambda a: {"done": True, **rag_reply(a)})
        return rag_reply(await outcome(head, events))

    async def rag_chat(self, app: str, body, params: dict, request: Request):
        """`/v1/chat/completions` with `rag: {collection, k, tau_query}`: the last user message is the
        question; the reply is a chat completion with this service's `rag` field (the query route's
        `cache`, `sources` and `latency`). Not on a context."""
        if body.context_id is not None:
            raise APIError("invalid_request", "rag and context_id cannot be combined: a RAG question is not a turn")
        msgs = [m for m in body.messages if m.role == "user"]
        if not msgs or body.messages[-1].role != "user":
            raise APIError("invalid_request", "the last message must be a user turn (the question)")
        col = _check(body.rag.collection, "collection_not_found")
        extra = {k: v for k, v in (("k", body.rag.k), ("tau_query", body.rag.tau_query)) if v is not None}
        sampling = {k: params[k] for k in Sampling.model_fields}  # the route's other keys (progress) stay out
        events = self._events(self._timeout(request), self.predictor.query_stream, app, col, body.messages[-1].content,
                              params={**sampling, **extra})
        head, events = await self._first(events)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model or self.model_id}

        def more(r: dict) -> dict:
            return {"rag": {"cache": r["cache"], "sources": r["sources"], "latency": r["latency"]}}

        if body.stream:
            def chunk(delta: dict, finish=None, **rest) -> dict:
                return {**base, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **rest}

            def done(a: dict) -> dict:
                r = rag_reply(a)
                return chunk({}, r["finish_reason"], usage=r["usage"], **more(r))

            return sse_response(head, events, lambda d: chunk({"content": d}), done,
                                first=chunk({"role": "assistant", "content": ""}))
        r = rag_reply(await outcome(head, events))
        return {**base, "object": "chat.completion", "usage": r["usage"], **more(r),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r["answer"]},
                             "finish_reason": r["finish_reason"]}]}

    # ---- embeddings ---------------------------------------------------------------------------------
    @api.post("/v1/embeddings", tags=["openai"], responses=responses(*APP, *BODY, *ACTORS, "embedder_missing"))
    async def embeddings(self, body: EmbeddingsBody, request: Request):
        """OpenAI-compatible embeddings from the model the knowledge bank retrieves with (unit rows)."""
        await self._app(request)
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        rows = await self._do(self.predictor.embed, texts)
        n = sum(len(t.split()) for t in texts)
        return {"object": "list", "model": EMBEDDING_MODEL,
                "data": [{"object": "embedding", "index": i, "embedding": [float(x) for x in row]}
                         for i, row in enumerate(rows)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}
