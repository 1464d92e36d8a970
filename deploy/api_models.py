"""What the HTTP API accepts and answers (docs/design.md §6), free of Ray and of the model: request bodies,
the error shape with its stable codes, id checks, and how an OpenAI `messages` list meets a stored
conversation. `deploy.serve_app` wires these to the actors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from storage.fileops import NO_SPACE

# ---- errors ------------------------------------------------------------------------------------------

STATUS: dict[str, int] = {
    "invalid_json": 400,
    "unauthorized": 401,
    "not_found": 404,
    "unknown_context": 404,
    "method_not_allowed": 405,
    "timeout": 408,
    "conversation_conflict": 409,
    "context_busy": 409,
    "context_limit": 409,
    "app_exists": 409,
    "prompt_too_long": 413,
    "body_too_large": 413,
    "invalid_request": 422,
    "invalid_key": 422,
    "unknown_policy": 422,
    "overloaded": 429,
    "capacity": 503,
    "not_enough_evictable": 503,
    "unavailable": 503,
    "internal": 500,
    "disk_full": 507,
    "disk_cap_exceeded": 507,
    "model_not_found": 404,
    "model_mismatch": 409,
    "unknown_adapter": 404,
    "adapter_not_found": 404,
    "adapter_outside_root": 403,
    "bad_adapter": 422,
    "adapter_exists": 409,
    "adapter_in_use": 409,
    "adapter_unavailable": 409,
    "collection_not_found": 404,
    "document_not_found": 404,
    "knowledge_chunk_not_found": 404,
    "collection_exists": 409,
    "collection_full": 409,
    "document_too_large": 413,
    "empty_document": 422,
    "unknown_document_kind": 422,
    "embedder_missing": 503,
}
"""HTTP status of every error code the API answers with."""

RETRY_AFTER_S = {"overloaded": 1, "capacity": 2, "not_enough_evictable": 2, "unavailable": 5}
"""Seconds a client should wait before sending again, for errors that pass by themselves. Not for
`disk_full`: space comes back when someone deletes contexts, not after a known time."""


class APIError(Exception):
    """An error answered as `{"error": {"code", "message"}}` with the code's status."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code if code in STATUS else "internal"
        self.message = message
        self.request_id = request_id
        """Set on internal errors: the id under which the server logged the traceback."""

    @property
    def status(self) -> int:
        return STATUS[self.code]

    def body(self) -> dict:
        err = {"code": self.code, "message": self.message}
        if self.request_id is not None:
            err["request_id"] = self.request_id
        return {"error": err}

    def headers(self) -> dict[str, str]:
        s = RETRY_AFTER_S.get(self.code)
        return {"Retry-After": str(s)} if s else {}


class ErrorDetail(BaseModel):
    code: str = Field(description="stable error code; its HTTP status is fixed (README, Errors)")
    message: str = Field(description="what went wrong, for people")
    request_id: str | None = Field(None, description="only on 500: the id under which the server logged "
                                                      "the traceback")


class ErrorBody(BaseModel):
    """What every error answers with (`APIError.body`), here for the OpenAPI document."""

    error: ErrorDetail


def from_exception(e: BaseException) -> APIError:
    """Map an exception raised by the service (typed, with a stable `code`) to an API error."""
    if isinstance(e, APIError):
        return e
    code = getattr(type(e), "code", None) or getattr(e, "code", None)
    if code == "unknown_app":
        return APIError("unauthorized", "missing or unknown bearer token")
    if code in ("unknown_context", "not_found"):
        return APIError("not_found", "no such context")
    if isinstance(code, str) and code in STATUS:
        return APIError(code, str(e) or code)
    if isinstance(e, TimeoutError):
        return APIError("timeout", str(e) or "the request timed out")
    if isinstance(e, OSError) and e.errno in NO_SPACE:  # a full disk met outside the storage layer
        return APIError("disk_full", f"the data directory's file system is full ({os.strerror(e.errno)}); "
                        "free space (delete contexts) and retry")
    return APIError("internal", f"internal error ({type(e).__name__})")


# ---- ids ---------------------------------------------------------------------------------------------

_CTX_ID = re.compile(r"[0-9a-f]{32}")


def check_context_id(ctx: str) -> str:
    """Context ids are 32 lowercase hex digits (server-made): anything else is unknown, checked
    before it reaches the registry or a path."""
    if not isinstance(ctx, str) or _CTX_ID.fullmatch(ctx) is None:
        raise APIError("not_found", "no such context")
    return ctx


def check_app_name(name: str) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= 128 or not name.isprintable() or name.strip() != name:
        raise APIError("invalid_request", "app name must be 1-128 printable characters without outer spaces")
    return name


# ---- bodies ------------------------------------------------------------------------------------------

MAX_TOKENS_CAP = 4096
MAX_TEXT = 1 << 20  # characters in one text field; the body limit usually bites first


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


Text = Annotated[StrictStr, Field(max_length=MAX_TEXT)]
StopText = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class Sampling(_Strict):
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_CAP)] = 256
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    seed: Annotated[StrictInt, Field(ge=0, lt=1 << 63)] | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=4)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] = 0.0
    """OpenAI's: a token's logit less this for every time the reply has produced it."""
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] = 0.0
    """OpenAI's: a token's logit less this once the reply has produced it."""
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 1.0
    """As vLLM and transformers take it: the logits of tokens in the context or the reply divided by it
    (positive ones; negative ones multiplied); 1 is off."""

    def params(self) -> dict:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "stop": tuple(stop), "frequency_penalty": self.frequency_penalty,
                "presence_penalty": self.presence_penalty, "repetition_penalty": self.repetition_penalty}


