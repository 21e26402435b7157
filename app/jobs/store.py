"""Document jobs on disk: one SQLite row per job, and a directory of its files, under
``NMT_DATA_DIR/jobs``.

A job's row says what was asked (the upload's name, languages), where it stands (its state and
sentences done of total), who may see it (``owner``: the API key's name) and how many bytes its
files take or may take (``bytes``). Its directory holds the upload as received, its options
(terminology, in ``options.json``: a resolved glossary can be megabytes, so that only the runner
that claims the job reads them, never a listing or a poll), the translations finished so far (one
JSON line per chunk, appended and flushed as each chunk finishes) and, once written, the translated
file. So a front end that stops loses nothing accepted: the next one to start takes the job up
again, reads the upload again (reading is deterministic) and goes on after the last chunk saved.

Several front-end processes may share the directory (``uvicorn --workers N``, replicas on one
volume): a process *claims* a job by writing a lease (a time a few seconds ahead) in the same
transaction that checks nobody holds one, and renews it while it works. A job whose lease ran out
(its process died) is claimable again; one cancelled is seen by its runner at its next chunk.

The disk is bounded: the jobs' ``bytes`` together stay within ``quota_bytes``
(``NMT_DATA_QUOTA_MB``). A new job counts its upload and options and reserves room for its
progress and result (``RESERVE_FACTOR`` times the upload); it is refused (``StorageFull``: 507)
past the quota, or when it would leave less than ``reserve_bytes`` free on the disk, which the
stores beside it (key usage, glossaries, memories) need to keep working. A result is checked the
same way when it is written (its job fails with 507 rather than fill the disk); a finished job
counts the files it keeps. Expired rows take their directories with them, and files no row
accounts for (a process killed between writing an upload and committing its row, or in the middle
of a write) are swept when the runner starts (``sweep``).

With ``NMT_DATABASE_URL`` the rows, and the files (``app.jobs.files.TableFiles``), are in the
PostgreSQL every replica shares: a job posted to one replica is polled, cancelled and downloaded
through any other, and any replica's runner claims it (``SELECT ... FOR UPDATE SKIP LOCKED``: two
never take the same job; a replica killed mid-job leaves a lease that runs out, and another takes
the job up after its last saved chunk).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from app.jobs.disk import MIB, StorageFull
from app.jobs.files import DiskFiles, JobFiles, TableFiles, files_schema
from app.jobs.job import RUNNING, ClaimedJob, Job, JobOptions, State
from app.stores.database import Database, Migration, Postgres, StoreUnavailable, open_database
from app.stores.database.migrations import postgresql_of
from app.stores.database.postgres import PostgresDatabase

LEASE_S = 30.0  # a claim lasts this long unless renewed (a runner renews it every LEASE_S / 3)
# Reserved for a new job's progress and result, in times its upload: its translations (as JSON
# lines) and the translated file are each about the size of a text upload. A result larger than
# its reservation is checked against the quota when it is written.
RESERVE_FACTOR = 2
# Files no row accounts for are swept at start only once older than this (by mtime): a younger
# directory may be another process's upload whose row is about to commit (``create`` writes the
# files first, then waits up to the database's time-out for the write lock), a younger ``.partial``
# a file another process is writing.
ORPHAN_GRACE_S = 300.0

SQLITE = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    source TEXT NOT NULL,
    target TEXT NOT NULL,
    options TEXT NOT NULL DEFAULT '', -- '': in the job's OPTIONS file (moved there by _migrate)
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
    result_name TEXT,
    bytes INTEGER NOT NULL DEFAULT 0 -- its files on disk, or reserved for them (counted in the quota)
);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner, created);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, created);
"""

