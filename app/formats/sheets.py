"""Excel workbooks (.xlsx): the text of their cells and comments, edited in the package's XML.

A workbook's cell text is in three kinds of part, found by their content types in
``[Content_Types].xml``:

* the shared strings (``xl/sharedStrings.xml``), where nearly all of it is: each ``<si>`` is one
  paragraph, a plain ``<t>`` or rich-text runs ``<r><rPr/><t>`` (the runs are marks, as a .docx
  paragraph's runs; their formatting stays with them);
* inline strings (``<c t="inlineStr"><is>``) in the worksheets that have them;
* the comments (``xl/comments1.xml``; the "notes" of newer Excel), in runs likewise.

Nothing else is touched: formulas (``<f>``), numbers, booleans, dates, the cached results of
formulas (``<c t="str">``: a formula computes them again), styles, charts, pictures, pivot tables.
Sheet names are not translated: formulas, defined names and charts refer to sheets by name, and a
translated name would break each reference. Not translated either: headers and footers, charts'
titles, text boxes (drawings), data validation messages, threaded comments (their legacy copy in
the comments part is translated).

Why not openpyxl: it reads what it models and writes only that, so a workbook saved by it loses
its charts, pictures and shapes (its documentation says so). Here the package is rewritten with
only the parts whose text changed written again; every other file keeps its bytes
(``app.formats.parts``). A workbook in the Strict OOXML namespaces (rare; Excel writes the
transitional ones) is read as having no text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app.formats.limits import DocumentError, DocumentLimits
from app.formats.package import check_package
from app.formats.parts import Part, open_zip, parse, save
from app.formats.runs import ElementText, RunsDocument

MAIN = "{http://schemas.openxmlformats.org/spreadsheetml/2006/main}"
TYPES = "{http://schemas.openxmlformats.org/package/2006/content-types}"
SPREADSHEETML = "application/vnd.openxmlformats-officedocument.spreadsheetml."
SHARED_STRINGS = SPREADSHEETML + "sharedStrings+xml"
COMMENTS = SPREADSHEETML + "comments+xml"
WORKSHEET = SPREADSHEETML + "worksheet+xml"
# A workbook's main part: .xlsx, a template (.xltx); macro-enabled ones (.xlsm) are Excel's own.
WORKBOOKS = (SPREADSHEETML + "sheet.main", SPREADSHEETML + "template.main", "application/vnd.ms-excel.")
KIND = ".xlsx"
CONTENT_TYPES = "[Content_Types].xml"


def read(kind: str, data: bytes, limits: DocumentLimits) -> RunsDocument:
    check_package(data, limits, KIND)
    with open_zip(data, KIND) as archive:
        names = archive.namelist()
        if CONTENT_TYPES not in names:
            raise DocumentError(f"not a {KIND} document: it has no {CONTENT_TYPES}")
        types = content_types(archive.read(CONTENT_TYPES))
        if not any(t.startswith(WORKBOOKS) for t in types.values()):
            raise DocumentError(f"not a {KIND} document: the package holds no workbook")
        parts = {}  # in package order
        for name in names:
            content_type = types.get(name)
            if content_type not in (SHARED_STRINGS, COMMENTS, WORKSHEET):
                continue
            raw = archive.read(name)
            if content_type == WORKSHEET and b"inlineStr" not in raw:
                continue  # no inline strings: worksheets can be large, and are left unparsed
            parts[name] = Part.read(archive, name, KIND, raw)
    paragraphs = (runs for part in parts.values() for runs in strings(part.tree.getroot()))
    return RunsDocument.make(paragraphs, lambda: save(data, parts), limits)


def content_types(types: bytes) -> dict[str, str]:
    """Each part's content type, by its name in the zip."""
    root = parse(types, CONTENT_TYPES, KIND).getroot()
    return {
        o.get("PartName", "").lstrip("/"): o.get("ContentType", "") for o in root.iter(f"{TYPES}Override")
    }


def strings(root: Any) -> Iterator[list[ElementText]]:
    """Each string of a part as its runs: a shared string ``<si>``, an inline string ``<is>``, a
    comment's ``<text>``. Phonetic runs (``<rPh>``, Japanese readings) are left as they are."""
    for holder in root.iter(f"{MAIN}si", f"{MAIN}is", f"{MAIN}text"):
        runs = []
        for child in holder:  # a plain <t>, or runs <r><rPr/><t>, in document order
            t = (
                child
                if child.tag == f"{MAIN}t"
                else child.find(f"{MAIN}t")
                if child.tag == f"{MAIN}r"
                else None
            )
            if t is not None:
                runs.append(ElementText(t, preserve=True))
        yield runs
