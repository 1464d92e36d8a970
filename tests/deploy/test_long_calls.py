"""Long calls over real HTTP (the session's Serve application): `/readyz` answers 200 while a call holds
the model executor, and 503 while an actor restarts, then 200 again; a client that goes away in the
middle of a call, streaming or not, stops it, and its turn is not committed; one that leaves a
streamed RAG answer stops it, and nothing of it is stored; contexts are created, adapters, collections
and documents listed while a call runs or a RAG query waits for the executor.

No timing bets: each test waits on a gate (the first streamed event, the context held by its call)
and polls for the end state with a generous bound."""

from __future__ import annotations

import time

import pytest
import ray
import requests

from deploy.client import Client
from tests.deploy.rawhttp import LONG, busy, read_until, send, wait_until


@pytest.fixture(scope="module")
def app(server):
    return Client(server.url, Client(server.url, server.admin).bind("long-calls"))


def test_ready_during_a_long_call_and_a_stream_left_midway_stops_uncommitted(server, app):
    ctx = app.new_ctx("You are terse.")
    before = app.context(ctx)
    s = send(server, app, f"/v1/contexts/{ctx}/calls", {**LONG, "stream": True})
    try:
        head = read_until(s, b"data: {")  # the gate: the first event, so the executor is decoding
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head[:300]
        # the executor's one working thread is in the call; its probe runs on a thread of its own. A
        # probe can miss its few seconds on a loaded host (any actor's): asked again while the call runs
        while (r := requests.get(server.url + "/readyz", timeout=60)).status_code != 200:
            assert r.status_code == 503 and busy(app, ctx), f"not ready while the call ran: {r.text}"
        assert r.json()["status"] == "ready", r.text
        assert busy(app, ctx), "the call ended before readiness was checked: the test checked nothing"
    finally:
        s.close()  # the client goes away mid-stream
    wait_until(lambda: not busy(app, ctx), "the call to stop")
    after = app.context(ctx)
    assert after["turns"] == before["turns"] and after["tokens"] == before["tokens"]  # nothing committed
    assert app.call(ctx, "Say hi.", max_tokens=4).usage["completion_tokens"] > 0  # not locked


def test_contexts_are_created_and_adapters_listed_while_a_call_decodes(server, app):
    """Creating a context (the executor tokenizes its system prompt) and listing the adapters do not wait
    for the executor's call to end: they run on a thread of their own beside it."""
    ctx = app.new_ctx("You are terse.")
    s = send(server, app, f"/v1/contexts/{ctx}/calls", {**LONG, "stream": True})
    try:
        read_until(s, b'data: {"delta"')  # the gate: the executor is decoding
        other = app.new_ctx("You are kind.")
        listed = requests.get(server.url + "/v1/adapters", headers={"Authorization": f"Bearer {app.token}"},
                              timeout=60)
        assert busy(app, ctx), "the call had ended when the context was created: it waited for the call"
    finally:
        s.close()
    assert listed.status_code == 200 and isinstance(listed.json(), (list, dict)), listed.text
    assert app.context(other)["system_prompt"] == "You are kind."
    wait_until(lambda: not busy(app, ctx), "the call to stop")
    assert app.call(other, "Say hi.", max_tokens=4).usage["completion_tokens"] > 0


def test_a_client_that_leaves_a_call_without_stream_stops_it_uncommitted(server, app):
    ctx = app.new_ctx("You are terse.")
    before = app.context(ctx)
    s = send(server, app, f"/v1/contexts/{ctx}/calls", LONG)
    try:
        wait_until(lambda: busy(app, ctx), "the call to hold its context")  # the gate: the call runs
    finally:
        s.close()  # the client goes away before the reply
    wait_until(lambda: not busy(app, ctx), "the call to stop")
    after = app.context(ctx)
    assert after["turns"] == before["turns"] and after["tokens"] == before["tokens"]
    assert app.call(ctx, "Say hi.", max_tokens=4).usage["completion_tokens"] > 0


def test_a_rag_answer_left_midway_stops_and_stores_nothing(server, app):
    """A streamed RAG answer left after its first delta: the cancel crosses the predictor to the
    executor, which stops decoding and stores nothing. The predictor takes one query at a time, so the
    same question asked next runs after the first one ended: had it finished, its stored answer would
    serve the second from the QA bank."""
    col = app.create_collection("counting")
    app.add_document(col, "Numbers in words: one, two, three, four, five, six, seven, eight, nine, ten.")
    s = send(server, app, f"/v1/rag/collections/{col}/query", {"query": LONG["prompt"], "max_tokens": 600,
                                                               "stream": True})
    try:
        head = read_until(s, b'data: {"delta"')  # the gate: the first delta, so the executor is decoding
        assert head.startswith(b"HTTP/1.1 200"), head[:300]
    finally:
        s.close()  # the client goes away mid-answer
    again = app.ask(col, LONG["prompt"], max_tokens=4)
    assert again["cache"]["level"] != "qa_bank" and again["usage"]["completion_tokens"] > 0