# Which process holds the job's lease (host:pid), for an operator asking which replica runs it.
HOLDER = "ALTER TABLE jobs ADD COLUMN holder TEXT NOT NULL DEFAULT ''"
# Who made it without a key (its client's address; "" with a key): strangers' jobs are counted per
# client, so that one stranger's jobs do not fill every other's share.
CLIENT = "ALTER TABLE jobs ADD COLUMN client TEXT NOT NULL DEFAULT ''"
# The SHA-256 (hex) of a secret the job's maker was given beside its id, and must show again to see
# the job ('': none, as for a job of /jobs). DeepL's document API asks for one (its document_key:
# app/http/endpoints/deepl/documents.py); only its digest is kept, so the table does not hold it.
SECRET = "ALTER TABLE jobs ADD COLUMN secret TEXT NOT NULL DEFAULT ''"
# The characters of its text, once read (NULL before): what its owner was charged (DeepL's
# billed_characters).
CHARS = "ALTER TABLE jobs ADD COLUMN chars INTEGER"

UPLOAD, OPTIONS, PROGRESS, RESULT = "upload", "options.json", "progress.jsonl", "result"


def holder() -> str:
    """This process, as a job's row names the holder of its lease: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


class JobsFull(Exception):
    """The key, or the service, holds as many jobs as it may (429 / 503)."""

    def __init__(self, message: str, per_key: bool) -> None:
        super().__init__(message)
        self.per_key = per_key


COLUMNS = (  # a Job's: never ``options``, whose value may be megabytes (a job made before OPTIONS)
    "id, owner, name, source, target, state, language, done, total, error_status, error, "
    "notes, created, finished, expires, result_name, chars"
)


class JobStore:
    """The jobs of every key, under ``directory`` (``NMT_DATA_DIR/jobs``; made on first use), whose
    files take at most ``quota_bytes`` and leave ``reserve_bytes`` free on the disk."""

    def __init__(
        self,
        directory: Path,
        max_per_key: int,
        max_jobs: int,
        ttl_s: float,
        *,
        quota_bytes: int,
        reserve_bytes: int,
        server: Postgres | None = None,
        lease_s: float = LEASE_S,
    ) -> None:
        self.directory = directory
        self.max_per_key = max_per_key
        self.max_jobs = max_jobs
        self.ttl_s = ttl_s
        self.quota_bytes = quota_bytes
        self.reserve_bytes = reserve_bytes
        self.lease_s = lease_s
        migrations = [
            Migration(1, SQLITE, postgresql_of(SQLITE) + files_schema("job_files")),
            Migration(2, self._add_bytes, ""),
            Migration(3, HOLDER, HOLDER),
            Migration(4, CLIENT, CLIENT),
            Migration(5, SECRET, SECRET),
            Migration(6, CHARS, CHARS),
        ]
        self.db: Database = open_database(server, directory / "jobs.sqlite3", "jobs", migrations)
        self.files: JobFiles = (
            TableFiles(self.db)
            if isinstance(self.db, PostgresDatabase)
            else DiskFiles(directory, reserve_bytes)
        )
        # In PostgreSQL, a check ("this key holds fewer than N jobs") and the write it allows are
        # made one step across replicas by a lock the transaction holds (SQLite's write lock is).
        self._serialize = (
            "SELECT pg_advisory_xact_lock(hashtext('nmt-jobs'))" if self.db.dialect == "postgresql" else ""
        )
        self._for_update = " FOR UPDATE SKIP LOCKED" if self.db.dialect == "postgresql" else ""

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _writing(self, serialized: bool = False) -> Iterator[Any]:
        """A write transaction; ``serialized``: one at a time across processes (a quota's check)."""
        with self.db.writing() as db:
            if serialized and self._serialize:
                db.execute(self._serialize)
            yield db

    def _add_bytes(self, db: Any) -> None:
        """Migration 2 (SQLite: PostgreSQL's tables were made with it). A database made before the
        quota has no ``bytes``: added, each job counting the files it holds now; and its options, in
        the rows then, are moved to each job's OPTIONS file."""
        if "bytes" in {row[1] for row in db.execute("PRAGMA table_info(jobs)")}:
            return
        db.execute("ALTER TABLE jobs ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0")
        for job_id, options in db.execute("SELECT id, options FROM jobs").fetchall():
            folder = self.directory / job_id
            if options and folder.is_dir():
                try:
                    self.files.write(job_id, OPTIONS, JobOptions.decoded(options).encoded())
                except (StorageFull, StoreUnavailable) as e:  # nothing here is a request's to refuse
                    raise StoreUnavailable(f"cannot move a job's options: {e}") from e
            bytes_ = self.files.size(job_id)
            db.execute("UPDATE jobs SET options = '', bytes = ? WHERE id = ?", (bytes_, job_id))

    # --- Made and seen by the routes -----------------------------------------------------------

    def create(
        self,
        owner: str,
        name: str,
        source: str,
        target: str,
        options: JobOptions,
        data: bytes,
        client: str = "",
        secret: str = "",
    ) -> Job:
        """A new queued job holding ``data`` (``JobsFull`` past the limits, ``StorageFull`` past
        the quota or the disk's reserve). Its files are on disk before its row commits: a row always
        has its files. ``client``: who made it without a key (``owner`` ""), whose jobs are counted
        apart from other strangers'. ``secret``: the digest ``get`` asks for (``SECRET``)."""
        client = client if not owner else ""
        encoded = options.encoded()
        need = len(data) * (1 + RESERVE_FACTOR) + len(encoded)
        # Refused before the upload is written when it can be (expired rows removed either way),
        # and checked again with the row's insert: another process may have taken the room.
        with self._writing(serialized=True) as db:
            expired = self._expire(db)
            refusal = self._refusal(db, owner, client, need, need)
        self.files.remove(expired)
        if refusal is not None:
            raise refusal
        job_id = secrets.token_urlsafe(16)
        try:
            self.files.write(job_id, OPTIONS, encoded)
            self.files.write(job_id, UPLOAD, data)
        except BaseException:
            self.files.remove([job_id])
            raise
        try:
            with self._writing(serialized=True) as db:
                written = len(encoded) + len(data)
                refusal = self._refusal(db, owner, client, need, need - written)
                if refusal is not None:
                    raise refusal
                db.execute(
                    "INSERT INTO jobs "
                    "(id, owner, client, name, source, target, options, state, created, bytes, secret) "
                    "VALUES (?, ?, ?, ?, ?, ?, '', 'queued', ?, ?, ?)",
                    (job_id, owner, client, name, source, target, time.time(), need, secret),
                )
        except BaseException:
            self.files.remove([job_id])
            raise
        job = self.get(owner, job_id)
        assert job is not None
        return job

    def _refusal(self, db: Any, owner: str, client: str, need: int, unwritten: int) -> Exception | None:
        """Why a new job of ``owner`` (of ``client``, without a key) counting ``need`` bytes,
        ``unwritten`` of them not on the disk yet, is refused now (None: it is not)."""
        query = "SELECT COUNT(*) FROM jobs WHERE owner = ? AND client = ?"
        (mine,) = db.execute(query, (owner, client)).fetchone()
        if mine >= self.max_per_key:
            holder = "this key holds" if owner else "you hold"
            message = f"{holder} {mine} jobs (at most {self.max_per_key}): delete finished ones"
            return JobsFull(message, per_key=True)
        everyone, used = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM jobs").fetchone()
        if everyone >= self.max_jobs:
            return JobsFull(f"the service holds {everyone} jobs; retry later", per_key=False)
        if used + need > self.quota_bytes:
            return StorageFull(
                f"the jobs' storage is full ({used / MIB:.0f} of {self.quota_bytes / MIB:.0f} MiB used; "
                f"this job needs {need / MIB:.1f} MiB): retry once jobs expire or are deleted"
            )
        return self.files.refusal(unwritten)

    def get(self, owner: str, job_id: str, secret: str | None = None) -> Job | None:
        """``owner``'s job ``job_id`` (None if it has none of that id, or it expired); with
        ``secret``, only if the job was made with that digest."""
        mine = "" if secret is None else " AND secret = ?"
        with self.db.reading() as db:
            if db is None:
                return None
            row = db.execute(
                f"SELECT {COLUMNS} FROM jobs WHERE id = ? AND owner = ?{mine} "
                "AND (expires IS NULL OR expires > ?)",
                (job_id, owner, *(() if secret is None else (secret,)), time.time()),
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
        with self._writing() as db:
            db.execute(
                "UPDATE jobs SET state = 'cancelled', finished = ?, expires = ? "
                "WHERE id = ? AND owner = ? AND state NOT IN ('done', 'failed', 'cancelled')",
                (now, now + self.ttl_s, job_id, owner),
            )
        return self.get(owner, job_id)

    def delete(self, owner: str, job_id: str) -> bool:
        """Remove the job and its files (a runner working on it stops at its next chunk)."""
        with self._writing() as db:
            deleted = db.execute("DELETE FROM jobs WHERE id = ? AND owner = ?", (job_id, owner)).rowcount
        if deleted:
            self.files.remove([job_id])
        return bool(deleted)

    # --- Claimed and advanced by a runner ---------------------------------------------------------

    def claim(self, running: dict[str, int]) -> ClaimedJob | None:
        """The next job to run, leased to the caller: the oldest queued one (or one whose runner
        stopped renewing its lease) among the owners with the fewest of ``running`` (owner -> jobs
        this runner is running), so that one key's many jobs do not hold every place. Its options
        are read once it is leased, outside the transaction."""
        if not self.db.exists():  # no job was ever made: the data directory stays untouched
            return None
        now = time.time()
        with self._writing() as db:
            # (In PostgreSQL the rows read are locked until this commits, and rows another replica
            # is claiming now are skipped: two never lease the same job.)
            rows = db.execute(
                f"SELECT {COLUMNS} FROM jobs WHERE (state = 'queued' OR state IN {RUNNING!r}) AND lease < ? "
                f"ORDER BY created LIMIT 256{self._for_update}",
                (now,),
            ).fetchall()
            if not rows:
                return None
            jobs = [Job.of(row) for row in rows]
            job = min(jobs, key=lambda j: (running.get(j.owner, 0), j.created))
            db.execute(
                "UPDATE jobs SET lease = ?, holder = ? WHERE id = ?", (now + self.lease_s, holder(), job.id)
            )
        try:
            options = JobOptions.decoded(self.files.read(job.id, OPTIONS))
        except (FileNotFoundError, ValueError):  # deleted meanwhile (no row to fail then), or lost
            self.finish(job.id, "failed", error_status=500, error="the job's files are lost")
            return None
        except OSError as e:
            raise StoreUnavailable(f"cannot read a job's options: {e.strerror or e}") from e
        return ClaimedJob.with_options(job, options)

    def renew(self, job_id: str) -> State | None:
        """Extend the lease; the job's state now (None: deleted), so a runner learns of a cancel."""
        with self._writing() as db:
            db.execute("UPDATE jobs SET lease = ? WHERE id = ?", (time.time() + self.lease_s, job_id))
            row = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else row[0]

    def release(self, job_id: str) -> None:
        """Give the lease back (a runner stopping: the next process takes the job up at once)."""
        with self._writing() as db:
            db.execute("UPDATE jobs SET lease = 0, holder = '' WHERE id = ?", (job_id,))

    def advance(self, job_id: str, state: State, **values: Any) -> bool:
        """Set the job's state and ``values`` (language, done, total, chars, notes) unless it was cancelled
        or deleted meanwhile (False)."""
        if "notes" in values:
            values["notes"] = json.dumps(list(values["notes"]))
        sets = ", ".join(f"{name} = ?" for name in ["state", *values])
        with self._writing() as db:
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
        """End the job: done (its result written), failed (why), never over a cancel. Its progress
        is removed (a finished job is never taken up again), and it counts the files it keeps."""
        now = time.time()
        kept = self.files.size(job_id, UPLOAD, OPTIONS, RESULT)
        with self._writing() as db:
            changed = db.execute(
                "UPDATE jobs SET state = ?, error_status = ?, error = ?, result_name = ?, finished = ?, "
                "expires = ?, lease = 0, bytes = ? "
                "WHERE id = ? AND state NOT IN ('done', 'failed', 'cancelled')",
                (state, error_status, error, result_name, now, now + self.ttl_s, kept, job_id),
            ).rowcount
        if changed:
            self.files.unlink(job_id, PROGRESS)
        return bool(changed)

    def remove_expired(self) -> int:
        """Delete expired jobs and their files; how many."""
        if not self.db.exists():
            return 0
        with self._writing() as db:
            ids = self._expire(db)
        self.files.remove(ids)
        return len(ids)

    def _expire(self, db: Any) -> list[str]:
        """Delete the expired rows; their ids, whose directories the caller removes once the
        transaction commits (``_remove``)."""
        ids = [r[0] for r in db.execute("SELECT id FROM jobs WHERE expires <= ?", (time.time(),))]
        db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in ids])
        return ids

    def sweep(self, grace_s: float = ORPHAN_GRACE_S) -> int:
        """Remove the files no row accounts for, once older than ``grace_s`` (by mtime): a job
        directory without a row (its process killed between writing the upload and committing the
        row) and a ``.partial`` file (a write cut short); how many."""
        return self.files.sweep(self._ids, time.time() - grace_s)

    def _ids(self) -> set[str]:
        """The ids of every job with a row (none when nothing was ever stored)."""
        with self.db.reading() as db:
            return set() if db is None else {row[0] for row in db.execute("SELECT id FROM jobs")}

    # --- Files ---------------------------------------------------------------------------------

    def upload(self, job_id: str) -> bytes:
        return self.files.read(job_id, UPLOAD)

    def saved_translations(self, job_id: str) -> list[str]:
        """The translations of the chunks finished so far, in order."""
        return self.saved_chunks(job_id)[0]

    def saved_chunks(self, job_id: str) -> tuple[list[str], dict[int, float]]:
        """The translations of the chunks finished so far, in order, and their sentences flagged
        for review (index in the document -> confidence). A torn last line, from a process killed
        while writing it, is dropped: its chunk is translated again."""
        out: list[str] = []
        low: dict[int, float] = {}
        for line in self.files.lines(job_id, PROGRESS):
            try:
                chunk = json.loads(line)
            except ValueError:
                break
            if isinstance(chunk, dict):  # {"translations": [...], "low": [[index, confidence], ...]}
                low |= {int(i): float(c) for i, c in chunk["low"]}
                chunk = chunk["translations"]
            out += chunk
        return out, low

    def save_translations(
        self, job_id: str, translations: Sequence[str], low: Mapping[int, float] | None = None
    ) -> None:
        """Append one finished chunk's translations, and those of its sentences flagged for review
        (``low``: index in the document -> confidence), flushed to disk before this returns."""
        texts = list(translations)
        line = {"translations": texts, "low": sorted(low.items())} if low else texts
        self.files.append_line(job_id, PROGRESS, json.dumps(line, ensure_ascii=False))

    def save_result(self, job_id: str, data: bytes) -> None:
        """Write the job's result, unless its files would then pass the quota or leave less than
        the reserve free on the disk (``StorageFull``: the job fails with 507)."""
        mine = len(data) + self.files.size(job_id, UPLOAD, OPTIONS, PROGRESS)
        with self._writing(serialized=True) as db:
            (others,) = db.execute(
                "SELECT COALESCE(SUM(bytes), 0) FROM jobs WHERE id != ?", (job_id,)
            ).fetchone()
            refusal = self.files.refusal(len(data))
            if refusal is None and others + mine > self.quota_bytes:
                refusal = StorageFull(
                    f"the translated file ({len(data) / MIB:.1f} MiB) would pass the jobs' storage quota "
                    f"({self.quota_bytes / MIB:.0f} MiB, {others / MIB:.0f} MiB used by other jobs)"
                )
            if refusal is None:  # counted before it is written: no other job can take its room
                db.execute(
                    "UPDATE jobs SET bytes = CASE WHEN bytes > ? THEN bytes ELSE ? END WHERE id = ?",
                    (mine, mine, job_id),
                )
        if refusal is not None:
            raise refusal
        self.files.write(job_id, RESULT, data)

    def result(self, job_id: str) -> bytes:
        return self.files.read(job_id, RESULT)
