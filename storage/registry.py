"""The context registry: apps, contexts (token ids and text) and chunk states, in embedded SQLite.

This module deliberately knows nothing about policies (which chunk to evict or compress: the
memory governor decides and calls ``mark_chunks``), nor about KV data: it records who owns what and
where it is. Timestamps come from the injected ``clock`` (seconds).

The database runs in WAL mode with ``synchronous=FULL``: a committed transaction survives a crash
of the process (and of the machine), and reopening after a crash gives the state of the last
committed transaction (one exception: eviction rows a restart discards anyway, written by
:meth:`Registry.upsert_chunks` with ``durable=False``). Every public method is one transaction
(``BEGIN IMMEDIATE`` ... ``COMMIT``); ``with registry.transaction():`` groups several into one,
all-or-nothing. A transaction that finds the disk full (SQLite's ``SQLITE_FULL``, "database or disk
is full") is rolled back and raises DiskFullError; the connection is left with no transaction open,
so the next one works as soon as there is room again.

Tables::

    apps      name PK, token_sha256 UNIQUE (the token itself is never stored), created, adapter
              (the LoRA adapter its contexts default to)
    contexts  id PK (server-made opaque hex), app -> apps, system_prompt, tokens (int32 LE blob),
              text, created, last_used, adapter (key of the LoRA adapter it is computed under)
    adapters  name PK, path (under the adapter root), key (name@digest), created
    chunks    (context -> contexts, idx) PK, state, level, file, checksum, nbytes, density, last_use

Chunk states: ``resident`` (in the memory pool only), ``swapped`` (in a file only), ``both``
(resident with a clean copy in a file), ``missing`` (neither: recompute it from the token ids).
Rows in ``swapped``/``both`` name their file and its checksum; the others name none.

Protocol with the chunk store (what makes crashes safe): write the chunk file first, then commit its
row. So a file is always as new as its row or newer; :meth:`Registry.verify` adopts a valid newer
file, marks rows whose file is missing or corrupt for recompute, and lists files no row names.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from storage.chunkstore import ChunkStore
from storage.records import (AdapterRow, ChunkRecord, ChunkRow, ChunkState, ContextRecord, ContextSummary,
                             RegistryConfig, VerifyReport)
from storage.codecs import codec
from storage.errors import (AdapterExistsError, AdapterInUseError, AppExistsError, ChunkNotFoundError,
                            ContextLimitError, DiskFullError, InvalidKeyError, RegistryError, StorageError,
                            UnknownAdapterError, UnknownAppError, UnknownChunkError, UnknownContextError)

SCHEMA_VERSION = 3
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS apps (
    name TEXT PRIMARY KEY,
    token_sha256 TEXT NOT NULL UNIQUE,
    created REAL NOT NULL,
    adapter TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS contexts (
    id TEXT PRIMARY KEY,
    app TEXT NOT NULL REFERENCES apps(name) ON DELETE CASCADE,
    system_prompt TEXT NOT NULL,
    tokens BLOB NOT NULL,
    text TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    adapter TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS contexts_by_app ON contexts(app, created);
CREATE TABLE IF NOT EXISTS adapters (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    key TEXT NOT NULL,
    created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (
    context TEXT NOT NULL REFERENCES contexts(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL CHECK (idx >= 0),
    state TEXT NOT NULL CHECK (state IN ('resident', 'swapped', 'both', 'missing')),
    level TEXT NOT NULL,
    file TEXT,
    checksum TEXT,
    nbytes INTEGER NOT NULL DEFAULT 0,
    density REAL NOT NULL DEFAULT 0,
    last_use REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0 CHECK (pinned IN (0, 1)),
    CHECK ((state IN ('swapped', 'both')) = (file IS NOT NULL)),
    PRIMARY KEY (context, idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS context_state (
    context TEXT PRIMARY KEY REFERENCES contexts(id) ON DELETE CASCADE,
    state TEXT NOT NULL,
    density BLOB NOT NULL);
"""


def new_token() -> str:
    """A bearer token: 256 random bits, URL-safe, behind a fixed prefix. The prefix makes tokens
    recognisable and keeps them from starting with '-' (a bare `token_urlsafe` does one time in 64,
    and `llmaas ... --token -xyz` is then read as a missing argument)."""
    return "llmaas_" + secrets.token_urlsafe(32)


