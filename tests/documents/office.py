"""Office documents (.pptx, .xlsx, .odt, .odp, .ods), generated with python-pptx, openpyxl,
XlsxWriter and odfpy, and a check that a translated copy kept each one's structure: the same
slides, shapes and runs; the same formulas, numbers, dates and sheet names; the same elements and
attributes of an OpenDocument's content, with ``mimetype`` first and stored."""

from __future__ import annotations

import datetime
import io
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import openpyxl
import pptx
import xlsxwriter
from lxml import etree
from openpyxl.cell.rich_text import CellRichText, TextBlock
from openpyxl.cell.text import InlineFont
from openpyxl.comments import Comment
from pptx.enum.shapes import MSO_SHAPE_TYPE
from pptx.util import Inches

# --- .pptx ---------------------------------------------------------------------------------------


def make_pptx() -> bytes:
    """Two slides: a title and a body with a bold run, notes; a group holding a text box, a table."""
    presentation = pptx.Presentation()
    slide = presentation.slides.add_slide(presentation.slide_layouts[1])
    slide.shapes.title.text = "Ein Hund läuft."
    body = slide.placeholders[1].text_frame
    body.text = "Die Katze schläft."
    paragraph = body.add_paragraph()
    for text, bold in (("Ein ", False), ("großer", True), (" Hund bellt.", False)):
        run = paragraph.add_run()
        run.text, run.font.bold = text, bold
    slide.notes_slide.notes_text_frame.text = "Langsam sprechen."
    slide = presentation.slides.add_slide(presentation.slide_layouts[5])
    slide.shapes.title.text = "Zahlen und Namen"
    group = slide.shapes.add_group_shape()
    box = group.shapes.add_textbox(Inches(1), Inches(2), Inches(3), Inches(1))
    box.text_frame.text = "Im Gruppenfeld steht ein Satz."
    table = slide.shapes.add_table(2, 2, Inches(1), Inches(3), Inches(4), Inches(1)).table
    for (row, column), text in {(0, 0): "Name", (0, 1): "Wert", (1, 0): "Der Hund", (1, 1): "42"}.items():
        table.cell(row, column).text = text
    out = io.BytesIO()
    presentation.save(out)
    return out.getvalue()


def shapes_outline(shapes: Any) -> list[Any]:
    """Each shape's type and name, its paragraphs' run counts, groups and tables within."""
    outline: list[Any] = []
    for shape in shapes:
        entry: list[Any] = [shape.shape_type, shape.name]
        if shape.shape_type == MSO_SHAPE_TYPE.GROUP:
            entry.append(shapes_outline(shape.shapes))
        if shape.has_text_frame:
            entry.append([len(p.runs) for p in shape.text_frame.paragraphs])
        if getattr(shape, "has_table", False) and shape.has_table:
            entry.append([[len(p.runs) for p in c.text_frame.paragraphs] for c in shape.table.iter_cells()])
        outline.append(entry)
    return outline


def pptx_outline(data: bytes) -> list[Any]:
    presentation = pptx.Presentation(io.BytesIO(data))
    return [
        (
            slide.slide_layout.name,
            shapes_outline(slide.shapes),
            slide.has_notes_slide and bool(slide.notes_slide.notes_text_frame.text.strip()),
        )
        for slide in presentation.slides
    ]


# --- .xlsx ---------------------------------------------------------------------------------------


def make_xlsx() -> bytes:
    """openpyxl: two sheets, formulas (one across sheets), numbers, a date, a boolean, rich text
    and a comment (openpyxl writes strings inline)."""
    workbook = openpyxl.Workbook()
    sheet = workbook.active
    sheet.title = "Preise"
    sheet["A1"], sheet["B1"], sheet["C1"] = "Ein Hund läuft.", 3.5, "=B1*2"
    sheet["D1"] = datetime.date(2024, 5, 1)
    sheet["A2"] = CellRichText(["Ein ", TextBlock(InlineFont(b=True), "großer"), " Hund bellt."])
    sheet["A1"].comment = Comment("Bitte prüfen.", "Anna")
    sheet["A3"], sheet["B3"] = "2024", 7
    other = workbook.create_sheet("Daten")
    other["A1"], other["A2"], other["A3"] = "=Preise!B1+1", True, "Die Katze schläft."
    out = io.BytesIO()
    workbook.save(out)
    return out.getvalue()


