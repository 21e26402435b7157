"""Markdown (.md, .markdown): parsed with markdown-it-py (CommonMark, plus GitHub's tables and
strikethrough), translated by rewriting only the text inside the source, so that everything else
stays byte for byte as it was.

Translated: the inline text of paragraphs, headings (ATX and setext), list items, block quotes and
table cells, link text and emphasis included. Each such text is one block (``app.formats.inline``)
whose markup is marks: emphasis and strikethrough delimiters, a link's ``[`` and its ``](url
"title")``, and each line break with the next line's prefix (``> ``, a list item's indentation),
so a paragraph keeps its lines (as long as the translation has words for each) and every line its
prefix. Code spans, images (their alt text too), autolinks, inline HTML and a task item's ``[ ]``
stay in their sentence untouched, as ``<code>`` does in HTML. Backslash escapes and entities are
text to the model (``AT&amp;T`` is "AT&T") and written back the way the source wrote them. How the
translation is written back around the markup: ``app.formats.markdown_text``.

Not translated, kept exactly: code blocks (fenced and indented), HTML blocks, link reference
definitions, front matter (``---`` YAML or ``+++`` TOML at the top), thematic breaks, and every
byte of markup outside the text. A text whose place in the source cannot be found again (a tab
expanded inside a block quote's prefix, say) is left as it was rather than guessed.

markdown-it-py gives block tokens with source line maps but inline tokens without offsets, so the
inline rules are wrapped to record where each one matched: that is what tells text from markup.
Limits: ``max_elements`` counts block and inline tokens as they are made, ``max_depth`` the blocks
open at once (a nesting too deep for Python's stack is refused the same way), ``check_chars`` the
text. markdown-it-py makes ~50,000 tokens a second, so the element limit also bounds the time.

Not done: a translation's own Markdown characters (a "*" or "_" the model writes) are not escaped,
and GitHub's footnotes, math and definition lists are read as CommonMark reads them (as text).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.rules_inline import StateInline

from app.formats.blocks import SplitBlocks
from app.formats.documents import Review, decode, encode
from app.formats.inline import Block, Mark
from app.formats.limits import DocumentLimits, TooLarge
from app.formats.markdown_text import Piece, Span, render, within_words

FRONT_MATTER = re.compile(r"\A(---|\+\+\+)[ \t]*\n.*?^(?:\1|\.\.\.)[ \t]*$", re.DOTALL | re.MULTILINE)
LEAVES = ("paragraph", "heading", "lheading", "table")  # the block rules whose inline text we translate
ATOMS = ("backticks", "image", "autolink", "html_inline")  # inline rules whose match stays whole
TASK = re.compile(r"\[[ xX]\](?=\s)")
INLINE_NESTING = 20  # markdown-it's own default for links and emphasis inside each other


def read(kind: str, data: bytes, limits: DocumentLimits) -> MarkdownDocument:
    text, bom = decode(data)
    crlf = "\r\n" in text
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    # Front matter is not Markdown (markdown-it would read YAML's "---" as a heading underline):
    # blanked out for the parser, with every offset kept, and never rewritten.
    match = FRONT_MATTER.match(text)
    parsed = re.sub(r"[^\n]", " ", match.group()) + text[match.end() :] if match else text
    spans = Reader(limits).read(parsed)
    return MarkdownDocument(text, tuple(spans), crlf, bom)


class Reader:
    """markdown-it with its block rules wrapped (limits, and where each leaf's lines start) and its
    inline rules wrapped (what each matched in the leaf's text)."""

    def __init__(self, limits: DocumentLimits) -> None:
        self.limits = limits
        # Block nesting is bounded by max_depth (checked in the wrapper), not cut off silently.
        md = MarkdownIt("commonmark", {"maxNesting": limits.max_depth + 8}).enable(["table", "strikethrough"])
        md.disable(["inline", "text_join"])  # the inline text is parsed here, leaf by leaf
        md.inline.ruler2.disable("fragments_join")  # keep unmatched delimiters their own tokens
        for rule in list(md.block.ruler.__rules__):
            md.block.ruler.at(rule.name, self.block_rule(rule.name, rule.fn), {"alt": rule.alt})
        for inline in list(md.inline.ruler.__rules__):
            md.inline.ruler.at(inline.name, self.inline_rule(inline.name, inline.fn), {"alt": inline.alt})
        self.md = md
        self.elements = 0
        self.chars = 0
        self.state: StateInline | None = None  # the leaf being read (an image's alt text has its own)
        self.events: list[tuple[str, int, int, list[tuple[Any, int]]]] = []

    def block_rule(self, name: str, fn: Callable[..., bool]) -> Callable[..., bool]:
        def rule(state: Any, start: int, end: int, silent: bool) -> bool:
            # Checked as each block starts, so that a bomb stops early, not once its list is read.
            if state.level > self.limits.max_depth:
                raise TooLarge(f"the Markdown nests more than {self.limits.max_depth} blocks deep")
            if len(state.tokens) > self.limits.max_elements:
                raise TooLarge(f"the Markdown has more than {self.limits.max_elements:,} elements")
            count = len(state.tokens)
            ok = fn(state, start, end, silent)
            if (
                ok and not silent and name in LEAVES
            ):  # where each of its lines starts, as nested blocks see it
                for token in state.tokens[count:]:
                    if token.type == "inline" and token.map:
                        lines = range(token.map[0], token.map[1])
                        token.meta["lines"] = [
                            (state.bMarks[i] + state.tShift[i], state.eMarks[i]) for i in lines
                        ]
            return ok

        return rule

    def inline_rule(
        self, name: str, fn: Callable[[StateInline, bool], bool]
    ) -> Callable[[StateInline, bool], bool]:
        def rule(state: StateInline, silent: bool) -> bool:
            start, count = state.pos, len(state.tokens)
            ok = fn(state, silent)
            if ok and not silent and state is self.state:
                if self.elements + len(state.tokens) > self.limits.max_elements:
                    raise TooLarge(f"the Markdown has more than {self.limits.max_elements:,} elements")
                # Token lengths now: matching emphasis pairs later empties some of them.
                self.events.append(
                    (name, start, state.pos, [(t, len(t.content)) for t in state.tokens[count:]])
                )
            return ok

        return rule

    def read(self, src: str) -> list[Span]:
        env: dict[str, Any] = {}
        try:
            tokens = self.md.parse(src, env)
        except RecursionError as e:
            raise TooLarge(f"the Markdown nests too deep (at most {self.limits.max_depth} blocks)") from e
        self.elements = len(tokens)
        self.md.options["maxNesting"] = INLINE_NESTING
        spans = []
        cursors: dict[int, int] = {}  # a table row's line: where its next cell is looked for
        for i, token in enumerate(tokens):
            if token.type != "inline" or "lines" not in token.meta or not token.content.strip():
                continue
            for segments in self.segments(src, tokens[i - 1], token, cursors):
                span = self.span(src, segments, token.content, env)
                if span is not None:
                    spans.append(span)
        return spans

    def segments(
        self, src: str, opener: Any, token: Any, cursors: dict[int, int]
    ) -> list[list[tuple[int, int]]]:
        """Where the inline ``token``'s text is in ``src``: one (start, end) per line; none when it
        cannot be found again."""
        lines, content = token.meta["lines"], token.content
        if opener.type in ("th_open", "td_open"):
            # A cell: found after the cells before it on its row (its `\|` is `|` in the content).
            start, end = lines[0]
            pattern = re.compile(r"\\?\|".join(re.escape(p) for p in content.split("|")))
            match = pattern.search(src, max(start, cursors.get(start, start)), end)
            if match is None:
                return []
            cursors[start] = match.end()
            return [[match.span()]]
        if opener.type == "heading_open" and opener.markup.startswith("#"):
            start, end = lines[0]
            at = src.find(content, start, end)
            return [[(at, at + len(content))]] if at >= 0 else []
        count = content.count("\n") + 1
        if len(lines) < count:
            return []
        segments = [(start, end) for start, end in lines[:count]]
        last_start, last_end = segments[-1]
        segments[-1] = (last_start, last_start + len(src[last_start:last_end].rstrip()))
        return [segments]

    def span(self, src: str, segments: list[tuple[int, int]], content: str, env: Any) -> Span | None:
        text = "\n".join(src[a:b] for a, b in segments)
        if "".join(text.split()).replace("\\", "") != "".join(content.split()).replace("\\", ""):
            return None  # not where markdown-it read it: left as it was
        classes = self.classify(text, env)
        return build_span(src, text, segments, classes, self.limits, self)

    def classify(self, text: str, env: Any) -> list[tuple[str, int, int, str]]:
        """``text`` cut into runs: ("text" | "markup" | "atom" | "br" | "special", start, end, decoded)."""
        tokens: list[Any] = []
        state = StateInline(text, self.md, env, tokens)
        self.state, self.events = state, []
        self.md.inline.tokenize(state)
        for rule in self.md.inline.ruler2.getRules(""):
            rule(state)
        self.elements += len(tokens)
        if self.elements > self.limits.max_elements:
            raise TooLarge(f"the Markdown has more than {self.limits.max_elements:,} elements")
        kinds: list[tuple[str, int, int, str]] = []
        for name, start, end, new in self.events:
            kinds += event_runs(state, name, start, end, new)
        if TASK.match(text) and not any(start < 3 for _, start, _, _ in kinds):
            kinds.append(("atom", 0, 3, ""))  # a task list item's "[ ]" or "[x]" (GitHub's)
        kinds.sort(key=lambda k: k[1])
        runs, cursor = [], 0
        for kind, start, end, decoded in kinds:
            if start < cursor:  # a newline's spaces claimed by an earlier run: theirs
                start = cursor
                if start >= end:
                    continue
            if start > cursor:
                runs.append(("text", cursor, start, text[cursor:start]))
            runs.append((kind, start, end, decoded))
            cursor = end
        if cursor < len(text):
            runs.append(("text", cursor, len(text), text[cursor:]))
        return merge_atoms(runs)


def event_runs(
    state: StateInline, name: str, start: int, end: int, pushed: list[tuple[Any, int]]
) -> list[tuple[str, int, int, str]]:
    """What one inline rule's match was: markup, text, or text written specially."""
    src, new = state.src, [t for t, _ in pushed]
    if name == "newline" or (name == "escape" and any(t.type == "hardbreak" for t in new)):
        while start > 0 and src[start - 1] == " ":  # a hard break's trailing spaces are markup too
            start -= 1
        return [("br", start, end, " ")]
    if name in ("escape", "entity"):
        special = [t for t in new if t.type == "text_special"]
        return [("special", start, end, special[0].content)] if special else []
    if name in ATOMS:
        return [("atom", start, end, "")] if any(t.type != "text" for t in new) else []
    if name in ("emphasis", "strikethrough"):
        # Its delimiters are text tokens until the pairs are matched: unmatched ones are text.
        out, position = [], end
        for token, length in reversed(pushed):  # one token a delimiter character ("~~": two)
            if position <= start:
                break
            position -= length
            if token.type != "text" or not token.content:
                out.append(("markup", position, position + length, ""))
        return out
    if name == "link":
        saved = state.pos
        label_end = state.md.helpers.parseLinkLabel(state, start, True)
        state.pos = saved
        tail = src[label_end:end]
        reference = " ".join(src[start + 1 : label_end].split()) if tail in ("]", "][]") else ""
        return [("link", start, start + 1, ""), ("markup", label_end, end, reference)]
    return []  # "text", or a rule that only added to the pending text


def merge_atoms(runs: Sequence[tuple[str, int, int, str]]) -> list[tuple[str, int, int, str]]:
    """Markup with nothing but atoms inside and around it is one atom: ``[`zlib`](url)`` and
    ``**`code`**`` move together (apart, the link's "[" could go to another word than its code)."""
    out: list[tuple[str, int, int, str]] = []
    group: list[tuple[str, int, int, str]] = []

    def close() -> None:
        if any(kind == "atom" for kind, _, _, _ in group):
            # A link opened in it: where the link's text starts, for a "[text][]" to compare.
            opener = [end - group[0][1] for kind, _, end, _ in group if kind == "link"]
            out.append(("atom", group[0][1], group[-1][2], str(opener[-1]) if opener else ""))
        else:
            out.extend(group)
        group.clear()

    for run in runs:
        if run[0] == "markup" and run[3]:  # a "[text][]" link's end stays apart: it may change
            close()
            out.append(run)
            continue
        if run[0] in ("atom", "markup", "link") and (not group or group[-1][2] == run[1]):
            group.append(run)
            continue
        close()
        if run[0] in ("atom", "markup", "link"):
            group.append(run)
        else:
            out.append(run)
    close()
    return out


def build_span(
    src: str,
    text: str,
    segments: Sequence[tuple[int, int]],
    runs: Sequence[tuple[str, int, int, str]],
    limits: DocumentLimits,
    reader: Reader,
) -> Span | None:
    """The block and its pieces, the runs' places in ``text`` mapped back to ``src``."""
    offsets = []  # where each segment starts in text
    at = 0
    for a, b in segments:
        offsets.append(at)
        at += b - a + 1

    def source(i: int, end: bool) -> int:
        """``text`` offset ``i`` in ``src`` (``end``: the position after the character ``i - 1``)."""
        k = bisect.bisect_right(offsets, i - 1 if end else i) - 1
        a, b = segments[k]
        inside = (i - 1 if end else i) - offsets[k]
        if inside < b - a:
            return a + inside + (1 if end else 0)
        return segments[k + 1][0] if end else b  # the line break: all of its prefix

    out: list[str] = []
    marks: list[Mark] = []
    pieces: list[Piece] = []
    written: dict[str, str] = {}
    length = 0
    for kind, start, end, decoded in runs:
        if kind in ("text", "special"):
            out.append(decoded)
            length += len(decoded)
            raw = text[start:end]
            if kind == "special" and len(decoded) == 1:
                written.setdefault(decoded, raw)
            continue
        raw = src[source(start, False) : source(end, True)]
        marks.append(Mark(length, "after" if kind == "br" else "before"))
        pieces.append(
            Piece(
                raw,
                atom=kind == "atom",
                br=kind == "br",
                opens_link=1 if kind == "link" else int(decoded) if kind == "atom" and decoded else -1,
                reference=decoded if kind == "markup" else "",
            )
        )
        if kind == "br":
            out.append(" ")
            length += 1
    block_text = "".join(out)
    reader.chars += len(block_text)
    limits.check_chars(reader.chars)
    # A mark with a space after it closes something: it goes with the word before it.
    marks = [
        Mark(
            m.offset,
            "after" if m.side == "after" or block_text[m.offset : m.offset + 1].isspace() else "before",
        )
        for m in marks
    ]
    pieces = [
        dataclasses.replace(p, follows=block_text[m.offset + 1 : m.offset + 12]) if p.br else p
        for p, m in zip(pieces, marks, strict=True)
    ]
    return Span(segments[0][0], segments[-1][1], Block(block_text, tuple(marks)), tuple(pieces), written)


@dataclass(frozen=True)
class MarkdownDocument:
    source: str  # "\n" line ends
    spans: tuple[Span, ...]
    crlf: bool
    bom: bool

    @property
    def text(self) -> str:
        return "\n".join(s.block.text for s in self.spans if s.block.text.strip())

    def split(self, language: str) -> SplitMarkdown:
        return SplitMarkdown(tuple(s.block.split(language) for s in self.spans), self)


@dataclass(frozen=True)
class SplitMarkdown(SplitBlocks):
    document: MarkdownDocument

    def join(self, translations: Sequence[str], review: Review | None = None) -> bytes:
        # (``review``: this format has no place for a reviewer's mark; the file is written as without it.)
        source, out, cursor = self.document.source, [], 0
        for span, placed in zip(self.document.spans, self.placed(translations), strict=True):
            if placed is None:
                continue
            text, offsets = placed
            offsets = within_words(span.block, text, offsets)
            out += [source[cursor : span.start], render(span, text, offsets)]
            cursor = span.end
        out.append(source[cursor:])
        joined = "".join(out)
        return encode(joined.replace("\n", "\r\n") if self.document.crlf else joined, self.document.bom)
