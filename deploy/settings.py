"""Server settings, free of Ray: what the HTTP layer adds to `actors.service.ServiceConfig`, and the admin
token (docs/design.md §6). `llmaas serve` reads them before it imports Ray."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from storage.registry import new_token


@dataclass(slots=True)
class ServerConfig:
    """What the HTTP layer adds to the service's configuration."""

    max_ongoing_calls: int = 1
    """Model calls handed to the executor at once (it runs one at a time; more only queue there)."""
    max_queued_calls: int = 8
    """Calls waiting for a slot; past this, 429 with Retry-After at once."""
    request_timeout_s: float = 120.0
    """A call not finished by then answers 408 and is rolled back (the context stays unlocked)."""
    max_body_bytes: int = 1 << 20
    """Request bodies over this answer 413."""
    admin_token_file: str = ""
    """Where the generated admin token is kept (mode 0600); default `<data_dir>/admin_token`.
    `LLMAAS_ADMIN_TOKEN` overrides it."""
    model: str = ""
    """Model path (empty: the embedded default)."""


def private_secret(path: Path, make=new_token) -> str:
    """The secret kept in `path`, created by `make()` with mode 0600 the first time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        value = path.read_text().strip()
        if not value:
            raise RuntimeError(f"{path} is empty; delete it to make a new secret") from None
        return value
    value = make()
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def admin_token(data_dir: str, path: str = "") -> str:
    """`LLMAAS_ADMIN_TOKEN`, else the token stored at first start in the data directory (0600)."""
    return os.environ.get("LLMAAS_ADMIN_TOKEN") or private_secret(Path(path or Path(data_dir) / "admin_token"))


SERVE_PROXY_TIMEOUTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
"""Ray Serve's HTTP proxy timeouts, seconds, for a Ray the service starts itself (Ray's defaults: 5 and
10). A proxy not started within the ready check's timeout is killed, and `serve.start` fails with
`ActorDiedError`: on a 2-core box beside two busy processes, starting the proxy's worker took longer
than 5 s (2026-11-29)."""


def set_serve_timeouts() -> None:
    """Put `SERVE_PROXY_TIMEOUTS` in this process's environment, keeping values already there; before Ray
    starts, so that Serve's controller (a process Ray starts) reads them."""
    for name, value in SERVE_PROXY_TIMEOUTS.items():
        os.environ.setdefault(name, value)


RUNTIME: dict = {"max_body_bytes": ServerConfig().max_body_bytes, "metrics": None}
"""This process's live settings for the HTTP middleware (body limit, metrics), set by the ingress at
start. Read it as `deploy.settings.RUNTIME` (module attribute access): Serve ships the ingress class by
value, and a module-level object of the ingress module would arrive as a copy."""
