"""XLIFF (.xlf, .xliff), the exchange format of CAT tools: 1.2 and 2.0/2.1, read with lxml.

What is translated, and how it is marked:

* 1.2: each ``<trans-unit>`` not marked ``translate="no"`` (on itself or an enclosing ``<group>``):
  its ``<source>`` goes into its ``<target>`` (made right after ``<source>``, or after
  ``<seg-source>`` where there is one, as the schema orders them; an existing target's content is
  replaced, its attributes kept). With a ``<seg-source>``, each ``<mrk mtype="seg">`` segment is
  translated on its own and the target is the seg-source with each segment's content translated,
  as 1.2 asks. The new target gets ``state="needs-review-translation"`` and
  ``state-qualifier="mt-suggestion"``: the 1.2 values for "a machine's translation, not yet read
  by a person" (``translated`` in Trados, memoQ or OmegaT counts as a translator's confirmed
  work; an MT draft should show as one, to be reviewed).
* 2.x: each ``<segment>`` of a ``<unit>`` not marked ``translate="no"`` (it is inherited from
  ``<file>`` and ``<group>``): ``<source>`` into ``<target>``, and the segment's
  ``state="translated"`` (2.x has no finer state; ``subState``, which refined the old one, goes).
  ``<ignorable>`` (whitespace between segments) is left as it is.
* A unit or segment that already holds a person's translation is left alone: 1.2 ``approved="yes"``
  or a target whose ``state`` is ``final`` or ``signed-off``, or ``translated`` with text; 2.x
  ``state="final"`` or ``reviewed``, or ``translated`` with a target that has text. So a file
  sent twice is translated again in 1.2, where the first pass marked its targets as suggestions,
  and kept in 2.x, where "translated" cannot tell a machine's work from a person's.

Inline codes stay, with their ids, as marks in the text (``app.formats.inline``): the paired ones
that hold text (1.2 ``<g>`` and ``<mrk>``, 2.x ``<pc>`` and ``<mrk>``) open and close around the
translated words; the others are copied whole to where their mark lands (1.2 ``<x/>``, ``<bx/>``,
``<ex/>`` and the native-code ``<ph>``, ``<bpt>``, ``<ept>``, ``<it>``; 2.x ``<ph/>``, ``<sc/>``,
``<ec/>``, ``<sm/>``, ``<em/>``, ``<cp/>``; anything of another namespace). Their content is code,
not text: a ``<sub>`` inside a 1.2 ``<ph>`` is not translated.

Not done: the target language is not known here (``join`` gets only translations), so a 1.2
``<file target-language>`` or 2.x ``<xliff trgLang>`` is left as it was (a CAT tool that exported
the file for translation set it); the text of a ``<mrk translate="no">`` (2.x) or
``<mrk mtype="protected">`` (1.2) is translated with the sentence around it.

Safety: parsed by lxml with no DTD loaded, no entity resolved and no network; a file that has a
DOCTYPE at all is refused (``Forbidden``) at the root's start, before any element is read, and
elements, comments and processing instructions are counted against ``max_elements`` as they are
read. Everything else is written back as lxml read it: namespaces and their prefixes, notes,
alt-trans, comments, processing instructions and the XML declaration (its encoding now UTF-8, which
the file is written in); lxml may change how an attribute is quoted or an empty element written.
"""

from __future__ import annotations

import copy
import io
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lxml import etree

from app.formats.documents import NOT_XML, UTF8_BOM, Review
from app.formats.inline import Block, Mark, Side, SplitBlock
from app.formats.limits import DocumentError, DocumentLimits, Forbidden, TooLarge

