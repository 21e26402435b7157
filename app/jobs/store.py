"""Document jobs on disk: one SQLite row per job, and a directory of its files, under
``NMT_DATA_DIR/jobs``.

A job's row says what was asked (the upload's name, languages, terminology), where it stands
(its state and sentences done of total) and who may see it (``owner``: the API key's name). Its
directory holds the upload as received, the translations finished so far (one JSON line per
chunk, appended and flushed as each chunk finishes) and, once written, the translated file. So a
front end that stops loses nothing accepted: the next one to start takes the job up again, reads
the upload again (reading is deterministic) and goes on after the last chunk saved.

Several front-end processes may share the directory (``uvicorn --workers N``, replicas on one
volume): a process *claims* a job by writing a lease (a time a few seconds ahead) in the same
transaction that checks nobody holds one, and renews it while it works. A job whose lease ran out
(its process died) is claimable again; one cancelled is seen by its runner at its next chunk.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from app.terminology.database import Database, StoreUnavailable

State = Literal["queued", "reading", "translating", "writing", "done", "failed", "cancelled"]
RUNNING: tuple[State, ...] = ("reading", "translating", "writing")
FINAL: tuple[State, ...] = ("done", "failed", "cancelled")
LEASE_S = 30.0  # a claim lasts this long unless renewed (a runner renews it every LEASE_S / 3)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    source TEXT NOT NULL,
    target TEXT NOT NULL,
    options TEXT NOT NULL,          -- JSON: JobOptions
    state TEXT NOT NULL,
    language TEXT,                  -- the language it is translated from, once read
    done INTEGER NOT NULL DEFAULT 0,
    total INTEGER,                  -- sentences, once read
    error_status INTEGER,
    error TEXT,
    notes TEXT NOT NULL DEFAULT '[]',
    created REAL NOT NULL,
    finished REAL,
    expires REAL,
    lease REAL NOT NULL DEFAULT 0,
    result_name TEXT
);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner, created);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, created);
"""

UPLOAD, PROGRESS, RESULT = "upload", "progress.jsonl", "result"


class JobsFull(Exception):
    """The key, or the service, holds as many jobs as it may (429 / 503)."""

    def __init__(self, message: str, per_key: bool) -> None:
        super().__init__(message)
        self.per_key = per_key


@dataclass(frozen=True)
class JobOptions:
    """What decides the translation besides the file and the languages."""

    glossary: list[tuple[str, str]] = field(default_factory=list)  # resolved when the job was made
    protect_placeholders: bool = True
    beam_size: int = 5


@dataclass(frozen=True)
class Job:
    id: str
    owner: str
    name: str
    source: str
    target: str
    options: JobOptions
    state: State
    language: str | None
    done: int
    total: int | None
    error_status: int | None
    error: str | None
    notes: tuple[str, ...]
    created: float  # time.time()
    finished: float | None
    expires: float | None
    result_name: str | None

    @classmethod
    def of(cls, row: sqlite3.Row | tuple[Any, ...]) -> Job:
        values = list(row)
        options = json.loads(values[5])
        values[5] = JobOptions(
            [(s, t) for s, t in options["glossary"]], options["protect_placeholders"], options["beam_size"]
        )
        values[12] = tuple(json.loads(values[12]))
        return cls(*values)


COLUMNS = (
    "id, owner, name, source, target, options, state, language, done, total, error_status, error, "
    "notes, created, finished, expires, result_name"
)


