"""Three replicas are one service (NMT_DATABASE_URL, NMT_REDIS_URL): three ``uvicorn app.main:app``
processes, each with its own NMT_DATA_DIR, one real PostgreSQL and one real Redis
(tests/postgres_server.py, tests/redis_server.py), asked in turn as a round-robin balancer would.
A job posted to one is polled, downloaded, cancelled and deleted through the others; a glossary
stored through one is used by another; PostgreSQL restarted mid-job loses nothing; the replica
running a job, SIGKILLed, has its job finished by another, once."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.conftest import synthetic_sentences
from tests.postgres_server import PostgresServer, reset
from tests.redis_server import RedisServer
from tests.test_keys import write_keys
from tests.test_server import Server, start_server, stop, wait_ready

KEY = "team-secret"
FINAL = ("done", "failed", "cancelled")
LEASE_S = 3  # NMT_JOB_LEASE_S: a killed replica's job is taken up this long after its last renewal


@pytest.fixture(scope="module")
def replicas(
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
) -> Iterator[list[Server]]:
    reset(postgres_server.url)
    directory = tmp_path_factory.mktemp("replicas")
    keys = write_keys(directory, f'[[keys]]\nname = "team"\nkey = "{KEY}"\n')
    servers = [
        start_server(
            directory / f"replica-{i}.log",
            NMT_MODEL_DIR=str(model_dir),
            NMT_API_KEYS_FILE=str(keys),
            NMT_DATABASE_URL=postgres_server.url,
            NMT_REDIS_URL=redis_server.url,
            NMT_DATA_DIR=str(directory / f"data-{i}"),
            NMT_JOB_LEASE_S=str(LEASE_S),
            NMT_SEGMENT_CACHE_MB="0",  # each sentence decoded: a taken-over job is not answered from memory
        )
        for i in range(3)
    ]
    try:
        for server in servers:
            wait_ready(server)
        yield servers
    finally:
        for server in servers:
            if server.process.poll() is None:
                stop(server)
    for i in range(3):  # nothing of the jobs' was kept in a replica's own directory
        assert not (directory / f"data-{i}" / "jobs").exists()


def ask(server: Server, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(
        method, server.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60, **kwargs
    )


def document(n: int, seed: int) -> bytes:
    sentences = list(dict.fromkeys(s for s in synthetic_sentences(4 * n, seed) if s.strip()))[:n]
    return "\n".join(sentences).encode()


def post_job(server: Server, data: bytes) -> str:
    response = ask(
        server, "POST", "/jobs", data={"source": "de", "target": "en"}, files={"file": ("a.txt", data)}
    )
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def wait(
    servers: list[Server], job_id: str, until: tuple[str, ...], timeout_s: float = 180.0
) -> dict[str, Any]:
    """The job once its state is one of ``until`` (and ``done`` > 0 for "translating"), polled through
    each of ``servers`` in turn."""
    deadline = time.monotonic() + timeout_s
    turn = 0
    while True:
        response = ask(servers[turn % len(servers)], "GET", f"/jobs/{job_id}")
        turn += 1
        if response.status_code == 200:  # (503 while the database restarts)
            body: dict[str, Any] = response.json()
            if body["state"] in until and (body["state"] != "translating" or body["progress"]["done"] > 0):
                return body
        assert time.monotonic() < deadline, response.text
        time.sleep(0.1)


def translated_file(server: Server, data: bytes) -> bytes:
    """What /translate_file gives for ``data``: the reference a job's result must equal."""
    response = ask(
        server,
        "POST",
        "/translate_file",
        data={"source": "de", "target": "en"},
        files={"file": ("a.txt", data)},
    )
    assert response.status_code == 200, response.text
    return ask(server, "GET", response.json()["translatedFileUrl"].removeprefix(server.url)).content


def test_a_job_posted_to_one_replica_is_polled_and_downloaded_through_the_others(
    replicas: list[Server],
) -> None:
    data = document(30, seed=11)
    job_id = post_job(replicas[0], data)
    done = wait(replicas[1:], job_id, FINAL)
    assert done["state"] == "done" and done["progress"] == {"done": 30, "total": 30}, done
    results = [ask(server, "GET", f"/jobs/{job_id}/result") for server in replicas]
    assert [r.status_code for r in results] == [200] * 3
    assert 'filename="a_en.txt"' in results[2].headers["content-disposition"]
    assert (
        results[0].content == results[1].content == results[2].content == translated_file(replicas[2], data)
    )
    for server in replicas:
        assert job_id in [job["id"] for job in ask(server, "GET", "/jobs").json()["jobs"]]