NS12 = "urn:oasis:names:tc:xliff:document:1.2"
VERSION_1 = ("", "urn:oasis:names:tc:xliff:document:1.1", NS12)  # 1.1 and 1.2 share their elements
VERSION_2 = ("urn:oasis:names:tc:xliff:document:2.0", "urn:oasis:names:tc:xliff:document:2.2")
MT_STATE_12 = {"state": "needs-review-translation", "state-qualifier": "mt-suggestion"}
NOTE_FROM = "machine-translation"  # who a review note is from (1.2 ``from``, 2.x ``category``)
KEPT_12 = ("final", "signed-off")  # and "translated" when the target has text
KEPT_2 = ("final", "reviewed")  # and "translated" when the target has text
# What may come before the root in a UTF-8 file that has no DOCTYPE, kept byte for byte.
PROLOG = re.compile(rb"(?:\s+|<\?.*?\?>|<!--.*?-->)*", re.DOTALL)
# A start tag (attribute values may hold ">"): the root's is kept as written, since lxml writes
# namespace declarations before attributes (``<xliff version="1.2" xmlns=...>`` would change).
START_TAG = re.compile(rb"""<(?:[^>"']|"[^"]*"|'[^']*')*>""")
ENCODING = re.compile(rb"""(encoding\s*=\s*)(["'])([^"']*)\2""")

# Inline elements by local name: which hold text (paired: marks where they open and close), and
# which side of a word the others attach to (None: by the space around them).
PAIRED = {1: ("g", "mrk"), 2: ("pc", "mrk")}
OPENS = ("bx", "bpt", "sc", "sm")
CLOSES = ("ex", "ept", "ec", "em")

Token = tuple[Literal["open", "close", "atom"], Any]  # and the source element it stands for


def read(kind: str, data: bytes, limits: DocumentLimits) -> XliffDocument:
    return XliffDocument.read(data, limits)


def parse(data: bytes, limits: DocumentLimits) -> Any:
    """The document's tree, read within the limits (module docstring)."""
    events = etree.iterparse(
        io.BytesIO(data),
        events=("start", "comment", "pi"),
        resolve_entities=False,
        no_network=True,
        load_dtd=False,
        huge_tree=False,
        strip_cdata=False,
    )
    nodes, rooted = 0, False
    try:
        for event, node in events:
            if not rooted and event == "start":  # the root: a DOCTYPE, if any, has been read
                rooted = True
                info = node.getroottree().docinfo
                if info.doctype or info.internalDTD is not None or info.system_url:
                    raise Forbidden("the XLIFF file has a DOCTYPE (a DTD or entity declarations): refused")
            nodes += 1
            if nodes > limits.max_elements:
                raise TooLarge(f"the XLIFF file has more than {limits.max_elements:,} XML elements")
    except etree.XMLSyntaxError as e:
        if "Excessive depth" in str(e):  # libxml2's own limit without huge_tree: 256 levels
            raise TooLarge(f"the XLIFF file nests its XML elements too deep: {e}") from e
        raise DocumentError(f"not well-formed XML: {e}") from e
    return events.root.getroottree()


def local(node: Any) -> str:
    return etree.QName(node).localname if isinstance(node.tag, str) else ""


def namespace(node: Any) -> str:
    return etree.QName(node).namespace or ""


def has_text(node: Any | None) -> bool:
    return node is not None and bool("".join(node.itertext()).strip())


def translatable(node: Any) -> bool:
    """``translate`` of the node or the nearest enclosing element that says (default yes)."""
    for element in (node, *node.iterancestors()):
        if element.get("translate") is not None:
            return bool(element.get("translate") != "no")
    return True


# --- inline content as a Block ---------------------------------------------------------------------


