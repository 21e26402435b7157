"""Language identification, behind one function: ``detect(text, candidates)``.

Used by ``POST /detect`` and by ``source: "auto"``, always among the languages the service
translates from (``app.translation.codes.source_languages``): a language it cannot translate is no useful
answer. The identifier is py3langid (a maintained fork of langid.py: a naive Bayes model over byte
n-grams, 97 languages, numpy only), chosen over lingua-language-detector on Multi30k's test
sentences in en/de/fr/cs (``python -m benchmarks.langid``): both are right on every full
sentence, py3langid more often on a sentence's first three words (99.3% vs 98.0%, what
translate-as-you-type first sends), and ~6x faster (~40 us a sentence, cheap enough for the event
loop) in half the memory; it also knows more languages (97 vs 75), which matters for whatever
pair someone trains.

Confidences are percentages among the candidates (they sum to ~100), as LibreTranslate reports
them. One candidate needs no model: it is the answer, with confidence 100 (today's German->English
model). Candidates the identifier does not know come last with confidence 0.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class Detection:
    language: str  # a candidate's code, as the caller spelled it
    confidence: float  # percent, 0-100


@lru_cache(maxsize=1)
def _full_identifier() -> Any:
    """py3langid's model over all its languages, loaded once (~0.8 s, ~100 MiB)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


_lock = threading.Lock()  # the first load may be asked for from a thread and the event loop at once


@lru_cache(maxsize=16)
def _identifier(codes: tuple[str, ...]) -> Any:
    """An identifier restricted to ``codes`` (all known to py3langid). A shallow copy of the full
    one: ``set_languages`` replaces the copy's arrays by column slices, never the shared ones, so
    identifiers for different candidate sets can be used side by side."""
    with _lock:
        identifier = copy.copy(_full_identifier())
    identifier.set_languages(list(codes))
    return identifier


def known_languages() -> frozenset[str]:
    """The codes the identifier can tell apart."""
    return frozenset(_full_identifier().labels)


def prepare(candidates: Sequence[str]) -> None:
    """Load what ``detect(..., candidates)`` needs now (at start-up, off the event loop), not on the
    first request. Nothing is loaded when there is nothing to choose."""
    if len(set(candidates)) > 1:
        _restricted(candidates)


def _restricted(candidates: Sequence[str]) -> tuple[Any | None, list[str]]:
    """The identifier for the known candidates (None if fewer than two), and the unknown ones."""
    known = known_languages()
    usable = sorted({c.lower() for c in candidates if c.lower() in known})
    unknown = [c for c in candidates if c.lower() not in known]
    return (_identifier(tuple(usable)) if len(usable) > 1 else None), unknown


def detect(text: str, candidates: Sequence[str]) -> list[Detection]:
    """The ``candidates`` (language codes) ranked by how likely ``text`` is in each, best first.

    A text with nothing to go by (blank, digits only) gets equal confidences, in the candidates'
    order. Raises ValueError for no candidates.
    """
    candidates = list(dict.fromkeys(candidates))
    if not candidates:
        raise ValueError("no candidate languages")
    if len(candidates) == 1:
        return [Detection(candidates[0], 100.0)]
    identifier, unknown = _restricted(candidates)
    spelled = {c.lower(): c for c in candidates}
    if identifier is None:  # at most one candidate is known: it wins if there is one
        known = [c for c in candidates if c not in unknown]
        return [Detection(c, 100.0) for c in known] + [Detection(c, 0.0) for c in unknown]
    scores = dict(identifier.rank(text))
    order = {c: i for i, c in enumerate(candidates)}
    ranked = sorted(spelled, key=lambda code: (-scores.get(code, 0.0), order[spelled[code]]))
    detections = [Detection(spelled[c], round(100.0 * float(scores.get(c, 0.0)), 2)) for c in ranked]
    return [d for d in detections if d.language not in unknown] + [Detection(c, 0.0) for c in unknown]
