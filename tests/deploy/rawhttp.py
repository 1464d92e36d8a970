"""Helpers for tests that hold a call open over real HTTP: a POST on a raw socket (the test decides when
the connection goes away), reading it up to a marker (the gate), and polling for an end state (which
the other tests over HTTP use too)."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

from deploy.client import Client

# a reply of hundreds of tokens: seconds of decoding on any machine, so the call is still running when
# the test acts on it
LONG = {"prompt": "Count from 1 to 300, writing every number in words, one per line.", "max_tokens": 600}


def busy(app: Client, ctx: str) -> bool:
    return app.context(ctx)["busy"]


def wait_until(predicate, what: str, bound_s: float = 180.0, every_s: float = 0.02):
    """`predicate()` once it is truthy, polled every `every_s` for at most `bound_s` (a generous bound on
    an end state, never a bet on timing)."""
    deadline = time.monotonic() + bound_s
    while not (got := predicate()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(every_s)
    return got


def send(server, app: Client, path: str, body: dict) -> socket.socket:
    """A POST written on a raw socket, so that the test decides when the connection goes away."""
    url = urlsplit(server.url)
    s = socket.create_connection((url.hostname, url.port), timeout=120)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {app.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    s.sendall(head.encode() + data)
    return s


def read_until(s: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = s.recv(4096)
        assert chunk, f"the connection closed before {marker!r}: {got[-300:]!r}"
        got += chunk
    return got