def _token_blob(ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError("token ids must be a 1-D sequence of ints")
    if arr.size and (arr.min() < 0 or arr.max() > 2**31 - 1):
        raise ValueError("token ids must lie in [0, 2^31)")
    return arr.astype("<i4").tobytes()


def _tokens(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, "<i4")


SQLITE_FULL = 13
"""SQLite's primary result code for "database or disk is full": a write met ENOSPC, or the database
reached ``max_page_count`` (``sqlite3.SQLITE_FULL``)."""


SQLITE_IOERR = 10
"""SQLite's primary result code for an I/O error. A write that meets ENOSPC in the WAL or a journal
can surface as this ("disk I/O error") instead of SQLITE_FULL."""
FULL_BYTES = 1 << 20
"""Free bytes below which the file system counts as full when SQLite reports an I/O error."""


@contextlib.contextmanager
def _disk_full(directory: str) -> Iterator[None]:
    """Raise DiskFullError for a SQLite error whose (primary) result code is SQLITE_FULL, or
    SQLITE_IOERR while the file system holding `directory` has less than FULL_BYTES free."""
    try:
        yield
    except sqlite3.Error as e:
        code = getattr(e, "sqlite_errorcode", None)  # extended code; None when not raised by SQLite
        full = code & 0xFF == SQLITE_FULL if code is not None else "disk is full" in str(e)
        if not full and code is not None and code & 0xFF == SQLITE_IOERR:
            with contextlib.suppress(OSError):
                full = shutil.disk_usage(directory).free < FULL_BYTES
        if not full:
            raise
        raise DiskFullError(f"the registry's file system is full (SQLite: {e}); the transaction was "
                            "rolled back; free space (delete contexts) and retry") from e


class Registry:
    """Apps, contexts and chunk rows in one SQLite file. Thread-safe (one connection, one lock)."""

    def __init__(self, path: str, clock: Callable[[], float] = time.time,
                 config: RegistryConfig | None = None):
        self.config = config or RegistryConfig()
        self._clock = clock
        self._lock = threading.RLock()
        self._depth = 0  # nesting of transaction()
        self._dir = os.path.dirname(os.path.abspath(path))
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                   timeout=self.config.busy_timeout_s)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        with self.transaction():
            for statement in _SCHEMA.split(";"):  # executescript would COMMIT our transaction
                if statement.strip():
                    self._db.execute(statement)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) in (1, 2):
                if int(row[0]) == 1:  # schema 1 had no pinned-exact flag: every chunk unpinned
                    self._db.execute("ALTER TABLE chunks ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0 "
                                     "CHECK (pinned IN (0, 1))")
                # schema 2 had no adapters: every app and context on the base model
                self._db.execute("ALTER TABLE apps ADD COLUMN adapter TEXT NOT NULL DEFAULT ''")
                self._db.execute("ALTER TABLE contexts ADD COLUMN adapter TEXT NOT NULL DEFAULT ''")
                self._db.execute("UPDATE meta SET value=? WHERE key='schema'", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise RegistryError(f"registry schema {row[0]}; this code reads {SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def transaction(self, durable: bool = True) -> Iterator[None]:
        """All-or-nothing: commits when the block ends, rolls back on any exception. Nests (an
        inner block joins the outer one and its durability).

        ``durable=False`` commits without waiting for the disk (``synchronous=NORMAL`` for this
        transaction): still atomic, and never corrupts, but a power loss may undo it until the
        next durable commit. Only for changes a restart discards anyway (see
        :meth:`upsert_chunks`)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            if not durable:
                self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                with _disk_full(self._dir):
                    self._db.execute("BEGIN IMMEDIATE")
                    self._depth = 1
                    try:
                        yield
                        self._db.execute("COMMIT")
                    except BaseException:
                        self._rollback()
                        raise
                    finally:
                        self._depth = 0
            finally:
                if not durable:
                    self._db.execute("PRAGMA synchronous=FULL")

    def _rollback(self) -> None:
        """End a failed transaction. SQLite has already rolled back the whole transaction after some
        errors (SQLITE_FULL, in a statement or at COMMIT), and a second ROLLBACK would hide the error;
        one that fails leaves nothing better to do than to report the first error."""
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def _q(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        return self._db.execute(sql, args)

    # -- apps ----------------------------------------------------------------------------------------

    @staticmethod
    def _hash(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def create_app(self, name: str, adapter: str = "") -> str:
        """Register an app and return its bearer token (only its sha256 is stored). `adapter`: the
        name of a recorded LoRA adapter the app's contexts are computed under unless they name
        another ("" for the base model)."""
        if not isinstance(name, str) or not 1 <= len(name) <= 128 or not name.isprintable():
            raise InvalidKeyError("app name must be 1-128 printable characters")
        token = new_token()
        with self.transaction():
            if adapter and self._q("SELECT 1 FROM adapters WHERE name=?", (adapter,)).fetchone() is None:
                raise UnknownAdapterError(f"no adapter named {adapter!r} is loaded")
            try:
                self._q("INSERT INTO apps VALUES (?, ?, ?, ?)", (name, self._hash(token), self._clock(), adapter))
            except sqlite3.IntegrityError:
                raise AppExistsError(f"app {name!r} exists") from None
        return token

    def app_adapter(self, name: str) -> str:
        """The adapter an app's contexts default to ("" for the base model)."""
        with self._lock:
            row = self._q("SELECT adapter FROM apps WHERE name=?", (name,)).fetchone()
        if row is None:
            raise UnknownAppError(f"no app {name!r}")
        return row[0]

    def app_for_token(self, token: str) -> str:
        """The name of the app holding ``token``; UnknownAppError otherwise."""
        if not isinstance(token, str):
            raise UnknownAppError("unknown token")
        with self._lock:
            row = self._q("SELECT name FROM apps WHERE token_sha256=?", (self._hash(token),)).fetchone()
        if row is None:
            raise UnknownAppError("unknown token")
        return row[0]

    def apps(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._q("SELECT name FROM apps ORDER BY name")]

    def delete_app(self, name: str) -> list[str]:
        """Delete an app, its contexts and chunk rows; returns the chunk files to delete."""
        with self.transaction():
            files = [r[0] for r in self._q(
                "SELECT c.file FROM chunks c JOIN contexts x ON c.context = x.id "
                "WHERE x.app=? AND c.file IS NOT NULL", (name,))]
            if self._q("DELETE FROM apps WHERE name=?", (name,)).rowcount == 0:
                raise UnknownAppError(f"no app {name!r}")
        return files

    # -- contexts ------------------------------------------------------------------------------------

    def create_context(self, app: str, system_prompt: str = "", adapter: str = "") -> str:
        """Create an empty context owned by ``app``, computed under the LoRA adapter of key ``adapter``
        ("" for the base model; it never changes); returns its id (32 hex digits)."""
        ctx = secrets.token_hex(16)
        now = self._clock()
        with self.transaction():
            if self._q("SELECT 1 FROM apps WHERE name=?", (app,)).fetchone() is None:
                raise UnknownAppError(f"no app {app!r}")
            limit = self.config.max_contexts_per_app
            if limit and self._q("SELECT COUNT(*) FROM contexts WHERE app=?",
                                 (app,)).fetchone()[0] >= limit:
                raise ContextLimitError(f"app {app!r} already holds {limit} contexts")
            self._q("INSERT INTO contexts VALUES (?, ?, ?, ?, '', ?, ?, ?)",
                    (ctx, app, system_prompt, b"", now, now, adapter))
        return ctx

    def _ctx_row(self, ctx: str, app: str | None, cols: str) -> tuple:
        row = self._q(f"SELECT app, {cols} FROM contexts WHERE id=?", (ctx,)).fetchone()
        if row is None or (app is not None and row[0] != app):
            raise UnknownContextError("unknown context")  # another app's context looks the same
        return row

    def get_context(self, ctx: str, app: str | None = None) -> ContextRecord:
        """The context ``ctx`` (and, when ``app`` is given, only if that app owns it)."""
        with self._lock:
            row = self._ctx_row(ctx, app, "system_prompt, tokens, text, created, last_used, adapter")
        return ContextRecord(ctx, row[0], row[1], _tokens(row[2]), row[3], row[4], row[5], row[6])

    def list_contexts(self, app: str) -> list[ContextSummary]:
        """The app's contexts, oldest first."""
        with self._lock:
            rows = self._q("SELECT id, app, length(tokens) / 4, created, last_used, adapter FROM contexts "
                           "WHERE app=? ORDER BY created, id", (app,)).fetchall()
        return [ContextSummary(*r) for r in rows]

    def touch(self, ctx: str) -> None:
        """Record a use of the context now."""
        with self.transaction():
            if self._q("UPDATE contexts SET last_used=? WHERE id=?",
                       (self._clock(), ctx)).rowcount == 0:
                raise UnknownContextError("unknown context")

    def append_tokens(self, ctx: str, ids: Sequence[int] | np.ndarray, text: str) -> int:
        """Append token ids and their text to the context; returns the new length (tokens)."""
        blob = _token_blob(ids)
        with self.transaction():
            row = self._ctx_row(ctx, None, "tokens, text")
            tokens = row[1] + blob
            self._q("UPDATE contexts SET tokens=?, text=?, last_used=? WHERE id=?",
                    (tokens, row[2] + text, self._clock(), ctx))
        return len(tokens) // 4

    def set_tokens(self, ctx: str, ids: Sequence[int] | np.ndarray, text: str) -> list[str]:
        """Replace the context's tokens and text.

        Chunk rows from the first changed token on no longer describe the context: they are
        deleted, and their chunk files are returned for the caller to delete.
        """
        blob = _token_blob(ids)
        with self.transaction():
            old = self._ctx_row(ctx, None, "tokens")[1]
            n = min(len(old), len(blob)) // 4
            a, b = _tokens(old)[:n], _tokens(blob)[:n]
            diff = np.flatnonzero(a != b)
            same = int(diff[0]) if diff.size else n
            if len(blob) < len(old) or diff.size:
                first_stale = same // self.config.chunk_tokens
            else:
                first_stale = None
            files: list[str] = []
            if first_stale is not None:
                files = [r[0] for r in self._q(
                    "SELECT file FROM chunks WHERE context=? AND idx>=? AND file IS NOT NULL",
                    (ctx, first_stale))]
                self._q("DELETE FROM chunks WHERE context=? AND idx>=?", (ctx, first_stale))
            self._q("UPDATE contexts SET tokens=?, text=?, last_used=? WHERE id=?",
                    (blob, text, self._clock(), ctx))
        return files

    def save_state(self, ctx: str, ids: Sequence[int] | np.ndarray, text: str, state: str,
                   density: bytes = b"") -> list[str]:
        """Commit a call's outcome in one transaction: the token ids and text (as ``set_tokens``,
        returning stale chunk files) and the executor's opaque per-context state (a JSON string:
        conversation turns, how many tokens have K/V) with its density blob."""
        if not isinstance(state, str) or not isinstance(density, (bytes, bytearray)):
            raise ValueError("state must be a str and density bytes")
        with self.transaction():
            files = self.set_tokens(ctx, ids, text)
            self._q("INSERT OR REPLACE INTO context_state VALUES (?, ?, ?)", (ctx, state, bytes(density)))
        return files

    def load_state(self, ctx: str) -> tuple[str, bytes] | None:
        """The state saved by ``save_state`` (None for a context that never completed a call)."""
        with self._lock:
            self._ctx_row(ctx, None, "id")
            row = self._q("SELECT state, density FROM context_state WHERE context=?", (ctx,)).fetchone()
        return (row[0], bytes(row[1])) if row else None

    def delete_context(self, ctx: str, app: str | None = None) -> list[str]:
        """Delete a context and its chunk rows; returns the chunk files to delete."""
        with self.transaction():
            self._ctx_row(ctx, app, "id")
            files = [r[0] for r in self._q(
                "SELECT file FROM chunks WHERE context=? AND file IS NOT NULL", (ctx,))]
            self._q("DELETE FROM contexts WHERE id=?", (ctx,))
        return files

    # -- adapters ------------------------------------------------------------------------------------

    def add_adapter(self, name: str, path: str, key: str) -> None:
        """Record a loaded adapter (the node loads it again at start)."""
        with self.transaction():
            if self._q("SELECT 1 FROM adapters WHERE name=?", (name,)).fetchone() is not None:
                raise AdapterExistsError(f"adapter {name!r} is already loaded")
            self._q("INSERT INTO adapters VALUES (?, ?, ?, ?)", (name, path, key, self._clock()))

    def adapters(self) -> list[AdapterRow]:
        with self._lock:
            return [AdapterRow(*r) for r in self._q("SELECT name, path, key, created FROM adapters ORDER BY name")]

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter; refused while a context is computed under it."""
        with self.transaction():
            row = self._q("SELECT key FROM adapters WHERE name=?", (name,)).fetchone()
            if row is None:
                raise UnknownAdapterError(f"no adapter named {name!r} is loaded")
            n = self._q("SELECT COUNT(*) FROM contexts WHERE adapter=?", (row[0],)).fetchone()[0]
            if n:
                raise AdapterInUseError(f"adapter {name!r} is in use by {n} context(s); delete them first")
            apps = [r[0] for r in self._q("SELECT name FROM apps WHERE adapter=?", (name,))]
            if apps:
                raise AdapterInUseError(f"adapter {name!r} is the default of app(s) {apps}; delete them first")
            self._q("DELETE FROM adapters WHERE name=?", (name,))

    # -- chunks --------------------------------------------------------------------------------------

    def upsert_chunk(self, ctx: str, index: int, *, state: ChunkState | str, level: str,
                     file: str | None = None, checksum: str | None = None, nbytes: int = 0,
                     density: float | None = None) -> ChunkRecord:
        """Insert or replace one chunk row (density kept when None); last_use is now."""
        return self.upsert_chunks(ctx, [ChunkRow(index, state, level, file, checksum, nbytes, density)])[0]

    def upsert_chunks(self, ctx: str, rows: Iterable[ChunkRow], durable: bool = True) -> list[ChunkRecord]:
        """Insert or replace chunk rows of one context in one transaction (all or none); a row's
        density is kept when None (0 for a new row); last_use is now.

        Why a batch: the governor rewrites a context's rows when it evicts from it, inside a switch;
        one statement per row, each with its own context check, costs time that adds up per row.
        ``durable=False`` (see :meth:`transaction`) is for evictions that write no file: they turn
        ``both`` into ``swapped`` and ``resident`` into ``missing``, which is also what
        :meth:`drop_resident` makes of the old rows after a restart, so losing them loses nothing;
        it saves an fsync inside a switch.
        """
        now = self._clock()
        args, out = [], []
        for r in rows:
            state = ChunkState(r.state)
            codec(r.level)  # UnknownCodecError lists the valid names
            if state.on_disk != (r.file is not None) or (r.file is None) != (r.checksum is None):
                raise ValueError(f"state {state.value} {'needs' if state.on_disk else 'takes no'} "
                                 "file and checksum")
            if type(r.index) is not int or r.index < 0:
                raise InvalidKeyError("chunk index must be an int >= 0")
            nbytes = r.nbytes if r.file else 0
            density = None if r.density is None else float(r.density)
            args.append((ctx, r.index, state.value, r.level, r.file, r.checksum, nbytes, density,
                         ctx, r.index, now, int(bool(r.pinned))))
            out.append(ChunkRecord(ctx, r.index, state, r.level, r.file, r.checksum, nbytes,
                                   density, now, bool(r.pinned)))
        with self.transaction(durable):
            self._ctx_row(ctx, None, "id")
            self._db.executemany(
                "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, COALESCE(?, (SELECT "
                "density FROM chunks WHERE context=? AND idx=?), 0.0), ?, ?)", args)
            kept = [i for i, rec in enumerate(out) if rec.density is None]
            for i in kept:  # the stored densities, for the records returned
                out[i] = self._record(self._q("SELECT * FROM chunks WHERE context=? AND idx=?",
                                              (ctx, out[i].index)).fetchone())
        return out

    def chunks(self, ctx: str) -> list[ChunkRecord]:
        """Chunk rows of a context by index."""
        with self._lock:
            rows = self._q("SELECT * FROM chunks WHERE context=? ORDER BY idx", (ctx,)).fetchall()
        return [self._record(r) for r in rows]

    def chunk(self, ctx: str, index: int) -> ChunkRecord:
        with self._lock:
            r = self._q("SELECT * FROM chunks WHERE context=? AND idx=?", (ctx, index)).fetchone()
        if r is None:
            raise UnknownChunkError(f"no chunk {index} of context {ctx}")
        return self._record(r)

    @staticmethod
    def _record(r: tuple) -> ChunkRecord:
        return ChunkRecord(r[0], r[1], ChunkState(r[2]), *r[3:9], bool(r[9]))

    def mark_chunks(self, ctx: str, indices: Iterable[int], state: ChunkState | str, *,
                    level: str | None = None, density: float | None = None,
                    touch: bool = False) -> list[str]:
        """Set the state (and optionally level/density/last use) of several chunks at once.

        Moving to a state without a file (resident, missing) clears file, checksum and nbytes and
        returns the dropped file names for the caller to delete. Moving to ``swapped``/``both``
        keeps the row's file and is refused for a row without one. Unknown indices raise
        UnknownChunkError and change nothing.
        """
        state = ChunkState(state)
        if level is not None:
            codec(level)
        dropped: list[str] = []
        with self.transaction():
            for i in indices:
                r = self._q("SELECT file FROM chunks WHERE context=? AND idx=?", (ctx, i)).fetchone()
                if r is None:
                    raise UnknownChunkError(f"no chunk {i} of context {ctx}")
                if state.on_disk and r[0] is None:
                    raise ValueError(f"chunk {i} has no file; write it with upsert_chunk")
                if not state.on_disk and r[0] is not None:
                    dropped.append(r[0])
                sets, args = ["state=?"], [state.value]
                if not state.on_disk:
                    sets.append("file=NULL, checksum=NULL, nbytes=0")
                if level is not None:
                    sets.append("level=?")
                    args.append(level)
                if density is not None:
                    sets.append("density=?")
                    args.append(float(density))
                if touch:
                    sets.append("last_use=?")
                    args.append(self._clock())
                self._q(f"UPDATE chunks SET {', '.join(sets)} WHERE context=? AND idx=?",
                        (*args, ctx, i))
        return dropped

    def drop_resident(self) -> int:
        """After a restart nothing is in memory: resident -> missing, both -> swapped."""
        with self.transaction():
            n = self._q("UPDATE chunks SET state='missing' WHERE state='resident'").rowcount
            n += self._q("UPDATE chunks SET state='swapped' WHERE state='both'").rowcount
        return n

    # -- consistency with the chunk files ------------------------------------------------------------

    def verify(self, store: ChunkStore, *, deep: bool = True,
               tag_of: Callable[[str], str | None] | None = None) -> VerifyReport:
        """Check every row against its chunk file and repair the rows (one transaction).

        - the file is missing or fails its checks (``deep``: every payload byte is checksummed;
          otherwise header and size only): the row is marked for recompute
          (swapped -> missing, both -> resident; file cleared);
        - a valid file for the row's chunk with another checksum, or a valid file for a row that
          names none, is newer than the row (files are written before rows): the row adopts it;
        - files that no row names are listed in ``orphans`` (not deleted here).

        ``tag_of(context id)`` is the tag its records must carry (None: the store's fingerprint); a
        record with another tag counts as corrupt.
        """
        report = VerifyReport()
        ct = self.config.chunk_tokens
        with self.transaction():
            rows = self._q("SELECT context, idx, state, file, checksum FROM chunks").fetchall()
            named: set[str] = set()
            for ctx, idx, state, file, checksum in rows:
                state = ChunkState(state)
                name = store.file_name(ctx, idx)
                try:
                    meta = store.check(ctx, idx, deep=deep, tag=tag_of(ctx) if tag_of else None)
                except ChunkNotFoundError:
                    if state.on_disk:
                        report.checked += 1
                        report.missing.append((ctx, idx))
                        self._unfile(ctx, idx, state)
                    continue
                except StorageError as e:
                    report.checked += state.on_disk
                    named.add(name)  # a bad file of a known chunk is not an orphan
                    if state.on_disk:
                        report.corrupt.append((ctx, idx, e.code))
                        self._unfile(ctx, idx, state)
                    else:
                        report.orphans.append(name)
                    continue
                named.add(name)
                report.checked += state.on_disk
                h = meta.header
                if (state.on_disk and meta.checksum == checksum and file == name):
                    continue
                if h.token_start != idx * ct or h.token_end > (idx + 1) * ct:
                    report.corrupt.append((ctx, idx, "chunk_range"))
                    if state.on_disk:
                        self._unfile(ctx, idx, state)
                    continue
                new_state = {ChunkState.RESIDENT: ChunkState.BOTH,
                             ChunkState.MISSING: ChunkState.SWAPPED}.get(state, state)
                self._q("UPDATE chunks SET state=?, level=?, file=?, checksum=?, nbytes=? "
                        "WHERE context=? AND idx=?",
                        (new_state.value, h.level, name, meta.checksum, meta.nbytes, ctx, idx))
                report.adopted.append((ctx, idx))
            for key in store.contexts():
                for i in store.indices(key):
                    name = store.file_name(key, i)
                    if name not in named:
                        report.orphans.append(name)
        return report

    def _unfile(self, ctx: str, idx: int, state: ChunkState) -> None:
        new = ChunkState.RESIDENT if state is ChunkState.BOTH else ChunkState.MISSING
        self._q("UPDATE chunks SET state=?, file=NULL, checksum=NULL, nbytes=0 "
                "WHERE context=? AND idx=?", (new.value, ctx, idx))

