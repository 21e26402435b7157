""".pptx, .xlsx and OpenDocument files through ``app.formats.documents.read`` with a stand-in
translator that upper-cases (its output is known): structure kept, text translated where it was,
what is not text left alone; and each hostile package refused before a tree is built of it."""

from __future__ import annotations

import importlib
import io
import re
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import openpyxl
import pptx
import pytest
from lxml import etree

from app.config import Settings
from app.formats import parts, sheets
from app.formats.documents import BY_EXTENSION, extension, read
from app.formats.limits import DocumentError, Forbidden, TooLarge
from app.formats.parts import parse
from tests.documents.office import SAMPLES, check_structure, make_ods, make_odt, make_pptx, make_xlsx

LIMITS = Settings().document_limits()  # the defaults
TEXT = "{urn:oasis:names:tc:opendocument:xmlns:text:1.0}"


def translate(name: str, data: bytes) -> tuple[tuple[str, ...], bytes]:
    split = read(name, data, LIMITS).split("de")
    return split.sentences, split.join([s.upper() for s in split.sentences])


@pytest.fixture(scope="module")
def samples() -> dict[str, bytes]:
    return {name: make() for name, make in SAMPLES.items()}


@pytest.mark.parametrize("name", SAMPLES)
def test_each_sample_keeps_its_structure_and_its_text_comes_back_translated_in_place(
    name: str, samples: dict[str, bytes]
) -> None:
    sentences, out = translate(name, samples[name])
    assert sentences and all(re.search("[a-zäöü]", s) for s in sentences)
    check_structure(name, samples[name], out)
    # Read again, the translation has the same paragraphs, each upper-cased where it was.
    assert read(name, out, LIMITS).text == read(name, samples[name], LIMITS).text.upper()


@pytest.mark.parametrize("name", [name for name in SAMPLES if not name.endswith(".pptx")])
def test_a_package_translated_into_itself_comes_back_with_every_file_as_it_was(
    name: str, samples: dict[str, bytes]
) -> None:
    """Only the parts whose text changed are written again; the rest keep their bytes."""
    split = read(name, samples[name], LIMITS).split("de")
    before, after = (zipfile.ZipFile(io.BytesIO(d)) for d in (samples[name], split.join(split.sentences)))
    assert [(i.filename, i.compress_type) for i in after.infolist()] == [
        (i.filename, i.compress_type) for i in before.infolist()
    ]
    assert all(after.read(n) == before.read(n) for n in before.namelist())


# --- .pptx ------------------------------------------------------------------------------------------


def test_pptx_runs_keep_their_formatting_and_notes_groups_and_tables_are_translated() -> None:
    sentences, out = translate("a.pptx", make_pptx())
    assert "Ein großer Hund bellt." in sentences and "Langsam sprechen." in sentences
    first, second = pptx.Presentation(io.BytesIO(out)).slides
    body = first.placeholders[1].text_frame.paragraphs
    assert [(r.text, r.font.bold) for r in body[1].runs] == [
        ("EIN ", False),
        ("GROSSER", True),
        (" HUND BELLT.", False),
    ]
    assert first.notes_slide.notes_text_frame.text == "LANGSAM SPRECHEN."
    group = next(s for s in second.shapes if s.shape_type == pptx.enum.shapes.MSO_SHAPE_TYPE.GROUP)
    assert group.shapes[0].text_frame.text == "IM GRUPPENFELD STEHT EIN SATZ."
    table = next(s for s in second.shapes if s.has_table).table
    assert [c.text for c in table.iter_cells()] == ["NAME", "WERT", "DER HUND", "42"]


def test_pptx_line_breaks_cut_a_paragraph_into_pieces_translated_apart() -> None:
    presentation = pptx.Presentation()
    slide = presentation.slides.add_slide(presentation.slide_layouts[5])
    slide.shapes.title.text_frame.paragraphs[0].text = "Erste Zeile\vzweite Zeile"  # \v: <a:br/>
    data = io.BytesIO()
    presentation.save(data)
    sentences, out = translate("a.pptx", data.getvalue())
    assert sentences == ("Erste Zeile", "zweite Zeile")
    title = pptx.Presentation(io.BytesIO(out)).slides[0].shapes.title
    assert title.text_frame.text == "ERSTE ZEILE\vZWEITE ZEILE"


# --- .xlsx ------------------------------------------------------------------------------------------


def test_xlsx_cells_rich_text_and_comments_are_translated_formulas_numbers_and_sheet_names_not() -> None:
    sentences, out = translate("a.xlsx", make_xlsx())
    assert "2024" not in sentences  # a string without letters
    workbook = openpyxl.load_workbook(io.BytesIO(out), rich_text=True)
    assert workbook.sheetnames == ["Preise", "Daten"]
    prices, data = workbook["Preise"], workbook["Daten"]
    assert [prices["A1"].value, prices["B1"].value, prices["C1"].value] == ["EIN HUND LÄUFT.", 3.5, "=B1*2"]
    assert prices["A1"].comment.text == "BITTE PRÜFEN."
    rich = prices["A2"].value
    assert [str(part) for part in rich] == ["EIN ", "GROSSER", " HUND BELLT."]
    assert rich[1].font.b and prices["A3"].value == "2024"
    assert [data["A1"].value, data["A2"].value, data["A3"].value] == [
        "=Preise!B1+1",
        True,
        "DIE KATZE SCHLÄFT.",
    ]


