"""``model.decoding.terms`` against its previous implementation, kept here as the reference.

The previous matcher compared every candidate term with every other kept one (quadratic: a
sentence of 50,000 numbers took a minute), tried every glossary entry sharing a word's first word,
and two of its placeholder patterns backtracked quadratically. The linear implementation must find
the very same terms: this file holds the old code (``Reference*``, unchanged but for names) and
compares the two on many seeded random sentences and glossaries built to hit the rules' corners:
overlapping entries, entries sharing a first word, numbers and their separators, URLs with
brackets and trailing punctuation, e-mail addresses, printf and brace placeholders, capitalised
first words, combining marks, entries that begin with punctuation. Past ``MAX_SEARCH_CHARS`` the
new matcher looks no further (``searched``): that rule is checked on its own.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pytest

from model.decoding.terms import (
    MAX_SEARCH_CHARS,
    Glossary,
    GlossaryEntry,
    Term,
    TooManyTerms,
    find_terms,
    placeholders,
    sentence_terms,
)

# -- the previous implementation (the reference) ----------------------------------------------------

_WORD = r"[\w\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]"
_WORD_CHAR = re.compile(_WORD)
_WORDS = re.compile(_WORD + "+")
_PLACEHOLDERS = [
    re.compile(r"\{\{\s*[^{}\s]{1,64}\s*\}\}"),
    re.compile(r"\{[^{}\s]{0,64}\}"),
    re.compile(r"(?<!%)%\([^()\s]{1,64}\)[-+#0]*\d*(?:\.\d+)?[diouxXeEfFgGcsr]"),
    re.compile(
        r"(?<!%)%(?:\d+\$)?[-+#0]*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|z|j|t)?[diouxXeEfFgGcsp@]"
    ),
    re.compile(r"(?:\b(?:https?|ftp)://|\bwww\.)[^\s<>\"'`]+", re.IGNORECASE),
    re.compile(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+"),
    re.compile(r"(?<!\w)\d+(?:[.,:/-]\d+)*(?!\w)"),
]
_NUMBER_GOES_ON = re.compile(r"[.,:/-]\d")
_NUMBER_CAME_FROM = re.compile(r"\d[.,:/-]$")
_URL_TRAILER = ".,;:!?'\"”’»"


def reference_is_word_char(char: str) -> bool:
    return _WORD_CHAR.fullmatch(char) is not None


@dataclass(frozen=True)
class _Variant:
    text: str
    entry: GlossaryEntry
    initial: bool


class ReferenceGlossary:
    def __init__(self, entries: Iterable[GlossaryEntry]) -> None:
        self.entries: list[GlossaryEntry] = []
        seen: set[str] = set()
        for entry in entries:
            if not entry.source.strip() or not entry.target.strip():
                continue
            if entry.source not in seen:
                seen.add(entry.source)
                self.entries.append(entry)
        self._by_word: dict[str, list[_Variant]] = {}
        self._other: list[_Variant] = []
        for entry in self.entries:
            source = entry.source
            self._add(_Variant(source, entry, initial=False))
            upper = source[0].upper()
            if source[0].islower() and len(upper) == 1:
                capital = upper + source[1:]
                if capital not in seen:
                    self._add(_Variant(capital, entry, initial=True))

    def _add(self, variant: _Variant) -> None:
        first = _WORDS.match(variant.text)
        if first is None:
            self._other.append(variant)
        else:
            self._by_word.setdefault(first.group(), []).append(variant)

    def __len__(self) -> int:
        return len(self.entries)

    def candidates(self, sentence: str) -> list[Term]:
        found: list[Term] = []
        first_word = _WORDS.search(sentence)
        initial_at = first_word.start() if first_word else -1
        for word in _WORDS.finditer(sentence):
            for variant in self._by_word.get(word.group(), ()):
                self._check(sentence, word.start(), variant, initial_at, found)
        for variant in self._other:
            start = sentence.find(variant.text)
            while start >= 0:
                self._check(sentence, start, variant, initial_at, found)
                start = sentence.find(variant.text, start + 1)
        return found

    @staticmethod
    def _check(sentence: str, start: int, variant: _Variant, initial_at: int, found: list[Term]) -> None:
        text = variant.text
        end = start + len(text)
        if not sentence.startswith(text, start):
            return
        if variant.initial and start != initial_at:
            return
        if reference_is_word_char(text[0]) and start > 0 and reference_is_word_char(sentence[start - 1]):
            return
        if reference_is_word_char(text[-1]) and end < len(sentence) and reference_is_word_char(sentence[end]):
            return
        if text[-1].isdigit() and _NUMBER_GOES_ON.match(sentence, end):
            return
        if text[0].isdigit() and _NUMBER_CAME_FROM.search(sentence, 0, start):
            return
        found.append(Term(start, end, text, variant.entry.target, "glossary"))


def reference_placeholders(sentence: str) -> list[Term]:
    found: list[Term] = []
    for pattern in _PLACEHOLDERS:
        for match in pattern.finditer(sentence):
            start, text = match.start(), match.group()
            if text.lower().startswith(("http", "ftp", "www.")):
                text = reference_trim_url(text)
            if text:
                found.append(Term(start, start + len(text), text, text, "placeholder"))
    return found


def reference_trim_url(url: str) -> str:
    while url:
        last = url[-1]
        if last in _URL_TRAILER or (last == ")" and url.count("(") < url.count(")")):
            url = url[:-1]
        else:
            break
    return url


def reference_resolve(candidates: Sequence[Term]) -> list[Term]:
    ranked = sorted(candidates, key=lambda t: (t.start - t.end, t.start, t.kind != "glossary"))
    kept: list[Term] = []
    for term in ranked:
        if all(term.end <= other.start or other.end <= term.start for other in kept):
            kept.append(term)
    return sorted(kept, key=lambda t: t.start)


def reference_find_terms(
    sentence: str, glossary: ReferenceGlossary | None = None, *, protect: bool = True
) -> list[Term]:
    candidates = glossary.candidates(sentence) if glossary is not None and len(glossary) else []
    if protect:
        candidates += reference_placeholders(sentence)
    return reference_resolve(candidates) if candidates else []


def reference_sentence_terms(
    sentence: str, glossary: ReferenceGlossary | None, *, protect: bool, limit: int
) -> list[Term]:
    terms = reference_find_terms(sentence, glossary, protect=protect) if sentence.strip() else []
    chosen = [t for t in terms if t.kind == "glossary"]
    if len(chosen) > limit:
        raise TooManyTerms(f"{len(chosen)} glossary terms (at most {limit} per sentence)")
    chosen += [t for t in terms if t.kind == "placeholder"][: limit - len(chosen)]
    return sorted(chosen, key=lambda t: t.start)


# -- random sentences and glossaries ----------------------------------------------------------------

WORDS = [
    "Acme", "acme", "GmbH", "Berlin", "bitte", "Bitte", "New", "York", "City", "Rechnung", "Rechnungen",
    "Version", "sa", "Sa", "ſa", "Café", "Cafe\u0301", "e\u0301", "straße", "Straße", "Hund", "hund",
    "der", "Der", "und", "x_y", "H2O", "mp3", "C", "NET", "tag",
]  # fmt: skip
TOKENS = [
    "1", "2", "2.5", "1,000", "2026-11-24", "12:30", "3.", "5-", "1/2", "007", "٣",
    "https://example.com/a_(b)", "https://example.com/x).", "www.example.de.", "ftp://h/p,",
    "(https://en.wikipedia.org/wiki/M_(p))", "info@example.com", "a.b+c@mail.example.co.uk",
    "{name}", "{0}", "{}", "{{ var }}", "{{x}}", "%s", "%d", "%1$s", "%-05.2f", "%lu", "%(n)s",
    "%(n)05d", "%%", "50%", "%", "%0", "%00d", ".NET", "C++", "#tag", "(x)", "€", "...", ",", ";",
    "!", "?", "(", ")", '"', "-", ".", ":",
]  # fmt: skip
SEPARATORS = [" ", " ", " ", "", "\n", "\u00a0", ", "]


def random_sentence(rng: random.Random, n_tokens: int) -> str:
    parts = []
    for _ in range(n_tokens):
        parts.append(rng.choice(WORDS) if rng.random() < 0.55 else rng.choice(TOKENS))
        parts.append(rng.choice(SEPARATORS))
    return rng.choice(["", " ", '"', "- "]) + "".join(parts).rstrip(" ")


def random_source(rng: random.Random) -> str:
    """An entry's source: one to four words or tokens, often sharing a first word with others."""
    n = rng.choice([1, 1, 1, 2, 2, 3, 4])
    parts = [rng.choice(WORDS) if rng.random() < 0.7 else rng.choice(TOKENS) for _ in range(n)]
    source = parts[0]
    for part in parts[1:]:
        source += rng.choice([" ", " ", "", "-"]) + part
    return rng.choice([source, source, source, " " + source, ""])  # blank and padded ones too