def test_a_translated_files_download_link_works_once_on_any_replica(replicas: list[Server]) -> None:
    data = document(20, seed=15)
    form = {"source": "de", "target": "en"}
    made = ask(replicas[0], "POST", "/translate_file", data=form, files={"file": ("b.txt", data)})
    assert made.status_code == 200, made.text
    link = made.json()["translatedFileUrl"].removeprefix(replicas[0].url)
    downloaded = ask(replicas[1], "GET", link)
    assert (
        downloaded.status_code == 200 and 'filename="b_en.txt"' in downloaded.headers["content-disposition"]
    )
    assert downloaded.content == translated_file(replicas[2], data)  # (its own link, on its own replica)
    assert ask(replicas[2], "GET", link).status_code == 404  # once, whichever replica is asked
    assert ask(replicas[0], "GET", link).status_code == 404


def test_a_job_is_cancelled_and_deleted_through_other_replicas(replicas: list[Server]) -> None:
    job_id = post_job(replicas[0], document(800, seed=12))
    wait(replicas[1:2], job_id, ("translating", *FINAL))
    cancelled = ask(replicas[2], "POST", f"/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled", cancelled.text
    assert ask(replicas[0], "GET", f"/jobs/{job_id}").json()["state"] == "cancelled"
    assert ask(replicas[1], "DELETE", f"/jobs/{job_id}").status_code == 204
    assert ask(replicas[2], "GET", f"/jobs/{job_id}").status_code == 404


def test_a_glossary_stored_through_one_replica_is_used_by_another(replicas: list[Server]) -> None:
    entries = [{"source": "Hund", "target": "hound"}]
    body = {"name": "pets", "source_lang": "de", "target_lang": "en", "entries": entries}
    made = ask(replicas[0], "POST", "/glossaries", json=body)
    assert made.status_code == 201, made.text
    glossary_id = made.json()["id"]
    assert [g["id"] for g in ask(replicas[1], "GET", "/glossaries").json()["glossaries"]] == [glossary_id]
    q = {"q": "Der Hund läuft im Park.", "source": "de", "target": "en"}
    by_id = ask(replicas[2], "POST", "/translate", json={**q, "glossary_id": glossary_id})
    inline = ask(replicas[2], "POST", "/translate", json={**q, "glossary": entries})
    assert by_id.status_code == 200 and by_id.json() == inline.json(), by_id.text
    assert ask(replicas[1], "DELETE", f"/glossaries/{glossary_id}").status_code == 204
    gone = ask(replicas[2], "POST", "/translate", json={**q, "glossary_id": glossary_id})
    assert gone.status_code == 404


def test_postgresql_restarted_mid_job_loses_nothing(
    replicas: list[Server], postgres_server: PostgresServer
) -> None:
    data = document(600, seed=13)
    job_id = post_job(replicas[0], data)
    wait(replicas, job_id, ("translating", *FINAL))
    postgres_server.stop()
    try:
        unready = ask(replicas[1], "GET", "/health/ready")
        down = ask(replicas[1], "GET", f"/jobs/{job_id}")
        time.sleep(1)
    finally:
        postgres_server.start()
    assert down.status_code == 503 and down.headers["Retry-After"], down.text
    assert unready.status_code in (200, 503)  # (its probe runs every 2 s: 503 once it has looked)
    done = wait(replicas, job_id, FINAL)
    assert done["state"] == "done" and done["progress"] == {"done": 600, "total": 600}, done
    assert ask(replicas[2], "GET", f"/jobs/{job_id}/result").content == translated_file(replicas[1], data)
    assert all(ask(server, "GET", "/health/ready").status_code == 200 for server in replicas)


def test_the_replica_running_a_job_sigkilled_has_it_finished_by_another_once(
    replicas: list[Server], postgres_server: PostgresServer
) -> None:
    data = document(600, seed=14)
    job_id = post_job(replicas[0], data)
    wait(replicas, job_id, ("translating",))
    with psycopg.connect(postgres_server.url) as db:
        (holder,) = db.execute("SELECT holder FROM jobs WHERE id = %s", (job_id,)).fetchone() or ("",)
    pid = int(holder.rsplit(":", 1)[1])
    (running,) = [server for server in replicas if server.process.pid == pid]
    os.kill(pid, signal.SIGKILL)
    running.process.wait(10)
    others = [server for server in replicas if server is not running]
    done = wait(others, job_id, FINAL)
    assert done["state"] == "done" and done["progress"] == {"done": 600, "total": 600}, done
    # Exactly once: every sentence's translation once, in order (no chunk lost or saved twice).
    assert ask(others[0], "GET", f"/jobs/{job_id}/result").content == translated_file(others[1], data)
    with psycopg.connect(postgres_server.url) as db:
        (taken_by,) = db.execute("SELECT holder FROM jobs WHERE id = %s", (job_id,)).fetchone() or ("",)
    assert taken_by != holder