def test_xlsx_shared_strings_are_translated_and_every_other_part_keeps_its_bytes(
    samples: dict[str, bytes],
) -> None:
    """XlsxWriter's workbook (as Excel writes one): shared strings and a chart, which openpyxl
    would have dropped."""
    original = samples["chart.xlsx"]
    _, out = translate("chart.xlsx", original)
    before, after = zipfile.ZipFile(io.BytesIO(original)), zipfile.ZipFile(io.BytesIO(out))
    changed = [n for n in before.namelist() if before.read(n) != after.read(n)]
    assert changed == ["xl/comments1.xml", "xl/sharedStrings.xml"]
    strings = after.read("xl/sharedStrings.xml").decode()
    assert "EIN HUND LÄUFT. DIE KATZE SCHLÄFT." in strings
    assert '<t xml:space="preserve">EIN </t>' in strings  # a run's outer space kept
    assert after.read("xl/charts/chart1.xml") == before.read("xl/charts/chart1.xml")
    sheet = openpyxl.load_workbook(io.BytesIO(out), data_only=True)["Umsatz"]
    assert sheet["C1"].value == 10.5  # the formula's cached result


# --- OpenDocument -------------------------------------------------------------------------------------


def paragraphs(data: bytes, name: str = "content.xml") -> list[Any]:
    root = etree.fromstring(zipfile.ZipFile(io.BytesIO(data)).read(name))
    return list(root.iter(f"{TEXT}p", f"{TEXT}h"))


def test_odt_spans_links_notes_and_headers_are_translated_in_place() -> None:
    sentences, out = translate("a.odt", make_odt())
    assert sentences == (
        "Ein Bericht",
        "Ein großer Hund läuft.",
        "Die Katze schläft.",
        "Mehr auf der Seite lesen.",
        "Eine Fußnote.",
        "Erste Zeile",
        "zweite Zeile mit Platz.",
        "Kopfzeile des Berichts",
        "Vertraulich",
    )
    body = paragraphs(out)
    assert body[1][0].text == "GROSSER" and body[1].text == "EIN " and body[1][0].tail.startswith(" HUND")
    link, note = body[2]
    assert (body[2].text, link.text, link.tail) == ("MEHR AUF ", "DER SEITE", " LESEN.")
    assert note.findtext(f"{TEXT}note-citation") == "1"  # a citation is not text to translate
    assert "".join(body[3].itertext()) == "EINE FUSSNOTE."
    line_break, spaces = body[4]
    assert (body[4].text, line_break.tail, spaces.tail) == ("ERSTE ZEILE", "ZWEITE ZEILE", "MIT PLATZ.")
    assert body[5].text == "12345"
    assert [p.text for p in paragraphs(out, "styles.xml")] == ["KOPFZEILE DES BERICHTS", "VERTRAULICH"]
    first = zipfile.ZipFile(io.BytesIO(out)).infolist()[0]
    assert (first.filename, first.compress_type) == ("mimetype", zipfile.ZIP_STORED)


def test_ods_translates_string_cells_only() -> None:
    sentences, out = translate("a.ods", make_ods())
    assert sentences == ("Ein Hund läuft.",)  # not "1. Mai 2024": a date cell's display
    assert [p.text for p in paragraphs(out)] == ["EIN HUND LÄUFT.", "3,5", "7", "1. Mai 2024"]
    assert b'table:formula="of:=[.B1]*2"' in zipfile.ZipFile(io.BytesIO(out)).read("content.xml")


# --- hostile packages -------------------------------------------------------------------------------

# Each kind's sample, and the part of it that holds the text.
KINDS = {"a.pptx": (make_pptx, "ppt/slides/slide1.xml"), "a.xlsx": (make_xlsx, "xl/worksheets/sheet1.xml")}
KINDS["a.odt"] = (make_odt, "content.xml")


def with_part(data: bytes, name: str, content: bytes) -> bytes:
    """The package with the file ``name`` replaced."""
    source, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info, content if info.filename == name else source.read(info))
    return out.getvalue()


def with_doctype(xml: bytes, doctype: bytes) -> bytes:
    """``doctype`` after the XML declaration, if there is one."""
    if xml.startswith(b"<?xml"):
        declaration, rest = xml.split(b"?>", 1)
        return declaration + b"?>" + doctype + rest
    return doctype + xml


