"""Documents flagged for review by confidence (issue 58), through the real app and a real worker
serving the shipped de-en model: /translate_file and /jobs take ``min_confidence``, and the sentences
whose confidence is below it (as the library computes it: the model's calibration of
``Translator.generate``'s best hypothesis, the same search) are the ones the file marks: an XLIFF
1.2 unit's note, a 2.x segment's state and its unit's note, a .docx comment; other formats count
them without a mark."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docx
import pytest
from fastapi.testclient import TestClient
from lxml import etree

from benchmarks.common import DATA, DEFAULT_MODEL
from model.decoding.confidence import Calibration
from model.translator import Translator
from tests.test_api import make_settings, serve
from training.data import read_lines

NS12 = "urn:oasis:names:tc:xliff:document:1.2"
NS20 = "urn:oasis:names:tc:xliff:document:2.0"
FORM = {"source": "de", "target": "en"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with serve(make_settings(DEFAULT_MODEL, data_dir=tmp_path_factory.mktemp("data"))) as c:
        yield c


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    """Eight test sentences: one per unit or paragraph (none of them splits in two)."""
    return read_lines(DATA / "test_2016_flickr.de.gz")[40:48]


@pytest.fixture(scope="module")
def confidences(client: TestClient, sentences: list[str]) -> list[float]:
    """Each sentence's confidence as the library computes it (float32 and eager, as the test
    server decodes; beam size the service's default)."""
    library = Translator.load(DEFAULT_MODEL, device="cpu")
    calibration = Calibration.load(DEFAULT_MODEL)
    beam = make_settings(DEFAULT_MODEL).default_beam_size
    out = []
    for text in sentences:
        value = calibration.of(library.generate(library.source_ids([text]), beam_size=beam)[0][0])
        assert value is not None
        out.append(value)
    return out


def threshold_between(confidences: list[float]) -> float:
    """A threshold halfway between the 4th and 5th lowest confidences (far from both: no sentence
    sits on it), so that four sentences are below it."""
    ranked = sorted(confidences)
    assert ranked[3] < ranked[4]
    return (ranked[3] + ranked[4]) / 2


def xliff12(sentences: list[str]) -> bytes:
    units = "".join(
        f'<trans-unit id="u{i}"><source>{text}</source></trans-unit>' for i, text in enumerate(sentences)
    )
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><xliff version="1.2" xmlns="{NS12}">'
        f'<file source-language="de" target-language="en" datatype="plaintext" original="t.txt">'
        f"<body>{units}</body></file></xliff>"
    ).encode()


def xliff20(sentences: list[str]) -> bytes:
    units = "".join(
        f'<unit id="u{i}"><segment id="s{i}"><source>{text}</source></segment></unit>'
        for i, text in enumerate(sentences)
    )
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><xliff version="2.0" xmlns="{NS20}" srcLang="de" '
        f'trgLang="en"><file id="f">{units}</file></xliff>'
    ).encode()


def translate_file(client: TestClient, name: str, data: bytes, **form: Any) -> tuple[dict[str, Any], bytes]:
    response = client.post("/translate_file", data={**FORM, **form}, files={"file": (name, data)})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    download = client.get(body["translatedFileUrl"])
    assert download.status_code == 200
    return body, download.content


def test_translate_file_notes_the_xliff_12_units_below_min_confidence(
    client: TestClient, sentences: list[str], confidences: list[float]
) -> None:
    threshold = threshold_between(confidences)
    body, out = translate_file(client, "t.xlf", xliff12(sentences), min_confidence=str(threshold))
    expected = {f"u{i}": c for i, c in enumerate(confidences) if c < threshold}
    assert body["lowConfidence"] == len(expected) == 4
    root = etree.fromstring(out)
    units = root.findall(f".//{{{NS12}}}trans-unit")
    noted = {
        u.get("id"): note.text
        for u in units
        for note in u.findall(f"{{{NS12}}}note")
        if note.text is not None
    }
    assert set(noted) == set(expected)
    for unit_id, text in noted.items():
        assert f"{expected[unit_id]:.2f}" in text and f"{threshold:.2f}" in text
    for unit in units:  # every machine translation stays a suggestion to review, as before
        target = unit.find(f"{{{NS12}}}target")
        assert target is not None and target.get("state") == "needs-review-translation"


