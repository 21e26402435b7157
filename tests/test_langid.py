"""Language identification (app.translation.langid) among several candidates: what /detect and source "auto"
will choose from once the service serves several source languages."""

from __future__ import annotations

import pytest

from app.translation.langid import detect, known_languages

# Multi30k-like sentences (not from its test set).
SENTENCES = {
    "de": "Eine Frau mit einem roten Hut geht mit ihrem Hund am Strand spazieren.",
    "en": "A woman in a red hat walks her dog along the beach.",
    "fr": "Une femme avec un chapeau rouge promène son chien sur la plage.",
    "cs": "Žena v červeném klobouku venčí svého psa na pláži.",
}


@pytest.mark.parametrize("language", sorted(SENTENCES))
def test_each_language_is_found_among_four(language: str) -> None:
    found = detect(SENTENCES[language], ["en", "de", "fr", "cs"])
    assert found[0].language == language
    assert found[0].confidence > 90
    assert sorted(d.language for d in found) == ["cs", "de", "en", "fr"]
    assert [d.confidence for d in found] == sorted((d.confidence for d in found), reverse=True)
    assert sum(d.confidence for d in found) == pytest.approx(100, abs=0.1)  # percentages


def test_only_candidates_are_answered() -> None:
    # French text, but French is not served: the answer is among what is.
    found = detect(SENTENCES["fr"], ["de", "en"])
    assert {d.language for d in found} == {"de", "en"}


def test_one_candidate_is_the_answer() -> None:
    assert [(d.language, d.confidence) for d in detect(SENTENCES["en"], ["de"])] == [("de", 100.0)]


def test_candidates_keep_their_spelling_and_unknown_ones_come_last() -> None:
    assert "xx" not in known_languages()
    found = detect(SENTENCES["de"], ["EN", "De", "xx"])
    assert [d.language for d in found] == ["De", "EN", "xx"]
    assert found[-1].confidence == 0.0
    only_one_known = detect(SENTENCES["en"], ["de", "xx"])
    assert [(d.language, d.confidence) for d in only_one_known] == [("de", 100.0), ("xx", 0.0)]


def test_nothing_to_go_by_gives_equal_confidence_in_candidate_order() -> None:
    found = detect("1234 !!", ["fr", "de"])
    assert [d.language for d in found] == ["fr", "de"]
    assert found[0].confidence == found[1].confidence


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        detect("Hallo", [])
