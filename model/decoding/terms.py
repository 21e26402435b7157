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

Cost: linear in the sentence, whatever it holds (a sentence may be a hostile upload's 100,000
characters of ``1 1 1 ...``). Terms are looked for in a sentence's first ``MAX_SEARCH_CHARS``
characters only (``searched``); a glossary lookup costs each word at most one dictionary look-up
per distinct length of the entries beginning with that word (so at most the longest term's
length, however many entries share the word); overlaps are resolved in O(C log C + L) for C
candidates (``resolve``); and no placeholder pattern backtracks more than linearly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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

# A width never begins with 0 (a leading 0 is the flag): written "\d+" after the flags "[-+#0]*", a
# run of zeros could be split between the two in every way, and "%" + 100,000 zeros not followed by
# a conversion took minutes to refuse. Same matches (tests/test_terms_reference.py).
_PLACEHOLDERS = [
    re.compile(r"\{\{\s*[^{}\s]{1,64}\s*\}\}"),  # {{var}}, {{ var }}
    re.compile(r"\{[^{}\s]{0,64}\}"),  # {name}, {0}, {}, {count:>5}
    re.compile(r"(?<!%)%\([^()\s]{1,64}\)[-+#0]*(?:(?!0)\d+)?(?:\.\d+)?[diouxXeEfFgGcsr]"),  # %(name)s
    # %s, %d, %1$s, %-5.2f, %lu; not "%%" (a literal percent sign) and not "50% discount".
    re.compile(
        r"(?<!%)%(?:\d+\$)?[-+#0]*(?:(?!0)\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|z|j|t)?[diouxXeEfFgGcsp@]"
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


@dataclass
class _Group:
    """The variants that begin alike (with the same word, or the same character where that is no
    word character): the first of each text (of two with one text, the first wins), and their
    distinct lengths, shortest first. A position of a sentence is looked up once per length."""

    by_text: dict[str, _Variant] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)

    def add(self, variant: _Variant) -> None:
        if variant.text not in self.by_text:
            self.by_text[variant.text] = variant
            if len(variant.text) not in self.lengths:
                self.lengths.append(len(variant.text))
                self.lengths.sort()


class Glossary:
    """Entries made ready for matching many sentences: indexed by their first word (by their first
    character, those that do not begin with a word character), and within that by their text, so
    that a word of a sentence costs at most one look-up per distinct entry length, however many
    entries there are or share that word."""

    def __init__(self, entries: Iterable[GlossaryEntry]) -> None:
        self.entries: list[GlossaryEntry] = []
        seen: set[str] = set()
        for entry in entries:
            if not entry.source.strip() or not entry.target.strip():
                continue  # a blank term matches nothing that means anything, nor says what to write
            if entry.source not in seen:  # the first of one source wins
                seen.add(entry.source)
                self.entries.append(entry)
        self._by_word: dict[str, _Group] = {}
        self._by_char: dict[str, _Group] = {}  # entries that do not begin with a word character
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
            self._by_char.setdefault(variant.text[0], _Group()).add(variant)
        else:
            self._by_word.setdefault(first.group(), _Group()).add(variant)

    def __len__(self) -> int:
        return len(self.entries)

    def candidates(self, sentence: str) -> list[Term]:
        """Every match of an entry in ``sentence``, overlapping ones included.

        An entry that begins with a word character can match only where a word of the sentence
        begins (the character before it is no word character), and only an entry whose first word
        is that word (a longer word fails the boundary after it): so each word is looked up once
        in ``_by_word``, then once per distinct length in its group."""
        found: list[Term] = []
        first_word = _WORDS.search(sentence)
        initial_at = first_word.start() if first_word else -1
        for word in _WORDS.finditer(sentence):
            group = self._by_word.get(word.group())
            if group is not None:
                _match(sentence, word.start(), group, initial_at, found)
        if self._by_char:
            for start, char in enumerate(sentence):
                group = self._by_char.get(char)
                if group is not None:
                    _match(sentence, start, group, initial_at, found)
        return found


def _match(sentence: str, start: int, group: _Group, initial_at: int, found: list[Term]) -> None:
    """Append to ``found`` each variant of ``group`` that matches ``sentence`` at ``start``."""
    for length in group.lengths:
        end = start + length
        if end > len(sentence):
            return
        variant = group.by_text.get(sentence[start:end])
        if variant is not None and _fits(sentence, start, end, variant, initial_at):
            found.append(Term(start, end, variant.text, variant.entry.target, "glossary"))


def _fits(sentence: str, start: int, end: int, variant: _Variant, initial_at: int) -> bool:
    """Whether the variant, found at ``sentence[start:end]``, is a match by the rules of case and of
    word boundaries (module docstring)."""
    text = variant.text
    if variant.initial and start != initial_at:
        return False
    if is_word_char(text[0]) and start > 0 and is_word_char(sentence[start - 1]):
        return False
    if is_word_char(text[-1]) and end < len(sentence) and is_word_char(sentence[end]):
        return False
    if text[-1].isdigit() and _NUMBER_GOES_ON.match(sentence, end):
        return False
    # Only the last three characters before ``start`` can match ("5," or "5,\n": ``$`` matches
    # before a final newline too): searched from there, not from 0 (which is quadratic).
    return not (text[0].isdigit() and _NUMBER_CAME_FROM.search(sentence, max(0, start - 3), start))


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
    has no opening one of its own (Wikipedia's "..._(disambiguation)"). (Counted once, and cut
    once: a URL followed by 100,000 dots or brackets costs its length, not its length squared.)"""
    opened, closed = url.count("("), url.count(")")
    end = len(url)
    while end:
        last = url[end - 1]
        if last in _URL_TRAILER:
            end -= 1
        elif last == ")" and opened < closed:
            closed -= 1
            end -= 1
        else:
            break
    return url[:end]


# Terms of one sentence at most (the service's NMT_MAX_TERMS_PER_SENTENCE, the CLI's --max-terms):
# each raises the sentence's beam (``beam_for``) and costs the search per step.
MAX_TERMS_PER_SENTENCE = 10


class TooManyTerms(ValueError):
    """A sentence has more glossary matches than a sentence may have terms."""


def _rank(term: Term) -> tuple[int, int, bool]:
    return (term.start - term.end, term.start, term.kind != "glossary")


def resolve(candidates: Sequence[Term], max_glossary: int | None = None) -> list[Term]:
    """The terms kept of overlapping ``candidates``: the longest first (then the earliest, then a
    glossary entry before a placeholder, then the first given), each kept unless it overlaps one
    kept before; in order. ``TooManyTerms`` as soon as more than ``max_glossary`` glossary terms
    are kept (a kept term stays kept: the count only grows).

    O(C log C + L) for C candidates in a sentence of L characters: a term kept before is at least
    as long as the one tested, and the kept ones do not overlap, so the one tested overlaps a kept
    one exactly when one covers its first or its last character; ``taken`` marks the characters of
    the kept terms (each character once)."""
    ranked = sorted(candidates, key=_rank)
    taken = bytearray(max((t.end for t in ranked), default=0))
    kept: list[Term] = []
    glossary_terms = 0
    for term in ranked:
        if term.end <= term.start:
            raise ValueError(f"a term must span at least one character: {term!r}")
        if taken[term.start] or taken[term.end - 1]:
            continue
        taken[term.start : term.end] = b"\x01" * (term.end - term.start)
        kept.append(term)
        if term.kind == "glossary":
            glossary_terms += 1
            if max_glossary is not None and glossary_terms > max_glossary:
                raise TooManyTerms(
                    f"more than {max_glossary} glossary terms (at most {max_glossary} per sentence)"
                )
    return sorted(kept, key=lambda t: t.start)


# Terms are looked for in a sentence's first MAX_SEARCH_CHARS characters. The model reads at most
# max_input_tokens (250) tokens of a sentence, ~1,000-1,500 characters of ordinary text: past them a
# term would be a constraint on text the model never sees, and searching a hostile 2,000,000-character
# "sentence" would cost the front end its length in candidates. 4,096 leaves every ordinary sentence
# untouched.
MAX_SEARCH_CHARS = 4096
_SPACES = "".join(c for c in map(chr, range(0x3001)) if c.isspace())  # every str.isspace character


def searched(sentence: str) -> str:
    """The part of ``sentence`` whose terms are found: all of it, up to ``MAX_SEARCH_CHARS``
    characters. Of a longer sentence, its start up to the last whitespace character within the
    first ``MAX_SEARCH_CHARS + 1`` (nothing is cut but at a space, so that no word, number or URL is
    cut short into a match it is not), or "" where there is none; a term that would end past that
    is not found, and that part of the sentence is translated without terms."""
    if len(sentence) <= MAX_SEARCH_CHARS:
        return sentence
    head = sentence[: MAX_SEARCH_CHARS + 1]
    cut = max(head.rfind(space) for space in _SPACES)
    return head[: max(cut, 0)]


def find_terms(
    sentence: str, glossary: Glossary | None = None, *, protect: bool = True, max_glossary: int | None = None
) -> list[Term]:
    """The terms of ``sentence`` (of its ``searched`` part), in order, none overlapping:
    ``glossary``'s matches, and with ``protect`` its placeholders (``TooManyTerms`` past
    ``max_glossary`` glossary terms)."""
    sentence = searched(sentence)
    candidates = glossary.candidates(sentence) if glossary is not None and len(glossary) else []
    if protect:
        candidates += placeholders(sentence)
    return resolve(candidates, max_glossary) if candidates else []


def sentence_terms(sentence: str, glossary: Glossary | None, *, protect: bool, limit: int) -> list[Term]:
    """The terms ``sentence`` is translated with: every glossary match (more than ``limit`` raise
    ``TooManyTerms``), then placeholders while room is left (the ones past it are translated as
    the model likes); in order."""
    terms = find_terms(sentence, glossary, protect=protect, max_glossary=limit) if sentence.strip() else []
    chosen = [t for t in terms if t.kind == "glossary"]
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
