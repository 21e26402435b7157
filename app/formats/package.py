"""A zip package (.docx, .pptx, .xlsx, OpenDocument) checked while it is inflated, before any XML
parser builds a tree of it.

python-docx (like python-pptx, and lxml on a part) reads a package whole: every part inflated,
every XML part parsed into lxml's tree.
A 1.7 MB package whose document part inflates to 600 MB took the front end to 9.6 GB that way.
So a package is first read here, as a stream, with nothing kept:

* the central directory's counts and declared sizes, against the limits (a bomb usually says
  what it is: refused before a byte is inflated);
* then every file inflated 64 KiB at a time, its bytes counted against the same limits as they
  come (zipfile also stops at the declared size and checks the CRC, so a file cannot inflate past
  what it declared without failing), and every XML file fed to expat through ``defusedxml``, which
  refuses a document type declaration (DTD): OOXML has none, and entity expansion ("billion
  laughs") and external entities need one. Its elements, and the text of the kind's text elements
  (``TEXT_TAGS``: Word's ``<w:t>``, DrawingML's ``<a:t>``, a workbook's ``<t>``, OpenDocument's
  ``<text:p>`` and ``<text:h>``), are counted as they stream.

A package that passes holds at most ``max_unpacked_bytes`` of files and ``max_elements`` XML
elements, which bounds what python-docx builds afterwards (in a child process with its own memory
limit: ``app.formats.sandbox``). python-docx's own parser resolves no entities and reads nothing
from the network, for what this check would miss.

An XML file is one whose name ends in .xml or .rels, or whose first bytes are markup (an SVG
image is XML too: one with a DTD is refused with the rest).
"""

from __future__ import annotations

import io
import zipfile
import zlib
from dataclasses import dataclass
from xml.etree.ElementTree import ParseError

from defusedxml import DefusedXmlException
from defusedxml.ElementTree import DefusedXMLParser

from app.formats.limits import RATIO_FLOOR_BYTES, DocumentError, DocumentLimits, Forbidden, TooLarge

CHUNK_BYTES = 64 * 1024
XML_NAMES = (".xml", ".rels")
BOMS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")
# The text of a Word document is in its runs' <w:t> elements (body, headers, footers, notes); as
# expat names it with ElementTree's namespace separator.
WORD_TEXT = "http://schemas.openxmlformats.org/wordprocessingml/2006/main}t"
# Slides: DrawingML's text runs (shapes, tables, notes; charts' titles count too, untranslated).
DRAWING_TEXT = "http://schemas.openxmlformats.org/drawingml/2006/main}t"
# Workbooks: shared strings, inline strings and comments, plain or in rich-text runs.
SHEET_TEXT = "http://schemas.openxmlformats.org/spreadsheetml/2006/main}t"
# OpenDocument: everything inside a paragraph or heading (spans, links, notes nested in it).
ODF_TEXT = "urn:oasis:names:tc:opendocument:xmlns:text:1.0}"
ODF_PARAGRAPHS = frozenset({ODF_TEXT + "p", ODF_TEXT + "h"})
# What text_tags is when a caller does not say: the elements each kind's text is in.
TEXT_TAGS: dict[str, frozenset[str]] = {
    ".docx": frozenset({WORD_TEXT}),
    ".pptx": frozenset({DRAWING_TEXT}),
    ".xlsx": frozenset({SHEET_TEXT}),
    ".odt": ODF_PARAGRAPHS,
    ".odp": ODF_PARAGRAPHS,
    ".ods": ODF_PARAGRAPHS,
}


@dataclass
class Budget:
    """What the package has used of its limits so far."""

    limits: DocumentLimits
    kind: str  # ".docx", for messages
    text_tags: frozenset[str]  # the elements whose text is counted
    unpacked: int = 0
    elements: int = 0
    chars: int = 0

    def check_entry(self, name: str, size: int, allowed: int) -> None:
        """``size`` bytes of the file ``name``, against the ``allowed`` of ``allowed_size``."""
        if size > allowed:
            raise TooLarge(
                f"{name} in the {self.kind} package inflates to more than {allowed:,} bytes "
                f"(limits: {self.limits.max_entry_bytes:,} bytes a file, {self.limits.max_ratio}x its "
                "compressed size)"
            )

    def inflated(self, name: str, size: int, allowed: int, count: int) -> None:
        """``count`` more bytes of ``name`` inflated, ``size`` of it so far."""
        self.check_entry(name, size, allowed)
        self.unpacked += count
        if self.unpacked > self.limits.max_unpacked_bytes:
            raise TooLarge(
                f"the {self.kind} package inflates to more than {self.limits.max_unpacked_bytes:,} bytes"
            )

    def element(self) -> None:
        self.elements += 1
        if self.elements > self.limits.max_elements:
            limit = self.limits.max_elements
            raise TooLarge(f"the {self.kind} document has more than {limit:,} XML elements")

    def text(self, count: int) -> None:
        self.chars += count
        self.limits.check_chars(self.chars)


