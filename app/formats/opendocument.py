"""OpenDocument files (.odt; .odp and .ods read the same way): ``content.xml`` and the headers and
footers in ``styles.xml`` edited with lxml, every other file of the package kept as it was.

Each paragraph (``<text:p>``) and heading (``<text:h>``) is translated. The inline elements inside
one (``<text:span>``, ``<text:a>``, ``<text:meta>``, bookmarks, fields, pictures, note citations)
keep their places: their boundaries are marks, as a .docx paragraph's runs are
(``app.formats.runs``); a span or link's own text is translated with the rest, while a field's
text (a page number, a date, a cross-reference: the application writes them), a picture and a note
are left whole. A note's paragraphs (``<text:note>``), like those of comments
(``<office:annotation>``), text boxes and tables, are paragraphs of their own. A line break
(``<text:line-break>``) or a tab (``<text:tab>``) cuts a paragraph in pieces translated apart (as
``<br>`` in HTML); a ``<text:s>`` (spaces) counts as one space between the words around it and
stays where it is.

In a spreadsheet (.ods) only the cells of strings are translated (a number's or a date's cell
shows its value as a paragraph too); formulas and values are attributes, never touched, and sheet
names stay (formulas refer to them). In a presentation (.odp) the master pages are left as they are
(their placeholder prompts are never shown); slides and their notes are translated.

Not translated: the document's metadata (title, ``meta.xml``), the names of styles, tables and
frames, charts and other embedded objects (packages of their own inside the file), change-tracked
deletions.

Only ``content.xml`` and ``styles.xml`` are written again, and each only if its text changed
(``app.formats.parts.save``); the ``mimetype`` file stays first and stored, as ODF requires.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.formats.limits import DocumentError, DocumentLimits
from app.formats.package import check_package
from app.formats.parts import Part, open_zip, save
from app.formats.runs import ElementText, Run, RunsDocument

TEXT = "{urn:oasis:names:tc:opendocument:xmlns:text:1.0}"
OFFICE = "{urn:oasis:names:tc:opendocument:xmlns:office:1.0}"
TABLE = "{urn:oasis:names:tc:opendocument:xmlns:table:1.0}"
PARAGRAPHS = (f"{TEXT}p", f"{TEXT}h")
# Inline elements whose own text is part of the paragraph's.
INLINE = frozenset(f"{TEXT}{name}" for name in ("span", "a", "meta", "ruby", "ruby-base"))
BREAKS = frozenset({f"{TEXT}line-break", f"{TEXT}tab"})
SPACES = f"{TEXT}s"
TRACKED_CHANGES = f"{TEXT}tracked-changes"
# Where each part's translatable paragraphs are: the body; the master pages' headers and footers.
WHERE = {"content.xml": f"{OFFICE}body", "styles.xml": f"{OFFICE}master-styles"}


def read(kind: str, data: bytes, limits: DocumentLimits) -> RunsDocument:
    check_package(data, limits, kind)
    parts = {}
    with open_zip(data, kind) as archive:
        names = set(archive.namelist())
        mimetype = archive.read("mimetype") if "mimetype" in names else b""
        if not mimetype.startswith(b"application/vnd.oasis.opendocument.") or "content.xml" not in names:
            raise DocumentError(f"not a {kind} document: no OpenDocument mimetype and content.xml")
        for name in ("content.xml", "styles.xml"):
            if name == "styles.xml" and (kind == ".odp" or name not in names):
                continue  # a presentation's masters: placeholder prompts, never shown
            parts[name] = Part.read(archive, name, kind)
    paragraphs = (
        runs
        for name, part in parts.items()
        for where in part.tree.getroot().iter(WHERE[name])
        for paragraph in where.iter(*PARAGRAPHS)
        if not in_value_cell(paragraph) and not deleted(paragraph)
        for runs in pieces(paragraph)
    )
    return RunsDocument.make(paragraphs, lambda: save(data, parts), limits)


def in_value_cell(paragraph: Any) -> bool:
    """Whether the paragraph shows a spreadsheet cell's number, date, time or boolean."""
    parent = paragraph.getparent()
    if parent is None or parent.tag != f"{TABLE}table-cell":
        return False
    return parent.get(f"{OFFICE}value-type", "string") != "string"


def deleted(paragraph: Any) -> bool:
    """Whether the paragraph is text a tracked change deleted (kept to be shown, or restored)."""
    return any(a.tag == TRACKED_CHANGES for a in paragraph.iterancestors())


@dataclass(frozen=True)
class SpacesTail:
    """A ``<text:s>`` and the text after it: one space, then its tail. The element's spaces stay
    in front of the tail whatever is written."""

    element: Any

    @property
    def text(self) -> str:
        return " " + (self.element.tail or "")

    def write(self, text: str) -> None:
        self.element.tail = text[1:] if text[:1].isspace() else text


def pieces(paragraph: Any) -> Iterator[list[Run]]:
    """A paragraph's runs, cut at its line breaks and tabs."""
    runs: list[Run] = []
    for run in walk(paragraph, own=True):
        if run is None:
            if runs:
                yield runs
            runs = []
        else:
            runs.append(run)
    if runs:
        yield runs


def walk(element: Any, own: bool) -> Iterator[Run | None]:
    """The runs of text in and after ``element`` in document order, ``None`` at a break. Its own
    text and children count only if ``own`` (the paragraph, an inline element); the tail always
    (it belongs to the parent)."""
    if own:
        if element.text:
            yield ElementText(element)
        for child in element:
            yield from walk(child, own=child.tag in INLINE)
    if element.tag in BREAKS:
        yield None
    if element.tag == SPACES:
        yield SpacesTail(element)
    elif element.tail and element.tag not in PARAGRAPHS:
        yield ElementText(element, tail=True)