class JobStore:
    """The jobs of every key, under ``directory`` (``NMT_DATA_DIR/jobs``; made on first use)."""

    def __init__(self, directory: Path, max_per_key: int, max_jobs: int, ttl_s: float) -> None:
        self.directory = directory
        self.max_per_key = max_per_key
        self.max_jobs = max_jobs
        self.ttl_s = ttl_s
        self.db = Database(directory / "jobs.sqlite3", SCHEMA)

    def close(self) -> None:
        self.db.close()

    def path(self, job_id: str, name: str) -> Path:
        return self.directory / job_id / name

    # --- Made and seen by the routes -----------------------------------------------------------

    def create(
        self, owner: str, name: str, source: str, target: str, options: JobOptions, data: bytes
    ) -> Job:
        """A new queued job holding ``data`` (``JobsFull`` past the limits). Its upload is on disk
        before its row commits: a row always has its file."""
        job_id = secrets.token_urlsafe(16)
        folder = self.directory / job_id
        try:
            folder.mkdir(parents=True)
            write_file(folder / UPLOAD, data)
        except OSError as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise StoreUnavailable(f"cannot store the upload: {e.strerror or e}") from e
        encoded = json.dumps(
            {
                "glossary": options.glossary,
                "protect_placeholders": options.protect_placeholders,
                "beam_size": options.beam_size,
            }
        )
        try:
            with self.db.writing() as db:
                self._expire(db)
                (mine,) = db.execute("SELECT COUNT(*) FROM jobs WHERE owner = ?", (owner,)).fetchone()
                if mine >= self.max_per_key:
                    raise JobsFull(
                        f"this key holds {mine} jobs (at most {self.max_per_key}): delete finished ones",
                        per_key=True,
                    )
                (everyone,) = db.execute("SELECT COUNT(*) FROM jobs").fetchone()
                if everyone >= self.max_jobs:
                    raise JobsFull(f"the service holds {everyone} jobs; retry later", per_key=False)
                db.execute(
                    "INSERT INTO jobs (id, owner, name, source, target, options, state, created) "
                    "VALUES (?, ?, ?, ?, ?, ?, 'queued', ?)",
                    (job_id, owner, name, source, target, encoded, time.time()),
                )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        job = self.get(owner, job_id)
        assert job is not None
        return job

    def get(self, owner: str, job_id: str) -> Job | None:
        """``owner``'s job ``job_id`` (None if it has none of that id, or it expired)."""
        with self.db.reading() as db:
            if db is None:
                return None
            row = db.execute(
                f"SELECT {COLUMNS} FROM jobs WHERE id = ? AND owner = ? AND (expires IS NULL OR expires > ?)",
                (job_id, owner, time.time()),
            ).fetchone()
        return None if row is None else Job.of(row)

    def jobs_of(self, owner: str) -> list[Job]:
        """``owner``'s jobs, newest first."""
        with self.db.reading() as db:
            if db is None:
                return []
            rows = db.execute(
                f"SELECT {COLUMNS} FROM jobs WHERE owner = ? AND (expires IS NULL OR expires > ?) "
                "ORDER BY created DESC",
                (owner, time.time()),
            ).fetchall()
        return [Job.of(row) for row in rows]

    def cancel(self, owner: str, job_id: str) -> Job | None:
        """Mark the job cancelled if it is not finished (its runner stops at its next chunk)."""
        now = time.time()
        with self.db.writing() as db:
            db.execute(
                "UPDATE jobs SET state = 'cancelled', finished = ?, expires = ? "
                "WHERE id = ? AND owner = ? AND state NOT IN ('done', 'failed', 'cancelled')",
                (now, now + self.ttl_s, job_id, owner),
            )
        return self.get(owner, job_id)

    def delete(self, owner: str, job_id: str) -> bool:
        """Remove the job and its files (a runner working on it stops at its next chunk)."""
        with self.db.writing() as db:
            deleted = db.execute("DELETE FROM jobs WHERE id = ? AND owner = ?", (job_id, owner)).rowcount
        if deleted:
            shutil.rmtree(self.directory / job_id, ignore_errors=True)
        return bool(deleted)

    # --- Claimed and advanced by a runner ---------------------------------------------------------

    def claim(self, running: dict[str, int]) -> Job | None:
        """The next job to run, leased to the caller: the oldest queued one (or one whose runner
        stopped renewing its lease) among the owners with the fewest of ``running`` (owner -> jobs
        this runner is running), so that one key's many jobs do not hold every place."""
        if not self.db.path.exists():  # no job was ever made: the data directory stays untouched
            return None
        now = time.time()
        with self.db.writing() as db:
            rows = db.execute(
                f"SELECT {COLUMNS} FROM jobs WHERE (state = 'queued' OR state IN {RUNNING!r}) AND lease < ? "
                "ORDER BY created LIMIT 256",
                (now,),
            ).fetchall()
            if not rows:
                return None
            jobs = [Job.of(row) for row in rows]
            job = min(jobs, key=lambda j: (running.get(j.owner, 0), j.created))
            db.execute("UPDATE jobs SET lease = ? WHERE id = ?", (now + LEASE_S, job.id))
        return job

    def renew(self, job_id: str) -> State | None:
        """Extend the lease; the job's state now (None: deleted), so a runner learns of a cancel."""
        with self.db.writing() as db:
            db.execute("UPDATE jobs SET lease = ? WHERE id = ?", (time.time() + LEASE_S, job_id))
            row = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else row[0]

    def release(self, job_id: str) -> None:
        """Give the lease back (a runner stopping: the next process takes the job up at once)."""
        with self.db.writing() as db:
            db.execute("UPDATE jobs SET lease = 0 WHERE id = ?", (job_id,))

    def advance(self, job_id: str, state: State, **values: Any) -> bool:
        """Set the job's state and ``values`` (language, done, total, notes) unless it was cancelled
        or deleted meanwhile (False)."""
        if "notes" in values:
            values["notes"] = json.dumps(list(values["notes"]))
        sets = ", ".join(f"{name} = ?" for name in ["state", *values])
        with self.db.writing() as db:
            changed = db.execute(
                f"UPDATE jobs SET {sets} WHERE id = ? AND state NOT IN ('done', 'failed', 'cancelled')",
                (state, *values.values(), job_id),
            ).rowcount
        return bool(changed)

    def finish(
        self,
        job_id: str,
        state: State,
        *,
        error_status: int | None = None,
        error: str | None = None,
        result_name: str | None = None,
    ) -> bool:
        """End the job: done (its result written), failed (why), never over a cancel."""
        now = time.time()
        with self.db.writing() as db:
            changed = db.execute(
                "UPDATE jobs SET state = ?, error_status = ?, error = ?, result_name = ?, finished = ?, "
                "expires = ?, lease = 0 WHERE id = ? AND state NOT IN ('done', 'failed', 'cancelled')",
                (state, error_status, error, result_name, now, now + self.ttl_s, job_id),
            ).rowcount
        return bool(changed)

    def remove_expired(self) -> int:
        """Delete expired jobs and their files; how many."""
        if not self.db.path.exists():
            return 0
        with self.db.writing() as db:
            ids = self._expire(db)
        for job_id in ids:
            shutil.rmtree(self.directory / job_id, ignore_errors=True)
        return len(ids)

    def _expire(self, db: sqlite3.Connection) -> list[str]:
        ids = [r[0] for r in db.execute("SELECT id FROM jobs WHERE expires <= ?", (time.time(),))]
        db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in ids])
        return ids

    # --- Files ---------------------------------------------------------------------------------

    def upload(self, job_id: str) -> bytes:
        return self.path(job_id, UPLOAD).read_bytes()

    def saved_translations(self, job_id: str) -> list[str]:
        """The translations of the chunks finished so far, in order (a torn last line, from a
        process killed while writing it, is dropped: its chunk is translated again)."""
        out: list[str] = []
        try:
            lines = self.path(job_id, PROGRESS).read_text("utf-8").splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
            try:
                chunk = json.loads(line)
            except ValueError:
                break
            out += chunk
        return out

    def save_translations(self, job_id: str, translations: Sequence[str]) -> None:
        """Append one finished chunk's translations (flushed to disk before this returns)."""
        with open(self.path(job_id, PROGRESS), "a", encoding="utf-8") as f:
            f.write(json.dumps(list(translations), ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def save_result(self, job_id: str, data: bytes) -> None:
        write_file(self.path(job_id, RESULT), data)

    def result(self, job_id: str) -> bytes:
        return self.path(job_id, RESULT).read_bytes()


def write_file(path: Path, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all (written beside it, synced, then renamed)."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