class BindBody(_Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    adapter: Annotated[StrictStr, Field(max_length=64)] = ""
    """A loaded LoRA adapter the app's contexts are computed under unless they name another."""


class NewContextBody(_Strict):
    system_prompt: Text | None = None
    adapter: Annotated[StrictStr, Field(max_length=64)] | None = None
    """Name of a loaded LoRA adapter the context is computed under, for its life ("" for the base
    model; left out, the app's default)."""


class AdapterBody(_Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    """What calls select it by (a context's `adapter`, the OpenAI `model`)."""
    path: Annotated[StrictStr, Field(min_length=1, max_length=4096)]
    """Its PEFT directory, relative to the server's adapter root (or absolute inside it)."""


class CallBody(Sampling):
    prompt: Text
    stream: StrictBool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionBody(Sampling):
    """OpenAI's chat completion request; fields this service does not use are ignored, as OpenAI-
    compatible servers do (`n` must be 1)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: Annotated[StrictStr, Field(max_length=256)] = ""
    messages: Annotated[list[Message], Field(min_length=1, max_length=1024)]
    stream: StrictBool = False
    context_id: StrictStr | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_CAP)] | None = None
    rag: "RagExtension | None" = None
    """This service's extension: answer the last user message over a collection (the RAG cache)."""


class RagExtension(_Strict):
    collection: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    """A collection id of the app's."""
    k: Annotated[StrictInt, Field(ge=1, le=32)] | None = None
    tau_query: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None


# ---- stateful OpenAI calls ---------------------------------------------------------------------------


@dataclass(slots=True)
class Reconciled:
    prompt: str
    """The one new user turn to call the context with."""


def reconcile(stored: list[dict], messages: list[Message]) -> Reconciled:
    """docs/design.md §6: `messages` holds only the new turns, or the whole conversation. When it begins
    with the stored conversation (`stored`: the context's turns, `{"role", "text"}`), only the rest is
    new; a message list that restates history differently (an assistant or system turn that does not
    match) is a conflict (409). What is new must be exactly one user turn."""
    msgs = [(m.role, m.content) for m in messages]
    have = [(t["role"], t["text"]) for t in stored]
    if have and have[0][0] == "system" and msgs and msgs[0][0] != "system":
        have = have[1:]  # the system prompt was set when the context was made; clients may leave it out
    if len(msgs) > len(have) and _same(msgs[: len(have)], have):
        new = msgs[len(have):]
    elif all(r == "user" for r, _ in msgs):
        new = msgs
    else:
        raise APIError("conversation_conflict",
                       "messages do not begin with the context's stored conversation "
                       f"({len(have)} turns); send only the new user turn or the whole conversation")
    if any(r != "user" for r, _ in new):
        raise APIError("conversation_conflict", "the new turns may not include assistant or system turns "
                       "that the context does not hold")
    if len(new) != 1:
        raise APIError("invalid_request", "a stateful call takes exactly one new user turn")
    return Reconciled(new[0][1])


def _same(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> bool:
    return all(ra == rb and ta.strip() == tb.strip() for (ra, ta), (rb, tb) in zip(a, b, strict=True))


def split_stateless(messages: list[Message]) -> tuple[str | None, list[tuple[str, str]], str]:
    """A stateless conversation as (system prompt, earlier turns, the final user prompt)."""
    msgs = [(m.role, m.content) for m in messages]
    system = None
    if msgs and msgs[0][0] == "system":
        system = msgs[0][1]
        msgs = msgs[1:]
    if not msgs or msgs[-1][0] != "user":
        raise APIError("invalid_request", "the last message must be a user turn")
    if any(r == "system" for r, _ in msgs):
        raise APIError("invalid_request", "a system message may only come first")
    return system, msgs[:-1], msgs[-1][1]


# ---- RAG (deploy.rag_http) ---------------------------------------------------------------------------


class CollectionBody(_Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=128)]


class DocumentBody(_Strict):
    content: Text
    """The document's text (plain text, Markdown, or HTML, stripped to text)."""
    name: Annotated[StrictStr, Field(max_length=256)] = ""
    kind: Literal["text", "markdown", "html"] = "text"


class RagQueryBody(Sampling):
    query: Annotated[StrictStr, Field(min_length=1, max_length=8192)]
    k: Annotated[StrictInt, Field(ge=1, le=32)] | None = None
    """Passages retrieved (the server's `rag.k` when left out)."""
    tau_query: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    """Similarity at or above which a stored question's answer is reused (the server's when left out)."""
    stream: StrictBool = False
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_CAP)] = 128

    def params(self) -> dict:
        out = dict(super().params(), k=self.k, tau_query=self.tau_query)
        return {k: v for k, v in out.items() if v is not None}


class EmbeddingsBody(BaseModel):
    """OpenAI's embeddings request; fields this service does not use are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
    input: Annotated[StrictStr, Field(max_length=65536)] | Annotated[
        list[Annotated[StrictStr, Field(max_length=65536)]], Field(min_length=1, max_length=256)]
    model: Annotated[StrictStr, Field(max_length=256)] = ""


ChatCompletionBody.model_rebuild()
