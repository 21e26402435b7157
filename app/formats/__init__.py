"""Request texts and files as sentences to translate, and back: plain text
(``app.translation.segments``), HTML (``html``), documents (``documents``); markup inside sentences
is placed by ``inline``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from app.formats.html import HtmlDocument
from app.translation.segments import split_text

Format = Literal["text", "html"]


class Layout(Protocol):
    """A text split into sentences; ``join`` puts their translations back in its place."""

    @property
    def sentences(self) -> tuple[str, ...]: ...

    def join(self, translations: Sequence[str]) -> str: ...


@dataclass(frozen=True)
class PlainText:
    text: str

    def split(self, language: str) -> Layout:
        return split_text(self.text, language)


def parse(text: str, format: Format) -> PlainText | HtmlDocument:
    """``text`` read as ``format``, before its language is known (``.text`` is what language
    identification looks at; ``.split(language)`` gives its sentences). ``HtmlError`` for HTML that
    cannot be read."""
    return HtmlDocument.parse(text) if format == "html" else PlainText(text)
