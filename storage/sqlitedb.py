"""Tables of one component in the registry's SQLite file, on a connection of their own: the knowledge
bank's (`storage.knowledge`) and the RAG store's (`storage.ragstore`). WAL, `synchronous=FULL`, foreign
keys on; every public method of a subclass is one transaction (`_transaction`: ``BEGIN IMMEDIATE`` to
write, ``BEGIN``, a snapshot, to read), and a full disk raises DiskFullError, as the registry does.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence

from storage.registry import _disk_full


class SqliteTables:
    def __init__(self, path: str, *, busy_timeout_s: float, schema: Sequence[str], meta: str, version: int,
                 error: type[Exception], what: str) -> None:
        """Open `path`, create `schema` (statements) and check the version row of the `meta` table
        (`error` with `what` in its message for another version)."""
        self._lock = threading.RLock()
        self._dir = os.path.dirname(os.path.abspath(path))
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s)
        for pragma in ("journal_mode=WAL", "synchronous=FULL", "foreign_keys=ON"):
            self._db.execute(f"PRAGMA {pragma}")
        with self._transaction(write=True):
            for statement in schema:
                self._db.execute(statement)
            row = self._q(f"SELECT value FROM {meta} WHERE key='schema'").fetchone()
            if row is None:
                self._q(f"INSERT INTO {meta} VALUES ('schema', ?)", (str(version),))
            elif int(row[0]) != version:
                raise error(f"{what} schema {row[0]}; this code reads {version}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _transaction(self, write: bool) -> Iterator[None]:
        """One transaction under the lock: ``BEGIN IMMEDIATE`` to write, ``BEGIN`` (a snapshot) to read.
        Commits at the end, rolls back on any exception; a full disk raises DiskFullError."""
        with self._lock, _disk_full(self._dir):
            self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise

    def _q(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        return self._db.execute(sql, args)
