"""``format: "html"``: translate the text of an HTML document or fragment, keep its markup.

Parsed with the standard library's HTML tokenizer (``html.parser``: maintained with CPython,
lenient like a browser, and it hands back each start tag exactly as written), never with regular
expressions. What comes out:

* every tag, attribute, comment and declaration is kept, in the same order, start tags byte for
  byte (end tags are written ``</name>``); attribute values are not translated;
* the text of each block (a paragraph, a heading, a list item, a table cell: whatever lies between
  block-level tags) is split into sentences across its inline tags (``<b>``, ``<a>``, ``<span>``,
  ...) and translated sentence by sentence; the inline tags are put back as ``app.formats.inline``
  explains (exactly at sentence edges, at the same relative word boundary inside a sentence);
* ``<script>``, ``<style>``, ``<code>``, ``<kbd>``, ``<samp>``, ``<svg>``, ``<math>``, and elements
  marked ``translate="no"`` or ``class="notranslate"``, are kept untranslated with everything
  inside them; an inline one (``<code>`` in a sentence) stays in its sentence, which is translated
  without it;
* entities: text is translated as the characters it means (``AT&amp;T`` is "AT&T" to the model),
  and written back with ``&``, ``<`` and ``>`` escaped and every character the source wrote as an
  entity (``&nbsp;``, ``&copy;``, ``&#8217;``) written as that same entity again;
* whitespace between sentences and blocks is kept; inside a sentence it is one space (HTML does not
  tell them apart; ``<pre>`` text loses its line breaks within a sentence).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser

from app.formats.blocks import SplitBlocks
from app.formats.inline import Block, Mark, Side, SplitBlock
from app.formats.limits import DocumentLimits, TooLarge

# fmt: off
# Phrasing content that may sit inside a sentence; any other tag ends a block.
INLINE = frozenset({
    "a", "abbr", "acronym", "b", "bdi", "bdo", "big", "cite", "code", "data", "del", "dfn", "em",
    "font", "i", "img", "input", "ins", "kbd", "label", "mark", "q", "ruby", "rp", "rt", "s", "samp",
    "small", "span", "strike", "strong", "sub", "sup", "time", "tt", "u", "var", "wbr",
})
VOID = frozenset({
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
    "track", "wbr",
})
# Kept as they are, content included.
UNTRANSLATED = frozenset({"script", "style", "code", "kbd", "samp", "svg", "math", "template"})
# Elements whose end tag may be left out: a start tag of the key closes the open ones of its value,
# as a browser does (``<li>a<li>b`` are siblings, not nested), so that such HTML does not count as
# deep. Any block-level start tag also closes an open <p>.
IMPLIED_END = {
    "li": {"li"}, "dt": {"dt", "dd"}, "dd": {"dt", "dd"}, "option": {"option"},
    "td": {"td", "th"}, "th": {"td", "th"}, "tr": {"tr", "td", "th"},
    "thead": {"thead", "tbody", "tfoot", "tr", "td", "th"},
    "tbody": {"thead", "tbody", "tfoot", "tr", "td", "th"},
    "tfoot": {"thead", "tbody", "tfoot", "tr", "td", "th"},
}
# fmt: on


class HtmlError(ValueError):
    """The text cannot be read as HTML (what the tokenizer itself refuses)."""


def untranslated(tag: str, attrs: list[tuple[str, str | None]]) -> bool:
    if tag in UNTRANSLATED:
        return True
    values = dict(attrs)
    return (values.get("translate") or "").strip().lower() == "no" or "notranslate" in (
        values.get("class") or ""
    ).split()


@dataclass
class Piece:
    """Markup inside a block, at an offset of the block's text."""

    raw: str
    atom: bool = False  # an untranslated element (spaces around it are kept in the translation)


@dataclass
class HtmlBlock:
    block: Block
    pieces: list[Piece]  # one per mark
    raw: str  # the block as written, for blocks with nothing to translate


