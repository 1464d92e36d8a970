"""A 500 is findable: the unexpected exception is logged with its traceback under a request id, and
the error reply carries that id; a typed error stays as it was. No Ray cluster."""

from __future__ import annotations

import logging

from deploy.api_models import APIError


def test_an_internal_error_logs_its_traceback_under_the_id_the_reply_carries(caplog):
    from deploy.serve_app import _typed

    logger = logging.getLogger("ray.serve.llmaas")  # Serve's loggers do not propagate to the root
    logger.addHandler(caplog.handler)
    try:
        raise RuntimeError("a broken invariant")
    except RuntimeError as e:
        err = _typed(e)
    finally:
        logger.removeHandler(caplog.handler)
    body = err.body()["error"]
    assert err.status == 500 and body["code"] == "internal" and body["request_id"] in body["message"]
    (rec,) = [r for r in caplog.records if body["request_id"] in r.getMessage()]
    assert rec.exc_info and rec.exc_info[1].args == ("a broken invariant",)
    assert "a broken invariant" in caplog.text  # the traceback's last line


def test_typed_errors_carry_no_request_id():
    from deploy.serve_app import _typed

    err = _typed(APIError("not_found", "no such context"))
    assert err.status == 404 and set(err.body()["error"]) == {"code", "message"}
