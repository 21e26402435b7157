"""Paragraphs made of runs of text, for the formats whose paragraphs are XML (.pptx, .xlsx, .odt).

A *run* is a stretch of a paragraph's text that sits in one place of the document (a DrawingML
``<a:t>``, a shared string's ``<t>``, the text or the tail of an OpenDocument ``<text:span>``);
the run boundaries are the paragraph's inline markup. As in ``app.formats.word``, a paragraph is
translated as one ``Block`` whose marks are those boundaries, and each run gets the piece of the
translation between its two marks. A run left as it was is not written (its element stays as it
was).

Paragraphs without a letter (numbers, dates, "---", blank ones) are not translated: a model asked
to translate "2024" or "3.5" can only make it worse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from app.formats.blocks import SplitBlocks
from app.formats.documents import NOT_XML, Review
from app.formats.inline import Block, Mark
from app.formats.limits import DocumentLimits
from app.formats.parts import XML_NS


class Run(Protocol):
    @property
    def text(self) -> str: ...

    def write(self, text: str) -> None: ...


@dataclass(frozen=True)
class ElementText:
    """The text of an lxml element (``tail=False``) or the text after it (``tail=True``)."""

    element: Any  # lxml.etree._Element
    tail: bool = False
    preserve: bool = False  # OOXML <t>: say xml:space="preserve" when the text has outer spaces

    @property
    def text(self) -> str:
        return (self.element.tail if self.tail else self.element.text) or ""

    def write(self, text: str) -> None:
        if self.tail:
            self.element.tail = text
            return
        self.element.text = text
        if self.preserve and text != text.strip():
            self.element.set(f"{{{XML_NS}}}space", "preserve")


def runs_block(runs: Sequence[Run]) -> Block:
    """A paragraph's text, with a mark where each run ends and the next begins: it goes with the
    word after it, unless a space follows it in the source (``"großer| Hund"``: the word before)."""
    texts = [run.text for run in runs]
    whole = "".join(texts)
    marks, offset = [], 0
    for text in texts[:-1]:
        offset += len(text)
        marks.append(Mark(offset, "after" if whole[offset : offset + 1].isspace() else "before"))
    return Block(whole, tuple(marks))


def has_letters(text: str) -> bool:
    return any(c.isalpha() for c in text)


@dataclass(frozen=True)
class RunsDocument:
    """The paragraphs of a document, each its runs, and how to write the document once they have
    been given their translations; ``flag``, where the format has a place for a reviewer's mark,
    marks a paragraph (its index in ``paragraphs``) with a note (``Review.note``), after the runs
    are written and before ``save``."""

    paragraphs: tuple[tuple[Run, ...], ...]
    blocks: tuple[Block, ...]
    save: Callable[[], bytes]
    flag: Callable[[int, str], None] | None = None

    @classmethod
    def make(
        cls,
        paragraphs: Iterable[Sequence[Run]],
        save: Callable[[], bytes],
        limits: DocumentLimits,
        flag: Callable[[int, str], None] | None = None,
    ) -> RunsDocument:
        """The paragraphs with letters in them, their text counted as it comes."""
        kept, blocks, chars = [], [], 0
        for runs in paragraphs:
            block = runs_block(runs)
            if not has_letters(block.text):
                continue
            chars += len(block.text)
            limits.check_chars(chars)
            kept.append(tuple(runs))
            blocks.append(block)
        return cls(tuple(kept), tuple(blocks), save, flag)

    @property
    def text(self) -> str:
        return "\n".join(b.text.strip() for b in self.blocks if b.text.strip())

    def split(self, language: str) -> SplitRuns:
        return SplitRuns(tuple(block.split(language) for block in self.blocks), self)


@dataclass(frozen=True)
class SplitRuns(SplitBlocks):
    source: RunsDocument

    def join(self, translations: Sequence[str], review: Review | None = None) -> bytes:
        """The document with its paragraphs translated (written once: the document is changed), and
        each paragraph that holds a sentence of ``review`` flagged where the format can."""
        for runs, placed in zip(self.source.paragraphs, self.placed(translations), strict=True):
            if placed is None:
                continue
            text, offsets = placed
            cuts = [0, *offsets, len(text)]
            for run, begin, end in zip(runs, cuts[:-1], cuts[1:], strict=True):
                piece = NOT_XML.sub("", text[begin:end])
                if run.text != piece:
                    run.write(piece)
        if review is not None and review.low and self.source.flag is not None:
            start = 0
            for paragraph, split in enumerate(self.splits):
                end = start + len(split.sentences)
                lowest = review.lowest(start, end)
                if lowest is not None:
                    self.source.flag(paragraph, review.note(lowest))
                start = end
        return self.source.save()
