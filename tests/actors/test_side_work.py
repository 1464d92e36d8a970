"""Calls whose side work fails or is skipped: stateless calls (an OpenAI-style call without a context,
answered on no context, nothing stored, locked or counted against the app's limit) and a write-back
that fails after a committed reply. In one process, on the real model."""

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


def test_a_failed_write_back_after_a_committed_reply_is_not_the_next_calls(engine, tmp_path, caplog):
    """The disk fails while a call's chunks are written ahead of time, after its reply: the reply
    stands, the failure is logged instead of failing the next call, the context is not left locked,
    the chunks are written on demand when evicted, and the next call restores the context and answers."""
    import errno

    e = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=512))
    svc = wire_local(ServiceConfig(data_dir=str(tmp_path), policy="llms-no-compress", pool_bytes=1,
                                   max_context_tokens=512, profile=PROFILE), engine=e)
    tok = svc.bind("app")
    ctx, other = svc.new_ctx(tok, "You are terse."), svc.new_ctx(tok, "You are terse.")
    io, failed = svc.parts.io, []
    write = io.write

    def full_disk(ctx_id, todo, adapter=""):
        if not failed:
            failed.append(ctx_id)
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(ctx_id, todo, adapter)

    io.write = full_disk  # the fault: a disk that fills up during one write-back
    first = svc.call(tok, ctx, "Name a fruit.", max_tokens=4)
    svc.flush()
    assert failed == [ctx] and "a write ahead of time of" in caplog.text
    assert svc.governor.stats["failed_writes"] == 1
    assert ctx not in svc.governor.locked
    svc.call(tok, other, "Hello.", max_tokens=2)  # the pool holds one chunk: ctx must come back from disk or recompute
    again = svc.call(tok, ctx, "What colour is it?", max_tokens=4)
    ref = e.new_ctx("You are terse.")
    assert first.token_ids == e.call(ref, "Name a fruit.", max_tokens=4).token_ids
    assert again.completion_tokens > 0 and again.restore.recomputed + again.restore.loaded > 0
    turns = svc.describe(tok, ctx)["turns"]
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user", "assistant"]
    svc.close()
