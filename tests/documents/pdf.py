"""PDF samples drawn with reportlab, and the check that a translation kept their pages.

The report has a page of headings and paragraphs in two sizes over a filled rectangle and a small
image, a second page in A4 landscape, and a page holding only an image (a "scan": it must come
back untouched and untranslated). What is checked of a translation (pdfminer reads both files):
as many pages, of the same sizes; text where each of the source's text boxes was; none of the
source's words that the translation changed; every image and drawing still drawn.
"""

from __future__ import annotations

import io
from collections.abc import Callable

from pdfminer.high_level import extract_pages
from pdfminer.layout import LAParams, LTCurve, LTImage, LTTextBox
from pypdf import PdfReader
from reportlab.lib.pagesizes import A4, landscape
from reportlab.lib.utils import ImageReader
from reportlab.pdfgen.canvas import Canvas

HEADING = "Machine translation on your own servers"
PARAGRAPHS = (
    "The service translates documents without sending them anywhere. Every page keeps its layout, "
    "its images and its drawings.",
    "Small print says more: the translation of each text block is drawn where the block was, in a "
    "font like its own, and shrunk when it needs more room.",
)
SECOND = "A landscape page. Its text is translated too."


def image(width: int = 24, height: int = 16) -> ImageReader:
    """A small RGB image (PPM, so that no image library is needed to make it)."""
    pixels = b"".join(bytes((x * 10 % 256, y * 15 % 256, 128)) for y in range(height) for x in range(width))
    return ImageReader(io.BytesIO(b"P6 %d %d 255\n" % (width, height) + pixels))


def paragraph(canvas: Canvas, text: str, x: float, y: float, size: float, width: float) -> float:
    """``text`` wrapped to ``width`` from baseline ``y`` down; the baseline after it."""
    from reportlab.lib.utils import simpleSplit

    for line in simpleSplit(text, "Helvetica", size, width):
        canvas.drawString(x, y, line)
        y -= size * 1.25
    return y - size


def report() -> bytes:
    out = io.BytesIO()
    canvas = Canvas(out, pagesize=A4)
    canvas.setFillColorRGB(0.85, 0.9, 1.0)
    canvas.rect(60, 560, 470, 60, fill=1, stroke=0)  # a drawing under no text
    canvas.drawImage(image(), 450, 700, 48, 32)
    canvas.setFillColorRGB(0, 0, 0)
    canvas.setFont("Helvetica-Bold", 20)
    canvas.drawString(72, 770, HEADING)
    canvas.setFont("Helvetica", 12)
    y = paragraph(canvas, PARAGRAPHS[0], 72, 730, 12, 360)
    canvas.setFont("Times-Roman", 9)
    paragraph(canvas, PARAGRAPHS[1], 72, y - 10, 9, 360)
    canvas.showPage()
    canvas.setPageSize(landscape(A4))
    canvas.setFont("Times-Bold", 16)
    canvas.drawString(72, 500, SECOND)
    canvas.setStrokeColorRGB(0.2, 0.2, 0.2)
    canvas.line(72, 490, 500, 490)
    canvas.showPage()
    canvas.setPageSize(A4)
    canvas.drawImage(image(60, 80), 100, 200, 300, 400)  # a scanned page: an image, no text
    canvas.showPage()
    canvas.save()
    return out.getvalue()


SAMPLES: dict[str, Callable[[], bytes]] = {"report.pdf": report}


def layout(data: bytes) -> list[tuple[tuple[float, float], list[LTTextBox], int, int]]:
    """Each page's size, text boxes, images and drawings (lines, rectangles, curves)."""
    pages = []
    for page in extract_pages(io.BytesIO(data), laparams=LAParams(all_texts=True)):
        boxes, images, drawings = [], 0, 0
        stack = list(page)
        while stack:
            item = stack.pop()
            if isinstance(item, LTTextBox):
                boxes.append(item)
            elif isinstance(item, LTImage):
                images += 1
            elif isinstance(item, LTCurve):  # LTLine and LTRect are curves
                drawings += 1
            elif hasattr(item, "__iter__"):
                stack += list(item)
        pages.append(((round(page.width, 1), round(page.height, 1)), boxes, images, drawings))
    return pages


def overlaps(a: LTTextBox, b: LTTextBox) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def check_structure(filename: str, original: bytes, translated: bytes) -> None:
    assert len(PdfReader(io.BytesIO(translated)).pages) == len(PdfReader(io.BytesIO(original)).pages)
    before, after = layout(original), layout(translated)
    assert [p[0] for p in after] == [p[0] for p in before], "page sizes changed"
    for number, ((_, source, images, drawings), (_, target, images_after, drawings_after)) in enumerate(
        zip(before, after, strict=True), start=1
    ):
        assert images_after == images, f"page {number}: {images} images, then {images_after}"
        assert drawings_after == drawings, f"page {number}: {drawings} drawings, then {drawings_after}"
        for box in source:
            where = f"page {number}: no text where {box.get_text()!r} was"
            assert any(overlaps(box, t) for t in target), where
        if not source:
            assert not target, f"page {number} had no text and has some now"
