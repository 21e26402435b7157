"""Hostile uploads (tests/hostile_files.py) refused with a clear 4xx, at no cost to anyone else.

First each limit where it is checked (in this process, the formats' own code), then the reader's
child process (its memory and time limits), then the whole corpus over HTTP against
``uvicorn app.main:app`` with its default limits: each file gets its status and message, the
front end's peak memory grows by less than 100 MB, and another client's translations sent at the
same time are answered as usual.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import docx
import httpx
import pytest

from app.config import Settings
from app.formats.documents import read
from app.formats.html import HtmlDocument
from app.formats.limits import DocumentLimits, TooLarge
from app.formats.sandbox import Busy, DocumentReaders, Opened, ReadFile, Reading, Refused, SplitFile
from app.http.uploads import BUSY_RETRY_AFTER_S
from model.translator import Translator
from tests.hostile_files import HOSTILE, Hostile, many_elements, small_docx
from tests.test_api import assert_error, make_settings, serve
from tests.test_server import Server, running_server

LIMITS = Settings().document_limits()  # the service's defaults
MB = 1024 * 1024


@pytest.fixture(scope="module")
def corpus() -> dict[str, bytes]:
    """Each hostile file, made once (the bomb takes a few seconds to deflate), and a heavy one
    within the limits."""
    return {hostile.name: hostile.make() for hostile in HOSTILE} | {"heavy": many_elements(180_000)}


# --- Each limit, where it is checked ----------------------------------------------------------------


@pytest.mark.parametrize("hostile", HOSTILE, ids=[h.name for h in HOSTILE])
def test_each_hostile_file_is_refused_by_its_limit(
    hostile: Hostile, corpus: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    # python-docx builds the whole tree: a hostile package must be refused before it is called.
    def no_tree(*args: Any) -> None:
        raise AssertionError("python-docx was asked to read a hostile package")

    monkeypatch.setattr(docx, "Document", no_tree)
    reading = Reading(LIMITS)  # what the reader's child does, here in this process
    answer = reading.answer(ReadFile(hostile.filename, corpus[hostile.name]))
    if isinstance(answer, Opened):
        answer = reading.answer(SplitFile("de"))
    assert isinstance(answer, Refused), answer
    assert answer.status == hostile.status, answer
    assert hostile.words in answer.message


def test_text_is_counted_as_the_package_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """A .docx with more text than the limit is refused by the package check, which counts its
    runs' text as it inflates (python-docx never reads it)."""
    text = ("Ein Hund läuft über die Wiese. " * 40).strip()
    limits, data = replace(LIMITS, max_chars=len(text) - 1), small_docx(text)
    with monkeypatch.context() as patched:
        patched.setattr(docx, "Document", None)  # called, it would raise TypeError
        with pytest.raises(TooLarge, match=f"at most {len(text) - 1} characters"):
            read("a.docx", data, limits)
    assert read("a.docx", data, replace(limits, max_chars=len(text))).text == text


def test_ratio_and_entry_limits() -> None:
    data = small_docx()
    parts = zipfile.ZipFile(io.BytesIO(data)).infolist()
    biggest = max(info.file_size for info in parts)
    with pytest.raises(TooLarge, match="inflates to more than"):
        read("a.docx", data, replace(LIMITS, max_entry_bytes=biggest - 1))
    with pytest.raises(TooLarge, match=f"at most {len(parts) - 1}"):
        read("a.docx", data, replace(LIMITS, max_entries=len(parts) - 1))
    with pytest.raises(TooLarge, match="inflates to"):
        read("a.docx", data, replace(LIMITS, max_unpacked_bytes=sum(p.file_size for p in parts) - 1))
    assert read("a.docx", data, replace(LIMITS, max_entries=len(parts))).text == "Ein Hund läuft."


@pytest.mark.parametrize(
    "markup",
    [
        "<ul>" + "<li>Ein Hund." * 5_000 + "</ul>",  # list items whose end tags are left out
        "<p>Ein Hund." * 5_000,  # paragraphs, likewise
        "<table>" + "<tr><td>Ein<td>Hund" * 5_000 + "</table>",  # cells and rows, likewise
        "<div>" * 512 + "Ein Hund." + "</div>" * 512,  # at the limit
    ],
)
def test_html_left_open_as_browsers_allow_is_not_deep(markup: str) -> None:
    assert "Hund" in HtmlDocument.parse(markup, LIMITS).text


