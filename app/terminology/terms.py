"""What a translation makes of terminology: each sentence's terms (a glossary's, placeholders),
whose targets the decoder is given as constraints; and the response's ``terminology``: where each
term is in the translated text. (The request's glossary itself, inline entries or a stored one, is
resolved at the HTTP edge: ``app.http.endpoints.request_glossary``.)

HTML (``format: "html"``) takes both too: its sentences are text. A term's offsets are then into
the translated markup, where the term is written escaped (``&amp;``); a term that an inline tag
placed inside it cuts (``app.formats.inline`` places tags by word counts) is not marked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.translation.errors import TooLarge
from app.translation.results import Span, Terminology, TermMark
from app.translation.segments import SplitText
from model.decoding.terms import Glossary, Term, TooManyTerms
from model.decoding.terms import sentence_terms as choose_terms

# A request's text is prepared (parsed, split, searched for terms: ~2 ms at worst, HTML or a text of
# numbers) on the event loop when it has no glossary and this many characters at most; otherwise
# on a thread (``find_sentence_terms``, ``app.translation.texts.split``), whose hop (~0.1 ms)
# would cost more than the work of a few ordinary sentences.
INLINE_CHARS = 2_000


@dataclass(frozen=True)
class SentenceTerms:
    """A request's sentences' terms, and the target strings the decoder is given for them."""

    terms: list[list[Term]]

    @property
    def targets(self) -> list[list[str]]:
        return [[t.target for t in own] for own in self.terms]

    def __bool__(self) -> bool:
        return any(self.terms)


def sentence_terms(
    sentences: Sequence[str], glossary: Glossary | None, *, protect: bool, limit: int
) -> SentenceTerms:
    """Each sentence's terms. Each one raises the sentence's beam, so at most ``limit``: more
    glossary matches than that are ``TooLarge`` (as too many sentences are); placeholders fill
    what the glossary leaves, in order (the ones past it are translated as the model likes)."""
    found: list[list[Term]] = []
    for n, sentence in enumerate(sentences, 1):
        try:
            found.append(choose_terms(sentence, glossary, protect=protect, limit=limit))
        except TooManyTerms as e:
            raise TooLarge(f"sentence {n} has {e}") from None
    return SentenceTerms(found)


async def find_sentence_terms(
    sentences: Sequence[str], glossary: Glossary | None, *, protect: bool, limit: int
) -> SentenceTerms:
    """``sentence_terms``, on a thread unless the work is small (no glossary, at most
    ``INLINE_CHARS`` characters): it grows with the text (a document's 100,000 characters, a
    job's 2,000,000), and the event loop must answer everyone else meanwhile."""
    if glossary is None and sum(map(len, sentences)) <= INLINE_CHARS:
        return sentence_terms(sentences, glossary, protect=protect, limit=limit)
    return await asyncio.to_thread(sentence_terms, sentences, glossary, protect=protect, limit=limit)


def text_terminology(
    layouts: Sequence[Any],
    terms: SentenceTerms,
    best: Sequence[str],
    placed: Sequence[Sequence[tuple[int, int, int]]],
    outputs: Sequence[str],
    memory: Sequence[bool] | None = None,
) -> list[Terminology | None]:
    """Each text's terminology (None where no term was placed and no sentence came from the
    translation memory, ``memory[i]`` for sentence i): each term placed in a sentence's best
    translation (``placed``: (term index, start, end) in ``best``), at its offset in the text's
    translation (``outputs``); ``memory`` true when any of its sentences came from the memory, and
    ``segments`` where those are. Plain text: ``SplitText.join`` makes it of separators and
    sentences in turn. HTML: the term or sentence as the markup writes it, found in order (a
    sentence that inline tags cut is not marked)."""
    out: list[Terminology | None] = []
    k = 0  # the first sentence of the text
    for layout, output in zip(layouts, outputs, strict=True):
        n = len(layout.sentences)
        marks: list[TermMark] = []
        segments: list[Span] = []
        plain = isinstance(layout, SplitText)
        offset = len(layout.separators[0]) if plain else 0
        for j in range(n):
            if memory is not None and memory[k + j]:  # no terms placed in it: the memory's words
                written = best[k + j] if plain else layout.escape(best[k + j])
                at = offset if plain else output.find(written, offset)
                if at >= 0 and output[at : at + len(written)] == written:
                    segments.append(Span(start=at, end=at + len(written)))
                    offset = offset if plain else at + len(written)
            for index, start, _ in sorted(placed[k + j], key=lambda p: p[1]):
                term = terms.terms[k + j][index]
                if plain:
                    at, written = offset + start, term.target
                else:
                    written = layout.escape(term.target)
                    at = output.find(written, offset)
                    if at < 0:
                        continue
                    offset = at + len(written)
                if output[at : at + len(written)] == written:  # (else not where we reckoned: no mark)
                    mark = TermMark(source=term.source, target=term.target, start=at, end=at + len(written))
                    marks.append(mark)
            if plain:
                offset += len(best[k + j]) + len(layout.separators[j + 1])
        remembered = memory is not None and any(memory[k : k + n])
        if remembered:
            out.append(Terminology(memory=True, terms=marks, segments=segments))
        else:
            out.append(Terminology(memory=False, terms=marks, segments=None) if marks else None)
        k += n
    return out
