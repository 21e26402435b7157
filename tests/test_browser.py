"""The page at / in a real browser: Debian's headless chromium driven by Playwright, against
``uvicorn app.main:app`` serving the shipped German->English model.

The browser is the system's (``apt-get install chromium``; .ci/run installs it), never one that
``playwright install`` would download. A person's steps: type German and read English, the
character counter, swap, auto-detection, copy, the messages for a 413 (a real one, from a file too
large), a busy server (retried by itself) and a timeout, the file tab's document jobs (dropped,
polled, cancelled, downloaded; faked in the page and for real), the keyboard, the API key prompt,
and terminology: typed terms, a stored glossary uploaded and picked, and the terms a glossary or
the translation memory decided marked in the translation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import under_ci
from tests.test_server import REPO, Server, start_server, stop, wait_ready

CHROMIUM = Path("/usr/bin/chromium")
# CI installs it: there a missing one fails (the ``browser`` fixture), elsewhere the module is skipped.
if not CHROMIUM.exists() and not under_ci():
    pytest.skip("Debian's chromium is not installed (apt-get install chromium)", allow_module_level=True)

from playwright.sync_api import Browser, Locator, Page, Route, expect, sync_playwright  # noqa: E402

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
MAX_CHARS = 200
MAX_FILE_BYTES = 2000
WAIT_MS = 30_000  # the shipped model on a busy 2-core machine


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("browser") / "uvicorn.log"
    srv = start_server(
        log,
        NMT_MODEL_DIR=str(REPO / "artifacts" / "multi30k-de-en"),
        NMT_DATA_DIR=str(tmp_path_factory.mktemp("browser-data")),  # its stored glossaries
        NMT_SHARED_STORES="true",  # without keys: the glossaries and the memory of the tests below
        NMT_MAX_CHARS=str(MAX_CHARS),
        NMT_MAX_FILE_BYTES=str(MAX_FILE_BYTES),
        NMT_JOB_MAX_BYTES=str(MAX_FILE_BYTES),  # POST /jobs: the file tab's 413
        NMT_FRONTEND_TIMEOUT_MS="150",
    )
    try:
        wait_ready(srv)
        yield srv
    finally:
        stop(srv)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():  # (under CI only: elsewhere the module was skipped)
        pytest.fail(f"{CHROMIUM} is not installed (.ci/run installs it: apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, server: Server) -> Iterator[Page]:
    context = browser.new_context(base_url=server.url, permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto("/")
    expect(page.locator("#target")).to_have_value("en")  # started: settings and languages loaded
    yield page
    context.close()


def api_translation(server: Server, text: str) -> str:
    response = httpx.post(
        f"{server.url}/translate", json={"q": text, "source": "de", "target": "en"}, timeout=60
    )
    response.raise_for_status()
    return str(response.json()["translatedText"])


def test_type_german_read_english_with_the_language_detected(page: Page, server: Server) -> None:
    text = "Ein Mann fährt mit dem Fahrrad eine Straße entlang."
    expected = api_translation(server, text)
    assert "man" in expected.lower()  # English from the shipped model
    expect(page.locator("#source")).to_have_value("auto")
    page.locator("#input").press_sequentially(text, delay=5)  # typing: translated once typing pauses
    expect(page.locator("#output")).to_have_text(expected)
    expect(page.locator("#detected")).to_have_text("Detected: German (100%)")
    expect(page.locator("#message")).to_be_hidden()


def test_counter_and_the_character_limit(page: Page) -> None:
    sent: list[str] = []
    page.on(
        "request", lambda request: sent.append(request.url) if request.url.endswith("/translate") else None
    )
    box = page.locator("#input")
    box.fill("Ein Hund.")
    expect(page.locator("#counter")).to_have_text(f"9 / {MAX_CHARS}")
    expect(page.locator("#output")).not_to_be_empty()
    before = len(sent)
    box.fill("Ein Hund. " * 21)  # 210 characters
    expect(page.locator("#counter")).to_have_text(f"210 / {MAX_CHARS}")
    expect(page.locator("#counter")).to_have_class(re.compile("over"))
    page.get_by_role("button", name="Translate", exact=True).click()
    expect(page.locator("#message")).to_contain_text(f"at most {MAX_CHARS}")
    assert len(sent) == before  # refused on the page, not sent to be refused by the server


def test_swap_where_the_reverse_pair_is_served(page: Page) -> None:
    swap = page.get_by_role("button", name="Swap languages")
    page.locator("#input").fill("Zwei Hunde spielen im Schnee.")
    expect(page.locator("#output")).not_to_be_empty()
    expect(swap).to_be_disabled()  # English->German is not served by this model
    assert "not available" in (swap.get_attribute("title") or "")

    # The page as it is on a server that also serves English->German (a second model, issue 18).
    both = [
        {"code": "de", "name": "German", "targets": ["en"]},
        {"code": "en", "name": "English", "targets": ["de"]},
    ]
    page.route("**/languages", lambda route: route.fulfill(json=both))
    page.reload()
    expect(page.locator("#target")).to_have_value("en")
    page.locator("#input").fill("Zwei Hunde spielen im Schnee.")
    translation = page.locator("#output")
    expect(translation).not_to_be_empty()
    english = translation.inner_text()
    expect(swap).to_be_enabled()
    page.route("**/translate", lambda route: route.fulfill(json={"translatedText": "Zwei Hunde."}))
    swap.click()
    expect(page.locator("#source")).to_have_value("en")  # the detected German became the target
    expect(page.locator("#target")).to_have_value("de")
    expect(page.locator("#input")).to_have_value(english)
    expect(translation).to_have_text("Zwei Hunde.")


def test_copy_puts_the_translation_on_the_clipboard(page: Page) -> None:
    page.locator("#input").fill("Eine Frau singt.")
    output = page.locator("#output")
    expect(output).not_to_be_empty()
    page.get_by_role("button", name="Copy").click()
    expect(page.get_by_role("status")).to_have_text("Copied")
    assert page.evaluate("() => navigator.clipboard.readText()") == output.text_content()


def test_alternatives_on_request(page: Page) -> None:
    page.locator("#input").fill("Ein Kind spielt im Park.")
    expect(page.locator("#output")).not_to_be_empty()
    more = page.get_by_role("button", name="Alternatives")
    more.click()
    expect(more).to_have_attribute("aria-expanded", "true")
    expect(page.locator("#alternative-list li").first).not_to_be_empty()


def test_busy_server_is_retried_and_a_timeout_explained(page: Page) -> None:
    answers = iter([503, 200])

    def busy_once(route: Route) -> None:
        if next(answers) == 503:
            body = json.dumps({"error": "server busy: translation queue is full"})
            route.fulfill(
                status=503, headers={"Retry-After": "1"}, body=body, content_type="application/json"
            )
        else:
            route.continue_()

    page.route("**/translate", busy_once)
    page.locator("#input").fill("Ein Hund läuft.")
    expect(page.locator("#message")).to_contain_text("busy")
    expect(page.locator("#message")).to_contain_text("Retrying")
    expect(page.locator("#output")).not_to_be_empty()  # the retry went through
    expect(page.locator("#message")).to_be_hidden()

    page.unroute("**/translate")
    page.route(
        "**/translate",
        lambda route: route.fulfill(status=504, json={"error": "translation timed out"}),
    )
    page.locator("#input").fill("Eine Katze schläft.")
    expect(page.locator("#message")).to_contain_text("took too long")
    expect(page.get_by_role("button", name="Retry now")).to_be_visible()


def choose_file(page: Page, name: str, data: bytes) -> None:
    page.get_by_role("tab", name="Files").click()
    page.get_by_label("File to translate").set_input_files(
        {"name": name, "mimeType": "text/plain", "buffer": data}
    )
    page.get_by_role("button", name="Translate file").click()


def drop_file(page: Page, name: str, text: str) -> None:
    """Drags a file over the drop zone and drops it there, as a person does from a file manager."""
    page.get_by_role("tab", name="Files").click()
    transfer = page.evaluate_handle(
        """([name, text]) => {
          const transfer = new DataTransfer();
          transfer.items.add(new File([text], name, { type: "text/plain" }));
          return transfer;
        }""",
        [name, text],
    )
    zone = page.locator("#drop-zone")
    zone.dispatch_event("dragenter", {"dataTransfer": transfer})
    expect(zone).to_have_class(re.compile("dragging"))  # shown as the place to drop it
    zone.dispatch_event("drop", {"dataTransfer": transfer})
    expect(zone).not_to_have_class(re.compile("dragging"))


def job_item(page: Page, name: str) -> Locator:
    return page.locator("#jobs > li").filter(has_text=name)


def fake_job(
    job_id: str, name: str, state: str, done: int = 0, total: int | None = None, **more: Any
) -> dict[str, Any]:
    """A Job as the API writes it (docs: issue 32)."""
    job = {
        "id": job_id,
        "name": name,
        "state": state,
        "source": "auto",
        "target": "en",
        "detectedLanguage": None,
        "progress": {"done": done, "total": total},
        "error": None,
        "notes": [],
        "created": "2026-11-24T23:50:00Z",
        "finished": None,
        "expires": None,
        "resultUrl": None,
    }
    return job | more


class FakeJobs:
    """POST /jobs, GET /jobs/{id} and POST /jobs/{id}/cancel answered in the page (page.route): a
    POST creates the next job of ``queued``; a GET answers ``jobs[id]`` as the test last set it, so
    that what the page shows is decided by the test, not by how fast it polls."""

    def __init__(self, page: Page) -> None:
        self.queued: list[dict[str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of each request to /jobs
        page.route(re.compile(r"/jobs(/[^?]*)?(\?.*)?$"), self.answer)

    def answer(self, route: Route) -> None:
        request = route.request
        path = httpx.URL(request.url).path
        self.requests.append((request.method, path))
        if request.method == "POST" and path == "/jobs":
            job = self.queued.pop(0)
            self.jobs[job["id"]] = job
            route.fulfill(status=202, json=job, headers={"Location": f"/jobs/{job['id']}"})
            return
        job_id = path.split("/")[2]
        if request.method == "POST" and path.endswith("/cancel"):
            self.jobs[job_id] = self.jobs[job_id] | {"state": "cancelled", "finished": "2026-11-24T23:51:00Z"}
        route.fulfill(json=self.jobs[job_id])

    def gets(self, job_id: str) -> int:
        return self.requests.count(("GET", f"/jobs/{job_id}"))


def test_a_jobs_progress_is_polled_until_done_then_it_offers_the_download(page: Page, server: Server) -> None:
    jobs = FakeJobs(page)
    jobs.queued.append(fake_job("job-1", "brief.txt", "queued"))
    choose_file(page, "brief.txt", "Ein Hund läuft.".encode())
    item = job_item(page, "brief.txt")
    state, count, progress = item.locator(".job-state"), item.locator(".job-count"), item.locator("progress")
    expect(state).to_have_text("Queued")
    expect(progress).not_to_have_attribute("value", re.compile(".*"))  # how many: not known yet
    live = page.locator("#jobs-status")
    expect(live).to_have_attribute("aria-live", "polite")
    expect(live).to_have_text("brief.txt: Queued")

    jobs.jobs["job-1"] = fake_job("job-1", "brief.txt", "translating", 3, 10, detectedLanguage="de")
    expect(state).to_have_text("Translating")
    expect(count).to_have_text("3 / 10 sentences")
    expect(progress).to_have_js_property("value", 3)
    expect(progress).to_have_js_property("max", 10)
    expect(item.locator(".job-language")).to_have_text("Detected: German")
    expect(live).to_have_text("brief.txt: Translating")
    expect(item.get_by_role("link")).to_be_hidden()
    expect(item.get_by_role("button", name="Cancel")).to_be_visible()

    result = f"{server.url}/jobs/job-1/result"
    note = "line 3 is <b>empty</b>: left as it is"
    jobs.jobs["job-1"] = fake_job(
        "job-1", "brief.txt", "done", 10, 10, detectedLanguage="de", resultUrl=result, notes=[note]
    )
    expect(state).to_have_text("Done")
    expect(count).to_have_text("10 / 10 sentences")
    expect(progress).to_have_js_property("value", 10)
    link = item.get_by_role("link", name="Download brief_en.txt")
    expect(link).to_have_attribute("href", result)
    expect(link).to_have_attribute("download", "brief_en.txt")
    expect(item.locator(".job-notes li")).to_have_text([note])  # text, not markup
    expect(item.locator("b")).to_have_count(0)
    expect(item.get_by_role("button", name="Cancel")).to_be_hidden()
    expect(live).to_have_text("brief.txt: Done. The translation can be downloaded.")
    polls = jobs.gets("job-1")
    assert polls >= 2  # translating, done (queued: the answer to the POST)
    page.wait_for_timeout(2500)
    assert jobs.gets("job-1") == polls  # a job that is done is no longer asked about

    page.reload()  # the session's jobs are asked for again
    expect(page.locator("#target")).to_have_value("en")
    page.get_by_role("tab", name="Files").click()
    expect(job_item(page, "brief.txt").get_by_role("link", name="Download brief_en.txt")).to_be_visible()


def test_cancel_on_a_running_job_posts_the_cancel_and_shows_it_cancelled(page: Page) -> None:
    jobs = FakeJobs(page)
    jobs.queued.append(fake_job("job-7", "lang.txt", "translating", 3, 10))
    choose_file(page, "lang.txt", "Ein Hund läuft.".encode())
    item = job_item(page, "lang.txt")
    expect(item.locator(".job-count")).to_have_text("3 / 10 sentences")
    cancel = item.get_by_role("button", name="Cancel lang.txt")
    with page.expect_request(lambda r: r.url.endswith("/jobs/job-7/cancel")) as sent:
        cancel.click()
    assert sent.value.method == "POST"
    expect(item.locator(".job-state")).to_have_text("Cancelled")
    expect(page.locator("#jobs-status")).to_have_text("lang.txt: Cancelled")
    expect(cancel).to_be_hidden()
    expect(item).to_be_focused()  # not lost with the button
    expect(item.get_by_role("link")).to_be_hidden()
    assert jobs.requests.count(("POST", "/jobs/job-7/cancel")) == 1


def test_a_failed_job_shows_the_reason(page: Page) -> None:
    jobs = FakeJobs(page)
    error = {"status": 413, "message": "the file has more than 200 characters"}
    jobs.queued.append(fake_job("job-3", "lang.txt", "failed", error=error))
    choose_file(page, "lang.txt", "Ein Hund läuft.".encode())
    item = job_item(page, "lang.txt")
    expect(item.locator(".job-state")).to_have_text("Failed")
    expect(item.locator(".job-error")).to_have_text(
        "Too large: the file has more than 200 characters. Choose a smaller file."
    )
    expect(item.get_by_role("button", name="Cancel")).to_be_hidden()


def test_a_file_dropped_is_translated_as_a_job_and_downloaded(page: Page, server: Server) -> None:
    """Against the service's /jobs: dropped, sent, polled until done, downloaded."""
    text = "Zwei Hunde spielen im Schnee.\n\nEine Frau singt."
    drop_file(page, "brief.txt", text)
    chosen = page.get_by_label("File to translate")
    assert chosen.evaluate("input => [...input.files].map((f) => f.name)") == ["brief.txt"]
    expect(chosen).to_be_focused()
    with page.expect_response(lambda r: r.url == f"{server.url}/jobs") as posted:
        page.get_by_role("button", name="Translate file").click()
    assert posted.value.status == 202, posted.value.text()
    job_id = posted.value.json()["id"]
    item = job_item(page, "brief.txt")
    expect(item.locator(".job-state")).to_have_text("Done", timeout=2 * WAIT_MS)
    expect(item.locator(".job-count")).to_have_text(re.compile(r"^([1-9]\d*) / \1 sentences$"))
    expect(item.locator(".job-language")).to_have_text("Detected: German")
    expect(page.locator("#message")).to_be_hidden()
    link = item.get_by_role("link", name="Download brief_en.txt")
    expect(link).to_have_attribute("href", re.compile(rf"/jobs/{re.escape(job_id)}/result$"))
    with page.expect_download() as info:
        link.click()
    download = info.value
    assert download.suggested_filename == "brief_en.txt"
    expected = "\n\n".join(api_translation(server, line) for line in text.split("\n\n"))
    assert Path(download.path()).read_text() == expected


