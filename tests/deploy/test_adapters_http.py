"""LoRA adapters over HTTP, on the session's Serve application (Ray actors): `POST/GET/DELETE
/v1/adapters`, a context bound to an adapter, the OpenAI `model` field selecting one, `/v1/models`
listing them, and the refusals (each with its code, nothing changed).

The adapters are written into the server's default adapter root (`<data_dir>/adapters`) for the
default model's shapes (random A and B, so they change the replies); the reference is the in-process
engine with the same adapter.
"""

from __future__ import annotations

import math

import pytest
import requests
from safetensors.torch import load_file, save_file

from deploy.client import Client
from engine.lora import AdapterSet
from bench.model_files import random_adapter

SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def root(server, engine):
    r = server.data_dir / "adapters"
    random_adapter(r / "tutor", engine.model.cfg, seed=1)
    random_adapter(r / "nan", engine.model.cfg, seed=3)
    f = r / "nan" / "adapter_model.safetensors"
    t = load_file(str(f))
    next(iter(t.values())).view(-1)[0] = math.nan
    save_file(t, str(f))
    return r


@pytest.fixture(scope="module")
def token(server):
    return Client(server.url, server.admin).bind("adapter-tests")


def _h(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _err(r) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def test_adapters_are_loaded_listed_selected_and_removed(server, root, token, engine):
    url, admin = server.url, _h(server.admin)
    # only the admin loads adapters; broken ones are refused, each with its code, nothing loaded
    assert _err(requests.post(f"{url}/v1/adapters", json={"name": "tutor", "path": "tutor"}, headers=_h(token))) \
        == (401, "unauthorized")
    for body, want in (({"name": "x", "path": "../.."}, (403, "adapter_outside_root")),
                       ({"name": "x", "path": "nowhere"}, (404, "adapter_not_found")),
                       ({"name": "x", "path": "nan"}, (422, "bad_adapter")),
                       ({"name": "../x", "path": "tutor"}, (422, "bad_adapter"))):
        assert _err(requests.post(f"{url}/v1/adapters", json=body, headers=admin)) == want, body
    assert requests.get(f"{url}/v1/adapters", headers=admin).json() == {"adapters": []}
    r = requests.post(f"{url}/v1/adapters", json={"name": "tutor", "path": "tutor"}, headers=admin)
    assert r.status_code == 201 and r.json()["name"] == "tutor" and r.json()["rank"] == 8, r.text
    assert _err(requests.post(f"{url}/v1/adapters", json={"name": "tutor", "path": "tutor"}, headers=admin)) \
        == (409, "adapter_exists")
    assert [a["name"] for a in requests.get(f"{url}/v1/adapters", headers=_h(token)).json()["adapters"]] == ["tutor"]
    models = requests.get(f"{url}/v1/models", headers=_h(token)).json()["data"]
    base = models[0]["id"]
    assert [(m["id"], m.get("parent")) for m in models] == [(base, None), ("tutor", base)]

    # the reference: the in-process engine with the same adapter
    tutor = AdapterSet(root, engine.model.cfg).add("tutor", "tutor")
    ref = {}
    for name, adapter in (("base", None), ("tutor", tutor)):
        ctx = engine.new_ctx(SYSTEM, adapter=adapter)
        ref[name] = engine.call(ctx, "Name a fruit.", max_tokens=10).text
        engine.delete_ctx(ctx)
    assert ref["tutor"] != ref["base"]

    # stateless: the OpenAI `model` selects the adapter
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}]
    for model, want in ((base, ref["base"]), ("tutor", ref["tutor"])):
        r = requests.post(f"{url}/v1/chat/completions", headers=_h(token),
                          json={"model": model, "messages": msgs, "max_tokens": 10, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == model, r.text
        assert r.json()["choices"][0]["message"]["content"] == want, model
    assert _err(requests.post(f"{url}/v1/chat/completions", headers=_h(token),
                              json={"model": "nope", "messages": msgs, "max_tokens": 2})) == (404, "model_not_found")

    # a context bound to the adapter for its life
    assert _err(requests.post(f"{url}/v1/contexts", json={"system_prompt": SYSTEM, "adapter": "nope"},
                              headers=_h(token))) == (404, "unknown_adapter")
    r = requests.post(f"{url}/v1/contexts", json={"system_prompt": SYSTEM, "adapter": "tutor"}, headers=_h(token))
    assert r.status_code == 201 and r.json()["adapter"] == "tutor", r.text
    cid = r.json()["id"]
    r = requests.post(f"{url}/v1/contexts/{cid}/calls", json={"prompt": "Name a fruit.", "max_tokens": 10},
                      headers=_h(token))
    assert r.json()["text"] == ref["tutor"]
    turn = [{"role": "user", "content": "And a vegetable?"}]
    assert _err(requests.post(f"{url}/v1/chat/completions", headers=_h(token), json={
        "model": "nope", "messages": turn, "max_tokens": 2, "context_id": cid})) == (404, "model_not_found")
    r = requests.post(f"{url}/v1/chat/completions", headers=_h(token),
                      json={"model": "tutor", "messages": turn, "max_tokens": 4, "context_id": cid})
    assert r.status_code == 200, r.text
    plain = Client(url, token).new_ctx(SYSTEM)
    assert _err(requests.post(f"{url}/v1/chat/completions", headers=_h(token), json={
        "model": "tutor", "messages": turn, "max_tokens": 2, "context_id": plain})) == (409, "model_mismatch")

    # an app bound to the adapter: its contexts default to it
    admin_client = Client(url, server.admin)
    assert _err(requests.post(f"{url}/v1/apps", json={"name": "tutored", "adapter": "nope"}, headers=admin)) \
        == (404, "unknown_adapter")
    tutored = admin_client.bind("tutored", adapter="tutor")
    assert Client(url, tutored).context(Client(url, tutored).new_ctx(SYSTEM))["adapter"] == "tutor"

    # removal waits until no context or app is computed under it
    assert _err(requests.delete(f"{url}/v1/adapters/tutor", headers=admin)) == (409, "adapter_in_use")
    assert requests.delete(f"{url}/v1/contexts/{cid}", headers=_h(token)).status_code == 200
    assert _err(requests.delete(f"{url}/v1/adapters/tutor", headers=admin)) == (409, "adapter_in_use")  # the app's
    admin_client.unbind("tutored")
    assert requests.delete(f"{url}/v1/adapters/tutor", headers=admin).json() == {"name": "tutor", "deleted": True}
    assert _err(requests.delete(f"{url}/v1/adapters/tutor", headers=admin)) == (404, "unknown_adapter")
    assert [m["id"] for m in requests.get(f"{url}/v1/models", headers=_h(token)).json()["data"]] == [base]
