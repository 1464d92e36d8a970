"""Registry: apps, contexts and chunk rows; all-or-nothing transactions; verify() against chunk files."""

from __future__ import annotations

import hashlib
import os
import sqlite3

import numpy as np
import pytest

from storage import codecs
from storage.chunkstore import ChunkStore
from storage.errors import (AppExistsError, ContextLimitError, InvalidKeyError, UnknownAppError,
                            UnknownChunkError, UnknownContextError, UnknownCodecError)
from storage.registry import ChunkRow, ChunkState, Registry, RegistryConfig
from tests.storage.helpers import synthetic_kv

FP = "registry-test-model"


class Clock:
    def __init__(self):
        self.now = 1000.0
        self.fail_at: int | None = None
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("injected failure")
        self.now += 1
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def reg(tmp_path, clock):
    r = Registry(str(tmp_path / "reg.db"), clock=clock)
    yield r
    r.close()


@pytest.fixture
def store(tmp_path):
    return ChunkStore(tmp_path / "chunks", fingerprint=FP)


def rows(path) -> dict[str, list]:
    """Every row of every table, read through a separate connection."""
    db = sqlite3.connect(str(path))
    try:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall()
                for t in ("apps", "contexts", "chunks")}
    finally:
        db.close()


def write_chunk(reg, store, ctx, i, level="q4", state="swapped", seed=0):
    meta = store.write(ctx, i, codecs.encode(synthetic_kv((2, 2, 1, 16, 8), seed=seed), level), 16 * i)
    reg.upsert_chunk(ctx, i, state=state, level=level, file=meta.name, checksum=meta.checksum,
                     nbytes=meta.nbytes, density=0.1 * i)
    return meta


# -- apps and contexts ---------------------------------------------------------------------------------


