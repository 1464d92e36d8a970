"""Stateless calls (an OpenAI-style call without a context): answered on no context, nothing stored,
locked or counted against the app's limit. In one process, on the real model."""

from __future__ import annotations

from actors.service import ServiceConfig, wire_local
from engine.config import EngineConfig
from engine.context import ContextEngine
from scheduler.pipeline import CostProfile

PROFILE = CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json()


def test_a_stateless_call_stores_nothing_and_counts_against_no_limit(engine, tmp_path):
    """At its context limit an app still makes stateless calls; they leave no context, row or file,
    and the context held in the working set is restored exactly afterwards."""
    e = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=512))
    svc = wire_local(ServiceConfig(data_dir=str(tmp_path), policy="swap", pool_bytes=64 << 20, max_context_tokens=512,
                                   max_contexts_per_app=1, profile=PROFILE), engine=e)
    tok = svc.bind("app")
    ctx = svc.new_ctx(tok, "You are terse.")
    first = svc.call(tok, ctx, "Name a fruit.", max_tokens=4)
    svc.flush()
    files = sorted(p.name for p in (tmp_path / "chunks").rglob("*"))
    out = svc.call_stateless(tok, "You are terse.", [("user", "Name a fruit."), ("assistant", first.text)],
                             "What colour is it?", max_tokens=4)
    assert out.completion_tokens > 0 and out.switch_ms == 0.0
    assert [c.id for c in svc.list_ctx(tok)] == [ctx] and sorted(p.name for p in (tmp_path / "chunks").rglob("*")) == files
    again = svc.call(tok, ctx, "What colour is it?", max_tokens=4)  # restored: the working set was taken
    assert not again.hit
    ref = e.new_ctx("You are terse.")
    want = [e.call(ref, p, max_tokens=4).text for p in ("Name a fruit.", "What colour is it?")]
    assert [first.text, again.text] == want
    svc.close()
