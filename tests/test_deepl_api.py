"""DeepL's API v2 (app/http/endpoints/deepl*.py) driven by DeepL's own Python client (``deepl``) against
``uvicorn app.main:app`` as deployed: the same answers as the LibreTranslate routes give for the
same input (texts, markup, glossaries, documents), the keys and their limits as DeepL's statuses,
each refusal raised as the client's own exception type.

The client retries 429 and 5xx with a backoff of a second and more: the tests that expect one set
its retries to 0 (``no_retries``). Its document helper polls every 5 s: the tests poll the status
themselves, and call the helper only once the document is done (it then returns at once).
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import deepl
import httpx
import pytest

from app.http.endpoints.deepl.codes import served_code, target_entries
from app.http.endpoints.deepl.documents import STATUS
from app.jobs.job import State
from tests.documents.office import make_pptx
from tests.documents.pdf import report
from tests.test_document_formats import same_document
from tests.test_formats import make_docx
from tests.test_server import Server, running_server

MAIN, QUOTA, RATE = "main-key", "quota-key", "rate-key"
QUOTA_CHARS = 40
KEYS = f"""
[[keys]]
name = "main"
key = "{MAIN}"

[[keys]]
name = "quota"
key = "{QUOTA}"
chars_per_day = {QUOTA_CHARS}

[[keys]]
name = "rate"
key = "{RATE}"
requests_per_minute = 1
"""


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("deepl")
    (root / "keys.toml").write_text(KEYS)
    env = {
        "NMT_MODEL_DIR": str(model_dir),
        "NMT_API_KEYS_FILE": str(root / "keys.toml"),
        "NMT_DATA_DIR": str(root / "data"),
        "NMT_MAX_JOBS_PER_KEY": "50",
    }
    with running_server(root / "uvicorn.log", **env) as srv:
        yield srv


@pytest.fixture(scope="module")
def translator(server: Server) -> Iterator[deepl.Translator]:
    client = deepl.Translator(MAIN, server_url=server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    """The LibreTranslate routes (and raw /v2 requests), under the same key as ``translator``."""
    with httpx.Client(base_url=server.url, headers={"X-API-Key": MAIN}, timeout=60) as client:
        yield client


@pytest.fixture
def no_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer the client would retry (429, 5xx) raised at once."""
    monkeypatch.setattr(deepl.http_client, "max_network_retries", 0)


def libre(http: httpx.Client, q: Any, **fields: Any) -> Any:
    response = http.post("/translate", json={"q": q, "source": "de", "target": "en", **fields})
    assert response.status_code == 200, response.text
    return response.json()["translatedText"]


# --- texts ---------------------------------------------------------------------------------------------


def test_a_text_and_a_list_are_translated_as_translate_translates_them(
    translator: deepl.Translator, http: httpx.Client
) -> None:
    one = translator.translate_text("Ein Mann spielt im Park.", target_lang="EN-US")
    assert isinstance(one, deepl.TextResult)
    assert one.text == libre(http, "Ein Mann spielt im Park.")
    assert one.detected_source_lang == "DE" and one.billed_characters == len("Ein Mann spielt im Park.")
    texts = ["Zwei Hunde spielen.", "Eine Katze sitzt auf dem Ball.\n\nEin Kind lacht."]
    many = translator.translate_text(texts, source_lang="DE", target_lang="en-gb", formality="prefer_less")
    assert [r.text for r in many] == libre(http, texts)
    assert [r.billed_characters for r in many] == [len(t) for t in texts]
    assert {r.detected_source_lang for r in many} == {"DE"}


def test_a_form_body_with_text_repeated_is_a_list(http: httpx.Client) -> None:
    texts = ["Ein Hund läuft.", "Eine Frau hält einen Ball."]
    response = http.post(
        "/v2/translate", data={"text": texts, "target_lang": "EN-US", "split_sentences": "1"}
    )
    assert response.status_code == 200, response.text
    translations = response.json()["translations"]
    assert [t["text"] for t in translations] == libre(http, texts)
    assert [t["billed_characters"] for t in translations] == [len(t) for t in texts]


