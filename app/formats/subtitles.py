"""Subtitles: SubRip (.srt) and WebVTT (.vtt), read with a small parser of our own.

What is kept, byte for byte: every line that is not cue text (cue numbers and identifiers, the
timing lines with their cue settings such as ``align:start line:0``, the ``WEBVTT`` header, NOTE,
STYLE and REGION blocks, blank lines, a byte-order mark, CRLF line ends). What is translated: the
text of each cue, its lines joined with a space into one block (``app.formats.inline``) whose
tags (``<i>``, ``<b>``, ``<font ...>``, ``<c.yellow>``, ``<v Speaker>``, ``<00:01.000>``,
``{\\an8}``) are marks that go back around the translated words. A dialogue cue (every line
starts with "-", one speaker a line) is translated line by line instead.

A file that leaves out the blank line between two cues still has each timing line kept as a
timing (with the cue number before it), never translated as text.

A sentence that runs across two cues is translated as two pieces (one per cue): each cue keeps its
own timing, which is what viewers see, and a cue's text never moves to another cue's time.

The translation is wrapped again to the cue's shape: as many lines as the source cue had (one
becomes two when it would be longer than the width), balanced, each at most
max(longest source line, 42) characters wide where the words allow.

Why not a library: ``srt`` renumbers cues and re-renders timings when it composes, ``webvtt-py``
and ``pysubs2`` rebuild the file from their own model (timings re-formatted, identifiers, NOTE
blocks or cue settings changed or dropped). The block structure of both formats is simple (blank
lines between blocks, a timing line with "-->"), and parsing it ourselves keeps every line we do
not translate exactly as it was.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass

from app.formats.documents import Review, decode, encode
from app.formats.inline import Block, Mark, SplitBlock
from app.formats.limits import DocumentError, DocumentLimits, TooLarge

MIN_WIDTH = 42  # characters a subtitle line may have whatever the source's lines (a common norm)
# Cue-text tags of WebVTT (and the HTML-like ones SubRip players accept): <i>, </i>, <v Bob>,
# <c.red.bg>, <lang en>, <font color="x">, timestamps <00:01.000>; SubRip's {\an8} position codes.
TAG = re.compile(r"<(?:/?[A-Za-z][\w.-]*(?:[ \t][^<>\n]*)?|\d[\d:.]*)>|\{\\[^{}\n]*\}")
VTT_ENTITY = re.compile(r"&(?:amp|lt|gt|nbsp|lrm|rlm);")
KEPT_VTT_BLOCKS = ("NOTE", "STYLE", "REGION", "WEBVTT")


def read(kind: str, data: bytes, limits: DocumentLimits) -> Subtitles:
    text, bom = decode(data)
    newline = "\r\n" if "\r\n" in text else "\n"
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    vtt = kind == ".vtt"
    if vtt and not re.match(r"WEBVTT(?:[ \t].*)?$", lines[0]):
        raise DocumentError("not a WebVTT file: it does not start with a WEBVTT line")
    cues = parse_cues(lines, vtt, limits)
    if not cues and text.strip() and not vtt:
        raise DocumentError("not a SubRip file: no cue with a timing line (00:00:01,000 --> 00:00:02,000)")
    return Subtitles(tuple(lines), cues, vtt, newline, bom)


@dataclass(frozen=True)
class Cue:
    """The text lines ``start:end`` of the file (one cue's), as blocks to translate."""

    start: int
    end: int
    blocks: tuple[Block, ...]
    tags: tuple[tuple[str, ...], ...]  # each block's marks' source text
    width: int  # the widest line the translation should have
    lines: int  # how many lines it should have (dialogue: one per block)
    dialogue: bool


def parse_cues(lines: Sequence[str], vtt: bool, limits: DocumentLimits) -> tuple[Cue, ...]:
    cues: list[Cue] = []
    chars = 0
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].strip():
            i += 1
        block = lines[start:i]  # one block: a cue, a header, a NOTE...
        if vtt and block[0].startswith(KEPT_VTT_BLOCKS):
            continue  # kept as it is
        for first, end in cue_text(block):
            if len(cues) >= limits.max_elements:
                raise TooLarge(f"too many subtitle cues in the file (at most {limits.max_elements:,})")
            cue = make_cue(block[first:end], start + first, vtt)
            chars += sum(len(b.text) for b in cue.blocks)
            limits.check_chars(chars)
            cues.append(cue)
    return tuple(cues)


def cue_text(block: Sequence[str]) -> list[tuple[int, int]]:
    """Where the text of each cue of a block is (lines ``first:end``). A block is one cue (a
    timing line, first or after a number or identifier, then text), or none (kept as it is); or,
    in a file that leaves out the blank line between cues, several: a timing line inside a cue's
    text starts the next one (with the number before it, if there is one), so it is never
    translated as text."""
    timings = [k for k, line in enumerate(block) if "-->" in line]
    if not timings or timings[0] > 1:
        return []
    out = []
    for k, timing in enumerate(timings):
        end = timings[k + 1] if k + 1 < len(timings) else len(block)
        if end < len(block) and end - 1 > timing and block[end - 1].strip().isdigit():
            end -= 1  # the next cue's number
        out.append((timing + 1, end))
    return out


def make_cue(text_lines: Sequence[str], start: int, vtt: bool) -> Cue:
    stripped = [line.strip() for line in text_lines]
    dialogue = len(stripped) > 1 and all(line.startswith("-") for line in stripped)
    parts = (
        [line_block(line, vtt) for line in stripped] if dialogue else [line_block(" ".join(stripped), vtt)]
    )
    visible = (
        [len(b.text) for b, _ in parts]
        if dialogue or len(stripped) == 1
        else [len(line_block(line, vtt)[0].text) for line in stripped]
    )
    return Cue(
        start,
        start + len(text_lines),
        tuple(b for b, _ in parts),
        tuple(t for _, t in parts),
        max([MIN_WIDTH, *visible]),
        len(text_lines),
        dialogue,
    )


