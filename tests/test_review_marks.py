"""Sentences flagged for review (``app.formats.documents.Review``) marked where a reader of the
file looks: a Word comment on each flagged body paragraph of a .docx, and a "Review" sheet listing
the flagged strings of an .xlsx (its translation and the note), added after the other sheets."""

from __future__ import annotations

import io
import zipfile
from typing import Any

import docx
import openpyxl
from lxml import etree

from app.config import Settings
from app.formats.documents import Review, SplitDocument, read

LIMITS = Settings().document_limits()  # the defaults
W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
COMMENTS = "word/comments.xml"


def split(name: str, data: bytes) -> SplitDocument:
    return read(name, data, LIMITS).split("de")


def upper(document: SplitDocument) -> list[str]:
    """The stand-in translation: each sentence upper-cased."""
    return [s.upper() for s in document.sentences]


def review(document: SplitDocument, flagged: dict[str, float]) -> Review:
    """A review flagging the sentences ``flagged`` names, each with its confidence."""
    return Review(0.5, {document.sentences.index(s): c for s, c in flagged.items()})


# --- .docx ------------------------------------------------------------------------------------------


def make_docx() -> bytes:
    document = docx.Document()
    document.add_paragraph("Der Hund bellt. Die Katze schläft.")
    paragraph = document.add_paragraph("Ein ")
    paragraph.add_run("großer").bold = True
    paragraph.add_run(" Baum steht im Garten.")
    document.add_paragraph("Das Wetter ist schön.")
    document.add_paragraph("2024")  # no letters: not a paragraph of the document
    document.add_paragraph("Der letzte Satz steht hier.")
    document.sections[0].header.paragraphs[0].text = "Die Kopfzeile ist kurz."
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def body_paragraphs(out: bytes) -> list[Any]:
    with zipfile.ZipFile(io.BytesIO(out)) as archive:
        root = etree.fromstring(archive.read("word/document.xml"))
    return list(root.find(f"{W}body").iter(f"{W}p"))


def commented(paragraph: Any) -> bool:
    return bool(paragraph.findall(f".//{W}commentRangeStart") or paragraph.findall(f".//{W}commentReference"))


def paragraph_text(paragraph: Any) -> str:
    return "".join(t.text or "" for t in paragraph.iter(f"{W}t"))


def comments(out: bytes) -> list[tuple[str, str, str]]:
    """Each comment of the document: its author, its initials and its text."""
    with zipfile.ZipFile(io.BytesIO(out)) as archive:
        if COMMENTS not in archive.namelist():
            return []
        root = etree.fromstring(archive.read(COMMENTS))
    return [
        (c.get(f"{W}author", ""), c.get(f"{W}initials", ""), "".join(t.text or "" for t in c.iter(f"{W}t")))
        for c in root.iter(f"{W}comment")
    ]


def test_docx_flagged_body_paragraphs_get_a_machine_translation_comment_with_the_note_and_no_other_does() -> (
    None
):
    document = split("a.docx", make_docx())
    marks = review(
        document, {"Die Katze schläft.": 0.3, "Der Hund bellt.": 0.2, "Ein großer Baum steht im Garten.": 0.4}
    )
    out = document.join(upper(document), marks)

    assert comments(out) == [
        ("Machine translation", "MT", marks.note(0.2)),  # the lowest of the paragraph's two sentences
        ("Machine translation", "MT", marks.note(0.4)),
    ]
    marked = {paragraph_text(p): commented(p) for p in body_paragraphs(out) if paragraph_text(p)}
    assert marked == {
        "DER HUND BELLT. DIE KATZE SCHLÄFT.": True,
        "EIN GROSSER BAUM STEHT IM GARTEN.": True,
        "DAS WETTER IST SCHÖN.": False,
        "2024": False,
        "DER LETZTE SATZ STEHT HIER.": False,
    }
    # The comment spans the paragraph's runs, whose formatting stays.
    paragraph = docx.Document(io.BytesIO(out)).paragraphs[1]
    assert [(r.text, r.bold) for r in paragraph.runs if r.text] == [
        ("EIN ", None),
        ("GROSSER", True),
        (" BAUM STEHT IM GARTEN.", None),
    ]


def test_docx_paragraph_after_one_without_letters_gets_the_comment_not_its_neighbour() -> None:
    """The flag's index counts only paragraphs with letters: "2024" is not one of them."""
    document = split("a.docx", make_docx())
    out = document.join(upper(document), review(document, {"Der letzte Satz steht hier.": 0.1}))
    assert [paragraph_text(p) for p in body_paragraphs(out) if commented(p)] == [
        "DER LETZTE SATZ STEHT HIER."
    ]


def test_docx_flagged_header_sentence_gives_no_error_and_no_comment() -> None:
    document = split("a.docx", make_docx())
    out = document.join(upper(document), review(document, {"Die Kopfzeile ist kurz.": 0.1}))
    assert comments(out) == []
    assert not any(commented(p) for p in body_paragraphs(out))
    assert docx.Document(io.BytesIO(out)).sections[0].header.paragraphs[0].text == "DIE KOPFZEILE IST KURZ."
    with zipfile.ZipFile(io.BytesIO(out)) as archive:
        headers = [n for n in archive.namelist() if n.startswith("word/header")]
        assert headers and not any(b"commentRange" in archive.read(n) for n in headers)