def test_wal_mode_and_schema(tmp_path, reg):
    assert reg._q("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert reg._q("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_apps_store_only_the_token_hash(tmp_path, reg, clock):
    token = reg.create_app("notes")
    assert reg.app_for_token(token) == "notes"
    # a fixed prefix, so a token never starts with '-' (CLI flags) and is recognisable; 256 random bits
    assert token.startswith("llmaas_") and len(token) == len("llmaas_") + 43
    (name, stored, created, adapter), = rows(tmp_path / "reg.db")["apps"]
    assert stored == hashlib.sha256(token.encode()).hexdigest() and token not in stored
    assert created == 1001.0 and adapter == ""
    with open(tmp_path / "reg.db", "rb") as f:
        raw = f.read()
    for wal in ("reg.db-wal",):
        if os.path.exists(tmp_path / wal):
            raw += open(tmp_path / wal, "rb").read()
    assert token.encode() not in raw
    with pytest.raises(AppExistsError) as e:
        reg.create_app("notes")
    assert e.value.code == "app_exists"
    for bad in ("", token + "x", None):
        with pytest.raises(UnknownAppError):
            reg.app_for_token(bad)
    with pytest.raises(InvalidKeyError):
        reg.create_app("x" * 200)


def test_contexts_belong_to_their_app(reg, clock):
    reg.create_app("a")
    reg.create_app("b")
    c1 = reg.create_context("a", "You are terse.")
    c2 = reg.create_context("a")
    cb = reg.create_context("b")
    assert len(c1) == 32 and int(c1, 16) >= 0 and len({c1, c2, cb}) == 3
    assert [c.id for c in reg.list_contexts("a")] == [c1, c2]
    ctx = reg.get_context(c1, app="a")
    assert ctx.system_prompt == "You are terse." and ctx.token_ids.size == 0 and ctx.app == "a"
    with pytest.raises(UnknownContextError) as other:
        reg.get_context(c1, app="b")
    with pytest.raises(UnknownContextError) as unknown:
        reg.get_context("0" * 32, app="b")
    assert str(other.value) == str(unknown.value) and other.value.code == "unknown_context"
    with pytest.raises(UnknownAppError):
        reg.create_context("nobody")


def test_tokens_are_a_compact_int32_blob(tmp_path, reg, clock):
    reg.create_app("a")
    ctx = reg.create_context("a")
    assert reg.append_tokens(ctx, [1, 2, 3], "abc") == 3
    assert reg.append_tokens(ctx, np.array([70000, 0], np.int64), "de") == 5
    c = reg.get_context(ctx)
    assert c.token_ids.tolist() == [1, 2, 3, 70000, 0] and c.text == "abcde"
    assert c.token_ids.dtype == np.dtype("<i4") and not c.token_ids.flags.writeable
    blob = rows(tmp_path / "reg.db")["contexts"][0][3]
    assert isinstance(blob, bytes) and len(blob) == 20
    assert c.last_used > c.created  # from the injected clock
    assert reg.list_contexts("a")[0].n_tokens == 5
    with pytest.raises(ValueError):
        reg.append_tokens(ctx, [-1], "")
    with pytest.raises(ValueError):
        reg.append_tokens(ctx, [1.5], "")


def test_set_tokens_drops_chunks_from_the_first_changed_token(reg, store):
    reg.create_app("a")
    ctx = reg.create_context("a")
    ids = list(range(64))
    reg.append_tokens(ctx, ids, "t")
    names = [write_chunk(reg, store, ctx, i).name for i in range(4)]
    assert reg.set_tokens(ctx, ids + [7, 7], "t2") == []  # pure extension: nothing stale
    changed = ids[:40] + [999] + ids[41:]
    assert reg.set_tokens(ctx, changed, "t3") == names[2:]  # token 40 is in chunk 2
    assert [r.index for r in reg.chunks(ctx)] == [0, 1]
    assert reg.set_tokens(ctx, ids[:20], "t4") == [names[1]]  # shortened inside chunk 1
    assert reg.get_context(ctx).token_ids.tolist() == ids[:20]


def test_context_limit_per_app(tmp_path, clock):
    with Registry(str(tmp_path / "r.db"), clock, RegistryConfig(max_contexts_per_app=2)) as reg:
        reg.create_app("a")
        reg.create_context("a")
        reg.create_context("a")
        with pytest.raises(ContextLimitError) as e:
            reg.create_context("a")
        assert e.value.code == "context_limit"


def test_delete_context_and_app_return_their_files(reg, store):
    reg.create_app("a")
    c1, c2 = reg.create_context("a"), reg.create_context("a")
    f1 = [write_chunk(reg, store, c1, i).name for i in range(2)]
    f2 = [write_chunk(reg, store, c2, i).name for i in range(3)]
    reg.upsert_chunk(c2, 3, state="resident", level="raw")
    assert reg.delete_context(c1, app="a") == f1
    assert reg.chunks(c1) == []
    with pytest.raises(UnknownContextError):
        reg.delete_context(c1)
    assert sorted(reg.delete_app("a")) == sorted(f2)
    assert reg.chunks(c2) == [] and reg.apps() == []
    with pytest.raises(UnknownAppError):
        reg.delete_app("a")
    assert store.delete_names(f1 + f2) == 5 and store.usage_bytes() == 0


# -- chunk rows --------------------------------------------------------------------------------------------


def test_chunk_rows_and_states(reg, store, clock):
    reg.create_app("a")
    ctx = reg.create_context("a")
    meta = write_chunk(reg, store, ctx, 0, state="both")
    reg.upsert_chunk(ctx, 1, state=ChunkState.RESIDENT, level="raw", density=0.7)
    r0, r1 = reg.chunks(ctx)
    assert (r0.state, r0.file, r0.checksum, r0.nbytes) == (ChunkState.BOTH, meta.name, meta.checksum,
                                                          meta.nbytes)
    assert (r1.state, r1.file, r1.density, r1.last_use) == (ChunkState.RESIDENT, None, 0.7, r1.last_use)
    assert r1.last_use > r0.last_use  # clock injected
    # keep density when not given
    reg.upsert_chunk(ctx, 1, state="missing", level="q2")
    assert reg.chunk(ctx, 1).density == 0.7
    with pytest.raises(UnknownCodecError, match="raw, fp16, bf16, q8, q4, q2"):
        reg.upsert_chunk(ctx, 2, state="resident", level="int3")
    with pytest.raises(ValueError):
        reg.upsert_chunk(ctx, 2, state="swapped", level="q8")  # swapped needs a file
    with pytest.raises(ValueError):
        reg.upsert_chunk(ctx, 2, state="bogus", level="q8")
    with pytest.raises(UnknownContextError):
        reg.upsert_chunk("f" * 32, 0, state="resident", level="raw")
    # evict chunk 0 from memory: both -> swapped keeps the file
    assert reg.mark_chunks(ctx, [0], ChunkState.SWAPPED, touch=True) == []
    # drop its file: -> missing returns the file to delete
    assert reg.mark_chunks(ctx, [0], "missing") == [meta.name]
    assert reg.chunk(ctx, 0).file is None
    with pytest.raises(ValueError):
        reg.mark_chunks(ctx, [0], "swapped")  # no file to be swapped to
    with pytest.raises(UnknownChunkError):
        reg.chunk(ctx, 9)


def test_upsert_chunks_writes_a_batch_all_or_nothing(tmp_path, reg, store):
    reg.create_app("a")
    ctx = reg.create_context("a")
    reg.upsert_chunk(ctx, 0, state="resident", level="q8", density=0.5)
    got = reg.upsert_chunks(ctx, [ChunkRow(0, "missing", "q8"), ChunkRow(1, "resident", "q4", density=0.25),
                                  ChunkRow(2, ChunkState.RESIDENT, "q2")])
    assert [(r.index, r.state, r.level, r.density) for r in got] == [
        (0, ChunkState.MISSING, "q8", 0.5), (1, ChunkState.RESIDENT, "q4", 0.25), (2, ChunkState.RESIDENT, "q2", 0.0)]
    assert reg.chunks(ctx) == got  # what it returns is what is stored
    before = rows(tmp_path / "reg.db")
    for bad, err in [(ChunkRow(7, "resident", "int3"), UnknownCodecError), (ChunkRow(7, "swapped", "q8"), ValueError),
                     (ChunkRow(-1, "resident", "q8"), InvalidKeyError)]:
        with pytest.raises(err):  # a bad row late in a batch: the rows before it are not written
            reg.upsert_chunks(ctx, [ChunkRow(0, "resident", "raw"), ChunkRow(3, "resident", "raw"), bad])
    with pytest.raises(UnknownContextError):
        reg.upsert_chunks("f" * 32, [ChunkRow(0, "resident", "raw")], durable=False)
    assert rows(tmp_path / "reg.db") == before
    # an eviction batch without fsync: committed (other connections see it), and the next
    # transactions are durable again
    reg.upsert_chunks(ctx, [ChunkRow(1, "missing", "q4")], durable=False)
    assert reg._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert rows(tmp_path / "reg.db") != before and reg.chunk(ctx, 1).state == ChunkState.MISSING


def test_drop_resident_after_restart(reg, store):
    reg.create_app("a")
    ctx = reg.create_context("a")
    write_chunk(reg, store, ctx, 0, state="both")
    reg.upsert_chunk(ctx, 1, state="resident", level="raw")
    assert reg.drop_resident() == 2
    assert [r.state for r in reg.chunks(ctx)] == [ChunkState.SWAPPED, ChunkState.MISSING]


# -- transactions --------------------------------------------------------------------------------------------


def test_a_failed_transaction_changes_nothing(tmp_path, reg, store):
    reg.create_app("a")
    ctx = reg.create_context("a")
    reg.append_tokens(ctx, range(32), "x")
    write_chunk(reg, store, ctx, 0)
    before = rows(tmp_path / "reg.db")
    with pytest.raises(RuntimeError, match="boom"):
        with reg.transaction():
            reg.upsert_chunk(ctx, 1, state="resident", level="raw")
            reg.mark_chunks(ctx, [0], "missing")
            reg.append_tokens(ctx, [5], "y")
            reg.create_app("b")
            raise RuntimeError("boom")
    assert rows(tmp_path / "reg.db") == before
    # an unknown index late in a batch leaves the earlier ones untouched too
    reg.upsert_chunk(ctx, 1, state="resident", level="raw")
    before = rows(tmp_path / "reg.db")
    with pytest.raises(UnknownChunkError):
        reg.mark_chunks(ctx, [0, 1, 7], "missing")
    assert rows(tmp_path / "reg.db") == before


def test_failure_injected_inside_a_method_rolls_it_back(tmp_path, reg, store, clock):
    reg.create_app("a")
    ctx = reg.create_context("a")
    reg.append_tokens(ctx, range(48), "x")
    for i in range(3):
        write_chunk(reg, store, ctx, i)
    before = rows(tmp_path / "reg.db")
    clock.fail_at = clock.calls + 1  # set_tokens reads the clock after deleting the stale rows
    with pytest.raises(RuntimeError, match="injected"):
        reg.set_tokens(ctx, [9] * 48, "changed")
    clock.fail_at = None
    assert rows(tmp_path / "reg.db") == before
    assert len(reg.chunks(ctx)) == 3


def test_committed_state_survives_reopening(tmp_path, clock):
    path = str(tmp_path / "reg.db")
    with Registry(path, clock) as reg:
        token = reg.create_app("a")
        ctx = reg.create_context("a", "sys")
        reg.append_tokens(ctx, [4, 5, 6], "abc")
        reg.upsert_chunk(ctx, 0, state="resident", level="raw", density=0.25)
    with Registry(path, clock) as reg:
        assert reg.app_for_token(token) == "a"
        assert reg.get_context(ctx).token_ids.tolist() == [4, 5, 6]
        assert reg.chunk(ctx, 0).density == 0.25


# -- verify ---------------------------------------------------------------------------------------------


def test_verify_marks_missing_and_corrupt_files_for_recompute(reg, store):
    reg.create_app("a")
    ctx = reg.create_context("a")
    reg.append_tokens(ctx, range(96), "x")
    metas = [write_chunk(reg, store, ctx, i, state="both" if i == 3 else "swapped", seed=i)
             for i in range(6)]
    reg.upsert_chunk(ctx, 6, state="resident", level="raw")
    os.unlink(store.path(ctx, 1))  # missing
    p = store.path(ctx, 2)  # a flipped payload byte: only the deep check sees it
    data = bytearray(open(p, "rb").read())
    data[-10] ^= 0x40
    open(p, "wb").write(bytes(data))
    open(store.path(ctx, 3), "wb").close()  # zero length, row in state "both"
    q = store.path(ctx, 4)  # truncated
    open(q, "r+b").truncate(os.path.getsize(q) - 7)
    orphan = store.write(ctx, 9, codecs.encode(synthetic_kv((2, 2, 1, 16, 8)), "q2"), 144).name

    shallow = reg.verify(store, deep=False)
    assert shallow.missing == [(ctx, 1)]
    assert sorted(shallow.corrupt) == [(ctx, 3, "chunk_corrupt"), (ctx, 4, "chunk_corrupt")]
    assert shallow.orphans == [orphan] and shallow.adopted == [] and shallow.checked == 6

    deep = reg.verify(store)
    assert deep.corrupt == [(ctx, 2, "chunk_corrupt")] and deep.missing == []
    states = {r.index: r.state for r in reg.chunks(ctx)}
    assert states == {0: ChunkState.SWAPPED, 1: ChunkState.MISSING, 2: ChunkState.MISSING,
                      3: ChunkState.RESIDENT, 4: ChunkState.MISSING, 5: ChunkState.SWAPPED,
                      6: ChunkState.RESIDENT}
    assert all(r.file is None for r in reg.chunks(ctx) if not r.state.on_disk)
    assert reg.chunk(ctx, 5).checksum == metas[5].checksum
    clean = reg.verify(store)
    assert clean.marked == 0 and clean.adopted == [] and clean.checked == 2


def test_verify_adopts_a_file_newer_than_its_row(reg, store):
    """Files are written before rows: a crash between the two leaves a valid, newer file."""
    reg.create_app("a")
    ctx = reg.create_context("a")
    reg.append_tokens(ctx, range(32), "x")
    write_chunk(reg, store, ctx, 0, level="q8")
    newer = store.write(ctx, 0, codecs.encode(synthetic_kv((2, 2, 1, 16, 8), seed=9), "q4"), 0)
    reg.upsert_chunk(ctx, 1, state="missing", level="raw")
    first = store.write(ctx, 1, codecs.encode(synthetic_kv((2, 2, 1, 16, 8)), "q2"), 16)
    report = reg.verify(store)
    assert sorted(report.adopted) == [(ctx, 0), (ctx, 1)] and report.marked == 0
    r0, r1 = reg.chunks(ctx)
    assert (r0.state, r0.level, r0.checksum) == (ChunkState.SWAPPED, "q4", newer.checksum)
    assert (r1.state, r1.level, r1.checksum, r1.file) == (ChunkState.SWAPPED, "q2", first.checksum,
                                                         first.name)


def test_verify_checks_each_contexts_records_under_its_own_tag(reg, store):
    """Records carry the tag of what their context is computed under (an adapter's); verify reads
    them under the tag `tag_of` names, and a record under another counts as corrupt."""
    reg.create_app("a")
    ctx, other = reg.create_context("a", adapter="x@1"), reg.create_context("a")
    for c in (ctx, other):
        reg.append_tokens(c, range(16), "x")
        meta = store.write_many(c, [(0, codecs.encode(synthetic_kv((2, 2, 1, 16, 8)), "q8"), 0)],
                                tag=FP + ";a=x@1")[0]
        reg.upsert_chunk(c, 0, state="swapped", level="q8", file=meta.name, checksum=meta.checksum,
                         nbytes=meta.nbytes)
    report = reg.verify(store, tag_of=lambda c: FP + ";a=x@1" if c == ctx else None)
    assert report.corrupt == [(other, 0, "chunk_fingerprint")] and report.checked == 2
    assert reg.chunk(ctx, 0).state is ChunkState.SWAPPED and reg.chunk(other, 0).state is ChunkState.MISSING


def test_save_state_commits_tokens_and_state_together(tmp_path):
    from storage.registry import Registry

    reg = Registry(tmp_path / "r.db")
    reg.create_app("a")
    ctx = reg.create_context("a")
    assert reg.load_state(ctx) is None
    reg.save_state(ctx, [1, 2, 3], "abc", '{"kv_tokens": 2}', b"\x00" * 16)
    assert reg.get_context(ctx).token_ids.tolist() == [1, 2, 3]
    assert reg.load_state(ctx) == ('{"kv_tokens": 2}', b"\x00" * 16)
    with pytest.raises(ValueError):
        reg.save_state(ctx, [4], "d", None)  # type: ignore[arg-type]
    assert reg.get_context(ctx).token_ids.tolist() == [1, 2, 3]  # nothing half-written
    reg.close()
    again = Registry(tmp_path / "r.db")
    assert again.load_state(ctx)[0] == '{"kv_tokens": 2}'


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_registry_gains_the_pinned_flag_and_adapters(tmp_path, clock, version):
    """A registry written before chunks could be pinned (schema 1) or contexts bound to adapters
    (schema 2) opens as schema 3: every chunk unpinned, every context on the base model."""
    import storage.registry as registry

    old = registry._SCHEMA.replace(",\n    adapter TEXT NOT NULL DEFAULT ''", "")
    if version == 1:
        old = old.replace("    pinned INTEGER NOT NULL DEFAULT 0 CHECK (pinned IN (0, 1)),\n", "")
    assert old.count("pinned") == (0 if version == 1 else 2) and "DEFAULT ''" not in old
    path = tmp_path / "old.db"
    db = sqlite3.connect(str(path))
    db.executescript(old)
    db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(version),))
    db.execute("INSERT INTO apps VALUES ('a', 'h', 1.0)")
    db.execute("INSERT INTO contexts (id, app, system_prompt, tokens, text, created, last_used) "
               "VALUES ('c0', 'a', '', x'', '', 1.0, 1.0)")
    db.commit()
    db.close()
    reg = Registry(str(path), clock=clock)
    assert reg.get_context("c0").adapter == "" and reg.app_adapter("a") == ""
    ctx = reg.create_context("a", "", adapter="lora@abc")
    reg.upsert_chunks(ctx, [ChunkRow(0, "missing", "raw"), ChunkRow(1, "missing", "raw", pinned=True)])
    assert [c.pinned for c in reg.chunks(ctx)] == [False, True]
    reg.close()
    reg = Registry(str(path), clock=clock)  # and it stays schema 3
    assert [c.pinned for c in reg.chunks(ctx)] == [False, True] and reg.get_context(ctx).adapter == "lora@abc"
    assert reg._q("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == "3"
    reg.close()


def test_adapters_are_recorded_and_not_removed_while_a_context_uses_one(reg):
    from storage.errors import AdapterExistsError, AdapterInUseError, UnknownAdapterError

    reg.create_app("a")
    with pytest.raises(UnknownAdapterError):
        reg.create_app("b", adapter="x")  # not loaded
    reg.add_adapter("x", "x", "x@1")
    with pytest.raises(AdapterExistsError):
        reg.add_adapter("x", "y", "x@2")
    reg.create_app("b", adapter="x")
    assert (reg.app_adapter("a"), reg.app_adapter("b")) == ("", "x")
    ctx = reg.create_context("a", "", adapter="x@1")
    for holder in ("a context", "an app"):
        with pytest.raises(AdapterInUseError) as e:
            reg.remove_adapter("x")
        assert e.value.code == "adapter_in_use", holder
        if holder == "a context":
            reg.delete_context(ctx)
    assert [(r.name, r.path, r.key) for r in reg.adapters()] == [("x", "x", "x@1")]
    reg.delete_app("b")
    reg.remove_adapter("x")
    assert reg.adapters() == []
    with pytest.raises(UnknownAdapterError):
        reg.remove_adapter("x")
