"""Files for ``POST /translate_file`` and ``/jobs``: the formats, and the two steps every one gives.

``read(name, data, limits)`` parses the upload (language-free: its ``text`` is what language
identification looks at), and ``.split(language)`` gives the sentences to translate and a
``join(translations)`` that writes the translated file.

Each format is a module with a function ``read(kind, data, limits) -> Document`` (``kind``: the
file's extension), named in ``FORMATS`` and imported only where documents are read: in the reader
processes (``app.formats.sandbox``, which preloads every module listed here) and in tests. The
front end never imports a format's library.

* .txt and .html: ``app.formats.plain``; .docx: ``app.formats.word``; .pptx: ``slides``;
  .xlsx: ``sheets``; .odt, .odp, .ods: ``opendocument``; .xlf, .xliff: ``xliff``; .pdf: ``pdf``;
  .srt, .vtt: ``subtitles``; .md: ``markdown`` (each module's docstring says what it keeps).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Protocol

from app.formats.limits import DocumentError, DocumentLimits, Forbidden


@dataclass(frozen=True)
class FileFormat:
    """A kind of file the service translates."""

    name: str  # as the page and the README list it
    extensions: tuple[str, ...]  # lower case, with the dot
    media_type: str  # of the translated file
    module: str  # its ``read(kind, data, limits)``


FORMATS: tuple[FileFormat, ...] = (
    FileFormat("Text", (".txt",), "text/plain; charset=utf-8", "app.formats.plain"),
    FileFormat("HTML", (".html", ".htm"), "text/html; charset=utf-8", "app.formats.plain"),
    FileFormat(
        "Word",
        (".docx",),
        "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
        "app.formats.word",
    ),
    FileFormat("XLIFF", (".xlf", ".xliff"), "application/xliff+xml", "app.formats.xliff"),
    FileFormat(
        "PowerPoint",
        (".pptx",),
        "application/vnd.openxmlformats-officedocument.presentationml.presentation",
        "app.formats.slides",
    ),
    FileFormat(
        "Excel",
        (".xlsx",),
        "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
        "app.formats.sheets",
    ),
    FileFormat(
        "OpenDocument text", (".odt",), "application/vnd.oasis.opendocument.text", "app.formats.opendocument"
    ),
    FileFormat(
        "OpenDocument presentation",
        (".odp",),
        "application/vnd.oasis.opendocument.presentation",
        "app.formats.opendocument",
    ),
    FileFormat(
        "OpenDocument spreadsheet",
        (".ods",),
        "application/vnd.oasis.opendocument.spreadsheet",
        "app.formats.opendocument",
    ),
    FileFormat("PDF", (".pdf",), "application/pdf", "app.formats.pdf"),
    FileFormat("SubRip subtitles", (".srt",), "application/x-subrip", "app.formats.subtitles"),
    FileFormat("WebVTT subtitles", (".vtt",), "text/vtt; charset=utf-8", "app.formats.subtitles"),
    FileFormat("Markdown", (".md", ".markdown"), "text/markdown; charset=utf-8", "app.formats.markdown"),
)
BY_EXTENSION = {extension: f for f in FORMATS for extension in f.extensions}
# How the formats that can flag a sentence for review (``Review``) show it.
REVIEW_MARKS = {
    ".xlf": "a note on each unit, its state for review",
    ".xliff": "a note on each unit, its state for review",
    ".docx": "a comment on each paragraph",
    ".xlsx": "listed on a sheet named Review",
}
MEDIA_TYPES = {extension: f.media_type for extension, f in BY_EXTENSION.items()}
SUPPORTED = tuple(BY_EXTENSION)
MODULES = tuple(dict.fromkeys(f.module for f in FORMATS))
UTF8_BOM = b"\xef\xbb\xbf"
# What XML 1.0 cannot hold (C0 controls but tab and line breaks, surrogates, U+FFFE/U+FFFF).
NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


@dataclass(frozen=True)
class Review:
    """The sentences a person should check before the translated file is used: each one's index in
    ``SplitDocument.sentences`` and its confidence (``app.translation.confidence``), below
    ``threshold``. The formats that can say so mark them where their readers look: XLIFF (a unit's
    state and a note), .docx (a comment on the paragraph), .xlsx (a sheet listing them); the others
    write the file as without it."""

    threshold: float
    low: dict[int, float]  # sentence index -> its confidence

    def note(self, confidence: float) -> str:
        """What a mark says: the lowest confidence among the sentences it covers, and the threshold."""
        return (
            f"Machine translation confidence {confidence:.2f} is below {self.threshold:.2f}: "
            "please review this translation."
        )

    def lowest(self, start: int, end: int) -> float | None:
        """The lowest confidence among the flagged sentences ``start`` to ``end`` (exclusive); None
        if none of them is flagged."""
        found = [self.low[i] for i in range(start, end) if i in self.low]  # (linear over a document)
        return min(found) if found else None


class SplitDocument(Protocol):
    @property
    def sentences(self) -> tuple[str, ...]: ...

    def join(self, translations: Sequence[str], review: Review | None = None) -> bytes: ...


class Document(Protocol):
    @property
    def text(self) -> str: ...

    def split(self, language: str) -> SplitDocument: ...


def extension(name: str) -> str:
    return PurePath(name).suffix.lower()


def download_name(name: str, target: str) -> str:
    """``report.docx`` -> ``report_en.docx``, in characters safe in a URL path and a header."""
    stem = name[: len(name) - len(extension(name))].rsplit("/", 1)[-1].rsplit("\\", 1)[-1]
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "_" for c in stem)[:80]
    target = "".join(c for c in target if c.isascii() and c.isalnum())[:16]
    return f"{safe or 'file'}_{target}{extension(name)}"


def read(name: str, data: bytes, limits: DocumentLimits) -> Document:
    """The upload ``data``, named ``name``, parsed by its extension within ``limits``
    (``DocumentError`` or one of its kinds if it cannot be; the caller has checked that the
    extension is one of ``SUPPORTED``)."""
    document = parse_file(extension(name), data, limits)
    # The formats count text as they read, to stop early; this is the count that decides.
    limits.check_chars(len(document.text))
    return document


def parse_file(kind: str, data: bytes, limits: DocumentLimits) -> Document:
    module = importlib.import_module(BY_EXTENSION[kind].module)
    document: Document = module.read(kind, data, limits)
    return document


def decode(data: bytes) -> tuple[str, bool]:
    bom = data.startswith(UTF8_BOM)
    try:
        text = data[len(UTF8_BOM) if bom else 0 :].decode("utf-8")
    except UnicodeDecodeError as e:
        raise DocumentError(f"the file is not UTF-8 text (invalid byte at offset {e.start})") from e
    nul = text.find("\0")
    if nul >= 0:
        raise Forbidden(f"the file holds NUL characters (the first at character {nul}): it is not text")
    return text, bom


def encode(text: str, bom: bool) -> bytes:
    return (UTF8_BOM if bom else b"") + text.encode("utf-8")
