"""The key before the body (app/keys/limits.py ``admit_given_key``): given in a header
(``Authorization: Bearer``, ``X-API-Key``) or the query, it is checked before a byte of the body
is read and before an upload takes a place; the body's ``api_key`` field still works, and may not
name another key. Looking at jobs counts under the key's limits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.test_access import without_body
from tests.test_api import assert_error, make_settings, serve
from tests.test_keys import write_keys

T0 = 1_700_000_000.0
KEYS = """
[[keys]]
name = "open"
key = "open-secret"

[[keys]]
name = "other"
key = "other-secret"

[[keys]]
name = "tight"
key = "tight-secret"
requests_per_minute = 1

[[keys]]
name = "poller"
key = "poller-secret"
requests_per_minute = 3
"""
FORM = {"source": "de", "target": "en"}
# Every route that takes a body and a key.
BODIES = [
    ("POST", "/translate"),
    ("POST", "/detect"),
    ("POST", "/translate_file"),
    ("POST", "/jobs"),
    ("POST", "/glossaries"),
    ("POST", "/memories"),
]
WAYS = {
    "bearer": lambda key: ({"Authorization": f"Bearer {key}"}, ""),
    "header": lambda key: ({"X-API-Key": key}, ""),
    "query": lambda key: ({}, f"api_key={key}"),
}


@pytest.fixture(scope="module")
def keyed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    keys = write_keys(tmp_path_factory.mktemp("keys"), KEYS)
    settings = make_settings(
        model_dir,
        api_keys_file=keys,
        data_dir=tmp_path_factory.mktemp("data"),
        warmup=False,
        max_file_requests=1,
    )
    with serve(settings) as client:
        client.app.state.services.keys.store.clock = lambda: T0  # type: ignore[attr-defined]  # windows stand still
        yield client


def asgi(client: TestClient, method: str, path: str, headers: dict[str, str], query: str = "") -> Any:
    return client.portal.call(without_body, client.app, method, path, headers, query)  # type: ignore[union-attr]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("method", "path"), BODIES)
def test_an_unknown_key_before_the_body_is_403_at_once(
    keyed: TestClient, method: str, path: str, way: str
) -> None:
    headers, query = WAYS[way]("nope-secret")
    status, _, asked = asgi(keyed, method, path, headers, query)
    assert (status, asked) == (403, False)


@pytest.mark.parametrize(("method", "path"), BODIES)
def test_a_key_over_its_limit_before_the_body_is_429_at_once_with_retry_after(
    keyed: TestClient, method: str, path: str
) -> None:
    store = keyed.app.state.services.keys.store  # type: ignore[attr-defined]
    store.clock = lambda: T0 + 3600 * BODIES.index((method, path))  # a fresh minute for each path
    assert (
        keyed.get("/glossaries", headers={"X-API-Key": "tight-secret"}).status_code == 200
    )  # its 1 a minute
    status, headers, asked = asgi(keyed, method, path, {"X-API-Key": "tight-secret"})
    assert (status, asked) == (429, False)
    assert int(headers["retry-after"]) > 0


def test_a_refused_key_never_takes_an_uploads_place(keyed: TestClient) -> None:
    """NMT_MAX_FILE_REQUESTS is 1: a good key's upload that has not arrived holds the place; a bad
    key is 403 meanwhile, not 503 (it was refused before it would take a place), a good one 503."""

    async def scenario() -> tuple[int, int]:
        places = keyed.app.state.services.file_requests  # type: ignore[attr-defined]
        holder = asyncio.create_task(
            # (within the file limit: a larger Content-Length would be refused, 413, without waiting)
            without_body(
                keyed.app, "POST", "/translate_file", {"X-API-Key": "open-secret", "Content-Length": "1000"}
            )
        )
        try:
            async with asyncio.timeout(20):
                while places.count == 0:  # until the upload holds the place, waiting for its body
                    await asyncio.sleep(0.01)
            bad, _, _ = await without_body(keyed.app, "POST", "/translate_file", {"X-API-Key": "nope-secret"})
            good, _, _ = await without_body(keyed.app, "POST", "/jobs", {"X-API-Key": "other-secret"})
        finally:
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holder  # its place given back before the next test
        return bad, good

    assert keyed.portal.call(scenario) == (403, 503)  # type: ignore[union-attr]


def upload(
    client: TestClient, form: dict[str, str], headers: dict[str, str] | None = None, query: str = ""
) -> Any:
    path = "/translate_file" + (f"?{query}" if query else "")
    return client.post(path, data={**FORM, **form}, files={"file": ("a.txt", b"Ein Hund.")}, headers=headers)


def test_the_form_field_still_works_and_may_not_name_another_key(keyed: TestClient) -> None:
    assert upload(keyed, {"api_key": "open-secret"}).status_code == 200  # LibreTranslate's way
    assert_error(upload(keyed, {"api_key": "nope-secret"}), 403, "invalid api_key")
    assert upload(keyed, {}, {"X-API-Key": "open-secret"}).status_code == 200
    assert (
        upload(keyed, {"api_key": "open-secret"}, {"Authorization": "Bearer open-secret"}).status_code == 200
    )
    assert_error(
        upload(keyed, {"api_key": "other-secret"}, {"X-API-Key": "open-secret"}), 400, "X-API-Key header"
    )
    assert_error(
        upload(keyed, {"api_key": "nope"}, {"Authorization": "Bearer open-secret"}), 400, "Authorization"
    )
    assert_error(
        upload(keyed, {"api_key": "other-secret"}, query="api_key=open-secret"), 400, "query parameter"
    )
    two = upload(keyed, {}, {"X-API-Key": "open-secret"}, query="api_key=other-secret")
    assert_error(two, 400, "the X-API-Key header and the api_key query parameter give different API keys")
    translated = keyed.post(
        "/translate",
        json={"q": "Ein Hund.", **FORM, "api_key": "other-secret"},
        headers={"X-API-Key": "open-secret"},
    )
    assert_error(translated, 400, "X-API-Key header")
    assert (
        keyed.post(
            "/translate", json={"q": "Ein Hund.", **FORM}, headers={"X-API-Key": "open-secret"}
        ).status_code
        == 200
    )
    assert (
        keyed.post(
            "/detect", json={"q": "Ein Hund."}, headers={"Authorization": "Bearer open-secret"}
        ).status_code
        == 200
    )


def test_a_header_keys_glossary_and_job_are_its_own(keyed: TestClient) -> None:
    body = {
        "name": "g",
        "source_lang": "de",
        "target_lang": "en",
        "entries": [{"source": "a", "target": "b"}],
    }
    made = keyed.post("/glossaries", json=body, headers={"Authorization": "Bearer open-secret"}).json()
    assert keyed.get(f"/glossaries/{made['id']}", params={"api_key": "open-secret"}).status_code == 200
    assert_error(keyed.get(f"/glossaries/{made['id']}", headers={"X-API-Key": "other-secret"}), 404)
    job = keyed.post(
        "/jobs", data=FORM, files={"file": ("a.txt", b"Ein Hund.")}, headers={"X-API-Key": "open-secret"}
    )
    assert job.status_code == 202, job.text
    assert keyed.get(f"/jobs/{job.json()['id']}", headers={"X-API-Key": "open-secret"}).status_code == 200
    assert_error(keyed.get(f"/jobs/{job.json()['id']}", headers={"X-API-Key": "other-secret"}), 404)


def test_looking_at_jobs_counts_one_request_each(keyed: TestClient) -> None:
    keyed.app.state.services.keys.store.clock = lambda: T0 - 86_400  # type: ignore[attr-defined]  # a minute of its own
    poller = {"X-API-Key": "poller-secret"}  # 3 requests a minute
    job = keyed.post("/jobs", data=FORM, files={"file": ("a.txt", b"Ein Hund.")}, headers=poller)
    assert job.status_code == 202, job.text  # 1
    assert keyed.get("/jobs", headers=poller).status_code == 200  # 2
    assert keyed.get(f"/jobs/{job.json()['id']}/result", headers=poller).status_code in (200, 409)  # 3
    assert_error(keyed.get(f"/jobs/{job.json()['id']}", headers=poller), 429, "3 requests per 1 minute")
    assert_error(keyed.get("/jobs", params={"api_key": "poller-secret"}), 429)


async def form_prefix(app: Any, path: str, prefix: bytes) -> tuple[int, dict[str, str]]:
    """``app``'s answer to a multipart upload whose first ``prefix`` bytes arrive and whose rest never
    does: an answer that waited for the rest would not come (the test fails on the time-out)."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": prefix, "more_body": True}
        await asyncio.Event().wait()  # the file never comes
        raise AssertionError("unreachable")

    answer: dict[str, Any] = {}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.update(message)

    headers = {
        "host": "testserver",
        "content-type": "multipart/form-data; boundary=b",
        "content-length": "100000",
    }
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "client": ("testclient", 50000), "server": ("testserver", 80),
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), timeout=3)  # (well within the upload's 5 s grace)
    return int(answer["status"]), {k.decode().lower(): v.decode() for k, v in answer.get("headers", [])}


