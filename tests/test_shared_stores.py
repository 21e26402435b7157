"""The stores in one PostgreSQL (NMT_DATABASE_URL, app/stores/database/), against a real server
(tests/postgres_server.py): what one replica stores, another finds; replicas starting at once
migrate once; two never claim the same job, and a lease that runs out passes the job on with its
saved progress; the quotas hold across replicas; files go with their rows; a server that cannot be
used is one line at start, and one restarted mid-run loses nothing. Each "replica" here is a store
with its own connection pool, as each service process has."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi.testclient import TestClient

from app.jobs import files as job_files
from app.jobs.store import OPTIONS, RESULT, UPLOAD, JobOptions, JobsFull, JobStore
from app.main import create_app, lifespan
from app.stores.database import StoreUnavailable
from app.stores.database.postgres import DatabaseUnusable, Postgres
from app.stores.database.sqlite import ABSENT_RECHECK_S
from app.stores.downloads import MIGRATIONS as DOWNLOAD_MIGRATIONS
from app.stores.downloads import NoRoom, SharedFileStore
from app.terminology import glossaries as glossary_module
from app.terminology import memory as memory_module
from app.terminology.glossaries import GlossaryStore
from app.terminology.memory import TranslationMemory
from model.decoding.terms import GlossaryEntry
from tests.postgres_server import PostgresServer, reset
from tests.test_api import assert_error, make_settings, serve
from tests.test_server import free_port

MIB = 1024 * 1024


@pytest.fixture
def url(postgres_server: PostgresServer) -> str:
    """The session's server, emptied for this test."""
    reset(postgres_server.url)
    return postgres_server.url


@pytest.fixture
def replica(url: str) -> Iterator[Callable[[], Postgres]]:
    """Makes the pool of one more replica (closed at the end)."""
    made: list[Postgres] = []

    def make() -> Postgres:
        made.append(Postgres.connect(url))
        return made[-1]

    yield make
    for server in made:
        server.pool.close()


def job_store(server: Postgres, tmp_path: Path, **limits: Any) -> JobStore:
    values: dict[str, Any] = {"max_per_key": 10, "max_jobs": 100, "quota_bytes": 64 * MIB} | limits
    store = JobStore(
        tmp_path / "jobs",
        values["max_per_key"],
        values["max_jobs"],
        3600.0,
        quota_bytes=values["quota_bytes"],
        reserve_bytes=0,
        server=server,
    )
    store.db.migrate()
    return store