def random_entries(rng: random.Random, n: int) -> list[GlossaryEntry]:
    return [GlossaryEntry(random_source(rng), rng.choice(["T", "t", " ", "target", "§"])) for _ in range(n)]


def spans(terms: Sequence[Term]) -> list[tuple[int, int, str, str, str]]:
    return [(t.start, t.end, t.source, t.target, t.kind) for t in terms]


@pytest.mark.parametrize("seed", range(8))
def test_the_terms_found_are_the_reference_implementations(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        entries = random_entries(rng, rng.choice([0, 1, 3, 10, 40]))
        new, old = Glossary(entries), ReferenceGlossary(entries)
        for _ in range(25):
            sentence = random_sentence(rng, rng.randint(0, 30))
            protect = rng.random() < 0.7
            assert spans(find_terms(sentence, new, protect=protect)) == spans(
                reference_find_terms(sentence, old, protect=protect)
            ), (sentence, entries)


@pytest.mark.parametrize("seed", range(4))
def test_the_terms_per_sentence_and_the_limit_are_the_reference_implementations(seed: int) -> None:
    rng = random.Random(100 + seed)
    refused = 0
    for _ in range(40):
        entries = random_entries(rng, rng.choice([3, 10, 40]))
        new, old = Glossary(entries), ReferenceGlossary(entries)
        for _ in range(25):
            sentence = random_sentence(rng, rng.randint(0, 40))
            limit = rng.choice([1, 2, 3, 10])
            try:
                expected = spans(reference_sentence_terms(sentence, old, protect=True, limit=limit))
            except TooManyTerms:
                refused += 1
                with pytest.raises(TooManyTerms, match=f"more than {limit} glossary terms"):
                    sentence_terms(sentence, new, protect=True, limit=limit)
                continue
            assert spans(sentence_terms(sentence, new, protect=True, limit=limit)) == expected, sentence
    assert refused > 10  # the refusals were compared too


PRINTF = "%%%(($$$0000123٠٣.*hlLzjtdsxf@ )a-+#n"


@pytest.mark.parametrize("seed", range(4))
def test_the_placeholder_patterns_match_as_the_reference_ones(seed: int) -> None:
    """The printf patterns were rewritten (a width never begins with 0) so as not to backtrack
    quadratically: on random strings of their own alphabet they match the same spans."""
    rng = random.Random(200 + seed)
    for _ in range(3000):
        text = "".join(rng.choice(PRINTF) for _ in range(rng.randint(1, 16)))
        assert spans(placeholders(text)) == spans(reference_placeholders(text)), text


def test_a_long_sentence_is_searched_up_to_the_last_space_within_max_search_chars() -> None:
    """The terms of a sentence longer than MAX_SEARCH_CHARS are the reference's in its start up to
    the last whitespace character within the limit; none past that, however many there are."""
    rng = random.Random(7)
    entries = [e for e in random_entries(rng, 30) if " " not in e.source.strip()]
    head = random_sentence(rng, 2000)[: MAX_SEARCH_CHARS - 20].rstrip()
    head = re.sub(r"\S*$", "", head).rstrip()  # ends at a word's end: a space follows
    word = "x" * 40  # no space within the limit after the head: the cut is right after it
    tail = " ".join(["1", "Hund", "{name}", "2.5"] * 2000)
    sentence = f"{head} {word} {tail}"
    assert len(head) < MAX_SEARCH_CHARS < len(head) + 1 + len(word)
    expected = [t for t in reference_find_terms(sentence, ReferenceGlossary(entries)) if t.end <= len(head)]
    found = find_terms(sentence, Glossary(entries))
    assert spans(found) == spans(expected)
    assert len(found) > 50  # the head has terms: the comparison means something
    assert not find_terms("1" * (MAX_SEARCH_CHARS + 1) + " 2 3")  # no space within the limit: none
