"""The weight format is part of the KV key: a service started with another format never restores K/V
computed under the first (the chunks are recomputed from their tokens), in either direction, and a
service refuses an engine of another format than it is configured for."""

from __future__ import annotations

import pytest

from actors.service import ServiceConfig, wire_local
from engine.config import EngineConfig
from engine.context import ContextEngine
from engine.model import Transformer
from scheduler.pipeline import CostProfile

PROFILE = CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json()


@pytest.fixture(scope="module")
def engines(engine, resolved_model):
    int4 = Transformer.from_directory(resolved_model.directory, EngineConfig(device="cpu", weights="int4"),
                                      fingerprint=resolved_model.fingerprint)
    return {"fp32": ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=512)),
            "int4-g32": ContextEngine(int4, engine.tok, EngineConfig(max_context_tokens=512, weights="int4"))}


def test_a_restart_in_another_format_recomputes_instead_of_reading_the_other_formats_chunks(engines, tmp_path):
    def service(fmt):
        return wire_local(ServiceConfig(data_dir=str(tmp_path), pool_bytes=64 << 20, max_context_tokens=512,
                                        profile=PROFILE, weights=fmt), engine=engines[fmt])

    svc = service("fp32")
    tok = svc.bind("app")
    ctx = svc.new_ctx(tok, "You are a concise assistant.")
    svc.call(tok, ctx, "Name three colours of the rainbow, then say which one you like.", max_tokens=16)
    svc.close()
    svc = service("fp32")  # the same format after a restart: read from disk
    out = svc.call(tok, ctx, "And a fourth colour?", max_tokens=8)
    assert out.restore.loaded > 0 and out.restore.recomputed == 0
    svc.close()
    for fmt in ("int4-g32", "fp32"):  # and across formats, both ways: nothing read, everything recomputed
        svc = service(fmt)
        out = svc.call(tok, ctx, "One more, please.", max_tokens=8)
        assert out.restore.loaded == 0 and out.restore.recomputed > 0, (fmt, out.restore)
        assert out.token_ids
        svc.close()


def test_a_service_refuses_an_engine_of_another_format(engines, tmp_path):
    with pytest.raises(ValueError, match="int4-g32 weights"):
        wire_local(ServiceConfig(data_dir=str(tmp_path), profile=PROFILE, max_context_tokens=512),
                   engine=engines["int4-g32"])


def test_streamed_weights_are_the_same_weights_to_the_kv_key(engines, resolved_model, tmp_path):
    """Weights streamed from the mapped file (weights_resident_bytes) compute what resident ones do: a
    service streaming them reads the K/V a resident one wrote (same key) and answers the same, and the
    components of both wirings carry the limit. An engine holding every weight is refused by a service
    configured to stream."""
    from actors.service import components

    streamed = Transformer.from_directory(resolved_model.directory, EngineConfig(weights_resident_bytes=32 << 20),
                                          fingerprint=resolved_model.fingerprint)
    eng = ContextEngine(streamed, engines["fp32"].tok, EngineConfig(max_context_tokens=512))
    cfg = dict(data_dir=str(tmp_path), pool_bytes=64 << 20, max_context_tokens=512, profile=PROFILE)
    with pytest.raises(ValueError, match="holds them all resident"):
        wire_local(ServiceConfig(**cfg, weights_resident_bytes=32 << 20), engine=engines["fp32"])
    svc = wire_local(ServiceConfig(**cfg), engine=engines["fp32"])
    tok = svc.bind("app")
    ctx = svc.new_ctx(tok, "You are a concise assistant.")
    svc.call(tok, ctx, "Name three colours of the rainbow.", max_tokens=12)
    expected = svc.call(tok, ctx, "And a fourth colour?", max_tokens=8).token_ids
    svc.close()
    config = ServiceConfig(**cfg, weights_resident_bytes=32 << 20)
    assert components(config, streamed.cfg, "float32").engine.weights_resident_bytes == 32 << 20
    try:
        svc = wire_local(config, engine=eng)
        ctx2 = svc.new_ctx(tok, "You are a concise assistant.")
        svc.call(tok, ctx2, "Name three colours of the rainbow.", max_tokens=12)
        out = svc.call(tok, ctx, "And a fourth colour?", max_tokens=8)  # the first context, from disk
        assert out.restore.loaded > 0
        assert svc.call(tok, ctx2, "And a fourth colour?", max_tokens=8).token_ids == expected
        svc.close()
    finally:
        streamed.weight_pager.close()