def test_html_one_level_past_the_depth_limit_is_refused() -> None:
    with pytest.raises(TooLarge, match="nests more than 512"):
        HtmlDocument.parse("<div>" * 513 + "Ein Hund." + "</div>" * 513, LIMITS)


def test_a_docx_translation_never_writes_what_xml_cannot_hold() -> None:
    split = read("a.docx", small_docx("Ein Hund."), LIMITS).split("de")
    out = docx.Document(io.BytesIO(split.join(["A\x00 dog\x1b.\ufffe"])))
    assert out.paragraphs[0].text == "A dog."


# --- The reader's child process ---------------------------------------------------------------------


def read_in_child(name: str, data: bytes, limits: DocumentLimits) -> tuple[str, tuple[str, ...]]:
    async def run() -> tuple[str, tuple[str, ...]]:
        readers = DocumentReaders(limits, readers=1, max_output=8 * MB)
        await asyncio.to_thread(readers.start)
        document = await readers.read(name, data, lambda sample: "de")
        return document.language, document.sentences

    return asyncio.run(run())


def test_a_file_that_needs_more_memory_than_the_reader_has_is_refused() -> None:
    """A million tags (~600 MB of blocks), allowed by the counts: the child runs out of its 64 MiB."""
    limits = replace(LIMITS, max_elements=10**7, max_chars=10**7, memory_bytes=64 * MB)
    with pytest.raises(TooLarge, match="64 MiB"):
        read_in_child("a.html", b"<p>Ein Hund." + b"<br>" * 1_000_000, limits)


def test_a_file_that_takes_longer_than_the_reader_may_is_refused_and_its_reader_killed() -> None:
    """Two million tags (tens of seconds of parsing), allowed by the counts, against 1 s of CPU."""
    limits = replace(LIMITS, max_elements=10**8, max_depth=10**8, read_seconds=1.0, memory_bytes=4096 * MB)
    with pytest.raises(TooLarge, match="more than 1 s of CPU"):
        read_in_child("a.html", b"<b>" * 2_000_000, limits)


def test_the_child_reads_what_the_front_end_would() -> None:
    data = "Ein Hund läuft. Eine Katze schläft.\n\nZwei Kinder.".encode()
    language, sentences = read_in_child("a.txt", data, LIMITS)
    assert (language, sentences) == ("de", read("a.txt", data, LIMITS).split("de").sentences)
    with pytest.raises(TooLarge, match="too many sentences"):
        read_in_child("a.txt", data, replace(LIMITS, max_sentences=2))


def test_the_front_end_takes_no_answer_longer_than_its_limit_from_a_reader() -> None:
    async def run() -> bytes:
        readers = DocumentReaders(LIMITS, readers=1, max_output=100)
        await asyncio.to_thread(readers.start)
        return await readers.write("a.txt", b"Ein Hund.", "de", 1, ["A dog. " * 20])

    with pytest.raises(TooLarge, match="larger than 100 bytes"):
        asyncio.run(run())


def test_a_request_waits_for_a_reader_at_most_read_seconds_then_is_told_busy() -> None:
    async def run() -> None:
        readers = DocumentReaders(replace(LIMITS, read_seconds=1.0), readers=1, max_output=MB)
        await asyncio.to_thread(readers.start)
        async with readers.reader():  # the only reader, taken
            with pytest.raises(Busy):
                await readers.read("a.txt", b"Hallo.", lambda sample: "de")
        document = await readers.read("a.txt", b"Hallo.", lambda sample: "de")
        assert (document.language, document.sentences, document.chars) == ("de", ("Hallo.",), 6)

    asyncio.run(run())


# --- The settings, through the app ------------------------------------------------------------------