def service_actors(role: str) -> list:
    """The session's actors of `role`: this replica's (and any left by an earlier replica)."""
    from actors.ray_service import NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].startswith("llmaas-") and a["name"].endswith(f"-{role}")]
    assert names, role
    return [ray.get_actor(n, namespace=NAMESPACE) for n in sorted(names)]


def test_collections_and_documents_are_listed_while_a_rag_query_waits(server, app):
    """The query predictor runs one query at a time; listing collections and documents, creating a
    collection and embedding run beside it. A chat call holds the executor (the gate: its first delta),
    so a RAG query sent to the predictor cannot end before it; a listing sent after the query by the
    same caller would run after it, in order, were both on the predictor's one default thread."""
    col = app.create_collection("listing")
    app.add_document(col, "Numbers in words: one, two, three, four, five, six, seven, eight, nine, ten.")
    ctx = app.new_ctx("You are terse.")
    predictor, = service_actors("predictor")  # the one replica's (an earlier replica's were killed with it)
    s = send(server, app, f"/v1/contexts/{ctx}/calls", {**LONG, "stream": True})
    try:
        read_until(s, b'data: {"delta"')  # the executor decodes the chat call
        query = predictor.query.remote("long-calls", col, "Name a number.", {"max_tokens": 4})
        listed = ray.get(predictor.collections.remote("long-calls"), timeout=120)
        docs = ray.get(predictor.documents.remote("long-calls", col), timeout=120)
        assert busy(app, ctx), "the chat call had ended when the listing answered: it waited for the query"
    finally:
        s.close()
    assert col in [c["id"] for c in listed] and len(docs) == 1
    assert ray.get(query, timeout=120).finish_reason in ("stop", "length")  # it ran once the executor was free
    assert col in [c["id"] for c in app.collections()] and len(app.documents(col)) == 1  # the routes' methods


def test_readyz_is_503_while_an_actor_restarts_and_200_once_it_is_back(server, app):
    """The recompute worker killed (as by the OOM killer): until Ray has restarted it (a new process
    that loads the model), `/readyz` names it and answers 503; then 200, and calls work."""
    for actor in service_actors("recompute"):
        ray.kill(actor, no_restart=False)
    seen: list[requests.Response] = []

    def ready(status: int) -> bool:
        seen.append(requests.get(server.url + "/readyz", timeout=60))
        return seen[-1].status_code == status

    wait_until(lambda: ready(503), "readyz to see the dead worker")
    err = seen[-1].json()["error"]
    assert err["code"] == "unavailable" and "recompute worker" in err["message"]
    assert seen[-1].headers.get("Retry-After")
    wait_until(lambda: ready(200), "the worker to come back")
    ctx = app.new_ctx()
    assert app.call(ctx, "Say hi.", max_tokens=4).usage["completion_tokens"] > 0


@ray.remote
class Talker:
    """An actor whose streaming call says whether it was closed midway."""

    def __init__(self) -> None:
        self.closed = False

    def stream(self, params: dict):
        try:
            for i in range(3000):  # 30 s if nothing stops it
                time.sleep(0.01)
                yield str(i)
        except GeneratorExit:
            self.closed = True
            raise

    def was_closed(self) -> bool:  # queued behind `stream`: answers once the call has ended
        return self.closed


def test_a_call_closed_before_its_outcome_is_cancelled_at_the_actor(ray_cluster):
    """Without Serve's own cancellation: the ingress's event generator (`Ingress._events`) closed after
    the first delta cancels the actor's streaming call, whose generator is then closed at its next
    yield (dropping the generator alone would let it run on)."""
    import asyncio
    from types import SimpleNamespace

    from deploy.http_parts import Limiter
    from deploy.serve_app import Ingress

    talker = Talker.remote()
    ingress = SimpleNamespace(limiter=Limiter(1, 1))

    async def leave_after_the_first_delta() -> str:
        events = Ingress.func_or_class._events(ingress, 60.0, talker.stream, params={})
        first = await events.__anext__()
        await events.aclose()
        return first

    assert asyncio.run(leave_after_the_first_delta()) == "0"
    assert ray.get(talker.was_closed.remote(), timeout=120)
    assert not ingress.limiter.sem.locked()  # the slot was given back
    ray.kill(talker)


def test_the_predictor_leaving_a_rag_stream_cancels_the_executors_call(ray_cluster):
    """The second hop of a RAG answer's cancel: the predictor reads the executor's `rag_stream` through
    `actors.ray_stubs.resolved_items`; closed before the outcome, it cancels the executor's call."""
    from actors.ray_stubs import resolved_items

    talker = Talker.remote()
    items = resolved_items(talker.stream.remote({}))
    assert next(items) == "0"
    items.close()
    assert ray.get(talker.was_closed.remote(), timeout=120)
    ray.kill(talker)
