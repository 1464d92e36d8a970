"""The OpenAPI document lists, per route, every error status the route can answer with, each with the
error body `{"error": {"code", "message", "request_id"?}}`, and the `text/event-stream` reply of the
streaming routes. Built from the FastAPI app object: no Ray cluster, no server."""

from __future__ import annotations

import pytest

ERROR_REF = "#/components/schemas/ErrorBody"
BODY = {400, 413, 422}  # not JSON, over the size limit, not valid for the route
CALL = {400, 401, 404, 408, 409, 413, 422, 429, 500, 503, 507}

ROUTES = {
    ("get", "/healthz"): set(),
    ("get", "/readyz"): {500, 503},
    ("post", "/v1/apps"): {401, 404, 409, 500, 503, 507} | BODY,
    ("delete", "/v1/apps/{name}"): {401, 404, 409, 422, 500, 503, 507},
    ("post", "/v1/contexts"): {401, 404, 409, 500, 503, 507} | BODY,
    ("get", "/v1/contexts"): {401, 500, 503},
    ("get", "/v1/contexts/{ctx}"): {401, 404, 500, 503},
    ("delete", "/v1/contexts/{ctx}"): {401, 404, 409, 500, 503, 507},
    ("post", "/v1/contexts/{ctx}/calls"): CALL,
    ("get", "/v1/models"): {401, 500, 503},
    ("post", "/v1/adapters"): {401, 403, 404, 409, 500, 503, 507} | BODY,
    ("get", "/v1/adapters"): {401, 500, 503},
    ("delete", "/v1/adapters/{name}"): {401, 404, 409, 500, 503, 507},
    ("post", "/v1/chat/completions"): CALL,
    ("post", "/v1/rag/collections"): {401, 409, 500, 503, 507} | BODY,
    ("get", "/v1/rag/collections"): {401, 500, 503},
    ("delete", "/v1/rag/collections/{collection}"): {401, 404, 500, 503, 507},
    ("post", "/v1/rag/collections/{collection}/documents"): {401, 404, 409, 500, 503, 507} | BODY,
    ("get", "/v1/rag/collections/{collection}/documents"): {401, 404, 500, 503},
    ("delete", "/v1/rag/collections/{collection}/documents/{document}"): {401, 404, 500, 503, 507},
    ("post", "/v1/rag/collections/{collection}/query"): {401, 404, 408, 429, 500, 503, 507} | BODY,
    ("post", "/v1/embeddings"): {401, 500, 503} | BODY,
}
CALLS = {("post", "/v1/contexts/{ctx}/calls"), ("post", "/v1/chat/completions")}
STREAMING = CALLS | {("post", "/v1/rag/collections/{collection}/query")}


@pytest.fixture(scope="module")
def doc():
    from deploy.serve_app import api

    return api.openapi()


def test_every_route_is_listed(doc):
    listed = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert listed == set(ROUTES)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_each_route_lists_its_error_statuses_with_the_error_body(doc, route):
    method, path = route
    responses = doc["paths"][path][method]["responses"]
    errors = {int(s) for s in responses if int(s) >= 400}
    assert errors == ROUTES[route]
    for s in errors:
        r = responses[str(s)]
        assert r["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}, s
        assert "`" in r["description"], s  # names the codes behind the status
        if s in (429, 503):
            assert "Retry-After" in r["headers"], s


def test_the_error_body_schema(doc):
    schemas = doc["components"]["schemas"]
    assert schemas["ErrorBody"]["required"] == ["error"]
    detail = schemas[schemas["ErrorBody"]["properties"]["error"]["$ref"].rsplit("/", 1)[1]]
    assert set(detail["properties"]) == {"code", "message", "request_id"}
    assert sorted(detail["required"]) == ["code", "message"]
    # FastAPI's own validation body is not what this API answers, so it is not in the document
    assert "HTTPValidationError" not in schemas


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_streaming_routes_answer_event_streams(doc, route):
    method, path = route
    ok = doc["paths"][path][method]["responses"]["201" if path in ("/v1/apps", "/v1/contexts", "/v1/adapters",
                                                                  "/v1/rag/collections",
                                                                  "/v1/rag/collections/{collection}/documents")
                                                  and method == "post"
                                                  else "200"]
    assert "application/json" in ok["content"]
    assert ("text/event-stream" in ok["content"]) == (route in STREAMING)
    if route in STREAMING:
        assert "[DONE]" in ok["description"]



@pytest.mark.parametrize("route", sorted(STREAMING))
def test_call_routes_document_the_headers_they_read(doc, route):
    method, path = route
    params = {p["name"]: p for p in doc["paths"][path][method].get("parameters", []) if p["in"] == "header"}
    assert set(params) >= ({"Idempotency-Key", "X-Request-Timeout"} if route in CALLS else {"X-Request-Timeout"})
    if route not in CALLS:
        return
    assert params["Idempotency-Key"]["schema"]["maxLength"] == 128
    assert params["X-Request-Timeout"]["schema"]["type"] == "number"
