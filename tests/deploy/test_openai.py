"""The official `openai` client against the server: chat, streaming, stateful calls via `context_id`,
and the 409 for a conversation that contradicts the stored one."""

from __future__ import annotations

import pytest

from deploy.client import Client

SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def token(server):
    return Client(server.url, server.admin).bind("openai-tests")


@pytest.fixture(scope="module")
def oai(server, token):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=token, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def base(oai) -> str:
    """The base model's id, as `/v1/models` lists it first."""
    return oai.models.list().data[0].id


def test_models(oai, base):
    models = oai.models.list().data
    assert models[0].id == base and base and not getattr(models[0], "parent", None)
    assert all(getattr(m, "parent", None) == base for m in models[1:])  # LoRA adapters, if any are loaded


def test_an_unknown_model_is_404_model_not_found(oai):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert e.value.response.json()["error"]["code"] == "model_not_found"


def test_stateless_chat_equals_engine(server, oai, token, engine, base):
    """Without `context_id` the conversation so far is answered on no context: the replies equal the
    engine's, and the app holds no context afterwards (nothing stored, nothing counted)."""
    before = Client(server.url, token).contexts()
    # reference: the same conversation on the in-process engine, with the assistant turn as history
    ctx = engine.new_ctx(SYSTEM)
    first = engine.call(ctx, "Name a fruit.", max_tokens=10).text
    second = engine.call(ctx, "What colour is it?", max_tokens=10)
    want = second.text
    engine.delete_ctx(ctx)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}]
    r = oai.chat.completions.create(model=base, messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == first
    assert r.usage.completion_tokens > 0
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "What colour is it?"}]
    # a client-supplied assistant turn is re-tokenized from its text; for this reply the ids agree
    r = oai.chat.completions.create(model=base, messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want
    # usage counts every token the model attended (system prompt and history too), as OpenAI does
    assert r.usage.prompt_tokens == second.context_tokens > second.prompt_tokens
    assert r.model_extra["dropped_tokens"] == 0
    chunks = list(oai.chat.completions.create(model=base, messages=msgs, max_tokens=10, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert Client(server.url, token).contexts() == before


def test_repetition_penalties_reach_the_model(oai, engine, base):
    """OpenAI's `frequency_penalty` and `presence_penalty`, and `repetition_penalty` as an extra field (as
    vLLM takes it), give the reply the engine gives under the same penalties."""
    penalties = {"frequency_penalty": 0.6, "presence_penalty": 0.4, "repetition_penalty": 1.2}
    prompt = "List three prime numbers larger than 100."
    want = []
    for p in (penalties, {}):
        ctx = engine.new_ctx(SYSTEM)
        want.append(engine.call(ctx, prompt, max_tokens=24, **p).text)
        engine.delete_ctx(ctx)
    assert want[0] != want[1]  # the penalties matter for this prompt
    r = oai.chat.completions.create(model=base, messages=[{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": prompt}],
                                    max_tokens=24, temperature=0, frequency_penalty=0.6, presence_penalty=0.4,
                                    extra_body={"repetition_penalty": 1.2})
    assert r.choices[0].message.content == want[0]


def test_stateful_chat_via_context_id(server, oai, token, engine, base):
    ctx = engine.new_ctx(SYSTEM)
    want = [engine.call(ctx, p, max_tokens=10).text for p in ("Name a tree.", "Where does it grow?", "Thanks!")]
    engine.delete_ctx(ctx)
    app = Client(server.url, token)
    cid = app.new_ctx(SYSTEM)
    # new turns only
    r = oai.chat.completions.create(model=base, messages=[{"role": "user", "content": "Name a tree."}],
                                    max_tokens=10, extra_body={"context_id": cid})
    assert r.choices[0].message.content == want[0]
    # the whole conversation: only the new turn is appended (streaming)
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a tree."},
            {"role": "assistant", "content": want[0]}, {"role": "user", "content": "Where does it grow?"}]
    chunks = oai.chat.completions.create(model=base, messages=conv, max_tokens=10, stream=True,
                                         extra_body={"context_id": cid})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[1]
    # a contradicting assistant turn is a conflict, and nothing changes
    import openai

    before = app.context(cid)
    bad = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a tree."},
           {"role": "assistant", "content": "A cactus."}, {"role": "user", "content": "Thanks!"}]
    with pytest.raises(openai.ConflictError):
        oai.chat.completions.create(model=base, messages=bad, max_tokens=10, extra_body={"context_id": cid})
    assert app.context(cid)["turns"] == before["turns"]
    r = oai.chat.completions.create(model=base, messages=[{"role": "user", "content": "Thanks!"}],
                                    max_tokens=10, extra_body={"context_id": cid})
    assert r.choices[0].message.content == want[2]
    assert len(app.context(cid)["turns"]) == 7  # system + three user/assistant pairs
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model=base, messages=[{"role": "user", "content": "x"}],
                                    extra_body={"context_id": "f" * 32})