@dataclass(frozen=True)
class Inline:
    """One segment's source: its text with a mark for each inline code, and what each mark is."""

    block: Block
    tokens: tuple[Token, ...]
    spaced: tuple[bool, ...]  # per token: a placeholder with a space either side ("have {n} new")

    @classmethod
    def read(cls, container: Any, version: int) -> Inline:
        pieces: list[str] = []
        places: list[tuple[int, Side | None]] = []
        tokens: list[Token] = []
        length = 0

        def add(text: str | None) -> None:
            nonlocal length
            if text:
                pieces.append(text)
                length += len(text)

        def walk(parent: Any) -> None:
            add(parent.text)
            for child in parent:
                name = local(child)
                if name in PAIRED[version] and namespace(child) == namespace(container):
                    places.append((length, "before"))
                    tokens.append(("open", child))
                    walk(child)
                    places.append((length, "after"))
                    tokens.append(("close", child))
                else:  # a placeholder, a comment, an element of another namespace: copied whole
                    places.append((length, fixed_side(child)))
                    tokens.append(("atom", child))
                add(child.tail)

        walk(container)
        text = "".join(pieces)
        marks = tuple(Mark(offset, side or free_side(text, offset)) for offset, side in places)
        spaced = tuple(side is None and text[o - 1 : o + 1].isspace() and o > 0 for o, side in places)
        return cls(Block(text, marks), tuple(tokens), spaced)

    def write(self, target: Any, text: str, offsets: Sequence[int]) -> None:
        """``target``'s content made the translated ``text`` with each code at its offset."""
        for child in list(target):
            target.remove(child)
        target.text = None
        stack = [target]

        def put(piece: str) -> None:
            piece = NOT_XML.sub("", piece)
            if not piece:
                return
            parent = stack[-1]
            if len(parent):
                parent[-1].tail = (parent[-1].tail or "") + piece
            else:
                parent.text = (parent.text or "") + piece

        cursor = 0
        for offset, (kind, source), spaced in zip(offsets, self.tokens, self.spaced, strict=True):
            put(text[cursor:offset])
            cursor = offset
            # The sentence's whitespace was collapsed, so a placeholder between two spaces lands
            # against a word ("HAVE{n} NEW"): it gets its space back.
            space_before = spaced and offset > 0 and not text[offset - 1].isspace()
            if kind == "open":  # same name and attributes (its id), new content
                stack.append(etree.SubElement(stack[-1], source.tag, attrib=dict(source.attrib)))
            elif kind == "close":
                stack.pop()
            else:
                put(" " if space_before else "")
                atom = copy.deepcopy(source)
                atom.tail = None
                stack[-1].append(atom)
                put(" " if spaced and offset < len(text) and not text[offset].isspace() else "")
        put(text[cursor:])


def fixed_side(code: Any) -> Side | None:
    """The side a code that opens or closes something attaches to (None: see ``free_side``)."""
    name = local(code)
    if name in OPENS or (name == "it" and code.get("pos") == "open"):
        return "before"
    if name in CLOSES or (name == "it" and code.get("pos") == "close"):
        return "after"
    return None


def free_side(text: str, offset: int) -> Side:
    """A placeholder goes with the word after it, unless a space (or the end) follows it in the
    source: then with the word before (``"Save {x} files"``: ``{x}`` stays after "Save")."""
    if offset > 0 and (offset == len(text) or text[offset].isspace()):
        return "after"
    return "before"


def place_after(node: Any, new: Any) -> None:
    """``new`` right after ``node``, indented as ``node`` is."""
    previous = node.getprevious()
    indent = node.getparent().text if previous is None else previous.tail
    node.addnext(new)
    new.tail = node.tail
    if indent and not indent.strip():
        node.tail = indent


# --- units ------------------------------------------------------------------------------------------


