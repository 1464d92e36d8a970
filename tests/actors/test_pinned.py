"""Pinned-exact chunks: under the lossy `llms` policy, chunks pinned by `MemoryGovernor.pin_exact` stay
raw through later calls, evictions and a restart, while their neighbours are lowered; a chunk
already lowered when pinned is recomputed raw. In one process, on the real model."""

from __future__ import annotations

import pytest

from actors.service import ServiceConfig, wire_local
from engine.config import EngineConfig
from engine.context import ContextEngine
from scheduler.pipeline import CostProfile

PROFILE = CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json()
TEXT = "Summarise in one line: " + " ".join(["rivers, lakes and the long valleys between hills"] * 10)


@pytest.fixture()
def small_engine(engine):
    return ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=512))


def open_svc(small_engine, tmp_path):
    return wire_local(ServiceConfig(data_dir=str(tmp_path), policy="llms", pool_bytes=1 << 20,
                                    max_context_tokens=512, profile=PROFILE), engine=small_engine)


def levels(svc, ctx) -> dict[int, str]:
    return {i: ch.level for i, ch in sorted(svc.governor.books[ctx].chunks.items())}


def test_pinned_chunks_are_never_lowered(small_engine, tmp_path):
    svc = open_svc(small_engine, tmp_path)
    tok = svc.bind("app")
    a, b = svc.new_ctx(tok, "Be brief."), svc.new_ctx(tok, "Be brief.")
    svc.call(tok, a, TEXT, max_tokens=4)
    svc.flush()
    before = levels(svc, a)
    lowered = [i for i, lv in before.items() if lv != "raw"]
    assert len(lowered) >= 2, before  # llms lowers some chunks of a fresh context
    pin = sorted(before)[:4]
    svc.governor.pin_exact(a, pin)
    assert all(levels(svc, a)[i] == "raw" for i in pin)
    for _ in range(2):  # switch away (a small pool: a's chunks are evicted) and back
        svc.call(tok, b, TEXT, max_tokens=4)
        out = svc.call(tok, a, "And again, shorter?", max_tokens=4)
        svc.flush()
        now = levels(svc, a)
        assert all(now[i] == "raw" for i in pin), now
        assert any(lv != "raw" for i, lv in now.items() if i not in pin)  # the others still lowered
    assert out.restore.recomputed + out.restore.loaded + out.restore.resident > 0
    rows = {r.index: r for r in svc.parts.registry.chunks(a)}
    assert all(rows[i].pinned and rows[i].level == "raw" for i in pin)
    svc.close()

    svc = open_svc(small_engine, tmp_path)  # a restart: the flag comes back from the registry
    assert all(svc.governor.books[a].chunks[i].pinned_exact for i in pin)
    svc.call(tok, a, "One word?", max_tokens=2)
    svc.flush()
    assert all(levels(svc, a)[i] == "raw" for i in pin)
    with pytest.raises(ValueError, match="no chunk"):
        svc.governor.pin_exact(a, [10_000])
    svc.close()
