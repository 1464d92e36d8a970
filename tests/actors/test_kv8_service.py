"""The service on a kv8 working set (keys int8, values fp8 e4m3; engine/kvformat.py): its chunks are
swapped as the working set's rows (a restart reads them back and answers as the in-process engine on
kv8 does), lowered only to q4/q2, keyed apart from float K/V in both directions, refused under a
lossless policy; and on Ray the shared working set and the recompute worker hold the same rows."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from actors.service import ServiceConfig, wire_local
from engine.config import EngineConfig
from engine.context import ContextEngine
from scheduler.pipeline import CostProfile
from storage import codecs

PROFILE = CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json()
SYSTEM = "You are a concise assistant."
PROMPTS = ["Name three colours of the rainbow, then say which one you like.", "And a fourth colour?",
           "One more, please."]


@pytest.fixture(scope="module")
def engines(engine):
    kv8 = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=512, kv_format="kv8"))
    flt = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=512))
    for e in (kv8, flt):
        e.fingerprint = engine.fingerprint
    return {"kv8": kv8, "float": flt}


@pytest.fixture(scope="module")
def reference(engines):
    """Replies of one conversation in the plain engine on a kv8 working set, in memory."""
    e = engines["kv8"]
    ctx = e.new_ctx(SYSTEM)
    out = [e.call(ctx, p, max_tokens=12).token_ids for p in PROMPTS]
    e.delete_ctx(ctx)
    return out


def service(engines, data_dir, fmt, **kw):
    kw.setdefault("pool_bytes", 64 << 20)
    return wire_local(ServiceConfig(data_dir=str(data_dir), max_context_tokens=512, profile=PROFILE,
                                    kv_format=fmt, **kw), engine=engines[fmt])


def test_kv8_chunks_are_swapped_as_their_rows_and_keyed_apart_from_float(engines, reference, tmp_path):
    svc = service(engines, tmp_path, "kv8")
    tok = svc.bind("app")
    ctx = svc.new_ctx(tok, SYSTEM)
    assert svc.call(tok, ctx, PROMPTS[0], max_tokens=12).token_ids == reference[0]
    ws = svc.parts.executor.ws
    assert ws.storage_name == "kv8" and ws.kv.dtype.itemsize == 1
    rows = {i: ws.export_chunk(i) for i in range(ws.n_chunks - 1)}  # the full chunks as the working set holds them
    svc.close()
    svc = service(engines, tmp_path, "kv8")  # a restart reads the rows back from disk, byte for byte
    io = svc.parts.io
    for i, enc in io.store.read(ctx, rows):
        want = rows[i]
        assert enc.dtype == "kv8" and enc.level == "raw"
        assert np.array_equal(codecs.decode(enc), want), i
    out = svc.call(tok, ctx, PROMPTS[1], max_tokens=12)
    assert out.restore.loaded > 0 and out.restore.recomputed == 0
    assert out.token_ids == reference[1]  # the same rows give the same reply as never swapping
    svc.close()
    for fmt in ("float", "kv8"):  # another format's chunks are never read: recomputed, both ways
        svc = service(engines, tmp_path, fmt)
        out = svc.call(tok, ctx, "And one more.", max_tokens=4)
        assert out.restore.loaded == 0 and out.restore.recomputed > 0, (fmt, out.restore)
        svc.close()


def test_under_pressure_kv8_chunks_are_lowered_to_q4_and_q2_only(engines, tmp_path):
    """A pool of a few chunks: the planner lowers kv8 chunks (8 bits already) to q4/q2, re-quantized
    once from their de-quantized values; the contexts go on answering."""
    svc = service(engines, tmp_path, "kv8", pool_bytes=1 << 20)
    try:
        tok = svc.bind("app")
        ctxs = [svc.new_ctx(tok, SYSTEM) for _ in range(3)]
        for turn in range(2):
            for ctx in ctxs:
                assert svc.call(tok, ctx, PROMPTS[turn], max_tokens=8).token_ids
        svc.parts.executor.flush()
        svc.parts.governor.drain()
        store = svc.parts.io.store
        levels = {enc.level for ctx in ctxs for _, enc in store.read(ctx, store.indices(ctx))}
    finally:
        svc.close()
    assert levels <= {"raw", "q4", "q2"} and levels & {"q4", "q2"}, levels


def test_a_lossless_policy_refuses_a_kv8_working_set(tmp_path):
    for policy in ("swap", "vllm-s", "lmk"):
        with pytest.raises(ValueError, match="lossless"):
            ServiceConfig(data_dir=str(tmp_path), policy=policy, kv_format="kv8")
    with pytest.raises(ValueError, match="valid: float, kv8"):
        ServiceConfig(data_dir=str(tmp_path), kv_format="int4")


def test_on_ray_the_shared_kv8_working_set_recomputes_as_the_one_process_service(ray_cluster, engines, tmp_path):
    """A context written under float K/V is recomputed on a kv8 service: on Ray in the recompute worker,
    over the executor's shared uint8 working set; the next replies equal the one-process service's."""
    from actors.ray_service import wire_ray

    svc = service(engines, tmp_path / "float", "float")
    tok = svc.bind("app")
    ctx = svc.new_ctx(tok, SYSTEM)
    svc.call(tok, ctx, PROMPTS[0], max_tokens=12)
    svc.close()
    shutil.copytree(tmp_path / "float", tmp_path / "ray")
    local = service(engines, tmp_path / "float", "kv8")
    try:
        want = [local.call(tok, ctx, p, max_tokens=8) for p in PROMPTS[1:]]
    finally:
        local.close()
    assert want[0].restore.recomputed > 0
    svc = wire_ray(ServiceConfig(data_dir=str(tmp_path / "ray"), max_context_tokens=512, profile=PROFILE,
                                 pool_bytes=64 << 20, kv_format="kv8"), prefix="t-kv8")
    try:
        got = [svc.call(tok, ctx, p, max_tokens=8) for p in PROMPTS[1:]]
    finally:
        svc.close()
    assert got[0].restore.recomputed == want[0].restore.recomputed
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