def test_file_limits_are_read_from_the_settings(model_dir: Path) -> None:
    settings = make_settings(model_dir, max_file_sentences=2, max_file_depth=3, max_file_requests=1)
    with serve(settings) as client:
        form = {"source": "de", "target": "en"}

        def upload(name: str, data: bytes) -> Any:
            return client.post("/translate_file", data=form, files={"file": (name, data)})

        assert_error(upload("a.txt", b"Ein Hund. Eine Katze. Ein Kind."), 413, "(at most 2)")
        assert upload("a.txt", b"Ein Hund. Eine Katze.").status_code == 200
        # Controls other than NUL are text: bidi overrides and isolates, escapes, zero-width marks.
        controls = "\u202eEin\u202c \u2066Hund\u2069.\n\x1b[1m\u200bKatze\ufeff."
        assert upload("a.txt", controls.encode()).status_code == 200
        assert upload("a.docx", small_docx(controls.replace("\x1b", ""))).status_code == 200
        assert_error(upload("a.html", b"<div><div><div><div>Hund"), 413, "nests more than 3")
        places = client.app.state.services.file_requests  # type: ignore[attr-defined]
        places.count = 1  # one file in progress: the most allowed
        busy = upload("a.txt", b"Ein Hund.")
        assert_error(busy, 503, "retry later")
        assert busy.headers["retry-after"] == BUSY_RETRY_AFTER_S
        places.count = 0
        assert upload("a.txt", b"Ein Hund.").status_code == 200


# --- Over HTTP, as deployed -------------------------------------------------------------------------


def vm(pid: int, field: str) -> int:
    """A memory figure of /proc/<pid>/status, in bytes (VmRSS: now; VmHWM: the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(
        tmp_path_factory.mktemp("hostile") / "uvicorn.log", NMT_MODEL_DIR=str(model_dir)
    ) as srv:
        yield srv


class Neighbour(threading.Thread):
    """Another client, translating a sentence again and again until told to stop."""

    def __init__(self, url: str, sentence: str) -> None:
        super().__init__(daemon=True)
        self.url, self.sentence = url, sentence
        self.answers: list[tuple[int, str]] = []
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.done.is_set():
                body = {"q": self.sentence, "source": "de", "target": "en"}
                response = client.post(f"{self.url}/translate", json=body)
                self.answers.append((response.status_code, response.text))


def test_hostile_files_over_http_cost_no_one_else_anything(
    server: Server, corpus: dict[str, bytes], translator: Translator
) -> None:
    sentence = "Ein Hund läuft über die Wiese."
    expected = translator.translate_batch([sentence], beam_size=5)[0].hypotheses[0]
    pid = server.process.pid
    form = {"source": "de", "target": "en"}
    with httpx.Client(timeout=60) as client:
        warm = client.post(f"{server.url}/translate_file", data=form, files={"file": ("a.txt", b"Hallo.")})
        assert warm.status_code == 200, warm.text
        neighbour = Neighbour(server.url, sentence)
        neighbour.start()
        base = vm(pid, "VmRSS")
        reset_peak(pid)
        answers = {}
        for hostile in HOSTILE:
            files = {"file": (hostile.filename, corpus[hostile.name])}
            start = time.monotonic()
            response = client.post(f"{server.url}/translate_file", data=form, files=files)
            answers[hostile.name] = (response, time.monotonic() - start)
        # Within every limit, yet ~110 MB to read and write (python-docx's tree of 180,000
        # elements): read where it costs the front end nothing.
        heavy = client.post(
            f"{server.url}/translate_file", data=form, files={"file": ("h.docx", corpus["heavy"])}
        )
        peak = vm(pid, "VmHWM")
        neighbour.done.set()
        neighbour.join()
    for hostile in HOSTILE:
        response, seconds = answers[hostile.name]
        assert response.status_code == hostile.status, (hostile.name, response.text)
        assert hostile.words in response.json()["error"], hostile.name
        # benchmarks/hostile.py measures these (each refused within ~1.3 s on 2 cores); here,
        # "quickly": inflating the 600 MB bomb in full would take ~39 s.
        assert seconds < 5, (hostile.name, seconds)
    assert heavy.status_code == 200, heavy.text
    assert peak - base < 100 * MB, f"the front end grew by {(peak - base) / MB:.0f} MB"
    assert neighbour.answers, "the other client was never answered"
    assert {status for status, _ in neighbour.answers} == {200}, neighbour.answers
    assert {json.loads(text)["translatedText"] for _, text in neighbour.answers} == {expected}


def test_many_elements_file_is_made_of_elements_not_ratio() -> None:
    """The corpus's many-elements package must reach the element count (not stop at the ratio)."""
    parts = zipfile.ZipFile(io.BytesIO(many_elements())).infolist()
    assert all(p.file_size <= LIMITS.max_ratio * p.compress_size or p.file_size < MB for p in parts)
