"""Versioned schemas: each store's numbered migrations, applied once, in order, under a lock.

A store (``jobs``, ``glossaries``, ``memory``) lists its ``Migration``s; the version it is at is a
row of ``schema_versions``. Opening a store applies those past it in one transaction that holds a
lock every process takes first (SQLite: ``BEGIN IMMEDIATE``, the file's write lock; PostgreSQL: a
transaction-scoped advisory lock), so that N replicas starting at once migrate once: the first
applies them, the others wait, then find the version current and apply nothing.

Migration 1 of every store is the schema as it was before versions were kept, written with ``IF NOT
EXISTS``: a SQLite file made by an earlier release gets its version row without a change to its
data, and the migrations after it bring it up to date as they do a new one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Dialect = Literal["sqlite", "postgresql"]

# Any number, the same in every process: the advisory lock that PostgreSQL migrations hold.
ADVISORY_LOCK = 0x6E6D74  # "nmt"

VERSIONS = "CREATE TABLE IF NOT EXISTS schema_versions (store TEXT PRIMARY KEY, version INTEGER NOT NULL)"

Step = str | Callable[[Any], None]  # SQL statements (";"-separated), or a function given the connection


@dataclass(frozen=True)
class Migration:
    version: int
    sqlite: Step
    postgresql: Step

    def step(self, dialect: Dialect) -> Step:
        return self.sqlite if dialect == "sqlite" else self.postgresql


def postgresql_of(sqlite: str) -> str:
    """A SQLite schema in PostgreSQL's types: REAL (8 bytes in SQLite) as DOUBLE PRECISION, INTEGER
    (up to 8 bytes) as BIGINT, and no ``WITHOUT ROWID`` (SQLite's own)."""
    script = re.sub(r"\bREAL\b", "DOUBLE PRECISION", re.sub(r"\bINTEGER\b", "BIGINT", sqlite))
    return script.replace(") WITHOUT ROWID", ")")


def both(version: int, sqlite: str) -> Migration:
    """A migration written once, in SQLite's types (``postgresql_of``)."""
    return Migration(version, sqlite, postgresql_of(sqlite))


def statements(script: str) -> list[str]:
    """A script's statements (no ";" inside one: these schemas have no triggers or literals with one)."""
    lines = [line.split("--", 1)[0] for line in script.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def current_version(db: Any, store: str) -> int:
    """The version ``store`` is at (0: none applied), ``schema_versions`` made if absent."""
    db.execute(VERSIONS)
    row = db.execute("SELECT version FROM schema_versions WHERE store = ?", (store,)).fetchone()
    return 0 if row is None else int(row[0])


def migrate(db: Any, store: str, migrations: Sequence[Migration], dialect: Dialect) -> int:
    """Apply ``store``'s migrations past its version, in the caller's transaction (which holds the
    lock); how many were applied."""
    version = current_version(db, store)
    applied = 0
    for migration in sorted(migrations, key=lambda m: m.version):
        if migration.version <= version:
            continue
        step = migration.step(dialect)
        if isinstance(step, str):
            for statement in statements(step):
                db.execute(statement)
        else:
            step(db)
        applied += 1
        version = migration.version
    if applied:
        db.execute(
            "INSERT INTO schema_versions (store, version) VALUES (?, ?) "
            "ON CONFLICT (store) DO UPDATE SET version = excluded.version",
            (store, version),
        )
    return applied


def latest(migrations: Sequence[Migration]) -> int:
    return max(m.version for m in migrations)