def line_block(line: str, vtt: bool) -> tuple[Block, tuple[str, ...]]:
    """A cue's text as a block: its tags become marks (an opening tag goes with the word after it,
    a closing one with the word before), WebVTT's entities the characters they mean."""
    text: list[str] = []
    marks: list[Mark] = []
    tags: list[str] = []
    length = cursor = 0
    for match in TAG.finditer(line):
        piece = unescape(line[cursor : match.start()], vtt)
        text.append(piece)
        length += len(piece)
        marks.append(Mark(length, "after" if match.group().startswith("</") else "before"))
        tags.append(match.group())
        cursor = match.end()
    text.append(unescape(line[cursor:], vtt))
    return Block("".join(text), tuple(marks)), tuple(tags)


def unescape(text: str, vtt: bool) -> str:
    return VTT_ENTITY.sub(lambda m: html.unescape(m.group()), text) if vtt else text


def escape(text: str, vtt: bool) -> str:
    if not vtt:
        return text
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("\xa0", "&nbsp;").replace("\u200e", "&lrm;").replace("\u200f", "&rlm;")


@dataclass(frozen=True)
class Subtitles:
    lines: tuple[str, ...]  # the file's lines, "\n" split off
    cues: tuple[Cue, ...]
    vtt: bool
    newline: str  # the file's line end, written back
    bom: bool

    @property
    def text(self) -> str:
        return "\n".join(b.text for cue in self.cues for b in cue.blocks if b.text.strip())

    def split(self, language: str) -> SplitSubtitles:
        splits = tuple(tuple(b.split(language) for b in cue.blocks) for cue in self.cues)
        return SplitSubtitles(self, splits)


@dataclass(frozen=True)
class SplitSubtitles:
    source: Subtitles
    splits: tuple[tuple[SplitBlock, ...], ...]  # each cue's

    @property
    def sentences(self) -> tuple[str, ...]:
        return tuple(s for cue in self.splits for split in cue for s in split.sentences)

    def join(self, translations: Sequence[str], review: Review | None = None) -> bytes:
        # (``review``: this format has no place for a reviewer's mark; the file is written as without it.)
        if len(translations) != len(self.sentences):
            raise ValueError(f"expected {len(self.sentences)} translations, got {len(translations)}")
        source = self.source
        out: list[str] = []
        line = start = 0
        for cue, splits in zip(source.cues, self.splits, strict=True):
            out += source.lines[line : cue.start]
            line = cue.end
            if not any(s.sentences for s in splits):
                out += source.lines[cue.start : cue.end]
                continue
            placed = []
            for split, tags in zip(splits, cue.tags, strict=True):
                count = len(split.sentences)
                text, offsets = split.place(translations[start : start + count])
                start += count
                placed.append((text, list(zip(offsets, tags, strict=True))))
            if cue.dialogue:  # one line a speaker, as in the source
                out += [render(text, marks, 0, len(text), source.vtt) for text, marks in placed]
            else:
                text, marks = placed[0]
                out += wrap(text, marks, cue.lines, cue.width, source.vtt)
        out += source.lines[line:]
        return encode(source.newline.join(out), source.bom)


def wrap(text: str, marks: Sequence[tuple[int, str]], lines: int, width: int, vtt: bool) -> list[str]:
    """``text`` (with its tags at their offsets) in ``lines`` balanced lines, two if one would be
    wider than ``width``."""
    words = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
    if not words:
        return [render(text, marks, 0, len(text), vtt)]
    lengths = [e - s for s, e in words]
    counts = balance(lengths, lines)
    if len(counts) == 1 and words[-1][1] - words[0][0] > width:
        counts = balance(lengths, 2)
    spans, first = [], 0
    for count in counts:
        spans.append((words[first][0], words[first + count - 1][1]))
        first += count
    out = []
    for i, (start, end) in enumerate(spans):
        # A tag at the end of a line's last word stays on that line, one after the space goes on
        # the next line; tags before the first word or after the last stay at the text's ends.
        low = spans[i - 1][1] + 1 if i else -1
        high = end if i < len(spans) - 1 else len(text)
        out.append(render(text, [(o, tag) for o, tag in marks if low <= o <= high], start, end, vtt))
    return out


def balance(lengths: Sequence[int], lines: int) -> list[int]:
    """How many words go on each of at most ``lines`` lines so that the widest is as narrow as can
    be (binary search on the width, each line filled greedily: fast for a cue of any length)."""
    lines = max(1, min(lines, len(lengths)))

    def fill(width: int) -> list[int] | None:
        counts: list[int] = []
        current = 0
        for length in lengths:
            if counts and current + 1 + length <= width:
                counts[-1] += 1
                current += 1 + length
            else:
                counts.append(1)
                current = length
        return counts if len(counts) <= lines else None

    low, high = max(lengths), sum(lengths) + len(lengths) - 1
    while low < high:
        middle = (low + high) // 2
        if fill(middle) is None:
            low = middle + 1
        else:
            high = middle
    counts = fill(low)
    assert counts is not None
    return counts


def render(text: str, marks: Sequence[tuple[int, str]], start: int, end: int, vtt: bool) -> str:
    """``text[start:end]`` with the tags inserted at their offsets (clamped into it)."""
    out, cursor = [], start
    for offset, tag in marks:
        offset = max(cursor, min(offset, end))
        out += [escape(text[cursor:offset], vtt), tag]
        cursor = offset
    out.append(escape(text[cursor:end], vtt))
    return "".join(out).strip()
