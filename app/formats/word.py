"""Word documents (.docx): checked as a package first (``app.formats.package``), then read with
python-docx.

Every paragraph of the body, of tables (nested ones too) and of the headers and footers is
translated; a paragraph's runs (its stretches of one formatting: bold, a font, a hyperlink) keep
their formatting, and sentences are split across them as across inline HTML tags
(``app.formats.inline``). Runs without text (pictures, breaks) are not touched. Text boxes,
footnotes, comments and fields are left as they are.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import docx

from app.formats.documents import NOT_XML
from app.formats.inline import Block, Mark, SplitBlock
from app.formats.limits import DocumentError, DocumentLimits
from app.formats.package import check_package


def read(kind: str, data: bytes, limits: DocumentLimits) -> DocxDocument:
    return DocxDocument.read(data, limits)


def inner_paragraphs(container: Any) -> Iterator[Any]:
    """The paragraphs of a body, cell, header or footer, tables' cells (nested ones too) included."""
    from docx.table import Table

    for item in container.iter_inner_content():
        if isinstance(item, Table):
            for row in item.rows:
                for cell in row.cells:
                    yield from inner_paragraphs(cell)
        else:
            yield item


def paragraph_runs(paragraph: Any) -> list[Any]:
    """A paragraph's runs in order, those inside hyperlinks included."""
    from docx.text.hyperlink import Hyperlink

    runs: list[Any] = []
    for item in paragraph.iter_inner_content():
        runs += item.runs if isinstance(item, Hyperlink) else [item]
    return runs


def document_paragraphs(document: Any) -> list[Any]:
    """Every paragraph to translate: the body, then each section's own headers and footers (a
    header "linked to previous" is the previous section's, translated once)."""
    paragraphs = list(inner_paragraphs(document))
    seen = set()
    for section in document.sections:
        for part in (
            section.header,
            section.first_page_header,
            section.even_page_header,
            section.footer,
            section.first_page_footer,
            section.even_page_footer,
        ):
            if part.is_linked_to_previous or id(part.part) in seen:
                continue
            seen.add(id(part.part))
            paragraphs += inner_paragraphs(part)
    return paragraphs


def runs_block(runs: Sequence[Any]) -> Block:
    """A paragraph's text, with a mark where each run ends and the next begins: it goes with the
    word after it, unless a space follows it in the source (``"großer| Hund"``: the word before)."""
    texts = [run.text for run in runs]
    whole = "".join(texts)
    marks, offset = [], 0
    for text in texts[:-1]:
        offset += len(text)
        marks.append(Mark(offset, "after" if whole[offset : offset + 1].isspace() else "before"))
    return Block(whole, tuple(marks))


@dataclass(frozen=True)
class DocxDocument:
    document: Any  # docx.document.Document
    paragraphs: tuple[tuple[Any, ...], ...]  # each paragraph's runs
    blocks: tuple[Block, ...]

    @classmethod
    def read(cls, data: bytes, limits: DocumentLimits) -> DocxDocument:
        check_package(data, limits)
        try:
            document = docx.Document(io.BytesIO(data))
        except (zipfile.BadZipFile, KeyError, ValueError) as e:
            raise DocumentError(f"not a .docx document: {e}") from e
        except Exception as e:  # lxml's XML errors and python-docx's own: all "unreadable"
            raise DocumentError(f"cannot read the .docx document: {e}") from e
        runs = tuple(tuple(paragraph_runs(p)) for p in document_paragraphs(document))
        return cls(document, runs, tuple(runs_block(r) for r in runs))

    @property
    def text(self) -> str:
        return "\n".join(b.text.strip() for b in self.blocks if b.text.strip())

    def split(self, language: str) -> SplitDocx:
        return SplitDocx(self, tuple(block.split(language) for block in self.blocks))


@dataclass(frozen=True)
class SplitDocx:
    source: DocxDocument
    splits: tuple[SplitBlock, ...]

    @property
    def sentences(self) -> tuple[str, ...]:
        return tuple(s for split in self.splits for s in split.sentences)

    def join(self, translations: Sequence[str]) -> bytes:
        """The document with its paragraphs translated (written once: the document is changed)."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"expected {len(self.sentences)} translations, got {len(translations)}")
        start = 0
        for runs, split in zip(self.source.paragraphs, self.splits, strict=True):
            count = len(split.sentences)
            if not count:
                continue
            text, offsets = split.place(translations[start : start + count])
            start += count
            cuts = [0, *offsets, len(text)]
            for run, begin, end in zip(runs, cuts[:-1], cuts[1:], strict=True):
                piece = NOT_XML.sub("", text[begin:end])
                if run.text != piece:  # a run left as it was keeps pictures and breaks
                    run.text = piece
        out = io.BytesIO()
        self.source.document.save(out)
        return out.getvalue()