def test_translate_file_sets_the_xliff_2_segments_below_min_confidence_back_to_initial(
    client: TestClient, sentences: list[str], confidences: list[float]
) -> None:
    threshold = threshold_between(confidences)
    body, out = translate_file(client, "t.xlf", xliff20(sentences), min_confidence=str(threshold))
    assert body["lowConfidence"] == 4
    root = etree.fromstring(out)
    for i, unit in enumerate(root.iter(f"{{{NS20}}}unit")):
        low = confidences[i] < threshold
        segment = unit.find(f"{{{NS20}}}segment")
        assert segment is not None and segment.get("state") == ("initial" if low else "translated")
        notes = unit.findall(f"{{{NS20}}}notes/{{{NS20}}}note")
        assert len(notes) == int(low)
        if low:  # <notes> come first in a unit, as 2.x orders them
            assert etree.QName(unit[0]).localname == "notes"
            assert notes[0].get("appliesTo") == "target" and (notes[0].text or "").startswith(
                f"Segment s{i}:"
            )


def test_without_a_threshold_nothing_is_marked_and_the_answer_is_libretranslates(
    client: TestClient, sentences: list[str]
) -> None:
    body, out = translate_file(client, "t.xlf", xliff12(sentences))
    assert set(body) == {"translatedFileUrl"}
    assert etree.fromstring(out).find(f".//{{{NS12}}}note") is None
    marked, _ = translate_file(client, "t.xlf", xliff12(sentences), min_confidence="1")
    assert marked["lowConfidence"] >= 1  # (the same file is marked when asked: the threshold is what differs)


def test_translate_file_comments_the_docx_paragraphs_below_min_confidence(
    client: TestClient, sentences: list[str], confidences: list[float]
) -> None:
    document = docx.Document()
    for text in sentences:
        document.add_paragraph(text)
    data = io.BytesIO()
    document.save(data)
    threshold = threshold_between(confidences)
    body, out = translate_file(client, "t.docx", data.getvalue(), min_confidence=str(threshold))
    assert body["lowConfidence"] == 4
    translated = docx.Document(io.BytesIO(out))
    anchored = [bool(p._p.xpath(".//w:commentRangeStart")) for p in translated.paragraphs if p.text.strip()]
    assert anchored == [c < threshold for c in confidences]
    comments = list(translated.comments)
    assert len(comments) == 4 and {c.author for c in comments} == {"Machine translation"}


def test_a_format_without_marks_counts_the_sentences_and_writes_the_same_file(
    client: TestClient, sentences: list[str], confidences: list[float]
) -> None:
    data = "\n".join(sentences).encode()
    threshold = threshold_between(confidences)
    body, marked = translate_file(client, "t.txt", data, min_confidence=str(threshold))
    _, plain = translate_file(client, "t.txt", data)
    assert body["lowConfidence"] == 4 and marked == plain


def test_a_job_marks_its_file_and_says_how_many_it_flagged(
    client: TestClient, sentences: list[str], confidences: list[float], tmp_path: Path
) -> None:
    threshold = threshold_between(confidences)
    response = client.post(
        "/jobs",
        data={**FORM, "min_confidence": str(threshold)},
        files={"file": ("t.xlf", xliff20(sentences))},
    )
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    deadline = time.monotonic() + 120
    while (job := client.get(f"/jobs/{job_id}").json())["state"] not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert job["state"] == "done", job
    assert job["notes"] == [
        f"4 of 8 sentences below confidence {threshold:g} flagged for review "
        "(a note on each unit, its state for review)"
    ]
    result = client.get(job["resultUrl"])
    states = [s.get("state") for s in etree.fromstring(result.content).iter(f"{{{NS20}}}segment")]
    assert states == ["initial" if c < threshold else "translated" for c in confidences]


def test_a_bad_min_confidence_is_refused(client: TestClient, sentences: list[str]) -> None:
    for endpoint in ("/translate_file", "/jobs"):
        response = client.post(
            endpoint, data={**FORM, "min_confidence": "1.5"}, files={"file": ("t.xlf", xliff12(sentences))}
        )
        assert response.status_code in (400, 422), (endpoint, response.text)
