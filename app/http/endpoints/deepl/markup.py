"""DeepL's ``ignore_tags`` on the service's markup translation (``format: "html"``).

The service already keeps an element untranslated, content included, when it is marked
``translate="no"`` (``app.formats.html``), and writes every start tag back byte for byte. So an
element that ``ignore_tags`` names is marked so in the text sent (the attribute, with a nonce of
this request, just before its start tag's ``>``: the last attribute wins in the parser), and the
mark is taken out of the translation again: what comes back is the markup as it was sent.

The start tags are found by the standard library's tokenizer, the one the service parses the
text with, so both agree on where a tag is (never by a regular expression). An empty element
written ``<x/>`` has nothing to keep and is left as it is.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from html.parser import HTMLParser


class _StartTags(HTMLParser):
    """Where each start tag of the ``names`` elements ends (the index of its ``>``)."""

    def __init__(self, markup: str, names: frozenset[str]) -> None:
        super().__init__(convert_charrefs=False)
        self.names = names
        self.line_starts = [0]  # (the tokenizer counts lines at "\n" alone)
        while (found := markup.find("\n", self.line_starts[-1])) >= 0:
            self.line_starts.append(found + 1)
        self.ends: list[int] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        raw = self.get_starttag_text() or ""
        if tag in self.names and raw.endswith(">"):
            line, column = self.getpos()  # where the tag begins
            self.ends.append(self.line_starts[line - 1] + column + len(raw) - 1)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        pass  # <x/>: nothing inside it to keep


def tag_names(values: Iterable[str]) -> frozenset[str]:
    """DeepL's tag lists, each a name or a comma-separated list of names, as the tokenizer names
    tags (lower-case)."""
    return frozenset(name.strip().lower() for value in values for name in value.split(",") if name.strip())


class IgnoredTags:
    """``mark`` the texts, translate them, ``unmark`` the translations."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.mark_text = f' translate="no" data-nmt-ignored-{secrets.token_hex(8)}'

    def mark(self, texts: Sequence[str]) -> list[str]:
        if not self.names:
            return list(texts)
        return [self._mark(text) for text in texts]

    def _mark(self, text: str) -> str:
        parser = _StartTags(text, self.names)
        try:
            parser.feed(text)
            parser.close()
        except (AssertionError, ValueError):  # the service's own parse says why (400)
            return text
        pieces, start = [], 0
        for end in parser.ends:
            pieces += [text[start:end], self.mark_text]
            start = end
        return "".join(pieces) + text[start:]

    def unmark(self, translation: str) -> str:
        return translation.replace(self.mark_text, "") if self.names else translation
