"""PDF files (.pdf): text blocks found with pdfminer.six, translated in place on the same pages.

A PDF has no paragraphs, only glyphs at positions. pdfminer's layout analysis groups them into
text boxes (lines close together, of one column); each box is one block to translate, its lines
joined with spaces (a line ending in a hyphen before a lower-case word is joined without it:
"Trans-" "lation" is "Translation"), split into sentences as a paragraph of HTML is
(``app.formats.inline``). Writing the translation:

* every page is kept, with its size, rotation, images, drawings, links and annotations (pypdf
  copies the file and changes only what follows);
* on a page with text, the text-showing operators are removed from its content (and from the
  forms it draws), and the translation is drawn over it, each block in its original box, in a
  standard font like its own, its size, colour and line spacing, shrunk if the translation needs
  more room (``app.formats.pdf_draw``); a one-line block (a heading, a label, a table cell)
  may first run right, up to what is next to it. Inline formatting inside a block (one bold
  word) is not kept: the block takes the style of most of its characters. A block without
  letters (numbers, a page number) is drawn again as it was, untranslated;
* a page without text (a scan: an image) is kept as it is, and ``PdfDocument.notes`` says so;
  so is a page with only invisible text (an OCR layer over a scan: drawn visibly, its
  translation would cover the scan; invisible text on a page with visible text is removed);
  a page whose text has no Unicode mapping (pdfminer reads "(cid:12)") is kept as it is too, with
  a note. A file with no text at all is refused: OCR is not done here.

The blocks are pdfminer's: where it groups lines that are no paragraph into one box (a chart's
tick labels and its axis title), their translation is reflowed as one paragraph all the same.
Not kept: the original fonts (subsets: they lack the translation's glyphs), text within a block
drawn in several styles or directions (rotated or vertical text is drawn horizontally), justified
alignment (centred lines stay centred), tagged-PDF structure. Not translated: annotations, form
fields, bookmarks and metadata.

Refused: encrypted files, more pages or layout objects than ``max_elements``, more text than
``max_chars`` (counted page by page), and compressed streams that inflate past a package's limits
(a PDF bomb: ``check_streams``, before pdfminer or pypdf inflates anything).

What it costs: pdfminer finds blocks glyph by glyph, in Python: 50-70 ms of CPU for a page of
3,000 characters. A 200-page book took 10-14 s to read and 5-7.5 s more to write (after reading it
again) on the 2 shared cores it was measured on, so the default 10 s of CPU a reader has
(``NMT_FILE_READ_TIMEOUT_S``) is enough for ~60 dense pages; longer files need a longer limit.
pypdf (BSD-3-Clause) and pdfminer.six (MIT) read, reportlab (BSD) draws: PyMuPDF would do all
three, but is AGPL.
"""

from __future__ import annotations

import io
import logging
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdfminer.converter import PDFPageAggregator
from pdfminer.layout import LAParams, LTChar, LTPage
from pdfminer.pdfdocument import PDFDocument
from pdfminer.pdfinterp import PDFPageInterpreter, PDFResourceManager
from pdfminer.pdfpage import PDFPage
from pdfminer.pdfparser import PDFParser
from pypdf import ObjectDeletionFlag, PdfReader, PdfWriter, Transformation
from pypdf.generic import EncodedStreamObject, IndirectObject

from app.formats.blocks import SplitBlocks
from app.formats.documents import Review
from app.formats.inline import Block, SplitBlock
from app.formats.limits import RATIO_FLOOR_BYTES, DocumentError, DocumentLimits, TooLarge
from app.formats.pdf_blocks import TextBlock, page_blocks
from app.formats.pdf_draw import Text, overlay

logging.getLogger("pdfminer").setLevel(logging.ERROR)  # it warns of every oddity of every file
logging.getLogger("pypdf").setLevel(logging.ERROR)

Matrix = tuple[float, float, float, float, float, float]
UNMAPPED = re.compile(r"\(cid:\d+\)")  # pdfminer's stand-in for a glyph without a Unicode value
HEADER_BYTES = 1024  # "%PDF-" must start within these (as PDF readers allow)
CHUNK = 1024 * 1024  # bytes inflated at a time while a stream is measured


def read(kind: str, data: bytes, limits: DocumentLimits) -> PdfDocument:
    return PdfDocument.read(data, limits)


@dataclass(frozen=True)
class Page:
    size: tuple[float, float]  # displayed width and height (rotation applied)
    ctm: Matrix  # PDF user space to pdfminer's displayed coordinates
    blocks: tuple[TextBlock, ...]  # empty: the page is left as it is


def count(item: Any) -> int:
    """Layout objects under ``item`` (characters not counted: ``check_chars`` does)."""
    if isinstance(item, LTChar) or not hasattr(item, "__iter__"):
        return 1
    return 1 + sum(0 if isinstance(c, LTChar) else count(c) for c in item)