class XmlCounter:
    """Expat's element and text handlers, keeping nothing: they count elements and the text inside
    ``text_tags`` (once, however deep those nest).

    They are set on the expat parser that ``defusedxml`` made and guards (its DTD and entity
    handlers stay), in place of ElementTree's, which build each element's tag and attribute dict
    for a target's methods: 3.5x the time (0.73 vs 0.21 s of CPU for 200,000 elements)."""

    def __init__(self, budget: Budget, text_tags: frozenset[str]) -> None:
        self.budget = budget
        self.text_tags = text_tags
        self.in_text = 0

    def parser(self) -> DefusedXMLParser:
        """A DTD-refusing parser whose elements and text come here."""
        parser = DefusedXMLParser(target=self, forbid_dtd=True)
        expat = parser.parser  # the pure-Python ElementTree parser's pyexpat parser
        expat.ordered_attributes = True  # attributes as a list: nothing reads them
        expat.buffer_text = True  # a run's text in one call
        expat.StartElementHandler = self.start
        expat.EndElementHandler = self.end
        expat.CharacterDataHandler = self.data
        return parser

    def start(self, tag: str, attributes: list[str]) -> None:
        self.budget.element()
        if tag in self.text_tags:
            self.in_text += 1

    def end(self, tag: str) -> None:
        if tag in self.text_tags:
            self.in_text -= 1

    def data(self, text: str) -> None:
        if self.in_text:
            self.budget.text(len(text))

    def close(self) -> None:
        return None


def looks_like_xml(name: str, head: bytes) -> bool:
    if name.lower().endswith(XML_NAMES):
        return True
    for bom in BOMS:
        head = head.removeprefix(bom)
    return head.lstrip(b" \t\r\n").startswith(b"<")


def allowed_size(info: zipfile.ZipInfo, limits: DocumentLimits) -> int:
    """The most one file of a package may inflate to."""
    return min(limits.max_entry_bytes, max(limits.max_ratio * info.compress_size, RATIO_FLOOR_BYTES))


def check_package(
    data: bytes, limits: DocumentLimits, kind: str = ".docx", text_tags: frozenset[str] | None = None
) -> None:
    """Raise ``TooLarge``, ``Forbidden`` or ``DocumentError`` unless ``data`` is a zip package within
    ``limits`` whose XML files declare no DTD; return having kept nothing. The text inside
    ``text_tags`` (expat's ``namespace}name``; by default ``TEXT_TAGS[kind]``) counts against
    ``limits.max_chars``."""
    if text_tags is None:
        text_tags = TEXT_TAGS[kind]
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError) as e:
        raise DocumentError(f"not a {kind} document: {e}") from e
    with archive:
        entries = archive.infolist()
        if len(entries) > limits.max_entries:
            count, limit = len(entries), limits.max_entries
            raise TooLarge(f"the {kind} package holds {count:,} files (at most {limit:,})")
        declared = sum(info.file_size for info in entries)
        if declared > limits.max_unpacked_bytes:
            raise TooLarge(
                f"the {kind} package says it inflates to {declared:,} bytes "
                f"(at most {limits.max_unpacked_bytes:,})"
            )
        budget = Budget(limits, kind, text_tags)
        for info in entries:  # what each file says it inflates to, before anything is inflated
            budget.check_entry(info.filename, info.file_size, allowed_size(info, limits))
        for info in entries:
            inflate(archive, info, budget)


def inflate(archive: zipfile.ZipFile, info: zipfile.ZipInfo, budget: Budget) -> None:
    """Inflate one file of the package a chunk at a time, counting it, and parse it if it is XML."""
    allowed, size = allowed_size(info, budget.limits), 0
    parser: DefusedXMLParser | None = None
    try:
        with archive.open(info) as stream:
            while chunk := stream.read(CHUNK_BYTES):
                size += len(chunk)
                budget.inflated(info.filename, size, allowed, len(chunk))
                if parser is None and size == len(chunk) and looks_like_xml(info.filename, chunk):
                    parser = XmlCounter(budget, budget.text_tags).parser()
                if parser is not None:
                    parser.feed(chunk)
            if parser is not None:
                parser.close()
    except DefusedXmlException as e:
        raise Forbidden(
            f"{info.filename} in the {budget.kind} package declares a DTD or entities ({type(e).__name__}): "
            "not allowed in a document"
        ) from e
    except ParseError as e:
        raise DocumentError(f"cannot read the {budget.kind} document: {info.filename}: {e}") from e
    except (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, NotImplementedError, OSError) as e:
        # a CRC or size that does not match, a truncated stream, encryption, an unknown method
        raise DocumentError(f"not a {budget.kind} document: {info.filename}: {e}") from e
