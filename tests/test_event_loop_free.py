"""Work that grows with what a request sends never runs on the event loop: ``/health`` is answered
while each of the issue's heavy requests is still being handled.

Deterministic, not timed: the heavy function of each case is wrapped so that it waits, once, until
``/health`` has been answered (``Hold``). Run on a thread, it waits there and the event loop answers
``/health`` at once; run on the event loop, it would hold the loop, ``/health`` could not be
answered, and the wait ends only at its time-out, which fails the test. (``TestClient`` sends every
request, from any thread, through the one event loop of the app.)

The cases are the issue's (#41): a urlencoded body of 250,000 bare ``q`` fields, a .txt of 50,000
numbers to /translate_file and as a job, a TMX unit of thousands of languages, a stored glossary of
10,000 entries sharing a first word.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.http import body as request_body
from app.http.endpoints import request_glossary
from app.terminology import memory
from app.terminology import terms as sentence_terms
from tests.test_api import make_settings, serve

FORM = {"source": "de", "target": "en"}
HOLD_S = 20.0  # how long a held function waits for /health at most: past it, the test has failed


class Hold:
    """Wraps a function: its first call waits until ``release()`` (or ``HOLD_S``) before it runs."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        self.timed_out = False

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            if not self.entered.is_set():
                self.entered.set()
                self.timed_out = not self.released.wait(HOLD_S)
            return function(*args, **kwargs)

        return held


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = make_settings(
        model_dir, warmup=False, data_dir=tmp_path_factory.mktemp("data"), shared_stores=True
    )
    with serve(settings) as c:
        yield c


def assert_health_answered_while_held(client: TestClient, hold: Hold, send: Callable[[], Any]) -> Any:
    """Run ``send`` on a thread; once it is held in its heavy function, GET /health, which must be
    answered before the hold times out; then release it. ``send``'s result."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = send()
        except BaseException as e:  # (re-raised below, in the test's thread)
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert hold.entered.wait(120), "the heavy function was never called"
        health = client.get("/health")
        answered_while_held = not hold.timed_out
    finally:
        hold.released.set()
        thread.join(120)
    assert health.status_code == 200
    assert answered_while_held, "/health was answered only once the request let go of the event loop"
    if "error" in result:
        raise result["error"]
    return result["value"]


def numbers(n: int) -> bytes:
    return " ".join(["1"] * n).encode()


def test_health_is_answered_while_a_body_of_bare_q_fields_is_parsed(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = Hold()
    monkeypatch.setattr(request_body, "parse_urlencoded", hold.wrap(request_body.parse_urlencoded))
    body = b"&".join([b"q"] * 250_000) + b"&source=de&target=en"
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    response = assert_health_answered_while_held(
        client, hold, lambda: client.post("/translate", content=body, headers=headers)
    )
    assert response.status_code == 413


def test_health_is_answered_while_the_terms_of_a_file_of_numbers_are_found(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = Hold()
    monkeypatch.setattr(sentence_terms, "choose_terms", hold.wrap(sentence_terms.choose_terms))
    files = {"file": ("numbers.txt", numbers(50_000))}
    response = assert_health_answered_while_held(
        client, hold, lambda: client.post("/translate_file", data=FORM, files=files)
    )
    assert response.status_code == 200, response.text


def test_health_is_answered_while_the_terms_of_a_job_of_numbers_are_found(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's terms are found by the front end's job runner, in the background."""
    hold = Hold()
    monkeypatch.setattr(sentence_terms, "choose_terms", hold.wrap(sentence_terms.choose_terms))
    response = client.post("/jobs", data=FORM, files={"file": ("numbers.txt", numbers(50_000))})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]

    def finished() -> str:
        assert hold.released.wait(HOLD_S + 60)
        while (state := client.get(f"/jobs/{job_id}").json()["state"]) not in ("done", "failed"):
            threading.Event().wait(0.05)
        return state

    assert assert_health_answered_while_held(client, hold, finished) == "done"


def test_health_is_answered_while_a_tmx_unit_of_thousands_of_languages_is_read(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = Hold()
    monkeypatch.setattr(memory.TmxReader, "read", hold.wrap(memory.TmxReader.read))
    letters = "abcdefghijklmnopqrstuvwxyz"
    codes = [a + b + c for a in letters for b in letters for c in letters][:6_000]
    unit = "".join(f'<tuv xml:lang="{code}"><seg>x</seg></tuv>' for code in codes)
    data = f'<tmx version="1.4"><header/><body><tu>{unit}</tu></body></tmx>'.encode()
    response = assert_health_answered_while_held(
        client, hold, lambda: client.post("/memories", files={"file": ("m.tmx", data)})
    )
    assert response.status_code == 413


def test_health_is_answered_while_a_stored_glossary_sharing_a_first_word_is_made_ready(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = [{"source": f"Wort {i}", "target": f"word {i}"} for i in range(10_000)]
    made = client.post(
        "/glossaries", json={"name": "g", "source_lang": "de", "target_lang": "en", "entries": entries}
    )
    assert made.status_code == 201, made.text
    hold = Hold()
    monkeypatch.setattr(request_glossary, "Glossary", hold.wrap(request_glossary.Glossary))
    body = {**FORM, "q": " ".join(["Wort x"] * 500), "glossary_id": made.json()["id"]}
    response = assert_health_answered_while_held(client, hold, lambda: client.post("/translate", json=body))
    assert response.status_code == 200, response.text


def test_health_is_answered_while_a_long_text_to_translate_is_prepared(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/translate's own text: parsed, split and its terms found on a thread when it is large."""
    hold = Hold()
    monkeypatch.setattr(sentence_terms, "choose_terms", hold.wrap(sentence_terms.choose_terms))
    body = {**FORM, "q": numbers(2_000).decode()}
    response = assert_health_answered_while_held(client, hold, lambda: client.post("/translate", json=body))
    assert response.status_code == 200, response.text