class Unit12:
    """A 1.2 ``<trans-unit>``: one segment (its source), or one per seg-source ``mrk``."""

    def __init__(self, unit: Any) -> None:
        self.unit = unit
        self.ns = namespace(unit)
        self.source = unit.find(self.q("source"))
        self.segments = self.seg_source_segments(self.seg_source)
        containers = self.segments if self.segments else [self.source]
        self.inlines = tuple(Inline.read(c, 1) for c in containers)

    def q(self, name: str) -> str:
        return f"{{{self.ns}}}{name}" if self.ns else name

    @property
    def seg_source(self) -> Any | None:
        return self.unit.find(self.q("seg-source"))

    def seg_source_segments(self, seg_source: Any | None) -> list[Any]:
        if seg_source is None:
            return []
        return [m for m in seg_source.iter(self.q("mrk")) if m.get("mtype") == "seg"]

    @staticmethod
    def wanted(unit: Any) -> bool:
        if not translatable(unit) or unit.get("approved") == "yes":
            return False
        ns = namespace(unit)
        if unit.find(f"{{{ns}}}source" if ns else "source") is None:
            return False
        target = unit.find(f"{{{ns}}}target" if ns else "target")
        state = None if target is None else target.get("state")
        return not (state in KEPT_12 or (state == "translated" and has_text(target)))

    def targets(self) -> list[Any]:
        """The elements the translations go into (the target made or emptied), one per inline."""
        target = self.unit.find(self.q("target"))
        if target is None:
            before = self.seg_source if self.seg_source is not None else self.source
            target = etree.SubElement(self.unit, self.q("target"))  # in the unit's namespace, prefix
            place_after(before, target)
        for name, value in MT_STATE_12.items():
            target.set(name, value)
        if not self.segments:
            return [target]
        # The target is the seg-source, each segment's content to be translated.
        for child in list(target):
            target.remove(child)
        segmented = copy.deepcopy(self.seg_source)
        assert segmented is not None  # there are segments
        target.text = segmented.text
        for child in segmented:
            target.append(child)
        return [m for m in target.iter(self.q("mrk")) if m.get("mtype") == "seg"]

    def flag(self, text: str) -> None:
        """Marked for review (after ``targets``): its target stays a suggestion to review, and a
        ``<note>`` right after it says why."""
        target = self.unit.find(self.q("target"))
        note = etree.Element(self.q("note"), attrib={"from": NOTE_FROM, "priority": "1"})
        note.text = text
        place_after(target, note)


class Segment2:
    """A 2.x ``<segment>``."""

    def __init__(self, segment: Any) -> None:
        self.segment = segment
        self.ns = namespace(segment)
        self.source = segment.find(f"{{{self.ns}}}source")
        self.inlines = (Inline.read(self.source, 2),)

    @staticmethod
    def wanted(segment: Any) -> bool:
        ns = namespace(segment)
        if segment.find(f"{{{ns}}}source") is None:
            return False
        state = segment.get("state")
        return not (state in KEPT_2 or (state == "translated" and has_text(segment.find(f"{{{ns}}}target"))))

    def targets(self) -> list[Any]:
        target = self.segment.find(f"{{{self.ns}}}target")
        if target is None:
            target = etree.SubElement(self.segment, f"{{{self.ns}}}target")
            place_after(self.source, target)
        self.segment.set("state", "translated")
        self.segment.attrib.pop("subState", None)
        return [target]

    def flag(self, text: str) -> None:
        """Marked for review (after ``targets``): the segment is ``initial`` again (its target a
        draft, not a translation), and its unit's ``<notes>`` say why (made where 2.x puts them:
        before the unit's first XLIFF element)."""
        self.segment.set("state", "initial")
        unit, q = self.segment.getparent(), f"{{{self.ns}}}"
        notes = unit.find(f"{q}notes")
        if notes is None:
            notes = etree.Element(f"{q}notes")
            first = next(c for c in unit if isinstance(c.tag, str) and namespace(c) == self.ns)
            previous = first.getprevious()
            notes.tail = unit.text if previous is None else previous.tail
            first.addprevious(notes)
        name = self.segment.get("id")
        attributes = {"category": NOTE_FROM, "appliesTo": "target", "priority": "1"}
        note = etree.SubElement(notes, f"{q}note", attrib=attributes)
        note.text = f"Segment {name}: {text}" if name else text


Unit = Unit12 | Segment2


def units(root: Any) -> Iterator[Unit]:
    ns = namespace(root)
    if ns in VERSION_2:
        for unit in root.iter(f"{{{ns}}}unit"):
            if translatable(unit):
                for segment in unit.iterchildren(f"{{{ns}}}segment"):
                    if Segment2.wanted(segment):
                        yield Segment2(segment)
    else:
        for unit in root.iter(f"{{{ns}}}trans-unit" if ns else "trans-unit"):
            if Unit12.wanted(unit):
                yield Unit12(unit)