@dataclass
class _Builder:
    """Collects blocks from the tokenizer's events."""

    items: list[HtmlBlock] = field(default_factory=list)
    entities: dict[str, str] = field(default_factory=dict)  # character -> the entity the source used
    text: list[str] = field(default_factory=list)
    length: int = 0
    marks: list[Mark] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)

    def add_text(self, decoded: str, raw: str) -> None:
        self.text.append(decoded)
        self.length += len(decoded)
        self.raw.append(raw)

    def add_mark(self, raw: str, side: Side, atom: bool = False) -> None:
        self.marks.append(Mark(self.length, side))
        self.pieces.append(Piece(raw, atom))
        self.raw.append(raw)

    def flush(self) -> None:
        if self.raw:
            block = Block("".join(self.text), tuple(self.marks))
            self.items.append(HtmlBlock(block, self.pieces, "".join(self.raw)))
        self.text, self.length, self.marks, self.pieces, self.raw = [], 0, [], [], []

    def add_boundary(self, raw: str) -> None:
        """Block-level markup: it ends the current block and stands as a block of its own."""
        self.flush()
        self.add_mark(raw, "before")
        self.flush()


class _Nesting:
    """The elements open at a point of a document, as far as depth is concerned (not a tree:
    nothing else is built from it), and how many there were: both bounded by ``limits``."""

    def __init__(self, limits: DocumentLimits) -> None:
        self.limits = limits
        self.open: list[str] = []
        self.elements = 0

    def start(self, tag: str, void: bool) -> None:
        self.elements += 1
        if self.elements > self.limits.max_elements:
            raise TooLarge(f"the HTML has more than {self.limits.max_elements:,} tags")
        if void:
            return
        closes = IMPLIED_END.get(tag, ())
        while self.open and (self.open[-1] in closes or (self.open[-1] == "p" and tag not in INLINE)):
            self.open.pop()
        self.open.append(tag)
        if len(self.open) > self.limits.max_depth:
            raise TooLarge(f"the HTML nests more than {self.limits.max_depth} elements deep")

    def end(self, tag: str) -> None:
        if tag in self.open:  # a stray end tag closes nothing
            del self.open[len(self.open) - 1 - self.open[::-1].index(tag) :]


class _Tokenizer(HTMLParser):
    def __init__(self, limits: DocumentLimits | None) -> None:
        super().__init__(convert_charrefs=False)  # entities come as events: they are kept
        self.out = _Builder()
        self.skipping: list[str] = []  # the untranslated element being copied, and nested same tags
        self.skipped: list[str] = []
        self.skip_inline = False
        self.chars = 0
        self.limits = limits
        self.nesting = None if limits is None else _Nesting(limits)

    # An untranslated element is copied whole, then stands as one piece.
    def _copy(self, raw: str) -> bool:
        if not self.skipping:
            return False
        self.skipped.append(raw)
        return True

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.nesting is not None:
            self.nesting.start(tag, void=tag in VOID)
        raw = self.get_starttag_text() or f"<{tag}>"
        if self._copy(raw):
            if tag == self.skipping[0] and tag not in VOID:
                self.skipping.append(tag)
            return
        if tag not in VOID and untranslated(tag, attrs):
            self.skipping, self.skipped, self.skip_inline = [tag], [raw], tag in INLINE
            return
        if tag in INLINE:
            self.out.add_mark(raw, "before")
        else:
            self.out.add_boundary(raw)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.nesting is not None:
            self.nesting.start(tag, void=True)
        raw = self.get_starttag_text() or f"<{tag}/>"
        if self._copy(raw):
            return
        if tag in INLINE:
            self.out.add_mark(raw, "before", atom=untranslated(tag, attrs))
        else:
            self.out.add_boundary(raw)

    def handle_endtag(self, tag: str) -> None:
        if self.nesting is not None:
            self.nesting.end(tag)
        raw = f"</{tag}>"
        if self.skipping:
            self.skipped.append(raw)
            if tag == self.skipping[0]:
                self.skipping.pop()
                if not self.skipping:
                    atom = "".join(self.skipped)
                    if self.skip_inline:
                        self.out.add_mark(atom, "before", atom=True)
                    else:
                        self.out.add_boundary(atom)
            return
        if tag in INLINE:
            self.out.add_mark(raw, "after")
        else:
            self.out.add_boundary(raw)

    def handle_data(self, data: str) -> None:
        if not self._copy(data):
            self._add_text(data, data)

    def _add_text(self, decoded: str, raw: str) -> None:
        """Text to translate, counted against the limit as it comes."""
        self.out.add_text(decoded, raw)
        self.chars += len(decoded)
        if self.limits is not None:
            self.limits.check_chars(self.chars)

    def _reference(self, raw: str) -> None:
        if self._copy(raw):
            return
        decoded = html.unescape(raw)
        if decoded == raw:  # not a known entity: plain text
            self._add_text(raw, raw)
            return
        if len(decoded) == 1:
            self.out.entities.setdefault(decoded, raw)
        self._add_text(decoded, raw)

    def handle_entityref(self, name: str) -> None:
        self._reference(f"&{name};")

    def handle_charref(self, name: str) -> None:
        self._reference(f"&#{name};")

    def _other(self, raw: str) -> None:
        if not self._copy(raw):
            self.out.add_mark(raw, "before")

    def handle_comment(self, data: str) -> None:
        self._other(f"<!--{data}-->")

    def handle_decl(self, decl: str) -> None:
        self._other(f"<!{decl}>")

    def handle_pi(self, data: str) -> None:
        self._other(f"<?{data}>")

    def unknown_decl(self, data: str) -> None:
        self._other(f"<![{data}]>")

    def finish(self) -> _Builder:
        self.close()
        if self.skipping:  # an untranslated element never closed: kept as it came
            self.out.add_boundary("".join(self.skipped))
        self.out.flush()
        return self.out


