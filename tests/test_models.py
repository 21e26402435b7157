"""Several models in one service, through the real app and real workers: tiny random models saved
as four model directories (de->en, en->de, fr->en, and a multilingual cs<->en one) in one folder,
served as ``NMT_MODEL_DIR=<that folder>``.

Expected translations come from ``Translator.translate_batch`` on each model directory (with the
target for the multilingual one), so a test fails if a request reaches the wrong model, the wrong
target token, or a pivot's hops are not chained as they should be.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.monitoring.metrics import Metrics
from app.translation.segments import split_text
from model.checkpoint import ModelInfo, save_model_dir
from model.tokenizer import Tokenizer, target_token
from model.translator import Translator
from tests.conftest import random_model, synthetic_sentences
from tests.test_api import assert_error, make_settings, serve

BEAM = 2
DE = "Ein Mann fährt mit dem Fahrrad die Straße entlang."
FR = "Un homme fait du vélo dans la rue avec son chien."


@pytest.fixture(scope="module")
def shelf(
    model_dir: Path, spm_model: Path, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A folder of model directories, as artifacts/ is: each with its own random weights."""
    folder = tmp_path_factory.mktemp("shelf")
    shutil.copytree(model_dir, folder / "tiny-de-en")
    for seed, (source, target) in ((2, ("en", "de")), (3, ("fr", "en"))):
        model = random_model(seed=seed, sharpen=2.0, eos_boost=1.5, vocab_size=tokenizer.vocab_size)
        save_model_dir(
            folder / f"tiny-{source}-{target}", model, ModelInfo(model.cfg, source, target), spm_model
        )
    spm = Tokenizer.train(
        synthetic_sentences(400), folder / "multi-spm", vocab_size=120, control_symbols=["<2cs>", "<2en>"]
    )
    multi_vocab = Tokenizer(spm)
    model = random_model(seed=4, sharpen=2.0, eos_boost=1.5, vocab_size=multi_vocab.vocab_size)
    prefix = {lang: [multi_vocab.control_id(target_token(lang))] for lang in ("cs", "en")}
    info = ModelInfo.multilingual(model.cfg, [("cs", "en"), ("en", "cs")], prefix)
    save_model_dir(folder / "tiny-multi", model, info, spm)
    for extra in folder.glob("multi-spm*"):
        extra.unlink()
    return folder


@pytest.fixture(scope="module")
def translators(shelf: Path) -> dict[str, Translator]:
    return {d.name: Translator.load(d, device="cpu") for d in sorted(shelf.iterdir())}


@pytest.fixture(scope="module")
def client(shelf: Path) -> Iterator[TestClient]:
    with serve(make_settings(shelf)) as c:  # the folder: every model directory in it
        yield c


def best(translator: Translator, texts: list[str], target: str, n_best: int = 1) -> list[list[str]]:
    found = translator.translate_batch(texts, target=target, beam_size=BEAM, n_best=n_best)
    return [r.hypotheses for r in found]


