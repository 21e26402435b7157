"""/translate's confidence extension, through the real app and a real worker serving the shipped
de-en model (its calibration, ``confidence.json``): the confidence a text gets is its model's
calibration of the library's own hypotheses (``Translator.generate``: the same search), the lowest
of its sentences'; token probabilities are the library's token log-probs; alternatives carry theirs;
a threshold flags or withholds; nothing is added unless asked; the per-model histogram counts."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.keys.accepted import KeysError, load_keys
from benchmarks.common import DEFAULT_MODEL
from model.decoding.confidence import Calibration
from model.decoding.hypothesis import Hypothesis
from model.translator import Translator
from tests.test_api import make_settings, serve

FIRST, SECOND = "Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee mit einem roten Ball."
MODEL = DEFAULT_MODEL.name


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with serve(make_settings(DEFAULT_MODEL)) as c:
        yield c


@pytest.fixture(scope="module")
def library() -> Translator:
    return Translator.load(DEFAULT_MODEL, device="cpu")  # float32, eager: as make_settings serves


def best(library: Translator, text: str, beam: int, n_best: int = 1) -> list[Hypothesis]:
    return library.generate(library.source_ids([text]), beam_size=beam, n_best=n_best)[0]


def post(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/translate", json={"source": "de", "target": "en", **body})
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


@pytest.mark.parametrize("beam", [1, 4])
def test_confidence_is_the_calibrated_library_hypothesis_and_a_text_takes_its_lowest_sentence(
    client: TestClient, library: Translator, beam: int
) -> None:
    calibration = Calibration.load(DEFAULT_MODEL)
    assert calibration.calibrated
    each = [calibration.of(best(library, text, beam)[0]) for text in (FIRST, SECOND)]
    body = post(client, q=[FIRST, f"{FIRST} {SECOND}"], beam_size=beam, confidence=True)
    assert body["confidence"][0] == pytest.approx(each[0], abs=1e-3)
    assert body["confidence"][1] == pytest.approx(min(each), abs=1e-3)
    assert "tokenConfidence" not in body and "lowConfidence" not in body


def test_token_confidence_lists_each_piece_with_its_probability(
    client: TestClient, library: Translator
) -> None:
    hyp = best(library, SECOND, 1)[0]
    body = post(client, q=SECOND, beam_size=1, confidence="tokens")
    tokens = body["tokenConfidence"]
    assert [t["token"] for t in tokens] == library.tokenizer.pieces(hyp.tokens)
    expected = [math.exp(lp) for lp in hyp.token_log_probs[:-1]]  # eos not listed
    assert [t["probability"] for t in tokens] == pytest.approx(expected, abs=1e-3)
    assert "".join(t["token"] for t in tokens).replace("\u2581", " ").strip() == body["translatedText"]


def test_alternatives_carry_their_own_confidence(client: TestClient, library: Translator) -> None:
    calibration = Calibration.load(DEFAULT_MODEL)
    hyps = best(library, SECOND, 4, n_best=3)
    body = post(client, q=SECOND, beam_size=4, alternatives=2, confidence=True)
    assert body["alternatives"] == library.tokenizer.decode([h.tokens for h in hyps[1:]])
    assert body["alternativesConfidence"] == pytest.approx([calibration.of(h) for h in hyps[1:]], abs=1e-3)


def test_without_confidence_the_answer_is_libretranslates(client: TestClient) -> None:
    body = post(client, q=FIRST)
    assert set(body) == {"translatedText"}


def test_min_confidence_flags_or_withholds_the_sentences_below_it(client: TestClient) -> None:
    text = f"{FIRST} {SECOND}"
    alone = [post(client, q=s, confidence=True) for s in (FIRST, SECOND)]
    values = [a["confidence"] for a in alone]
    assert values[0] != values[1]  # (so that a threshold between them splits the text)
    for threshold in (0.0, max(values), 1.0):
        kept = post(client, q=text, min_confidence=threshold)
        expected = sum(v < threshold for v in values)
        assert kept["lowConfidence"] == {"sentences": expected, "withheld": False, "threshold": threshold}
        assert kept["translatedText"] == post(client, q=text)["translatedText"]
    gone = post(client, q=text, min_confidence=max(values), low_confidence="withhold")
    assert gone["lowConfidence"] == {"sentences": 1, "withheld": True, "threshold": max(values)}
    low, high = sorted(alone, key=lambda a: a["confidence"])
    assert gone["translatedText"].strip() == high["translatedText"]  # the other sentence only


def test_a_bad_confidence_field_is_refused(client: TestClient) -> None:
    for bad in ({"confidence": "all"}, {"min_confidence": 1.5}, {"low_confidence": "drop"}):
        response = client.post("/translate", json={"q": FIRST, "source": "de", "target": "en", **bad})
        assert response.status_code == 422, bad


def confidence_count(client: TestClient) -> float:
    text = client.get("/metrics").text
    found = re.search(rf'^nmt_sentence_confidence_count{{model="{MODEL}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_the_confidence_histogram_counts_each_scored_sentence_per_model(client: TestClient) -> None:
    # (Sentences no other test sent: a cached answer is not decoded again, nor counted again.)
    before = confidence_count(client)
    post(client, q=["Eine Katze schläft.", "Ein Mann kocht."], beam_size=1, confidence=True)  # asked: 2
    post(client, q="Ein Kind lacht.", beam_size=1)  # greedy, not asked: no log-probs, not counted
    assert confidence_count(client) == before + 2
    post(client, q="Eine Frau liest ein Buch.", beam_size=4)  # a beam's have them, asked or not
    assert confidence_count(client) == before + 3


def test_the_service_default_threshold_applies_without_a_request_field() -> None:
    with serve(make_settings(DEFAULT_MODEL, min_confidence=1.0)) as c:
        body = post(c, q=FIRST)
    assert body["lowConfidence"] == {"sentences": 1, "withheld": False, "threshold": 1.0}


@pytest.mark.parametrize("format", ["text", "html"])
def test_sentence_confidence_says_where_each_sentence_is_in_the_translation(
    client: TestClient, format: str
) -> None:
    alone = [post(client, q=s, confidence=True) for s in (FIRST, SECOND)]
    text = f"{FIRST}\n\n{SECOND}" if format == "text" else f"<p>{FIRST}</p><p><b>{SECOND}</b></p>"
    body = post(client, q=text, format=format, confidence=True)
    out = body["translatedText"]
    spans = body["sentenceConfidence"]
    assert [out[s["start"] : s["end"]] for s in spans] == [a["translatedText"] for a in alone]
    assert [s["confidence"] for s in spans] == [a["confidence"] for a in alone]
    assert body["confidence"] == min(a["confidence"] for a in alone)


def test_a_keys_default_threshold_applies_to_its_requests_and_a_requests_own_replaces_it(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[[keys]]\nname = "strict"\nkey = "k-strict"\nmin_confidence = 1.0\n\n'
        '[[keys]]\nname = "plain"\nkey = "k-plain"\n'
    )
    with serve(make_settings(DEFAULT_MODEL, api_keys_file=keys)) as c:
        strict = post(c, q=FIRST, api_key="k-strict")
        own = post(c, q=FIRST, api_key="k-strict", min_confidence=0.0)
        plain = post(c, q=FIRST, api_key="k-plain")
    assert strict["lowConfidence"] == {"sentences": 1, "withheld": False, "threshold": 1.0}
    assert own["lowConfidence"] == {"sentences": 0, "withheld": False, "threshold": 0.0}
    assert "lowConfidence" not in plain  # no threshold of its own, none of the service's


def test_a_keys_file_threshold_outside_0_to_1_is_refused_naming_the_entry(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "odd"\nkey = "k-odd"\nmin_confidence = 1.5\n')
    with pytest.raises(KeysError, match=r"keys\[0\]\.min_confidence"):
        load_keys(make_settings(DEFAULT_MODEL, api_keys_file=keys))
