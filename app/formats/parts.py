"""The XML parts of a zip package, parsed with lxml and written back in place of the originals.

The spreadsheet and OpenDocument formats change a few parts of their package (the shared strings,
``content.xml``) and keep every other file as it was: a library that loads the whole package and
saves it anew writes back only what it understood (openpyxl drops a workbook's charts and
pictures). ``rewrite`` copies the package file by file, in the same order, each with its own
``ZipInfo`` (name, date, attributes, compression method), the unchanged ones with the same
uncompressed bytes: an OpenDocument ``mimetype`` stays first and stored, as ODF requires.

Parts are parsed only after ``app.formats.package.check_package`` has streamed them (no DTD, within
the limits), and with a parser that could not expand an entity or load anything anyway.
"""

from __future__ import annotations

import io
import zipfile
from typing import Any

from lxml import etree

from app.formats.limits import DocumentError, Forbidden

XML_NS = "http://www.w3.org/XML/1998/namespace"
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
    """The tree as a part again, with the original's XML declaration (standalone or not)."""
    declared = original.lstrip().startswith(b"<?xml")
    out: bytes = etree.tostring(
        tree,
        xml_declaration=declared,
        encoding="UTF-8",
        standalone=tree.docinfo.standalone if declared else None,
    )
    return out


def open_zip(data: bytes, kind: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise DocumentError(f"not a {kind} document: {e}") from e


def rewrite(data: bytes, replaced: dict[str, bytes]) -> bytes:
    """The package ``data`` with the files named in ``replaced`` given new contents."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            content = replaced[info.filename] if info.filename in replaced else source.read(info)
            # The same name, date, attributes and compression method; zipfile writes the sizes and
            # the CRC anew (and extra fields of its own: the source's could say zip64 twice).
            copy = zipfile.ZipInfo(info.filename, info.date_time)
            copy.compress_type, copy.comment = info.compress_type, info.comment
            copy.create_system, copy.external_attr = info.create_system, info.external_attr
            target.writestr(copy, content)
    return out.getvalue()
