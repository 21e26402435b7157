"""PDF files (app.formats.pdf) through the stand-in translator that upper-cases each sentence: the
pages, their sizes, images and drawings kept, each text block's translation where the block was,
in a font like its own, and the files refused that should be (not a PDF, broken, encrypted, too
many pages or characters, no text at all)."""

from __future__ import annotations

import dataclasses
import io
import os
import random
import zlib
from collections.abc import Callable

import pytest
from pdfminer.high_level import extract_text
from pdfminer.layout import LTChar, LTTextBox
from pypdf import PdfReader, PdfWriter
from pypdf.generic import DictionaryObject, NameObject, StreamObject
from reportlab.lib.pagesizes import A4
from reportlab.pdfgen.canvas import Canvas

from app.config import Settings
from app.formats import pdf_draw
from app.formats.documents import MEDIA_TYPES, read
from app.formats.limits import DocumentError, TooLarge
from app.formats.pdf import PdfDocument
from app.formats.pdf_blocks import join_lines
from tests.documents.pdf import HEADING, check_structure, layout, report

LIMITS = Settings().document_limits()  # the defaults


def translate(data: bytes, translator: Callable[[str], str] = str.upper) -> tuple[PdfDocument, bytes]:
    document = read("report.pdf", data, LIMITS)
    assert isinstance(document, PdfDocument)
    split = document.split("en")
    return document, split.join([translator(s) for s in split.sentences])


def words(data: bytes) -> str:
    return " ".join(extract_text(io.BytesIO(data)).split())


def one_page(*lines: tuple[str, float, str, float]) -> bytes:
    """A page with ``(font, size, text, y)`` lines at x = 72."""
    out = io.BytesIO()
    canvas = Canvas(out, pagesize=A4)
    for font, size, text, y in lines:
        canvas.setFont(font, size)
        canvas.drawString(72, y, text)
    canvas.showPage()
    canvas.save()
    return out.getvalue()


@pytest.fixture(scope="module")
def sample() -> bytes:
    return report()


@pytest.fixture(scope="module")
def translated(sample: bytes) -> tuple[PdfDocument, bytes]:
    return translate(sample)


# --- translated in place --------------------------------------------------------------------------


def test_the_translation_keeps_pages_sizes_images_and_drawings_with_text_where_each_block_was(
    sample: bytes, translated: tuple[PdfDocument, bytes]
) -> None:
    check_structure("report.pdf", sample, translated[1])


def test_every_sentence_is_replaced_by_its_translation(translated: tuple[PdfDocument, bytes]) -> None:
    document, out = translated
    text = words(out)
    sentences = document.split("en").sentences
    assert HEADING in sentences and "Its text is translated too." in sentences
    for sentence in sentences:
        assert sentence.upper() in text
    assert HEADING not in text and "translated" not in text  # the source's text is gone


def test_each_block_keeps_its_font_family_weight_and_size(translated: tuple[PdfDocument, bytes]) -> None:
    looks = {}
    for _, boxes, _, _ in layout(translated[1]):
        for box in boxes:
            first = next(c for line in box for c in line if isinstance(c, LTChar))
            looks[box.get_text().split()[0]] = (first.fontname, round(first.size))
    # Upper case is wider: a block may shrink to fit its box, never below half its size.
    expected = [("MACHINE", "Helvetica-Bold", 20), ("THE", "Helvetica", 12), ("A", "Times-Bold", 16)]
    for first, font, size in expected:
        assert looks[first][0] == font and size * pdf_draw.FLOOR <= looks[first][1] <= size
    assert looks["SMALL"][0] == "Times-Roman"


def test_a_page_without_text_is_kept_as_it_is_and_noted(
    sample: bytes, translated: tuple[PdfDocument, bytes]
) -> None:
    document, out = translated
    assert document.notes == ("page 3 has no text layer (scanned?): left untranslated",)
    before, after = PdfReader(io.BytesIO(sample)).pages[2], PdfReader(io.BytesIO(out)).pages[2]
    assert after.get_contents().get_data() == before.get_contents().get_data()  # type: ignore[union-attr]


