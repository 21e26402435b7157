"""An imported model is just a model directory: OPUS-MT models (transformers MarianMTModels made
here, tests/marian_models.py) converted by ``model.convert.marian`` and served over HTTP by the real
app and workers, in int8 with the running batch (and unquantized, as ``auto`` is without VNNI),
routed by their languages (the multilingual one by its >>fra<< tokens), counted in the metrics, and
answered as the library and the CLI answer.

Expected translations come from ``Translator`` on the converted directories (which
tests/test_convert_marian.py checks against transformers and CTranslate2), so a test fails if a
request reaches the wrong model or target token, or a neighbour in the running batch changes a row.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.config import Settings
from app.monitoring.metrics import Metrics
from model.decoding.terms import sentence_terms
from model.translator import Translator
from tests.conftest import under_ci
from tests.marian_models import MarianOptions, data_dir, read_gz
from tests.test_api import make_settings, serve

pytest.importorskip("transformers")
if data_dir() is None and not under_ci():
    pytest.skip("Multi30k not found: the Marian test models train on it", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
BILINGUAL, MULTILINGUAL = "opus-mt-de-en", "opus-mt-de-mul"


@pytest.fixture(scope="module")
def shelf(
    tmp_path_factory: pytest.TempPathFactory, marian_dirs: Callable[[MarianOptions], tuple[Path, Path]]
) -> Path:
    """A folder of two converted OPUS-MT models: de->en, and de->{en, fr, cs} by target token."""
    folder = tmp_path_factory.mktemp("imported")
    for name, options in ((BILINGUAL, MarianOptions()), (MULTILINGUAL, MarianOptions(multilingual=True))):
        shutil.copytree(marian_dirs(options)[1], folder / name)
    return folder


@pytest.fixture(scope="module")
def settings(shelf: Path) -> Settings:
    # int8 (per row) as the service's CPU default, two rows of work at a time at least.
    return make_settings(shelf, quantization="int8")


@pytest.fixture(scope="module")
def client(settings: Settings) -> Iterator[TestClient]:
    with serve(settings) as c:
        yield c


@pytest.fixture(scope="module")
def float32_served(shelf: Path) -> Iterator[tuple[TestClient, Settings]]:
    """The shelf served unquantized too (what ``auto`` gives on CPUs without VNNI), with its settings."""
    settings = make_settings(shelf, quantization="none")
    with serve(settings) as c:
        yield c, settings


@functools.cache
def translator(model_dir: Path, settings: Settings) -> Translator:
    options = settings.decode_options()
    return Translator.load(model_dir, device="cpu", quantization=settings.quantization, options=options)


def library(shelf: Path, settings: Settings, name: str, texts: list[str], target: str) -> list[str]:
    """What the library translates ``texts`` into, decoding as the service does: its placeholders
    (a number, say) kept as the service keeps them by default (``model.decoding.terms``)."""
    terms = [
        [t.target for t in sentence_terms(text, None, protect=True, limit=settings.max_terms_per_sentence)]
        for text in texts
    ]
    results = translator(shelf / name, settings).translate_batch(texts, target=target, terms=terms)
    return [r.hypotheses[0] for r in results]


def post(client: TestClient, texts: list[str], target: str) -> list[str]:
    answer = client.post("/translate", json={"q": texts, "source": "de", "target": target})
    assert answer.status_code == 200, answer.text
    translated: Any = answer.json()["translatedText"]
    return list(translated)


def test_languages_list_the_imported_directions(client: TestClient) -> None:
    targets = {entry["code"]: entry["targets"] for entry in client.get("/languages").json()}
    assert targets["de"] == ["en", "fr", "cs"]
    models = {m["name"]: m["directions"] for m in client.get("/info").json()["models"]}
    assert models == {BILINGUAL: ["de-en"], MULTILINGUAL: ["de-en", "de-fr", "de-cs"]}


@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_each_request_is_translated_by_its_model_and_target_token(
    request: pytest.FixtureRequest, client: TestClient, shelf: Path, settings: Settings, quantization: str
) -> None:
    """Each answer is the library's with the model and target token asked for, in int8 and float32.
    The multilingual model opens every translation with a word its target token alone chooses
    (tests/marian_models.py checks the margin as it builds the model), so that answers made with
    another token, or by the other model, differ in every sentence: none can pass for the right one."""
    if quantization != settings.quantization:
        client, settings = request.getfixturevalue("float32_served")
    texts = read_gz("test_2016_flickr.de.gz", 6)
    english = post(client, texts, "en")  # de-en: the bilingual model's
    assert english == library(shelf, settings, BILINGUAL, texts, "en")
    multilingual = {"en": library(shelf, settings, MULTILINGUAL, texts, "en")}
    for target in ("fr", "cs"):
        multilingual[target] = post(client, texts, target)
        assert multilingual[target] == library(shelf, settings, MULTILINGUAL, texts, target), target
    opening = {target: {text.split()[0] for text in answers} for target, answers in multilingual.items()}
    assert all(len(words) == 1 for words in opening.values()), opening  # one word for each token,
    assert len(set.union(*opening.values())) == 3, opening  # another for each token,
    assert all(e.split()[0] not in opening["en"] for e in english), english  # and not the bilingual's


def test_concurrent_clients_get_the_answers_each_sentence_gets_alone(
    client: TestClient, shelf: Path, settings: Settings
) -> None:
    """Twelve clients at once share the running batch (and two models); each one's answer is the
    library's for its sentence alone."""
    texts = read_gz("test_2016_flickr.de.gz", 12, offset=20)
    targets = ["en", "fr"] * 6
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda tt: post(client, [tt[0]], tt[1])[0], zip(texts, targets, strict=True)))
    for text, target, got in zip(texts, targets, answers, strict=True):
        name = BILINGUAL if target == "en" else MULTILINGUAL
        assert got == library(shelf, settings, name, [text], target)[0], text


def test_metrics_count_the_imported_model(client: TestClient) -> None:
    metrics: Metrics = client.app.state.services.metrics  # type: ignore[attr-defined]

    def translated() -> float:
        return metrics.sample("nmt_sentences_total", {"model": MULTILINGUAL, "outcome": "translated"})

    before = translated()
    post(client, read_gz("test_2016_flickr.de.gz", 3, offset=40), "cs")
    assert translated() - before == 3


def test_the_cli_translates_an_imported_model_as_the_service_does(client: TestClient, shelf: Path) -> None:
    texts = read_gz("test_2016_flickr.de.gz", 5, offset=60)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NMT_")}
    cli = subprocess.run(
        [sys.executable, "-m", "model.translate", "--model", str(shelf / MULTILINGUAL), "--target", "fr"]
        + ["--quantization", "int8", "--no-compile", "--device", "cpu", "--no-progress"],
        input="\n".join(texts) + "\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
        check=True,
    )
    assert cli.stdout.splitlines() == post(client, texts, "fr")
