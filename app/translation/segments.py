"""Cut a request text into sentences, and put their translations back into the same layout.

The model is trained on single sentences, so a paragraph is translated sentence by sentence; the
layout around the sentences (line breaks, blank lines, indentation) is kept exactly, and only the
whitespace between two sentences of one line becomes a single space.

Sentence splitting uses ``sentencex`` (Wikimedia's segmenter: a Rust core with Python wheels), not
a hand-written regex and not pysbd, because:

* it is maintained (regular releases; pysbd's last release was in 2021);
* it knows ~300 languages (abbreviation lists, language-specific terminators) with fallbacks,
  so any language pair someone trains gets sensible splits, not only the 22 languages of pysbd;
* it is built for machine translation: when unsure it keeps sentences together rather than
  cutting one in the middle ("z. B.", "Dr.", "3. Oktober" stay whole), the right trade-off here;
* it is native code and fast, which matters because it runs on the event loop for every request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import sentencex

SENTENCE_SEPARATOR = " "


@dataclass(frozen=True)
class SplitText:
    """A text as sentences plus the literal separators around them.

    ``separators`` has one more item than ``sentences``: the text is
    ``separators[0] + sentences[0] + separators[1] + ... + sentences[-1] + separators[-1]``
    (with whitespace between sentences of one line normalised to a single space).
    """

    sentences: tuple[str, ...]
    separators: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.separators) != len(self.sentences) + 1:
            raise ValueError("separators must have exactly one more item than sentences")

    def join(self, translations: Sequence[str]) -> str:
        """The text with each sentence replaced by its translation (same order, same layout)."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"expected {len(self.sentences)} translations, got {len(translations)}")
        parts = [self.separators[0]]
        for translation, separator in zip(translations, self.separators[1:], strict=True):
            parts += [translation, separator]
        return "".join(parts)


def _lines(text: str) -> Iterator[tuple[str, str]]:
    """``(content, line_break)`` for each line; ``line_break`` is the exact break ("\\r\\n", ...)."""
    for chunk in text.splitlines(keepends=True):
        content = chunk.splitlines()[0]
        yield content, chunk[len(content) :]


def split_sentences(line: str, language: str) -> list[str]:
    """The sentences of one line (no line breaks inside), stripped, none empty."""
    sentences = [s.strip() for s in sentencex.segment(language, line)]
    return [s for s in sentences if s] or ([line.strip()] if line.strip() else [])


def split_text(text: str, language: str) -> SplitText:
    """Split ``text`` into sentences of ``language`` (an ISO 639 code), keeping its layout.

    Line breaks come first (a sentence never spans lines: a line break in the input is a
    boundary the author chose), then sentences within each line. A blank text has no sentences
    and joins back to "" (blank in, blank out, no model work).
    """
    if not text.strip():
        return SplitText((), ("",))
    sentences: list[str] = []
    separators: list[str] = []
    pending = ""  # layout text seen since the last sentence
    for content, line_break in _lines(text):
        core = content.strip()
        if not core:  # blank or whitespace-only line: keep it exactly
            pending += content + line_break
            continue
        pending += content[: len(content) - len(content.lstrip())]  # indentation
        for sentence in split_sentences(core, language):
            separators.append(pending)
            sentences.append(sentence)
            pending = SENTENCE_SEPARATOR
        pending = content[len(content.rstrip()) :] + line_break  # trailing spaces and the break
    separators.append(pending)
    return SplitText(tuple(sentences), tuple(separators))


def sentence_spans(text: str, language: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each sentence of ``text`` (surrounding whitespace left out), in order.

    For text whose line breaks are no boundaries (HTML, a paragraph of a document): every
    whitespace character counts as a space. Sentences found nowhere in the text (which sentencex
    does not do: its segments are slices of the input) would make the whole text one sentence.
    """
    flat = "".join(" " if c.isspace() else c for c in text)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for segment in sentencex.segment(language, flat):
        start = flat.find(segment, cursor)
        if start < 0:
            core = flat.strip()
            return [(flat.index(core), flat.index(core) + len(core))] if core else []
        cursor = start + len(segment)
        core = segment.strip()
        if core:
            begin = start + len(segment) - len(segment.lstrip())
            spans.append((begin, begin + len(core)))
    return spans
