"""The HTTP API end to end over real HTTP (Ray Serve on the session's local Ray): conversations equal the
in-process engine, a restart loses nothing, app isolation, every error path, overload and timeouts."""

from __future__ import annotations

import json
import threading

import pytest
import requests

from deploy.client import Client, ServiceError
from tests.deploy.rawhttp import LONG, busy, read_until, send, wait_until

SYSTEM = "You are terse."
TURNS = ["Name a planet.", "Why is it red?", "Thank you. Summarise in five words."]


@pytest.fixture(scope="module")
def reference(engine):
    """The same conversation on the in-process engine (greedy)."""
    ctx = engine.new_ctx(SYSTEM)
    out = [engine.call(ctx, p, max_tokens=12).text for p in TURNS]
    engine.delete_ctx(ctx)
    return out


@pytest.fixture(scope="module")
def admin(server):
    return Client(server.url, server.admin)


@pytest.fixture(scope="module")
def app(server, admin):
    return Client(server.url, admin.bind("http-tests"))


def h(token):
    return {"Authorization": f"Bearer {token}"}


def test_health_and_schema(server):
    assert requests.get(server.url + "/healthz").json() == {"status": "ok"}
    r = requests.get(server.url + "/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    schema = requests.get(server.url + "/openapi.json").json()
    for path in ("/v1/apps", "/v1/contexts", "/v1/contexts/{ctx}/calls", "/v1/chat/completions", "/v1/models"):
        assert path in schema["paths"], path
    # the served document is the one tests/deploy/test_api_docs.py checks: error statuses, event streams
    call = schema["paths"]["/v1/contexts/{ctx}/calls"]["post"]["responses"]
    assert {"400", "422", "429", "503"} <= set(call) and "text/event-stream" in call["200"]["content"]


def test_conversation_equals_engine_and_survives_restart(server, app, reference):
    ctx = app.new_ctx(SYSTEM)
    first = app.call(ctx, TURNS[0], max_tokens=12)
    assert first.text == reference[0]
    assert first.switch_ms >= 0 and first.usage["completion_tokens"] > 0
    stream = app.stream(ctx, TURNS[1], max_tokens=12)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text == reference[1]
    before = app.context(ctx)
    assert [t["role"] for t in before["turns"]] == ["system", "user", "assistant", "user", "assistant"]

    server.restart()  # new replica, new actors: the registry and chunk files carry the context
    after = app.context(ctx)
    assert after["turns"] == before["turns"] and after["tokens"] == before["tokens"]
    third = app.call(ctx, TURNS[2], max_tokens=12)
    assert third.text == reference[2]
    assert third.raw["restore"]["resident"] == 0  # nothing was resident after the restart
    assert third.raw["restore"]["loaded"] + third.raw["restore"]["recomputed"] > 0


def test_app_isolation_and_tokens(server, admin, app):
    other = Client(server.url, admin.bind("http-tests-other"))
    mine = app.new_ctx()
    unknown = "0" * 32
    for ctx in (mine, unknown):  # another app's context answers exactly like an unknown one
        r = requests.get(f"{server.url}/v1/contexts/{ctx}", headers=h(other.token))
        assert r.status_code == 404 and r.json() == {"error": {"code": "not_found", "message": "no such context"}}
        r = requests.post(f"{server.url}/v1/contexts/{ctx}/calls", json={"prompt": "hi"}, headers=h(other.token))
        assert r.status_code == 404
        r = requests.delete(f"{server.url}/v1/contexts/{ctx}", headers=h(other.token))
        assert r.status_code == 404
    assert mine not in [c["id"] for c in other.contexts()]
    assert mine in [c["id"] for c in app.contexts()]
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer "}):
        r = requests.get(server.url + "/v1/contexts", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    # app routes need the admin token
    r = requests.post(server.url + "/v1/apps", json={"name": "x"}, headers=h(app.token))
    assert r.status_code == 401
    with pytest.raises(ServiceError) as e:
        admin.bind("http-tests")
    assert e.value.status == 409 and e.value.code == "app_exists"
    # unbinding deletes the app's contexts and invalidates its token
    c = other.new_ctx("temporary")
    admin.unbind("http-tests-other")
    r = requests.get(f"{server.url}/v1/contexts/{c}", headers=h(other.token))
    assert r.status_code == 401
    with pytest.raises(ServiceError) as e:
        admin.unbind("http-tests-other")
    assert e.value.status == 404


def test_bad_input_gets_4xx_and_leaves_contexts_alone(server, app):
    ctx = app.new_ctx(SYSTEM)
    app.call(ctx, "Say one word.", max_tokens=4)
    before = app.context(ctx)
    url = f"{server.url}/v1/contexts/{ctx}/calls"
    hdr = {**h(app.token), "Content-Type": "application/json"}
    bad = {
        b"{": 400,  # not JSON: invalid_json; the rest is JSON that does not validate: invalid_request
        b"[]": 422,
        b'{"prompt": 1}': 422,
        b'{"prompt": "x", "max_tokens": -1}': 422,
        b'{"prompt": "x", "max_tokens": 1000000000000}': 422,
        b'{"prompt": "x", "max_tokens": "8"}': 422,
        b'{"prompt": "x", "max_tokens": true}': 422,
        b'{"prompt": "x", "temperature": 1e9}': 422,
        b'{"prompt": "x", "temperature": NaN}': 422,
        b'{"prompt": "x", "top_p": 0}': 422,
        b'{"prompt": "x", "frequency_penalty": 2.5}': 422,
        b'{"prompt": "x", "presence_penalty": -3}': 422,
        b'{"prompt": "x", "repetition_penalty": 0}': 422,
        b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}': 422,
        b'{"prompt": "x", "unknown_field": 1}': 422,
        json.dumps({"prompt": "word " * 3000}).encode(): 413,  # over the 1024-token context limit
        json.dumps({"prompt": "x" * 100_000}).encode(): 413,  # over the body limit
    }
    for body, status in bad.items():
        r = requests.post(url, data=body, headers=hdr, timeout=60)
        assert r.status_code == status, (body[:60], r.status_code, r.text)
        if len(body) > 64 * 1024:
            assert r.json()["error"]["code"] == "body_too_large"
        if status in (400, 422):
            assert r.json()["error"]["code"] == {400: "invalid_json", 422: "invalid_request"}[status]
        err = r.json()["error"]
        assert set(err) == {"code", "message"} and err["code"] and err["message"]
    # a body over the limit sent without a length (chunked) is cut off too
    r = requests.post(url, data=iter([b'{"prompt": "', b"x" * 70_000, b'"}']), headers=hdr)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    for hostile in ("..", "..%2F..%2Fetc%2Fpasswd", "%00", "a" * 10_000, ctx.upper(), ctx + "0", "%2e%2e"):
        for method in ("GET", "DELETE"):
            r = requests.request(method, f"{server.url}/v1/contexts/{hostile}", headers=h(app.token))
            assert r.status_code == 404, (method, hostile[:20], r.status_code)
        r = requests.post(f"{server.url}/v1/contexts/{hostile}/calls", json={"prompt": "x"}, headers=h(app.token))
        assert r.status_code == 404
    r = requests.post(f"{server.url}/v1/apps", json={"name": "a\x00b"}, headers=h(server.admin))
    assert r.status_code == 422
    after = app.context(ctx)
    assert after["turns"] == before["turns"] and after["tokens"] == before["tokens"]
    assert app.call(ctx, "One more word.", max_tokens=4).usage["completion_tokens"] > 0


def test_timeout_answers_408_and_rolls_back(server, app):
    """A deadline of 0.2 s on a 400-token reply: 400 decode steps cannot fit it on any machine, and a
    call that found its deadline passed before it started is refused the same way, so either way the
    answer is 408 and nothing of the turn is kept (no bet on how long the call takes)."""
    ctx = app.new_ctx()
    before = app.context(ctx)
    r = requests.post(f"{server.url}/v1/contexts/{ctx}/calls",
                      json={"prompt": "Count from 1 to 300, writing every number in words, one per line.",
                            "max_tokens": 400},
                      headers={**h(app.token), "X-Request-Timeout": "0.2"}, timeout=120)
    assert r.status_code == 408 and r.json()["error"]["code"] == "timeout"
    after = app.context(ctx)
    assert not after["busy"] and after["turns"] == before["turns"]  # nothing half-done was kept
    assert app.call(ctx, "Say hi.", max_tokens=4).usage["completion_tokens"] > 0  # not locked


def test_burst_past_the_queue_gets_429_at_once(server, app):
    """One call holds the only slot (the gate: its first streamed delta) while 8 more arrive: 3 queue
    for the slot and 5 are refused, while the gate still holds it, so refused without waiting for a
    slot. Once the gate's client goes away the queued 3 run."""
    gate_ctx, *ctxs = [app.new_ctx() for _ in range(9)]
    gate = send(server, app, f"/v1/contexts/{gate_ctx}/calls", {**LONG, "stream": True})
    results: list[requests.Response] = []
    lock = threading.Lock()

    def one(c):
        r = requests.post(f"{server.url}/v1/contexts/{c}/calls", json={"prompt": "Say a color.", "max_tokens": 6},
                          headers=h(app.token), timeout=120)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one, args=(c,)) for c in ctxs]
    try:
        assert read_until(gate, b'data: {"delta"').startswith(b"HTTP/1.1 200")  # the gate holds the slot
        for t in threads:
            t.start()
        wait_until(lambda: len(results) >= 5, "the calls past the queue to be refused")
        with lock:
            early = list(results)
        assert busy(app, gate_ctx), "the gate's call ended during the burst: the test checked nothing"
    finally:
        gate.close()  # its client goes away: the call stops and frees the slot for the queued ones
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in early) == [429] * 5, [(r.status_code, r.text[:200]) for r in early]
    assert all(r.headers.get("Retry-After") and r.json()["error"]["code"] == "overloaded" for r in early)
    late = [r for r in results if r not in early]
    assert [r.status_code for r in late] == [200] * 3, [(r.status_code, r.text[:200]) for r in late]