def key_field(key: str) -> bytes:
    return (
        f'--b\r\nContent-Disposition: form-data; name="api_key"\r\n\r\n{key}\r\n'
        '--b\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nEin'
    ).encode()


@pytest.mark.parametrize("path", ["/jobs", "/translate_file"])  # (in this order: the clock goes on)
def test_a_key_in_the_form_before_its_file_is_refused_before_the_upload_takes_a_place(
    keyed: TestClient, path: str
) -> None:
    """LibreTranslate's clients send api_key as a form field: sent before the file, it is checked
    before the upload takes one of the NMT_MAX_FILE_REQUESTS places (here 1), as a header is."""
    places = keyed.app.state.services.file_requests  # type: ignore[attr-defined]
    store = keyed.app.state.services.keys.store  # type: ignore[attr-defined]
    store.clock = lambda: T0 + 3600 * (200 + len(path))  # a fresh minute, later than any before
    status, _ = keyed.portal.call(form_prefix, keyed.app, path, key_field("nope-secret"))  # type: ignore[union-attr]
    assert status == 403 and places.count == 0
    assert (
        keyed.get("/glossaries", headers={"X-API-Key": "tight-secret"}).status_code == 200
    )  # its 1 a minute
    status, headers = keyed.portal.call(form_prefix, keyed.app, path, key_field("tight-secret"))  # type: ignore[union-attr]
    assert status == 429 and int(headers["retry-after"]) > 0 and places.count == 0


def test_a_key_read_from_the_form_early_counts_its_upload_once(keyed: TestClient) -> None:
    store = keyed.app.state.services.keys.store  # type: ignore[attr-defined]
    store.clock = lambda: T0 + 3600 * 300
    first = keyed.post(
        "/translate_file", data={"api_key": "tight-secret", **FORM}, files={"file": ("a.txt", b"Ein Hund.")}
    )
    assert first.status_code == 200, first.text  # one request of its one a minute, not two
    again = keyed.post(
        "/translate_file", data={"api_key": "tight-secret", **FORM}, files={"file": ("a.txt", b"Ein Hund.")}
    )
    assert again.status_code == 429