def make_xlsx_with_chart() -> bytes:
    """XlsxWriter (as Excel writes them): shared strings, a rich string, a comment, a formula with
    its cached result, and a chart whose part must come back unchanged."""
    out = io.BytesIO()
    workbook = xlsxwriter.Workbook(out, {"in_memory": True})
    bold = workbook.add_format({"bold": True})
    dates = workbook.add_format({"num_format": "yyyy-mm-dd"})
    sheet = workbook.add_worksheet("Umsatz")
    sheet.write("A1", "Ein Hund läuft. Die Katze schläft.")
    sheet.write_rich_string("A2", "Ein ", bold, "großer", " Hund.")
    sheet.write("B1", 3.5)
    sheet.write("B2", 7)
    sheet.write_formula("C1", "=SUM(B1:B2)", None, 10.5)
    sheet.write_datetime("D1", datetime.datetime(2024, 5, 1), dates)
    sheet.write_comment("A1", "Bitte prüfen.")
    chart = workbook.add_chart({"type": "column"})
    chart.add_series({"values": "=Umsatz!$B$1:$B$2", "name": "Werte"})
    chart.set_title({"name": "Umsatz im Jahr"})
    sheet.insert_chart("E2", chart)
    workbook.add_worksheet("Mehr").write("A1", "Ein Hund läuft.")
    workbook.close()
    return out.getvalue()


def xlsx_cells(data: bytes, data_only: bool) -> dict[tuple[str, str], Any]:
    """Every cell that is not text (formulas, numbers, dates, booleans), by sheet and coordinate;
    text cells as ``str`` (their text is translated)."""
    workbook = openpyxl.load_workbook(io.BytesIO(data), data_only=data_only)
    return {
        (sheet.title, cell.coordinate): str if cell.data_type == "s" else cell.value
        for sheet in workbook
        for row in sheet.iter_rows()
        for cell in row
    }


# --- OpenDocument --------------------------------------------------------------------------------


def make_odt() -> bytes:
    """A heading, a paragraph with a bold span, one with a link and a footnote, one with a line
    break and spaces, a number, and a header and a footer."""
    from odf.opendocument import OpenDocumentText
    from odf.style import Footer, Header, MasterPage, PageLayout, Style, TextProperties
    from odf.text import A, H, LineBreak, Note, NoteBody, NoteCitation, P, S, Span

    document = OpenDocumentText()
    bold = Style(name="Fett", family="text")
    bold.addElement(TextProperties(fontweight="bold"))
    document.automaticstyles.addElement(bold)
    layout = PageLayout(name="pm1")
    document.automaticstyles.addElement(layout)
    master = MasterPage(name="Standard", pagelayoutname=layout)
    for holder, text in ((Header(), "Kopfzeile des Berichts"), (Footer(), "Vertraulich")):
        holder.addElement(P(text=text))
        master.addElement(holder)
    document.masterstyles.addElement(master)
    document.text.addElement(H(outlinelevel=1, text="Ein Bericht"))
    paragraph = P(text="Ein ")
    paragraph.addElement(Span(stylename=bold, text="großer"))
    paragraph.addText(" Hund läuft. Die Katze schläft.")
    document.text.addElement(paragraph)
    paragraph = P(text="Mehr auf ")
    paragraph.addElement(A(href="https://example.org/", text="der Seite"))
    paragraph.addText(" lesen.")
    note = Note(id="ftn1", noteclass="footnote")
    note.addElement(NoteCitation(text="1"))
    body = NoteBody()
    body.addElement(P(text="Eine Fußnote."))
    note.addElement(body)
    paragraph.addElement(note)
    document.text.addElement(paragraph)
    paragraph = P(text="Erste Zeile")
    paragraph.addElement(LineBreak())
    paragraph.addText("zweite Zeile")
    paragraph.addElement(S(c=2))
    paragraph.addText("mit Platz.")
    document.text.addElement(paragraph)
    document.text.addElement(P(text="12345"))
    return odf_bytes(document)


