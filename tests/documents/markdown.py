"""Markdown samples (.md, .markdown) and the check that a translation kept the block structure
(the same markdown-it block tokens), code, URLs, HTML and front matter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from markdown_it import MarkdownIt

README = """# Die *große* Anleitung

Ein **großer** Hund läuft über die [Wiese](https://example.com/wiese "Die Wiese").
Dann ruft man `pip install paket` auf, und alles ist gut.
Ein harter Umbruch\\
steht hier. AT&amp;T sagt 5\\* Sterne.

> Ein Zitat mit
> zwei Zeilen.
>
> - Eine Liste im Zitat
>   mit Fortsetzung.

1. Erster Punkt der Liste.
2. Zweiter ~~falscher~~ Punkt mit ![einem Bild](bild.png).
   - Ein verschachtelter Punkt.

Zweite Überschrift
------------------

| Spalte | Beschreibung |
|--------|:------------:|
| Eins   | Der erste Wert ist klein. |
| Zwei   | Der zweite \\| Wert ist groß. |

```python
print("Dieser Code bleibt, wie er ist.")
```

    eingerückter Code bleibt auch

<div class="hinweis">
Ein HTML-Block bleibt unübersetzt.
</div>

Siehe [die Quelle][quelle] oder <https://example.org/auto> und <span>Text im Tag</span>.

[quelle]: https://example.com/quelle "Quelle"
"""

NOTES = """---
title: Notizen
tags: [a, b]
---

## Notizen zum Treffen

- Wir treffen uns am Montag.
- Das Protokoll schreibt *Anna*.

Ende der Notizen.
"""

SAMPLES: dict[str, Callable[[], bytes]] = {
    "readme.md": lambda: README.encode(),
    "notes.markdown": lambda: b"\xef\xbb\xbf" + NOTES.replace("\n", "\r\n").encode(),
}


def parser() -> MarkdownIt:
    return MarkdownIt("commonmark").enable(["table", "strikethrough"])


def kept(text: str) -> list[tuple[Any, ...]]:
    """What a translation must not change: each block token (code blocks with their content), and
    of inline text only code spans, link and image targets, autolinks and inline HTML."""
    out: list[tuple[Any, ...]] = []
    for token in parser().parse(text):
        if token.type != "inline":
            # Lines (token.map) are left out: a paragraph may lose a line break that the
            # translation has too few words to keep.
            out.append((token.type, token.tag, token.nesting, token.markup, token.info, token.content))
            continue
        for child in token.children or []:
            if child.type in ("code_inline", "html_inline"):
                out.append((child.type, child.content))
            elif child.type in ("link_open", "image"):
                out.append((child.type, child.attrGet("href"), child.attrGet("src"), child.attrGet("title")))
    return out


def front_matter(text: str) -> str:
    if not text.startswith("---\n"):
        return ""
    return text[: text.index("\n---\n", 4) + 5]


def check_structure(filename: str, original: bytes, translated: bytes) -> None:
    assert translated.startswith(b"\xef\xbb\xbf") == original.startswith(b"\xef\xbb\xbf"), "BOM kept"
    assert (b"\r\n" in translated) == (b"\r\n" in original), "line ends kept"
    source = original.decode("utf-8-sig").replace("\r\n", "\n")
    target = translated.decode("utf-8-sig").replace("\r\n", "\n")
    assert front_matter(target) == front_matter(source), "front matter kept"
    assert kept(target) == kept(source), "blocks, code, URLs and HTML kept"