def test_delete_context(server, app):
    ctx = app.new_ctx()
    app.call(ctx, "Hello.", max_tokens=4)
    app.delete_ctx(ctx)
    with pytest.raises(ServiceError) as e:
        app.context(ctx)
    assert e.value.status == 404
    assert not (server.data_dir / "chunks" / ctx).exists() or not any((server.data_dir / "chunks" / ctx).iterdir())


def test_a_call_sent_again_with_its_idempotency_key_appends_once(server, app):
    """A client that lost the reply sends the call again with the same key: it gets the committed turn
    and the conversation holds it once; a malformed key is refused before anything runs."""
    ctx = app.new_ctx(SYSTEM)
    url = f"{server.url}/v1/contexts/{ctx}/calls"
    hdr = {**h(app.token), "Idempotency-Key": "turn-1"}
    first = requests.post(url, json={"prompt": "Name a colour.", "max_tokens": 6}, headers=hdr, timeout=120)
    assert first.status_code == 200
    turns = app.context(ctx)["turns"]
    again = requests.post(url, json={"prompt": "Name a colour.", "max_tokens": 6}, headers=hdr, timeout=120)
    assert again.status_code == 200 and again.json()["text"] == first.json()["text"]
    assert app.context(ctx)["turns"] == turns
    r = requests.post(url, json={"prompt": "x"}, headers={**h(app.token), "Idempotency-Key": "a" * 129}, timeout=60)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    assert app.context(ctx)["turns"] == turns


