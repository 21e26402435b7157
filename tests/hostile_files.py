"""Hostile uploads, generated: what an attacker would post to /translate_file.

Each is made here, with python-docx and zipfile, not stored: a zip bomb that is a valid OOXML
package, XML entity expansion and external entities inside a .docx part, a package of thousands of
files, one whose document has more elements than the limit, HTML nested 100,000 deep, HTML of
300,000 tags, a 1 MB "word", 50,000 one-character sentences, NUL characters in text. Each comes
with the status and the words of the answer the service must give with its default limits
(tests/test_hostile_files.py checks them over HTTP; benchmarks/hostile.py times them).
"""

from __future__ import annotations

import io
import random
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import docx

DOCUMENT_PART = "word/document.xml"
BODY = "<w:body>"


@dataclass(frozen=True)
class Hostile:
    name: str  # what it is (a test id)
    filename: str  # as uploaded
    make: Callable[[], bytes]
    status: int
    words: str  # in the answer's error message


def small_docx(text: str = "Ein Hund läuft.") -> bytes:
    document = docx.Document()
    document.add_paragraph(text)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def rewrite_docx(change: Callable[[str, bytes], Iterator[tuple[zipfile.ZipInfo | str, bytes]]]) -> bytes:
    """A copy of ``small_docx()`` whose every file goes through ``change(name, data)``, which yields
    the files to write in its place (streams are not needed: nothing here is large uncompressed
    except the bomb, which writes its own)."""
    source = zipfile.ZipFile(io.BytesIO(small_docx()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            for name, data in change(info.filename, source.read(info)):
                target.writestr(name, data)
    return out.getvalue()


def with_body(xml: bytes, body: str) -> bytes:
    """The document part with ``body`` placed at the start of its body."""
    text = xml.decode()
    at = text.index(BODY) + len(BODY)
    return (text[:at] + body + text[at:]).encode()


def zip_bomb(inflated: int = 600 * 1024 * 1024) -> bytes:
    """A valid package whose document part inflates to ``inflated`` bytes of empty paragraphs
    (~1.7 MB compressed at 600 MB: the issue's bomb), written as a stream."""
    source = zipfile.ZipFile(io.BytesIO(small_docx()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename != DOCUMENT_PART:
                target.writestr(info.filename, data)
                continue
            head, tail = data.decode().split(BODY, 1)
            with target.open(DOCUMENT_PART, "w", force_zip64=True) as part:
                part.write((head + BODY).encode())
                chunk = b"<w:p/>" * (1024 * 1024 // 6)
                for _ in range(inflated // len(chunk)):
                    part.write(chunk)
                part.write(tail.encode())
    return out.getvalue()


def lying_bomb(inflated: int = 64 * 1024 * 1024) -> bytes:
    """A package whose document part inflates to ``inflated`` bytes while its central directory
    (where zipfile reads sizes) says 1 KiB."""

    def change(name: str, data: bytes) -> Iterator[tuple[str, bytes]]:
        yield name, with_body(data, "<w:p/>" * (inflated // 6)) if name == DOCUMENT_PART else data

    package = bytearray(rewrite_docx(change))
    at = 0
    while (at := package.index(b"PK\x01\x02", at + 1)) >= 0:  # each central directory record
        length = struct.unpack_from("<H", package, at + 28)[0]
        if package[at + 46 : at + 46 + length] == DOCUMENT_PART.encode():
            struct.pack_into("<I", package, at + 24, 1024)  # its uncompressed size
            return bytes(package)
    raise AssertionError("no document part")


def xml_doctype(doctype: str, body: str) -> bytes:
    """The document part with a DTD: ``<!DOCTYPE ...>`` after its XML declaration."""

    def change(name: str, data: bytes) -> Iterator[tuple[str, bytes]]:
        if name == DOCUMENT_PART:
            declaration, rest = data.split(b"?>", 1)
            data = declaration + b"?>" + doctype.encode() + with_body(rest, body)
        yield name, data

    return rewrite_docx(change)


def billion_laughs() -> bytes:
    entities = '<!ENTITY lol0 "lol">' + "".join(
        f'<!ENTITY lol{i} "{f"&lol{i - 1};" * 10}">' for i in range(1, 10)
    )
    return xml_doctype(f"<!DOCTYPE w:document [{entities}]>", "<w:p><w:r><w:t>&lol9;</w:t></w:r></w:p>")


def external_entity() -> bytes:
    doctype = '<!DOCTYPE w:document [<!ENTITY secret SYSTEM "file:///etc/passwd">]>'
    return xml_doctype(doctype, "<w:p><w:r><w:t>&secret;</w:t></w:r></w:p>")


def many_entries(count: int = 5_000) -> bytes:
    def change(name: str, data: bytes) -> Iterator[tuple[str, bytes]]:
        yield name, data
        if name == DOCUMENT_PART:
            for i in range(count):
                yield f"word/media/extra{i}.bin", b""

    return rewrite_docx(change)


def many_elements(paragraphs: int = 300_000) -> bytes:
    """A document part of empty paragraphs, each with a random revision id (so that it deflates
    ~7x, not 1,000x: no ratio limit stops it before its elements are counted): no text."""
    ids = random.Random(0).choices(range(16**4), k=paragraphs)
    body = "".join(f'<w:p w:rsidR="{i:04X}"/>' for i in ids)

    def change(name: str, data: bytes) -> Iterator[tuple[str, bytes]]:
        yield name, with_body(data, body) if name == DOCUMENT_PART else data

    return rewrite_docx(change)


def deep_html(levels: int = 100_000) -> bytes:
    return ("<div>" * levels + "Ein Hund." + "</div>" * levels).encode()


def many_tags(tags: int = 300_000) -> bytes:
    return ("<p>Ein Hund." + "<br>" * tags + "</p>").encode()


HOSTILE = [
    Hostile("zip-bomb", "bomb.docx", zip_bomb, 413, "inflates to"),
    Hostile("lying-zip-bomb", "lying.docx", lying_bomb, 400, "Bad CRC-32"),
    Hostile("entity-expansion", "laughs.docx", billion_laughs, 422, "DTD"),
    Hostile("external-entity", "xxe.docx", external_entity, 422, "DTD"),
    Hostile("many-entries", "entries.docx", many_entries, 413, "files (at most 1,000)"),
    Hostile("many-elements", "elements.docx", many_elements, 413, "XML elements"),
    Hostile("deep-html", "deep.html", deep_html, 413, "nests more than 512"),
    Hostile("many-tags", "tags.html", many_tags, 413, "tags"),
    Hostile("giant-word", "word.txt", lambda: b"x" * 1_000_000, 413, "too much text"),
    Hostile("tiny-sentences", "tiny.txt", lambda: b"a\n" * 50_000, 413, "too many sentences"),
    Hostile("nul-characters", "nul.txt", lambda: b"Ein Hund.\0\0\0 Eine Katze.", 422, "NUL"),
]
