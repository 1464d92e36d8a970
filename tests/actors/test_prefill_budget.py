"""A call's prefill admitted under `ServiceConfig.prefill_budget_bytes` (actors/admission.py): a long
prompt whose one-pass estimate is over the budget runs in the planner's row partitions and answers
as without a budget; one that cannot fit is refused with `prompt_too_long` and the estimate before any
prefill, and the context goes on as it was; one that fits only with its K/V streamed layer by layer
(`severe`) runs so and answers the same. (On Ray, where the recompute worker maps the streamed working
set by its path, the same is checked on the service of tests/actors/test_adapters_service.py's Ray test.)"""

from __future__ import annotations

import pytest

from actors.admission import prefill_shape
from actors.service import ServiceConfig, wire_local
from engine.config import EngineConfig
from engine.context import ContextEngine
from scheduler.pipeline import CostProfile
from scheduler.prefill import plan_prefill

PROFILE = CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json()
SYSTEM = "You are terse."
LONG = "Summarise this list: " + " ".join(f"item {i} is a {['red', 'blue', 'green'][i % 3]} box," for i in range(120))


@pytest.fixture(scope="module")
def small_engine(engine):
    return ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=2048))


def test_a_long_prompt_runs_in_partitions_or_is_refused_with_its_estimate(small_engine, tmp_path, monkeypatch):
    e = small_engine
    ref = e.new_ctx(SYSTEM)
    new, cached = e.new_tokens(ref, LONG), ref.cache.length
    want = e.call(ref, LONG, max_tokens=8).token_ids
    shape = prefill_shape(e.model, "float")
    one_pass = plan_prefill(shape, new, cached, 1 << 40).peak
    budget = one_pass - 1
    plan = plan_prefill(shape, new, cached, budget)
    assert new > 600 and plan.kind == "moderate" and plan.partitions >= 2, plan

    passes = []
    forward_steps = e.model.forward_steps
    monkeypatch.setattr(e.model, "forward_steps", lambda cache, ids, **kw: (
        passes.append((len(ids), kw.get("partition_rows"))), forward_steps(cache, ids, **kw))[1])
    svc = wire_local(ServiceConfig(data_dir=str(tmp_path / "a"), max_context_tokens=2048, profile=PROFILE,
                                   prefill_budget_bytes=budget), engine=e)
    try:
        tok = svc.bind("app")
        ctx = svc.new_ctx(tok, SYSTEM)
        out = svc.call(tok, ctx, LONG, max_tokens=8)
        assert out.token_ids == want and out.prefill_plan == "moderate"  # partitions change nothing
        assert out.streamed_bytes == 0
        assert (new, plan.partition_rows) in passes  # the prefill ran in the plan's partitions
        assert svc.call(tok, ctx, "Thanks.", max_tokens=4).prefill_plan == "none"
    finally:
        svc.close()

    severe = plan_prefill(shape, new, cached, 8 << 20)
    assert severe.kind == "severe" and severe.resident_layers < e.model.cfg.n_layers, severe
    other = e.new_ctx(SYSTEM)
    after = [e.call(other, "Hi.", max_tokens=4).token_ids, e.call(ref, "Thanks.", max_tokens=4).token_ids]
    svc = wire_local(ServiceConfig(data_dir=str(tmp_path / "s"), max_context_tokens=2048, profile=PROFILE,
                                   policy="swap", prefill_budget_bytes=8 << 20), engine=e)
    ex = svc.executor
    puts, writes = [], []
    put, write = ex.put, ex.io.write
    ex.put = lambda encs: (puts.append(len(encs)), put(encs))[1]
    ex.io.write = lambda c, todo, adapter="": (writes.append([h.nbytes for _i, h, _t in todo]), write(c, todo, adapter))[1]
    try:  # K/V streamed layer by layer through a mapped file (engine/kvspill.py): the same reply
        tok = svc.bind("app")
        ctx, b = svc.new_ctx(tok, SYSTEM), svc.new_ctx(tok, SYSTEM)
        ex.flush()
        puts.clear()
        out = svc.call(tok, ctx, LONG, max_tokens=8)
        assert out.token_ids == want and out.prefill_plan == "severe"
        layers = e.model.cfg.n_layers - severe.resident_layers  # every row of every streamed layer written out
        assert out.streamed_bytes >= layers * (cached + new) * 2 * e.model.cfg.n_kv_heads * e.model.cfg.head_dim * 4
        ex.flush()  # written through (`ModelExecutor._write_through`): on disk in batches of at most one
        # layer's K/V of the context and one chunk (not a whole layer's slab of the capacity), none in the pool
        tokens = cached + new + len(out.token_ids)
        n = -(-tokens // 16)
        chunk_bytes = max(max(w) for w in writes)
        layer = tokens * 2 * e.model.cfg.n_kv_heads * e.model.cfg.head_dim * 4
        assert ex.ws.pager.slab_bytes(tokens) == layer < ex.ws.pager.layer_bytes
        assert not any(puts) and sum(map(len, writes)) >= n - 1 and len(writes) > 1, (puts, writes)
        assert all(sum(w) < layer + chunk_bytes for w in writes), (layer, writes)
        seen = svc.describe(tok, ctx)  # GET /v1/contexts/{id}: where its K/V is
        chunks = seen["chunks"]
        assert chunks["resident"] == {} and sum(chunks["swapped"].values()) == chunks["total"], chunks
        assert seen["working_set"] == {"held": True, "streamed_from_layer": severe.resident_layers}, seen
        assert svc.call(tok, b, "Hi.", max_tokens=4).token_ids == after[0]
        assert svc.describe(tok, ctx)["working_set"]["held"] is False
        assert svc.describe(tok, b)["working_set"] == {"held": True, "streamed_from_layer": None}
        back = svc.call(tok, ctx, "Thanks.", max_tokens=4)  # read back from those records
        assert back.restore.loaded > 0 and back.token_ids == after[1], back.restore
    finally:
        svc.close()

    svc = wire_local(ServiceConfig(data_dir=str(tmp_path / "b"), max_context_tokens=2048, profile=PROFILE,
                                   prefill_budget_bytes=2 << 20), engine=e)
    try:
        tok = svc.bind("app")
        ctx = svc.new_ctx(tok, SYSTEM)
        before = svc.describe(tok, ctx)
        with pytest.raises(Exception) as err:
            svc.call(tok, ctx, LONG, max_tokens=8)
        assert getattr(err.value, "code", "") == "prompt_too_long" and "MiB" in str(err.value)
        after = svc.describe(tok, ctx)
        assert (after["tokens"], after["turns"]) == (before["tokens"], before["turns"])
        assert svc.call(tok, ctx, "Hi.", max_tokens=4).token_ids  # a short call still fits
    finally:
        svc.close()
    with pytest.raises(ValueError, match="prefill_budget_bytes"):
        ServiceConfig(data_dir=str(tmp_path), prefill_budget_bytes=-1)
