"""A full disk, in one process on the real model: calls that must write answer DiskFullError (code
`disk_full`, 507 over HTTP), a context can be deleted while the disk is full, the stored contexts are
untouched, and once space comes back the next call works, with no restart. The chunk files' file system
is filled by injected file operations (storage.fileops.FileOps), the registry's SQLite database for real
(held at `max_page_count`, its free pages taken)."""

from __future__ import annotations

import os

import pytest

from actors.service import ServiceConfig, wire_local
from engine.config import EngineConfig
from engine.context import ContextEngine
from scheduler.pipeline import CostProfile
from storage.errors import DiskFullError
from tests.conftest import SAMPLE_TEXT
from tests.storage.test_disk_full import FullDisk, fill, make_room

PROFILE = CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json()
SYSTEM = "You are terse."
LONG = " ".join([SAMPLE_TEXT] * 4)  # a turn too long for the free space of the database's pages


def test_a_full_disk_answers_disk_full_lets_contexts_go_and_recovers_without_a_restart(engine, tmp_path, monkeypatch):
    e = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=1024))
    # pool of one byte, swap: every chunk is written to a file after its call, and read back losslessly
    svc = wire_local(ServiceConfig(data_dir=str(tmp_path), policy="swap", pool_bytes=1, max_context_tokens=1024,
                                   profile=PROFILE), engine=e)
    reg, store = svc.parts.registry, svc.parts.io.store
    fs = FullDisk()
    store._index.fs = fs
    tok = svc.bind("app")
    kept, doomed, stuck = (svc.new_ctx(tok, SYSTEM) for _ in range(3))
    first = {c: svc.call(tok, c, "Name a fruit.", max_tokens=4) for c in (kept, doomed, stuck)}
    svc.flush()
    assert all(store.indices(c) for c in (kept, doomed, stuck))  # on disk
    before = reg.get_context(kept)

    fs.full = True  # the disk fills up: chunk files and the registry
    fill(reg)
    with pytest.raises(DiskFullError) as err:
        svc.call(tok, kept, LONG, max_tokens=4)
    assert err.value.code == "disk_full"
    with pytest.raises(DiskFullError):  # a new context too
        svc.call(tok, svc.new_ctx(tok, SYSTEM), LONG, max_tokens=4)
    assert kept not in svc.governor.locked
    n = len(svc.list_ctx(tok))
    with pytest.raises(DiskFullError):  # a context seeded with a long history: made whole or not at all
        svc.new_ctx(tok, SYSTEM, [("user", LONG), ("assistant", "Noted.")])
    assert len(svc.list_ctx(tok)) == n

    svc.delete_ctx(tok, doomed)  # deleting works on the full disk, and frees space
    assert doomed not in {c.id for c in svc.list_ctx(tok)} and not os.path.exists(os.path.join(store.root, doomed))

    # the rows' transaction fails after the files went: the context stays, its chunks to be recomputed
    def rows_full(ctx, app=None):
        raise DiskFullError("injected: the registry's file system is full")

    with monkeypatch.context() as m:
        m.setattr(reg, "delete_context", rows_full)
        with pytest.raises(DiskFullError):
            svc.delete_ctx(tok, stuck)
    assert stuck in {c.id for c in svc.list_ctx(tok)} and store.indices(stuck) == []

    after = reg.get_context(kept)  # nothing stored was changed by the failed calls
    assert list(after.token_ids) == list(before.token_ids) and after.text == before.text

    fs.full = False  # space comes back: the next calls work, no restart
    make_room(reg)
    again = svc.call(tok, kept, "What colour is it?", max_tokens=4)
    assert again.restore.loaded > 0  # its chunks came back from their files
    ref = e.new_ctx(SYSTEM)
    want = [e.call(ref, p, max_tokens=4).token_ids for p in ("Name a fruit.", "What colour is it?")]
    assert [first[kept].token_ids, again.token_ids] == want
    redo = svc.call(tok, stuck, "What colour is it?", max_tokens=4)
    assert redo.restore.recomputed > 0 and redo.token_ids == want[1]
    svc.delete_ctx(tok, stuck)
    fresh = svc.new_ctx(tok, SYSTEM)
    assert svc.call(tok, fresh, "Name a fruit.", max_tokens=4).token_ids == want[0]
    assert [t["role"] for t in svc.describe(tok, kept)["turns"]] == ["system", "user", "assistant", "user", "assistant"]
    svc.close()
