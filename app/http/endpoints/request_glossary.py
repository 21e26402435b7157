"""A request's glossary (``glossary``, ``glossary_id``): its inline entries, then the stored glossary
of the request's owner, checked against the limits and the pair; what the use case is given as the
request's terminology (``app.translation.texts.TextRequest.glossary``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import HTTPException, Request

from app.config import Settings
from app.http.schemas import GlossaryEntryBody
from app.keys.limits import store_owner
from app.terminology.glossaries import GlossaryStore
from app.translation.languages import AUTO
from model.decoding.terms import Glossary, GlossaryEntry


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
