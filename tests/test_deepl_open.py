"""DeepL's API v2 on a service without keys, driven by DeepL's own client: any key or none is
accepted (as on the LibreTranslate routes), the stores that strangers would share stay off, and a
document is still seen only with its document_key."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import deepl
import httpx
import pytest

from tests.test_server import Server, running_server


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("deepl-open")
    with running_server(root / "uvicorn.log", NMT_MODEL_DIR=str(model_dir), NMT_DATA_DIR=str(root)) as srv:
        yield srv


@pytest.fixture(autouse=True)
def no_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepl.http_client, "max_network_retries", 0)


def test_any_key_or_none_is_accepted(server: Server) -> None:
    text = "Ein Hund läuft im Park."
    answers = set()
    for key in ("anything", "something-else:fx"):
        result = deepl.Translator(key, server_url=server.url).translate_text(text, target_lang="EN-US")
        assert isinstance(result, deepl.TextResult)
        answers.add(result.text)
    keyless = httpx.post(f"{server.url}/v2/translate", json={"text": [text], "target_lang": "EN-US"})
    assert keyless.status_code == 200, keyless.text
    libre = httpx.post(f"{server.url}/translate", json={"q": text, "source": "de", "target": "en"})
    assert answers == {keyless.json()["translations"][0]["text"], libre.json()["translatedText"]}
    usage = deepl.Translator("anything", server_url=server.url).get_usage().character
    assert (usage.count, usage.limit) == (0, 10**12)


def test_stored_glossaries_stay_off_without_keys(server: Server) -> None:
    translator = deepl.Translator("anything", server_url=server.url)
    with pytest.raises(deepl.AuthorizationException, match="NMT_SHARED_STORES"):
        translator.create_glossary("pets", "DE", "EN", {"Hund": "dog"})
    with pytest.raises(deepl.AuthorizationException):
        translator.list_glossaries()


def test_a_document_is_seen_with_its_key_only(server: Server) -> None:
    translator = deepl.Translator("anything", server_url=server.url)
    handle = translator.translate_document_upload(
        b"Ein Hund.\nEine Katze.", target_lang="EN-US", filename="a.txt"
    )
    changed = "1" if handle.document_key.endswith("0") else "0"
    stranger = deepl.DocumentHandle(handle.document_id, handle.document_key[:-1] + changed)
    deadline = time.monotonic() + 60
    while not translator.translate_document_get_status(handle).done:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(deepl.DeepLException) as refused:
        translator.translate_document_download(stranger, io.BytesIO())
    assert refused.value.http_status_code == 404
    out = io.BytesIO()
    translator.translate_document_download(handle, out)
    assert out.getvalue().count(b"\n") == 1
