"""Crash safety: a writer process killed with SIGKILL at every step of a chunk write, and mid-transaction.

The writer (tests/storage/crash_writer.py) imports the storage layer but not torch; it forks one
child per trial and the child stops at a known step; this test kills it there and reopens the store
and the registry as a restarted service would.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from storage import codecs
from storage.chunkstore import ChunkStore, ChunkStoreConfig
from storage.registry import ChunkState, Registry
from tests.storage import crash_writer
from tests.storage.helpers import read_all, read_one

REPO = Path(__file__).resolve().parents[2]
TRIALS = 20
OLD, NEW = 1, 2  # seeds of the two versions of the chunk


class Writer:
    """The crash_writer process, with line reads that have a deadline."""

    def __init__(self, root: Path, db: Path):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.storage.crash_writer", str(root), str(db)],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.buf = b""

    def line(self, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                raise TimeoutError(f"no line from the writer within {timeout} s")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise EOFError("writer exited")
            self.buf += chunk
        out, self.buf = self.buf.split(b"\n", 1)
        return out.decode()

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd.encode() + b"\n")

    def kill_at(self, cmd: str, step: str) -> None:
        """Run one trial and SIGKILL the child when it reports ``step``."""
        self.send(cmd)
        at, got, pid = self.line().split()
        assert (at, got) == ("AT", step)
        os.kill(int(pid), signal.SIGKILL)
        reaped, status = self.line().split()
        assert reaped == "REAPED" and os.WIFSIGNALED(int(status))
        assert os.WTERMSIG(int(status)) == signal.SIGKILL

    def close(self) -> None:
        try:
            self.send("quit")
            self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def writer(tmp_path):
    w = Writer(tmp_path / "chunks", tmp_path / "registry.db")
    assert w.line(timeout=60) == "READY heavy=-"  # storage pulled in neither torch nor ray
    yield w
    w.close()


def encoded(seed: int) -> codecs.EncodedChunk:
    return crash_writer.encoded(seed, 1)[0][1]


def install_old_version(root: Path, db: Path) -> tuple[str, str]:
    """Write the old chunk file and commit its row (the state before each trial).

    Returns (context id, checksum of the old file).
    """
    store = ChunkStore(root, fingerprint=crash_writer.FP)
    with Registry(str(db)) as reg:
        if "crash-app" not in reg.apps():
            reg.create_app("crash-app")
            ctx = reg.create_context("crash-app")
            reg.append_tokens(ctx, list(range(16)), "sixteen tokens")
        ctx = reg.list_contexts("crash-app")[0].id
        meta = store.write(ctx, 0, encoded(OLD), 0)
        reg.upsert_chunk(ctx, 0, state="swapped", level=crash_writer.LEVEL, file=meta.name,
                         checksum=meta.checksum, nbytes=meta.nbytes)
    return ctx, meta.checksum


def test_kill_at_every_step_of_a_chunk_write(writer, tmp_path):
    root, db = tmp_path / "chunks", tmp_path / "registry.db"
    versions = {OLD: encoded(OLD).payload, NEW: encoded(NEW).payload}
    # after a kill before the rename the old file stands; from the rename on the new one does
    new_from = crash_writer.STEPS.index("fsync_dir")
    for step_no, step in enumerate(crash_writer.STEPS):
        for trial in range(TRIALS):
            ctx, old_sum = install_old_version(root, db)
            writer.kill_at(f"chunk {step} {NEW} {ctx}", step)

            store = ChunkStore(root, fingerprint=crash_writer.FP)  # reopen: removes stale temporaries
            left = [n for n in os.listdir(root / ctx) if n.endswith(".tmp")]
            assert left == [], (step, trial, left)
            payload = read_one(store, ctx, 0).payload
            expected = NEW if step_no >= new_from else OLD
            assert np.array_equal(payload, versions[expected]), (step, trial)
            assert not np.array_equal(payload, versions[OLD + NEW - expected])

            with Registry(str(db)) as reg:
                row = reg.chunk(ctx, 0)
                assert (row.checksum == old_sum) == (step != "done"), (step, trial)
                report = reg.verify(store)
                assert report.missing == [] and report.corrupt == [] and report.orphans == []
                assert report.adopted == ([(ctx, 0)] if step in ("fsync_dir", "commit") else [])
                row = reg.chunk(ctx, 0)
                assert row.state is ChunkState.SWAPPED
                assert row.checksum == store.check(ctx, 0, deep=False).checksum  # registry agrees
                assert store.usage_bytes() == os.path.getsize(store.path(ctx, 0))


def test_kill_at_every_step_of_a_pack_write(writer, tmp_path):
    """Three chunks written as one pack (a write-back): after a kill they are all old or all new,
    never a mix, and the pack they were in before is gone once the new one decides them."""
    root, db = tmp_path / "chunks", tmp_path / "registry.db"
    versions = {v: [e.payload for _, e, _ in crash_writer.encoded(v, 3)] for v in (OLD, NEW)}
    new_from = crash_writer.STEPS.index("fsync_dir")
    with Registry(str(db)) as reg:
        reg.create_app("crash-app")
        ctx = reg.create_context("crash-app")
        reg.append_tokens(ctx, list(range(48)), "48 tokens")
    for step_no, step in enumerate(crash_writer.STEPS):
        for trial in range(TRIALS // 2):
            store = ChunkStore(root, fingerprint=crash_writer.FP)
            with Registry(str(db)) as reg:
                for i, m in enumerate(store.write_many(ctx, crash_writer.encoded(OLD, 3))):
                    reg.upsert_chunk(ctx, i, state="swapped", level=crash_writer.LEVEL, file=m.name,
                                     checksum=m.checksum, nbytes=m.nbytes)
            writer.kill_at(f"pack {step} {NEW} {ctx}", step)

            store = ChunkStore(root, fingerprint=crash_writer.FP)
            got = read_all(store, ctx, range(3))
            expected = NEW if step_no >= new_from else OLD
            assert all(np.array_equal(g.payload, x) for g, x in zip(got, versions[expected])), (step, trial)
            names = os.listdir(root / ctx)
            assert not [n for n in names if n.endswith(".tmp")] and len(names) == 1, (step, trial, names)
            with Registry(str(db)) as reg:
                report = reg.verify(store)
                assert report.missing == [] and report.corrupt == [] and report.orphans == []
                assert {r.checksum for r in reg.chunks(ctx)} == {store.check(ctx, i, deep=False).checksum
                                                                  for i in range(3)}


def test_kill_at_every_step_of_a_compaction(writer, tmp_path):
    """A write that compacts its context, killed at each step of the compaction's copy and of the
    removal of the packs it replaced: every chunk reads back as written (the copy is verbatim),
    no temporary or superseded pack outlives a reopen, the registry agrees, and the store takes
    the next write."""
    root, db = tmp_path / "chunks", tmp_path / "registry.db"
    payloads = ([e.payload for _, e, _ in crash_writer.encoded(OLD, 4)][:3]
                + [crash_writer.encoded(NEW, 4)[3][1].payload])
    with Registry(str(db)) as reg:
        reg.create_app("crash-app")
    copied_from = crash_writer.COMPACT_STEPS.index("fsync_dir")  # from here on the copy exists
    for step_no, step in enumerate(crash_writer.COMPACT_STEPS):
        for trial in range(TRIALS // 4):  # each stop is deterministic; trials guard against luck
            store = ChunkStore(root, ChunkStoreConfig(max_packs=crash_writer.COMPACT_MAX_PACKS),
                               fingerprint=crash_writer.FP)
            with Registry(str(db)) as reg:  # a fresh context a trial: chunks 0-2 in a pack each
                ctx = reg.create_context("crash-app")
                reg.append_tokens(ctx, list(range(80)), "80 tokens")
                for i, enc, start in crash_writer.encoded(OLD, 4)[:3]:
                    m = store.write(ctx, i, enc, start)
                    reg.upsert_chunk(ctx, i, state="swapped", level=crash_writer.LEVEL, file=m.name,
                                     checksum=m.checksum, nbytes=m.nbytes)
                reg.upsert_chunk(ctx, 3, state="missing", level=crash_writer.LEVEL)
            assert len(store.files(ctx)) == 3 and store.compactions == 0
            writer.kill_at(f"compact {step} {NEW} {ctx}", step)

            store = ChunkStore(root, fingerprint=crash_writer.FP)  # reopen: removes stale temporaries
            got = read_all(store, ctx, range(4))
            assert all(np.array_equal(g.payload, x) for g, x in zip(got, payloads)), (step, trial)
            names = sorted(os.listdir(root / ctx))
            assert not [n for n in names if n.endswith(".tmp")], (step, trial, names)
            packs = [os.path.basename(q) for q in store.files(ctx)]
            assert names == packs, (step, trial, names, packs)  # every pack left decides a chunk
            # before the copy's rename the four packs stand; after it the copy and at most the one
            # pack the compaction kept (which one depends on the folder's listing order)
            assert len(packs) == 4 if step_no < copied_from else len(packs) <= 2, (step, trial, names)
            on_disk = sum(q.stat().st_size for q in root.rglob("*") if q.is_file())
            assert store.usage_bytes() == on_disk, (step, trial)
            with Registry(str(db)) as reg:
                report = reg.verify(store)
                assert report.missing == [] and report.corrupt == [] and report.orphans == []
                assert report.adopted == ([] if step == "done" else [(ctx, 3)]), (step, trial)
                assert [r.checksum for r in reg.chunks(ctx)] == [store.check(ctx, i, deep=False).checksum
                                                                for i in range(4)]
            _, enc, start = crash_writer.encoded(NEW, 5)[4]
            m = store.write(ctx, 4, enc, start)
            with Registry(str(db)) as reg:
                reg.upsert_chunk(ctx, 4, state="swapped", level=crash_writer.LEVEL, file=m.name,
                                 checksum=m.checksum, nbytes=m.nbytes)
            assert np.array_equal(read_one(store, ctx, 4).payload, enc.payload)
            assert all(np.array_equal(g.payload, x) for g, x in zip(read_all(store, ctx, range(4)), payloads))


def test_kill_in_the_middle_of_a_registry_transaction(writer, tmp_path):
    db = tmp_path / "registry.db"
    for seed in range(TRIALS):
        writer.kill_at(f"txn {seed}", "txn")
        with Registry(str(db)) as reg:  # reopening recovers the WAL: last committed state
            apps = reg.apps()
            assert f"committed-{seed}" in apps and f"torn-{seed}" not in apps
            assert reg.list_contexts(f"committed-{seed}") == []
            # and the database is writable again (no lock left by the dead process)
            reg.create_context(f"committed-{seed}")
    with Registry(str(db)) as reg:
        assert len(reg.apps()) == TRIALS
        assert reg._q("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_storage_imports_neither_torch_nor_ray():
    code = ("import sys, storage.codecs, storage.chunkstore, storage.chunkformat, storage.registry, "
            "storage.errors, storage.fileops, storage.throttle; "
            "print(sorted(m for m in ('torch', 'ray', 'pickle') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                         text=True, timeout=60, check=True)
    assert "torch" not in out.stdout and "ray" not in out.stdout, out.stdout
    assert out.stdout.strip() in ("[]", "['pickle']")  # numpy may import pickle; storage never does
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert not {"torch", "ray"} & imported
