"""Text blocks of a PDF page, as pdfminer's layout analysis finds them: each text box's text (its
lines joined into one paragraph), its box, and how it looked (font, size, colour, line spacing,
alignment), and how far a block of one line may grow when its translation is longer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdfminer.layout import LTChar, LTCurve, LTImage, LTPage, LTTextBox, LTTextLine

from app.formats.pdf_draw import Style

Box = tuple[float, float, float, float]  # x0, y0, x1, y1
GAP = 4.0  # points kept free between a widened block and what is next to it
CENTRED = 2.0  # points: lines whose middles are this close (and starts are not) are centred
# Typographic ligatures (pdfminer gives "ﬁ" for the glyph): the model knows the letters.
LIGATURES = str.maketrans({"ﬀ": "ff", "ﬁ": "fi", "ﬂ": "fl", "ﬃ": "ffi", "ﬄ": "ffl", "ﬅ": "st", "ﬆ": "st"})


@dataclass(frozen=True)
class TextBlock:
    """One of pdfminer's text boxes: where it is on its page, its text and how it looked."""

    box: Box  # in the page's displayed coordinates; a one-line block's as wide as it may run
    text: str
    style: Style
    centred: bool  # its lines (else left-aligned)


def join_lines(lines: Sequence[str]) -> str:
    """A text box's lines as one paragraph: a hyphen at a line's end before a lower-case letter
    (or a soft hyphen before anything) is a word broken across lines (its halves joined), other
    line breaks are spaces; ligatures are letters again."""
    text = ""
    for line in (line.strip().translate(LIGATURES) for line in lines):
        if not line:
            continue
        soft = text.endswith("\xad")  # a soft hyphen: the word goes on, whatever the case
        if soft or (text.endswith("-") and len(text) > 1 and text[-2].isalpha() and line[0].islower()):
            text = text[:-1] + line
        else:
            text = f"{text} {line}" if text else line
    return text


def chars(item: Any) -> Iterator[LTChar]:
    for child in item:
        if isinstance(child, LTChar):
            yield child
        elif isinstance(child, LTTextLine):
            yield from chars(child)


def style(box: LTTextBox, lines: Sequence[LTTextLine]) -> Style:
    """The font, size and colour of most of a box's characters, and its line spacing."""
    shown = [c for line in lines for c in chars(line) if c.get_text().strip()]
    looks = Counter((c.fontname, round(c.size, 1), color(c)) for c in shown)
    (font, size, col), _ = looks.most_common(1)[0] if looks else (("Helvetica", 10.0, (0.0,)), 0)
    leading = 1.2
    if len(lines) > 1 and size > 0:  # baseline to baseline, averaged over the box
        leading = (lines[0].y0 - lines[-1].y0) / (len(lines) - 1) / size
    return Style(font, max(size, 1.0), col, min(max(leading, 1.0), 2.0))


def color(char: LTChar) -> tuple[float, ...]:
    value: Any = getattr(getattr(char, "graphicstate", None), "ncolor", None)
    if isinstance(value, int | float):
        return (float(value),)
    numbers = isinstance(value, tuple | list) and all(isinstance(v, int | float) for v in value)
    if numbers and len(value) in (1, 3, 4):  # not a pattern's name
        return tuple(float(v) for v in value)
    return (0.0,)


def text_boxes(item: Any) -> Iterator[LTTextBox]:
    """The text boxes of a page, those inside figures (forms) included, in pdfminer's order."""
    for child in item:
        if isinstance(child, LTTextBox):
            yield child
        elif hasattr(child, "__iter__") and not isinstance(child, LTTextLine):
            yield from text_boxes(child)


def obstacles(item: Any) -> Iterator[Box]:
    """The boxes of what a page draws: text boxes, images, lines, rectangles and curves."""
    for child in item:
        if isinstance(child, LTTextBox | LTImage | LTCurve):
            yield (child.x0, child.y0, child.x1, child.y1)
        elif hasattr(child, "__iter__") and not isinstance(child, LTTextLine):
            yield from obstacles(child)


def room(box: Box, margin: float, page_width: float, around: Sequence[Box]) -> tuple[float, float]:
    """How far left and right a one-line block may run: to what is next to it on either side, or
    to the page's margins (its text's leftmost start, and as much on the right), never less than
    its box (a translation is often longer than its source, and a heading shrunk to its source's
    width looks wrong)."""
    x0, y0, x1, y1 = box
    left, right = min(x0, margin), max(x1, page_width - margin)
    for a0, b0, a1, b1 in around:
        if b0 < y1 and y0 < b1:  # beside the block
            if a0 >= x1 - 0.5:
                right = min(right, a0 - GAP)
            elif a1 <= x0 + 0.5:
                left = max(left, a1 + GAP)
    return min(left, x0), max(right, x1)


def centred(lines: Sequence[LTTextLine], page_width: float, starts: Sequence[float]) -> bool:
    """Whether a box's lines are centred: their middles line up and their starts do not; one line
    is if it sits in the middle of the page and starts where no other box does."""
    middles = [(line.x0 + line.x1) / 2 for line in lines]
    if len(lines) > 1:
        lefts = [line.x0 for line in lines]
        return max(middles) - min(middles) <= CENTRED and max(lefts) - min(lefts) > 2 * CENTRED
    alone = sum(abs(start - lines[0].x0) <= CENTRED for start in starts) <= 1  # itself
    return abs(middles[0] - page_width / 2) <= CENTRED and alone


def page_blocks(layout: LTPage) -> tuple[TextBlock, ...]:
    blocks = []
    around = list(obstacles(layout))
    boxes = list(text_boxes(layout))
    starts = [box.x0 for box in boxes]
    margin = min(starts, default=0.0)
    for box in boxes:
        lines = [line for line in box if isinstance(line, LTTextLine)]
        text = join_lines([line.get_text() for line in lines])
        if not text:
            continue
        x0, y0, x1, y1 = box.x0, box.y0, box.x1, box.y1
        middle = centred(lines, layout.width, starts)
        if len(lines) == 1:
            left, right = room((x0, y0, x1, y1), margin, layout.width, around)
            if middle:  # as far as it may run on both sides
                half = min(right - (x0 + x1) / 2, (x0 + x1) / 2 - left)
                left, right = (x0 + x1) / 2 - half, (x0 + x1) / 2 + half
            x0, x1 = (left if middle else x0), right
        blocks.append(TextBlock((x0, y0, x1, y1), text, style(box, lines), middle))
    return tuple(blocks)
