"""A 500 is findable: the unexpected exception is logged with its traceback under a request id, and
the error reply carries that id; a typed error stays as it was. A body that is not JSON answers 400
`invalid_json`, JSON that does not fit the route 422 `invalid_request`. No Ray cluster."""

from __future__ import annotations

import logging

import pytest

from deploy.api_models import APIError


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_an_internal_error_logs_its_traceback_under_the_id_the_reply_carries():
    from deploy.serve_app import _typed

    logger = logging.getLogger("ray.serve.llmaas")  # whether it propagates depends on Serve's set-up
    seen = Records()
    logger.addHandler(seen)
    try:
        raise RuntimeError("a broken invariant")
    except RuntimeError as e:
        err = _typed(e)
    finally:
        logger.removeHandler(seen)
    body = err.body()["error"]
    assert err.status == 500 and body["code"] == "internal" and body["request_id"] in body["message"]
    (rec,) = [r for r in seen.records if body["request_id"] in r.getMessage()]
    assert rec.levelno == logging.ERROR and rec.exc_info and rec.exc_info[1].args == ("a broken invariant",)
    assert "a broken invariant" in logging.Formatter().format(rec)  # the traceback's last line


def test_typed_errors_carry_no_request_id():
    from deploy.serve_app import _typed

    err = _typed(APIError("not_found", "no such context"))
    assert err.status == 404 and set(err.body()["error"]) == {"code", "message"}


# ---- one code for one fault: a body that is not JSON is 400, JSON that does not validate is 422 ------

@pytest.fixture
def client(monkeypatch):
    """The FastAPI app without Serve: the routes' `self` (Serve's replica context) is a stub that no
    route reaches, since every request here fails before its handler runs."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient
    from ray import serve

    from deploy.serve_app import api

    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=SimpleNamespace()))
    return TestClient(api, raise_server_exceptions=False)


CALLS = "/v1/contexts/" + "0" * 32 + "/calls"
JSON = {"Authorization": "Bearer x", "Content-Type": "application/json"}


@pytest.mark.parametrize("path", [CALLS, "/v1/contexts", "/v1/chat/completions", "/v1/apps"])
@pytest.mark.parametrize("body, headers, status, code", [
    (b"{", JSON, 400, "invalid_json"),  # not JSON
    (b'{"prompt": "x",}', JSON, 400, "invalid_json"),
    (b'{"prompt": "\xff"}', JSON, 400, "invalid_json"),  # not UTF-8: FastAPI's own 400
    (b'{"prompt": "x"}', {**JSON, "Content-Type": "text/plain"}, 400, "invalid_json"),  # not sent as JSON
    (b"[]", JSON, 422, "invalid_request"),  # JSON, but not what the route takes
    (b'{"prompt": 1, "messages": 1, "name": 1, "system_prompt": 1}', JSON, 422, "invalid_request"),
])
def test_a_body_that_is_not_json_is_400_and_json_that_does_not_validate_is_422(client, path, body, headers,
                                                                               status, code):
    from deploy.api_models import STATUS

    r = client.post(path, content=body, headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert STATUS[code] == status
    assert set(r.json()["error"]) == {"code", "message"} and r.json()["error"]["message"]


@pytest.mark.parametrize("path", [CALLS, "/v1/chat/completions", "/v1/apps"])
def test_no_body_where_one_is_needed_is_400_invalid_json(client, path):
    r = client.post(path, content=b"", headers=JSON)  # (POST /v1/contexts takes no body at all)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json"), r.text
    assert "empty" in r.json()["error"]["message"]


# ---- a full disk is 507 `disk_full`, however it reaches the front ------------------------------------

def test_a_full_disk_is_507_disk_full_through_ray_s_wrappers():
    """DiskFullError raised in the IO worker reaches the governor wrapped by Ray, and the governor's
    failure reaches the ingress wrapped again (each wrapper pickled across processes): the reply is
    still 507 `disk_full`, with the storage layer's message and no Retry-After."""
    from ray import cloudpickle
    from ray.exceptions import RayTaskError

    from deploy.serve_app import _typed
    from storage.errors import DiskFullError

    def wrapped(cause: BaseException, where: str) -> BaseException:
        try:
            raise cause
        except BaseException as e:
            err = RayTaskError(where, "traceback", e).as_instanceof_cause()
        return cloudpickle.loads(cloudpickle.dumps(err))

    full = DiskFullError("the chunk store's file system is full (No space left on device)")
    in_io = wrapped(full, "IOActor.write")
    in_gov = wrapped(in_io, "GovernorActor.begin_call")
    for e in (full, in_io, in_gov):
        err = _typed(e)
        assert (err.status, err.code) == (507, "disk_full") and "No space left" in err.message
        assert err.headers() == {} and set(err.body()["error"]) == {"code", "message"}


def test_an_oserror_for_want_of_space_is_507_and_other_oserrors_stay_500():
    import errno

    from deploy.api_models import from_exception

    for code in (errno.ENOSPC, errno.EDQUOT):
        err = from_exception(OSError(code, "no room"))
        assert (err.status, err.code) == (507, "disk_full") and "file system is full" in err.message
    assert from_exception(OSError(errno.EIO, "I/O error")).code == "internal"