def test_markup_is_kept_and_ignore_tags_are_left_untranslated(
    translator: deepl.Translator, http: httpx.Client
) -> None:
    text = '<p>Ein Mann <b>spielt</b> im Park. <keep class="x">Eine Katze sitzt.</keep> Der Hund läuft.</p>'
    result = translator.translate_text(text, target_lang="EN-US", tag_handling="xml", ignore_tags=["keep"])
    assert isinstance(result, deepl.TextResult)
    # What /translate gives for the element marked translate="no", the mark taken out again.
    marked = text.replace('class="x">', 'class="x" translate="no">')
    expected = libre(http, marked, format="html").replace(' translate="no"', "")
    assert result.text == expected
    assert '<keep class="x">Eine Katze sitzt.</keep>' in result.text and "<b>" in result.text
    # Without ignore_tags the element is translated like any other.
    plain = translator.translate_text(text, target_lang="EN-US", tag_handling="html")
    assert isinstance(plain, deepl.TextResult)
    assert "Eine Katze sitzt." not in plain.text


# --- glossaries ----------------------------------------------------------------------------------------


def test_glossaries_are_made_listed_read_used_and_deleted(
    translator: deepl.Translator, http: httpx.Client
) -> None:
    glossary = translator.create_glossary("pets", "DE", "EN", {"Hund": "dog", "Katze": "cat"})
    assert glossary.ready and glossary.entry_count == 2
    assert (glossary.source_lang, glossary.target_lang) == ("DE", "EN")
    assert abs(glossary.creation_time.timestamp() - time.time()) < 60
    assert glossary.glossary_id in [g.glossary_id for g in translator.list_glossaries()]
    assert translator.get_glossary(glossary.glossary_id).name == "pets"
    assert translator.get_glossary_entries(glossary) == {"Hund": "dog", "Katze": "cat"}
    # The same stored glossary as /glossaries': /translate uses it by its id alike.
    text = "Der Hund und die Katze spielen."
    used = translator.translate_text_with_glossary(text, glossary, target_lang="EN-US")
    assert isinstance(used, deepl.TextResult)
    assert used.text == libre(http, text, glossary_id=glossary.glossary_id)
    assert "dog" in used.text and "cat" in used.text
    csv = translator.create_glossary_from_csv("csv", "DE", "EN", "Ball,ball\nPark,park\n")
    assert translator.get_glossary_entries(csv) == {"Ball": "ball", "Park": "park"}
    pairs = translator.get_glossary_languages()
    assert [(p.source_lang, p.target_lang) for p in pairs] == [("de", "en")]
    translator.delete_glossary(glossary)
    translator.delete_glossary(csv.glossary_id)
    with pytest.raises(deepl.GlossaryNotFoundException):
        translator.get_glossary(glossary.glossary_id)
    with pytest.raises(deepl.GlossaryNotFoundException):
        translator.delete_glossary(glossary)
    # Another key sees none of them.
    other = deepl.Translator(QUOTA, server_url=str(http.base_url))
    with pytest.raises(deepl.GlossaryNotFoundException):
        other.get_glossary_entries(csv.glossary_id)


def test_a_malformed_glossary_is_a_bad_request(translator: deepl.Translator) -> None:
    with pytest.raises(deepl.DeepLException, match="line 2") as refused:
        translator.create_glossary_from_csv("bad", "DE", "EN", "Hund,dog\nKatze,cat,x\n")
    assert refused.value.http_status_code == 400


# --- documents -----------------------------------------------------------------------------------------

DOCUMENTS = {
    "brief.docx": make_docx,
    "slides.pptx": make_pptx,
    "report.pdf": report,
    "notes.txt": lambda: "Ein Mann spielt.\nDer Hund läuft im Park.\n".encode(),
    "page.html": lambda: b"<h1>Ein Hund</h1><p>Eine <i>Katze</i> sitzt.</p>",
}


def job_result(http: httpx.Client, name: str, data: bytes) -> bytes:
    """What POST /jobs gives for the same file."""
    job = http.post("/jobs", data={"source": "de", "target": "en"}, files={"file": (name, data)}).json()
    deadline = time.monotonic() + 60
    while (state := http.get(f"/jobs/{job['id']}").json())["state"] not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    assert state["state"] == "done", state
    return http.get(state["resultUrl"]).content


