"""PowerPoint presentations (.pptx): checked as a package first (``app.formats.package``), then
read and written with python-pptx.

Translated: every text frame of every slide (shapes, placeholders, shapes inside groups however
deep, the cells of tables) and each slide's notes. A paragraph's runs keep their formatting: the
run boundaries are marks, as in a .docx (``app.formats.runs``). A line break (``<a:br>``) or a
field (``<a:fld>``: a slide number, a date, which the application fills in) inside a paragraph
cuts it in two pieces translated apart, as ``<br>`` does in HTML: a sentence cannot be split
across an element that is not text.

Left as they are: slide layouts and masters (their placeholder prompts are never shown in a
presentation), charts and SmartArt diagrams (their text is in parts of their own), pictures, the
text of OLE objects, comments.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pptx
from pptx.oxml.ns import qn
from pptx.shapes.group import GroupShape

from app.formats.limits import DocumentError, DocumentLimits
from app.formats.package import check_package
from app.formats.runs import ElementText, RunsDocument

KIND = ".pptx"
RUN, BREAK, FIELD, TEXT = qn("a:r"), qn("a:br"), qn("a:fld"), qn("a:t")


def read(kind: str, data: bytes, limits: DocumentLimits) -> RunsDocument:
    check_package(data, limits, KIND)
    try:
        presentation = pptx.Presentation(io.BytesIO(data))
    except Exception as e:  # zipfile's, lxml's and python-pptx's own errors: all "unreadable"
        raise DocumentError(f"cannot read the {KIND} document: {e}") from e

    def save() -> bytes:
        out = io.BytesIO()
        presentation.save(out)
        return out.getvalue()

    paragraphs = (runs for frame in text_frames(presentation) for runs in frame_paragraphs(frame))
    return RunsDocument.make(paragraphs, save, limits)


def text_frames(presentation: Any) -> Iterator[Any]:
    """Each slide's text frames in the order of its shapes, then its notes."""
    for slide in presentation.slides:
        yield from shapes_frames(slide.shapes)
        if slide.has_notes_slide and slide.notes_slide.notes_text_frame is not None:
            yield slide.notes_slide.notes_text_frame


def shapes_frames(shapes: Any) -> Iterator[Any]:
    for shape in shapes:
        if isinstance(shape, GroupShape):
            yield from shapes_frames(shape.shapes)
        elif shape.has_text_frame:
            yield shape.text_frame
        elif getattr(shape, "has_table", False) and shape.has_table:
            for cell in shape.table.iter_cells():
                if not cell.is_spanned:  # a merged cell's text is in its first cell
                    yield cell.text_frame


def frame_paragraphs(frame: Any) -> Iterator[list[ElementText]]:
    """A text frame's paragraphs as runs, each cut at its line breaks and fields."""
    for paragraph in frame.paragraphs:
        runs: list[ElementText] = []
        for child in paragraph._p:  # python-pptx's runs leave out breaks and fields
            if child.tag == RUN and (t := child.find(TEXT)) is not None:
                runs.append(ElementText(t))
            elif child.tag in (BREAK, FIELD) and runs:
                yield runs
                runs = []
        if runs:
            yield runs