@dataclass(frozen=True)
class HtmlDocument:
    """A parsed document: its blocks, before any language is known."""

    blocks: tuple[HtmlBlock, ...]
    entities: dict[str, str]

    @classmethod
    def parse(cls, markup: str, limits: DocumentLimits | None = None) -> HtmlDocument:
        """``markup`` parsed; with ``limits``, ``TooLarge`` as soon as it crosses one (tags, depth,
        text), before the rest is read."""
        # Tags cost the tokenizer ~15 us each: count them first, at the speed of str.count, so that
        # 300,000 of them are refused in milliseconds, not after seconds of parsing. Every start tag
        # has a "<" that no "</" begins (the count is an upper bound: a "<" in a script or in text
        # counts too, and the tokenizer counts exactly afterwards).
        if limits is not None and markup.count("<") - markup.count("</") > limits.max_elements:
            raise TooLarge(f"the HTML has more than {limits.max_elements:,} tags")
        tokenizer = _Tokenizer(limits)
        try:
            tokenizer.feed(markup)
            out = tokenizer.finish()
        except TooLarge:
            raise
        except (AssertionError, ValueError) as e:  # the few inputs the tokenizer gives up on
            raise HtmlError(f"cannot parse HTML: {e}") from e
        return cls(tuple(out.items), out.entities)

    @property
    def text(self) -> str:
        """The text to translate, a line per block: what language identification looks at."""
        return "\n".join(b.block.text.strip() for b in self.blocks if b.block.text.strip())

    def split(self, language: str) -> HtmlText:
        return HtmlText(tuple(b.block.split(language) for b in self.blocks), self)


@dataclass(frozen=True)
class HtmlText(SplitBlocks):
    """A document split into sentences; ``join`` puts their translations back into its markup
    (the same protocol as ``app.translation.segments.SplitText``)."""

    document: HtmlDocument

    def join(self, translations: Sequence[str]) -> str:
        out = []
        placed_blocks = self.placed(translations)
        for item, split, placed in zip(self.document.blocks, self.splits, placed_blocks, strict=True):
            if placed is None:
                out.append(item.raw)
                continue
            text, offsets = placed
            out.append(self._render(split, text, offsets, item.pieces))
        return "".join(out)

    def _render(self, split: SplitBlock, text: str, offsets: Sequence[int], pieces: Sequence[Piece]) -> str:
        source = split.block.text
        out, cursor = [], 0
        for mark, offset, piece in zip(split.block.marks, offsets, pieces, strict=True):
            out.append(self._escape(text[cursor:offset]))
            cursor = offset
            if not piece.atom:
                out.append(piece.raw)
                continue
            # An untranslated element in a sentence: the translation around it has no space where
            # the source had one ("Rufen Sie <code>f()</code> auf." -> "Call <code>f()</code> up.").
            spaced_before = mark.offset == 0 or source[mark.offset - 1].isspace()
            spaced_after = mark.offset == len(source) or source[mark.offset].isspace()
            if spaced_before and offset > 0 and not text[offset - 1].isspace():
                out.append(" ")
            out.append(piece.raw)
            if spaced_after and offset < len(text) and not text[offset].isspace():
                out.append(" ")
        out.append(self._escape(text[cursor:]))
        return "".join(out)

    def escape(self, text: str) -> str:
        """``text`` as ``join`` writes it in the markup (where to find a term in the output)."""
        return self._escape(text)

    def _escape(self, text: str) -> str:
        entities = self.document.entities
        out = []
        for c in text:
            if c in entities:
                out.append(entities[c])
            elif c in "&<>":
                out.append(html.escape(c, quote=False))
            else:
                out.append(c)
        return "".join(out)
