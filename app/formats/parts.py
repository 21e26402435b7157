"""The XML parts of a zip package, parsed with lxml and written back in place of the originals.

The spreadsheet and OpenDocument formats change a few parts of their package (the shared strings,
``content.xml``) and keep every other file as it was: a library that loads the whole package and
saves it anew writes back only what it understood (openpyxl drops a workbook's charts and
pictures). ``rewrite`` copies the package file by file, in the same order, each with its own
``ZipInfo`` (name, date, attributes, compression method), the unchanged ones with the same
uncompressed bytes: an OpenDocument ``mimetype`` stays first and stored, as ODF requires. A file
the package did not have (the sheet listing a workbook's sentences to review) is added at the end.

Parts are parsed only after ``app.formats.package.check_package`` has streamed them (no DTD, within
the limits), and with a parser that could not expand an entity or load anything anyway.
"""

from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass
from typing import Any

from lxml import etree

from app.formats.limits import DocumentError, Forbidden

XML_NS = "http://www.w3.org/XML/1998/namespace"
ENCODING = re.compile(rb"encoding\s*=")
UTF8 = re.compile(rb"encoding\s*=\s*[\"']utf-?8[\"']", re.IGNORECASE)
# No DTD loaded, no entity resolved, nothing read from the network; huge_tree stays off.
PARSER = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, remove_blank_text=False)


def parse(data: bytes, name: str, kind: str) -> Any:
    """The part ``name`` of a ``kind`` package as an lxml tree."""
    try:
        tree = etree.ElementTree(etree.fromstring(data, PARSER))
    except etree.XMLSyntaxError as e:
        raise DocumentError(f"cannot read the {kind} document: {name}: {e}") from e
    if tree.docinfo.doctype:  # check_package refuses these first; this is the parser's own word
        raise Forbidden(f"{name} in the {kind} package declares a DTD: not allowed in a document")
    return tree


def serialize(tree: Any, original: bytes) -> bytes:
    """The tree as a part again, under the original's own XML declaration (Excel's says
    ``standalone="yes"`` in double quotes; lxml would write its own in single quotes)."""
    body: bytes = etree.tostring(tree.getroot(), encoding="UTF-8", xml_declaration=False)
    head = original.lstrip()
    if not head.startswith(b"<?xml"):
        return body
    declaration = head[: head.index(b"?>") + 2]
    if ENCODING.search(declaration) and not UTF8.search(declaration):  # a UTF-16 part, say
        return etree.tostring(
            tree, encoding="UTF-8", xml_declaration=True, standalone=tree.docinfo.standalone
        )
    return declaration + b"\n" + body


@dataclass(frozen=True)
class Part:
    """One XML part of a package, parsed, and its text as it was read: a part whose text nodes
    are all as they were is not written again (lxml would write ``<v></v>`` as ``<v/>``: the same
    XML, other bytes)."""

    raw: bytes
    tree: Any
    texts: tuple[str, ...]

    @classmethod
    def read(cls, archive: zipfile.ZipFile, name: str, kind: str, raw: bytes | None = None) -> Part:
        raw = archive.read(name) if raw is None else raw
        tree = parse(raw, name, kind)
        return cls(raw, tree, tuple(tree.getroot().itertext()))

    def changed(self) -> bool:
        return tuple(self.tree.getroot().itertext()) != self.texts

    def write(self) -> bytes:
        return serialize(self.tree, self.raw)


def save(data: bytes, parts: dict[str, Part], files: dict[str, bytes] | None = None) -> bytes:
    """The package ``data`` with each of ``parts`` whose text changed written again, and ``files``
    written as given (in place of the package's file of that name, or added)."""
    return rewrite(
        data, {name: part.write() for name, part in parts.items() if part.changed()} | (files or {})
    )


def open_zip(data: bytes, kind: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise DocumentError(f"not a {kind} document: {e}") from e


def rewrite(data: bytes, replaced: dict[str, bytes]) -> bytes:
    """The package ``data`` with the files named in ``replaced`` given new contents; those it has
    no file of are added after the others, compressed."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
        names = set(source.namelist())
        for info in source.infolist():
            content = replaced[info.filename] if info.filename in replaced else source.read(info)
            # The same name, date, attributes and compression method; zipfile writes the sizes and
            # the CRC anew (and extra fields of its own: the source's could say zip64 twice).
            copy = zipfile.ZipInfo(info.filename, info.date_time)
            copy.compress_type, copy.comment = info.compress_type, info.comment
            copy.create_system, copy.external_attr = info.create_system, info.external_attr
            target.writestr(copy, content)
        for name, content in replaced.items():
            if name not in names:
                # (Dated as the package's first file: the same upload gives the same bytes.)
                added = zipfile.ZipInfo(name, source.infolist()[0].date_time)
                added.compress_type, added.external_attr = zipfile.ZIP_DEFLATED, 0o600 << 16
                target.writestr(added, content)
    return out.getvalue()
