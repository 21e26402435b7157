"""Text with inline markup, translated sentence by sentence: where does the markup go?

A *block* is the text of one paragraph (an HTML block element's inline content, a .docx
paragraph) with *marks* at character offsets: where an inline tag opens or closes (``<b>``,
``</a>``), where one run of a document ends and the next begins. Sentences are split on the
block's text whatever the marks (``Ein <b>großer</b> Hund.`` is one sentence, translated whole:
cut at the tags, the model would see "Ein", "großer" and "Hund." and translate neither), and each
mark is put back into the translation:

* a mark between two sentences, or at a sentence's start or end, stays exactly there;
* a mark inside a sentence goes to the word boundary at the same relative place, counted in words
  (after 2 of 6 source words: after 1 of 3 target words). The model gives no word alignment, so
  this is a guess; it is right when both languages keep the order of the words concerned (as
  German and English mostly do for adjectives, nouns and links) and never breaks the markup: the
  marks keep their order, so tags stay properly nested, and a mark that had words between itself
  and its neighbour keeps at least one word there (no ``<b></b>`` left empty) as long as the
  translation has words enough;
* a mark in a word's leading or trailing punctuation stays inside that punctuation (the quote
  or full stop stays outside ``<i>...</i>``);
* a mark that opens something (``side="before"``) attaches to the word after it, one that closes
  something (``side="after"``) to the word before it, so the space between words stays outside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from app.translation.segments import sentence_spans

Side = Literal["before", "after"]
Span = tuple[int, int]


@dataclass(frozen=True)
class Mark:
    offset: int  # in the block's text
    side: Side  # "before": belongs with the following word (an opening tag); "after": the preceding one


@dataclass(frozen=True)
class Block:
    """A paragraph's text and its marks, in document order (offsets non-decreasing)."""

    text: str
    marks: tuple[Mark, ...]

    def split(self, language: str) -> SplitBlock:
        spans = tuple(sentence_spans(self.text, language))
        return SplitBlock(self, spans, tuple(" ".join(self.text[s:e].split()) for s, e in spans))


@dataclass(frozen=True)
class Word:
    start: int
    end: int
    lead: int  # leading punctuation: characters before the first letter or digit
    trail: int  # trailing punctuation


def words(text: str) -> list[Word]:
    """The whitespace-separated words of ``text`` with their punctuation at either end."""
    out = []
    i, n = 0, len(text)
    while i < n:
        if text[i].isspace():
            i += 1
            continue
        start = i
        while i < n and not text[i].isspace():
            i += 1
        word = text[start:i]
        core = [j for j, c in enumerate(word) if c.isalnum()]
        lead, trail = (core[0], len(word) - 1 - core[-1]) if core else (len(word), 0)
        out.append(Word(start, i, lead, trail))
    return out


@dataclass(frozen=True)
class SplitBlock:
    block: Block
    spans: tuple[Span, ...]  # the sentences' places in block.text
    sentences: tuple[str, ...]  # what the model translates: each span, whitespace collapsed

    def place(self, translations: Sequence[str]) -> tuple[str, list[int]]:
        """The block's text with each sentence replaced by its translation (the text between
        sentences kept), and each mark's offset in it."""
        if len(translations) != len(self.spans):
            raise ValueError(f"expected {len(self.spans)} translations, got {len(translations)}")
        text, marks = self.block.text, self.block.marks
        out: list[str] = []
        length = 0  # of the output so far
        offsets: list[int] = []
        cursor = 0  # source text copied up to here
        m = 0  # next mark
        for (start, end), translation in zip(self.spans, translations, strict=True):
            while m < len(marks) and marks[m].offset <= start:  # in the gap before the sentence
                offsets.append(length + marks[m].offset - cursor)
                m += 1
            out.append(text[cursor:start])
            length += start - cursor
            inside = []
            while m < len(marks) and marks[m].offset < end:
                inside.append(marks[m])
                m += 1
            offsets += [length + p for p in inside_positions(text[start:end], translation, inside, start)]
            out.append(translation)
            length += len(translation)
            cursor = end
        offsets += [length + mark.offset - cursor for mark in marks[m:]]
        out.append(text[cursor:])
        return "".join(out), offsets


def inside_positions(source: str, target: str, marks: Sequence[Mark], base: int) -> list[int]:
    """Where marks inside one sentence go in its translation (module docstring). ``source`` is
    the sentence as it stands in the block, at offset ``base``."""
    if not marks:
        return []
    src, tgt = words(source), words(target)
    n, m = len(src), len(tgt)
    rel = [mark.offset - base for mark in marks]
    # Each mark as a word boundary of the source (k of n), and in which punctuation it sits.
    places: list[tuple[float, str | None]] = [source_boundary(src, o) for o in rel]
    wanted = [round(k * m / n) if n else 0 for k, _ in places]
    # Marks with letters between them (or between them and the sentence's ends) keep words between.
    cuts = [0, *rel, len(source)]
    between = [any(c.isalnum() for c in source[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    low = 0
    for i in range(len(wanted)):
        low = wanted[i] = max(wanted[i], low + between[i])
    high = m
    for i in reversed(range(len(wanted))):
        high = wanted[i] = min(wanted[i], high - between[i + 1])
    positions, last = [], 0
    for j, (_, region), mark in zip(wanted, places, marks, strict=True):
        j = min(max(j, 0), m)
        last = max(last, target_position(tgt, len(target), j, region, mark.side))
        positions.append(last)
    return positions


def source_boundary(src: Sequence[Word], o: int) -> tuple[float, str | None]:
    """Offset ``o`` as a word boundary (words before it) and the punctuation it sits in, if any."""
    before = sum(w.end <= o for w in src)
    if before == len(src) or o <= src[before].start:
        return before, None  # between words
    word = src[before]
    if o <= word.start + word.lead:
        return before, "lead"
    if o >= word.end - word.trail:
        return before + 1, "trail"
    # Inside a word's letters ("Haus<b>tür</b>"): the nearer boundary.
    return before + round((o - word.start) / (word.end - word.start)), None


def target_position(tgt: Sequence[Word], length: int, j: int, region: str | None, side: Side) -> int:
    """The offset in the translation of word boundary ``j`` (0..len(tgt))."""
    if region == "lead" and j < len(tgt):
        return tgt[j].start + tgt[j].lead
    if region == "trail" and j > 0:
        return tgt[j - 1].end - tgt[j - 1].trail
    if side == "before" or region == "lead":
        return tgt[j].start if j < len(tgt) else length
    return tgt[j - 1].end if j > 0 else 0
