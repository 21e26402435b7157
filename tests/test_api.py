"""The HTTP API through FastAPI's TestClient: the real app, a real model worker, a tiny random model.

Expected translations come from ``Translator.translate_batch`` on the same model directory, so a
test fails if the service translates other sentences than it should, mixes up their order, loses
the layout, or searches with another beam than requested.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.config import Settings
from app.http.endpoints.sentences import wait_for_disconnect
from app.main import create_app
from app.serving.errors import DeadlineExceeded, EngineStopped, QueueFull, TooLarge
from app.translation.sentences import run_until_disconnect
from model.runtime.precision import int8_pays
from model.translator import Translator

JSON = dict[str, Any]


def make_settings(model_dir: Path, **overrides: Any) -> Settings:
    """Settings for a test: defaults plus ``overrides``, whatever NMT_* the shell has set.

    Quantization is off unless asked for (the tests compare answers with ``translate_batch`` in
    float32), one worker process with one thread is enough, and the decoding step is not compiled
    unless asked for (tests/test_executor.py and tests/test_determinism.py test the compiled step;
    compiling in every worker started here would take most of the suite's time).
    """
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("NMT_")}
    values = {
        "model_dir": model_dir,
        "device": "cpu",
        "quantization": "none",
        "replicas": 1,
        "threads": 1,
        "compile": False,
    }
    values.update(overrides)
    with mock.patch.dict(os.environ, clean_env, clear=True):
        return Settings(**values)


@contextmanager
def serve(settings: Settings) -> Iterator[TestClient]:
    """A client of a started app (the lifespan starts the workers, which load the model)."""
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    with serve(make_settings(model_dir)) as c:
        yield c


def translate(client: TestClient, **body: Any) -> Any:
    return client.post("/translate", json={"source": "de", "target": "en", **body})


def best(translator: Translator, sentences: list[str], beam_size: int = 5) -> list[str]:
    return [r.hypotheses[0] for r in translator.translate_batch(sentences, beam_size=beam_size)]


def multipart(fields: list[tuple[str, str]], boundary: str = "nmt-test-boundary") -> tuple[bytes, str]:
    """A multipart/form-data body of text fields only (httpx would send urlencoded for these)."""
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        for name, value in fields
    ]
    return ("".join(parts) + f"--{boundary}--\r\n").encode(), f"multipart/form-data; boundary={boundary}"


def assert_error(response: Any, status: int, *fragments: str) -> JSON:
    """``response`` has ``status`` and a LibreTranslate error body mentioning every fragment."""
    assert response.status_code == status, response.text
    body: JSON = response.json()
    assert isinstance(body.get("error"), str) and body["error"], body
    for fragment in fragments:
        assert fragment in body["error"], body
    return body


# --- LibreTranslate request and response shapes -------------------------------------------------


def test_string_q_gives_string_translation(client: TestClient, translator: Translator) -> None:
    response = translate(client, q="Ein Mann spielt.")
    assert response.status_code == 200
    assert response.json() == {"translatedText": best(translator, ["Ein Mann spielt."])[0]}


def test_list_q_gives_list_in_order(client: TestClient, translator: Translator, sentences: list[str]) -> None:
    response = translate(client, q=sentences)
    assert response.status_code == 200
    assert response.json() == {"translatedText": best(translator, sentences)}


def test_auto_source_reports_the_model_source_language(client: TestClient) -> None:
    one = translate(client, q="Ein Hund.", source="auto").json()
    assert one["detectedLanguage"] == {"confidence": 100.0, "language": "de"}
    many = translate(client, q=["Ein Hund.", "Eine Katze."], source="auto").json()
    assert many["detectedLanguage"] == [{"confidence": 100.0, "language": "de"}] * 2
    assert "detectedLanguage" not in translate(client, q="Ein Hund.").json()


def test_sentences_of_a_text_are_translated_separately(client: TestClient, translator: Translator) -> None:
    text = "Ein Mann spielt.   Der Hund läuft im Wasser!"
    expected = " ".join(best(translator, ["Ein Mann spielt.", "Der Hund läuft im Wasser!"]))
    assert translate(client, q=text).json()["translatedText"] == expected


def test_newlines_and_paragraphs_are_preserved(client: TestClient, translator: Translator) -> None:
    text = "Ein Mann spielt.\n\nEine Katze\r\n  Der Hund läuft.\n"
    one, two, three = best(translator, ["Ein Mann spielt.", "Eine Katze", "Der Hund läuft."])
    assert translate(client, q=text).json()["translatedText"] == f"{one}\n\n{two}\r\n  {three}\n"


def test_beam_size_is_the_one_requested(client: TestClient, translator: Translator) -> None:
    sentences = ["Zwei kleinen Kinder sitzen auf dem Ball.", "Der Hund schaut auf die Straße."]
    for beam in (1, 3):
        got = translate(client, q=sentences, beam_size=beam).json()["translatedText"]
        assert got == best(translator, sentences, beam_size=beam)


def test_alternatives_are_the_next_best_hypotheses(client: TestClient, translator: Translator) -> None:
    sentence = "Zwei kleinen Kinder sitzen auf dem roten Ball."
    [result] = translator.translate_batch([sentence], beam_size=5, n_best=3)
    body = translate(client, q=sentence, alternatives=2).json()
    assert body == {"translatedText": result.hypotheses[0], "alternatives": result.hypotheses[1:3]}
    batch = translate(client, q=[sentence, ""], alternatives=2).json()
    assert batch == {
        "translatedText": [result.hypotheses[0], ""],
        "alternatives": [result.hypotheses[1:3], ["", ""]],
    }


def test_alternatives_raise_a_small_beam_to_n_best(client: TestClient, translator: Translator) -> None:
    [result] = translator.translate_batch(["Ein Mann spielt."], beam_size=3, n_best=3)
    body = translate(client, q="Ein Mann spielt.", alternatives=2, beam_size=1).json()
    assert body["alternatives"] == result.hypotheses[1:3]


def test_form_urlencoded_single_and_repeated_q(client: TestClient, translator: Translator) -> None:
    form = {"source": "de", "target": "en"}
    single = client.post("/translate", data={**form, "q": "Ein Mann spielt."})
    assert single.json() == {"translatedText": best(translator, ["Ein Mann spielt."])[0]}
    repeated = client.post("/translate", data={**form, "q": ["Ein Mann spielt.", "Eine Katze"]})
    assert repeated.json() == {"translatedText": best(translator, ["Ein Mann spielt.", "Eine Katze"])}


def test_form_urlencoded_with_raw_utf8_and_alternatives(client: TestClient, translator: Translator) -> None:
    # curl -d 'q=Größe' sends the UTF-8 bytes unescaped; they must not be read as Latin-1.
    body = "q=Die Straße ist groß.&source=de&target=en&alternatives=1".encode()
    response = client.post(
        "/translate", content=body, headers={"content-type": "application/x-www-form-urlencoded"}
    )
    [result] = translator.translate_batch(["Die Straße ist groß."], beam_size=5, n_best=2)
    assert response.json() == {"translatedText": result.hypotheses[0], "alternatives": result.hypotheses[1:2]}


def test_multipart_form(client: TestClient, translator: Translator) -> None:
    body, content_type = multipart(
        [("q", "Ein Mann spielt."), ("q", "Große Katze"), ("source", "de"), ("target", "en")]
    )
    response = client.post("/translate", content=body, headers={"content-type": content_type})
    assert response.json() == {"translatedText": best(translator, ["Ein Mann spielt.", "Große Katze"])}


def test_unknown_fields_are_ignored(client: TestClient, translator: Translator) -> None:
    response = translate(client, q="Ein Mann spielt.", model="whatever", extra={"x": [1]})
    assert response.json() == {"translatedText": best(translator, ["Ein Mann spielt."])[0]}


def test_empty_texts_translate_to_empty_without_model_work(
    client: TestClient, translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = client.app.state.services.scheduler  # type: ignore[attr-defined]
    client.app.state.services.segment_cache.clear()  # type: ignore[attr-defined]  # (an earlier test's answers)
    calls: list[int] = []
    real = scheduler.submit

    def spy(sources: list[list[int]], **kwargs: Any) -> Any:
        calls.append(len(sources))
        return real(sources, **kwargs)

    monkeypatch.setattr(scheduler, "submit", spy)
    assert translate(client, q="").json() == {"translatedText": ""}
    assert translate(client, q=["", "  \n ", "\n"]).json() == {"translatedText": ["", "", ""]}
    assert translate(client, q=[]).json() == {"translatedText": []}
    assert calls == []
    mixed = translate(client, q=["", "Ein Mann spielt.", " "]).json()
    assert mixed == {"translatedText": ["", best(translator, ["Ein Mann spielt."])[0], ""]}
    assert calls == [1]  # one request to the workers; blank texts are not sent


# --- Bad input: a 4xx with an "error" message, never a 500 --------------------------------------


def test_too_many_texts_is_413(client: TestClient) -> None:
    assert_error(translate(client, q=["Ein Hund."] * 129), 413, "too many texts", "128")


def test_too_many_characters_is_413(client: TestClient) -> None:
    assert_error(translate(client, q="a" * 5001), 413, "5001", "5000")
    assert_error(translate(client, q=["a" * 2500, "b" * 2501]), 413, "5001")  # summed over q
    assert translate(client, q=["a " * 1250, "b " * 1250]).status_code == 200  # exactly at the limit


def test_malformed_json_is_422_with_position(client: TestClient) -> None:
    response = client.post("/translate", content=b'{"q": "Hallo", "target": "en",', headers=_JSON_TYPE)
    body = assert_error(response, 422, "invalid JSON")
    assert body["detail"][0]["type"] == "json_invalid"
    assert body["detail"][0]["loc"][0] == "body"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"q": 123, "target": "en"}, "q"),
        ({"q": ["ok", 5], "target": "en"}, "q"),
        ({"q": "Hallo", "target": 5}, "target"),
        ({"q": "Hallo", "target": "en", "alternatives": "many"}, "alternatives"),
        ({"q": "Hallo", "target": "en", "alternatives": -1}, "alternatives"),
        ({"q": "Hallo", "target": "en", "beam_size": 0}, "beam_size"),
        ({"q": "Hallo", "target": "en", "beam_size": True}, "beam_size"),
        ({"q": "Hallo", "target": "en", "alternatives": False}, "alternatives"),
        ({"q": "Hallo", "target": "en", "format": "pdf"}, "format"),
        ({"q": "Hallo", "source": None, "target": "en"}, "source"),
    ],
)
def test_wrong_types_are_422_naming_the_field(client: TestClient, body: JSON, field: str) -> None:
    response = client.post("/translate", json=body)
    result = assert_error(response, 422, field)
    assert any(err["loc"][:2] == ["body", field] for err in result["detail"]), result


@pytest.mark.parametrize(
    ("body", "missing"),
    [
        ({"target": "en"}, "q"),
        ({"q": None, "target": "en"}, "q"),
        ({}, "q"),  # q first, then source and target: LibreTranslate's order
        ({"q": "Hallo"}, "target"),
        ({"q": "Hallo", "target": None}, "target"),
        ({"q": "Hallo", "target": ""}, "target"),
        ({"q": "Hallo", "source": "", "target": "en"}, "source"),  # absent is "auto"; empty is missing
    ],
)
def test_a_missing_parameter_is_400_in_libretranslates_words(
    client: TestClient, body: JSON, missing: str
) -> None:
    expected = {"error": f"Invalid request: missing {missing} parameter"}
    response = client.post("/translate", json=body)
    assert (response.status_code, response.json()) == (400, expected)
    form = {key: value for key, value in body.items() if value is not None}  # a form has no null
    if len(form) == len(body):
        response = client.post("/translate", data=form)
        assert (response.status_code, response.json()) == (400, expected)


@pytest.mark.parametrize(
    ("source", "target", "message"),
    [
        ("de", "fr", "fr is not supported"),
        ("auto", "fr", "fr is not supported"),
        ("xx", "fr", "xx is not supported"),  # the source first, as LibreTranslate checks them
        ("DE", "zz", "zz is not supported"),
        ("de", "z" * 100, "z" * 32 + "... is not supported"),  # no 100-character echo
        ("en", "en", "English (en) is not available as a target language from English (en)"),
        ("de", "DE", "German (de) is not available as a target language from German (de)"),
        ("auto", "de", "German (de) is not available as a target language"),
    ],
)
def test_an_unsupported_language_is_400_in_libretranslates_words_with_the_served_pairs(
    client: TestClient, source: str, target: str, message: str
) -> None:
    response = translate(client, q="Hallo", source=source, target=target)
    assert response.status_code == 400, response.text
    assert response.json() == {"error": message, "supportedPairs": ["de->en"]}


def test_more_sentences_than_the_queue_holds_is_413(model_dir: Path) -> None:
    with serve(make_settings(model_dir, max_queue=2, warmup=False)) as small:
        # Distinct sentences: one repeated in a request is decoded once (app/terminology/precedence.py).
        three = ["Ein Hund.", "Eine Katze.", "Ein Haus."]
        assert_error(small.post("/translate", json={"q": three, "target": "en"}), 413, "sentences")
        assert small.post("/translate", json={"q": three[:2], "target": "en"}).status_code == 200


def test_html_format_keeps_the_markup(client: TestClient, translator: Translator) -> None:
    response = translate(client, q="<p>Hallo</p>", format="html")
    assert response.status_code == 200, response.text
    assert response.json() == {"translatedText": f"<p>{best(translator, ['Hallo'])[0]}</p>"}


def test_invalid_utf8_is_400(client: TestClient) -> None:
    raw = b'{"q": "Gr\xfc\xdfe", "source": "de", "target": "en"}'  # Latin-1, not UTF-8
    assert_error(client.post("/translate", content=raw, headers=_JSON_TYPE), 400, "UTF-8")
    form = b"q=Gr%FC%DFe&source=de&target=en"
    assert_error(client.post("/translate", content=form, headers=_FORM_TYPE), 400, "UTF-8")
    surrogate = b'{"q": "\\ud800", "source": "de", "target": "en"}'  # valid JSON, not encodable
    assert_error(client.post("/translate", content=surrogate, headers=_JSON_TYPE), 400, "UTF-8")


def test_body_over_the_limit_is_413(model_dir: Path) -> None:
    with serve(make_settings(model_dir, max_body_bytes=1000, warmup=False)) as small:
        announced = small.post("/translate", json={"q": "a" * 2000, "target": "en"})
        assert_error(announced, 413, "1000 bytes")

        def chunks() -> Iterator[bytes]:  # no Content-Length: only the bytes received count
            yield b'{"q": "'
            yield b"a" * 2000
            yield b'", "target": "en"}'

        streamed = small.post("/translate", content=chunks(), headers=_JSON_TYPE)
        assert "content-length" not in streamed.request.headers
        assert_error(streamed, 413, "1000 bytes")
        assert small.post("/translate", json={"q": "Hallo", "target": "en"}).status_code == 200


def test_api_keys_are_required_when_configured(model_dir: Path) -> None:
    with serve(make_settings(model_dir, api_keys="k1,k2", warmup=False)) as keyed:
        assert_error(keyed.post("/translate", json={"q": "Hallo", "target": "en"}), 403, "api_key")
        wrong = keyed.post("/translate", json={"q": "Hallo", "target": "en", "api_key": "k3"})
        assert_error(wrong, 403, "invalid api_key")
        non_ascii = keyed.post("/translate", json={"q": "Hallo", "target": "en", "api_key": "ключ"})
        assert_error(non_ascii, 403)
        ok = keyed.post("/translate", json={"q": "Hallo", "target": "en", "api_key": "k2"})
        assert ok.status_code == 200
        form_ok = keyed.post("/translate", data={"q": "Hallo", "target": "en", "api_key": "k1"})
        assert form_ok.status_code == 200
        assert keyed.get("/languages").status_code == 200  # only /translate needs a key


def test_beam_size_above_the_maximum_is_400(client: TestClient) -> None:
    assert_error(translate(client, q="Hallo", beam_size=9), 400, "beam_size", "8")
    assert translate(client, q="Hallo", beam_size=8).status_code == 200


def test_too_many_alternatives_is_400(client: TestClient) -> None:
    assert_error(translate(client, q="Hallo", alternatives=4), 400, "alternatives", "3")


_JSON_TYPE = {"content-type": "application/json"}
_FORM_TYPE = {"content-type": "application/x-www-form-urlencoded"}


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b"", _JSON_TYPE, 400),  # no parameters: q missing
        (b"null", _JSON_TYPE, 422),
        (b"[]", _JSON_TYPE, 422),
        (b'"just a string"', _JSON_TYPE, 422),
        (b"[" * 100_000, _JSON_TYPE, 422),  # nested beyond the JSON parser's recursion limit
        (b'{"q": [["nested"]], "target": "en"}', _JSON_TYPE, 422),
        (b'{"q": "a", "target": "en", "alternatives": 1e999}', _JSON_TYPE, 422),
        (b'{"q": "a", "target": "en", "alternatives": 1.5}', _JSON_TYPE, 422),
        (b'{"q": "a", "target": "en", "api_key": 5}', _JSON_TYPE, 422),
        (b'{"q": "a", "target": "\\udfff"}', _JSON_TYPE, 400),
        (b'{"q": "a", "target": "en"}', {"content-type": "text/plain"}, 200),  # forgiving: JSON
        (b"q=a&target=en&beam_size=", _FORM_TYPE, 422),
        (b"q=a&target=en&alternatives=x", _FORM_TYPE, 422),
        (b"no equals sign at all", _FORM_TYPE, 400),  # a field "no equals sign at all": no q
        (b"--x\r\n", {"content-type": "multipart/form-data"}, 400),  # no boundary
        (
            b'--b\r\nContent-Disposition: form-data; name="q"; filename="a.txt"\r\n\r\nHallo\r\n--b--\r\n',
            {"content-type": "multipart/form-data; boundary=b"},
            400,  # files are not accepted
        ),
    ],
)
def test_odd_bodies_never_give_500(client: TestClient, content: bytes, headers: JSON, status: int) -> None:
    response = client.post("/translate", content=content, headers=headers)
    assert response.status_code == status, response.text
    if status != 200:
        assert_error(response, status)


@pytest.mark.parametrize("headers", [_JSON_TYPE, _FORM_TYPE, {}], ids=["json", "form", "untyped"])
def test_an_empty_body_misses_q(client: TestClient, headers: dict[str, str]) -> None:
    response = client.post("/translate", content=b"", headers=headers)
    assert (response.status_code, response.json()) == (400, {"error": "Invalid request: missing q parameter"})


# --- Engine errors, disconnects and real bugs ---------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (QueueFull("full"), 503, "1"),
        (TooLarge("big"), 413, None),
        (DeadlineExceeded("late"), 504, None),
        (EngineStopped("gone"), 503, None),
    ],
)
def test_engine_errors_map_to_status_codes(
    client: TestClient,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    status: int,
    retry_after: str | None,
) -> None:
    def failing(sources: list[list[int]], **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(client.app.state.services.scheduler, "submit", failing)  # type: ignore[attr-defined]
    response = translate(client, q="Hallo Welt.")
    assert_error(response, status)
    assert response.headers.get("retry-after") == retry_after


def test_a_full_queue_refuses_before_reading_the_body(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = client.app.state.services.scheduler  # type: ignore[attr-defined]
    monkeypatch.setattr(scheduler, "enter", lambda: False)  # full: no place to take...
    monkeypatch.setattr(scheduler, "has_room", lambda: False)  # ...and none to see before the body
    read: list[bool] = []

    def body() -> Iterator[bytes]:  # streamed: it is read only if the server asks for it
        read.append(True)
        yield b'{"q": "Hallo", "target": "en"}'

    busy = client.post("/translate", content=body(), headers=_JSON_TYPE)
    assert_error(busy, 503, "busy")
    assert busy.headers["retry-after"] == "1"
    assert read == []  # refused on the headers alone: the body was never asked for
    assert client.get("/health").status_code == 200  # only translations are refused
    monkeypatch.undo()
    # The spy sees a read: with room in the queue, the same streamed body is read and translated.
    admitted = client.post("/translate", content=body(), headers=_JSON_TYPE)
    assert admitted.status_code == 200 and read == [True]
    assert scheduler.enter()  # every place held at the gate was given back
    scheduler.leave()


def test_a_request_past_its_deadline_is_504(model_dir: Path) -> None:
    with serve(make_settings(model_dir, request_timeout_s=1e-6, warmup=False)) as strict:
        late = strict.post("/translate", json={"q": "Der Hund läuft im Wasser.", "target": "en"})
        assert_error(late, 504, "timed out")
        assert strict.app.state.services.scheduler.waiting == 0  # type: ignore[attr-defined]


def test_a_bug_is_a_500_with_an_error_body(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(sources: list[list[int]], **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(client.app.state.services.scheduler, "submit", broken)  # type: ignore[attr-defined]
    client.app.state.services.segment_cache.clear()  # type: ignore[attr-defined]  # (an earlier test's "Hallo")
    lenient = TestClient(client.app, raise_server_exceptions=False)  # same app, already started
    assert lenient.post("/translate", json={"q": "Hallo", "target": "en"}).json() == {
        "error": "internal server error"
    }


def test_a_disconnected_client_cancels_the_engine_call() -> None:
    cancelled = asyncio.Event()

    async def slow_translation() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def scenario() -> tuple[bool, object]:
        outcome = await run_until_disconnect(slow_translation(), asyncio.sleep(0.01))  # gone at 10 ms
        await asyncio.wait_for(cancelled.wait(), 1)
        return outcome

    assert asyncio.run(scenario()) == (False, None)


def test_a_connected_client_gets_the_result() -> None:
    async def translation() -> str:
        await asyncio.sleep(0.05)
        return "done"

    async def scenario() -> tuple[tuple[bool, object], bool]:
        connected = asyncio.Event()
        watcher = connected.wait()  # never set: the client stays
        return await run_until_disconnect(translation(), watcher), connected.is_set()

    assert asyncio.run(scenario()) == ((True, "done"), False)


def test_wait_for_disconnect_returns_on_the_disconnect_message() -> None:
    messages = [{"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}]
    seen: list[str] = []

    async def receive() -> dict[str, object]:
        msg = messages.pop(0)
        seen.append(str(msg["type"]))
        return msg

    asyncio.run(asyncio.wait_for(wait_for_disconnect(receive), 1))
    assert seen == ["http.request", "http.disconnect"]


def test_languages(client: TestClient) -> None:
    assert client.get("/languages").json() == [
        {"code": "de", "name": "German", "targets": ["en"]},
        {"code": "en", "name": "English", "targets": []},
    ]


def test_health_when_ready(client: TestClient) -> None:
    ready = client.get("/health/ready")
    assert (ready.status_code, ready.json()) == (
        200,
        {"status": "ok", "model": "tiny-de-en", "device": "cpu"},
    )
    health = client.get("/health")  # LibreTranslate's body, which its clients compare whole
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert client.get("/health/live").json() == {"status": "alive"}


def test_not_ready_before_the_model_is_loaded(model_dir: Path) -> None:
    idle = TestClient(create_app(make_settings(model_dir)))  # no "with": the lifespan never runs
    assert idle.get("/health/live").status_code == 200
    for path in ("/health", "/health/ready", "/languages", "/info"):
        assert_error(idle.get(path), 503)
    assert_error(idle.post("/translate", json={"q": "Hallo", "target": "en"}), 503)


def test_not_ready_when_the_engine_has_stopped(model_dir: Path) -> None:
    with serve(make_settings(model_dir, warmup=False)) as stopping:
        stopping.app.state.services.scheduler.stop()  # type: ignore[attr-defined]
        assert_error(stopping.get("/health"), 503, "engine")
        assert stopping.get("/health/live").status_code == 200
        assert_error(stopping.post("/translate", json={"q": "Hallo", "target": "en"}), 503)


def test_info(client: TestClient, translator: Translator) -> None:
    info = client.get("/info").json()
    [model] = info["models"]
    assert model["name"] == "tiny-de-en" and model["workers"] == 1
    assert model["config"] == translator.info.config.to_dict()
    assert (model["source"], model["target"], model["directions"]) == ("de", "en", ["de-en"])
    assert info["routes"] == {
        "direct": [{"source": "de", "target": "en", "model": "tiny-de-en"}],
        "pivot": [],
    }
    assert info["languages"][0]["targets"] == ["en"]
    assert (model["device"], model["dtype"]) == ("cpu", "float32")
    assert info["decoding"]["max_input_tokens"] == 250 and info["decoding"]["no_repeat_ngram_size"] == 0
    assert info["batching"]["max_batch_size"] == 64
    assert info["batching"]["replicas"] == 1
    assert info["limits"]["max_chars"] == 5000
    assert info["version"]
    assert model["quantization"] == "none"  # what the tests asked for
    assert (model["decoding"], model["compile_seconds"]) == ("eager", 0.0)
    # Resident memory of the front end and of its one worker (which holds the model's weights),
    # as the OS reports it (/proc, read here independently).
    memory = info["memory"]
    [worker_mb] = memory["workers_mb"]
    [state] = client.app.state.services.scheduler.workers  # type: ignore[attr-defined]
    with open(f"/proc/{state.worker.pid}/status") as f:
        rss = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    assert worker_mb == pytest.approx(rss, rel=0.2) and worker_mb > model["weight_mb"]
    assert memory["total_mb"] == pytest.approx(memory["front_end_mb"] + worker_mb, abs=0.2)


def test_defaults_on_cpu_are_int8_where_it_pays_and_a_compiled_step(model_dir: Path) -> None:
    """int8 by default where int8 layers are measured faster than float32's on this machine, float32
    elsewhere (model.runtime.precision.int8_pays: the verdict the server's workers read)."""
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("NMT_")}
    with mock.patch.dict(os.environ, clean_env, clear=True):
        settings = Settings(model_dir=model_dir, device="cpu")  # everything else as deployed
    expected = "int8" if int8_pays(settings.compile_cache_dir) else "none"
    with serve(settings) as client:  # ready only once the decoding step is compiled
        [info] = client.get("/info").json()["models"]
        assert info["quantization"] == expected
        assert info["decoding"] == "compiled" and info["compile_seconds"] > 0
        assert f'quantization="{expected}"' in client.get("/metrics").text  # nmt_model_info
        r = translate(client, q="Ein Mann spielt.", beam_size=1)
        assert r.status_code == 200 and r.json()["translatedText"]


def test_int8_needs_cpu_and_float32(model_dir: Path) -> None:
    for bad in ({"dtype": "bfloat16"}, {"device": "cuda"}):
        with pytest.raises(ValidationError, match="NMT_QUANTIZATION=int8"):
            make_settings(model_dir, quantization="int8", **bad)


def test_metrics(client: TestClient) -> None:
    metrics = client.app.state.services.metrics  # type: ignore[attr-defined]

    def requests(endpoint: str, status: str) -> float:
        return metrics.sample("nmt_requests_total", {"endpoint": endpoint, "status": status})

    before_ok, before_other = requests("/translate", "200"), requests("other", "404")
    assert translate(client, q="Hallo Welt.").status_code == 200
    assert client.get("/no/such/path/123").status_code == 404
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert requests("/translate", "200") == before_ok + 1
    assert requests("other", "404") == before_other + 1
    assert "/no/such/path" not in text  # raw URLs never become labels
    assert 'nmt_request_duration_seconds_count{endpoint="/translate"}' in text
    # What belongs to a model is labelled with its name.
    assert 'nmt_queue_depth_sentences{model="tiny-de-en"} 0.0' in text
    assert 'nmt_active_sequences{model="tiny-de-en"} 0.0' in text
    assert 'nmt_model_info{device="cpu",dtype="float32",model="tiny-de-en"' in text
    model = {"model": "tiny-de-en"}
    assert metrics.sample("nmt_model_load_seconds", model) > 0.0
    # Samples of the worker process, merged into the same view (prometheus_client's multiprocess mode).
    assert metrics.sample("nmt_sentences_total", {**model, "outcome": "translated"}) >= 1
    assert metrics.sample("nmt_decode_steps_total", model) >= 1


def test_openapi_documents_the_translate_body(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/translate"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/x-www-form-urlencoded", "multipart/form-data"}
    assert "q" in body["application/json"]["schema"]["properties"]


def test_spec_is_the_openapi_document_with_the_served_languages(client: TestClient) -> None:
    spec = client.get("/spec")  # where LibreTranslate serves its API description
    assert spec.status_code == 200
    document = spec.json()
    assert document == client.get("/openapi.json").json()
    body = document["paths"]["/translate"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["properties"]["target"]["enum"] == ["en"]
    # The 400 documents the served pairs that come beside LibreTranslate's message.
    bad_request = document["paths"]["/translate"]["post"]["responses"]["400"]["content"]["application/json"]
    name = bad_request["schema"]["$ref"].rsplit("/", 1)[-1]
    assert set(document["components"]["schemas"][name]["properties"]) == {"error", "supportedPairs"}
    assert_error(client.post("/spec"), 405)


def test_every_request_gives_back_its_gate_place_and_its_turn(client: TestClient) -> None:
    """Translated, refused by a route check or malformed: none keeps (or gives back twice) the
    admission place and the parsing turn it took (app.http.shedding)."""
    from app.http.shedding import TURNS

    assert translate(client, q="Ein Mann.").status_code == 200
    assert translate(client, q=["Eins.", "Zwei."]).status_code == 200
    assert client.post("/translate", json={"q": "x", "source": "xx", "target": "en"}).status_code == 400
    assert (
        client.post("/translate", content=b"{", headers={"content-type": "application/json"}).status_code
        == 422
    )
    state = client.app.state.services  # type: ignore[attr-defined]
    assert state.scheduler._entered == 0
    assert state.turns._value == TURNS
