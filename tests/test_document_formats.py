"""Every format's generated samples (tests/documents/*.py) through the service as deployed: the
synchronous /translate_file and a /jobs job give the same file, its structure kept (each format's
``check_structure``), its text translated, and the format's media type."""

from __future__ import annotations

import importlib
import io
import pkgutil
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import tests.documents
from app.formats.documents import MEDIA_TYPES, SUPPORTED, extension
from tests.test_api import make_settings, serve

Check = Callable[[str, bytes, bytes], None]


def samples() -> Iterator[tuple[str, Callable[[], bytes], Check]]:
    for module_info in pkgutil.iter_modules(tests.documents.__path__):
        module: Any = importlib.import_module(f"tests.documents.{module_info.name}")
        for name, make in module.SAMPLES.items():
            yield name, make, module.check_structure


SAMPLES = sorted(samples(), key=lambda s: s[0])


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    # The test model answers in German-looking word salad: each format's check_structure asks
    # for its structure, not for particular words.
    settings = make_settings(model_dir, data_dir=tmp_path_factory.mktemp("data"), max_jobs_per_key=100)
    with serve(settings) as c:
        yield c


def test_every_supported_extension_has_a_generated_sample() -> None:
    covered = {extension(name) for name, _, _ in SAMPLES} | {".txt", ".html", ".htm", ".docx"}
    assert covered >= set(SUPPORTED), set(SUPPORTED) - covered


def same_document(a: bytes, b: bytes) -> bool:
    """The same bytes; for a zip package (.docx, .pptx, ...) the same files with the same bytes, in
    the same order: python-docx and python-pptx date each file with the time of the save, so two
    saves a 2-second tick apart differ there and only there."""
    if not (a.startswith(b"PK") and b.startswith(b"PK")):
        return a == b
    with zipfile.ZipFile(io.BytesIO(a)) as x, zipfile.ZipFile(io.BytesIO(b)) as y:
        members = [(i.filename, x.read(i)) for i in x.infolist()]
        return members == [(i.filename, y.read(i)) for i in y.infolist()]


@pytest.mark.parametrize(("name", "make", "check"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_a_sample_translated_now_and_as_a_job_keeps_its_structure(
    client: TestClient, name: str, make: Callable[[], bytes], check: Check
) -> None:
    original = make()
    form = {"source": "de", "target": "en"}
    sync = client.post("/translate_file", data=form, files={"file": (name, original)})
    assert sync.status_code == 200, sync.text
    translated = client.get(sync.json()["translatedFileUrl"])
    assert translated.headers["content-type"] == MEDIA_TYPES[extension(name)]
    assert translated.content != original  # something was translated
    check(name, original, translated.content)
    job = client.post("/jobs", data=form, files={"file": (name, original)}).json()
    deadline = time.monotonic() + 60
    while (state := client.get(f"/jobs/{job['id']}").json())["state"] not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    assert state["state"] == "done", state
    assert state["progress"]["done"] == state["progress"]["total"] > 0
    assert same_document(client.get(state["resultUrl"]).content, translated.content)
    if name.endswith(".pdf"):  # the sample's image-only page is named in the job's notes
        assert any("no text layer" in note for note in state["notes"]), state
