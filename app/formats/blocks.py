"""A document split block by block, for the formats that translate it as ``inline`` blocks
(HTML, Markdown, PDF, the paragraphs of runs of .pptx, .xlsx and OpenDocument).

The model gets every block's sentences in one list, in document order; ``SplitBlocks`` keeps
the per-block splits, gives that list as ``sentences``, and cuts the list of translations back into
each block's share in ``placed``. Each format subclasses it with what its ``join`` writes with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.formats.inline import SplitBlock

# A block's text with its sentences translated, and each of its marks' offsets in that text.
Placed = tuple[str, list[int]]


@dataclass(frozen=True)
class SplitBlocks:
    splits: tuple[SplitBlock, ...]  # one per block, in document order

    @property
    def sentences(self) -> tuple[str, ...]:
        return tuple(s for split in self.splits for s in split.sentences)

    def placed(self, translations: Sequence[str]) -> list[Placed | None]:
        """Each block placed with its share of ``translations`` (``SplitBlock.place``); ``None``
        for a block with no sentences, which the format writes as it was."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"expected {len(self.sentences)} translations, got {len(translations)}")
        out: list[Placed | None] = []
        start = 0
        for split in self.splits:
            count = len(split.sentences)
            out.append(split.place(translations[start : start + count]) if count else None)
            start += count
        return out
