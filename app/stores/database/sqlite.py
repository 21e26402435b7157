"""A SQLite file under ``NMT_DATA_DIR``, opened on first use, shared by every front-end process.

The default of every store (``app.stores.database.postgres`` is the one replicas share). As
``app.keys.usage``: WAL mode, so that readers never wait for a writer and several front-end
processes (``uvicorn --workers N``, containers sharing a volume) see one store; explicit
transactions, ``BEGIN IMMEDIATE`` for writes, so that a check ("this key has fewer than N
glossaries") and the write it allows are one atomic step across processes.

Opened on first use, not at start: a service that never stores a glossary never touches its data
directory (which may be read-only), and reads of a store that was never written find no file and
answer "nothing" without creating one. A file found absent is looked for again at most every
``ABSENT_RECHECK_S`` (a /translate request's memory lookup would otherwise ``stat`` it every time,
~5% of the front end's CPU per request), and at once after this process writes: another process's
first write is seen within that second.

Reads and writes have a connection each, each behind its own lock: writes run on a thread
(``asyncio.to_thread``) and may wait seconds for another process's write lock, while reads are
made from the event loop too (a /translate request's memory lookup), and must never wait for them.

Its schema is the store's migrations (``app.stores.database.migrations``), applied when the file is
opened, in a ``BEGIN IMMEDIATE`` transaction: the file's write lock, so that processes opening it at
once apply them once.

``StoreUnavailable``'s message names the file, for the operator's log; a client is answered
``unavailable``'s 503, which names no path.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from app.stores.database.errors import StoreUnavailable
from app.stores.database.migrations import Migration, current_version, latest, migrate

ABSENT_RECHECK_S = 1.0


class SqliteDatabase:
    dialect = "sqlite"

    def __init__(
        self, path: Path, store: str, migrations: Sequence[Migration], timeout_s: float = 5.0
    ) -> None:
        self.path = path
        self.store = store
        self.migrations = migrations
        self.timeout_s = timeout_s
        self._reader: sqlite3.Connection | None = None
        self._writer: sqlite3.Connection | None = None
        self._read_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._absent_until = 0.0  # (monotonic) until then the file is taken to be still absent

    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: transactions are begun and ended here, explicitly.
            db = sqlite3.connect(
                self.path, timeout=self.timeout_s, isolation_level=None, check_same_thread=False
            )
            try:
                db.execute("PRAGMA journal_mode=WAL")
                # Unlike the usage counts, these are the users' data: NORMAL keeps every commit
                # across a crash of the process, and in WAL mode costs no fsync per commit.
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute("PRAGMA foreign_keys=ON")
                self._migrate(db)
            except BaseException:
                db.close()
                raise
        except (OSError, sqlite3.Error) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise StoreUnavailable(f"cannot open {self.path}: {reason}") from e
        return db

    def _migrate(self, db: sqlite3.Connection) -> None:
        """The store's migrations past the file's version, under the file's write lock."""
        if current_version(db, self.store) >= latest(self.migrations):
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            migrate(db, self.store, self.migrations, "sqlite")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def exists(self) -> bool:
        """Whether anything was ever stored (the file is there)."""
        return self.path.exists()

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection | None]:
        """The connection for reads, or None when the file was never made (nothing stored yet)."""
        with self._read_lock:
            if self._reader is None:
                if self._absent():
                    yield None
                    return
                self._reader = self._open()
            try:
                yield self._reader
            except sqlite3.Error as e:
                raise StoreUnavailable(f"cannot read {self.path}: {e}") from e

    def _absent(self) -> bool:
        """Whether the file is still not there: looked for at most once per ABSENT_RECHECK_S."""
        now = time.monotonic()
        if now < self._absent_until:
            return True
        if self.path.exists():
            return False
        self._absent_until = now + ABSENT_RECHECK_S
        return True

    @contextmanager
    def writing(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (rolled back if the block raises)."""
        with self._write_lock:
            if self._writer is None:
                self._writer = self._open()
                self._absent_until = 0.0  # it exists now: the next read opens it
            db = self._writer
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:  # locked past the timeout by another process, disk full, ...
                raise StoreUnavailable(f"cannot write {self.path}: {e}") from e
            try:
                yield db
            except sqlite3.Error as e:
                db.execute("ROLLBACK")
                raise StoreUnavailable(f"cannot write {self.path}: {e}") from e
            except BaseException:
                db.execute("ROLLBACK")
                raise
            try:
                db.execute("COMMIT")
            except sqlite3.Error as e:
                db.execute("ROLLBACK")
                raise StoreUnavailable(f"cannot write {self.path}: {e}") from e

    def close(self) -> None:
        with self._read_lock, self._write_lock:
            for db in (self._reader, self._writer):
                if db is not None:
                    db.close()
            self._reader = self._writer = None
