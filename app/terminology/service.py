"""What /translate makes of terminology: the request's glossary (inline entries, a stored one),
checked against the limits; each sentence's terms (``match``), whose targets the decoder is given
as constraints; and the response's ``terminology``: where each term is in the translated text.

HTML (``format: "html"``) takes both too: its sentences are text. A term's offsets are then into
the translated markup, where the term is written escaped (``&amp;``); a term that an inline tag
placed inside it cuts (``app.formats.inline`` places tags by word counts) is not marked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import HTTPException, Request

from app.config import Settings
from app.key_limits import store_owner
from app.schemas import GlossaryEntryBody, Span, Terminology, TermMark
from app.terminology.glossaries import GlossaryStore
from app.text import SplitText
from model.decoding.terms import Glossary, GlossaryEntry, Term, TooManyTerms
from model.decoding.terms import sentence_terms as choose_terms

AUTO = "auto"


class StoredGlossary(Protocol):
    """What /translate needs of a stored glossary (``app.terminology.glossaries.Glossary``)."""

    @property
    def entries(self) -> Sequence[Any]: ...  # each with ``source`` and ``target``


def stored_glossary(
    request: Request, store: GlossaryStore, glossary_id: str, settings: Settings
) -> StoredGlossary:
    """The glossary ``glossary_id`` of the request's owner in ``store``; 404 if there is none, 403
    without keys where stored glossaries are not shared (``store_owner``)."""
    owner = store_owner(request, settings)
    found = store.get(owner, glossary_id)
    if found is None:
        raise HTTPException(404, f"unknown glossary: {glossary_id[:64]!r}")
    return found


def primary(code: str) -> str:
    """A language code's primary subtag, lower-case: de-DE, de_de and DE are all "de"."""
    return code.replace("_", "-").split("-")[0].lower()


def check_pair(found: Any, source: str, target: str) -> None:
    """400 when a stored glossary is for another pair (a source of "auto" takes any source)."""
    glossary_source = getattr(found, "source_lang", None)
    glossary_target = getattr(found, "target_lang", None)
    # Primary subtags, as the memory compares them: a glossary stored for de-DE serves "de".
    if glossary_target and primary(glossary_target) != primary(target):
        raise HTTPException(400, f"the glossary is for target {glossary_target}, not {target}")
    if glossary_source and source.lower() != AUTO and primary(glossary_source) != primary(source):
        raise HTTPException(400, f"the glossary is for source {glossary_source}, not {source}")


def check_entries(entries: Sequence[GlossaryEntry], settings: Settings) -> None:
    """400 for an inline glossary past the limits (also stated in the served OpenAPI document)."""
    if len(entries) > settings.max_glossary_entries:
        raise HTTPException(
            400, f"glossary has {len(entries)} entries (at most {settings.max_glossary_entries} per request)"
        )
    for n, entry in enumerate(entries, 1):
        longest = max(len(entry.source), len(entry.target))
        if longest > settings.max_term_chars:
            raise HTTPException(
                400, f"glossary entry {n}: a term of {longest} characters (at most {settings.max_term_chars})"
            )


class TerminologyFields(Protocol):
    """A request's terminology fields (``TranslateRequest``, the /translate_file form)."""

    source: str
    target: str
    glossary: list[GlossaryEntryBody] | None
    glossary_id: str | None


# An inline glossary of up to this many entries is made ready on the event loop (~0.15 ms); a larger
# one, and any stored one, on a thread (``request_glossary``).
INLINE_ENTRIES = 100
# A request's text is prepared (parsed, split, searched for terms: ~2 ms at worst, HTML or a text of
# numbers) on the event loop when it has no glossary and this many characters at most; otherwise
# on a thread (``find_sentence_terms``, ``app.routes.translate.prepare``), whose hop (~0.1 ms)
# would cost more than the work of a few ordinary sentences.
INLINE_CHARS = 2_000


async def request_glossary(
    request: Request, req: TerminologyFields, settings: Settings, store: GlossaryStore
) -> Glossary | None:
    """The request's glossary: its inline entries, then the stored glossary's (from ``store``; an
    inline entry wins over a stored one of the same source); None without either.

    A stored glossary is read (SQLite) and made ready for matching (~20 ms for 10,000 entries) on
    a thread, so that the event loop answers other requests meanwhile; so is a large inline one."""
    if req.glossary is None and req.glossary_id is None:
        return None
    if req.glossary_id is None and len(req.glossary or ()) <= INLINE_ENTRIES:
        return make_glossary(request, req, settings, store)
    return await asyncio.to_thread(make_glossary, request, req, settings, store)


def make_glossary(
    request: Request, req: TerminologyFields, settings: Settings, store: GlossaryStore
) -> Glossary:
    """``request_glossary``'s work, where it runs (4xx for a glossary refused)."""
    entries = [GlossaryEntry(e.source, e.target) for e in req.glossary or ()]
    check_entries(entries, settings)
    if req.glossary_id is not None:
        found = stored_glossary(request, store, req.glossary_id, settings)
        check_pair(found, req.source, req.target)
        entries += [GlossaryEntry(e.source, e.target) for e in found.entries]
    return Glossary(entries)


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
    glossary matches than that are a 413 (too large, as too many sentences are); placeholders fill
    what the glossary leaves, in order (the ones past it are translated as the model likes)."""
    found: list[list[Term]] = []
    for n, sentence in enumerate(sentences, 1):
        try:
            found.append(choose_terms(sentence, glossary, protect=protect, limit=limit))
        except TooManyTerms as e:
            raise HTTPException(413, f"sentence {n} has {e}") from None
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