def pdfminer_ctm(page: PDFPage) -> Matrix:
    """The matrix pdfminer's ``PDFPageInterpreter.process_page`` puts a page's coordinates through."""
    x0, y0, x1, y1 = page.mediabox
    rotate = page.rotate % 360
    if rotate == 90:
        return (0, -1, 1, 0, -y0, x1)
    if rotate == 180:
        return (-1, 0, 0, -1, x1, y1)
    if rotate == 270:
        return (0, 1, -1, 0, y1, -x0)
    return (1, 0, 0, 1, -x0, -y0)


def inverse(m: Matrix) -> Matrix:
    a, b, c, d, e, f = m
    det = a * d - b * c
    return (d / det, -b / det, -c / det, a / det, (c * f - d * e) / det, (b * e - a * f) / det)


def open_pdf(data: bytes, limits: DocumentLimits) -> PdfReader:
    """pypdf's reader of ``data``, refused if it is no PDF or is encrypted."""
    if b"%PDF-" not in data[:HEADER_BYTES]:
        raise DocumentError("not a PDF file (no %PDF- header)")
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        encrypted = reader.is_encrypted
        pages = len(reader.pages) if not encrypted else 0
    except (MemoryError, RecursionError):  # the sandbox's 413s
        raise
    except Exception as e:  # pypdf's PdfReadError and what a broken file makes its parser raise
        raise DocumentError(f"cannot read the PDF file: {e}") from e
    if encrypted:
        raise DocumentError("the PDF file is encrypted: upload it without a password or restrictions")
    if not pages:
        raise DocumentError("the PDF file has no pages")
    check_streams(reader, limits)
    return reader


def check_streams(reader: PdfReader, limits: DocumentLimits) -> None:
    """Raise ``TooLarge`` if the streams that pdfminer or pypdf would inflate (page contents,
    forms, fonts, object streams: all but images, which neither decodes) inflate past the limits
    of a package's files (``app.formats.package``): a PDF bomb, measured in chunks before either
    library inflates it whole. Only Flate (zlib) streams are measured, the filter of nearly every
    PDF; a bomb in another (LZW) meets the reader's memory limit."""
    total = 0
    for generation, objects in reader.xref.items():
        for number in objects:
            try:
                stream = reader.get_object(IndirectObject(number, generation, reader))
            except (MemoryError, RecursionError):
                raise
            except Exception:  # a broken object: the readers skip it or say what is wrong
                continue
            if not isinstance(stream, EncodedStreamObject) or stream.get("/Subtype") == "/Image":
                continue
            filters = stream.get("/Filter")
            if (filters[0] if isinstance(filters, list) and filters else filters) in ("/FlateDecode", "/Fl"):
                total += inflated_size(stream._data, number, limits)
                if total > limits.max_unpacked_bytes:
                    raise TooLarge(
                        f"the PDF's streams inflate to more than {limits.max_unpacked_bytes:,} bytes"
                    )


def inflated_size(raw: bytes, number: int, limits: DocumentLimits) -> int:
    """How large the zlib data ``raw`` of PDF object ``number`` inflates (up to where it breaks)."""
    allowed = min(limits.max_entry_bytes, max(limits.max_ratio * len(raw), RATIO_FLOOR_BYTES))
    inflater, size = zlib.decompressobj(), 0
    while raw and not inflater.eof:
        try:
            size += len(inflater.decompress(raw, CHUNK))
        except zlib.error:  # a broken stream: the readers' to deal with
            break
        if size > allowed:
            raise TooLarge(
                f"a stream of the PDF file (object {number}) inflates to more than {allowed:,} bytes "
                f"(limits: {limits.max_entry_bytes:,} bytes a stream, {limits.max_ratio}x its size)"
            )
        raw = inflater.unconsumed_tail
    return size


class Aggregator(PDFPageAggregator):
    """pdfminer's page layouts, without invisible text (render modes 3 and 7: an OCR layer over a
    scanned page, which drawn visibly would cover the scan), counting the strings it leaves out."""

    hidden = 0

    def render_string(self, textstate: Any, seq: Any, ncs: Any, graphicstate: Any) -> None:
        if textstate.render in (3, 7):
            self.hidden += 1
            return
        super().render_string(textstate, seq, ncs, graphicstate)


