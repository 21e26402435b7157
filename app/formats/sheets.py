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

The strings holding a sentence flagged for review (``app.formats.documents.Review``) are listed in
a sheet added after the others, "Review" (or "Review (2)", ... if the name is taken): a row for
each, its translation and the note.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import count
from typing import Any

from lxml import etree

from app.formats.documents import NOT_XML
from app.formats.limits import DocumentError, DocumentLimits
from app.formats.package import check_package
from app.formats.parts import XML_NS, Part, open_zip, parse, save, serialize
from app.formats.runs import ElementText, Run, RunsDocument

MAIN_NS = "http://schemas.openxmlformats.org/spreadsheetml/2006/main"
MAIN = f"{{{MAIN_NS}}}"
TYPES = "{http://schemas.openxmlformats.org/package/2006/content-types}"
RELATIONSHIPS = "{http://schemas.openxmlformats.org/package/2006/relationships}"
OFFICE_RELATIONSHIPS = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"
WORKSHEET_RELATIONSHIP = OFFICE_RELATIONSHIPS + "/worksheet"
SPREADSHEETML = "application/vnd.openxmlformats-officedocument.spreadsheetml."
SHARED_STRINGS = SPREADSHEETML + "sharedStrings+xml"
COMMENTS = SPREADSHEETML + "comments+xml"
WORKSHEET = SPREADSHEETML + "worksheet+xml"
# A workbook's main part: .xlsx, a template (.xltx); macro-enabled ones (.xlsm) are Excel's own.
WORKBOOKS = (SPREADSHEETML + "sheet.main", SPREADSHEETML + "template.main", "application/vnd.ms-excel.")
KIND = ".xlsx"
CONTENT_TYPES = "[Content_Types].xml"
REVIEW_SHEET = "Review"
REVIEW_HEADER = ("Translation", "Note")
REVIEW_WIDTHS = (80, 60)  # of the Review sheet's columns, in characters
CELL_CHARS = 32767  # the most a cell holds
DECLARATION = b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'  # as Excel writes it


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
    workbook = next(
        (n for n, t in types.items() if t.startswith(WORKBOOKS) and t.endswith(".main+xml")), None
    )
    paragraphs = (runs for part in parts.values() for runs in strings(part.tree.getroot()))
    kept: list[tuple[Run, ...]] = []  # the made document's paragraphs: ``flag`` counts among them
    flagged: list[tuple[str, str]] = []  # (translation, note), for the Review sheet

    def flag(index: int, note: str) -> None:
        flagged.append(("".join(run.text for run in kept[index]), note))

    def write() -> bytes:
        rows = flagged[:]
        flagged.clear()
        files = review_files(data, workbook, rows) if rows and workbook is not None else None
        return save(data, parts, files)

    made = RunsDocument.make(paragraphs, write, limits, flag)
    kept += made.paragraphs
    return made


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


def review_files(data: bytes, workbook: str, rows: Sequence[tuple[str, str]]) -> dict[str, bytes]:
    """The files that add to the package a last sheet listing ``rows`` (translation, note): the
    sheet, and the workbook, its relationships and the content types that name it. Nothing if
    the package is not as expected (no relationships for the workbook; the Strict namespaces)."""
    folder, _, base = workbook.rpartition("/")
    prefix = f"{folder}/" if folder else ""
    relationships = f"{prefix}_rels/{base}.rels"
    with open_zip(data, KIND) as archive:
        names = archive.namelist()
        if workbook not in names or relationships not in names:
            return {}
        raw = {name: archive.read(name) for name in (CONTENT_TYPES, workbook, relationships)}
    trees = {name: parse(content, name, KIND) for name, content in raw.items()}
    book, rels, types = (trees[n].getroot() for n in (workbook, relationships, CONTENT_TYPES))
    sheets = book.find(f"{MAIN}sheets")
    if sheets is None:
        return {}
    taken = {sheet.get("name", "").casefold() for sheet in sheets.iter(f"{MAIN}sheet")}
    name = next(n for n in review_names() if n.casefold() not in taken)
    used = {n.lower() for n in names} | {
        o.get("PartName", "").lstrip("/").lower() for o in types.iter(f"{TYPES}Override")
    }
    number = next(n for n in count(1) if f"{prefix}worksheets/sheet{n}.xml".lower() not in used)
    target = f"worksheets/sheet{number}.xml"  # from the workbook's folder
    ids = {r.get("Id") for r in rels.iter(f"{RELATIONSHIPS}Relationship")}
    rid = next(f"rId{n}" for n in count(len(ids) + 1) if f"rId{n}" not in ids)
    sheet_ids = [int(i) for s in sheets.iter(f"{MAIN}sheet") if (i := s.get("sheetId", "")).isdigit()]
    etree.SubElement(rels, f"{RELATIONSHIPS}Relationship", Id=rid, Type=WORKSHEET_RELATIONSHIP, Target=target)
    etree.SubElement(types, f"{TYPES}Override", PartName=f"/{prefix}{target}", ContentType=WORKSHEET)
    etree.SubElement(
        sheets,
        f"{MAIN}sheet",
        {"name": name, "sheetId": str(max(sheet_ids, default=0) + 1), f"{{{OFFICE_RELATIONSHIPS}}}id": rid},
    )
    return {
        **{n: serialize(tree, raw[n]) for n, tree in trees.items()},
        prefix + target: review_sheet(rows),
    }


def review_names() -> Iterator[str]:
    yield REVIEW_SHEET
    for n in count(2):
        yield f"{REVIEW_SHEET} ({n})"


def review_sheet(rows: Sequence[tuple[str, str]]) -> bytes:
    """A worksheet of a header row and ``rows``, each cell an inline string."""
    worksheet = etree.Element(f"{MAIN}worksheet", nsmap={None: MAIN_NS})
    cols = etree.SubElement(worksheet, f"{MAIN}cols")
    for index, width in enumerate(REVIEW_WIDTHS, 1):
        etree.SubElement(
            cols, f"{MAIN}col", min=str(index), max=str(index), width=str(width), customWidth="1"
        )
    sheet_data = etree.SubElement(worksheet, f"{MAIN}sheetData")
    for number, texts in enumerate([REVIEW_HEADER, *rows], 1):
        row = etree.SubElement(sheet_data, f"{MAIN}row", r=str(number))
        for column, text in zip("AB", texts, strict=True):
            cell = etree.SubElement(row, f"{MAIN}c", r=f"{column}{number}", t="inlineStr")
            t = etree.SubElement(etree.SubElement(cell, f"{MAIN}is"), f"{MAIN}t")
            t.text = NOT_XML.sub("", text)[:CELL_CHARS]
            if t.text != t.text.strip():
                t.set(f"{{{XML_NS}}}space", "preserve")
    return DECLARATION + etree.tostring(worksheet, encoding="UTF-8", xml_declaration=False)
