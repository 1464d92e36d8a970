"""RAG over HTTP, on the session's Serve application (the query predictor actor): collections and
documents, questions answered from the QA bank and from cached passage K/V, streaming, OpenAI
embeddings, app isolation and the refusals (each with its code, nothing changed)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests

from deploy.client import Client

DOCS = [
    ("fuji", "text", "Mount Fuji is the highest mountain in Japan. It is 3,776 metres tall and last erupted in 1707."),
    ("nile", "html", "<html><body><h1>Nile</h1><p>The Nile flows north through eleven countries.</p>"
                     "<script>var x = 1;</script><p>It empties into the Mediterranean Sea.</p></body></html>"),
    ("paris", "markdown", "# Paris\n\nThe Eiffel Tower stands in Paris. It was finished in **1889**."),
]


def _h(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _err(r) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


@pytest.fixture(scope="module")
def tokens(server):
    c = Client(server.url, server.admin)
    return c.bind("rag-a"), c.bind("rag-b")


def test_documents_are_added_asked_about_and_deleted(server, tokens):
    url, (a, b) = server.url, tokens
    r = requests.post(f"{url}/v1/rag/collections", json={"name": "facts"}, headers=_h(a))
    assert r.status_code == 201
    col = r.json()["id"]
    assert _err(requests.post(f"{url}/v1/rag/collections", json={"name": "facts"}, headers=_h(a))) \
        == (409, "collection_exists")
    docs = {}
    for name, kind, text in DOCS:
        r = requests.post(f"{url}/v1/rag/collections/{col}/documents",
                          json={"content": text, "name": name, "kind": kind}, headers=_h(a))
        assert r.status_code == 201 and r.json()["chunks"] >= 1, r.text
        docs[name] = r.json()["id"]
    again = requests.post(f"{url}/v1/rag/collections/{col}/documents", json={"content": DOCS[0][2]}, headers=_h(a))
    assert again.json()["id"] == docs["fuji"]  # the same text is the same document
    listed = requests.get(f"{url}/v1/rag/collections/{col}/documents", headers=_h(a)).json()["documents"]
    assert sorted(d["name"] for d in listed) == ["fuji", "nile", "paris"]

    # refusals change nothing; another app's collection does not exist for b
    for path, body, want in ((f"/v1/rag/collections/{col}/documents", {"content": "  \n "}, (422, "empty_document")),
                             (f"/v1/rag/collections/{col}/documents", {"content": "x", "kind": "pdf"},
                              (422, "invalid_request")),
                             ("/v1/rag/collections/nothex/query", {"query": "hi"}, (404, "collection_not_found")),
                             (f"/v1/rag/collections/{'0' * 32}/query", {"query": "hi"}, (404, "collection_not_found"))):
        assert _err(requests.post(url + path, json=body, headers=_h(a))) == want, path
    assert _err(requests.post(f"{url}/v1/rag/collections/{col}/query", json={"query": "hi"}, headers=_h(b))) \
        == (404, "collection_not_found")
    assert _err(requests.get(f"{url}/v1/rag/collections/{col}/documents", headers=_h(b))) \
        == (404, "collection_not_found")
    assert requests.get(f"{url}/v1/rag/collections", headers=_h(b)).json() == {"collections": []}

    ask = {"query": "How tall is Mount Fuji?", "max_tokens": 12, "k": 2}
    first = requests.post(f"{url}/v1/rag/collections/{col}/query", json=ask, headers=_h(a)).json()
    assert first["cache"]["level"] == "miss" and first["sources"][0]["document"] == docs["fuji"]
    assert first["usage"]["completion_tokens"] >= 1 and set(first["latency"]) >= {"embed", "retrieve", "prefill"}
    same = requests.post(f"{url}/v1/rag/collections/{col}/query", json=ask, headers=_h(a)).json()
    assert same["cache"]["level"] == "qa_bank" and same["answer"] == first["answer"]
    # no QA bank (a threshold no question meets): the passages' K/V comes from the tree, the answer is the same
    exact = requests.post(f"{url}/v1/rag/collections/{col}/query", json={**ask, "tau_query": 1.0},
                          headers=_h(a)).json()
    if exact["cache"]["level"] != "qa_bank":  # a similarity that rounds to exactly 1.0 still matches
        assert exact["cache"]["level"] == "kv_tree" and exact["answer"] == first["answer"]
        assert exact["cache"]["tokens_reused"] == exact["cache"]["retrieved_tokens"] > 0

    def streamed(body: dict) -> tuple[list[str], dict]:
        r = requests.post(f"{url}/v1/rag/collections/{col}/query", json={**body, "stream": True}, headers=_h(a),
                          stream=True)
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
        assert r.headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
        done = json.loads(events[-2])
        assert done["done"] is True
        return [json.loads(e)["delta"] for e in events[:-2]], done

    deltas, done = streamed(ask)  # from the QA bank: the stored answer in one piece
    assert done["cache"]["level"] == "qa_bank" and deltas == [first["answer"]]
    # a question not asked before is decoded: token by token, from the executor through the predictor
    deltas, done = streamed({**ask, "query": "When did Mount Fuji last erupt?"})
    assert done["cache"]["level"] != "qa_bank" and len(deltas) > 1 and "".join(deltas) == done["answer"]

    # the OpenAI route with this service's `rag` extension: the last user message is the question
    from openai import OpenAI

    chat = OpenAI(base_url=f"{url}/v1", api_key=a).chat.completions.create(
        model="", messages=[{"role": "user", "content": ask["query"]}], max_tokens=12,
        extra_body={"rag": {"collection": col, "k": 2}})
    assert chat.choices[0].message.content == first["answer"]
    assert chat.model_extra["rag"]["cache"]["level"] == "qa_bank"
    chunks = list(OpenAI(base_url=f"{url}/v1", api_key=a).chat.completions.create(
        model="", messages=[{"role": "user", "content": "When did Mount Fuji last erupt?"}], max_tokens=12,
        stream=True, extra_body={"rag": {"collection": col, "k": 2}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done["answer"]
    assert chunks[-1].choices[0].finish_reason == done["finish_reason"]
    assert chunks[-1].model_extra["rag"]["cache"]["level"] == "qa_bank"  # the streamed answer was stored
    r = requests.post(f"{url}/v1/chat/completions", headers=_h(a), json={
        "messages": [{"role": "user", "content": "hi"}], "context_id": "0" * 32, "rag": {"collection": col}})
    assert _err(r) == (422, "invalid_request")

    # deleting a document drops its passages, their cached K/V and the answers they gave
    r = requests.delete(f"{url}/v1/rag/collections/{col}/documents/{docs['fuji']}", headers=_h(a))
    assert r.status_code == 200 and r.json()["chunks"] >= 1
    after = requests.post(f"{url}/v1/rag/collections/{col}/query", json=ask, headers=_h(a)).json()
    assert after["cache"]["level"] != "qa_bank" and all(s["document"] != docs["fuji"] for s in after["sources"])
    assert _err(requests.delete(f"{url}/v1/rag/collections/{col}/documents/{docs['fuji']}", headers=_h(a))) \
        == (404, "document_not_found")
    assert requests.delete(f"{url}/v1/rag/collections/{col}", headers=_h(a)).json() == {"id": col, "deleted": True}
    assert requests.get(f"{url}/v1/rag/collections", headers=_h(a)).json() == {"collections": []}


def test_openai_embeddings(server, tokens):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=tokens[0])
    got = client.embeddings.create(model="all-MiniLM-L6-v2", input=["Cats sleep a lot.", "Cats nap often.",
                                                                    "The tax deadline is in April."])
    v = np.array([d.embedding for d in got.data])
    assert v.shape == (3, 384) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-4)
    assert v[0] @ v[1] > v[0] @ v[2]
    one = client.embeddings.create(model="x", input="Cats sleep a lot.")
    assert np.allclose(one.data[0].embedding, v[0], atol=1e-5)
    assert _err(requests.post(f"{server.url}/v1/embeddings", json={"input": []}, headers=_h(tokens[0]))) \
        == (422, "invalid_request")
