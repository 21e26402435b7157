"""A Markdown inline text (a paragraph's, a heading's, a table cell's) as ``app.formats.markdown``
reads it, and its translation written back with the source's markup.

The text is a block of ``app.formats.inline`` whose marks are the markup: each mark's piece is
the source markup written at the mark's new offset. Beyond what ``app.formats.inline`` does:

* a mark inside a word (``**Ecma**'s``, ``<kbd>Ctrl</kbd>+<kbd>C</kbd>``, ``(`code`, more)``) goes
  back to the same place in that word when the translation has the word near where it went;
* code spans, images, autolinks and inline HTML ("atoms") keep a space where the source had one,
  get one where they now stand next to a word, and are kept apart when they meet (`a``b` would be
  one code span);
* a line break is written only when words follow it on its line (an empty line would end the
  paragraph), and a line whose translation starts with what would open a block ("- ", "# ",
  "1. ") gets that character escaped, unless the source's line started so too;
* a link written ``[text][]`` or ``[text]`` names its reference with its text: translated, it
  becomes ``[translation][text]``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from app.formats.inline import Block

# What would open a block at the start of a line (a list item, heading, quote, fence, HTML, rule).
BLOCK_START = re.compile(r"[-+*#>=`~<]|\d{1,9}[.)]")
WINDOW = 200  # characters around a mark where within_words looks for its word


@dataclass(frozen=True)
class Piece:
    """The source markup at one mark of a block."""

    raw: str
    atom: bool = False  # a code span, image, autolink or inline HTML: something the sentence holds
    br: bool = False  # a line break with the next line's prefix
    follows: str = ""  # a line break's: the text that followed it in the source
    opens_link: int = -1  # a link's "[" (alone or in an atom): where in raw the link's text starts
    # The closing "]" or "][]" of a link whose text is its reference ("[Ecma International][]"):
    # the text it must still have, or the reference it must name once the text is translated.
    reference: str = ""


@dataclass(frozen=True)
class Span:
    """One inline text of the source, ``start:end``, as a block to translate."""

    start: int
    end: int
    block: Block
    pieces: tuple[Piece, ...]  # one per mark
    written: dict[str, str]  # characters the source wrote escaped or as entities, and how


def word_around(text: str, offset: int) -> tuple[int, int]:
    """The whitespace-separated word that ``offset`` is in or touches (the one before it first)."""
    start = end = offset
    if start > 0 and not text[start - 1].isspace():
        while start > 0 and not text[start - 1].isspace():
            start -= 1
    while end < len(text) and not text[end].isspace():
        end += 1
    return start, end


def within_words(block: Block, text: str, offsets: Sequence[int]) -> list[int]:
    """Marks inside a word, where ``app.formats.inline`` moves them to a word boundary or the end
    of its punctuation (``**Ecma**'s``, ``(`code`, more)``, ``<kbd>Ctrl</kbd>+<kbd>C</kbd>``): back
    at the same place in the word when the translation has that same word near where the mark
    went."""
    out: list[int] = []
    for mark, offset in zip(block.marks, offsets, strict=True):
        source_start, source_end = word_around(block.text, mark.offset)
        word = block.text[source_start:source_end]
        inside = mark.offset - source_start
        low = max(0, out[-1] - inside if out else 0, offset - WINDOW)  # marks keep their order
        best = None
        for match in re.finditer(re.escape(word), text[low : offset + WINDOW]) if word else ():
            start = match.start() + low
            whole = word_around(text, start + len(word)) == (start, start + len(word))
            if whole and (best is None or abs(start + inside - offset) < abs(best - offset)):
                best = start + inside
        offset = best if best is not None else offset
        out.append(max(offset, out[-1]) if out else offset)
    return out


def render(span: Span, text: str, offsets: Sequence[int]) -> str:
    """The translated text with the source's markup at the marks' new offsets."""
    source = span.block.text
    out = Writer(span.written, source)
    cursor = 0
    for mark, offset, piece in zip(span.block.marks, offsets, span.pieces, strict=True):
        out.text(text[cursor:offset])
        cursor = offset
        if piece.br:
            out.line_break(piece.raw, piece.follows)
        elif piece.atom:  # as app.formats.html does with <code>: keep the spaces around it
            # (and one where it now stands next to a word and stood next to none: "mit ![Bild](b.png)."
            # -> "with ![Bild](b.png) it.").
            before, after = source[mark.offset - 1 : mark.offset], source[mark.offset : mark.offset + 1]
            spaced_before = not before.strip() or (
                text[offset - 1 : offset].isalnum() and not before.isalnum()
            )
            spaced_after = not after.strip() or (text[offset : offset + 1].isalnum() and not after.isalnum())
            out.atom(
                piece.raw, spaced_before and offset > 0 and not text[offset - 1].isspace(), piece.opens_link
            )
            if spaced_after and offset < len(text) and not text[offset].isspace():
                out.text(" ")
        elif piece.reference and " ".join(out.since_link().split()) != piece.reference:
            out.markup(f"][{piece.reference}]")  # "[Text][]" translated: "[Translation][Text]"
        else:
            out.markup(piece.raw, piece.opens_link)
    out.text(text[cursor:])
    return "".join(out.out)


class Writer:
    """A translated inline text as it is put together: a line break is written only when something
    follows it on its line (two breaks with nothing between would leave an empty line, which ends
    the paragraph); a line's text is escaped where it would open a block."""

    def __init__(self, written: dict[str, str], source: str) -> None:
        self.written = written
        self.out: list[str] = []
        self.pending = ""  # a line break not yet written
        self.follows = source  # what followed it in the source (at first: the text's start)
        self.line_start = True  # the next text starts a line
        self.last_atom = -1  # where in out the last atom is
        self.link = (0, 0)  # where the text of the last link opened begins: in out, and in that piece

    def flush(self) -> None:
        if self.pending:
            self.out.append(self.pending)
            self.pending = ""
            self.line_start = True

    def text(self, chunk: str) -> None:
        if self.line_start or self.pending:
            chunk = chunk.lstrip(" ")
        if not chunk:
            return
        self.flush()
        if self.line_start:
            start = BLOCK_START.match(chunk)
            # It would open a block (a list item, a heading...), unless the source's line started
            # so too (and was no block: a "-" in a paragraph's continuation line).
            if start and not self.follows.startswith(start.group()):
                digits = len(chunk) - len(chunk.lstrip("0123456789"))
                chunk = chunk[:digits] + "\\" + chunk[digits:]
            self.line_start = False
        self.out.append("".join(self.written.get(c, c) for c in chunk))

    def markup(self, raw: str, opens_link: int = -1) -> None:
        self.flush()
        self.line_start = False
        self.out.append(raw)
        if opens_link >= 0:
            self.link = (len(self.out) - 1, opens_link)

    def atom(self, raw: str, space: bool, opens_link: int) -> None:
        self.flush()
        # Two atoms that now meet get a space between them: `a``b` would be one code span.
        if (space and not self.line_start) or self.last_atom == len(self.out) - 1 >= 0:
            self.out.append(" ")
        self.markup(raw, opens_link)
        self.last_atom = len(self.out) - 1

    def line_break(self, raw: str, follows: str) -> None:
        self.pending, self.follows = raw, follows

    def since_link(self) -> str:
        index, offset = self.link
        return "".join(self.out[index:])[offset:]
