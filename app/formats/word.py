"""Word documents (.docx): checked as a package first (``app.formats.package``), then read with
python-docx.

Every paragraph of the body, of tables (nested ones too) and of the headers and footers is
translated; a paragraph's runs (its stretches of one formatting: bold, a font, a hyperlink) keep
their formatting, and sentences are split across them as across inline HTML tags
(``app.formats.inline``), as for the other formats made of runs (``app.formats.runs``: a
paragraph without a letter is left as it is). Runs without text (pictures, breaks) are not
touched. Text boxes, footnotes, comments and fields are left as they are.

A paragraph holding a sentence flagged for review (``app.formats.documents.Review``) gets a Word
comment on its text, by "Machine translation" (initials "MT"), saying the note; Word cannot anchor
a comment in a header or footer, so a flagged paragraph there gets none.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import docx

from app.formats.limits import DocumentError, DocumentLimits
from app.formats.package import check_package
from app.formats.runs import Run, RunsDocument

AUTHOR, INITIALS = "Machine translation", "MT"  # of the comments on paragraphs flagged for review


def read(kind: str, data: bytes, limits: DocumentLimits) -> RunsDocument:
    check_package(data, limits)
    try:
        document = docx.Document(io.BytesIO(data))
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise DocumentError(f"not a .docx document: {e}") from e
    except Exception as e:  # lxml's XML errors and python-docx's own: all "unreadable"
        raise DocumentError(f"cannot read the .docx document: {e}") from e
    paragraphs = [[DocxRun(run) for run in paragraph_runs(p)] for p in document_paragraphs(document)]
    kept: list[tuple[Run, ...]] = []  # the made document's paragraphs: ``flag`` counts among them

    def flag(index: int, note: str) -> None:
        add_comment(document, kept[index], note)

    made = RunsDocument.make(paragraphs, lambda: save(document), limits, flag)
    kept += made.paragraphs
    return made


@dataclass(frozen=True)
class DocxRun:
    """A python-docx run as ``app.formats.runs`` writes it: a run left as it was keeps its pictures
    and breaks (setting its text would replace them)."""

    run: Any  # docx.text.run.Run

    @property
    def text(self) -> str:
        return str(self.run.text)

    def write(self, text: str) -> None:
        self.run.text = text


def add_comment(document: Any, runs: Sequence[Run], note: str) -> None:
    """A comment saying ``note`` on a paragraph's text (from its first run with text to its last),
    if the paragraph is in the body: Word anchors comments in the main document part only."""
    docx_runs = [run.run for run in runs if isinstance(run, DocxRun)]
    anchored = [run for run in docx_runs if run.text] or docx_runs
    if not anchored or any(run.part is not document.part for run in anchored):
        return  # a header's or a footer's paragraph
    document.add_comment([anchored[0], anchored[-1]], text=note, author=AUTHOR, initials=INITIALS)


def save(document: Any) -> bytes:
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def inner_paragraphs(container: Any) -> Iterator[Any]:
    """The paragraphs of a body, cell, header or footer, tables' cells (nested ones too) included."""
    from docx.table import Table

    for item in container.iter_inner_content():
        if isinstance(item, Table):
            for row in item.rows:
                for cell in row.cells:
                    yield from inner_paragraphs(cell)
        else:
            yield item


def paragraph_runs(paragraph: Any) -> list[Any]:
    """A paragraph's runs in order, those inside hyperlinks included."""
    from docx.text.hyperlink import Hyperlink

    runs: list[Any] = []
    for item in paragraph.iter_inner_content():
        runs += item.runs if isinstance(item, Hyperlink) else [item]
    return runs


def document_paragraphs(document: Any) -> list[Any]:
    """Every paragraph to translate: the body, then each section's own headers and footers (a
    header "linked to previous" is the previous section's, translated once)."""
    paragraphs = list(inner_paragraphs(document))
    seen = set()
    for section in document.sections:
        for part in (
            section.header,
            section.first_page_header,
            section.even_page_header,
            section.footer,
            section.first_page_footer,
            section.even_page_footer,
        ):
            if part.is_linked_to_previous or id(part.part) in seen:
                continue
            seen.add(id(part.part))
            paragraphs += inner_paragraphs(part)
    return paragraphs
