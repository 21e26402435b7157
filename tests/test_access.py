"""Who may use what, over HTTP (app/http/endpoints/access.py, app/keys/limits.py): without keys the stores
every stranger would share are off unless NMT_SHARED_STORES shares them, a job stays reachable by
its id; the writes of the stores and jobs refuse what a page of another site sends; a failing
store's 503 names no file."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.stores.database.errors import StoreUnavailable
from app.terminology.memory import TranslationMemory
from tests.test_api import assert_error, make_settings, serve

FORM = {"source": "de", "target": "en"}
SENTENCE = "Zwei Katzen schlafen auf dem Sofa."
REMEMBERED = "Two cats doze on the sofa (from memory)."
STORES_OFF = "NMT_SHARED_STORES=true"


def wait_done(client: TestClient, job_id: str, timeout_s: float = 120.0, **headers: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job: dict[str, Any] = client.get(f"/jobs/{job_id}", headers=headers).json()
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def submit(client: TestClient, text: bytes = b"Ein Hund.", **headers: str) -> dict[str, Any]:
    response = client.post("/jobs", data=FORM, files={"file": ("a.txt", text)}, headers=headers)
    assert response.status_code == 202, response.text
    job: dict[str, Any] = response.json()
    return job


# --- keys off, stores not shared (the default) --------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A memory left by a run that shared its stores: one segment of the keyless owner ""."""
    directory = tmp_path_factory.mktemp("data")
    memory = TranslationMemory(directory, 100, 1 << 20)
    assert memory.import_tsv("", "de", "en", f"{SENTENCE}\t{REMEMBERED}\n".encode()) == 1
    memory.close()
    return directory


@pytest.fixture(scope="module")
def closed(model_dir: Path, data_dir: Path) -> Iterator[TestClient]:
    with serve(make_settings(model_dir, data_dir=data_dir, warmup=False)) as client:
        yield client


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/glossaries"),
        ("POST", "/glossaries"),
        ("GET", "/glossaries/some-id"),
        ("DELETE", "/glossaries/some-id"),
        ("GET", "/memories"),
        ("POST", "/memories"),
        ("DELETE", "/memories"),
        ("GET", "/jobs"),
    ],
)
def test_without_keys_the_shared_stores_are_403_naming_the_setting(
    closed: TestClient, method: str, path: str
) -> None:
    body = {
        "name": "g",
        "source_lang": "de",
        "target_lang": "en",
        "entries": [{"source": "a", "target": "b"}],
    }
    response = closed.request(method, path, json=body if method == "POST" else None)
    assert_error(response, 403, "need an API key", STORES_OFF)


def test_without_keys_a_glossary_id_is_403_wherever_it_is_named(closed: TestClient) -> None:
    translated = closed.post("/translate", json={"q": "Ein Hund.", **FORM, "glossary_id": "g1"})
    assert_error(translated, 403, STORES_OFF)
    upload = {"file": ("a.txt", b"Ein Hund.")}
    assert_error(
        closed.post("/translate_file", data={**FORM, "glossary_id": "g1"}, files=upload), 403, STORES_OFF
    )
    assert_error(closed.post("/jobs", data={**FORM, "glossary_id": "g1"}, files=upload), 403, STORES_OFF)
    assert closed.post("/translate", json={"q": "Ein Hund.", **FORM}).status_code == 200  # without it: served


def test_without_keys_a_job_is_reachable_by_its_id_alone(closed: TestClient) -> None:
    job = submit(closed)
    assert_error(closed.get("/jobs"), 403, STORES_OFF)  # the list would show everyone's
    done = wait_done(closed, job["id"])
    assert done["state"] == "done", done
    assert closed.get(f"/jobs/{job['id']}/result").status_code == 200
    assert_error(closed.post(f"/jobs/{job['id']}/cancel"), 409, "done already")
    assert closed.delete(f"/jobs/{job['id']}").status_code == 204
    assert_error(closed.get(f"/jobs/{job['id']}"), 404)
    other = submit(closed)
    assert closed.post(f"/jobs/{other['id']}/cancel").status_code in (200, 409)  # (it may be done)
    assert closed.delete(f"/jobs/{other['id']}").status_code == 204


def test_without_keys_translate_skips_the_memory_unless_the_stores_are_shared(
    closed: TestClient, model_dir: Path, data_dir: Path
) -> None:
    body = {"q": SENTENCE, **FORM}
    alone = closed.post("/translate", json=body).json()
    assert alone["translatedText"] != REMEMBERED and "terminology" not in alone  # the model's
    with serve(make_settings(model_dir, data_dir=data_dir, warmup=False, shared_stores=True)) as shared:
        assert shared.post("/translate", json=body).json()["translatedText"] == REMEMBERED