def rows(url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as db:
        return db.execute(query, params).fetchall()


def test_replicas_starting_at_once_migrate_each_store_once(
    replica: Callable[[], Postgres], url: str, tmp_path: Path
) -> None:
    servers = [replica() for _ in range(4)]
    start = threading.Barrier(len(servers))

    def migrate(server: Postgres) -> list[int]:
        databases = [
            JobStore(tmp_path, 1, 1, 1.0, quota_bytes=1, reserve_bytes=0, server=server).db,
            GlossaryStore(tmp_path, server=server).db,
            TranslationMemory(tmp_path, server=server).db,
        ]
        start.wait()
        return [db.migrate() for db in databases]

    with ThreadPoolExecutor(len(servers)) as pool:
        applied = list(pool.map(migrate, servers))
    # Each store's migrations applied once in all (by whichever replica took the lock first).
    assert [sum(column) for column in zip(*applied, strict=True)] == [6, 1, 1], applied
    versions = dict(rows(url, "SELECT store, version FROM schema_versions"))
    assert versions == {"jobs": 6, "glossaries": 1, "memory": 1}
    assert not (tmp_path / "jobs.sqlite3").exists()  # nothing written to the data directory


def test_a_job_made_through_one_replica_is_polled_claimed_and_downloaded_through_another(
    replica: Callable[[], Postgres], tmp_path: Path
) -> None:
    one, other = job_store(replica(), tmp_path / "1"), job_store(replica(), tmp_path / "2")
    upload = "Ein Hund läuft.\n".encode() * 200_000  # 3.2 MB: four parts in the database
    options = JobOptions(glossary=[("Hund", "dog")], beam_size=2)
    job = one.create("alice", "a.txt", "de", "en", options, upload)
    assert other.get("alice", job.id) == job and other.get("bob", job.id) is None
    claimed = other.claim({})
    assert claimed is not None and claimed.id == job.id and claimed.options == options
    assert one.claim({}) is None  # leased
    assert other.upload(job.id) == upload
    other.save_translations(job.id, ["A dog runs."])
    assert one.saved_translations(job.id) == ["A dog runs."]
    result = bytes(range(256)) * 10_000
    other.save_result(job.id, result)
    assert other.finish(job.id, "done", result_name="a_en.txt")
    parts = list(one.files.chunks(job.id, RESULT))
    assert b"".join(parts) == result and max(map(len, parts)) <= job_files.PART_BYTES and len(parts) == 3
    assert one.get("alice", job.id).state == "done"  # type: ignore[union-attr]
    assert [j.id for j in other.jobs_of("alice")] == [job.id]
    assert one.files.path(job.id, RESULT) is None and not (tmp_path / "1").exists()


def test_a_job_made_with_a_secret_is_found_through_any_replica_with_that_secret_only(
    replica: Callable[[], Postgres], tmp_path: Path
) -> None:
    """(DeepL's document_key: app/http/endpoints/deepl/documents.py keeps its digest as the secret.)"""
    one, other = job_store(replica(), tmp_path / "1"), job_store(replica(), tmp_path / "2")
    job = one.create("alice", "a.txt", "de", "en", JobOptions(), b"Ein Hund.", "", "d1gest")
    assert other.get("alice", job.id, "d1gest") == job == other.get("alice", job.id)
    assert other.get("alice", job.id, "other") is None and other.get("bob", job.id, "d1gest") is None
    plain = one.create("alice", "b.txt", "de", "en", JobOptions(), b"Eine Katze.")
    assert other.get("alice", plain.id, "d1gest") is None  # a job of /jobs has none


def test_concurrent_claims_from_replicas_take_each_job_once(
    replica: Callable[[], Postgres], tmp_path: Path
) -> None:
    stores = [job_store(replica(), tmp_path / str(i)) for i in range(3)]
    made = {stores[0].create(f"owner{i % 4}", "a.txt", "de", "en", JobOptions(), b"x").id for i in range(30)}

    def claim_all(store: JobStore) -> list[str]:
        claimed = []
        while (job := store.claim({})) is not None:
            claimed.append(job.id)
        return claimed

    with ThreadPoolExecutor(6) as pool:
        taken = [i for ids in pool.map(claim_all, stores * 2) for i in ids]
    assert sorted(taken) == sorted(made)  # each once


def test_a_lease_that_runs_out_passes_the_job_to_another_replica_with_its_progress(
    replica: Callable[[], Postgres], url: str, tmp_path: Path
) -> None:
    dead, alive = job_store(replica(), tmp_path / "1"), job_store(replica(), tmp_path / "2")
    dead.lease_s = 0.5
    job = dead.create("alice", "a.txt", "de", "en", JobOptions(), b"x")
    assert dead.claim({}) is not None
    dead.advance(job.id, "translating", done=1, total=2)
    dead.save_translations(job.id, ["one"])
    assert alive.claim({}) is None  # (dead stops renewing here)
    time.sleep(0.6)
    taken = alive.claim({})
    assert taken is not None and taken.id == job.id and taken.state == "translating"
    assert alive.saved_translations(job.id) == ["one"]
    (holder,) = rows(url, "SELECT holder FROM jobs")[0]
    assert holder.endswith(f":{os.getpid()}")


def test_a_keys_job_limit_holds_across_replicas_creating_at_once(
    replica: Callable[[], Postgres], tmp_path: Path
) -> None:
    stores = [job_store(replica(), tmp_path / str(i), max_per_key=3) for i in range(3)]
    start = threading.Barrier(12)

    def create(i: int) -> bool:
        start.wait()
        try:
            stores[i % 3].create("alice", "a.txt", "de", "en", JobOptions(), b"x" * 100)
        except JobsFull:
            return False
        return True

    with ThreadPoolExecutor(12) as pool:
        made = list(pool.map(create, range(12)))
    assert made.count(True) == 3
    assert len(stores[1].jobs_of("alice")) == 3


def test_the_storage_quota_counts_every_replicas_jobs(
    replica: Callable[[], Postgres], tmp_path: Path
) -> None:
    # A job counts its upload three times (itself, and room for its progress and result).
    one, other = (job_store(replica(), tmp_path / str(i), quota_bytes=MIB) for i in range(2))
    one.create("alice", "a.txt", "de", "en", JobOptions(), b"x" * 200_000)
    with pytest.raises(job_files.StorageFull, match="storage is full"):
        other.create("bob", "b.txt", "de", "en", JobOptions(), b"x" * 200_000)


def test_a_jobs_files_go_with_its_row_deleted_or_expired(
    replica: Callable[[], Postgres], url: str, tmp_path: Path
) -> None:
    store = job_store(replica(), tmp_path)
    kept, deleted, expired = (
        store.create("a", "a.txt", "de", "en", JobOptions(), b"x" * 10) for _ in range(3)
    )
    assert store.delete("a", deleted.id)
    store.finish(expired.id, "failed", error_status=500, error="lost")
    with store.db.writing() as db:
        db.execute("UPDATE jobs SET expires = 0 WHERE id = ?", (expired.id,))
    assert store.remove_expired() == 1
    left = {job for (job,) in rows(url, "SELECT DISTINCT job FROM job_files")}
    assert left == {kept.id}
    assert {name for (name,) in rows(url, "SELECT name FROM job_files")} == {UPLOAD, OPTIONS}


def test_files_without_a_row_are_swept_once_old(
    replica: Callable[[], Postgres], url: str, tmp_path: Path
) -> None:
    store = job_store(replica(), tmp_path)
    job = store.create("a", "a.txt", "de", "en", JobOptions(), b"x")
    store.files.write("orphan", UPLOAD, b"y")  # a process killed before its row committed
    assert store.sweep(grace_s=60) == 0  # young: maybe a row about to commit
    with store.db.writing() as db:
        db.execute("UPDATE job_files SET written = written - 120")
    assert store.sweep(grace_s=60) == 1
    assert {job for (job,) in rows(url, "SELECT DISTINCT job FROM job_files")} == {job.id}


def test_glossaries_and_memories_stored_through_one_replica_are_used_by_another(
    replica: Callable[[], Postgres], tmp_path: Path
) -> None:
    one, other = replica(), replica()
    glossaries = [GlossaryStore(tmp_path, server=s) for s in (one, other)]
    memories = [TranslationMemory(tmp_path, server=s) for s in (one, other)]
    for store in (*glossaries, *memories):
        store.db.migrate()
    entries = [GlossaryEntry("Hund", "hound"), GlossaryEntry("100% Wolle", "100% wool?")]
    made = glossaries[0].create("alice", "pets", "de", "en", entries)
    found = glossaries[1].get("alice", made.id)
    assert found is not None and found.entries == tuple(entries) and glossaries[1].get("bob", made.id) is None
    assert [g.id for g in glossaries[1].list("alice")] == [made.id]
    assert glossaries[1].delete("alice", made.id) and glossaries[0].get("alice", made.id) is None

    tsv = b"Ein  Hund.\tA hound.\nZwei Katzen.\tTwo cats.\n"
    assert memories[0].import_tsv("alice", "de", "en", tsv) == 2
    asked = ["Zwei Katzen. ", "Ein Hund.", "Drei Hunde.", "ein hund."]
    reference = TranslationMemory(tmp_path / "sqlite")  # the same import, in the SQLite default
    reference.import_tsv("alice", "de", "en", tsv)
    expected = reference.lookup_many("alice", "de-DE", "en", asked)
    assert expected == ["Two cats.", "A hound.", None, None]
    assert memories[1].lookup_many("alice", "de-DE", "en", asked) == expected
    assert memories[1].lookup_many("bob", "de", "en", asked) == [None] * 4
    assert memories[0].import_tsv("alice", "de", "en", b"Ein Hund.\tA dog.\n") == 1  # replaces
    assert memories[1].lookup("alice", "de", "en", "Ein Hund.") == "A dog."
    assert [(p.source_lang, p.segments) for p in memories[1].stats("alice")] == [("de", 2)]
    assert memories[1].delete("alice") == 2
    # An owner without a memory is not asked of the server again within a second (every keyed
    # /translate looks one up): another replica's first import is seen after it, this one's at once.
    assert memories[1].lookup("carol", "de", "en", "Ein Hund.") is None and memories[1].known_empty("carol")
    memories[0].import_tsv("carol", "de", "en", b"Ein Hund.\tA dog.\n")
    time.sleep(ABSENT_RECHECK_S)
    assert memories[1].lookup("carol", "de", "en", "Ein Hund.") == "A dog."
    assert memories[0].lookup("dave", "de", "en", "Ein Hund.") is None
    memories[0].import_tsv("dave", "de", "en", b"Ein Hund.\tA hound.\n")
    assert memories[0].lookup("dave", "de", "en", "Ein Hund.") == "A hound."


def test_a_database_url_that_cannot_be_used_is_one_line_naming_the_setting() -> None:
    for url, reason in [
        ("mysql://127.0.0.1/x", "must be a postgresql:// URL"),
        (f"postgresql://postgres@127.0.0.1:{free_port()}/postgres", "cannot connect to PostgreSQL"),
    ]:
        with pytest.raises(DatabaseUnusable) as raised:
            Postgres.connect(url)
        message = str(raised.value)
        assert message.startswith("NMT_DATABASE_URL") and reason in message and "\n" not in message


def test_a_server_restarted_mid_run_loses_nothing_and_is_used_again_once_back(
    replica: Callable[[], Postgres], postgres_server: PostgresServer, url: str, tmp_path: Path
) -> None:
    server = replica()
    store = job_store(server, tmp_path)
    job = store.create("alice", "a.txt", "de", "en", JobOptions(), b"Hallo.")
    assert store.claim({}) is not None
    store.save_translations(job.id, ["Hello."])
    postgres_server.stop()
    try:
        with pytest.raises(StoreUnavailable, match="NMT_DATABASE_URL"):
            store.get("alice", job.id)
        assert server.down() == "the database (NMT_DATABASE_URL) is unreachable"
    finally:
        postgres_server.start()
    server._check()  # (the probe, every PROBE_S): the pool's broken connections replaced
    assert server.down() is None
    assert store.get("alice", job.id) is not None
    assert store.saved_translations(job.id) == ["Hello."] and store.upload(job.id) == b"Hallo."


# --- SQLite: the default, versioned the same way --------------------------------------------------


@pytest.mark.parametrize(
    ("make", "schema", "row"),
    [
        (
            lambda d: GlossaryStore(d),
            glossary_module._SQLITE,
            "INSERT INTO glossaries VALUES ('g1', 'alice', 'pets', 'de', 'en', 1, 1.0);"
            "INSERT INTO entries VALUES ('g1', 0, 'Hund', 'dog')",
        ),
        (
            lambda d: TranslationMemory(d),
            memory_module._SQLITE,
            "INSERT INTO segments VALUES ('alice', 'de', 'en', 'Ein Hund.', 'A dog.')",
        ),
    ],
    ids=["glossaries", "memory"],
)
def test_a_sqlite_file_of_an_earlier_release_keeps_its_data_and_gets_its_version(
    tmp_path: Path, make: Callable[[Path], Any], schema: str, row: str
) -> None:
    store = make(tmp_path)
    old = sqlite3.connect(store.db.path)  # as the release before versions made it
    old.executescript(schema + row + ";")
    old.close()
    store = make(tmp_path)
    if isinstance(store, GlossaryStore):
        found = store.get("alice", "g1")
        assert found is not None and found.entries == (GlossaryEntry("Hund", "dog"),)
    else:
        assert store.lookup("alice", "de", "en", "Ein Hund.") == "A dog."
    with sqlite3.connect(store.db.path) as db:
        assert db.execute("SELECT version FROM schema_versions").fetchall() == [(1,)]


def test_a_download_stored_by_one_replica_is_taken_once_by_another_and_its_parts_go(
    replica: Callable[[], Postgres], url: str
) -> None:
    stores = []
    for server in (replica(), replica()):
        stores.append(SharedFileStore(server.database("downloads", DOWNLOAD_MIGRATIONS), 600.0, 8 * MIB))
        stores[-1].db.migrate()
    data = bytes(range(256)) * 7_000  # 1.8 MB: two parts (within an owner's quarter of 8 MiB)
    token = stores[0].put(data, "a_en.txt", "text/plain", "alice")
    assert stores[1].take(token, "other.txt") is None  # the name is part of the link
    taken = stores[1].take(token, "a_en.txt")
    assert taken is not None and (taken.name, taken.media_type) == ("a_en.txt", "text/plain")
    assert stores[0].take(token, "a_en.txt") is None  # once, whichever replica is asked
    assert b"".join(taken.chunks) == data
    assert rows(url, "SELECT COUNT(*) FROM download_files") == [(0,)]


def test_the_download_stores_bounds_hold_across_replicas(replica: Callable[[], Postgres], url: str) -> None:
    one, other = (
        SharedFileStore(replica().database("downloads", DOWNLOAD_MIGRATIONS), 600.0, 8 * MIB)
        for _ in range(2)
    )
    one.db.migrate()
    one.put(b"x" * (2 * MIB - 10), "a.txt", "text/plain", "alice")  # an owner's share: a quarter
    with pytest.raises(NoRoom, match="your translated files"):
        other.put(b"x" * 100, "b.txt", "text/plain", "alice")
    for owner in ("bob", "carol", "dave"):
        other.put(b"x" * (2 * MIB - 10), "c.txt", "text/plain", owner)
    with pytest.raises(NoRoom, match="too many translated files"):
        one.put(b"x" * 100, "d.txt", "text/plain", "erin")
    with other.db.writing() as db:  # bob's file expires
        db.execute("UPDATE downloads SET expires = 0 WHERE owner = 'bob'")
    one.put(b"z" * 100, "f.txt", "text/plain", "erin")  # its room taken back
    assert rows(url, "SELECT DISTINCT owner FROM downloads ORDER BY owner") == [
        ("alice",),
        ("carol",),
        ("dave",),
        ("erin",),
    ]
    assert rows(url, "SELECT COUNT(DISTINCT job) FROM download_files") == [(4,)]  # bob's parts gone


# --- the service ------------------------------------------------------------------------------------


def test_a_database_url_that_cannot_be_used_stops_the_start_with_one_line(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(model_dir, database_url=f"postgresql://postgres@127.0.0.1:{free_port()}/x")

    async def start() -> None:
        async with lifespan(create_app(settings)):
            pass

    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit):
        asyncio.run(start())
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "\n" not in lines[0], caplog.text
    assert lines[0].startswith("NMT_DATABASE_URL: cannot connect to PostgreSQL")


def test_the_database_lost_while_running_is_a_503_and_unready_until_it_is_back(
    model_dir: Path, postgres_server: PostgresServer, url: str
) -> None:
    def ready_within(client: TestClient, status: int) -> httpx.Response:
        deadline = time.monotonic() + 10
        while (answer := client.get("/health/ready")).status_code != status:
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.2)
        return answer

    with serve(make_settings(model_dir, database_url=url, shared_stores=True)) as client:
        assert client.get("/jobs").status_code == 200
        postgres_server.stop()
        try:
            lost = client.get("/jobs")
            assert_error(lost, 503, "retry later")
            assert lost.headers["Retry-After"]
            unready = ready_within(client, 503)
            assert unready.json()["error"] == "the database (NMT_DATABASE_URL) is unreachable"
            assert client.get("/health/live").status_code == 200
        finally:
            postgres_server.start()
        ready_within(client, 200)
        assert client.get("/jobs").status_code == 200
