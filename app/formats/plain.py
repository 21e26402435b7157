"""Text files: .txt (UTF-8, a byte-order mark kept, the layout kept as for ``/translate``'s text)
and .html (as ``format: "html"``: ``app.formats.html``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.formats import Layout
from app.formats.documents import Document, Review, decode, encode
from app.formats.html import HtmlDocument, HtmlError
from app.formats.limits import DocumentError, DocumentLimits
from app.translation.segments import split_text


def read(kind: str, data: bytes, limits: DocumentLimits) -> Document:
    text, bom = decode(data)
    if kind in (".html", ".htm"):
        try:
            return HtmlFile(HtmlDocument.parse(text, limits), bom)
        except HtmlError as e:
            raise DocumentError(str(e)) from e
    return TextFile(text, bom)


@dataclass(frozen=True)
class TextFile:
    text: str
    bom: bool

    def split(self, language: str) -> SplitTextFile:
        return SplitTextFile(split_text(self.text, language), self.bom)


@dataclass(frozen=True)
class HtmlFile:
    document: HtmlDocument
    bom: bool

    @property
    def text(self) -> str:
        return self.document.text

    def split(self, language: str) -> SplitTextFile:
        return SplitTextFile(self.document.split(language), self.bom)


@dataclass(frozen=True)
class SplitTextFile:
    """A .txt or .html file split into sentences; joined, it is UTF-8 again (with its BOM if it
    had one)."""

    layout: Layout
    bom: bool

    @property
    def sentences(self) -> tuple[str, ...]:
        return self.layout.sentences

    def join(self, translations: Sequence[str], review: Review | None = None) -> bytes:
        # (``review``: this format has no place for a reviewer's mark; the file is written as without it.)
        return encode(self.layout.join(translations), self.bom)
