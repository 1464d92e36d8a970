"""The HTTP API as a Ray Serve application (docs/design.md §6): a FastAPI ingress deployment in front of the
context service's actors (memory governor, KV swap/IO worker, recompute worker, model executor).

The ingress requests no CPU: it checks tokens and bodies, bounds the calls in flight and queued, and
turns actor results into JSON or Server-Sent Events. It starts the actors itself (owned by the replica,
so `serve shutdown` takes them down too); their state lives in the registry and the chunk files under
the data directory, so a restarted server loses nothing.

Run it with `llmaas serve` (or `make serve`), `serve run deploy.serve_app:build data_dir=...`, or
`serve deploy deploy/serve_config.yaml`.

(No `from __future__ import annotations` here: Serve ships the ingress class by value, and FastAPI must
see the route annotations as real types to parse bodies.)
"""

import asyncio
import contextlib
import hmac
import logging
import os
import time
import uuid
from dataclasses import asdict, fields
from typing import AsyncIterator

import ray
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors import retry
from actors.config import RagConfig, ServiceConfig, prepare_data_dir, tuning_from
from actors.messages import CallOutcome
from actors.ragfront import RagAnswer
import deploy.settings as settings
from deploy.settings import ServerConfig, admin_token
from deploy.api_docs import ACTORS, APP, BODY, CALL, CALL_HEADERS, CONTEXT, SSE_CALL, SSE_CHAT, WRITES, responses
from deploy.http_parts import Limiter, api, outcome, sse_data, sse_response
from deploy.rag_http import RagRoutes
from deploy.api_models import (
    AdapterBody, APIError, BindBody, CallBody, ChatCompletionBody, NewContextBody, check_app_name, check_context_id,
    from_exception, reconcile, split_stateless,
)


log = logging.getLogger("ray.serve.llmaas")  # under Serve's logger: the replica's log file has it

READY_TIMEOUT_S = 3.0
"""How long `/readyz` waits for each actor's probe."""


# ---- calling the actors from async code --------------------------------------------------------------

def _request_id(request: Request) -> str:
    """The call's request id: the client's `Idempotency-Key` (sent again with a retried call, which then
    appends nothing when the first one was committed), else a new one. Scoped to the context."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return uuid.uuid4().hex
    if not 1 <= len(key) <= 128 or not key.isprintable():
        raise APIError("invalid_request", "Idempotency-Key must be 1-128 printable characters")
    return "client:" + key


def _typed(e: BaseException) -> APIError:
    """The API error for an exception the service raised. An unexpected one (500) is logged with its
    traceback under a new request id, which the reply carries, so that it can be found."""
    err = from_exception(_cause(e))
    if err.code == "internal":
        rid = uuid.uuid4().hex
        log.error("internal error, request id %s", rid, exc_info=e)
        err = APIError("internal", f"{err.message}; request id {rid} (the server log has the traceback)", rid)
    return err


def _cause(e: BaseException) -> BaseException:
    """The service's own exception under Ray's wrappers (an actor calling another actor wraps twice)."""
    for _ in range(8):
        if not isinstance(e, ray.exceptions.RayTaskError) or e.cause is None or e.cause is e:
            break
        e = e.cause
    if isinstance(e, (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)):
        return APIError("unavailable", "a service actor restarted during the request; retry")
    return e


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())




@api.exception_handler(APIError)
async def _api_error(_request: Request, e: APIError):
    return _error_response(e)


@api.exception_handler(RequestValidationError)
async def _invalid(_request: Request, e: RequestValidationError):
    """A body that is not JSON is 400 `invalid_json`; JSON that does not fit the route's model, 422
    `invalid_request` naming the first field at fault."""
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "malformed")
        at = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        return _error_response(APIError("invalid_json", f"the body is not valid JSON: {why}{at}"))
    if loc == ("body",) and first.get("type") == "missing":
        return _error_response(APIError("invalid_json", "the body is empty: send a JSON object"))
    if loc == ("body",) and isinstance(first.get("input"), bytes):
        # a body sent with a content type other than JSON reaches validation as raw bytes
        return _error_response(APIError("invalid_json", "send the body as JSON (Content-Type: application/json)"))
    where = ".".join(str(x) for x in loc if x != "body")
    msg = first.get("msg", "invalid request")
    return _error_response(APIError("invalid_request", f"{where}: {msg}" if where else msg))


@api.exception_handler(StarletteHTTPException)
async def _http_error(_request: Request, e: StarletteHTTPException):
    """Starlette's and FastAPI's own errors in the API's shape; FastAPI's 400 is a body it could not
    parse (not UTF-8, say)."""
    code = {400: "invalid_json", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
            413: "body_too_large"}.get(e.status_code, "invalid_request")
    return JSONResponse({"error": {"code": code, "message": str(e.detail)}}, status_code=e.status_code)


@api.exception_handler(Exception)
async def _unexpected(_request: Request, e: Exception):
    return _error_response(_typed(e))


def _bearer(request: Request) -> str:
    h = request.headers.get("authorization", "")
    scheme, _, token = h.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError("unauthorized", "send Authorization: Bearer <token>")
    return token.strip()


def _usage(o: dict) -> dict:
    """OpenAI's usage: the prompt is every token the model attended for the reply (the conversation so
    far, after any overflow), not only the new turn's."""
    prompt = o["context_tokens"] or o["prompt_tokens"]  # a retried call's answer from before these fields
    return {"prompt_tokens": prompt, "completion_tokens": o["completion_tokens"],
            "total_tokens": prompt + o["completion_tokens"]}


