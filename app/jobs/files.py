"""A job's files (its upload, options, progress and result): in a directory per job under
``NMT_DATA_DIR/jobs`` (``DiskFiles``, the default), or in rows of the shared PostgreSQL
(``TableFiles``, with ``NMT_DATABASE_URL``), so that any replica reads what another wrote.

Both write a file whole or not at all, read it back whole (``read``) or a part at a time
(``chunks``: a download never holds the whole result in memory), append the progress's lines one
chunk of sentences at a time, and remove what no job's row accounts for (``sweep``). The job store
(``app.jobs.store``) decides when; these only keep the bytes.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Container, Iterable, Iterator
from pathlib import Path
from typing import Protocol

from app.jobs.disk import StorageFull, disk_refusal, file_size, folder_size, storage_error, sweep, write_file
from app.stores.database.errors import StoreUnavailable
from app.stores.database.postgres import PostgresDatabase

PART_BYTES = 1024 * 1024  # a row of a file in the database; a download's read


class JobFiles(Protocol):
    def write(self, job_id: str, name: str, data: bytes) -> None: ...
    def read(self, job_id: str, name: str) -> bytes: ...  # FileNotFoundError when absent
    def chunks(self, job_id: str, name: str) -> Iterator[bytes]: ...
    def path(self, job_id: str, name: str) -> Path | None: ...  # None: not a file on this disk
    def size(self, job_id: str, *names: str) -> int: ...  # of those of its files there are
    def append_line(self, job_id: str, name: str, line: str) -> None: ...
    def lines(self, job_id: str, name: str) -> list[str]: ...  # [] when absent
    def unlink(self, job_id: str, name: str) -> None: ...
    def remove(self, job_ids: Iterable[str]) -> None: ...
    # (``jobs``: the ids of the jobs with a row, read when called, before any file is listed.)
    def sweep(self, jobs: Callable[[], Container[str]], cutoff: float) -> int: ...
    def refusal(self, need: int) -> StorageFull | None: ...  # the room ``need`` more bytes would leave


class DiskFiles:
    """A directory per job under ``directory`` (``app.jobs.disk``), keeping ``reserve`` bytes free."""

    def __init__(self, directory: Path, reserve: int) -> None:
        self.directory = directory
        self.reserve = reserve

    def path(self, job_id: str, name: str) -> Path:
        return self.directory / job_id / name

    def write(self, job_id: str, name: str, data: bytes) -> None:
        folder = self.directory / job_id
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_file(folder / name, data)
        except OSError as e:
            raise storage_error(f"cannot store the job's {name}", e) from e

    def read(self, job_id: str, name: str) -> bytes:
        return self.path(job_id, name).read_bytes()

    def chunks(self, job_id: str, name: str) -> Iterator[bytes]:
        with open(self.path(job_id, name), "rb") as f:
            while part := f.read(PART_BYTES):
                yield part

    def size(self, job_id: str, *names: str) -> int:
        if not names:
            return folder_size(self.directory / job_id)
        return sum(file_size(self.path(job_id, name)) for name in names)

    def append_line(self, job_id: str, name: str, line: str) -> None:
        try:
            with open(self.path(job_id, name), "a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise storage_error("cannot save the translations", e) from e

    def lines(self, job_id: str, name: str) -> list[str]:
        try:
            return self.path(job_id, name).read_text("utf-8").splitlines()
        except FileNotFoundError:
            return []

    def unlink(self, job_id: str, name: str) -> None:
        self.path(job_id, name).unlink(missing_ok=True)

    def remove(self, job_ids: Iterable[str]) -> None:
        for job_id in job_ids:
            shutil.rmtree(self.directory / job_id, ignore_errors=True)

    def sweep(self, jobs: Callable[[], Container[str]], cutoff: float) -> int:
        if not self.directory.is_dir():
            return 0
        ids = jobs()  # before the directory is listed: a row made since is young
        try:
            return sweep(self.directory, ids, cutoff)
        except OSError as e:
            raise StoreUnavailable(f"cannot sweep the jobs' directory: {e.strerror or e}") from e

    def refusal(self, need: int) -> StorageFull | None:
        self.directory.mkdir(parents=True, exist_ok=True)
        return disk_refusal(self.directory, need, self.reserve)


# The files' table beside the jobs' (in ``app.jobs.store``'s migrations for PostgreSQL; the
# downloads of ``app.stores.downloads`` have one of their own). A file is its parts in order, written in
# one transaction: a reader never sees half of one. ``written`` is when, for the sweep's grace period.
FILES_SCHEMA = """
CREATE TABLE {table} (
    job TEXT NOT NULL,
    name TEXT NOT NULL,
    part INTEGER NOT NULL,
    data BYTEA NOT NULL,
    written DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (job, name, part)
);
"""


def files_schema(table: str) -> str:
    return FILES_SCHEMA.format(table=table)


class TableFiles:
    """A job's files as rows of ``table`` in the shared PostgreSQL, ``PART_BYTES`` a row; a file
    belongs to the row of ``owners`` whose ``id`` is its ``job`` (the sweep removes the others).

    There is no disk of the service's to keep room on: the quota (``NMT_DATA_QUOTA_MB``) bounds
    what the jobs hold in the database."""

    def __init__(self, db: PostgresDatabase, table: str = "job_files", owners: str = "jobs") -> None:
        self.db = db
        self.table, self.owners = table, owners

    def path(self, job_id: str, name: str) -> None:
        return None

    def write(self, job_id: str, name: str, data: bytes) -> None:
        """The file replaced, in one transaction: readers see the old one or the whole new one."""
        now = time.time()
        parts = [data[i : i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
        with self.db.writing() as db:
            db.execute(f"DELETE FROM {self.table} WHERE job = ? AND name = ?", (job_id, name))
            db.executemany(
                f"INSERT INTO {self.table} (job, name, part, data, written) VALUES (?, ?, ?, ?, ?)",
                [(job_id, name, i, part, now) for i, part in enumerate(parts)],
            )

    def read(self, job_id: str, name: str) -> bytes:
        with self.db.reading() as db:
            rows = db.execute(
                f"SELECT data FROM {self.table} WHERE job = ? AND name = ? ORDER BY part", (job_id, name)
            ).fetchall()
        if not rows:
            raise FileNotFoundError(f"job {job_id} has no {name}")
        return b"".join(bytes(row[0]) for row in rows)

    def chunks(self, job_id: str, name: str) -> Iterator[bytes]:
        """The file a part at a time, each read when it is wanted (a part held at once)."""
        with self.db.reading() as db:
            (count,) = db.execute(
                f"SELECT COUNT(*) FROM {self.table} WHERE job = ? AND name = ?", (job_id, name)
            ).fetchone()
        for part in range(count):
            with self.db.reading() as db:
                row = db.execute(
                    f"SELECT data FROM {self.table} WHERE job = ? AND name = ? AND part = ?",
                    (job_id, name, part),
                ).fetchone()
            if row is None:  # deleted meanwhile
                return
            yield bytes(row[0])

    def size(self, job_id: str, *names: str) -> int:
        query = f"SELECT COALESCE(SUM(octet_length(data)), 0) FROM {self.table} WHERE job = ?"
        with self.db.reading() as db:
            if names:
                (size,) = db.execute(query + " AND name = ANY(?)", (job_id, list(names))).fetchone()
            else:
                (size,) = db.execute(query, (job_id,)).fetchone()
        return int(size)

    def append_line(self, job_id: str, name: str, line: str) -> None:
        with self.db.writing() as db:
            db.execute(
                f"INSERT INTO {self.table} (job, name, part, data, written) SELECT ?, ?, "
                f"COALESCE(MAX(part) + 1, 0), ?, ? FROM {self.table} WHERE job = ? AND name = ?",
                (job_id, name, line.encode(), time.time(), job_id, name),
            )

    def lines(self, job_id: str, name: str) -> list[str]:
        with self.db.reading() as db:
            rows = db.execute(
                f"SELECT data FROM {self.table} WHERE job = ? AND name = ? ORDER BY part", (job_id, name)
            ).fetchall()
        return [bytes(row[0]).decode() for row in rows]

    def unlink(self, job_id: str, name: str) -> None:
        with self.db.writing() as db:
            db.execute(f"DELETE FROM {self.table} WHERE job = ? AND name = ?", (job_id, name))

    def remove(self, job_ids: Iterable[str]) -> None:
        ids = list(job_ids)
        if ids:
            with self.db.writing() as db:
                db.execute(f"DELETE FROM {self.table} WHERE job = ANY(?)", (ids,))

    def sweep(self, jobs: Callable[[], Container[str]], cutoff: float) -> int:
        """The files of jobs without a row (a process killed between writing an upload and its
        row), once older than ``cutoff`` (found by the query itself: ``jobs`` is not asked)."""
        with self.db.writing() as db:
            return int(
                db.execute(
                    f"DELETE FROM {self.table} f WHERE written < ? AND NOT EXISTS "
                    f"(SELECT 1 FROM {self.owners} j WHERE j.id = f.job)",
                    (cutoff,),
                ).rowcount
            )

    def refusal(self, need: int) -> StorageFull | None:
        return None
