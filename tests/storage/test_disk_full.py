"""A full disk: chunk writes and registry transactions that meet ENOSPC (or a spent quota) raise
DiskFullError (code `disk_full`), change nothing already stored, leave no temporary and no open
transaction behind, and work again once there is room. Deleting works on a full disk. The chunk store's
file system is filled by injected file operations; the registry's by a real SQLite database held at
`max_page_count`."""

from __future__ import annotations

import errno
import os
import sqlite3

import numpy as np
import pytest

from storage import codecs
from storage.chunkstore import ChunkStore, ChunkStoreConfig
from storage.errors import DiskFullError, StorageError
from storage.fileops import FileOps
from storage.registry import Registry
from tests.storage.helpers import read_all, read_one, synthetic_kv

KEY = "0123456789abcdef0123456789abcdef"
FP = "disk-full-test-model"
SHAPE = (2, 2, 1, 16, 8)


class FullDisk(FileOps):
    """File operations on a file system that fills up: while `full`, the operations named in `failing`
    raise OSError(`err`); `after` lets that many of them succeed first."""

    def __init__(self, failing=("write", "fsync"), err: int = errno.ENOSPC, after: int = 0):
        self.full, self.failing, self.err, self.after = False, set(failing), err, after

    def _check(self, op: str) -> None:
        if self.full and op in self.failing:
            if self.after > 0:
                self.after -= 1
                return
            raise OSError(self.err, os.strerror(self.err))

    def write(self, fd, buffers):
        self._check("write")
        return super().write(fd, buffers)

    def fsync(self, fd):
        self._check("fsync")
        super().fsync(fd)


def enc(seed: int) -> codecs.EncodedChunk:
    return codecs.encode(synthetic_kv(SHAPE, seed=seed), "raw")


def leftovers(store: ChunkStore) -> list[str]:
    """Temporaries under the store's root."""
    return [n for _, _, names in os.walk(store.root) for n in names if n.endswith(".tmp")]


def payloads(store: ChunkStore, key: str = KEY) -> dict[int, bytes]:
    return {i: read_one(store, key, i).payload.tobytes() for i in store.indices(key)}