def test_a_translation_twice_as_long_is_shrunk_into_its_box() -> None:
    lines = ["The first line of a paragraph that", "goes on for three lines", "at twelve points, Helvetica."]
    data = one_page(*[("Helvetica", 12, line, 700 - 14 * i) for i, line in enumerate(lines)])
    _, out = translate(data, lambda s: f"{s.upper()} {s.upper()}")
    ((box,),), ((drawn,),) = [p[1] for p in layout(data)], [p[1] for p in layout(out)]
    assert drawn.get_text().split() == 2 * " ".join(lines).upper().split()
    assert box.y0 - 1 <= drawn.y0 and drawn.y1 <= box.y1 + 1 and drawn.x1 <= box.x1 * pdf_draw.SLACK
    sizes = {round(c.size, 1) for line in drawn for c in line if isinstance(c, LTChar)}
    assert len(sizes) == 1 and 6 <= sizes.pop() < 12


def test_a_translation_too_long_even_at_the_smallest_size_keeps_all_its_words() -> None:
    data = one_page(("Helvetica", 12, "A line.", 700))
    _, out = translate(data, lambda s: " ".join([s.upper()] * 20))
    ((drawn,),) = [p[1] for p in layout(out)]
    assert drawn.get_text().split() == ["A", "LINE."] * 20  # runs past the box's bottom


def test_a_scanned_page_with_an_invisible_ocr_layer_is_kept_as_it_is_and_noted() -> None:
    out = io.BytesIO()
    canvas = Canvas(out, pagesize=A4)
    canvas.setFont("Helvetica", 12)
    canvas.drawString(72, 700, "A page of visible text.")
    canvas.showPage()
    canvas.rect(60, 600, 400, 200, fill=1)  # the "scan"
    ocr = canvas.beginText(72, 700)
    ocr.setTextRenderMode(3)  # invisible: an OCR layer
    ocr.textLine("The scanned words.")
    canvas.drawText(ocr)
    canvas.showPage()
    canvas.save()
    document, translated = translate(out.getvalue())
    assert document.notes == ("page 2 has only invisible text (a scan with OCR?): left untranslated",)
    assert document.split("en").sentences == ("A page of visible text.",)
    before, after = (PdfReader(io.BytesIO(d)).pages[1] for d in (out.getvalue(), translated))
    assert after.get_contents().get_data() == before.get_contents().get_data()  # type: ignore[union-attr]


def test_a_longer_one_line_block_runs_right_up_to_its_neighbour_in_its_own_size() -> None:
    out = io.BytesIO()
    canvas = Canvas(out, pagesize=A4)
    canvas.setFont("Helvetica-Bold", 16)
    canvas.drawString(72, 700, "Results")
    canvas.rect(300, 690, 100, 40)  # what the heading must not run into
    canvas.showPage()
    canvas.save()
    _, translated = translate(out.getvalue(), lambda s: "Results of the whole study")
    ((drawn,),) = [p[1] for p in layout(translated)]
    assert drawn.get_text().strip() == "Results of the whole study"
    assert {round(c.size) for line in drawn for c in line if isinstance(c, LTChar)} == {16}
    assert 72 + 150 < drawn.x1 < 300


def test_centred_lines_stay_centred_and_left_aligned_ones_left_aligned() -> None:
    out = io.BytesIO()
    canvas = Canvas(out, pagesize=A4)
    canvas.setFont("Helvetica-Bold", 18)
    canvas.drawCentredString(A4[0] / 2, 780, "A centred title")
    canvas.setFont("Helvetica", 11)
    for i, line in enumerate(["Two centred lines", "of a subtitle"]):
        canvas.drawCentredString(A4[0] / 2, 740 - 14 * i, line)
    canvas.drawString(72, 600, "A paragraph at the margin.")
    canvas.showPage()
    canvas.save()
    _, translated = translate(out.getvalue(), lambda s: f"{s.upper()} !!")
    boxes = {box.get_text().split()[1]: box for box in layout(translated)[0][1]}
    assert set(boxes) == {"CENTRED", "PARAGRAPH"}  # the title, the subtitle's two lines, the paragraph
    for box in [b for b in layout(translated)[0][1] if "CENTRED" in b.get_text()]:
        for line in box:
            assert abs((line.x0 + line.x1) / 2 - A4[0] / 2) < 1, line.get_text()
    assert abs(boxes["PARAGRAPH"].x0 - 72) < 1