def make_odp() -> bytes:
    """A slide with a titled text box, and its notes."""
    from odf.draw import Frame, Page, TextBox
    from odf.opendocument import OpenDocumentPresentation
    from odf.presentation import Notes
    from odf.style import MasterPage, PageLayout
    from odf.text import P

    document = OpenDocumentPresentation()
    layout = PageLayout(name="pl1")
    document.automaticstyles.addElement(layout)
    master = MasterPage(name="Standard", pagelayoutname=layout)
    document.masterstyles.addElement(master)
    page = Page(name="Folie1", masterpagename=master)
    for text in ("Ein Hund läuft.", "Die Katze schläft."):
        frame = Frame(width="20cm", height="3cm", x="1cm", y="1cm")
        box = TextBox()
        box.addElement(P(text=text))
        frame.addElement(box)
        page.addElement(frame)
    notes = Notes()
    frame = Frame(width="20cm", height="3cm", x="1cm", y="1cm")
    box = TextBox()
    box.addElement(P(text="Langsam sprechen."))
    frame.addElement(box)
    notes.addElement(frame)
    page.addElement(notes)
    document.presentation.addElement(page)
    return odf_bytes(document)


def make_ods() -> bytes:
    """A sheet with a text cell, a number, a formula and a date (each shown as a paragraph)."""
    from odf.opendocument import OpenDocumentSpreadsheet
    from odf.table import Table, TableCell, TableRow
    from odf.text import P

    document = OpenDocumentSpreadsheet()
    table = Table(name="Preise")
    row = TableRow()
    cells = [
        TableCell(valuetype="string"),
        TableCell(valuetype="float", value="3.5"),
        TableCell(valuetype="float", value="7", formula="of:=[.B1]*2"),
        TableCell(valuetype="date", datevalue="2024-05-01"),
    ]
    for cell, shown in zip(cells, ("Ein Hund läuft.", "3,5", "7", "1. Mai 2024"), strict=True):
        cell.addElement(P(text=shown))
        row.addElement(cell)
    table.addElement(row)
    document.spreadsheet.addElement(table)
    return odf_bytes(document)


def odf_bytes(document: Any) -> bytes:
    out = io.BytesIO()
    document.write(out)
    return out.getvalue()


def odf_outline(data: bytes, name: str) -> Iterator[tuple[str, dict[str, str]]]:
    """Every element of one part, with its attributes, in document order (text left out)."""
    root = etree.fromstring(zipfile.ZipFile(io.BytesIO(data)).read(name))
    for element in root.iter():
        yield element.tag, dict(element.attrib)


# --- the samples and their check -----------------------------------------------------------------

SAMPLES: dict[str, Callable[[], bytes]] = {
    "slides.pptx": make_pptx,
    "workbook.xlsx": make_xlsx,
    "chart.xlsx": make_xlsx_with_chart,
    "report.odt": make_odt,
    "slides.odp": make_odp,
    "prices.ods": make_ods,
}
CHANGED_PARTS = ("content.xml", "styles.xml", "xl/sharedStrings.xml")


def entries(data: bytes) -> list[tuple[str, int]]:
    return [(info.filename, info.compress_type) for info in zipfile.ZipFile(io.BytesIO(data)).infolist()]


def check_structure(filename: str, original: bytes, translated: bytes) -> None:
    kind = filename.rsplit(".", 1)[-1]
    if kind == "pptx":
        assert pptx_outline(translated) == pptx_outline(original)
        return
    # Packages edited in place: the same files in the same order, each compressed as it was.
    assert entries(translated) == entries(original)
    before, after = zipfile.ZipFile(io.BytesIO(original)), zipfile.ZipFile(io.BytesIO(translated))
    if kind == "xlsx":
        assert xlsx_cells(translated, data_only=False) == xlsx_cells(original, data_only=False)
        assert xlsx_cells(translated, data_only=True) == xlsx_cells(original, data_only=True)
        for name in before.namelist():  # charts, drawings, styles, the workbook: the same bytes
            if "sharedStrings" not in name and "comments" not in name and "worksheets/sheet" not in name:
                assert after.read(name) == before.read(name), name
        return
    first = after.infolist()[0]
    assert first.filename == "mimetype" and first.compress_type == zipfile.ZIP_STORED
    assert after.read("mimetype") == before.read("mimetype")
    for name in before.namelist():
        if name in CHANGED_PARTS:
            assert list(odf_outline(translated, name)) == list(odf_outline(original, name)), name
        else:
            assert after.read(name) == before.read(name), name