# --- the document -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class XliffDocument:
    tree: Any  # lxml.etree._ElementTree
    prolog: bytes | None  # the bytes before the root (BOM, XML declaration, comments) if UTF-8
    root_tag: bytes  # the root's start tag as the file has it (b"" if not UTF-8 or empty)
    epilog: bytes  # the space after the root's end tag
    units: tuple[Unit, ...]

    @classmethod
    def read(cls, data: bytes, limits: DocumentLimits) -> XliffDocument:
        tree = parse(data, limits)
        root = tree.getroot()
        if local(root) != "xliff" or namespace(root) not in VERSION_1 + VERSION_2:
            raise DocumentError(f"not an XLIFF document: its root element is <{root.tag}>, not <xliff>")
        bom = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
        end = match.end() if (match := PROLOG.match(data, bom)) else bom
        prolog: bytes | None = data[:end]
        encoding = (tree.docinfo.encoding or "UTF-8").upper().replace("_", "-")
        if encoding not in ("UTF-8", "UTF8", "US-ASCII", "ASCII"):
            prolog = None  # UTF-16, Latin-1...: lxml writes a new declaration
        elif (declared := ENCODING.search(prolog or b"")) and declared.group(3).upper() != b"UTF-8":
            prolog = ENCODING.sub(rb"\1\2UTF-8\2", prolog or b"", count=1)  # ASCII: what is written is UTF-8
        tag = START_TAG.match(data, end)
        root_tag = tag.group() if prolog is not None and tag and not tag.group().endswith(b"/>") else b""
        epilog = data[len(data.rstrip()) :]
        found, chars = [], 0
        for unit in units(root):
            chars += sum(len(inline.block.text) for inline in unit.inlines)
            limits.check_chars(chars)  # as the text accumulates: stop at the unit that crosses it
            found.append(unit)
        return cls(tree, prolog, root_tag, epilog, tuple(found))

    @property
    def text(self) -> str:
        blocks = (inline.block.text.strip() for unit in self.units for inline in unit.inlines)
        return "\n".join(b for b in blocks if b)

    def split(self, language: str) -> SplitXliff:
        return SplitXliff(self, tuple(tuple(i.block.split(language) for i in u.inlines) for u in self.units))


@dataclass(frozen=True)
class SplitXliff:
    source: XliffDocument
    splits: tuple[tuple[SplitBlock, ...], ...]  # per unit, per segment

    @property
    def sentences(self) -> tuple[str, ...]:
        return tuple(s for unit in self.splits for split in unit for s in split.sentences)

    def join(self, translations: Sequence[str], review: Review | None = None) -> bytes:
        """The file with its units translated (written once: the tree is changed); each unit (1.2)
        or segment (2.x) that holds a sentence of ``review`` flagged (``Unit12.flag``,
        ``Segment2.flag``)."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"expected {len(self.sentences)} translations, got {len(translations)}")
        start = 0
        for unit, splits in zip(self.source.units, self.splits, strict=True):
            first = start
            for target, inline, split in zip(unit.targets(), unit.inlines, splits, strict=True):
                count = len(split.sentences)
                text, offsets = split.place(translations[start : start + count])
                start += count
                inline.write(target, text, offsets)
            lowest = review.lowest(first, start) if review is not None else None
            if lowest is not None and review is not None:
                unit.flag(review.note(lowest))
        tree, prolog = self.source.tree, self.source.prolog
        if prolog is None:
            return etree.tostring(tree, encoding="UTF-8", xml_declaration=True) + self.source.epilog
        root = tree.getroot()
        after = b"".join(etree.tostring(node) for node in root.itersiblings())  # comments, PIs
        body = etree.tostring(root, encoding="UTF-8")
        if self.source.root_tag and (tag := START_TAG.match(body)):
            body = self.source.root_tag + body[tag.end() :]
        return prolog + body + after + self.source.epilog
