"""What the OpenAPI document (`/openapi.json`) says beyond what FastAPI infers from the routes: every
error status each route can answer with, as the error body `deploy.api_models.ErrorBody` with the
codes behind it, and the Server-Sent Events that `"stream": true` answers with. `deploy.serve_app`
passes `responses(...)` to each route.

Free of Ray and of the model, like `deploy.api_models`, whose `STATUS` table gives each code its status.
"""

from __future__ import annotations

from deploy.api_models import RETRY_AFTER_S, STATUS, ErrorBody

# the codes behind each kind of route; a route's list is the union of the kinds it is
ANY = ("internal",)
"""Any route: an unexpected error (500, with a request id)."""
ACTORS = ("unavailable",)
"""Routes that call the service's actors: one restarting past the retry deadline (503)."""
APP = ("unauthorized",)
"""Routes that need a bearer token (an app's, or the admin's)."""
BODY = ("invalid_json", "invalid_request", "body_too_large")
"""Routes that take a JSON body: not JSON (400), not valid for the route (422), over the size limit (413)."""
CONTEXT = ("not_found",)
"""Routes on a context id: unknown, malformed, or another app's (404)."""
WRITES = ("disk_full",)
"""Routes that write the registry or chunk files: the data directory's file system is full (507)."""
CALL = ("timeout", "context_busy", "prompt_too_long", "overloaded", "capacity", "not_enough_evictable",
        "disk_cap_exceeded")
"""Calls to the model: past the deadline (408, rolled back), the context already in a call (409), the
prompt over the context limit (413), the queue full (429), no room in the KV pool (503), the chunk
files' cap reached (507)."""

SSE_CALL = ('Server-Sent Events with `"stream": true`: while a prompt of 128 tokens or more is prefilled, '
            '`data: {"progress": {"prefill_layers", "layers", "tokens"}}` after each layer; then '
            '`data: {"delta": TEXT}` per piece of text, then '
            '`data: {"done": true, ...}` with the fields of the JSON reply, then `data: [DONE]`. An error '
            'after the first event is one `data: {"error": {"code", "message"}}` event before `[DONE]`.')
SSE_CHAT = ('Server-Sent Events with `"stream": true`: OpenAI `chat.completion.chunk` objects, the first with '
            'the assistant role, the last with `finish_reason`, `usage` and `switch_ms`, then `data: [DONE]`; '
            'a long prefill\'s progress comes first as SSE comments (`: prefill 3/30 layers of 6000 tokens`), '
            'which OpenAI clients ignore. '
            'An error after the first event is one `data: {"error": {"code", "message"}}` event before `[DONE]`.')

CALL_HEADERS = {"parameters": [
    {"name": "Idempotency-Key", "in": "header", "required": False,
     "schema": {"type": "string", "minLength": 1, "maxLength": 128},
     "description": "the call's request id, 1-128 printable characters: a call sent again with the key of one "
                    "already committed (its reply was lost) appends nothing and answers that call's reply"},
    {"name": "X-Request-Timeout", "in": "header", "required": False,
     "schema": {"type": "number", "exclusiveMinimum": 0},
     "description": "seconds this call may take, at most the server's `request_timeout_s`; past it the call "
                    "answers 408 `timeout` and is rolled back"},
]}
"""The headers the two call routes read, as `openapi_extra` of their routes."""


def responses(*codes: str, stream: str | None = None) -> dict[int | str, dict]:
    """The `responses` argument of a route answering with the error `codes` (every route may also
    answer 500): per status, the error body and the codes it carries, with `Retry-After` where the
    code sets it. `stream`: the route answers `text/event-stream` too, described so."""
    by_status: dict[int, list[str]] = {}
    for code in dict.fromkeys(codes + ANY):
        by_status.setdefault(STATUS[code], []).append(code)
    out: dict[int | str, dict] = {}
    for status, cs in sorted(by_status.items()):
        entry = {"model": ErrorBody, "description": "error; `error.code` is " + ", ".join(f"`{c}`" for c in cs)}
        if any(c in RETRY_AFTER_S for c in cs):
            entry["headers"] = {"Retry-After": {"description": "seconds to wait before sending again",
                                                "schema": {"type": "integer"}}}
        out[status] = entry
    if stream is not None:
        out[200] = {"description": "the reply as JSON; or, " + stream,
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return out


def without_default_422(schema: dict) -> dict:
    """`schema` (FastAPI's document, changed in place) without the 422 FastAPI adds to every route with
    parameters, whose body (`HTTPValidationError`) is not what this API answers: a route that can
    answer 422 declares it with `ErrorBody` (`responses`)."""
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            r = op.get("responses", {}).get("422", {})
            ref = r.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
            if ref.endswith("/HTTPValidationError"):
                del op["responses"]["422"]
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema
