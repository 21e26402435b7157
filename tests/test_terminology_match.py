"""Terminology matching (``model.decoding.terms``): which glossary entries and placeholders a
source sentence holds, under the documented rules (case, Unicode word boundaries, overlaps,
inflected forms listed, placeholder kinds), and the service's terms per sentence and offsets."""

from __future__ import annotations

import pytest

from app.http.errors import status_of
from app.terminology.terms import sentence_terms, text_terminology
from app.translation.errors import TooLarge
from app.translation.segments import split_text
from model.decoding.terms import Glossary, GlossaryEntry, find_terms, placeholders, resolve

# -- matching -------------------------------------------------------------------------------------


def matched(sentence: str, *entries: tuple[str, str], protect: bool = False) -> list[tuple[str, str]]:
    """(source text, target) of each term found, in order."""
    glossary = Glossary(GlossaryEntry(s, t) for s, t in entries)
    return [(t.source, t.target) for t in find_terms(sentence, glossary, protect=protect)]


def test_an_entry_matches_its_source_as_written() -> None:
    assert matched("Die Rechnung kommt.", ("Rechnung", "invoice")) == [("Rechnung", "invoice")]
    assert matched("Die rechnung kommt.", ("Rechnung", "invoice")) == []  # case-aware
    assert matched("Ich mag apple pie.", ("Apple", "Apple")) == []


def test_a_lower_case_entry_matches_its_capitalised_form_only_as_the_first_word() -> None:
    entry = ("bitte", "please")
    assert matched("Bitte kommen Sie.", entry) == [("Bitte", "please")]
    assert matched('"Bitte", sagte er.', entry) == [("Bitte", "please")]  # after punctuation
    assert matched("Kommen Sie, Bitte.", entry) == []  # capitalised elsewhere: not this entry
    assert matched("Kommen Sie, bitte.", entry) == [("bitte", "please")]


def test_matches_respect_unicode_word_boundaries() -> None:
    assert matched("Die Rechnungen kommen.", ("Rechnung", "invoice")) == []
    assert matched("Die Straßenbahn fährt.", ("Straße", "street")) == []
    assert matched("Die Straße, bitte.", ("Straße", "street")) == [("Straße", "street")]
    assert matched("Ein Vorstraße.", ("straße", "street")) == []
    decomposed = "Cafe\u0301"  # "Café" with a combining accent: the mark is part of the word
    assert matched(f"Ein {decomposed} hier.", ("Cafe", "coffee")) == []
    assert matched("Wir nutzen C++ und .NET heute.", ("C++", "C++"), (".NET", ".NET")) == [
        ("C++", "C++"),
        (".NET", ".NET"),
    ]


def test_the_longest_match_wins_and_entries_match_several_times() -> None:
    entries = (("Acme", "ACME"), ("Acme GmbH", "Acme GmbH"))
    assert matched("Acme GmbH kauft Acme und Acme.", *entries) == [
        ("Acme GmbH", "Acme GmbH"),
        ("Acme", "ACME"),
        ("Acme", "ACME"),
    ]


def test_german_inflection_is_matched_for_the_forms_listed() -> None:
    forms = (("Rechnung", "invoice"), ("Rechnungen", "invoices"), ("Rechnungsnummer", "invoice number"))
    assert matched("Rechnungen und die Rechnungsnummer der Rechnung.", *forms) == [
        ("Rechnungen", "invoices"),
        ("Rechnungsnummer", "invoice number"),
        ("Rechnung", "invoice"),
    ]


def test_the_first_entry_of_a_source_wins_and_blank_terms_are_ignored() -> None:
    entries = (("Hund", "dog"), ("Hund", "hound"), ("", "x"), (" ", "x"), ("Der", " "))
    assert matched("Der Hund.", *entries) == [("Hund", "dog")]


@pytest.mark.parametrize(
    "placeholder",
    [
        "{name}",
        "{0}",
        "{{var}}",
        "{{ user.name }}",
        "%s",
        "%d",
        "%1$s",
        "%2$d",
        "%(name)s",
        "%.2f",
        "https://example.com/a/b?c=d&e=f",
        "http://example.org",
        "www.example.com/x",
        "info@example.com",
        "first.last+tag@mail.example.co.uk",
        "3.14",
        "1,000",
        "2026-11-24",
        "12:30",
        "42",
    ],
)
def test_placeholders_are_terms_of_their_own_text(placeholder: str) -> None:
    sentence = f"Hallo {placeholder} und mehr."
    assert [(t.source, t.target, t.kind) for t in find_terms(sentence)] == [
        (placeholder, placeholder, "placeholder")
    ]
    term = find_terms(sentence)[0]
    assert sentence[term.start : term.end] == placeholder


@pytest.mark.parametrize(
    ("sentence", "found"),
    [("50% Rabatt heute.", ["50"]), ("100%% sicher.", ["100"]), ("Ein mp3 und H2O.", []), ("Nur Text.", [])],
)
def test_no_placeholder_where_there_is_none(sentence: str, found: list[str]) -> None:
    """ "% R" is no format (a space flag is not taken), "%%" is a literal percent sign, and a digit
    inside a word is no number."""
    assert [t.source for t in find_terms(sentence)] == found


def test_a_url_leaves_the_sentences_punctuation_out() -> None:
    assert [t.source for t in placeholders("Siehe https://example.com/x.")] == ["https://example.com/x"]
    wiki = "https://en.wikipedia.org/wiki/Mercury_(planet)"
    found = resolve(placeholders(f"Siehe ({wiki})."))
    assert [t.source for t in found if t.source.startswith("http")] == [wiki]


def test_a_glossary_entry_wins_over_a_placeholder_of_the_same_span_and_a_longer_one_over_both() -> None:
    glossary = Glossary([GlossaryEntry("2026", "MMXXVI"), GlossaryEntry("Version 2", "v2")])
    terms = find_terms("Im Jahr 2026 kam Version 2.5 heraus.", glossary)
    assert [(t.source, t.target, t.kind) for t in terms] == [
        ("2026", "MMXXVI", "glossary"),
        ("2.5", "2.5", "placeholder"),  # "Version 2" would end inside the number
    ]
    assert [t.source for t in find_terms("Nur 1,000 Version 2 hier.", glossary)] == ["1,000", "Version 2"]


def test_placeholders_are_not_protected_when_asked_not_to() -> None:
    assert find_terms("Hallo {name}, 3 Hunde.", protect=False) == []


# -- the service's side: terms per sentence, offsets in the text ------------------------------------


def test_glossary_terms_past_the_sentence_limit_are_a_400_placeholders_fill_what_is_left() -> None:
    glossary = Glossary([GlossaryEntry("Hund", "dog"), GlossaryEntry("Katze", "cat")])
    terms = sentence_terms(["Hund 1 Katze 2 3."], glossary, protect=True, limit=3)
    assert [t.source for t in terms.terms[0]] == ["Hund", "1", "Katze"]
    with pytest.raises(TooLarge) as refused:
        sentence_terms(["Hund und Katze."], glossary, protect=True, limit=1)
    assert status_of(refused.value) == 413 and "at most 1" in str(refused.value)


def test_offsets_in_html_are_into_the_markup_where_the_term_is_written_escaped() -> None:
    from app.formats import parse

    layout = parse("<p>Ein <b>Hund</b>.</p><p>AT&amp;T ruft.</p>", "html").split("de")
    glossary = Glossary([GlossaryEntry("Hund", "dog"), GlossaryEntry("AT&T", "AT&T")])
    terms = sentence_terms(layout.sentences, glossary, protect=False, limit=5)
    best_texts = ["A dog.", "AT&T calls."]
    output = layout.join(best_texts)
    [terminology] = text_terminology([layout], terms, best_texts, [((0, 2, 5),), ((0, 0, 4),)], [output])
    assert terminology is not None
    assert [(m.target, output[m.start : m.end]) for m in terminology.terms] == [
        ("dog", "dog"),
        ("AT&T", "AT&amp;T"),
    ]


def test_offsets_of_placed_terms_are_in_the_whole_texts_translation() -> None:
    layout = split_text("  Der Hund.\nDie Katze.", "de")
    glossary = Glossary([GlossaryEntry("Katze", "cat")])
    terms = sentence_terms(layout.sentences, glossary, protect=False, limit=5)
    best_texts = ["The dog.", "The cat."]
    output = layout.join(best_texts)
    [terminology] = text_terminology([layout], terms, best_texts, [(), ((0, 4, 7),)], [output])
    assert terminology is not None and not terminology.memory
    [mark] = terminology.terms
    assert (mark.source, mark.target) == ("Katze", "cat")
    assert output[mark.start : mark.end] == "cat"