LAUGHS = (
    b'<!DOCTYPE r [<!ENTITY lol0 "lol">'
    + b"".join(b'<!ENTITY lol%d "%s">' % (i, b"&lol%d;" % (i - 1) * 10) for i in range(1, 10))
    + b"]>"
)
XXE = b'<!DOCTYPE r [<!ENTITY secret SYSTEM "file:///etc/passwd">]>'


def hostile(name: str) -> Iterator[tuple[str, bytes, type[DocumentError], str]]:
    make, part = KINDS[name]
    data = make()
    xml = zipfile.ZipFile(io.BytesIO(data)).read(part)
    yield "zip bomb", with_part(data, part, xml + b" " * 20_000_000), TooLarge, "inflates to more than"
    yield "entity expansion", with_part(data, part, with_doctype(xml, LAUGHS)), Forbidden, "DTD"
    yield "external entity", with_part(data, part, with_doctype(xml, XXE)), Forbidden, "DTD"
    yield "malformed part", with_part(data, part, xml[: len(xml) // 2]), DocumentError, "cannot read"
    yield "truncated package", data[: len(data) // 2], DocumentError, f"not a {name[1:]} document"
    yield "not a zip", b"PK not really", DocumentError, f"not a {name[1:]} document"


CASES = [(name, case) for name in KINDS for case in hostile(name)]


@pytest.fixture
def no_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """python-pptx and lxml build whole trees: a hostile package must be refused before."""

    def refuse(*args: Any) -> None:
        raise AssertionError("a tree was asked for of a hostile package")

    monkeypatch.setattr(pptx, "Presentation", refuse)
    monkeypatch.setattr(parts, "parse", refuse)  # every part
    monkeypatch.setattr(sheets, "parse", refuse)  # [Content_Types].xml


@pytest.mark.parametrize(("name", "case"), CASES, ids=[f"{n}-{c[0]}" for n, c in CASES])
def test_each_hostile_package_is_refused_with_its_kind_of_error_before_a_tree_is_built(
    name: str, case: tuple[str, bytes, type[DocumentError], str], no_tree: None
) -> None:
    _, data, error, words = case
    with pytest.raises(DocumentError, match=words) as raised:
        read(name, data, LIMITS)
    assert type(raised.value) is error


@pytest.fixture(scope="module")
def packages() -> dict[str, bytes]:
    """Each kind's sample, made before ``no_tree`` takes python-pptx away."""
    return {name: make() for name, (make, _) in KINDS.items()}


@pytest.mark.parametrize("name", KINDS)
def test_elements_and_text_are_counted_as_the_package_streams(
    name: str, packages: dict[str, bytes], no_tree: None
) -> None:
    data = packages[name]
    with pytest.raises(TooLarge, match="XML elements"):
        read(name, data, replace(LIMITS, max_elements=10))
    with pytest.raises(TooLarge, match="too much text"):
        read(name, data, replace(LIMITS, max_chars=10))


@pytest.mark.parametrize("name", KINDS)
def test_paragraphs_are_counted_as_they_are_read_not_only_by_the_package_check(
    name: str, packages: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = extension(name)
    module = importlib.import_module(BY_EXTENSION[kind].module)
    monkeypatch.setattr(module, "check_package", lambda *args: None)
    text = module.read(kind, packages[name], LIMITS).text
    with pytest.raises(TooLarge, match="too much text"):
        module.read(kind, packages[name], replace(LIMITS, max_chars=len(text) // 2))


@pytest.mark.parametrize("name", KINDS)
def test_another_kind_of_package_is_unreadable(name: str, packages: dict[str, bytes]) -> None:
    other = packages["a.xlsx" if name == "a.odt" else "a.odt"]
    with pytest.raises(DocumentError, match=f"the {name[1:]} document|not a {name[1:]} document") as raised:
        read(name, other, LIMITS)
    assert type(raised.value) is DocumentError


def test_a_part_with_a_doctype_is_refused_by_the_parser_too() -> None:
    with pytest.raises(Forbidden, match="DTD"):
        parse(b'<!DOCTYPE r [<!ENTITY a "b">]><r>&a;</r>', "content.xml", ".odt")


def test_odt_text_deleted_by_a_tracked_change_is_left_as_it_is() -> None:
    data = make_odt()
    content = zipfile.ZipFile(io.BytesIO(data)).read("content.xml")
    region = (
        b'<text:tracked-changes><text:changed-region text:id="c1"><text:deletion>'
        b"<text:p>Ein gel\xc3\xb6schter Satz.</text:p>"
        b"</text:deletion></text:changed-region></text:tracked-changes>"
    )
    data = with_part(data, "content.xml", content.replace(b"<office:text>", b"<office:text>" + region))
    sentences, out = translate("a.odt", data)
    assert "Ein gelöschter Satz." not in sentences and "Ein Bericht" in sentences
    assert "Ein gelöschter Satz." in zipfile.ZipFile(io.BytesIO(out)).read("content.xml").decode()
