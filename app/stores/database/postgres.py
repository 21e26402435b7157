"""The stores in one PostgreSQL that every replica shares (``NMT_DATABASE_URL``).

``Postgres`` is the server: a pool of connections (psycopg's), opened at start, where a bad URL or
a server that does not answer is one line naming the setting (``DatabaseUnusable``). Each store
(jobs, glossaries, memories) has its ``PostgresDatabase`` on it, with the same ``reading()`` and
``writing()`` as a SQLite file (``app.stores.database.sqlite``), so that a store's queries are written
once: ``?`` placeholders, rewritten here as psycopg's ``%s``. Each store's migrations run at start
in one transaction holding an advisory lock (``app.stores.database.migrations``): replicas starting at
once migrate once.

A server lost while running is a ``StoreUnavailable`` for each call (a 503 with Retry-After for a
request; a job runner keeps its job and tries again), and ``down()`` says so for /health/ready,
from a probe every ``PROBE_S``. The probe also checks the pool's idle connections and replaces the
broken ones (a restarted server closes them all), so that within ``PROBE_S`` of the server being
back, requests find working ones; a connection is not checked each time it is taken (a round trip
that cost a quarter of a job poll's throughput, ``benchmarks.job_polls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg_pool

from app.stores.database.errors import StoreUnavailable
from app.stores.database.migrations import ADVISORY_LOCK, Migration, migrate

logger = logging.getLogger("uvicorn.error").getChild("nmt")

SETTING = "NMT_DATABASE_URL"
CONNECT_TIMEOUT_S = 5.0  # to open a connection, and to wait for one from the pool
POOL_SIZE = 10  # connections of one process at most: requests' threads, the job runner
PROBE_S = 2.0  # between checks of the server for /health/ready


class DatabaseUnusable(Exception):
    """NMT_DATABASE_URL names no server this process can use (the message says why, in one line)."""


@functools.lru_cache(maxsize=1024)
def _placeholders(sql: str) -> str:
    """``?`` (SQLite's placeholders, the ones the stores write) as psycopg's ``%s``; a literal
    ``%`` doubled. (No store writes a ``?`` inside a literal.)"""
    return sql.replace("%", "%%").replace("?", "%s")


class PgConnection:
    """A psycopg connection with sqlite3's ``execute``/``executemany`` (``?`` placeholders)."""

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self.connection = connection

    # (Any, as sqlite3's cursors are: a row is a tuple whose types the query says.)
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self.connection.execute(_placeholders(sql), params or None)

    def executemany(self, sql: str, params: Iterable[Sequence[Any]]) -> Any:
        cursor = self.connection.cursor()
        cursor.executemany(_placeholders(sql), params)
        return cursor


def reason(e: BaseException) -> str:
    """One line saying why (psycopg's messages have the server's detail on further lines)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class Postgres:
    """The server of ``NMT_DATABASE_URL``: its pool, and whether it answers."""

    def __init__(self, url: str, pool: psycopg_pool.ConnectionPool[Any]) -> None:
        self.url = url
        self.pool = pool
        self._down: str | None = None
        self._probe: asyncio.Task[None] | None = None

    @classmethod
    def connect(cls, url: str, max_size: int = POOL_SIZE) -> Postgres:
        """The pool, once one connection works (``DatabaseUnusable`` otherwise)."""
        if not url.startswith(("postgresql://", "postgres://")):
            raise DatabaseUnusable(f"{SETTING} must be a postgresql:// URL")
        try:
            pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
                url,
                min_size=1,
                max_size=max_size,
                kwargs={"autocommit": True, "connect_timeout": int(CONNECT_TIMEOUT_S)},
                timeout=CONNECT_TIMEOUT_S,
                open=False,
                name="nmt",
            )
        except psycopg.ProgrammingError as e:  # a URL psycopg cannot read
            raise DatabaseUnusable(f"{SETTING}: {reason(e)}") from None
        try:
            pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
        except (psycopg.Error, psycopg_pool.PoolTimeout) as e:
            pool.close()
            why = reason(e)
            # The pool's own words ("pool initialization incomplete") say less than a connection's.
            try:
                psycopg.connect(url, connect_timeout=int(CONNECT_TIMEOUT_S)).close()
            except psycopg.Error as cause:
                why = reason(cause)
            raise DatabaseUnusable(f"{SETTING}: cannot connect to PostgreSQL: {why}") from None
        return cls(url, pool)

    def database(self, store: str, migrations: Sequence[Migration]) -> PostgresDatabase:
        return PostgresDatabase(self, store, migrations)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        try:
            with self.pool.connection() as connection:
                yield connection
        except (psycopg.OperationalError, psycopg.InterfaceError, psycopg_pool.PoolTimeout) as e:
            self._down = reason(e)
            raise StoreUnavailable(f"PostgreSQL ({SETTING}): {reason(e)}") from e
        except psycopg.Error as e:
            raise StoreUnavailable(f"PostgreSQL ({SETTING}): {reason(e)}") from e

    def down(self) -> str | None:
        """Why the server is unusable now (for /health/ready), or None."""
        if self._down is None:
            return None
        return f"the database ({SETTING}) is unreachable"

    def start(self) -> None:
        """Check the server every PROBE_S, so that /health/ready says when it is down and back."""
        self._probe = asyncio.create_task(self._probing(), name="nmt-database-probe")

    async def _probing(self) -> None:
        while True:
            await asyncio.sleep(PROBE_S)
            await asyncio.to_thread(self._check)

    def _check(self) -> None:
        """Whether the server answers; the pool's idle connections checked too, those broken (the
        server restarted) replaced, so that requests after it is back find working ones."""
        self.pool.check()  # (first: the query below then takes a connection that works)
        try:
            with self.connection() as connection:
                connection.execute("SELECT 1")
        except StoreUnavailable:
            return  # (self._down set)
        self._down = None

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        await asyncio.to_thread(self.pool.close)


class PostgresDatabase:
    """One store's tables in the shared server: SQLite's ``reading``/``writing`` (``SqliteDatabase``)."""

    dialect = "postgresql"

    def __init__(self, server: Postgres, store: str, migrations: Sequence[Migration]) -> None:
        self.server = server
        self.store = store
        self.migrations = migrations

    def migrate(self) -> int:
        """Apply the store's migrations past its version, under the advisory lock every process
        takes to migrate; how many were applied."""
        with self.writing() as db:
            db.execute("SELECT pg_advisory_xact_lock(?)", (ADVISORY_LOCK,))
            return migrate(db, self.store, self.migrations, "postgresql")

    def exists(self) -> bool:
        return True  # the tables are made at start

    @contextmanager
    def reading(self) -> Iterator[PgConnection]:
        """A connection for reads (each statement its own transaction)."""
        with self.server.connection() as connection:
            yield PgConnection(connection)

    @contextmanager
    def writing(self) -> Iterator[PgConnection]:
        """One transaction (rolled back if the block raises)."""
        with self.server.connection() as connection, connection.transaction():
            yield PgConnection(connection)

    def close(self) -> None:
        pass  # the pool is the server's (``Postgres.close``)
