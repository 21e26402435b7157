"""LibreTranslate's own API tests, every case, over HTTP against ``uvicorn app.main:app``.

The cases are LibreTranslate's, copied from ``libretranslate/tests/test_api/test_api_*.py``
(detect_language, frontend_settings, get_languages, health, spec, translate) at commit
39429cbe7f27987fc0ba771c4ad060d6321423ff of https://github.com/LibreTranslate/LibreTranslate, one
test each, under their own names, their requests and assertions word for word. Only the
languages differ: LibreTranslate's conftest loads en,es and its cases translate en->es; the server
here serves the tiny German->English model of tests/conftest.py, so ``"en"`` became ``"de"`` and
``"es"`` became ``"en"`` (``"zz"``, a code no one serves, is kept).

Their ``client`` is Flask's test client; here it is ``LibreTranslateClient``, which sends the same
requests (``data=`` form-encoded, ``json=`` as JSON, no body when none is given) over real HTTP and
answers with what their assertions read of Flask's response (``status_code``, ``data``, ``json``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_server import Server, running_server


class FlaskLikeResponse:
    """An httpx response seen through the attributes of Flask's test response that the cases use."""

    def __init__(self, response: httpx.Response) -> None:
        self.status_code = response.status_code
        self.data = response.content  # Flask: the body's bytes
        self._response = response

    @property
    def json(self) -> Any:  # Flask: a property, the body parsed as JSON
        return self._response.json()


class LibreTranslateClient:
    """The calls of Flask's test client that the cases make, sent to a running server."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def get(self, path: str) -> FlaskLikeResponse:
        return FlaskLikeResponse(self.http.get(path))

    def post(
        self, path: str, data: dict[str, str] | None = None, json: dict[str, Any] | None = None
    ) -> FlaskLikeResponse:
        return FlaskLikeResponse(self.http.post(path, data=data, json=json))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("libretranslate-suite") / "uvicorn.log"
    with running_server(log, NMT_MODEL_DIR=str(model_dir)) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> Iterator[LibreTranslateClient]:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield LibreTranslateClient(http)


# The cases as LibreTranslate wrote them, layout included (easier to compare with theirs).
# fmt: off

# --- libretranslate/tests/test_api/test_api_detect_language.py --------------------------------------


def test_api_detect_language(client: LibreTranslateClient) -> None:
    response = client.post("/detect", data={
        "q": "Hello"
    })
    response_json = json.loads(response.data)

    assert "confidence" in response_json[0] and "language" in response_json[0]
    assert len(response_json) >= 1
    assert response.status_code == 200


def test_api_detect_language_must_fail_without_parameters(client: LibreTranslateClient) -> None:
    response = client.post("/detect")
    response_json = json.loads(response.data)

    assert "error" in response_json
    assert response.status_code == 400


def test_api_detect_language_must_fail_bad_request_type(client: LibreTranslateClient) -> None:
    response = client.get("/detect")

    assert response.status_code == 405


# --- libretranslate/tests/test_api/test_api_frontend_settings.py ------------------------------------


def test_api_get_frontend_settings(client: LibreTranslateClient) -> None:
    response = client.get("/frontend/settings")

    assert response.status_code == 200


# --- libretranslate/tests/test_api/test_api_get_languages.py ----------------------------------------


def test_api_get_languages(client: LibreTranslateClient) -> None:
    response = client.get("/languages")
    response_json = json.loads(response.data)

    assert "code" in response_json[0] and "name" in response_json[0]
    assert len(response_json) >= 1
    assert response.status_code == 200


def test_api_get_languages_must_fail_bad_request_type(client: LibreTranslateClient) -> None:
    response = client.post("/languages")

    assert response.status_code == 405


# --- libretranslate/tests/test_api/test_api_health.py -----------------------------------------------


def test_api_get_health(client: LibreTranslateClient) -> None:
    response = client.get("/health")

    assert response.status_code == 200
    assert response.json == {"status": "ok"}


def test_api_health_must_fail_bad_request_type(client: LibreTranslateClient) -> None:
    response = client.post("/health")

    assert response.status_code == 405


# --- libretranslate/tests/test_api/test_api_spec.py -------------------------------------------------


def test_api_get_spec(client: LibreTranslateClient) -> None:
    response = client.get("/spec")

    assert response.status_code == 200


def test_api_get_spec_must_fail_bad_request_type(client: LibreTranslateClient) -> None:
    response = client.post("/spec")

    assert response.status_code == 405


# --- libretranslate/tests/test_api/test_api_translate.py --------------------------------------------


def test_api_translate(client: LibreTranslateClient) -> None:
    response = client.post("/translate", data={
        "q": "Hello",
        "source": "de",
        "target": "en",
        "format": "text"
    })

    response_json = json.loads(response.data)

    assert "translatedText" in response_json
    assert response.status_code == 200


def test_api_translate_batch(client: LibreTranslateClient) -> None:

    response = client.post("/translate", json={
        "q": ["Hello", "World"],
        "source": "de",
        "target": "en",
        "format": "text"
    })

    response_json = json.loads(response.data)

    assert "translatedText" in response_json
    assert isinstance(response_json["translatedText"], list)
    assert len(response_json["translatedText"]) == 2
    assert response.status_code == 200


def test_api_translate_unsupported_language(client: LibreTranslateClient) -> None:
    response = client.post("/translate", data={
        "q": "Hello",
        "source": "de",
        "target": "zz",
        "format": "text"
    })

    response_json = json.loads(response.data)

    assert "error" in response_json
    assert response_json["error"] == "zz is not supported"
    assert response.status_code == 400


def test_api_translate_missing_parameter(client: LibreTranslateClient) -> None:
    response = client.post("/translate", data={
        "source": "de",
        "target": "en",
        "format": "text"
    })

    response_json = json.loads(response.data)

    assert "error" in response_json
    assert response_json["error"] == "Invalid request: missing q parameter"
    assert response.status_code == 400

# fmt: on