def test_docx_join_without_review_or_with_nothing_flagged_adds_no_comment() -> None:
    for marks in (None, Review(0.5, {})):
        document = split("a.docx", make_docx())
        out = document.join(upper(document), marks)
        with zipfile.ZipFile(io.BytesIO(out)) as archive:
            assert COMMENTS not in archive.namelist()
        assert not any(commented(p) for p in body_paragraphs(out))


# --- .xlsx ------------------------------------------------------------------------------------------


def make_xlsx(*extra_sheets: str) -> bytes:
    workbook = openpyxl.Workbook()
    first = workbook.active
    first.title = "Daten"
    first["A1"] = "Der Hund bellt. Die Katze schläft."
    first["A2"] = "Das Wetter ist schön."
    first["B2"] = 42
    second = workbook.create_sheet("Mehr")
    second["A1"] = "Ein Baum steht im Garten."
    second["A2"] = "Der letzte Satz steht hier."
    for title in extra_sheets:
        workbook.create_sheet(title)["A1"] = f"Blatt {title} hat Text."
    out = io.BytesIO()
    workbook.save(out)
    return out.getvalue()


def sheet_rows(workbook: Any, title: str) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in workbook[title].iter_rows(values_only=True)]


def test_xlsx_review_sheet_is_added_last_with_a_header_and_each_flagged_translation_and_its_note() -> None:
    source = make_xlsx()
    document = split("a.xlsx", source)
    marks = review(
        document, {"Die Katze schläft.": 0.3, "Der Hund bellt.": 0.2, "Der letzte Satz steht hier.": 0.1}
    )
    out = document.join(upper(document), marks)

    workbook = openpyxl.load_workbook(io.BytesIO(out))
    assert workbook.sheetnames == ["Daten", "Mehr", "Review"]
    assert sheet_rows(workbook, "Review") == [
        ("Translation", "Note"),
        ("DER HUND BELLT. DIE KATZE SCHLÄFT.", marks.note(0.2)),
        ("DER LETZTE SATZ STEHT HIER.", marks.note(0.1)),
    ]
    # The sheets that were there are as they were, their text translated.
    assert sheet_rows(workbook, "Daten") == [
        ("DER HUND BELLT. DIE KATZE SCHLÄFT.", None),
        ("DAS WETTER IST SCHÖN.", 42),
    ]
    assert sheet_rows(workbook, "Mehr") == [("EIN BAUM STEHT IM GARTEN.",), ("DER LETZTE SATZ STEHT HIER.",)]
    # Beside the translation, the review adds the sheet and changes only the parts that name it.
    plain = split("a.xlsx", source)
    translated = plain.join(upper(plain))
    with zipfile.ZipFile(io.BytesIO(translated)) as before, zipfile.ZipFile(io.BytesIO(out)) as after:
        changed = {n for n in before.namelist() if after.read(n) != before.read(n)}
        assert changed == {"[Content_Types].xml", "xl/workbook.xml", "xl/_rels/workbook.xml.rels"}
        added = set(after.namelist()) - set(before.namelist())
        assert len(added) == 1 and added.pop().startswith("xl/worksheets/sheet")


def test_xlsx_join_without_review_or_with_nothing_flagged_leaves_the_sheets_and_files_as_they_were() -> None:
    source = make_xlsx()
    for marks in (None, Review(0.5, {})):
        document = split("a.xlsx", source)
        out = document.join(upper(document), marks)
        assert openpyxl.load_workbook(io.BytesIO(out)).sheetnames == ["Daten", "Mehr"]
        with zipfile.ZipFile(io.BytesIO(source)) as before, zipfile.ZipFile(io.BytesIO(out)) as after:
            assert after.namelist() == before.namelist()


def test_xlsx_workbook_with_a_review_sheet_already_gets_review_2() -> None:
    document = split("a.xlsx", make_xlsx("Review"))
    marks = review(document, {"Das Wetter ist schön.": 0.25})
    out = document.join(upper(document), marks)
    workbook = openpyxl.load_workbook(io.BytesIO(out))
    assert workbook.sheetnames == ["Daten", "Mehr", "Review", "Review (2)"]
    assert sheet_rows(workbook, "Review") == [("BLATT REVIEW HAT TEXT.",)]
    assert sheet_rows(workbook, "Review (2)") == [
        ("Translation", "Note"),
        ("DAS WETTER IST SCHÖN.", marks.note(0.25)),
    ]


def test_xlsx_second_join_without_review_adds_no_review_sheet() -> None:
    """The flagged strings of a join are listed by that join only."""
    document = split("a.xlsx", make_xlsx())
    document.join(upper(document), review(document, {"Das Wetter ist schön.": 0.25}))
    out = document.join(upper(document))
    assert openpyxl.load_workbook(io.BytesIO(out)).sheetnames == ["Daten", "Mehr"]