def _progress_event(p) -> bytes:
    """A long prefill's progress on the contexts route: a data event that clients reading only
    `delta` and `done` pass over."""
    return sse_data({"progress": {"prefill_layers": p.layers_done, "layers": p.layers, "tokens": p.tokens}})


def _progress_comment(p) -> bytes:
    """The same on the OpenAI route: an SSE comment, which OpenAI clients ignore."""
    return f": prefill {p.layers_done}/{p.layers} layers of {p.tokens} tokens\n\n".encode()


def _call_reply(o: dict) -> dict:
    r = o["restore"]
    return {
        "text": o["text"], "finish_reason": o["finish_reason"], "usage": _usage(o),
        "switch_ms": o["switch_ms"], "ttft_ms": o["ttft_s"] * 1000, "total_ms": o["total_s"] * 1000,
        "restore": {"resident": r["resident"], "loaded": r["loaded"], "loaded_bytes": r["loaded_bytes"],
                    "recomputed": r["recomputed"], "faults": r["faults"],
                    "predicted_ms": o["predicted_restore_ms"]},
        "cached_tokens": o["cached_tokens"], "turn_tokens": o["prompt_tokens"],
        "dropped_tokens": o["dropped_tokens"],
    }


@serve.deployment(
    name="llmaas",
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=64,
    max_queued_requests=64,
    health_check_period_s=10,
    health_check_timeout_s=30,
)
@serve.ingress(api)
class Ingress(RagRoutes):
    def __init__(self, service: "dict | None" = None, server: "dict | None" = None) -> None:
        from actors.ray_service import wire_ray

        self.cfg = ServiceConfig(**(service or {}))
        self.server = ServerConfig(**(server or {}))
        prepare_data_dir(self.cfg.data_dir)
        self.admin = admin_token(self.cfg.data_dir, self.server.admin_token_file)
        settings.RUNTIME["max_body_bytes"] = self.server.max_body_bytes
        if settings.RUNTIME["metrics"] is None:
            from actors.metrics import Metrics

            m = Metrics()
            m.start("ingress", self.cfg.data_dir)
            settings.RUNTIME["metrics"] = m
        self.limiter = Limiter(self.server.max_ongoing_calls, self.server.max_queued_calls)
        # actors of this replica (a new replica makes new ones; the registry and files carry the state)
        self.svc = wire_ray(self.cfg, model_path=self.server.model or None,
                            prefix=f"llmaas-{uuid.uuid4().hex[:8]}")
        self.gov, self.executor = self.svc.parts.gov, self.svc.parts.executor  # actor handles
        self.predictor = self.svc.parts.predictor
        self.model_id = self.svc.model_id
        self._adapter_names: set[str] | None = None  # loaded adapters, as this replica last saw them

    def __del__(self) -> None:
        """Serve calls this when the replica shuts down (`serve shutdown`, a redeploy): the executor closes
        its working set (a shared-memory segment the size of a context's K/V, which outlives a killed
        process) before the actors are taken down."""
        svc = getattr(self, "svc", None)
        if svc is not None:
            self.svc = None
            with contextlib.suppress(Exception):
                svc.close()

    # ---- helpers ------------------------------------------------------------------------------------
    async def _app(self, request: Request) -> str:
        """The app holding the request's bearer token (401 otherwise)."""
        return await self._do(self.gov.app_for_token, _bearer(request))

    def _is_admin(self, request: Request) -> None:
        if not hmac.compare_digest(_bearer(request).encode(), self.admin.encode()):
            raise APIError("unauthorized", "this route needs the admin token")

    async def _adapters(self, refresh: bool = False) -> set[str]:
        """Names of the loaded adapters (asked of the executor when unknown here or `refresh`)."""
        if self._adapter_names is None or refresh:
            self._adapter_names = {a["name"] for a in await self._do(self.executor.list_adapters)}
        return self._adapter_names

    async def _model_adapter(self, model: str) -> str | None:
        """The LoRA adapter an OpenAI `model` names: None for the service's model ("" or its id), a
        loaded adapter's name, else 404 `model_not_found`."""
        if model in ("", self.model_id):
            return None
        if model in await self._adapters() or model in await self._adapters(refresh=True):
            return model
        raise APIError("model_not_found", f"no model {model!r}: GET /v1/models lists the base model and its adapters")

    async def _do(self, method, *args, **kwargs):
        """An actor call (retried while the actor restarts) whose errors become typed API errors."""
        try:
            return await retry.acall(method, *args, **kwargs)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _typed(e) from None

    async def _front(self, fn, *args):
        """A method of the service's front (blocking: run on a thread), its errors typed API errors."""
        try:
            return await asyncio.to_thread(fn, *args)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _typed(e) from None

    def _timeout(self, request: Request) -> float:
        """The server's request timeout, or less when the client asks (`X-Request-Timeout`, seconds)."""
        t = self.server.request_timeout_s
        h = request.headers.get("x-request-timeout")
        if h is not None:
            try:
                asked = float(h)
            except ValueError:
                raise APIError("invalid_request", "X-Request-Timeout must be a number of seconds") from None
            if not 0 < asked < float("inf"):
                raise APIError("invalid_request", "X-Request-Timeout must be a positive number of seconds")
            t = min(t, asked)
        return t

    async def _events(self, timeout_s: float, method, *args, params: dict) -> AsyncIterator[str | dict]:
        """Text deltas of one call (the executor's `stream` or `stream_stateless`, or the predictor's
        `query_stream`, with `args` and `params` and a deadline), then its outcome (`CallOutcome` or
        `RagAnswer`, as a dict). Holds a limiter slot throughout. Closed
        before the outcome (the client went away: Serve cancels the request, whose cancellation
        reaches the executor's call too, or the event stream is abandoned), it cancels the executor's
        call itself, which stops at its next token and rolls the turn back."""
        deadline = time.time() + timeout_s
        await self.limiter.acquire(timeout_s)
        gen, finished = None, False
        try:
            gen = method.remote(*args, dict(params, deadline=deadline))
            try:
                async for ref in gen:
                    item = await ref
                    finished = isinstance(item, (CallOutcome, RagAnswer))
                    yield asdict(item) if finished else item
            except Exception as e:  # noqa: BLE001
                finished = True  # the call failed and is over
                raise _typed(e) from None
        finally:
            self.limiter.release()
            if gen is not None and not finished:
                # dropping the generator would not stop the call; a sync actor's generator is closed
                # (GeneratorExit at its next yield) on cancel. Not recursive: the governor, IO and
                # recompute calls it is making finish, and its own abort path unlocks the context.
                with contextlib.suppress(Exception):
                    ray.cancel(gen, recursive=False)

    async def _first(self, events: AsyncIterator) -> tuple[list, AsyncIterator]:
        """Run a call up to its first item, so that errors before any output become HTTP errors."""
        head = []
        try:
            head.append(await events.__anext__())
        except StopAsyncIteration:
            pass
        return head, events

    # ---- health -------------------------------------------------------------------------------------
    @api.get("/healthz", tags=["health"])
    async def healthz(self):
        return {"status": "ok"}

    @api.get("/readyz", tags=["health"], responses=responses("unavailable"))
    async def readyz(self):
        """Ready when every actor of the service answers its probe within `READY_TIMEOUT_S`; the probe
        runs on a thread of its own (`actors/ray_actors.py:Health`), so a long call does not delay it,
        while a dead or restarting actor does not answer."""
        roles = self.svc.parts.by_role()

        async def probe(handle) -> None:
            await handle.alive.remote()

        got = await asyncio.gather(*(asyncio.wait_for(probe(h), READY_TIMEOUT_S) for h in roles.values()),
                                   return_exceptions=True)
        down = [role for role, r in zip(roles, got) if isinstance(r, BaseException)]
        if down:
            return _error_response(APIError("unavailable", f"not answering: {', '.join(down)}"))
        return {"status": "ready", "model": self.model_id}

    # ---- apps (admin) -------------------------------------------------------------------------------
    @api.post("/v1/apps", status_code=201, tags=["apps"],
              responses=responses(*APP, *BODY, *ACTORS, *WRITES, "app_exists", "unknown_adapter"))
    async def bind(self, body: BindBody, request: Request):
        self._is_admin(request)
        name = check_app_name(body.name)
        token = await self._do(self.gov.bind_app, name, body.adapter)
        return {"name": name, "token": token, "adapter": body.adapter or None}

    @api.delete("/v1/apps/{name}", tags=["apps"],
                responses=responses(*APP, *ACTORS, *WRITES, "not_found", "invalid_request", "context_busy"))
    async def unbind(self, name: str, request: Request):
        self._is_admin(request)
        check_app_name(name)
        ctxs = await self._do(self.gov.list_contexts, name)
        for c in ctxs:
            await self._delete(c.id, name)
        try:
            await self._do(self.gov.delete_app, name)
        except APIError as e:
            if e.code == "unauthorized":  # unknown_app: here the name, not a token, is unknown
                raise APIError("not_found", f"no app {name!r}") from None
            raise
        return {"name": name, "deleted_contexts": len(ctxs)}

    # ---- contexts -----------------------------------------------------------------------------------
    @api.post("/v1/contexts", status_code=201, tags=["contexts"],
              responses=responses(*APP, *BODY, *ACTORS, *WRITES, "context_limit", "prompt_too_long",
                                   "unknown_adapter"))
    async def new_ctx(self, request: Request, body: NewContextBody | None = None):
        app = await self._app(request)
        system = body.system_prompt if body else None
        ctx = await self._do(self.executor.new_ctx, app, system, None, body.adapter if body else None)
        return await self._do(self.gov.describe, ctx, app)

    @api.get("/v1/contexts", tags=["contexts"], responses=responses(*APP, *ACTORS))
    async def list_ctx(self, request: Request):
        app = await self._app(request)
        rows = await self._do(self.gov.list_contexts, app)
        return {"contexts": [{"id": r.id, "tokens": r.n_tokens, "created": r.created, "last_used": r.last_used}
                             for r in rows]}

    @api.get("/v1/contexts/{ctx}", tags=["contexts"], responses=responses(*APP, *CONTEXT, *ACTORS))
    async def get_ctx(self, ctx: str, request: Request):
        app = await self._app(request)
        return await self._do(self.gov.describe, check_context_id(ctx), app)

    @api.delete("/v1/contexts/{ctx}", tags=["contexts"],
                responses=responses(*APP, *CONTEXT, *ACTORS, *WRITES, "context_busy"))
    async def delete_ctx(self, ctx: str, request: Request):
        app = await self._app(request)
        await self._delete(check_context_id(ctx), app)
        return {"id": ctx, "deleted": True}

    async def _delete(self, ctx: str, app: str) -> None:
        await self._front(self.svc.remove_ctx, app, ctx)

    @api.post("/v1/contexts/{ctx}/calls", tags=["contexts"],
              responses=responses(*APP, *BODY, *CONTEXT, *ACTORS, *WRITES, *CALL, stream=SSE_CALL),
              openapi_extra=CALL_HEADERS)
    async def call(self, ctx: str, body: CallBody, request: Request):
        app = await self._app(request)
        check_context_id(ctx)
        events = self._events(self._timeout(request), self.executor.stream, app, ctx, body.prompt,
                              params=dict(body.params(), request_id=_request_id(request), progress=body.stream))
        head, events = await self._first(events)
        if body.stream:
            return sse_response(head, events, lambda d: {"delta": d},
                                 lambda o: {"done": True, **_call_reply(o)}, on_progress=_progress_event)
        return {"id": ctx, **_call_reply(await outcome(head, events))}

    # ---- LoRA adapters ------------------------------------------------------------------------------
    @api.post("/v1/adapters", status_code=201, tags=["adapters"], responses=responses(
        *APP, *BODY, *ACTORS, *WRITES, "adapter_exists", "adapter_not_found", "adapter_outside_root", "bad_adapter"))
    async def add_adapter(self, body: AdapterBody, request: Request):
        """Load a LoRA adapter (PEFT format) from under the server's adapter root (admin). It is
        loaded again at every start until deleted; a broken one is refused and changes nothing."""
        self._is_admin(request)
        info = await self._do(self.executor.add_adapter, body.name, body.path)
        await self._adapters(refresh=True)
        return info

    @api.get("/v1/adapters", tags=["adapters"], responses=responses(*APP, *ACTORS))
    async def list_adapters(self, request: Request):
        """The loaded adapters (the admin token or an app's)."""
        if not hmac.compare_digest(_bearer(request).encode(), self.admin.encode()):
            await self._app(request)
        return {"adapters": await self._do(self.executor.list_adapters)}

    @api.delete("/v1/adapters/{name}", tags=["adapters"],
                responses=responses(*APP, *ACTORS, *WRITES, "unknown_adapter", "adapter_in_use"))
    async def delete_adapter(self, name: str, request: Request):
        """Unload an adapter (admin); refused while a context is computed under it."""
        self._is_admin(request)
        await self._do(self.executor.remove_adapter, name)
        await self._adapters(refresh=True)
        return {"name": name, "deleted": True}

    # ---- OpenAI compatibility -----------------------------------------------------------------------
    @api.get("/v1/models", tags=["openai"], responses=responses(*APP, *ACTORS))
    async def models(self, request: Request):
        """The base model and each loaded adapter (its `parent` the base), as `model` selects them."""
        await self._app(request)
        base = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "llmaas"}
        return {"object": "list", "data": [base] + [
            {"id": name, "object": "model", "created": 0, "owned_by": "llmaas", "parent": self.model_id}
            for name in sorted(await self._adapters(refresh=True))]}

    @api.post("/v1/chat/completions", tags=["openai"], openapi_extra=CALL_HEADERS, responses=responses(
        *APP, *BODY, *CONTEXT, *ACTORS, *WRITES, *CALL, "conversation_conflict", "model_not_found",
        "model_mismatch", "adapter_unavailable", "collection_not_found", stream=SSE_CHAT))
    async def chat_completions(self, body: ChatCompletionBody, request: Request):
        app = await self._app(request)
        params = dict(body.params(), progress=body.stream)
        if body.max_completion_tokens is not None:
            params["max_tokens"] = body.max_completion_tokens
        if body.rag is not None:  # the last user message, answered over a collection (deploy.rag_http)
            return await self.rag_chat(app, body, params, request)
        if body.context_id is not None:
            ctx = check_context_id(body.context_id)
            info = await self._do(self.gov.describe, ctx, app)
            if body.model not in ("", self.model_id) and body.model != info["adapter"]:
                await self._model_adapter(body.model)  # 404 for a name that is no model at all
                raise APIError("model_mismatch", f"the context is computed under "
                               f"{info['adapter'] or self.model_id!r}, not {body.model!r}")
            prompt = reconcile(info["turns"], body.messages).prompt
            events = self._events(self._timeout(request), self.executor.stream, app, ctx, prompt,
                                  params=dict(params, request_id=_request_id(request)))
        else:  # stateless: the conversation so far is answered on no context, nothing is stored
            system, history, prompt = split_stateless(body.messages)
            adapter = await self._model_adapter(body.model)
            events = self._events(self._timeout(request), self.executor.stream_stateless, system, history, prompt,
                                  params=dict(params, adapter=adapter) if adapter else params)
        head, events = await self._first(events)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": body.model or self.model_id}
        if body.stream:
            def chunk(delta: dict, finish=None, **more) -> dict:
                return {**base, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **more}

            return sse_response(
                head, events, lambda d: chunk({"content": d}),
                lambda o: chunk({}, o["finish_reason"], usage=_usage(o), context_id=body.context_id,
                                switch_ms=o["switch_ms"], dropped_tokens=o["dropped_tokens"]),
                first=chunk({"role": "assistant", "content": ""}), on_progress=_progress_comment)
        o = await outcome(head, events)
        return {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": o["text"]},
                             "finish_reason": o["finish_reason"]}],
                "usage": _usage(o), "context_id": body.context_id, "switch_ms": o["switch_ms"],
                "dropped_tokens": o["dropped_tokens"]}


