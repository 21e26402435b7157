"""XLIFF samples (1.2 and 2.0, built with lxml as a CAT tool would export them) and the check that
a translated copy kept its structure and is valid against the OASIS schema (tests/schemas/)."""

from __future__ import annotations

import io
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from lxml import etree
from lxml.builder import ElementMaker

NS12 = "urn:oasis:names:tc:xliff:document:1.2"
NS2 = "urn:oasis:names:tc:xliff:document:2.0"
SCHEMAS = Path(__file__).resolve().parent.parent / "schemas"
SCHEMA_FILES = {NS12: "xliff-core-1.2-strict.xsd", NS2: "xliff_core_2.0.xsd"}
# The codes whose ids a target must repeat, in the source's order (by local name).
CODES = ("g", "x", "bx", "ex", "ph", "bpt", "ept", "it", "mrk", "pc", "sc", "ec", "sm", "em", "cp")


def serialize(root: Any) -> bytes:
    tree = etree.ElementTree(root)
    return etree.tostring(tree, xml_declaration=True, encoding="UTF-8", pretty_print=True)


def xliff_12() -> bytes:
    """Strings of an app: groups, notes, every 1.2 inline code, a final and an approved unit, one
    not to translate, one segmented (seg-source), one whose target is still the untranslated copy."""
    E = ElementMaker(namespace=NS12, nsmap={None: NS12})
    root = E.xliff(
        E.file(
            E.header(E.note("Exported for translation.")),
            E.body(
                E.group(
                    {"id": "menu", "resname": "menu"},
                    E("trans-unit", {"id": "open"}, E.source("Open the file."), E.note("Menu item.")),
                    E(
                        "trans-unit",
                        {"id": "bold"},
                        E.source(
                            "Click the ", E.g({"id": "1", "ctype": "bold"}, "green button"), " to save."
                        ),
                    ),
                    E(
                        "trans-unit",
                        {"id": "count"},
                        E.source("You have ", E.x({"id": "2", "ctype": "x-placeholder"}), " new messages."),
                    ),
                ),
                E(
                    "trans-unit",
                    {"id": "native"},
                    E.source(
                        E.bpt({"id": "3"}, "<b>"),
                        "Warning",
                        E.ept({"id": "3"}, "</b>"),
                        ": the disk is full",
                        E.ph({"id": "4"}, "<br/>"),
                        " Delete some files.",
                    ),
                ),
                E(
                    "trans-unit",
                    {"id": "split"},
                    E.source("Begin ", E.bx({"id": "5"}), "here", E.ex({"id": "6"}), " and read on."),
                ),
                E(
                    "trans-unit",
                    {"id": "term"},
                    E.source("The ", E.mrk({"mtype": "term"}, "printer"), " is ready. Press start."),
                    E(
                        "seg-source",
                        E.mrk(
                            {"mtype": "seg", "mid": "1"},
                            "The ",
                            E.mrk({"mtype": "term"}, "printer"),
                            " is ready.",
                        ),
                        " ",
                        E.mrk({"mtype": "seg", "mid": "2"}, "Press start."),
                    ),
                ),
                E(
                    "trans-unit",
                    {"id": "copy"},
                    E.source("The old target is a copy."),
                    E.target({"state": "needs-translation"}, "The old target is a copy."),
                ),
                E("trans-unit", {"id": "brand", "translate": "no"}, E.source("Acme Writer")),
                E(
                    "trans-unit",
                    {"id": "done"},
                    E.source("Cancel"),
                    E.target({"state": "final"}, "Abbrechen"),
                ),
                E(
                    "trans-unit",
                    {"id": "approved", "approved": "yes"},
                    E.source("Help"),
                    E.target("Hilfe"),
                ),
            ),
            {"original": "strings.properties", "source-language": "en", "target-language": "de"},
            datatype="javapropertyresourcebundle",
        ),
        version="1.2",
    )
    root[0].addprevious(etree.Comment(" strings of the app "))
    return serialize(root)


def xliff_2() -> bytes:
    """Messages of a web page in XLIFF 2.0: original data for the codes, nested ``<pc>``, ``<ph>``,
    ``<sc>``/``<ec>``, ``<mrk>``, an ``<ignorable>``, a final segment and a unit not to translate."""
    E = ElementMaker(namespace=NS2, nsmap={None: NS2})
    root = E.xliff(
        E.file(
            E.notes(E.note("From the web page.")),
            E.unit(
                E.originalData(E.data("<b>", id="d1"), E.data("</b>", id="d2"), E.data("<br/>", id="d3")),
                E.segment(
                    E.source(
                        "Read the ",
                        E.pc(
                            "new ",
                            E.mrk("terms", id="m1", type="term"),
                            " of use",
                            id="1",
                            dataRefStart="d1",
                            dataRefEnd="d2",
                        ),
                        " first.",
                    ),
                    id="s1",
                ),
                E.ignorable(E.source(" ")),
                E.segment(E.source("Then sign here.", E.ph(id="2", dataRef="d3")), id="s2"),
                id="intro",
            ),
            E.group(
                E.unit(
                    E.segment(
                        E.source(
                            E.sc(id="3", dataRef="d1"),
                            "Important",
                            E.ec(startRef="3", dataRef="d2"),
                            " news.",
                        ),
                        id="s3",
                    ),
                    E.segment(E.source("Thank you."), E.target("Danke."), id="s4", state="final"),
                    id="news",
                ),
                E.unit(E.segment(E.source("Acme Cloud")), id="brand", translate="no"),
                id="page",
            ),
            id="f1",
        ),
        version="2.0",
        srcLang="en",
        trgLang="de",
    )
    return serialize(root)


