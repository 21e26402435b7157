"""Document jobs (POST /jobs ... app.jobs): answered at once, translated in the background as
/translate_file would, with progress, cancel, results until they expire, each key's own, and
nothing accepted lost when the front end or a worker stops."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.jobs import runner as job_runner
from app.jobs import store as job_store
from app.jobs.runner import JobRunner
from app.jobs.store import PROGRESS
from model.translator import Translator
from tests.conftest import synthetic_sentences
from tests.test_api import assert_error, make_settings, serve

FINAL = ("done", "failed", "cancelled")
FORM = {"source": "de", "target": "en"}


def german(n: int, seed: int) -> list[str]:
    """``n`` distinct sentences (none repeated: the segment cache would answer a repeat)."""
    return list(dict.fromkeys(s for s in synthetic_sentences(4 * n, seed) if s.strip()))[:n]


def text_file(sentences: list[str]) -> bytes:
    return "\n".join(sentences).encode()


def submit(client: TestClient, name: str, data: bytes, **form: str) -> dict[str, Any]:
    response = client.post("/jobs", data={**FORM, **form}, files={"file": (name, data)})
    assert response.status_code == 202, response.text
    body: dict[str, Any] = response.json()
    assert response.headers["location"].endswith(f"/jobs/{body['id']}")
    return body


def wait(
    client: TestClient, job_id: str, until: tuple[str, ...] = FINAL, timeout_s: float = 120.0, **query: str
) -> dict[str, Any]:
    """The job once its state is one of ``until``; every state seen on the way is checked."""
    deadline = time.monotonic() + timeout_s
    last_done = 0
    while True:
        body: dict[str, Any] = client.get(f"/jobs/{job_id}", params=query).json()
        assert body["progress"]["done"] >= last_done  # progress never goes back
        last_done = body["progress"]["done"]
        if body["state"] in until:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    # (shared_stores: the list of jobs, without keys)
    settings = make_settings(
        model_dir, data_dir=tmp_path_factory.mktemp("data"), max_jobs_per_key=50, shared_stores=True
    )
    with serve(settings) as c:
        yield c


def test_a_job_is_answered_at_once_and_its_result_is_what_translate_file_gives(client: TestClient) -> None:
    data = text_file(german(40, seed=1))
    job = submit(client, "brief.txt", data)
    assert job["state"] == "queued" and job["progress"] == {"done": 0, "total": None}
    done = wait(client, job["id"])
    assert done["state"] == "done", done
    assert done["progress"] == {"done": 40, "total": 40} and done["detectedLanguage"] == "de"
    result = client.get(done["resultUrl"])
    assert result.status_code == 200
    assert 'filename="brief_en.txt"' in result.headers["content-disposition"]
    sync = client.post("/translate_file", data=FORM, files={"file": ("brief.txt", data)})
    assert result.content == client.get(sync.json()["translatedFileUrl"]).content
    # Downloadable again until it expires (unlike /translate_file's one download).
    assert client.get(done["resultUrl"]).content == result.content
    assert [j["id"] for j in client.get("/jobs").json()["jobs"]].count(job["id"]) == 1
    assert_error(client.post(f"/jobs/{job['id']}/cancel"), 409, "done already")


def test_progress_counts_the_sentences_done_chunk_by_chunk(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_runner, "CHUNK_SENTENCES", 7)
    job = submit(client, "a.txt", text_file(german(60, seed=2)))
    seen = set()
    while (body := client.get(f"/jobs/{job['id']}").json())["state"] not in FINAL:
        seen.add(body["progress"]["done"])
        time.sleep(0.01)
    assert body["state"] == "done" and body["progress"]["done"] == 60
    partial = {d for d in seen if 0 < d < 60}
    assert partial, seen  # seen between chunks, not only 0 and the end
    assert all(d % 7 == 0 for d in partial), seen


def test_a_cancelled_job_stops_and_has_no_result(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_runner, "CHUNK_SENTENCES", 4)
    job = submit(client, "long.txt", text_file(german(400, seed=3)))
    wait(client, job["id"], until=("translating", *FINAL))
    cancelled = client.post(f"/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    time.sleep(0.5)
    after = client.get(f"/jobs/{job['id']}").json()
    assert after["state"] == "cancelled" and after["progress"]["done"] < 400
    assert_error(client.get(f"/jobs/{job['id']}/result"), 409, "cancelled")
    assert client.delete(f"/jobs/{job['id']}").status_code == 204
    assert_error(client.get(f"/jobs/{job['id']}"), 404, "no such job")


def test_refusals_are_immediate_and_say_why(client: TestClient) -> None:
    assert_error(
        client.post("/jobs", data=FORM, files={"file": ("a.exe", b"MZ")}), 400, "unsupported file format"
    )
    assert_error(
        client.post("/jobs", data={"source": "de", "target": "zz"}, files={"file": ("a.txt", b"x")}), 400
    )
    assert_error(client.get("/jobs/nope"), 404, "no such job")
    # A file that cannot be read is accepted, then fails with the status /translate_file answers.
    job = submit(client, "bad.txt", b"\xff\xfe not utf-8")
    failed = wait(client, job["id"])
    assert failed["state"] == "failed" and failed["error"]["status"] == 400, failed
    assert "UTF-8" in failed["error"]["message"]


def test_each_key_sees_only_its_own_jobs_and_holds_at_most_its_limit(model_dir: Path, tmp_path: Path) -> None:
    settings = make_settings(model_dir, api_keys="k1,k2", data_dir=tmp_path, max_jobs_per_key=2, warmup=False)
    with serve(settings) as client:
        first = submit(client, "a.txt", b"Ein Hund.", api_key="k1")
        submit(client, "b.txt", b"Eine Katze.", api_key="k1")
        full = client.post("/jobs", data={**FORM, "api_key": "k1"}, files={"file": ("c.txt", b"Ein Kind.")})
        assert_error(full, 429, "at most 2")
        assert_error(client.get(f"/jobs/{first['id']}", params={"api_key": "k2"}), 404)
        assert client.get("/jobs", params={"api_key": "k2"}).json()["jobs"] == []
        assert_error(client.get(f"/jobs/{first['id']}"), 403)
        assert wait(client, first["id"], api_key="k1")["state"] == "done"
        assert client.delete(f"/jobs/{first['id']}", params={"api_key": "k2"}).status_code == 404


def test_a_job_accepted_before_a_restart_is_finished_after_it_from_its_last_saved_chunk(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, translator: Translator
) -> None:
    sentences = german(30, seed=4)
    settings = make_settings(model_dir, data_dir=tmp_path, warmup=False)
    monkeypatch.setattr(JobRunner, "start", lambda self: None)  # a front end that stops at once
    with serve(settings) as client:
        job = submit(client, "a.txt", text_file(sentences))
    # As if the first chunk had been translated and saved before the stop: kept, not redone.
    saved = [f"SAVED {i}" for i in range(10)]
    (tmp_path / "jobs" / job["id"] / PROGRESS).write_text(json.dumps(saved) + "\n")
    monkeypatch.undo()
    with serve(settings) as client:
        done = wait(client, job["id"])
        assert done["state"] == "done" and done["progress"]["done"] == 30
        lines = client.get(done["resultUrl"]).text.split("\n")
    expected = [r.hypotheses[0] for r in translator.translate_batch(sentences[10:], beam_size=5)]
    assert lines == saved + expected


def test_a_job_survives_a_worker_killed_in_the_middle(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, translator: Translator
) -> None:
    monkeypatch.setattr(job_runner, "CHUNK_SENTENCES", 4)
    sentences = german(60, seed=5)
    job = submit(client, "a.txt", text_file(sentences))
    wait(client, job["id"], until=("translating", *FINAL))
    worker = client.app.state.services.scheduler.workers[0].worker  # type: ignore[attr-defined]
    os.kill(worker.pid, signal.SIGKILL)
    done = wait(client, job["id"], timeout_s=180)
    assert done["state"] == "done", done
    lines = client.get(done["resultUrl"]).text.split("\n")
    assert lines == [r.hypotheses[0] for r in translator.translate_batch(sentences, beam_size=5)]


def test_a_long_job_and_eight_typing_clients_share_the_workers(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a long job translates, 8 clients each get their typed lines answered, one after the
    other, before the job ends (its sentences decode apart, after theirs); then the job goes on to
    the end: neither waits for the other to finish."""
    monkeypatch.setattr(job_runner, "CHUNK_SENTENCES", 8)
    job = submit(client, "long.txt", text_file(german(200, seed=6)))
    wait(client, job["id"], until=("translating", *FINAL))
    lines = german(8 * 8, seed=7)
    latencies: list[float] = []

    def typist(mine: list[str]) -> None:
        for line in mine:
            start = time.monotonic()
            response = client.post("/translate", json={**FORM, "q": line})
            assert response.status_code == 200
            latencies.append(time.monotonic() - start)

    threads = [threading.Thread(target=typist, args=(lines[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    during = client.get(f"/jobs/{job['id']}").json()
    assert len(latencies) == 64
    assert during["state"] == "translating", during  # every typed line was answered before the job ended
    done = wait(client, job["id"], timeout_s=180)
    assert done["state"] == "done" and done["progress"]["done"] == 200


def test_a_job_stopped_with_the_service_goes_on_at_once_when_it_starts_again(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, translator: Translator
) -> None:
    monkeypatch.setattr(job_runner, "CHUNK_SENTENCES", 4)
    sentences = german(80, seed=8)
    settings = make_settings(model_dir, data_dir=tmp_path, warmup=False)
    with serve(settings) as client:
        job = submit(client, "a.txt", text_file(sentences))
        stopped = wait(client, job["id"], until=("translating", *FINAL))
        while stopped["progress"]["done"] == 0:
            stopped = client.get(f"/jobs/{job['id']}").json()
    assert stopped["state"] == "translating"
    with serve(settings) as client:
        # Its lease was given back at the stop: taken up now, not once the lease runs out.
        done = wait(client, job["id"], timeout_s=job_store.LEASE_S - 5)
        assert done["state"] == "done" and done["progress"]["done"] == 80
        lines = client.get(done["resultUrl"]).text.split("\n")
    assert lines == [r.hypotheses[0] for r in translator.translate_batch(sentences, beam_size=5)]
