"""The terms of a source sentence: glossary entries found in it, and placeholders to keep verbatim.

A term is a span of the sentence and the exact text its translation must contain (the decoder is
given each term's target as a constraint: ``model.decoding.constraints``). Torch-free: the service's
front end and the command line (``model.decoding.cli``) choose a sentence's terms with the same
code (``sentence_terms``), so that a line translates alike in both.

Glossary matching rules:

* **Case**: an entry matches its source as written ("Apple" the brand is not "apple" the fruit).
  An entry whose source begins with a lower-case letter also matches the same text with that
  letter upper-cased when it is the sentence's first word (only spaces or punctuation before it),
  where German and English capitalise any word ("bitte" matches "Bitte, ..."). The target is put
  in as written: where it lands in the translation is the model's choice.
* **Word boundaries** (Unicode): a match neither starts nor ends inside a word: the character
  before it and the character after it are not letters, digits, combining marks or underscores.
  The rule holds on a side only where the entry's own first (last) character is such a character,
  so ".NET" or "C++" match as written. A number is one word: "Version 2" does not match in
  "Version 2.5", nor "1" in "1,000".
* **Overlaps**: the longest match wins (then the earliest); a glossary entry wins over a
  placeholder of the same span. An entry may match several times in a sentence; of entries with
  the same source, the first is used; one with a blank source or target is ignored.
* **Inflection**: no stemming. German forms are matched only as listed: give each form its own
  entry ("Rechnung" and "Rechnungen", both to "invoice" or each to its own target).

Placeholders (``protect``): ``{name}``, ``{0}``, ``{{var}}``, printf's ``%s``, ``%d``, ``%1$s``,
``%(name)s``, URLs (``https://``, ``ftp://``, ``www.``), e-mail addresses and numbers as written
(``3.14``, ``1,000``, ``2026-11-24``, ``12:30``): each is a term whose target is its own text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GlossaryEntry:
    """``source`` is translated as ``target``; an entry whose target equals its source is a
    do-not-translate term."""

    source: str
    target: str


# Word characters: \w (Unicode letters, digits, underscore) and the combining marks of decomposed
# text ("e" + U+0301), which \w leaves out.
_WORD = r"[\w\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]"
_WORD_CHAR = re.compile(_WORD)
_WORDS = re.compile(_WORD + "+")

Kind = Literal["glossary", "placeholder"]

_PLACEHOLDERS = [
    re.compile(r"\{\{\s*[^{}\s]{1,64}\s*\}\}"),  # {{var}}, {{ var }}
    re.compile(r"\{[^{}\s]{0,64}\}"),  # {name}, {0}, {}, {count:>5}
    re.compile(r"(?<!%)%\([^()\s]{1,64}\)[-+#0]*\d*(?:\.\d+)?[diouxXeEfFgGcsr]"),  # %(name)s
    # %s, %d, %1$s, %-5.2f, %lu; not "%%" (a literal percent sign) and not "50% discount".
    re.compile(
        r"(?<!%)%(?:\d+\$)?[-+#0]*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|z|j|t)?[diouxXeEfFgGcsp@]"
    ),
    re.compile(r"(?:\b(?:https?|ftp)://|\bwww\.)[^\s<>\"'`]+", re.IGNORECASE),  # URLs
    re.compile(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+"),  # e-mail addresses
    re.compile(r"(?<!\w)\d+(?:[.,:/-]\d+)*(?!\w)"),  # numbers, dates and times as written
]
# A digit with a separator and another digit beside it: the match would cut a number ("2" of "2.5").
_NUMBER_GOES_ON = re.compile(r"[.,:/-]\d")
_NUMBER_CAME_FROM = re.compile(r"\d[.,:/-]$")
_URL_TRAILER = ".,;:!?'\"”’»"  # sentence punctuation after a URL is not part of it


def is_word_char(char: str) -> bool:
    return _WORD_CHAR.fullmatch(char) is not None


@dataclass(frozen=True)
class Term:
    """``sentence[start:end]`` (``source``) is to be translated as ``target``, exactly."""

    start: int
    end: int
    source: str
    target: str
    kind: Kind


@dataclass(frozen=True)
class _Variant:
    text: str  # what is looked for in the sentence
    entry: GlossaryEntry
    initial: bool  # only as the sentence's first word (an entry's capitalised form)


class Glossary:
    """Entries made ready for matching many sentences: indexed by their first word, so that a
    sentence costs one look-up per word however many entries there are."""

    def __init__(self, entries: Iterable[GlossaryEntry]) -> None:
        self.entries: list[GlossaryEntry] = []
        seen: set[str] = set()
        for entry in entries:
            if not entry.source.strip() or not entry.target.strip():
                continue  # a blank term matches nothing that means anything, nor says what to write
            if entry.source not in seen:  # the first of one source wins
                seen.add(entry.source)
                self.entries.append(entry)
        self._by_word: dict[str, list[_Variant]] = {}
        self._other: list[_Variant] = []  # entries that do not begin with a word character
        for entry in self.entries:
            source = entry.source
            self._add(_Variant(source, entry, initial=False))
            upper = source[0].upper()
            if source[0].islower() and len(upper) == 1:  # ("ß".upper() is "SS": no such variant)
                capital = upper + source[1:]
                if capital not in seen:  # an entry of its own for the capitalised form wins
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
        """Every match of an entry in ``sentence``, overlapping ones included."""
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
        if is_word_char(text[0]) and start > 0 and is_word_char(sentence[start - 1]):
            return
        if is_word_char(text[-1]) and end < len(sentence) and is_word_char(sentence[end]):
            return
        if text[-1].isdigit() and _NUMBER_GOES_ON.match(sentence, end):
            return
        if text[0].isdigit() and _NUMBER_CAME_FROM.search(sentence, 0, start):
            return
        found.append(Term(start, end, text, variant.entry.target, "glossary"))


def placeholders(sentence: str) -> list[Term]:
    """Every placeholder, URL, e-mail address and number in ``sentence``, overlapping ones
    included (``resolve`` keeps the longest)."""
    found: list[Term] = []
    for pattern in _PLACEHOLDERS:
        for match in pattern.finditer(sentence):
            start, text = match.start(), match.group()
            if text.lower().startswith(("http", "ftp", "www.")):
                text = _trim_url(text)
            if text:
                found.append(Term(start, start + len(text), text, text, "placeholder"))
    return found


def _trim_url(url: str) -> str:
    """``url`` without the sentence's punctuation after it; a closing bracket only when the URL
    has no opening one of its own (Wikipedia's "..._(disambiguation)")."""
    while url:
        last = url[-1]
        if last in _URL_TRAILER or (last == ")" and url.count("(") < url.count(")")):
            url = url[:-1]
        else:
            break
    return url


def resolve(candidates: Sequence[Term]) -> list[Term]:
    """The terms kept of overlapping ``candidates``: the longest first (then the earliest, then a
    glossary entry before a placeholder), each kept unless it overlaps one kept before; in order."""
    ranked = sorted(candidates, key=lambda t: (t.start - t.end, t.start, t.kind != "glossary"))
    kept: list[Term] = []
    for term in ranked:
        if all(term.end <= other.start or other.end <= term.start for other in kept):
            kept.append(term)
    return sorted(kept, key=lambda t: t.start)


def find_terms(sentence: str, glossary: Glossary | None = None, *, protect: bool = True) -> list[Term]:
    """The terms of ``sentence``, in order, none overlapping: ``glossary``'s matches, and with
    ``protect`` its placeholders."""
    candidates = glossary.candidates(sentence) if glossary is not None and len(glossary) else []
    if protect:
        candidates += placeholders(sentence)
    return resolve(candidates) if candidates else []


# Terms of one sentence at most (the service's NMT_MAX_TERMS_PER_SENTENCE, the CLI's --max-terms):
# each raises the sentence's beam (``beam_for``) and costs the search per step.
MAX_TERMS_PER_SENTENCE = 10


class TooManyTerms(ValueError):
    """A sentence has more glossary matches than a sentence may have terms."""


def sentence_terms(sentence: str, glossary: Glossary | None, *, protect: bool, limit: int) -> list[Term]:
    """The terms ``sentence`` is translated with: every glossary match (more than ``limit`` raise
    ``TooManyTerms``), then placeholders while room is left (the ones past it are translated as
    the model likes); in order."""
    terms = find_terms(sentence, glossary, protect=protect) if sentence.strip() else []
    chosen = [t for t in terms if t.kind == "glossary"]
    if len(chosen) > limit:
        raise TooManyTerms(f"{len(chosen)} glossary terms (at most {limit} per sentence)")
    chosen += [t for t in terms if t.kind == "placeholder"][: limit - len(chosen)]
    return sorted(chosen, key=lambda t: t.start)


def read_glossary(text: str) -> Glossary:
    """A glossary written one entry per line, ``source<TAB>target`` (a line without a tab keeps its
    term as it is: do-not-translate); blank lines and lines starting with ``#`` are skipped."""
    entries = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        source, _, target = line.partition("\t")
        entries.append(GlossaryEntry(source.strip(), (target or source).strip()))
    return Glossary(entries)