@pytest.mark.parametrize("op", ["write", "fsync"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_a_chunk_write_on_a_full_disk_raises_disk_full_and_loses_nothing(tmp_path, op, err):
    fs = FullDisk([op], err)
    store = ChunkStore(tmp_path, fingerprint=FP, fs=fs)
    store.write_many(KEY, [(i, enc(i), 16 * i) for i in range(4)])
    before, usage = payloads(store), store.usage_bytes()
    fs.full = True
    with pytest.raises(DiskFullError) as e:  # new content for chunks 1 and 2, and a new chunk 5
        store.write_many(KEY, [(1, enc(11), 16), (2, enc(12), 32), (5, enc(15), 80)])
    assert e.value.code == "disk_full" and isinstance(e.value, StorageError)
    assert os.strerror(err) in str(e.value) and KEY in str(e.value)
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == err
    assert leftovers(store) == [] and store.usage_bytes() == usage
    assert payloads(store) == before
    assert payloads(ChunkStore(tmp_path, fingerprint=FP)) == before  # as a restart finds it
    fs.full = False  # space comes back: the same write succeeds, nothing to reset
    store.write_many(KEY, [(1, enc(11), 16), (2, enc(12), 32), (5, enc(15), 80)])
    after = payloads(store)
    assert after[1] == enc(11).payload.tobytes() and after[5] == enc(15).payload.tobytes()
    assert after[0] == before[0] and after[3] == before[3]


def test_deleting_a_chunk_on_a_full_disk_keeps_it_and_deleting_a_context_works(tmp_path):
    """A chunk whose pack holds others is deleted by a marker file: on a full disk the marker is not
    made and the chunk stays readable. Deleting a whole context writes nothing, so it works."""
    fs = FullDisk(["fsync"])
    store = ChunkStore(tmp_path, fingerprint=FP, fs=fs)
    other = "fedcba9876543210fedcba9876543210"
    store.write_many(KEY, [(i, enc(i), 16 * i) for i in range(4)])
    store.write_many(other, [(0, enc(7), 0)])
    kept = payloads(store, other)
    fs.full = True
    with pytest.raises(DiskFullError):
        store.delete(KEY, 1)
    assert store.indices(KEY) == [0, 1, 2, 3]
    assert read_one(store, KEY, 1).payload.tobytes() == enc(1).payload.tobytes()
    assert store.delete_context(KEY) == 4
    assert store.contexts() == [other] and not os.path.exists(os.path.join(store.root, KEY))
    assert payloads(store, other) == kept and leftovers(store) == []
    fs.full = False
    assert store.delete(other, 0) and store.usage_bytes() == 0


def test_compaction_waits_for_room_and_the_write_before_it_stands(tmp_path):
    """The third pack of a context asks for compaction (max_packs=2), which meets the full disk after
    the write itself succeeded: the write is kept, the records stay where they are, and the next
    write once there is room compacts."""
    fs = FullDisk(["write"], after=1)  # the write's own pack fits, compaction's copy does not
    store = ChunkStore(tmp_path, ChunkStoreConfig(max_packs=2), fingerprint=FP, fs=fs)
    store.write(KEY, 0, enc(0), 0)
    store.write(KEY, 2, enc(2), 32)
    fs.full = True
    meta = store.write(KEY, 4, enc(4), 64)
    assert store.check(KEY, 4).checksum == meta.checksum and store.compactions == 0
    assert len(store.files(KEY)) == 3 and leftovers(store) == []
    assert [c.payload.tobytes() for c in read_all(store, KEY, [0, 2, 4])] == [
        enc(i).payload.tobytes() for i in (0, 2, 4)]
    fs.full = False
    store.write(KEY, 6, enc(6), 96)
    assert store.compactions == 1 and len(store.files(KEY)) <= 2
    assert payloads(store) == {i: enc(i).payload.tobytes() for i in (0, 2, 4, 6)}


# ---- the registry ---------------------------------------------------------------------------------


def fill(reg: Registry) -> None:
    """Make the registry's database full for real: no page may be added (`max_page_count`), and the
    free pages are taken by a filler table. What fits in the pages' free space still fits."""
    db = reg._db
    db.execute("CREATE TABLE IF NOT EXISTS filler (b BLOB)")
    db.execute(f"PRAGMA max_page_count={db.execute('PRAGMA page_count').fetchone()[0] + 8}")
    with pytest.raises(sqlite3.OperationalError, match="full"):
        while True:
            db.execute("INSERT INTO filler VALUES (zeroblob(1000))")


def make_room(reg: Registry) -> None:
    """Space comes back: the filler rows go (their pages become free pages)."""
    reg._db.execute("DELETE FROM filler")


def test_a_registry_on_a_full_disk_raises_disk_full_rolls_back_and_recovers(tmp_path):
    reg = Registry(str(tmp_path / "registry.db"))
    reg.create_app("app")
    ctx = reg.create_context("app", "You are terse.")
    reg.save_state(ctx, [1, 2, 3], "one two three", '{"turns": []}', b"d")
    other = reg.create_context("app")
    fill(reg)
    big = np.arange(4000, dtype=np.int32)  # needs pages the database may not add
    with pytest.raises(DiskFullError) as e:
        reg.save_state(ctx, big, "x" * 8000, '{"turns": ["long"]}', b"d" * 4000)
    assert e.value.code == "disk_full" and "database or disk is full" in str(e.value)
    assert not reg._db.in_transaction
    rec = reg.get_context(ctx)
    assert list(rec.token_ids) == [1, 2, 3] and rec.text == "one two three"
    assert reg.load_state(ctx) == ('{"turns": []}', b"d")
    with pytest.raises(DiskFullError):
        reg.create_context("app", "y" * 20000)
    reg.touch(ctx)  # the next transaction works (nothing was left open)
    reg.delete_context(other)  # deleting frees pages: it works while full
    assert [c.id for c in reg.list_contexts("app")] == [ctx]
    make_room(reg)
    reg.save_state(ctx, big, "x" * 8000, '{"turns": ["long"]}', b"d" * 4000)
    assert np.array_equal(reg.get_context(ctx).token_ids, big)
    assert reg._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    reg.close()


class FullAtCommit:
    """A connection whose COMMIT fails for want of space, as SQLite's does when the WAL cannot grow
    (an injected error; the statement-level case above is real). `rolled_back`: whether SQLite has
    ended the transaction itself (what it does on SQLITE_FULL) or left it open."""

    def __init__(self, db: sqlite3.Connection, rolled_back: bool,
                 error: tuple[int, str, str] = (13, "SQLITE_FULL", "database or disk is full")):
        self.db, self.rolled_back, self.full, self.error = db, rolled_back, True, error

    def __getattr__(self, name):
        return getattr(self.db, name)

    def execute(self, sql, *args):
        if sql == "COMMIT" and self.full:
            if self.rolled_back:
                self.db.execute("ROLLBACK")
            code, name, message = self.error
            e = sqlite3.OperationalError(message)
            e.sqlite_errorcode, e.sqlite_errorname = code, name
            raise e
        return self.db.execute(sql, *args)


@pytest.mark.parametrize("rolled_back", [True, False])
def test_a_commit_on_a_full_disk_leaves_no_transaction_open(tmp_path, rolled_back):
    reg = Registry(str(tmp_path / "registry.db"))
    reg.create_app("app")
    db = reg._db
    reg._db = conn = FullAtCommit(db, rolled_back)
    with pytest.raises(DiskFullError):
        reg.create_context("app")
    assert not db.in_transaction and reg.list_contexts("app") == []
    conn.full = False  # space comes back: the next transaction works
    ctx = reg.create_context("app")
    assert [c.id for c in reg.list_contexts("app")] == [ctx]
    reg._db = db
    reg.close()


@pytest.mark.parametrize("free, full", [(0, True), (1 << 30, False)])
def test_an_io_error_on_a_full_file_system_is_disk_full(tmp_path, monkeypatch, free, full):
    """SQLite may report a write that met ENOSPC in its WAL as SQLITE_IOERR_WRITE ("disk I/O error"),
    not SQLITE_FULL: with the registry's file system full that is disk_full too, otherwise it stays
    what it is. (Injected: the error and the free space; the case above is real.)"""
    import shutil

    from storage import registry as registry_module

    reg = Registry(str(tmp_path / "registry.db"))
    reg.create_app("app")
    db = reg._db
    reg._db = FullAtCommit(db, rolled_back=True, error=(10 | (3 << 8), "SQLITE_IOERR_WRITE", "disk I/O error"))
    real = shutil.disk_usage
    monkeypatch.setattr(registry_module.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=free) if str(p) == str(tmp_path) else real(p))
    with pytest.raises(DiskFullError if full else sqlite3.OperationalError, match="disk I/O error"):
        reg.create_context("app")
    assert not db.in_transaction and reg.list_contexts("app") == []
    reg._db = db
    reg.close()


def test_other_sqlite_errors_stay_what_they_are(tmp_path):
    reg = Registry(str(tmp_path / "registry.db"))
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        with reg.transaction():
            reg._q("SELECT * FROM nothing_here")
    reg.create_app("app")  # and the registry goes on
    reg.close()
