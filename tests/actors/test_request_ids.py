"""A call's request id makes its commit idempotent: an executor that stops between the commit and the
reply, then a retried call with the same id, appends the turn once. In one process: the executor's
death is an exception raised right after the commit, its restart a new executor over the same
governor (which then rebuilds its books from the registry, as on Ray)."""

from __future__ import annotations

import json

import pytest

from actors.executor import ModelExecutor
from actors.local_restore import InProcessRestorer
from actors.service import ServiceConfig, wire_local
from engine.config import EngineConfig
from engine.context import ContextEngine
from scheduler.pipeline import CostProfile

PROFILE = CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json()


class Died(BaseException):
    """The executor process ending between the commit and the reply."""


def turns(svc, ctx) -> list[dict]:
    return json.loads(svc.parts.registry.load_state(ctx)[0])["turns"]


@pytest.fixture()
def svc(engine, tmp_path):
    e = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=512))
    s = wire_local(ServiceConfig(data_dir=str(tmp_path), policy="swap", pool_bytes=64 << 20,
                                 max_context_tokens=512, profile=PROFILE), engine=e)
    yield s
    s.close()


def test_a_call_retried_after_its_executor_died_past_the_commit_appends_once(svc):
    tok = svc.bind("app")
    ctx = svc.new_ctx(tok, "You are terse.")
    svc.call(tok, ctx, "Name a fruit.", max_tokens=4)
    before = turns(svc, ctx)

    def die(*_args, **_kw):
        raise Died()

    svc.executor._schedule_write_back = die  # the commit is made, the reply never leaves
    with pytest.raises(Died):
        svc.call(tok, ctx, "Name a colour.", request_id="r-1", max_tokens=4)
    committed = turns(svc, ctx)
    assert len(committed) == len(before) + 2  # the turn is durable: user and assistant

    # the restarted executor: a new object with nothing of the old one's, over the same governor
    gov = svc.governor
    gov.executor_started()
    parts = svc.parts
    svc.executor = parts.executor = ModelExecutor(parts.engine, gov, InProcessRestorer(parts.engine.model, parts.io))
    ids = len(parts.registry.get_context(ctx).token_ids)
    again = svc.call(tok, ctx, "Name a colour.", request_id="r-1", max_tokens=4)
    assert turns(svc, ctx) == committed and len(parts.registry.get_context(ctx).token_ids) == ids
    assert again.text == committed[-1]["text"] and again.completion_tokens == len(again.token_ids) > 0
    assert ctx not in gov.locked

    # the same id again, now with the executor holding the context: still nothing appended
    assert svc.call(tok, ctx, "Name a colour.", request_id="r-1", max_tokens=4).text == again.text
    assert turns(svc, ctx) == committed
    # another id is another turn
    svc.call(tok, ctx, "Name a colour.", request_id="r-2", max_tokens=4)
    assert len(turns(svc, ctx)) == len(committed) + 2


def test_the_governor_refuses_to_commit_one_request_twice(svc):
    tok = svc.bind("app")
    ctx = svc.new_ctx(tok, "You are terse.")
    svc.call(tok, ctx, "Hi.", request_id="once", max_tokens=2)
    svc.flush()  # the write-back unlocks the context
    gov = svc.governor
    gov.begin_call(ctx, "app")
    reply = gov.commit_call(ctx, [1, 2, 3], "x", "{}", b"", 0, [], 0, request_id="once")
    assert reply.repeated and reply.todo == {}
    gov.abort_call(ctx)
    # the id survives a rebuild of the books from the registry
    gov.executor_started()
    assert gov.books[ctx].request_id == "once"