def wait_done(translator: deepl.Translator, handle: deepl.DocumentHandle) -> deepl.DocumentStatus:
    deadline = time.monotonic() + 60
    seen = []
    while not (status := translator.translate_document_get_status(handle)).done:
        assert status.ok, status.error_message
        seen.append(status.status)
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    assert set(seen) <= {deepl.DocumentStatus.Status.QUEUED, deepl.DocumentStatus.Status.TRANSLATING}
    return status


def test_documents_are_uploaded_polled_and_downloaded_as_jobs_give_them(
    translator: deepl.Translator, http: httpx.Client
) -> None:
    files = {name: make() for name, make in DOCUMENTS.items()}
    handles = {
        name: translator.translate_document_upload(data, target_lang="EN-US", source_lang="DE", filename=name)
        for name, data in files.items()
    }
    for name, handle in handles.items():
        wait_done(translator, handle)
        # Done: DeepL's own waiting helper returns at once (it sleeps 5 s between polls otherwise).
        assert translator.translate_document_wait_until_done(handle).done
        out = io.BytesIO()
        translator.translate_document_download(handle, out)
        assert out.getvalue() != files[name]
        assert same_document(out.getvalue(), job_result(http, name, files[name])), name


def test_a_document_needs_its_key_and_a_finished_one_downloads_again(
    translator: deepl.Translator, no_retries: None
) -> None:
    handle = translator.translate_document_upload(b"Ein Hund.", target_lang="EN-GB", filename="a.txt")
    wrong = deepl.DocumentHandle(handle.document_id, "0" * 64)
    with pytest.raises(deepl.DeepLException) as refused:
        translator.translate_document_get_status(wrong)
    assert refused.value.http_status_code == 404
    # Billed: the characters of the document's text, as read.
    assert wait_done(translator, handle).billed_characters == len("Ein Hund.")
    first, again = io.BytesIO(), io.BytesIO()
    translator.translate_document_download(handle, first)
    translator.translate_document_download(handle, again)
    assert first.getvalue() == again.getvalue() != b""
    with pytest.raises(deepl.DeepLException) as refused:
        translator.translate_document_upload(b"x", target_lang="EN-US", filename="a.txt", output_format="pdf")
    assert refused.value.http_status_code == 400


def test_a_document_that_fails_is_an_error_with_its_message(translator: deepl.Translator) -> None:
    handle = translator.translate_document_upload(
        b"\xff\xfe not UTF-8", target_lang="EN-US", filename="a.txt"
    )
    deadline = time.monotonic() + 60
    while (status := translator.translate_document_get_status(handle)).ok and not status.done:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert status.status == deepl.DocumentStatus.Status.ERROR
    assert "UTF-8" in str(status.error_message)


# --- languages and usage -------------------------------------------------------------------------------


def test_languages_are_the_served_ones_in_deepl_codes(
    translator: deepl.Translator, http: httpx.Client
) -> None:
    assert [(lang.code, lang.name) for lang in translator.get_source_languages()] == [("DE", "German")]
    targets = translator.get_target_languages()
    assert [(lang.code, lang.supports_formality) for lang in targets] == [("EN-GB", False), ("EN-US", False)]
    assert (
        http.post("/v2/languages", params={"type": "target"}).json()
        == http.get("/v2/languages", params={"type": "target"}).json()
    )


def test_usage_counts_the_characters_of_the_day_and_456_once_they_are_used_up(
    server: Server, no_retries: None
) -> None:
    quota = deepl.Translator(QUOTA, server_url=server.url)
    text = "Ein Hund läuft im Park."
    quota.translate_text(text, target_lang="EN-US")
    usage = quota.get_usage()
    assert (usage.character.count, usage.character.limit) == (len(text), QUOTA_CHARS)
    assert not usage.any_limit_reached
    with pytest.raises(deepl.QuotaExceededException):
        quota.translate_text(text, target_lang="EN-US")  # past the 40 characters of the day
    with pytest.raises(deepl.QuotaExceededException):
        quota.translate_text("x" * (QUOTA_CHARS + 1), target_lang="EN-US")  # more than all of them
    assert quota.get_usage().character.count == len(text)  # a refusal spends nothing
    # A key without a character limit: DeepL's answer for an unlimited account.
    unlimited = deepl.Translator(MAIN, server_url=server.url).get_usage().character
    assert (unlimited.count, unlimited.limit) == (0, 10**12)


