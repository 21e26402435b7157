"""Where the stores keep their rows: a SQLite file each in ``NMT_DATA_DIR`` (the default, one
machine), or one PostgreSQL that every replica shares (``NMT_DATABASE_URL``). A store writes its
queries once, with ``?`` placeholders, against ``Database``'s ``reading()``/``writing()``; its
schema is its migrations (``app.stores.database.migrations``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from app.stores.database.errors import StoreUnavailable
from app.stores.database.migrations import Migration
from app.stores.database.postgres import Postgres, PostgresDatabase
from app.stores.database.sqlite import SqliteDatabase

Database = SqliteDatabase | PostgresDatabase

__all__ = ["Database", "Migration", "Postgres", "StoreUnavailable", "open_database"]


def open_database(
    server: Postgres | None, path: Path, store: str, migrations: Sequence[Migration]
) -> Database:
    """The store's tables in ``server`` when there is one, else in the SQLite file ``path``."""
    if server is not None:
        return server.database(store, migrations)
    return SqliteDatabase(path, store, migrations)