def build(args: dict | None = None):
    """Application builder for `serve run deploy.serve_app:build key=value ...` and serve configs:
    keys of `actors.service.ServiceConfig` and `ServerConfig`, and `tuning.NAME` for each field of
    `actors.config.Tuning` (see `app_options`)."""
    service, server = app_options(args)
    return Ingress.options(max_ongoing_requests=64).bind(service, server)


def app_options(args: dict | None) -> tuple[dict, dict]:
    """(ServiceConfig keywords, ServerConfig keywords) from the builder's arguments, values coerced to
    each field's type; `tuning` as a mapping (a config file's) or as `tuning.NAME` keys. Unknown
    names and bad values fail here, before anything starts."""
    svc_keys = {f.name: f.type for f in fields(ServiceConfig)}
    srv_keys = {f.name: f.type for f in fields(ServerConfig)}
    service, server, tuning, rag = {}, {}, {}, {}
    for k, v in dict(args or {}).items():
        if k == "tuning":  # a config file's mapping
            if not isinstance(v, dict):
                raise ValueError(f"tuning takes a mapping of option names to values, got {v!r}")
            tuning.update(v)
        elif k.startswith("tuning."):  # `serve run ... tuning.NAME=VALUE`
            tuning[k.removeprefix("tuning.")] = v
        elif k == "rag":
            if not isinstance(v, dict):
                raise ValueError(f"rag takes a mapping of option names to values, got {v!r}")
            rag.update(v)
        elif k.startswith("rag."):
            rag[k.removeprefix("rag.")] = v
        elif k in svc_keys:
            service[k] = _coerce(v, getattr(ServiceConfig(), k))
        elif k in srv_keys:
            server[k] = _coerce(v, getattr(ServerConfig(), k))
        else:
            raise ValueError(f"unknown option {k!r}; valid: {sorted(svc_keys) + sorted(srv_keys)}")
    if tuning:
        tuning_from(tuning)
        service["tuning"] = tuning
    if rag:
        known = {f.name: getattr(RagConfig(), f.name) for f in fields(RagConfig)}
        unknown = sorted(set(rag) - set(known))
        if unknown:
            raise ValueError(f"unknown rag options {unknown}; valid: {sorted(known)}")
        service["rag"] = {k: _coerce(v, known[k]) for k, v in rag.items()}
    service.setdefault("data_dir", os.environ.get("LLMAAS_DATA_DIR", "./data"))
    service["data_dir"] = os.path.abspath(os.path.expanduser(service["data_dir"]))
    return service, server


def _coerce(v, default):
    if isinstance(default, bool):
        return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int(v)
    if isinstance(default, float):
        return float(v)
    return str(v)


app = build  # `serve run deploy.serve_app:app`