def with_client_address(app: Any) -> Any:
    """``app`` behind a stand-in for a network: each request comes from the address of its
    ``X-Test-Client`` header (TestClient gives every request one address)."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"x-test-client")
            if host is not None:
                scope = {**scope, "client": (host.decode(), 40000)}
        await app(scope, receive, send)

    return asgi


def test_without_keys_each_client_address_has_a_segment_cache_of_its_own(
    model_dir: Path, tmp_path: Path, jobs: list[Any]
) -> None:
    """A cached answer is the asker's own: another stranger's identical sentence is decoded, so
    the speed of its answer cannot tell it what the first one translated."""
    settings = make_settings(model_dir, data_dir=tmp_path, warmup=False)
    with TestClient(with_client_address(create_app(settings))) as client:

        def ask(address: str) -> str:
            body = {"q": "Ein Vogel singt im Garten.", **FORM}
            response = client.post("/translate", json=body, headers={"X-Test-Client": address})
            assert response.status_code == 200, response.text
            text: str = response.json()["translatedText"]
            return text

        first = ask("10.0.0.1")
        assert len(jobs) == 1
        assert ask("10.0.0.1") == first and len(jobs) == 1  # the same client: its cache answers
        assert ask("10.0.0.2") == first and len(jobs) == 2  # another one: decoded for it


# --- cross-site writes ----------------------------------------------------------------------------------

OTHER_SITES = [
    {"Sec-Fetch-Site": "cross-site", "Origin": "https://evil.example"},
    {"Sec-Fetch-Site": "same-site", "Origin": "http://other.testserver"},
    {"Sec-Fetch-Site": "cross-site"},  # (a browser may leave Origin out: a form's GET-like POST)
    {"Origin": "https://evil.example"},  # a browser without Sec-Fetch-*
    {"Origin": "null"},  # a sandboxed frame, a file: page
    {"Origin": "https://testserver"},  # another scheme is another origin
    {"Origin": "http://testserver:8080"},  # and another port
]
SAME_ORIGIN = [
    {},  # curl, an SDK
    {"Origin": "http://testserver"},
    {"Origin": "http://testserver:80"},  # the default port written out
    {"Sec-Fetch-Site": "same-origin", "Origin": "http://testserver"},
    # Behind a proxy that rewrote Host, the browser's own word is taken over the Origin's.
    {"Sec-Fetch-Site": "same-origin", "Origin": "https://nmt.example.org"},
]


@pytest.fixture(scope="module")
def shared(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = make_settings(
        model_dir, data_dir=tmp_path_factory.mktemp("data"), warmup=False, shared_stores=True
    )
    with serve(settings) as client:
        yield client


def glossary(client: TestClient, **headers: str) -> Any:
    body = {
        "name": "g",
        "source_lang": "de",
        "target_lang": "en",
        "entries": [{"source": "a", "target": "b"}],
    }
    return client.post("/glossaries", json=body, headers=headers)


UNIQUE = itertools.count()


def memory(client: TestClient, **headers: str) -> Any:
    """Imports a segment never imported before: one more in the memory if it is written."""
    tsv = {"file": ("m.tsv", f"Satz {next(UNIQUE)}.\tSentence.\n".encode())}
    return client.post(
        "/memories", data={"source_lang": "de", "target_lang": "en"}, files=tsv, headers=headers
    )


def segments(client: TestClient) -> int:
    count: int = client.get("/memories").json()["segments"]
    return count


def glossary_ids(client: TestClient) -> list[str]:
    return [g["id"] for g in client.get("/glossaries").json()["glossaries"]]


def job_ids(client: TestClient) -> list[str]:
    return [j["id"] for j in client.get("/jobs").json()["jobs"]]


Write = Callable[[TestClient, dict[str, str]], Any]


def writes(client: TestClient) -> dict[str, tuple[Write, Callable[[], Any], tuple[int, ...]]]:
    """Each write: how to send it, what it would change, and its statuses when let through (a
    cancel: 409 once the job is done; the tiny model may be that fast)."""
    made = glossary(client).json()["id"]
    job = submit(client)["id"]
    assert memory(client).status_code == 200
    return {
        "POST /glossaries": (lambda c, h: glossary(c, **h), lambda: glossary_ids(client), (201,)),
        "DELETE /glossaries/{id}": (
            lambda c, h: c.delete(f"/glossaries/{made}", headers=h),
            lambda: glossary_ids(client),
            (204,),
        ),
        "POST /memories": (lambda c, h: memory(c, **h), lambda: segments(client), (200,)),
        "DELETE /memories": (lambda c, h: c.delete("/memories", headers=h), lambda: segments(client), (200,)),
        "POST /jobs": (lambda c, h: submit_raw(c, h), lambda: job_ids(client), (202,)),
        "POST /jobs/{id}/cancel": (
            lambda c, h: c.post(f"/jobs/{job}/cancel", headers=h),
            # (Whether it was cancelled: the job itself moves on from "writing" to "done" meanwhile.)
            lambda: client.get(f"/jobs/{job}").json()["state"] == "cancelled",
            (200, 409),
        ),
        "DELETE /jobs/{id}": (
            lambda c, h: c.delete(f"/jobs/{job}", headers=h),
            lambda: job_ids(client),
            (204,),
        ),
    }


def submit_raw(client: TestClient, headers: dict[str, str]) -> Any:
    return client.post("/jobs", data=FORM, files={"file": ("a.txt", b"Ein Hund.")}, headers=headers)


def test_every_write_of_the_stores_and_jobs_refuses_another_sites_request(shared: TestClient) -> None:
    for name, (write, holds, _) in writes(shared).items():
        before = holds()
        for headers in OTHER_SITES:
            response = write(shared, headers)
            assert_error(response, 403, "another site")
            assert holds() == before, (name, headers)  # nothing was written


@pytest.mark.parametrize(
    "headers", SAME_ORIGIN, ids=lambda h: ",".join(f"{k}={v}" for k, v in h.items()) or "none"
)
def test_the_pages_own_writes_and_clients_without_a_browser_pass(
    shared: TestClient, headers: dict[str, str]
) -> None:
    for name, (write, holds, passed) in writes(shared).items():
        before = holds()
        response = write(shared, headers)
        assert response.status_code in passed, (name, response.text)
        assert name.endswith("/cancel") or holds() != before, name  # written


def test_reads_are_not_refused_for_their_origin(shared: TestClient) -> None:
    for headers in OTHER_SITES:
        assert shared.get("/glossaries", headers=headers).status_code == 200
        assert shared.get("/memories", headers=headers).status_code == 200
        assert shared.post("/translate", json={"q": "Ein Hund.", **FORM}, headers=headers).status_code == 200


def test_a_cross_site_write_is_refused_before_its_body_is_read(shared: TestClient) -> None:
    for method, path in [("POST", "/glossaries"), ("POST", "/memories"), ("POST", "/jobs")]:
        status, _, asked = shared.portal.call(  # type: ignore[union-attr]
            without_body, shared.app, method, path, {"Sec-Fetch-Site": "cross-site"}
        )
        assert (status, asked) == (403, False), path


async def without_body(
    app: Any, method: str, path: str, headers: dict[str, str], query: str = ""
) -> tuple[int, dict[str, str], bool]:
    """``app``'s answer to a request whose headers arrive and whose body never does (a declared
    Content-Length of 10 MB, nothing sent): its status, headers, and whether it asked for the
    body. An app that waited for the body would not answer: the test fails on the time-out."""
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked = True
        await asyncio.Event().wait()  # never set: the client is still "sending"
        raise AssertionError("unreachable")

    answer: dict[str, Any] = {}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.update(message)

    given = {
        "host": "testserver",
        "content-type": "multipart/form-data; boundary=b",
        "content-length": "10000000",
        **{k.lower(): v for k, v in headers.items()},
    }
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in given.items()],
        "client": ("testclient", 50000),
        "server": ("testserver", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=20)
    response_headers = {k.decode().lower(): v.decode() for k, v in answer.get("headers", [])}
    return int(answer["status"]), response_headers, asked


# --- a store that fails: 503 without its path ------------------------------------------------------------

DETAIL = "cannot read /srv/nmt-private/store.sqlite3: disk I/O error"


def broken(*args: Any, **kwargs: Any) -> Any:
    raise StoreUnavailable(DETAIL)


@pytest.mark.parametrize(
    ("store", "method", "request_"),
    [
        ("glossaries", "list", lambda c: c.get("/glossaries")),
        ("glossaries", "create", lambda c: glossary(c)),
        ("memory", "stats", lambda c: c.get("/memories")),
        ("memory", "import_tsv", lambda c: memory(c)),
        ("jobs", "jobs_of", lambda c: c.get("/jobs")),
        ("jobs", "get", lambda c: c.get("/jobs/some-id")),
    ],
)
def test_a_failing_stores_503_names_no_path_and_the_log_does(
    shared: TestClient,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    store: str,
    method: str,
    request_: Callable[[TestClient], Any],
) -> None:
    monkeypatch.setattr(getattr(shared.app.state.services, store), method, broken)  # type: ignore[attr-defined]
    with caplog.at_level(logging.ERROR):
        response = request_(shared)
    assert_error(response, 503, "unavailable now")
    assert "/srv" not in response.text and "sqlite3" not in response.text and "I/O" not in response.text
    assert "Retry-After" in response.headers
    assert DETAIL in caplog.text  # for the operator
