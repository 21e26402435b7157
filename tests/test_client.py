"""The real LibreTranslate Python client (``libretranslatepy``) against ``uvicorn app.main:app``:
what its users get. The client (2.1.4, its latest) has no ``format`` argument and no file
method: html and files are sent as it sends everything, urlencoded through urllib, and as a
multipart upload, to the same server with the same key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib import parse, request
from urllib.error import HTTPError

import httpx
import pytest
from libretranslatepy import LibreTranslateAPI

from app.formats.html import HtmlDocument
from model.translator import Translator
from tests.test_server import Server, running_server

KEY = "client-key"


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("client") / "uvicorn.log"
    with running_server(log, NMT_MODEL_DIR=str(model_dir), NMT_API_KEYS=KEY) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> LibreTranslateAPI:
    return LibreTranslateAPI(server.url, api_key=KEY)


def post_like_the_client(client: LibreTranslateAPI, path: str, params: dict[str, str]) -> Any:
    """What ``LibreTranslateAPI.translate`` does, with the fields it cannot send."""
    data = parse.urlencode({**params, "api_key": client.api_key or ""}).encode()
    with request.urlopen(request.Request(client.url + path, data=data), timeout=60) as response:
        return json.loads(response.read().decode())


def best(translator: Translator, sentences: list[str]) -> list[str]:
    return [r.hypotheses[0] for r in translator.translate_batch(sentences, beam_size=5)]


def test_languages(client: LibreTranslateAPI) -> None:
    assert client.languages() == [
        {"code": "de", "name": "German", "targets": ["en"]},
        {"code": "en", "name": "English", "targets": []},
    ]


def test_translate_text(client: LibreTranslateAPI, translator: Translator) -> None:
    assert (
        client.translate("Ein Mann spielt.", source="de", target="en")
        == best(translator, ["Ein Mann spielt."])[0]
    )
    assert (
        client.translate("Ein Mann spielt.", source="auto", target="en")
        == best(translator, ["Ein Mann spielt."])[0]
    )


def test_a_wrong_key_is_refused(server: Server) -> None:
    with pytest.raises(HTTPError) as refused:
        LibreTranslateAPI(server.url, api_key="wrong").translate("Hallo", "de", "en")
    assert refused.value.code == 403
    assert json.loads(refused.value.read())["error"] == "invalid api_key"


def test_detect(client: LibreTranslateAPI) -> None:
    assert client.detect("Ein Hund läuft im Park.") == [{"confidence": 100.0, "language": "de"}]


def test_translate_html(client: LibreTranslateAPI, translator: Translator) -> None:
    markup = '<p>Der Hund <a href="/x?a=1&amp;b=2">läuft</a>.</p>'
    out = post_like_the_client(
        client, "translate", {"q": markup, "source": "de", "target": "en", "format": "html"}
    )
    text = out["translatedText"]
    assert text.startswith("<p>") and text.endswith("</p>") and '<a href="/x?a=1&amp;b=2">' in text
    assert HtmlDocument.parse(text).text == best(translator, ["Der Hund läuft."])[0]


def test_translate_file(client: LibreTranslateAPI, translator: Translator) -> None:
    upload = httpx.post(
        client.url + "translate_file",
        data={"source": "de", "target": "en", "api_key": KEY},
        files={"file": ("notiz.txt", "Ein Mann spielt.\nDer Hund läuft.".encode())},
        timeout=60,
    )
    assert upload.status_code == 200, upload.text
    url = upload.json()["translatedFileUrl"]
    with request.urlopen(url, timeout=60) as response:
        assert response.read().decode() == "\n".join(
            best(translator, ["Ein Mann spielt.", "Der Hund läuft."])
        )
