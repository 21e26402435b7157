"""app.translation.segments: sentence splitting and putting translations back into the text's layout."""

from __future__ import annotations

import pytest

from app.translation.segments import SplitText, split_sentences, split_text


def identity(split: SplitText) -> str:
    return split.join(list(split.sentences))


def test_german_sentences_split_at_sentence_ends_not_at_abbreviations() -> None:
    text = "Dr. Müller kam am 3. Oktober nach Berlin. Er blieb z. B. lange! War es schön? Ja."
    assert split_text(text, "de").sentences == (
        "Dr. Müller kam am 3. Oktober nach Berlin.",
        "Er blieb z. B. lange!",
        "War es schön?",
        "Ja.",
    )


def test_english_abbreviations_are_not_sentence_ends() -> None:
    text = "Mr. Smith went to Washington. He arrived at 5 p.m. on Monday."
    assert split_sentences(text, "en") == ["Mr. Smith went to Washington.", "He arrived at 5 p.m. on Monday."]


def test_line_breaks_are_boundaries_and_are_kept_exactly() -> None:
    text = "Erster Satz. Zweiter Satz.\n\nNeuer Absatz\r\nohne Punkt\n"
    split = split_text(text, "de")
    assert split.sentences == ("Erster Satz.", "Zweiter Satz.", "Neuer Absatz", "ohne Punkt")
    assert identity(split) == text
    assert split.separators == ("", " ", "\n\n", "\r\n", "\n")


def test_translations_are_put_in_the_original_layout() -> None:
    text = "  Eins. Zwei.\n \n\tDrei.  \n\n\n"
    split = split_text(text, "de")
    assert split.join(["One.", "Two.", "Three."]) == "  One. Two.\n \n\tThree.  \n\n\n"


def test_whitespace_between_sentences_of_a_line_becomes_one_space() -> None:
    split = split_text("Hallo Welt.   Zweiter Satz.\tDritter.", "de")
    assert split.sentences == ("Hallo Welt.", "Zweiter Satz.", "Dritter.")
    assert split.join(["A.", "B.", "C."]) == "A. B. C."


@pytest.mark.parametrize("text", ["", " ", "\n", "\n\n  \t\n", "\r\n"])
def test_blank_text_has_no_sentences_and_joins_to_empty(text: str) -> None:
    split = split_text(text, "de")
    assert split.sentences == ()
    assert split.join([]) == ""


@pytest.mark.parametrize(
    "text",
    [
        "Ein Satz.",
        "Ein Satz. Noch einer.\nUnd hier.\n\nUnd da.",
        "Zeile ohne Punkt\nnoch eine\u2028und mit Zeilentrenner",
        "\n\nVorne leer. Hinten leer.\n\n",
        "Eins!Zwei?Drei.",
    ],
)
def test_sentences_are_stripped_non_empty_and_never_span_lines(text: str) -> None:
    split = split_text(text, "de")
    assert split.sentences
    for sentence in split.sentences:
        assert sentence == sentence.strip() and sentence
        assert len(sentence.splitlines()) == 1
    assert len(split.separators) == len(split.sentences) + 1


def test_join_needs_one_translation_per_sentence() -> None:
    split = split_text("Eins. Zwei.", "de")
    with pytest.raises(ValueError, match="expected 2 translations"):
        split.join(["One."])


def test_unknown_language_code_still_splits() -> None:
    # A model directory may use any code; the segmenter falls back to generic rules.
    assert split_text("First one. Second one.", "xx").sentences == ("First one.", "Second one.")
