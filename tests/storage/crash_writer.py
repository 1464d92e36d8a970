"""Writer process for the crash tests: forks one child per trial and stops it at a chosen step.

Run as ``python -m tests.storage.crash_writer ROOT DB``. It imports the storage layer once (and
reports whether torch or ray came along), then reads commands from stdin, one per line:

    chunk STEP SEED CTX  fork a child that writes chunk 0 of context CTX from
                      synthetic_kv(seed=SEED) and commits its registry row; the child prints ``AT STEP PID`` and blocks just
                      before STEP (or, for ``midwrite``, after writing half of the bytes)
    pack STEP SEED CTX   the same for chunks 0-2 written as one pack (write_many) and their three rows
    compact STEP SEED CTX  write chunk 3 of CTX (whose chunks 0-2 are in three packs of one chunk) in
                      a store with max_packs=3, so the write compacts the context; STEP is a step of
                      the compaction (COMPACT_STEPS), the chunk's own write runs through
    txn SEED          fork a child that commits one registry transaction (app ``committed-SEED``)
                      then prints ``AT txn PID`` and blocks inside a second one
    quit

The parent kills the child with SIGKILL; this process reaps it and prints ``REAPED STATUS``.
"""

from __future__ import annotations

import os
import sys
import time

from storage import codecs
from storage.chunkstore import ChunkStore, ChunkStoreConfig
from storage.fileops import FileOps
from storage.registry import Registry
from tests.storage.helpers import synthetic_kv

FP = "crash-test-model"
SHAPE = (4, 2, 1, 16, 8)
LEVEL = "q8"
STEPS = ("open", "midwrite", "fsync", "rename", "fsync_dir", "commit", "done")
# a compaction: its copy's steps, then the removal of the packs the copy replaced
COMPACT_STEPS = ("open", "midwrite", "fsync", "rename", "fsync_dir", "unlink", "unlink2", "commit", "done")
COMPACT_MAX_PACKS = 3


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def block(step: str) -> None:
    say(f"AT {step} {os.getpid()}")
    time.sleep(30)  # the parent kills us long before; never hang a test run if it does not
    os._exit(3)


class PausingOps(FileOps):
    """Real file operations that stop the process at one step of a chunk write."""

    def __init__(self, step: str, key: str):
        self.step, self.key = step, key

    def open(self, path, flags, mode=0o600):
        if self.step == "open" and path.endswith(".tmp"):
            block("open")
        return super().open(path, flags, mode)

    def write(self, fd, buffers):
        if self.step == "midwrite":
            data = b"".join(bytes(b) for b in buffers)
            os.write(fd, data[: len(data) // 2])
            block("midwrite")
        return super().write(fd, buffers)

    def fsync(self, fd):
        if self.step == "fsync":
            block("fsync")
        super().fsync(fd)

    def rename(self, src, dst):
        if self.step == "rename":
            block("rename")
        super().rename(src, dst)

    def fsync_dir(self, path):
        if self.step == "fsync_dir" and os.path.basename(path) == self.key:
            block("fsync_dir")
        super().fsync_dir(path)


class CompactPausingOps(PausingOps):
    """Stops at one step of the compaction that follows a chunk write: armed once the write's own
    folder fsync is done; ``unlink``/``unlink2`` stop before the first/second pack removal."""

    def __init__(self, step: str, key: str):
        super().__init__("-", key)
        self.target, self.unlinks = step, 0

    def fsync_dir(self, path):
        super().fsync_dir(path)
        if self.step == "-" and os.path.basename(path) == self.key:
            self.step = self.target  # the chunk write is durable; the compaction comes next

    def unlink(self, path):
        if path.endswith(".kvp"):
            self.unlinks += 1
            if self.step == ("unlink" if self.unlinks == 1 else "unlink2" if self.unlinks == 2 else ""):
                block(self.step)
        super().unlink(path)


def encoded(seed: int, n: int) -> list[tuple[int, codecs.EncodedChunk, int]]:
    """Chunks 0..n-1 of one version (seeds seed, seed + 10, ...), as write_many takes them."""
    return [(i, codecs.encode(synthetic_kv(SHAPE, seed=seed + 10 * i), LEVEL), 16 * i) for i in range(n)]


def write_chunks(root: str, db: str, step: str, seed: int, key: str, n: int) -> None:
    store = ChunkStore(root, fingerprint=FP, fs=PausingOps(step, key))
    reg = Registry(db)
    metas = store.write_many(key, encoded(seed, n))
    with reg.transaction():
        for i, meta in enumerate(metas):
            reg.upsert_chunk(key, i, state="swapped", level=LEVEL, file=meta.name,
                             checksum=meta.checksum, nbytes=meta.nbytes)
        if step == "commit":
            block("commit")
    if step == "done":
        block("done")


def write_and_compact(root: str, db: str, step: str, seed: int, key: str) -> None:
    store = ChunkStore(root, ChunkStoreConfig(max_packs=COMPACT_MAX_PACKS), fingerprint=FP,
                       fs=CompactPausingOps(step, key))
    reg = Registry(db)
    _, enc, start = encoded(seed, 4)[3]
    meta = store.write(key, 3, enc, start)
    with reg.transaction():
        reg.upsert_chunk(key, 3, state="swapped", level=LEVEL, file=meta.name,
                         checksum=meta.checksum, nbytes=meta.nbytes)
        if step == "commit":
            block("commit")
    if step == "done":
        block("done")


def registry_txn(db: str, seed: int) -> None:
    reg = Registry(db)
    with reg.transaction():
        reg.create_app(f"committed-{seed}")
    with reg.transaction():
        reg.create_app(f"torn-{seed}")
        ctx = reg.create_context(f"committed-{seed}", "system")
        reg.append_tokens(ctx, list(range(100)), "text")
        block("txn")


def main(root: str, db: str) -> None:
    heavy = sorted(m for m in ("torch", "ray") if m in sys.modules)
    say(f"READY heavy={','.join(heavy) or '-'}")
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        pid = os.fork()
        if pid == 0:
            try:
                if cmd[0] in ("chunk", "pack"):
                    write_chunks(root, db, cmd[1], int(cmd[2]), cmd[3], 1 if cmd[0] == "chunk" else 3)
                elif cmd[0] == "compact":
                    write_and_compact(root, db, cmd[1], int(cmd[2]), cmd[3])
                else:
                    registry_txn(db, int(cmd[1]))
                say("FINISHED")  # only if no step stopped us: the parent treats it as a failure
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        say(f"REAPED {status}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