# --- refusals ------------------------------------------------------------------------------------------


def test_a_bad_or_missing_key_is_an_authorization_failure(server: Server, no_retries: None) -> None:
    with pytest.raises(deepl.AuthorizationException):
        deepl.Translator("not-a-key", server_url=server.url).translate_text("Ein Hund.", target_lang="EN-US")
    response = httpx.post(f"{server.url}/v2/translate", json={"text": ["Ein Hund."], "target_lang": "EN-US"})
    assert response.status_code == 403 and "message" in response.json()
    # The LibreTranslate routes answer as they did, and take DeepL's header too.
    assert "error" in httpx.post(f"{server.url}/translate", json={"q": "x", "target": "en"}).json()
    headers = {"Authorization": f"DeepL-Auth-Key {MAIN}"}
    ok = httpx.post(f"{server.url}/translate", json={"q": "Ein Hund.", "target": "en"}, headers=headers)
    assert ok.status_code == 200, ok.text


def test_over_a_rate_is_too_many_requests_with_retry_after(server: Server, no_retries: None) -> None:
    rate = deepl.Translator(RATE, server_url=server.url)
    rate.get_usage()  # its one request of the minute
    with pytest.raises(deepl.TooManyRequestsException):
        rate.get_usage()
    response = httpx.get(f"{server.url}/v2/usage", headers={"Authorization": f"DeepL-Auth-Key {RATE}"})
    assert response.status_code == 429
    assert 0 < int(response.headers["retry-after"]) <= 61  # (a second's bucket past the minute)
    assert "requests_per_minute" in response.json()["message"]


def test_malformed_and_oversized_requests_are_400_and_413(
    translator: deepl.Translator, http: httpx.Client, no_retries: None
) -> None:
    with pytest.raises(deepl.DeepLException, match="zz is not supported") as refused:
        translator.translate_text("Ein Hund.", target_lang="ZZ")
    assert type(refused.value) is deepl.DeepLException and refused.value.http_status_code == 400
    with pytest.raises(deepl.DeepLException) as refused:
        translator.translate_text("x" * 5001, target_lang="EN-US")  # NMT_MAX_CHARS
    assert refused.value.http_status_code == 413
    # FastAPI's 422 is DeepL's 400, with DeepL's body.
    response = http.post("/v2/translate", json={"text": [1, 2], "target_lang": "EN-US", "formality": "rude"})
    assert response.status_code == 400 and "formality" in response.json()["message"]
    missing = http.post("/v2/translate", json={"target_lang": "EN-US"})
    assert missing.status_code == 400 and "text" in missing.json()["message"]
    assert http.get("/v2/languages", params={"type": "both"}).status_code == 400


# --- the mappings, without a server ----------------------------------------------------------------


def test_deepl_codes_name_the_served_languages() -> None:
    served = ["de", "en", "pt", "pt-br", "zh"]
    assert [served_code(c, served) for c in ("EN-US", "en-gb", "PT-BR", "PT-PT", "ZH-HANS", "DE")] == [
        "en",
        "en",
        "pt-br",
        "pt",
        "zh",
        "de",
    ]
    assert served_code("XX-YY", served) == "xx"  # refused by the use case, in its words
    assert [e["language"] for e in target_entries(["en", "pt", "pt_br", "de"])] == [
        "EN-GB",
        "EN-US",
        "PT-PT",  # (PT-BR is a model's own)
        "PT-BR",
        "DE",
    ]


def test_every_job_state_is_one_of_deepls_four() -> None:
    assert set(STATUS) == set(get_args(State))
    assert set(STATUS.values()) == {"queued", "translating", "done", "error"}
    assert [STATUS[s] for s in ("reading", "writing", "cancelled")] == ["queued", "translating", "error"]
