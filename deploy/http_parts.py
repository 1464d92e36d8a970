"""Pieces of the HTTP ingress that hold no route: the FastAPI application the routes attach to (`api`),
its ASGI middleware (the body limit, the request counter), the limiter of calls in flight, and how a
call's events become Server-Sent Events or one reply. `deploy.serve_app` and `deploy.rag_http` wire
them to the routes.
"""

import asyncio
import json
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

import deploy.settings as settings
from deploy.api_docs import without_default_422
from deploy.api_models import APIError


class Limiter:
    """At most `ongoing` calls hold a slot and `queued` wait for one; the rest are turned away."""

    def __init__(self, ongoing: int, queued: int) -> None:
        self.sem = asyncio.Semaphore(max(1, ongoing))
        self.queued, self.waiting = queued, 0

    async def acquire(self, timeout_s: float) -> None:
        if self.sem.locked() and self.waiting >= self.queued:
            raise APIError("overloaded", f"{self.waiting} calls are already queued; retry later")
        self.waiting += 1
        try:
            await asyncio.wait_for(self.sem.acquire(), timeout_s)
        except TimeoutError:
            raise APIError("timeout", "the call waited too long for the model") from None
        finally:
            self.waiting -= 1

    def release(self) -> None:
        self.sem.release()


class BodyLimit:
    """ASGI middleware: bodies over `settings.RUNTIME["max_body_bytes"]` answer 413 before anything
    parses them."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = settings.RUNTIME["max_body_bytes"]
        too_large = APIError("body_too_large", f"request body over {limit} bytes")
        length = [v for k, v in scope.get("headers", []) if k == b"content-length"]
        if length:
            if not length[0].isdigit() or int(length[0]) > limit:
                return await send_error(send, too_large)
            return await self.app(scope, receive, send)
        # no length given (chunked): read the body here, up to the limit, then hand it on
        msgs, seen = [], 0
        while True:
            msg = await receive()
            msgs.append(msg)
            if msg["type"] != "http.request":
                break
            seen += len(msg.get("body", b""))
            if seen > limit:
                return await send_error(send, too_large)
            if not msg.get("more_body"):
                break

        async def replay():
            return msgs.pop(0) if msgs else await receive()

        return await self.app(scope, replay, send)


async def send_error(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers().items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class CountRequests:
    """ASGI middleware (outermost): `llmaas_requests_total{route, code}`, route as its template."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        metrics = settings.RUNTIME["metrics"]
        if scope["type"] != "http" or metrics is None:
            return await self.app(scope, receive, send)
        status = [500]

        async def send_(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_)
        finally:
            route = scope.get("route")
            metrics.requests.labels(getattr(route, "path", "unmatched"), str(status[0])).inc()


def sse_data(obj: Any) -> bytes:
    """One Server-Sent Event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _chain(head: list, rest):
    """`head`, then the rest of the call's events; the call's generator is closed in the end (its
    limiter slot is released even when the consumer stops early)."""
    try:
        for x in head:
            yield x
        async for x in rest:
            yield x
    finally:
        await rest.aclose()


def sse_response(head: list, events, on_delta, on_done, first: dict | None = None,
                 on_progress=None) -> StreamingResponse:
    """A call's events as Server-Sent Events: `first`, each delta and the outcome rendered by the
    callbacks, an error event if the call fails midway, then `[DONE]`. A prefill's progress
    (`engine.context.PrefillProgress`) goes through `on_progress`, which returns the event's bytes."""
    async def gen():
        chain = _chain(head, events)
        try:
            if first is not None:
                yield sse_data(first)
            async for item in chain:
                if isinstance(item, dict):
                    yield sse_data(on_done(item))
                elif isinstance(item, str):
                    yield sse_data(on_delta(item))
                elif on_progress is not None:
                    yield on_progress(item)
        except APIError as e:
            yield sse_data(e.body())
        finally:
            await chain.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


async def outcome(head: list, events) -> dict:
    """Run a call to its end; its outcome."""
    chain = _chain(head, events)
    try:
        async for item in chain:
            if isinstance(item, dict):
                return item
    finally:
        await chain.aclose()
    raise APIError("internal", "the call ended without an outcome")


api = FastAPI(
    title="llmaas",
    version="0.1",
    description="An LLM context service for edge devices: persistent per-app contexts whose KV caches are "
                "compressed, swapped and recomputed so that switching between them is fast, and a RAG cache "
                "that answers questions over an app's documents.",
)
api.openapi = lambda: without_default_422(FastAPI.openapi(api))  # FastAPI caches the document; this is idempotent
api.add_middleware(BodyLimit)
api.add_middleware(CountRequests)  # added last: outermost, so it also counts the body limit's 413s
