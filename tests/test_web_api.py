"""The rest of LibreTranslate's API through FastAPI's TestClient (the real app, a real model worker,
the tiny random model): /detect, format html, /translate_file and its download, /frontend/settings,
and the page's files at /."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docx
import pytest
from fastapi.testclient import TestClient

from app.formats.html import HtmlDocument
from model.translator import Translator
from tests.test_api import assert_error, best, make_settings, serve

LIMITS = {"max_file_bytes": 65536, "max_file_chars": 600, "max_chars": 300}


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    with serve(make_settings(model_dir, **LIMITS)) as c:
        yield c


@pytest.fixture(scope="module")
def keyed(model_dir: Path) -> Iterator[TestClient]:
    with serve(make_settings(model_dir, api_keys=("k1",))) as c:
        yield c


# --- /detect ---------------------------------------------------------------------------------------


def test_detect_answers_in_libretranslates_shape(client: TestClient) -> None:
    for send in ({"json": {"q": "Ein Hund läuft."}}, {"data": {"q": "Ein Hund läuft."}}):
        response = client.post("/detect", **send)  # type: ignore[arg-type]
        assert response.status_code == 200, response.text
        # The tiny model translates from German only: the one candidate.
        assert response.json() == [{"confidence": 100.0, "language": "de"}]


def test_detect_refuses_what_it_should(client: TestClient, keyed: TestClient) -> None:
    missing = {"error": "Invalid request: missing q parameter"}  # LibreTranslate's words
    for send in ({"json": {"q": ""}}, {"json": {}}, {"json": {"q": None}}, {"data": {"q": ""}}, {}):
        response = client.post("/detect", **send)  # type: ignore[arg-type]
        assert (response.status_code, response.json()) == (400, missing), send
    assert_error(client.post("/detect", json={"q": 5}), 422, "q")  # there, but not text
    assert_error(client.post("/detect", json={"q": "x" * 301}), 413, "at most 300")
    assert_error(keyed.post("/detect", json={"q": "Hallo"}), 403, "api_key")
    assert keyed.post("/detect", json={"q": "Hallo", "api_key": "k1"}).status_code == 200


# --- format html -----------------------------------------------------------------------------------


def test_html_is_translated_sentence_by_sentence_with_its_markup(
    client: TestClient, translator: Translator
) -> None:
    markup = (
        '<p class="a">Ein <b>Mann</b> spielt. <a href="/x">Der Hund</a> läuft.</p>'
        '<script>x = "Hund";</script>'
    )
    response = client.post("/translate", json={"q": markup, "source": "de", "target": "en", "format": "html"})
    assert response.status_code == 200, response.text
    out = response.json()["translatedText"]
    one, two = best(translator, ["Ein Mann spielt.", "Der Hund läuft."])
    assert out.startswith('<p class="a">') and out.endswith('</p><script>x = "Hund";</script>')
    # The text of the answer is the two sentences' translations (the markup placed among them).
    assert HtmlDocument.parse(out).text == f"{one} {two}".strip()
    for tag in ("<b>", "</b>", '<a href="/x">', "</a>"):
        assert out.count(tag) == 1


def test_html_with_alternatives_and_auto_source(client: TestClient) -> None:
    body = {"q": ["<i>Ein Hund.</i>", "<p></p>"], "source": "auto", "target": "en", "format": "html"}
    response = client.post("/translate", json={**body, "alternatives": 1})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["translatedText"][1] == "<p></p>"
    assert result["translatedText"][0].startswith("<i>") and result["translatedText"][0].endswith("</i>")
    assert result["alternatives"][1] == ["<p></p>"]
    assert result["detectedLanguage"] == [{"confidence": 100.0, "language": "de"}] * 2


def test_unknown_format_is_still_422(client: TestClient) -> None:
    response = client.post("/translate", json={"q": "x", "source": "de", "target": "en", "format": "xml"})
    assert_error(response, 422, "format")


# --- /translate_file ------------------------------------------------------------------------------


def upload(client: TestClient, name: str, data: bytes, **fields: str) -> Any:
    form = {"source": "de", "target": "en", **fields}
    return client.post("/translate_file", data=form, files={"file": (name, data)})


def download(client: TestClient, response: Any) -> Any:
    assert response.status_code == 200, response.text
    url = response.json()["translatedFileUrl"]
    assert url.startswith("http://testserver/download_file/")
    return client.get(url)


def test_text_file_round_trip(client: TestClient, translator: Translator) -> None:
    text = "Ein Mann spielt.\n\nDer Hund läuft."
    got = download(client, upload(client, "brief.txt", text.encode()))
    assert got.status_code == 200
    assert got.headers["content-type"].startswith("text/plain")
    assert 'filename="brief_en.txt"' in got.headers["content-disposition"]
    one, two = best(translator, ["Ein Mann spielt.", "Der Hund läuft."])
    assert got.content.decode() == f"{one}\n\n{two}"


def test_a_file_is_downloaded_once(client: TestClient) -> None:
    response = upload(client, "a.txt", b"Ein Hund.")
    url = response.json()["translatedFileUrl"]
    assert client.get(url).status_code == 200
    assert_error(client.get(url), 404, "downloaded already")
    assert_error(client.get("/download_file/0123456789abcdef.a_en.txt"), 404)


def test_html_and_docx_files(client: TestClient, translator: Translator) -> None:
    html = download(client, upload(client, "seite.html", b"<h1>Ein Hund</h1><p>Eine <b>Katze</b>.</p>"))
    assert html.headers["content-type"].startswith("text/html")
    assert html.text.startswith("<h1>") and "<b>" in html.text and html.text.endswith("</p>")

    document = docx.Document()
    document.add_paragraph("Ein Mann spielt.")
    document.add_paragraph("Der Hund läuft.").runs[0].italic = True
    data = io.BytesIO()
    document.save(data)
    got = download(client, upload(client, "text.docx", data.getvalue(), source="auto"))
    assert got.headers["content-type"].startswith("application/vnd.openxmlformats")
    translated = docx.Document(io.BytesIO(got.content))
    expected = best(translator, ["Ein Mann spielt.", "Der Hund läuft."])
    assert [p.text for p in translated.paragraphs] == expected
    assert translated.paragraphs[1].runs[0].italic is True


def test_file_errors(client: TestClient, keyed: TestClient) -> None:
    assert_error(upload(client, "a.exe", b"MZ"), 400, "unsupported file format '.exe'", ".docx", ".pdf")
    assert_error(upload(client, "a.pdf", b"%PDF-1.4"), 400, "cannot read the PDF file")
    assert_error(upload(client, "a.docx", b"PK not really"), 400, "not a .docx document")
    assert_error(upload(client, "a.txt", b"\xff\xfe"), 400, "not UTF-8")
    assert_error(upload(client, "a.txt", b"x" * 65537), 413, "larger than 65536 bytes")
    assert_error(upload(client, "a.txt", b"Ein Hund. " * 61), 413, "at most 600")
    unsupported = upload(client, "a.txt", b"Hallo", target="fr")
    assert unsupported.status_code == 400
    assert unsupported.json() == {"error": "fr is not supported", "supportedPairs": ["de->en"]}
    assert_error(client.post("/translate_file", data={"source": "de", "target": "en"}), 400, "multipart")
    no_file = client.post("/translate_file", data={"target": "en"}, files={"other": ("a.txt", b"x")})
    assert no_file.json() == {"error": "Invalid request: missing file parameter"}
    assert no_file.status_code == 400
    for fields in ({}, {"target": ""}):
        no_target = client.post("/translate_file", data=fields, files={"file": ("a.txt", b"x")})
        assert no_target.json() == {"error": "Invalid request: missing target parameter"}
        assert no_target.status_code == 400
    assert_error(upload(keyed, "a.txt", b"Hallo"), 403, "api_key")
    assert upload(keyed, "a.txt", b"Hallo", api_key="k1").status_code == 200


# --- /frontend/settings and the page -----------------------------------------------------------------


def test_frontend_settings(client: TestClient, keyed: TestClient) -> None:
    settings = client.get("/frontend/settings").json()
    formats = settings.pop("filesFormats")  # ours: the formats by name, for the page
    assert {"name": "PDF", "extensions": [".pdf"]} in formats
    assert [e for f in formats for e in f["extensions"]] == settings["supportedFilesFormat"]
    assert settings == {
        "charLimit": 300,
        "frontendTimeout": 500,
        "apiKeys": False,
        "keyRequired": False,
        "suggestions": False,
        "filesTranslation": True,
        "supportedFilesFormat": [
            ".txt",
            ".html",
            ".htm",
            ".docx",
            ".xlf",
            ".xliff",
            ".pptx",
            ".xlsx",
            ".odt",
            ".odp",
            ".ods",
            ".pdf",
            ".srt",
            ".vtt",
            ".md",
            ".markdown",
        ],
        "language": {
            "source": {"code": "auto", "name": "Auto Detect"},
            "target": {"code": "en", "name": "English"},
        },
    }
    assert keyed.get("/frontend/settings").json()["keyRequired"] is True


def test_the_page_and_its_files_are_served(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for path in ("/static/app.js", "/static/style.css"):
        assert path in page.text
        assert client.get(path).status_code == 200
    # Nothing from elsewhere: every script, style and link the page loads is its own.
    for needle in ("http://", "https://", "//cdn"):
        assert needle not in page.text
        assert needle not in client.get("/static/app.js").text
        assert needle not in client.get("/static/style.css").text