SAMPLES: dict[str, Callable[[], bytes]] = {"strings.xlf": xliff_12, "messages.xliff": xliff_2}


@cache
def schema(namespace: str) -> etree.XMLSchema:
    return etree.XMLSchema(etree.parse(str(SCHEMAS / SCHEMA_FILES[namespace])))


def parse(data: bytes) -> Any:
    return etree.parse(io.BytesIO(data), etree.XMLParser(resolve_entities=False, no_network=True)).getroot()


def local(node: Any) -> str:
    return etree.QName(node).localname if isinstance(node.tag, str) else ""


def codes(container: Any) -> list[tuple[str, str | None]]:
    """The inline codes under ``container`` in document order, each with the attribute that names it."""
    out = []
    for node in container.iterdescendants():
        name = local(node)
        if name in CODES and not (name == "mrk" and node.get("mtype") == "seg"):
            out.append((name, node.get("id") or node.get("mid") or node.get("startRef") or node.get("mtype")))
    return out


def has_text(node: Any) -> bool:
    return bool("".join(node.itertext()).strip())


def translate_attribute(node: Any) -> str:
    for element in (node, *node.iterancestors()):
        if element.get("translate") is not None:
            return str(element.get("translate"))
    return "yes"


def check_structure(filename: str, original: bytes, translated: bytes) -> None:
    before, after = parse(original), parse(translated)
    ns = etree.QName(before).namespace
    assert etree.QName(after).namespace == ns and local(after) == "xliff"
    xsd = schema(ns)
    assert xsd.validate(etree.ElementTree(after)), f"{filename}: {xsd.error_log}"
    if ns == NS12:
        check_12(filename, before, after)
    else:
        check_2(filename, before, after)


def check_12(filename: str, before: Any, after: Any) -> None:
    name = f"{{{NS12}}}trans-unit"
    units = list(zip(before.iter(name), after.iter(name), strict=True))
    assert [u.get("id") for u, _ in units] == [v.get("id") for _, v in units]
    for unit, out in units:
        old_target = unit.find(f"{{{NS12}}}target")
        kept = (
            translate_attribute(unit) == "no"
            or unit.get("approved") == "yes"
            or (old_target is not None and old_target.get("state") in ("final", "signed-off"))
            or (old_target is not None and old_target.get("state") == "translated" and has_text(old_target))
        )
        if kept:
            assert etree.tostring(out) == etree.tostring(unit), f"{filename}: unit {unit.get('id')} changed"
            continue
        target = out.find(f"{{{NS12}}}target")
        assert target is not None, f"{filename}: unit {unit.get('id')} has no target"
        assert target.get("state") == "needs-review-translation"
        assert target.get("state-qualifier") == "mt-suggestion"
        # Right after the source (or seg-source): the order the schema asks for.
        source = out.find(f"{{{NS12}}}seg-source")
        source = source if source is not None else out.find(f"{{{NS12}}}source")
        assert source.getnext() is target
        assert codes(target) == codes(source), f"{filename}: unit {unit.get('id')}"
        segments = [m.get("mid") for m in target.iter(f"{{{NS12}}}mrk") if m.get("mtype") == "seg"]
        assert segments == [m.get("mid") for m in source.iter(f"{{{NS12}}}mrk") if m.get("mtype") == "seg"]
        # Everything but the target as it was (notes, source).
        assert [etree.tostring(c, with_tail=False) for c in out if c is not target] == [
            etree.tostring(c, with_tail=False) for c in unit if local(c) != "target"
        ]


def check_2(filename: str, before: Any, after: Any) -> None:
    units = list(zip(before.iter(f"{{{NS2}}}unit"), after.iter(f"{{{NS2}}}unit"), strict=True))
    assert [u.get("id") for u, _ in units] == [v.get("id") for _, v in units]
    for unit, out in units:
        if translate_attribute(unit) == "no":
            assert etree.tostring(out) == etree.tostring(unit), f"{filename}: unit {unit.get('id')} changed"
            continue
        pairs = list(zip(unit, out, strict=True))
        for old, new in pairs:
            old_target = old.find(f"{{{NS2}}}target")
            done = old.get("state") == "translated" and old_target is not None and has_text(old_target)
            if local(old) != "segment" or old.get("state") in ("final", "reviewed") or done:
                assert etree.tostring(new) == etree.tostring(old), f"{filename}: {local(old)} changed"
                continue
            assert new.get("state") == "translated"
            source, target = new.find(f"{{{NS2}}}source"), new.find(f"{{{NS2}}}target")
            assert target is not None and source.getnext() is target
            old_source = old.find(f"{{{NS2}}}source")
            assert etree.tostring(source, with_tail=False) == etree.tostring(old_source, with_tail=False)
            assert codes(target) == codes(source), f"{filename}: segment {old.get('id')}"