def extract(data: bytes, pages: int) -> Iterator[tuple[PDFPage, LTPage, int]]:
    """Each page of ``data``, its layout and how many invisible strings it holds, page by page (so
    that limits stop it early)."""
    try:
        document = PDFDocument(PDFParser(io.BytesIO(data)))
        resources = PDFResourceManager(caching=True)
        device = Aggregator(resources, laparams=LAParams(all_texts=True))
        interpreter = PDFPageInterpreter(resources, device)
        found = 0
        for page in PDFPage.create_pages(document):
            found += 1
            if found > pages:
                break
            device.hidden = 0
            interpreter.process_page(page)
            yield page, device.get_result(), device.hidden
    except (MemoryError, RecursionError, DocumentError):
        raise
    except Exception as e:  # pdfminer's PDFSyntaxError, PSEOF, ... and its asserts on broken files
        raise DocumentError(f"cannot read the PDF file: {e}") from e
    if found != pages:
        raise DocumentError(f"the PDF file's page tree is broken ({pages} pages, {found} found)")


@dataclass(frozen=True)
class PdfDocument:
    data: bytes
    pages: tuple[Page, ...]
    notes: tuple[str, ...]  # what was left untranslated and why, one line each, for the user

    @classmethod
    def read(cls, data: bytes, limits: DocumentLimits) -> PdfDocument:
        total = len(open_pdf(data, limits).pages)
        if total > limits.max_elements:
            raise TooLarge(f"too many pages in the PDF file: {total} (at most {limits.max_elements})")
        pages, notes = [], []
        text_chars = elements = 0
        for number, (page, layout, hidden) in enumerate(extract(data, total), start=1):
            elements += count(layout)
            if elements > limits.max_elements:
                raise TooLarge(f"too many objects in the PDF file (at most {limits.max_elements})")
            blocks = page_blocks(layout)
            if blocks and min(layout.width, layout.height) < 1:
                notes.append(f"page {number} has no area to draw on: left untranslated")
                blocks = ()
            elif any(UNMAPPED.search(b.text) for b in blocks):
                notes.append(f"page {number}: its text has no Unicode mapping: left untranslated")
                blocks = ()
            elif not blocks and hidden:
                notes.append(f"page {number} has only invisible text (a scan with OCR?): left untranslated")
            elif not blocks:
                notes.append(f"page {number} has no text layer (scanned?): left untranslated")
            text_chars += sum(len(b.text) + 2 for b in blocks)
            limits.check_chars(text_chars)
            pages.append(Page((layout.width, layout.height), pdfminer_ctm(page), blocks))
        if not any(p.blocks for p in pages):
            raise DocumentError("the PDF file has no text layer (a scan?): OCR is not supported")
        return cls(data, tuple(pages), tuple(notes))

    @property
    def blocks(self) -> tuple[TextBlock, ...]:
        return tuple(b for p in self.pages for b in p.blocks)

    @property
    def text(self) -> str:
        return "\n\n".join(b.text for b in self.blocks)

    def split(self, language: str) -> SplitPdf:
        return SplitPdf(tuple(split_block(b.text, language) for b in self.blocks), self)


def split_block(text: str, language: str) -> SplitBlock:
    """A block's sentences; none for one without letters (a chart's ticks, a page number): it is
    drawn again as it was, not sent to the model."""
    block = Block(text, ())
    return block.split(language) if any(c.isalpha() for c in text) else SplitBlock(block, (), ())


@dataclass(frozen=True)
class SplitPdf(SplitBlocks):  # its splits: one per block, in the order of ``source.blocks``
    source: PdfDocument

    def join(self, translations: Sequence[str], review: Review | None = None) -> bytes:
        # (``review``: this format has no place for a reviewer's mark; the file is written as without it.)
        """The PDF with each page's text replaced by its translation."""
        texts: list[list[Text]] = []
        blocks = iter(self.placed(translations))
        for page in self.source.pages:
            texts.append([])
            for block, placed in zip(page.blocks, blocks, strict=False):
                text = block.text if placed is None else placed[0]
                texts[-1].append(Text(block.box, " ".join(text.split()), block.style, block.centred))
        pages = [(p.size, t) for p, t in zip(self.source.pages, texts, strict=True) if p.blocks]
        drawn = PdfReader(io.BytesIO(overlay(pages)))
        try:
            return self.write(drawn)
        except (MemoryError, RecursionError):
            raise
        except Exception as e:  # pypdf's own errors on parts of a broken file that reading skipped
            raise DocumentError(f"cannot write the PDF file: {type(e).__name__}: {e}") from e

    def write(self, drawn: PdfReader) -> bytes:
        """The source with the text of each page with blocks removed, and ``drawn``'s next page
        (its translation) merged over it."""
        writer = PdfWriter(clone_from=PdfReader(io.BytesIO(self.source.data), strict=False))
        over = iter(drawn.pages)
        for number, page in enumerate(self.source.pages):
            if not page.blocks:
                continue
            target = writer.pages[number]
            writer.remove_objects_from_page(target, ObjectDeletionFlag.TEXT)
            target.merge_transformed_page(next(over), Transformation(inverse(page.ctm)))
            target.compress_content_streams()
        out = io.BytesIO()
        writer.write(out)
        return out.getvalue()
