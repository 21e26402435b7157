"""A pivot over two imported models: de->fr served as de->en->fr, each hop an OPUS-MT model
converted by ``model.convert.marian`` (tests/marian_models.py), in int8 with the running batch.

Only de->en and de->{en, fr, cs} models can be trained here (no hub), so the second hop is the
converted de->en model labelled en->fr: weights and vocabulary as imported, a pair of its own for the
router. What is checked is the service around the models: /languages and /info list the pivot; a
de->fr answer is the second model's translation of the first's best, as the library gives them; a
glossary term is forced on the last hop; and the segment cache answers the whole pivot again.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.config import Settings
from model.translator import Translator
from tests.conftest import under_ci
from tests.marian_models import MarianOptions, data_dir, read_gz
from tests.test_api import make_settings, serve

pytest.importorskip("transformers")
if data_dir() is None and not under_ci():
    pytest.skip("Multi30k not found: the Marian test models train on it", allow_module_level=True)

FIRST, SECOND = "opus-mt-de-en", "opus-mt-en-fr"


@pytest.fixture(scope="module")
def shelf(
    tmp_path_factory: pytest.TempPathFactory, marian_dirs: Callable[[MarianOptions], tuple[Path, Path]]
) -> Path:
    folder = tmp_path_factory.mktemp("pivot")
    converted = marian_dirs(MarianOptions())[1]
    shutil.copytree(converted, folder / FIRST)
    shutil.copytree(converted, folder / SECOND)
    config = folder / SECOND / "config.json"
    data = json.loads(config.read_text())
    data["source_lang"], data["target_lang"] = "en", "fr"
    config.write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def settings(shelf: Path) -> Settings:
    return make_settings(shelf, quantization="int8", segment_cache_mb=16)


@pytest.fixture(scope="module")
def client(settings: Settings) -> Iterator[TestClient]:
    with serve(settings) as c:
        yield c


@functools.cache
def translator(model_dir: Path, settings: Settings) -> Translator:
    options = settings.decode_options()
    return Translator.load(model_dir, device="cpu", quantization=settings.quantization, options=options)


def best(
    shelf: Path, settings: Settings, name: str, texts: list[str], terms: list[list[str]] | None = None
) -> list[str]:
    results = translator(shelf / name, settings).translate_batch(texts)
    return [r.hypotheses[0] for r in results]


def plain_sentences(n: int) -> list[str]:
    """Test sentences with nothing the service protects as a placeholder (no digits)."""
    texts = [t for t in read_gz("test_2016_flickr.de.gz", 60) if not any(c.isdigit() for c in t)]
    return texts[:n]


def test_the_pivot_is_listed(client: TestClient) -> None:
    targets = {entry["code"]: entry["targets"] for entry in client.get("/languages").json()}
    assert "fr" in targets["de"]
    pivots = client.get("/info").json()["routes"]["pivot"]
    assert {"source": "de", "target": "fr", "via": "en", "models": [FIRST, SECOND]} in pivots


def test_a_pivot_answer_is_the_second_models_translation_of_the_firsts(
    client: TestClient, shelf: Path, settings: Settings
) -> None:
    texts = plain_sentences(4)
    answer = client.post("/translate", json={"q": texts, "source": "de", "target": "fr"})
    assert answer.status_code == 200, answer.text
    english = best(shelf, settings, FIRST, texts)
    assert answer.json()["translatedText"] == best(shelf, settings, SECOND, english)


def test_a_glossary_term_is_forced_on_the_last_hop(client: TestClient) -> None:
    text = next(t for t in plain_sentences(40) if " Mann " in f" {t} ")
    glossary = [{"source": "Mann", "target": "Gärtnerin"}]
    answer = client.post("/translate", json={"q": text, "source": "de", "target": "fr", "glossary": glossary})
    assert answer.status_code == 200, answer.text
    assert "Gärtnerin" in answer.json()["translatedText"]


def test_the_segment_cache_answers_a_pivot_again(client: TestClient) -> None:
    metrics = client.app.state.services.metrics  # type: ignore[attr-defined]
    texts = plain_sentences(12)[8:12]
    body = {"q": texts, "source": "de", "target": "fr"}
    first = client.post("/translate", json=body)
    hits = metrics.sample("nmt_segment_cache_hits_total")
    again = client.post("/translate", json=body)
    assert again.status_code == first.status_code == 200
    assert again.json() == first.json()
    assert metrics.sample("nmt_segment_cache_hits_total") == hits + len(texts)
