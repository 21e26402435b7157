"""Translated PDF text drawn with reportlab: a font for each block, and the text fitted to its box.

A PDF's own fonts cannot be reused for the translation: they are usually subsets holding only the
glyphs the source text needed. So each block gets a font of its own kind instead:

* one of the 14 standard PDF fonts (Helvetica, Times, Courier, each bold and/or italic), chosen
  from the original font's name ("ABCDEF+Arial-BoldMT": Helvetica-Bold). They need no embedding
  and hold Latin-1 (Windows-1252) text;
* for a translation with characters outside that, DejaVu (Sans, Serif or Sans Mono, the same
  bold/italic) from the system's fonts, embedded as a subset; where no DejaVu is installed, those
  characters are drawn as "?" (the text is still there, in the right place; ``FONT_DIRS`` says
  where fonts are looked for). reportlab neither shapes nor reorders text: Arabic, Hebrew and
  Indic scripts come out as unjoined letters in logical order, and CJK (which DejaVu lacks) as
  missing glyphs, wrapped only at spaces.

A block's text is wrapped to its box's width in its original size, colour and line spacing, and
shrunk (down to ``FLOOR`` of its size, and never below ``MIN_POINTS``) until it fits the box's
height; at the floor it runs past the bottom of its box rather than lose words. Lines are drawn
left-aligned, or centred where the source's were (justified text is drawn left-aligned).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from reportlab.lib.utils import simpleSplit
from reportlab.pdfbase import pdfmetrics
from reportlab.pdfbase.ttfonts import TTFont
from reportlab.pdfgen.canvas import Canvas

FLOOR = 0.5  # the smallest a block's font shrinks to, as a fraction of its size
MIN_POINTS = 4.0
SLACK = 1.04  # a box's width and height, stretched a little: pdfminer's boxes are tight
FONT_DIRS = (
    Path("/usr/share/fonts/truetype/dejavu"),
    Path("/usr/share/fonts/dejavu"),
    Path("/usr/share/fonts/TTF"),
)
STANDARD = {
    "sans": ("Helvetica", "Helvetica-Bold", "Helvetica-Oblique", "Helvetica-BoldOblique"),
    "serif": ("Times-Roman", "Times-Bold", "Times-Italic", "Times-BoldItalic"),
    "mono": ("Courier", "Courier-Bold", "Courier-Oblique", "Courier-BoldOblique"),
}
DEJAVU = {
    "sans": ("DejaVuSans", "DejaVuSans-Bold", "DejaVuSans-Oblique", "DejaVuSans-BoldOblique"),
    "serif": ("DejaVuSerif", "DejaVuSerif-Bold", "DejaVuSerif-Italic", "DejaVuSerif-BoldItalic"),
    "mono": ("DejaVuSansMono", "DejaVuSansMono-Bold", "DejaVuSansMono-Oblique", "DejaVuSansMono-BoldOblique"),
}
SERIF = ("times", "serif", "roman", "georgia", "garamond", "cambria", "minion", "palatino", "book", "cmr")
MONO = ("courier", "mono", "consol", "menlo", "code", "cmtt", "typewriter")
BOLD = ("bold", "black", "heavy", "semibold", "demi", "-bd", "cmbx")
ITALIC = ("italic", "oblique", "-it", "cmti", "slanted")


@dataclass(frozen=True)
class Style:
    """How a block's text looked: its font's name, size, colour and line spacing."""

    font: str  # as the PDF names it ("ABCDEF+Times-Bold")
    size: float  # points
    color: tuple[float, ...]  # gray, RGB or CMYK components in 0..1
    leading: float  # baseline to baseline, in multiples of size


@dataclass(frozen=True)
class Text:
    """Translated text to draw into a box (x0, y0, x1, y1, in the page's displayed coordinates)."""

    box: tuple[float, float, float, float]
    text: str
    style: Style
    centred: bool = False  # each line in the middle of the box (else at its left)


def kind(font: str) -> tuple[str, int]:
    """The family ("sans", "serif", "mono") and variant (0 regular, 1 bold, 2 italic, 3 both)
    that a PDF font's name suggests."""
    name = font.split("+", 1)[-1].lower()
    family = "mono" if any(w in name for w in MONO) else "serif" if any(w in name for w in SERIF) else "sans"
    if "sans" in name:  # "DejaVuSans", "Noto Sans": never serif whatever else the name holds
        family = "mono" if family == "mono" else "sans"
    bold = any(w in name for w in BOLD)
    italic = any(w in name for w in ITALIC)
    return family, bold + 2 * italic


@cache
def dejavu(name: str) -> str | None:
    """``name`` registered with reportlab from the system's DejaVu fonts (None if not installed)."""
    for directory in FONT_DIRS:
        path = directory / f"{name}.ttf"
        if path.is_file():
            pdfmetrics.registerFont(TTFont(name, str(path)))
            return name
    return None


def latin1(text: str) -> bool:
    """Whether the standard fonts' encoding (Windows-1252, as reportlab writes them) holds ``text``."""
    try:
        text.encode("cp1252")
    except UnicodeEncodeError:
        return False
    return True


def font_for(text: str, font: str) -> tuple[str, str]:
    """The font to draw ``text`` in for a block in PDF font ``font``, and the text as drawn."""
    family, variant = kind(font)
    if latin1(text):
        return STANDARD[family][variant], text
    chosen = dejavu(DEJAVU[family][variant]) or dejavu(DEJAVU["sans"][0])
    if chosen:
        return chosen, text
    return STANDARD[family][variant], text.encode("cp1252", "replace").decode("cp1252")


def fit(
    text: str, font: str, size: float, leading: float, width: float, height: float
) -> tuple[float, list[str]]:
    """The size at which ``text`` wrapped to ``width`` fits ``height`` (or the floor), and its lines."""
    floor = max(MIN_POINTS, size * FLOOR)
    while True:
        lines = simpleSplit(text, font, size, width)
        tall = (len(lines) - 1) * size * leading + size
        wide = max((pdfmetrics.stringWidth(line, font, size) for line in lines), default=0.0)
        if (tall <= height and wide <= width) or size <= floor:
            return size, lines
        size = max(floor, size * 0.92)


def set_color(canvas: Canvas, color: tuple[float, ...]) -> None:
    c = [min(max(float(v), 0.0), 1.0) for v in color]
    if len(c) == 1:
        canvas.setFillGray(c[0])
    elif len(c) == 3:
        canvas.setFillColorRGB(*c)
    elif len(c) == 4:
        canvas.setFillColorCMYK(*c)
    else:  # a pattern or a colour space we do not follow
        canvas.setFillGray(0)


def draw(text: Text, canvas: Canvas) -> None:
    x0, y0, x1, y1 = text.box
    font, shown = font_for(text.text, text.style.font)
    size, lines = fit(shown, font, text.style.size, text.style.leading, (x1 - x0) * SLACK, (y1 - y0) * SLACK)
    ascent = pdfmetrics.getAscent(font, size)
    set_color(canvas, text.style.color)
    canvas.setFont(font, size)
    baseline = y1 - ascent
    for line in lines:
        if text.centred:
            canvas.drawCentredString((x0 + x1) / 2, baseline, line)
        else:
            canvas.drawString(x0, baseline, line)
        baseline -= size * text.style.leading


def overlay(pages: Sequence[tuple[tuple[float, float], Sequence[Text]]]) -> bytes:
    """A PDF of one page per (size, texts) in ``pages``: the texts drawn on a transparent page."""
    out = io.BytesIO()
    canvas = Canvas(out, pageCompression=1)
    for (width, height), texts in pages:
        canvas.setPageSize((width, height))
        for text in texts:
            draw(text, canvas)
        canvas.showPage()
    canvas.save()
    return out.getvalue()
