"""A 500 is findable: the unexpected exception is logged with its traceback under a request id, and
the error reply carries that id; a typed error stays as it was. No Ray cluster."""

from __future__ import annotations

import logging

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
