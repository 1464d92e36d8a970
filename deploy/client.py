"""Python client for the context service over HTTP, mirroring LLMS Table 1: `bind`, `new_ctx`, `call`,
`delete_ctx` (plus `contexts`, `context`, `stream`, `unbind`).

    from deploy.client import Client
    admin = Client("http://127.0.0.1:8000", token=ADMIN_TOKEN)
    app = Client("http://127.0.0.1:8000", token=admin.bind("notes"))
    ctx = app.new_ctx("You are terse.")
    print(app.call(ctx, "Hello").text)

Errors come back as `ServiceError` with the server's stable `code` and the HTTP `status`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

import requests


class ServiceError(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


@dataclass(slots=True)
class Reply:
    text: str
    finish_reason: str
    switch_ms: float
    usage: dict
    raw: dict = field(repr=False)


class CallStream:
    """Iterates over text deltas; `result` is set when the reply is complete: a `Reply` for a context's
    call, the reply's fields (a dict, as `Client.ask` returns them) for a RAG query."""

    def __init__(self, lines: Iterator[bytes], close, parse=None) -> None:
        self._lines, self._close = lines, close
        self._parse = parse or _reply
        self.result: Reply | dict | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            for ev in _sse_events(self._lines):
                if "error" in ev:
                    e = ev["error"]
                    raise ServiceError(0, e.get("code", "internal"), e.get("message", ""))
                if ev.get("done"):
                    self.result = self._parse(ev)
                elif "delta" in ev:
                    yield ev["delta"]
        finally:
            self._close()


def _sse_events(lines: Iterator[bytes]) -> Iterator[dict]:
    for raw in lines:
        if not raw or not raw.startswith(b"data: "):
            continue
        data = raw[6:]
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _reply(d: dict) -> Reply:
    return Reply(d["text"], d["finish_reason"], d["switch_ms"], d["usage"], d)


class Client:
    def __init__(self, url: str = "http://127.0.0.1:8000", token: str | None = None, timeout: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.http = requests.Session()

    # ---- plumbing -----------------------------------------------------------------------------------
    def _headers(self, token: str | None = None) -> dict:
        t = token or self.token
        return {"Authorization": f"Bearer {t}"} if t else {}

    def _req(self, method: str, path: str, *, token: str | None = None, stream: bool = False, **kw):
        try:
            r = self.http.request(method, self.url + path, headers=self._headers(token), timeout=self.timeout,
                                  stream=stream, **kw)
        except requests.ConnectionError as e:
            raise ServiceError(0, "unreachable", f"cannot reach {self.url}: {e}") from None
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                code, msg = err["code"], err["message"]
            except (ValueError, KeyError, TypeError):
                code, msg = "http_error", r.text[:200]
            ra = r.headers.get("Retry-After")
            raise ServiceError(r.status_code, code, msg, float(ra) if ra else None)
        return r

    # ---- LLMS Table 1 -------------------------------------------------------------------------------
    def bind(self, app: str, admin_token: str | None = None, adapter: str = "") -> str:
        """Register an app (admin token); returns the app's token. `adapter`: a loaded LoRA adapter
        the app's contexts are computed under unless they name another."""
        body = {"name": app, **({"adapter": adapter} if adapter else {})}
        return self._req("POST", "/v1/apps", token=admin_token, json=body).json()["token"]

    def unbind(self, app: str, admin_token: str | None = None) -> None:
        self._req("DELETE", f"/v1/apps/{requests.utils.quote(app, safe='')}", token=admin_token)

    def new_ctx(self, system_prompt: str | None = None, adapter: str | None = None) -> str:
        """A new context; `adapter`: a loaded LoRA adapter it is computed under, for its life."""
        body = {} if system_prompt is None else {"system_prompt": system_prompt}
        if adapter is not None:
            body["adapter"] = adapter
        return self._req("POST", "/v1/contexts", json=body).json()["id"]

    def call(self, ctx: str, prompt: str, **params) -> Reply:
        return _reply(self._req("POST", f"/v1/contexts/{ctx}/calls", json={"prompt": prompt, **params}).json())

    def stream(self, ctx: str, prompt: str, **params) -> CallStream:
        r = self._req("POST", f"/v1/contexts/{ctx}/calls", json={"prompt": prompt, "stream": True, **params},
                      stream=True)
        return CallStream(r.iter_lines(), r.close)

    def delete_ctx(self, ctx: str) -> None:
        self._req("DELETE", f"/v1/contexts/{ctx}")

    # ---- LoRA adapters ------------------------------------------------------------------------------
    def add_adapter(self, name: str, path: str, admin_token: str | None = None) -> dict:
        """Load the PEFT adapter at `path` (under the server's adapter root) as `name` (admin token)."""
        return self._req("POST", "/v1/adapters", token=admin_token, json={"name": name, "path": path}).json()

    def adapters(self) -> list[dict]:
        return self._req("GET", "/v1/adapters").json()["adapters"]

    def remove_adapter(self, name: str, admin_token: str | None = None) -> None:
        self._req("DELETE", f"/v1/adapters/{requests.utils.quote(name, safe='')}", token=admin_token)

    # ---- RAG ----------------------------------------------------------------------------------------
    def create_collection(self, name: str) -> str:
        return self._req("POST", "/v1/rag/collections", json={"name": name}).json()["id"]

    def collections(self) -> list[dict]:
        return self._req("GET", "/v1/rag/collections").json()["collections"]

    def collection(self, name: str, create: bool = True) -> str:
        """The id of the app's collection called `name`, made when missing and `create`."""
        for c in self.collections():
            if c["name"] == name:
                return c["id"]
        if not create:
            raise ServiceError(404, "collection_not_found", f"no collection {name!r}")
        return self.create_collection(name)

    def delete_collection(self, collection: str) -> None:
        self._req("DELETE", f"/v1/rag/collections/{collection}")

    def add_document(self, collection: str, content: str, name: str = "", kind: str = "text") -> dict:
        """Add a document (`text`, `markdown` or `html`); its description (id, chunks, ...)."""
        return self._req("POST", f"/v1/rag/collections/{collection}/documents",
                         json={"content": content, "name": name, "kind": kind}).json()

    def documents(self, collection: str) -> list[dict]:
        return self._req("GET", f"/v1/rag/collections/{collection}/documents").json()["documents"]

    def delete_document(self, collection: str, document: str) -> int:
        return self._req("DELETE", f"/v1/rag/collections/{collection}/documents/{document}").json()["chunks"]

    def ask(self, collection: str, query: str, **params) -> dict:
        """A question over a collection: `answer`, `sources`, `cache` (the level that served it), `latency`."""
        return self._req("POST", f"/v1/rag/collections/{collection}/query", json={"query": query, **params}).json()

    def ask_stream(self, collection: str, query: str, **params) -> CallStream:
        """`ask` as the answer is decoded: iterate for its text deltas; `result` then holds `ask`'s fields."""
        r = self._req("POST", f"/v1/rag/collections/{collection}/query",
                      json={"query": query, "stream": True, **params}, stream=True)
        return CallStream(r.iter_lines(), r.close, parse=lambda ev: {k: v for k, v in ev.items() if k != "done"})

    # ---- more ---------------------------------------------------------------------------------------
    def contexts(self) -> list[dict]:
        return self._req("GET", "/v1/contexts").json()["contexts"]

    def context(self, ctx: str) -> dict:
        return self._req("GET", f"/v1/contexts/{ctx}").json()

    def health(self) -> bool:
        try:
            return self.http.get(self.url + "/readyz", timeout=5).status_code == 200
        except requests.RequestException:
            return False