def test_a_block_without_letters_is_not_translated_but_drawn_again() -> None:
    data = one_page(("Helvetica", 12, "Figures matter.", 700), ("Helvetica", 10, "2.75  -  42", 100))
    split = read("a.pdf", data, LIMITS).split("en")
    assert split.sentences == ("Figures matter.",)
    assert words(split.join(["ZAHLEN ZÄHLEN."])) == "ZAHLEN ZÄHLEN. 2.75 - 42"


def test_a_word_broken_across_lines_is_joined_before_a_lower_case_letter_only() -> None:
    data = one_page(
        ("Helvetica", 11, "Machine trans-", 700),
        ("Helvetica", 11, "lation works well-", 687),
        ("Helvetica", 11, "Known to all.", 674),
    )
    sentences = read("a.pdf", data, LIMITS).split("en").sentences
    assert sentences == ("Machine translation works well- Known to all.",)
    lines = ["Trans-\n", "  ", "lation 2-\n", "3 and e-\n", "Mail of\n", "ﬁve Ab\xad\n", "Satz\n"]
    assert join_lines(lines) == "Translation 2- 3 and e- Mail of five AbSatz"


def test_characters_outside_latin1_are_drawn_in_a_font_that_has_them(sample: bytes) -> None:
    if pdf_draw.dejavu("DejaVuSans") is None:
        pytest.skip("no DejaVu fonts installed: such characters are drawn as '?'")
    _, out = translate(sample, lambda s: "Привет, мир: " + s)
    assert "Привет, мир: A landscape page." in words(out)


def test_a_rotated_page_with_its_origin_moved_gets_its_translation_in_the_same_places(sample: bytes) -> None:
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(sample)))
    writer.pages[0].rotate(90)
    writer.pages[1].mediabox.lower_left = (-50, -30)  # user space no longer starts at the corner
    writer.pages[1].mediabox.upper_right = (791.9, 565.3)
    moved = io.BytesIO()
    writer.write(moved)
    _, out = translate(moved.getvalue())
    check_structure("moved.pdf", moved.getvalue(), out)
    assert [p.rotation for p in PdfReader(io.BytesIO(out)).pages] == [90, 0, 0]


def test_the_format_is_registered_with_its_media_type() -> None:
    assert MEDIA_TYPES[".pdf"] == "application/pdf"


# --- refused ----------------------------------------------------------------------------------------


def test_a_file_that_is_not_a_pdf_is_refused() -> None:
    with pytest.raises(DocumentError, match="not a PDF"):
        read("a.pdf", b"hello, world\n" * 10, LIMITS)


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.9])
def test_a_truncated_pdf_is_refused(sample: bytes, cut: float) -> None:
    with pytest.raises(DocumentError):
        read("a.pdf", sample[: int(len(sample) * cut)], LIMITS)


def test_a_pdf_header_before_garbage_is_refused() -> None:
    with pytest.raises(DocumentError):
        read("a.pdf", b"%PDF-1.7\n" + bytes(range(256)) * 20, LIMITS)


