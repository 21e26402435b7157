"""``app.stores.database.sqlite.SqliteDatabase``: a store that was never written is looked for at most
once per ``ABSENT_RECHECK_S``; this process's own writes are read at once, another's within that."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from unittest import mock

import pytest

from app.stores.database import sqlite as database
from app.stores.database.migrations import Migration
from app.stores.database.sqlite import SqliteDatabase

SCHEMA = "CREATE TABLE IF NOT EXISTS t (x INTEGER);"
MIGRATIONS = [Migration(1, SCHEMA, SCHEMA)]


def Database(path: Path) -> SqliteDatabase:  # noqa: N802 (the class, given its one store)
    return SqliteDatabase(path, "t", MIGRATIONS)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The database's monotonic clock, set by the test: ``clock[0]``."""
    now = [100.0]
    monkeypatch.setattr(database.time, "monotonic", lambda: now[0])
    return now


def rows(db: SqliteDatabase) -> list[int] | None:
    with db.reading() as conn:
        return None if conn is None else [r[0] for r in conn.execute("SELECT x FROM t")]


def test_an_absent_file_is_not_looked_for_again_within_the_recheck_interval(
    tmp_path: Path, clock: list[float]
) -> None:
    db = Database(tmp_path / "store.sqlite3")
    with mock.patch.object(Path, "exists", autospec=True, side_effect=lambda p: False) as exists:
        assert rows(db) is None and rows(db) is None
        assert exists.call_count == 1  # the second read did not stat the file
        clock[0] += database.ABSENT_RECHECK_S
        assert rows(db) is None
        assert exists.call_count == 2
    assert not db.path.exists()  # reading never creates it


def test_this_process_writes_are_read_at_once(tmp_path: Path) -> None:
    db = Database(tmp_path / "store.sqlite3")
    assert rows(db) is None
    with db.writing() as conn:
        conn.execute("INSERT INTO t VALUES (7)")
    assert rows(db) == [7]


def test_another_process_write_is_seen_after_the_recheck_interval(tmp_path: Path, clock: list[float]) -> None:
    db = Database(tmp_path / "store.sqlite3")
    assert rows(db) is None
    other = sqlite3.connect(db.path)  # another process's first write
    other.executescript(SCHEMA + "INSERT INTO t VALUES (3);")
    other.close()
    assert rows(db) is None  # within the interval: still taken to be absent
    clock[0] += database.ABSENT_RECHECK_S
    assert rows(db) == [3]
