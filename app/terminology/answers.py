"""A request's sentences answered in the issue's order: the key's translation memory, then the
segment cache, then the model (``app.terminology.precedence`` decides; this module is its glue to
a request).

- Memory: the request owner's (``key_owner``), for each sentence's source language (a text's
  detected one when the source is "auto") and the request's target; exact after whitespace is
  normalised. One indexed query per sentence (~30 us): a request of a few sentences reads on
  the event loop, as ``app.stores.database.sqlite`` allows (WAL: readers never wait for a writer),
  a larger one on a thread; in PostgreSQL (``NMT_DATABASE_URL``) one query a request, always on a
  thread.
- Cache: keyed by everything that decides the model's answer (``cache_key``), so that a cached
  answer is the one decoding would give ("one answer per input" makes that true).
- Model: the rest, with their constraints; what it decodes is cached.

Blank sentences are neither looked up nor cached: the caller's decoding answers them without
model work anyway, and counting them would only inflate the cache's hit rate.

Generic over the caller's per-sentence result (``app.serving.protocol.SentenceResult``), so that
nothing here depends on HTTP routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, TypeVar

from app.config import Settings, stores_on
from app.serving.frontend.router import Route
from app.stores.database.errors import StoreUnavailable, logged
from app.terminology.cache import SegmentCache
from app.terminology.memory import TranslationMemory
from app.terminology.precedence import plan
from app.translation.errors import Unavailable
from model.decoding.options import nonblank

R = TypeVar("R")
# The memory's answers to some of a request's sentences: (their indices, their texts) -> each one's
# stored translation or None.
MemoryLookup = Callable[[Sequence[int], Sequence[str]], list[str | None]]
STORE_RETRY_AFTER_S = "1"
INLINE_LOOKUPS = 8  # sentences looked up on the event loop itself (to_thread costs ~50-100 us)


def cache_key(
    owner: str, route: Route[Any], beam_size: int, n_best: int, targets: Sequence[str], sentence: str
) -> Hashable:
    """What decides the model's answer to ``sentence``: the models of each hop (by their unique
    served names) and the languages they translate between, the search, the terms' targets (in
    order: a term's index is in the answer's marks) and the sentence exactly as sent (the
    tokenizer, not this cache, decides what whitespace means); and whose it is
    (``app.keys.limits.client_identity``: a key's, or without keys a client address's): shared, a
    client could tell from the time of its answer that another translated that sentence recently."""
    hops = tuple((hop.model.name, hop.source, hop.target) for hop in route.hops)
    return (owner, hops, beam_size, n_best, tuple(targets), sentence)


def memory_lookup(
    memory: TranslationMemory, settings: Settings, owner: str, languages: Sequence[str], target: str
) -> MemoryLookup | None:
    """``owner``'s memory (a request's: ``key_owner``) for its sentences (``languages[i]``: sentence
    i's source language); None where it has none to use (no keys, and the stores not shared,
    ``stores_on``)."""
    if not stores_on(settings, owner):
        return None
    return OwnerLookup(memory, owner, languages, target)


class OwnerLookup:
    """``owner``'s memory for some sentences (``languages[i]``: sentence i's source language): a
    ``MemoryLookup``. ``inline_limit``: the most sentences looked up on the event loop itself; none
    in a database across the network (``NMT_DATABASE_URL``), whose round trips, or a server that
    does not answer, must not hold the loop."""

    def __init__(self, memory: TranslationMemory, owner: str, languages: Sequence[str], target: str) -> None:
        self.memory, self.owner, self.languages, self.target = memory, owner, languages, target
        self.inline_limit = INLINE_LOOKUPS if memory.db.dialect == "sqlite" else 0

    def inline(self, sentences: int) -> bool:
        """Whether a lookup of that many sentences may run on the event loop (asks no server)."""
        return sentences <= self.inline_limit or self.memory.known_empty(self.owner)

    def __call__(self, indices: Sequence[int], sentences: Sequence[str]) -> list[str | None]:
        found: list[str | None] = [None] * len(sentences)
        groups: dict[str, list[int]] = {}  # one language pair per lookup_many
        for i, index in enumerate(indices):
            groups.setdefault(self.languages[index], []).append(i)
        try:
            for language, members in groups.items():
                texts = [sentences[i] for i in members]
                stored = self.memory.lookup_many(self.owner, language, self.target, texts)
                for i, text in zip(members, stored, strict=True):
                    found[i] = text
        except StoreUnavailable as e:
            # Not the model instead: the key's team expects their translation, and would get
            # another one silently.
            raise Unavailable(logged(e, "the translation memory"), retry_after=STORE_RETRY_AFTER_S) from None
        return found


async def answer(
    sentences: Sequence[str],
    keys: Sequence[Hashable],
    decode: Callable[[list[int]], Awaitable[Sequence[R] | None]],
    remembered: Callable[[str], R],
    *,
    lookup: MemoryLookup | None,
    cache: SegmentCache[R] | None,
) -> list[R] | None:
    """Each sentence's result: ``remembered(text)`` for the memory's, a cached one, or the model's
    (``decode(indices)``: the results of those sentences, in that order, or None when the client
    went away, which this returns too)."""
    todo = nonblank(sentences)
    blank = sorted(set(range(len(sentences))) - set(todo))
    texts = [sentences[i] for i in todo]
    memory: Callable[[Sequence[str]], Sequence[str | None]] | None = None
    if lookup is not None and todo:
        # ~30 us a sentence: a few inline; more (up to NMT_MAX_TEXTS' sentences, milliseconds) on a
        # thread, so that the event loop goes on serving everyone else meanwhile.
        inline = lookup.inline(len(todo)) if isinstance(lookup, OwnerLookup) else len(todo) <= INLINE_LOOKUPS
        stored = lookup(todo, texts) if inline else await asyncio.to_thread(lookup, todo, texts)
        memory = lambda _: stored  # noqa: E731  (plan asks for the texts it was given)
    chosen = plan(texts, [keys[i] for i in todo], lookup=memory, cache=cache)
    asked = sorted(blank + [todo[j] for j in chosen.decode])
    # Called even with nothing to decode: the caller's decoding also ends the request's wait at the
    # admission gate (``app.http.shedding.passed``).
    results = await decode(asked)
    if results is None:
        return None
    by_index = dict(zip(asked, results, strict=True))
    out: dict[int, R] = {i: by_index[i] for i in blank}
    answers = chosen.finish([by_index[todo[j]] for j in chosen.decode])
    for i, found in zip(todo, answers, strict=True):
        if found.memory is not None:
            out[i] = remembered(found.memory)
        elif found.result is not None:
            out[i] = found.result
    return [out[i] for i in range(len(sentences))]