def test_a_streamed_long_prompt_sends_prefill_progress_first(server, app):
    """On the contexts route a progress event per layer comes before the first delta (a data event that
    `Client.stream` passes over); on the OpenAI route the same as SSE comments, which OpenAI clients
    ignore."""
    prompt = "Summarise this: " + " ".join(f"item {i}," for i in range(80))
    ctx = app.new_ctx(SYSTEM)
    r = requests.post(f"{server.url}/v1/contexts/{ctx}/calls", headers=h(app.token), stream=True,
                      json={"prompt": prompt, "max_tokens": 4, "stream": True})
    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
    kinds = [next(iter(e)) for e in events]
    first_delta = kinds.index("delta") if "delta" in kinds else kinds.index("done")
    progress = [e["progress"] for e in events[:first_delta]]
    assert progress and all(k == "progress" for k in kinds[:first_delta])
    assert progress[-1]["prefill_layers"] == progress[-1]["layers"] and progress[0]["tokens"] >= 128
    assert "progress" not in kinds[first_delta:]
    r = requests.post(f"{server.url}/v1/chat/completions", headers=h(app.token), stream=True,
                      json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "stream": True})
    lines = [line for line in r.iter_lines() if line]
    comments = [k for k, line in enumerate(lines) if line.startswith(b": prefill ")]
    content = [k for k, line in enumerate(lines) if b'"content": "' in line and b'"content": ""' not in line]
    assert comments and (not content or max(comments) < min(content))
