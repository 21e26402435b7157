"""One glossary entry: shared by the stores (``glossaries``) and the matcher (``match``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GlossaryEntry:
    """``source`` is translated as ``target``; an entry whose target equals its source is a
    do-not-translate term."""

    source: str
    target: str
