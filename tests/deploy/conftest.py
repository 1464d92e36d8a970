"""One Serve application for the whole test session, over real HTTP on a loopback port."""

from __future__ import annotations

import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from scheduler.pipeline import CostProfile

# the injected profile keeps the first start from measuring one (a few seconds); its shape is this
# machine's (`llmaas profile`)
PROFILE = CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    admin: str
    data_dir: Path
    options: dict

    def start(self) -> None:
        from ray import serve

        from deploy.serve_app import build

        serve.run(build(self.options), name="llmaas", route_prefix="/")

    def restart(self) -> None:
        """A full restart of the application: a new ingress replica with new actors."""
        from ray import serve

        serve.delete("llmaas")
        self.start()


@pytest.fixture(scope="session")
def server(ray_cluster, tmp_path_factory):
    from ray import serve

    data = tmp_path_factory.mktemp("serve-data")
    segments = set(Path("/dev/shm").glob("llmaas-*-ws-*"))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    opts = dict(data_dir=str(data), policy="llms", pool_bytes=2 << 20, max_context_tokens=1024, profile=PROFILE,
                max_ongoing_calls=1, max_queued_calls=3, max_body_bytes=64 * 1024, request_timeout_s=120.0)
    srv = Server(f"http://127.0.0.1:{port}", "", data, opts)
    t = time.monotonic()
    srv.start()
    token_file = data / "admin_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600  # generated at first start, owner-only
    srv.admin = token_file.read_text().strip()
    print(f"serve app started in {time.monotonic() - t:.1f} s")
    yield srv
    serve.shutdown()
    # every replica closed its executor's working-set segment (RAM under /dev/shm) on the way down
    assert set(Path("/dev/shm").glob("llmaas-*-ws-*")) <= segments