def test_corrupted_pdfs_are_translated_or_refused_as_unreadable_never_crash(sample: bytes) -> None:
    """Bytes changed at random (seeded): pypdf and pdfminer's own errors, in reading or in
    writing, are a ``DocumentError`` (a 400 that says what is wrong), not a crash."""
    rng = random.Random(1)
    for _ in range(40):
        data = bytearray(sample)
        for _ in range(rng.randint(1, 20)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            document = read("a.pdf", bytes(data), LIMITS)
            split = document.split("en")
            assert split.join([s.upper() for s in split.sentences]).startswith(b"%PDF-")
        except DocumentError:
            pass


@pytest.mark.parametrize("owner_only", [False, True])
def test_an_encrypted_pdf_is_refused(sample: bytes, owner_only: bool) -> None:
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(sample)))
    writer.encrypt(user_password="" if owner_only else "secret", owner_password="owner")
    data = io.BytesIO()
    writer.write(data)
    with pytest.raises(DocumentError, match="encrypted") as refused:
        read("a.pdf", data.getvalue(), LIMITS)
    assert type(refused.value) is DocumentError


def bomb(filler: bytes) -> bytes:
    """A one-page PDF whose zlib content stream is a comment of ``filler``, then a line of text."""
    content = b"%" + filler + b"\nBT /F1 12 Tf 72 700 Td (Boom.) Tj ET\n"
    writer = PdfWriter()
    page = writer.add_blank_page(595, 842)
    stream = StreamObject()
    stream.set_data(zlib.compress(content, 1))
    stream[NameObject("/Filter")] = NameObject("/FlateDecode")
    page[NameObject("/Contents")] = writer._add_object(stream)
    font = {"/Type": "/Font", "/Subtype": "/Type1", "/BaseFont": "/Helvetica"}
    f1 = DictionaryObject({NameObject(k): NameObject(v) for k, v in font.items()})
    fonts = DictionaryObject({NameObject("/F1"): f1})
    page[NameObject("/Resources")] = DictionaryObject({NameObject("/Font"): fonts})
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def test_a_pdf_bomb_is_refused_before_it_is_inflated() -> None:
    data = bomb(b" " * 64 * 1024 * 1024)  # 64 MiB in ~300 KB
    assert len(data) < 400_000
    with pytest.raises(TooLarge, match=r"inflates to more than .* 100x its size"):
        read("bomb.pdf", data, LIMITS)


def test_streams_inflating_to_more_than_the_unpacked_limit_together_are_refused() -> None:
    data = bomb(os.urandom(1024 * 1024).hex().encode())  # 2 MiB, compressed to about half
    with pytest.raises(TooLarge, match="streams inflate to more than"):
        read("big.pdf", data, dataclasses.replace(LIMITS, max_unpacked_bytes=1024 * 1024))
    assert read("big.pdf", data, LIMITS).text == "Boom."


def test_too_many_pages_are_refused_before_they_are_read(sample: bytes) -> None:
    with pytest.raises(TooLarge, match="too many pages"):
        read("a.pdf", sample, dataclasses.replace(LIMITS, max_elements=2))


def test_too_much_text_is_refused(sample: bytes) -> None:
    with pytest.raises(TooLarge, match="too much text"):
        read("a.pdf", sample, dataclasses.replace(LIMITS, max_chars=100))


def test_a_pdf_without_any_text_is_refused_as_a_scan() -> None:
    out = io.BytesIO()
    canvas = Canvas(out, pagesize=A4)
    canvas.rect(100, 100, 300, 300, fill=1)
    canvas.showPage()
    canvas.save()
    with pytest.raises(DocumentError, match="no text layer .*OCR is not supported"):
        read("scan.pdf", out.getvalue(), LIMITS)


def test_text_boxes_are_found_inside_forms_too() -> None:
    """Text drawn through a form XObject (a template, a stamp) is a block like any other."""
    out = io.BytesIO()
    canvas = Canvas(out, pagesize=A4)
    canvas.beginForm("stamp")
    canvas.setFont("Helvetica", 14)
    canvas.drawString(100, 100, "Approved by the board.")
    canvas.endForm()
    canvas.doForm("stamp")
    canvas.showPage()
    canvas.save()
    _, translated = translate(out.getvalue())
    assert "APPROVED BY THE BOARD." in words(translated) and "Approved" not in words(translated)
    assert all(isinstance(b, LTTextBox) for b in layout(translated)[0][1])