def translate(client: TestClient, **body: Any) -> Any:
    response = client.post("/translate", json={"beam_size": BEAM, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize(
    ("source", "target", "model"),
    [
        ("de", "en", "tiny-de-en"),
        ("en", "de", "tiny-en-de"),
        ("fr", "en", "tiny-fr-en"),
        ("cs", "en", "tiny-multi"),
        ("en", "cs", "tiny-multi"),
    ],
)
def test_each_direct_pair_is_translated_by_its_model(
    client: TestClient, translators: dict[str, Translator], source: str, target: str, model: str
) -> None:
    texts = synthetic_sentences(6, seed=31)
    got = translate(client, q=texts, source=source, target=target)["translatedText"]
    assert got == [nbest[0] for nbest in best(translators[model], texts, target)]


def test_the_multilingual_model_is_asked_for_the_requested_target(
    client: TestClient, translators: dict[str, Translator]
) -> None:
    texts = synthetic_sentences(6, seed=32)
    into_en = translate(client, q=texts, source="cs", target="en")["translatedText"]
    into_cs = translate(client, q=texts, source="en", target="cs")["translatedText"]
    assert into_en != into_cs  # one model, two targets: the target token reaches it
    assert into_cs == [nbest[0] for nbest in best(translators["tiny-multi"], texts, "cs")]


def test_a_pair_served_only_through_english_gives_the_two_hop_result(
    client: TestClient, translators: dict[str, Translator]
) -> None:
    texts = [" ".join(synthetic_sentences(3, seed=33)), "Zwei Kinder.\n\nEin Hund spielt im Park!"]
    expected, alternatives = [], []
    for text in texts:
        layout = split_text(text, "fr")
        english = [nbest[0] for nbest in best(translators["tiny-fr-en"], list(layout.sentences), "en")]
        german = best(translators["tiny-en-de"], english, "de", n_best=2)
        expected.append(layout.join([nbest[0] for nbest in german]))
        alternatives.append([layout.join([nbest[1] for nbest in german])])
    answer = translate(client, q=texts, source="fr", target="de", alternatives=1)
    assert answer["translatedText"] == expected  # sentence by sentence, the layout kept
    assert answer["alternatives"] == alternatives  # the second hop's alternatives
    # A pivot whose second hop is the multilingual model, with its target token.
    english = [nbest[0] for nbest in best(translators["tiny-de-en"], [DE], "en")]
    czech = best(translators["tiny-multi"], english, "cs")[0][0]
    assert translate(client, q=DE, source="de", target="cs")["translatedText"] == czech


def test_auto_picks_among_the_languages_served_into_the_target(
    client: TestClient, translators: dict[str, Translator]
) -> None:
    answer = translate(client, q=[DE, FR], source="auto", target="en")
    assert [d["language"] for d in answer["detectedLanguage"]] == ["de", "fr"]
    assert answer["translatedText"] == [
        best(translators["tiny-de-en"], [DE], "en")[0][0],
        best(translators["tiny-fr-en"], [FR], "en")[0][0],
    ]
    # Into German: English directly, French through English.
    answer = translate(client, q=FR, source="auto", target="de")
    assert answer["detectedLanguage"]["language"] == "fr"
    english = best(translators["tiny-fr-en"], [FR], "en")[0][0]
    assert answer["translatedText"] == best(translators["tiny-en-de"], [english], "de")[0][0]
    # /detect chooses among every language the service translates from.
    found = client.post("/detect", json={"q": FR}).json()
    assert found[0]["language"] == "fr" and {d["language"] for d in found} == {"de", "en", "fr", "cs"}


def test_an_unserved_pair_gets_400_naming_the_served_pairs(client: TestClient) -> None:
    unserved = {  # LibreTranslate's messages: an unknown code, or two known ones no route joins
        ("de", "xx"): "xx is not supported",
        ("xx", "en"): "xx is not supported",
        ("cs", "fr"): "French (fr) is not available as a target language from Czech (cs)",
        ("de", "de"): "German (de) is not available as a target language from German (de)",
    }
    for (source, target), message in unserved.items():
        response = client.post("/translate", json={"q": "Hallo", "source": source, "target": target})
        body = assert_error(response, 400)
        assert body["error"] == message
        assert body["supportedPairs"][:3] == ["de->en", "en->de", "fr->en"]
        assert {"en->cs", "fr->de (via en)", "cs->de (via en)"} <= set(body["supportedPairs"])


def test_languages_info_and_openapi_report_every_route(client: TestClient) -> None:
    targets = {entry["code"]: entry["targets"] for entry in client.get("/languages").json()}
    assert targets == {
        "de": ["en", "cs"],
        "en": ["de", "cs"],
        "fr": ["en", "de", "cs"],
        "cs": ["en", "de"],
    }
    info = client.get("/info").json()
    assert [m["name"] for m in info["models"]] == ["tiny-de-en", "tiny-en-de", "tiny-fr-en", "tiny-multi"]
    assert info["models"][3]["directions"] == ["cs-en", "en-cs"]
    assert {"source": "en", "target": "cs", "model": "tiny-multi"} in info["routes"]["direct"]
    pivots = {(p["source"], p["target"]): p for p in info["routes"]["pivot"]}
    assert set(pivots) == {("de", "cs"), ("fr", "de"), ("fr", "cs"), ("cs", "de")}
    assert pivots["fr", "de"] == {
        "source": "fr",
        "target": "de",
        "via": "en",
        "models": ["tiny-fr-en", "tiny-en-de"],
    }
    body = client.get("/openapi.json").json()["paths"]["/translate"]["post"]["requestBody"]["content"]
    fields = body["application/json"]["schema"]["properties"]
    assert fields["source"]["enum"] == ["auto", "de", "en", "fr", "cs"]
    assert fields["target"]["enum"] == ["en", "de", "cs"]
    health = client.get("/health/ready").json()
    assert health["model"] == "tiny-de-en,tiny-en-de,tiny-fr-en,tiny-multi"


def test_a_file_is_translated_through_english(client: TestClient, translators: dict[str, Translator]) -> None:
    files = {"file": ("brief.txt", FR.encode(), "text/plain")}
    response = client.post("/translate_file", data={"source": "fr", "target": "de"}, files=files)
    assert response.status_code == 200, response.text
    download = client.get(response.json()["translatedFileUrl"])
    english = best(translators["tiny-fr-en"], [FR], "en")[0][0]
    german = (
        translators["tiny-en-de"].translate_batch([english], beam_size=5)[0].hypotheses[0]
    )  # the default beam
    assert download.text == german


def test_metrics_carry_the_model_label(client: TestClient) -> None:
    metrics: Metrics = client.app.state.services.metrics  # type: ignore[attr-defined]

    def translated(model: str) -> float:
        return metrics.sample("nmt_sentences_total", {"model": model, "outcome": "translated"})

    names = ["tiny-de-en", "tiny-en-de", "tiny-fr-en", "tiny-multi"]
    before = {name: translated(name) for name in names}
    translate(client, q=synthetic_sentences(3, seed=34), source="fr", target="de")  # a pivot: two models
    after = {name: translated(name) for name in names}
    assert {name: after[name] - before[name] for name in names} == {
        "tiny-de-en": 0,
        "tiny-en-de": 3,
        "tiny-fr-en": 3,
        "tiny-multi": 0,
    }
    text = client.get("/metrics").text
    for name in names:
        assert metrics.sample("nmt_model_load_seconds", {"model": name}) > 0
        assert f'nmt_model_info{{device="cpu",dtype="float32",model="{name}"' in text
    for name in ("tiny-fr-en", "tiny-en-de"):
        assert metrics.sample("nmt_decode_steps_total", {"model": name}) > 0
        assert f'nmt_queue_depth_sentences{{model="{name}"}} 0.0' in text
        assert f'nmt_batch_size_sequences_count{{model="{name}"}}' in text