def test_a_413_from_the_server_is_explained(page: Page) -> None:
    choose_file(page, "big.txt", b"Ein Hund. " * (MAX_FILE_BYTES // 10 + 1))
    message = page.get_by_role("alert")
    expect(message).to_contain_text("Too large")
    expect(message).to_contain_text(f"larger than {MAX_FILE_BYTES} bytes")
    expect(message).to_contain_text("Choose a smaller file")


def test_the_drop_zone_is_a_labelled_file_input_reached_with_tab(page: Page, server: Server) -> None:
    page.get_by_role("tab", name="Text").focus()
    page.keyboard.press("ArrowRight")  # the Files tab, selected and focused
    page.keyboard.press("Tab")
    chosen = page.locator("#drop-zone").get_by_label("File to translate", exact=True)
    expect(chosen).to_be_focused()
    expect(chosen).to_have_attribute("type", "file")
    expect(chosen).to_have_accessible_description(re.compile("^Formats: .*\\.txt"))
    formats = httpx.get(f"{server.url}/frontend/settings", timeout=10).json()["supportedFilesFormat"]
    expect(chosen).to_have_attribute("accept", ",".join(formats))
    page.keyboard.press("Tab")
    expect(page.get_by_role("button", name="Translate file")).to_be_focused()


def test_the_formats_are_listed_by_name_and_others_refused_on_the_page(page: Page, server: Server) -> None:
    def named(route: Route) -> None:
        response = route.fetch()
        settings = response.json()
        settings["filesFormats"] = [
            {"name": "Plain text", "extensions": [".txt"]},
            {"name": "HTML", "extensions": [".html", ".htm"]},
        ]
        route.fulfill(response=response, json=settings)

    page.route("**/frontend/settings", named)
    page.reload()
    expect(page.locator("#target")).to_have_value("en")
    page.get_by_role("tab", name="Files").click()
    expect(page.locator("#formats")).to_have_text("Plain text (.txt), HTML (.html, .htm)")
    formats = httpx.get(f"{server.url}/frontend/settings", timeout=10).json()["supportedFilesFormat"]
    expect(page.get_by_label("File to translate")).to_have_attribute("accept", ",".join(formats))

    sent: list[str] = []
    page.on("request", lambda request: sent.append(request.url) if "/jobs" in request.url else None)
    choose_file(page, "notes.xyz", b"Ein Hund.")
    expect(page.get_by_role("alert")).to_contain_text("does not translate .xyz files")
    assert sent == []  # refused on the page


def test_keyboard_and_labels(page: Page) -> None:
    for label in ("From", "To", "Text to translate", "Translation"):
        expect(page.get_by_label(label, exact=True)).to_be_visible()
    box = page.get_by_label("Text to translate")
    box.focus()
    box.press_sequentially("Ein Hund")
    box.press("Control+Enter")  # translates at once
    expect(page.get_by_label("Translation", exact=True)).not_to_be_empty()
    text_tab = page.get_by_role("tab", name="Text")
    text_tab.focus()
    page.keyboard.press("ArrowRight")
    expect(page.get_by_role("tab", name="Files")).to_have_attribute("aria-selected", "true")
    expect(page.get_by_role("tab", name="Files")).to_be_focused()
    expect(page.get_by_label("File to translate")).to_be_visible()


# --- terminology ----------------------------------------------------------------------------------


def open_glossary(page: Page) -> None:
    summary = page.locator("#glossary-panel summary")
    expect(summary).to_contain_text("Glossary")
    summary.focus()
    summary.press("Enter")  # opens the <details>, as a click does
    expect(page.get_by_label("Stored glossary")).to_be_visible()


# Keeps the text fields of each form the page sends with fetch, in window.sentForms.
RECORD_FORMS = """() => {
  const send = window.fetch;
  window.sentForms = [];
  window.fetch = (url, options = {}) => {
    if (options.body instanceof FormData) {
      const fields = [...options.body].filter(([, value]) => typeof value === "string");
      window.sentForms.push(Object.fromEntries(fields));
    }
    return send(url, options);
  };
}"""


def translation_request(page: Page, text: str) -> dict[str, Any]:
    """The body of the /translate request the page sends for ``text`` typed in, once answered."""
    with page.expect_request(lambda r: r.url.endswith("/translate")) as info:
        page.get_by_label("Text to translate").fill(text)
    response = info.value.response()
    assert response is not None and response.status == 200, response and response.text()
    body: dict[str, Any] = info.value.post_data_json
    return body


def test_typed_terms_are_sent_with_each_translation(page: Page) -> None:
    open_glossary(page)
    terms = page.get_by_label("Terms for this page")
    terms.fill("Hund\tpuppy")  # pasted from a spreadsheet: Tab itself moves on to the next field
    terms.press("End")
    terms.press_sequentially("\nStraße, street \n\nACME\n")
    expect(page.locator("#glossary-state")).to_have_text("3 terms typed")
    body = translation_request(page, "Ein Hund läuft über die Straße.")
    assert body["glossary"] == [
        {"source": "Hund", "target": "puppy"},
        {"source": "Straße", "target": "street"},
        {"source": "ACME", "target": "ACME"},  # a term alone: kept untranslated
    ]
    assert "glossary_id" not in body
    expect(page.locator("#output")).not_to_be_empty()

    # (Chromium does not show a multipart body with a file to Playwright: the page's forms are kept.)
    page.evaluate(RECORD_FORMS)
    jobs = FakeJobs(page)
    jobs.queued.append(fake_job("job-1", "brief.txt", "queued"))
    choose_file(page, "brief.txt", "Ein Hund läuft.".encode())  # files get the terms too
    expect(job_item(page, "brief.txt").locator(".job-state")).to_have_text("Queued")
    page.get_by_role("tab", name="Text").click()
    forms = page.evaluate("() => window.sentForms")
    assert [json.loads(form["glossary"]) for form in forms] == [body["glossary"]]

    terms.fill("")
    expect(page.locator("#glossary-state")).to_have_text("none")
    assert "glossary" not in translation_request(page, "Ein Hund läuft.")


def test_a_glossary_uploaded_is_stored_picked_and_sent(page: Page, server: Server) -> None:
    open_glossary(page)
    page.get_by_label("CSV or TSV file").set_input_files(
        {"name": "pets.csv", "mimeType": "text/csv", "buffer": b"Hund,puppy\nACME,ACME\n"}
    )
    name = page.get_by_label("Name", exact=True)
    name.fill("pets")
    name.press("Enter")  # submits the form
    status = page.locator("#glossary-status")
    expect(status).to_contain_text("Choose the language")  # "Detect language" has no language yet
    expect(page.get_by_label("From")).to_be_focused()

    page.get_by_label("From").select_option("de")
    page.get_by_role("button", name="Upload glossary").click()
    expect(status).to_have_text('Stored "pets": 2 terms, de → en.')
    picked = page.get_by_label("Stored glossary")
    expect(picked).to_be_focused()
    expect(picked.locator("option:checked")).to_have_text("pets (de → en, 2 terms)")
    expect(page.locator("#glossary-state")).to_have_text("pets")

    stored = httpx.get(f"{server.url}/glossaries", timeout=10).json()["glossaries"]
    found = [g for g in stored if g["name"] == "pets"]
    assert [(g["source_lang"], g["target_lang"], g["entry_count"]) for g in found] == [("de", "en", 2)]
    body = translation_request(page, "Ein Hund bellt.")
    assert body["glossary_id"] == found[0]["id"]
    assert "glossary" not in body

    picked.select_option(label="None")
    expect(page.locator("#glossary-state")).to_have_text("none")
    assert "glossary_id" not in translation_request(page, "Ein Hund bellt laut.")


def test_a_glossary_term_is_marked_in_the_translation(page: Page) -> None:
    """Against the model: the constrained search writes the term, the answer says where."""
    page.get_by_label("From").select_option("de")
    open_glossary(page)
    page.get_by_label("Terms for this page").fill("Hund\tpuppy")
    page.get_by_label("Text to translate").fill("Ein Hund bellt.")
    mark = page.locator("#output mark")
    expect(mark).to_have_text("puppy", timeout=WAIT_MS)  # a constrained beam search: slower
    expect(mark).to_have_attribute("title", "glossary: Hund → puppy")
    # (Then, where the model is unsure of the forced sentence, a note on that: confidence's test.)
    expect(page.locator("#terms-note")).to_contain_text("Glossary terms: Hund → puppy.")


def test_an_answer_from_the_translation_memory_is_marked(page: Page, server: Server) -> None:
    """Against the service: a sentence of the memory is answered from it, and the page says so."""
    sentence, stored = "Zwei Katzen schlafen auf dem Sofa.", "Two cats doze on the sofa."
    table = f"{sentence}\t{stored}\n".encode()
    response = httpx.post(
        f"{server.url}/memories",
        files={"file": ("team.tsv", table, "text/tab-separated-values")},
        data={"source_lang": "de", "target_lang": "en"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    output = page.locator("#output")
    page.get_by_label("Text to translate").fill(f"Danke. {sentence}")
    expect(output.locator("mark.memory")).to_have_text(stored)  # that sentence, not the other
    expect(output.locator("mark.memory")).to_have_attribute("title", "from translation memory")
    expect(output).to_contain_text(stored)
    # (Then, where the model is unsure of the other sentence, a note on that: confidence's test.)
    expect(page.locator("#terms-note")).to_contain_text("From translation memory.")


def test_decided_terms_and_memory_answers_are_marked_as_text(page: Page) -> None:
    text = "😀 <b>x</b> The invoice for {name}."  # before the terms: a character of 2 UTF-16 units
    terms = [
        {"source": "Rechnung", "target": "invoice", "start": 15, "end": 22},
        {"source": "{name}", "target": "{name}", "start": 27, "end": 33},
    ]
    assert [text[t["start"] : t["end"]] for t in terms] == ["invoice", "{name}"]
    remembered = "Thank you. <i>Our</i> dog barks."
    answers = iter(
        [
            {"translatedText": text, "terminology": {"memory": False, "terms": terms}},
            {
                "translatedText": remembered,
                "terminology": {
                    "memory": True,
                    "terms": [],
                    "segments": [{"start": 11, "end": len(remembered)}],
                },
            },
            {"translatedText": "A dog.", "terminology": {"memory": True, "terms": []}},  # all of it
            {"translatedText": "A cat."},
        ]
    )
    page.route("**/translate", lambda route: route.fulfill(json=next(answers)))
    output = page.locator("#output")
    box = page.get_by_label("Text to translate")
    box.fill("Die Rechnung für {name}.")
    expect(output).to_have_text(text)
    marks = output.locator("mark")
    expect(marks).to_have_text(["invoice", "{name}"])
    expect(marks.first).to_have_attribute("title", "glossary: Rechnung → invoice")
    expect(marks.last).to_have_attribute("title", "glossary: {name} → {name}")
    expect(output.locator("b")).to_have_count(0)  # the model's text stays text
    note = page.locator("#terms-note")
    expect(note).to_have_text("Glossary terms: Rechnung → invoice; {name} → {name}.")
    expect(output.locator("mark.memory")).to_have_count(0)

    box.fill("Danke. Unser Hund bellt.")
    expect(output).to_have_text(remembered)
    expect(marks).to_have_text(["<i>Our</i> dog barks."])  # the sentence from the memory, as text
    expect(marks).to_have_class("memory")
    expect(marks).to_have_attribute("title", "from translation memory")
    expect(note).to_have_text("From translation memory.")

    box.fill("Ein Hund.")
    expect(output.locator("mark.memory")).to_have_text("A dog.")
    expect(output).to_have_text("A dog.")

    box.fill("Eine Katze.")
    expect(output).to_have_text("A cat.")
    expect(marks).to_have_count(0)
    expect(note).to_be_hidden()


def test_sentences_the_model_is_unsure_of_are_marked_by_more_than_colour(page: Page) -> None:
    """The page asks for each sentence's confidence and marks the low ones: a wavy (unsure, below
    0.5) or dotted (doubtful, below 0.8) underline, the confidence in the title, and a note that
    names them (what a screen reader and a colour-blind reader get); a term inside keeps its mark."""
    text = "A dog runs. The invoice is due. A cat sleeps."
    answer = {
        "translatedText": text,
        "confidence": 0.3,
        "sentenceConfidence": [
            {"start": 0, "end": 11, "confidence": 0.3},
            {"start": 12, "end": 31, "confidence": 0.6},
            {"start": 32, "end": 45, "confidence": 0.95},
        ],
        "terminology": {
            "memory": False,
            "terms": [{"source": "Rechnung", "target": "invoice", "start": 16, "end": 23}],
        },
    }
    asked: list[dict[str, Any]] = []

    def fulfill(route: Any) -> None:
        asked.append(json.loads(route.request.post_data or "{}"))
        route.fulfill(json=answer)

    page.route("**/translate", fulfill)
    page.get_by_label("Text to translate").fill(
        "Ein Hund läuft. Die Rechnung ist fällig. Eine Katze schläft."
    )
    output = page.locator("#output")
    expect(output).to_have_text(text)
    assert asked[-1]["confidence"] is True
    expect(output.locator(".unsure")).to_have_text("A dog runs.")
    expect(output.locator(".unsure")).to_have_attribute(
        "title", "The model is unsure of this sentence (confidence 30 %)"
    )
    expect(output.locator(".doubtful")).to_have_text("The invoice is due.")
    expect(output.locator(".doubtful mark")).to_have_text("invoice")
    assert output.locator(".unsure").evaluate("e => getComputedStyle(e).textDecorationStyle") == "wavy"
    assert output.locator(".doubtful").evaluate("e => getComputedStyle(e).textDecorationStyle") == "dotted"
    expect(page.locator("#terms-note")).to_have_text(
        "Glossary terms: Rechnung → invoice. 1 sentence the model is unsure of (wavy underline): check them. "
        "1 sentence that may be wrong (dotted underline)."
    )


def test_the_page_makes_no_requests_elsewhere(page: Page, server: Server) -> None:
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url))
    page.reload()
    expect(page.locator("#target")).to_have_value("en")
    open_glossary(page)
    page.get_by_label("Terms for this page").fill("Hund\tpuppy")
    translation_request(page, "Ein Hund spielt.")
    expect(page.locator("#output")).not_to_be_empty()
    assert any(url.endswith("/glossaries") for url in urls)
    assert urls and all(url.startswith(f"{server.url}/") for url in urls), urls


# --- a server that asks for API keys ----------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("browser-keys") / "uvicorn.log"
    data = tmp_path_factory.mktemp("browser-keys-data")
    srv = start_server(log, NMT_MODEL_DIR=str(model_dir), NMT_API_KEYS="secret-1", NMT_DATA_DIR=str(data))
    try:
        wait_ready(srv)
        yield srv
    finally:
        stop(srv)


def test_the_page_asks_for_the_api_key_and_sends_it_in_a_header_never_a_url(
    browser: Browser, keyed_server: Server
) -> None:
    context = browser.new_context(base_url=keyed_server.url)
    page: Any = context.new_page()
    page.set_default_timeout(WAIT_MS)
    sent: list[Any] = []
    page.on("request", lambda request: sent.append(request))
    try:
        page.goto("/")
        expect(page.get_by_role("heading", name="API key required")).to_be_visible()
        page.get_by_label("Text to translate").fill("Ein Hund.")
        expect(page.get_by_role("alert")).to_contain_text("API key")  # 403 without one
        page.get_by_label("API key", exact=True).fill("secret-1")
        with page.expect_response(lambda r: r.url.endswith("/glossaries")) as listed:
            page.get_by_role("button", name="Save key").click()
        assert listed.value.ok and listed.value.request.all_headers().get("x-api-key") == "secret-1"
        expect(page.get_by_label("Translation", exact=True)).not_to_be_empty()
        expect(page.locator("#message")).to_be_hidden()

        # A document job: made, polled and downloaded with the key in the header.
        drop_file(page, "brief.txt", "Ein Hund.")
        with page.expect_response(lambda r: r.url == f"{keyed_server.url}/jobs") as posted:
            page.get_by_role("button", name="Translate file").click()
        assert posted.value.status == 202, posted.value.text()
        job_id = posted.value.json()["id"]
        item = job_item(page, "brief.txt")
        expect(item.locator(".job-state")).to_have_text("Done", timeout=2 * WAIT_MS)
        with page.expect_download() as info:
            item.get_by_role("link", name="Download brief_en.txt").click()
        assert info.value.suggested_filename == "brief_en.txt"
        result = httpx.get(
            f"{keyed_server.url}/jobs/{job_id}/result", headers={"X-API-Key": "secret-1"}, timeout=10
        )
        assert result.status_code == 200 and Path(info.value.path()).read_bytes() == result.content

        assert not [r.url for r in sent if "secret-1" in r.url or "api_key" in r.url]
        # After the key was saved, every request to the API carried it.
        after = sent[sent.index(listed.value.request) :]
        api = [r for r in after if r.url.startswith(keyed_server.url) and "/static/" not in r.url]
        assert len(api) >= 4  # glossaries, translate, the job, its polls, its result
        assert all(r.all_headers().get("x-api-key") == "secret-1" for r in api), [r.url for r in api]
    finally:
        context.close()
