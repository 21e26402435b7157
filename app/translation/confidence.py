"""The confidence stage of a translation: each text's confidence from its sentences', and the
sentences below a threshold flagged or withheld.

A sentence's confidence is its model's calibrated estimate that its chrF against a reference
translation is at least 50 (``model.decoding.confidence``; written by the front end,
``ServedModel.render``). A text of several sentences takes the lowest of its sentences' (a text is
as good as its worst sentence: one wrong sentence is what a reader must be warned of). Sentences
the model did not translate (blank ones, a translation memory's) have none and do not count; a text
with none of its own has none (null).

A threshold (the request's ``min_confidence``, else ``NMT_MIN_CONFIDENCE``) counts the sentences of
each text whose best translation is below it; with ``withhold``, those sentences are answered with
an empty string (every alternative too), the layout around them kept."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from app.formats import Layout
from app.serving.protocol import SentenceResult
from app.translation.segments import SplitText


@dataclass(frozen=True)
class TextConfidence:
    """One text's: per translation (best first, as ``TextResult.translations``) the lowest of its
    sentences' confidences (None: no sentence had one); the best translation's pieces with their
    probabilities, sentence after sentence (when asked for); and, with a threshold, how many of its
    sentences fell below it and whether they were withheld."""

    values: list[float | None]
    tokens: list[tuple[str, float]] | None = None
    below: int | None = None  # None: no threshold
    withheld: bool = False
    # (start, end, confidence) of each sentence that has one, in characters of the best
    # translation's text (``sentence_spans``).
    sentences: list[tuple[int, int, float]] | None = None


def below_threshold(results: Sequence[SentenceResult], threshold: float | None) -> list[bool]:
    """Whether each sentence's best translation has a confidence below ``threshold``."""
    if threshold is None:
        return [False] * len(results)
    return [bool(r.confidence) and r.confidence[0].value < threshold for r in results]


def withhold(results: Sequence[SentenceResult], low: Sequence[bool]) -> list[SentenceResult]:
    """The sentences marked ``low`` answered with empty strings (their confidence kept)."""
    return [
        replace(r, hypotheses=tuple(replace(h, text="") for h in r.hypotheses)) if out else r
        for r, out in zip(results, low, strict=True)
    ]


def sentence_spans(
    # (Plain text's ``SplitText``, or an HTML document's layout, which has ``escape``.)
    layouts: Sequence[Any],
    results: Sequence[SentenceResult],
    outputs: Sequence[str],
) -> list[list[tuple[int, int, float]]]:
    """Where each sentence with a confidence is in its text's best translation (``outputs``), as
    (start, end, confidence), end exclusive. Plain text: ``SplitText.join`` writes separators and
    sentences in turn; HTML: the sentence as the markup writes it, found in order (a sentence that
    inline tags cut, or a withheld one, is not listed), as ``text_terminology`` finds sentences."""
    out: list[list[tuple[int, int, float]]] = []
    k = 0
    for layout, output in zip(layouts, outputs, strict=True):
        n = len(layout.sentences)
        spans: list[tuple[int, int, float]] = []
        plain = isinstance(layout, SplitText)
        offset = len(layout.separators[0]) if plain else 0
        for j in range(n):
            result = results[k + j]
            best = result.hypotheses[0].text if result.hypotheses else ""
            written = best if plain else layout.escape(best)
            at = offset if plain else (output.find(written, offset) if written else -1)
            found = at >= 0 and output[at : at + len(written)] == written
            if result.confidence and found and written:
                spans.append((at, at + len(written), result.confidence[0].value))
            if plain:
                offset += len(best) + len(layout.separators[j + 1])
            elif found:
                offset = at + len(written)
        out.append(spans)
        k += n
    return out


def text_confidence(
    layouts: Sequence[Layout],
    results: Sequence[SentenceResult],
    n_best: int,
    *,
    pieces: bool,
    low: Sequence[bool],
    threshold: float | None,
    withheld: bool,
) -> list[TextConfidence]:
    """Each text's ``TextConfidence`` from its sentences' results (in order, as ``assemble``
    takes them)."""
    out: list[TextConfidence] = []
    start = 0
    for layout in layouts:
        n = len(layout.sentences)
        own, flags = results[start : start + n], low[start : start + n]
        start += n
        values: list[float | None] = []
        for k in range(n_best):
            # (The k-th translation of a sentence whose search found fewer is its best: ``hypothesis``.)
            found = [r.confidence[k if k < len(r.confidence) else 0].value for r in own if r.confidence]
            values.append(min(found) if found else None)
        tokens = None
        if pieces:
            tokens = [piece for r in own if r.confidence for piece in r.confidence[0].tokens]
        below = None if threshold is None else sum(flags)
        out.append(TextConfidence(values, tokens, below, withheld and bool(below)))
    return out
