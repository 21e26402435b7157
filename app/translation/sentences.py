"""The sentence stage of a translation: each sentence's answer from its owner's translation memory,
the segment cache, or the model through the scheduler (``app.terminology.answers`` decides which;
this module gives it the decoding), withdrawn when the caller goes away or is cancelled, with the
engine's refusals as the use case's own errors (``app.translation.errors``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.config import Settings
from app.models.served import ServedModel
from app.serving.errors import DeadlineExceeded, EngineError, EngineStopped, QueueFull
from app.serving.errors import TooLarge as TooManySentences
from app.serving.frontend.pipeline import Translation
from app.serving.frontend.router import Route
from app.serving.frontend.scheduler import Scheduler
from app.serving.protocol import SentenceResult
from app.terminology.answers import MemoryLookup, answer, cache_key, memory_lookup
from app.terminology.cache import SegmentCache
from app.terminology.memory import TranslationMemory
from app.terminology.terms import SentenceTerms
from app.translation.errors import Busy, TimedOut, TooLarge, TranslationError, Unavailable
from model.decoding.options import nonblank

T = TypeVar("T")
QUEUE_RETRY_AFTER_S = "1"  # a full queue: what the gate says too (``app.http.shedding.RETRY_AFTER_S``)


@dataclass(frozen=True)
class SearchPlan:
    beam_size: int
    n_best: int  # alternatives + 1
    # Each sentence's confidence asked for (``SentenceResult.confidence``), with each piece's
    # probability (``pieces``).
    confidence: bool = False
    pieces: bool = False


@dataclass(frozen=True)
class Recall:
    """What may answer sentences before the model: the translation memory, where the owner may use
    it (``stores_on``: ``settings``), and the segment cache."""

    settings: Settings
    memory: TranslationMemory | None
    cache: SegmentCache[Any] | None


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Caller:
    """Who asks for a translation, and how the asking ends.

    ``owner``: whose translation memory answers (a key's owner; "" without keys); ``identity``:
    whose segment cache entries they are (``app.keys.limits.client_identity``: a key's, or without
    keys a client's). ``gone``: made into an awaitable that completes when the caller has gone
    away (then its sentences are withdrawn and the answer is None); ``admitted``: called once, when
    the sentences are handed to the scheduler (the HTTP edge's gate then frees the request's place);
    ``background``: a document job's sentences, which take what typed requests leave."""

    owner: str
    identity: str
    timeout_s: float
    gone: Callable[[], Awaitable[None]] | None = None
    admitted: Callable[[], None] = field(default=_nothing)
    background: bool = False


@dataclass(frozen=True)
class SentenceRequest:
    """Sentences to translate, each with its route (its model or models) and its source language,
    into ``target``, with ``plan``'s search and each sentence's ``terms``."""

    sentences: list[str]
    routes: list[Route[ServedModel]]
    languages: list[str]
    target: str
    plan: SearchPlan
    terms: SentenceTerms
    caller: Caller


def engine_error(exc: EngineError) -> TranslationError:
    if isinstance(exc, QueueFull):
        return Busy("server busy: translation queue is full", retry_after=QUEUE_RETRY_AFTER_S)
    if isinstance(exc, TooManySentences):
        return TooLarge(f"too many sentences: {exc}")
    if isinstance(exc, DeadlineExceeded):
        return TimedOut("translation timed out")
    if isinstance(exc, EngineStopped):
        return Unavailable("translation engine is not running")
    return Unavailable(f"translation engine error: {exc}")


async def run_until_disconnect(work: Awaitable[T], disconnected: Awaitable[None]) -> tuple[bool, T | None]:
    """Await ``work``, cancelling it if ``disconnected`` completes first.

    Returns ``(True, result)``, or ``(False, None)`` after a disconnect (the caller then withdraws
    the request, so that an abandoned request stops costing model time). Both are cancelled if this
    coroutine itself is. (Not polling ``Request.is_disconnected``: every 50 ms per request, at 64
    concurrent requests, that costs the event loop most of a core.)
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        return False, None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Collect its outcome so that nothing is reported as "exception never retrieved".
            task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def decode_sentences(
    scheduler: Scheduler,
    sentences: list[str],
    routes: Sequence[Route[ServedModel]],
    plan: SearchPlan,
    caller: Caller,
    terms: Sequence[Sequence[str]] | None = None,
) -> list[SentenceResult] | None:
    """Each sentence's n-best translations along its route (blank sentences give "" without model
    work), or None if the caller went away first (its sentences are then withdrawn from the
    workers, as they are if this is cancelled). ``terms``: each sentence's target strings its
    translation must contain."""
    caller.admitted()
    todo = nonblank(sentences)
    results = [SentenceResult.of_texts([""] * plan.n_best)] * len(sentences)
    if not todo:
        return results
    try:
        translation = Translation(
            scheduler,
            [sentences[i] for i in todo],
            [routes[i] for i in todo],
            beam_size=plan.beam_size,
            n_best=plan.n_best,
            timeout_s=caller.timeout_s,
            terms=[terms[i] for i in todo] if terms else None,
            background=caller.background,
            confidence=plan.confidence,
            pieces=plan.pieces,
        )
    except EngineError as e:
        raise engine_error(e) from e
    try:
        found: list[SentenceResult] | None
        if caller.gone is None:
            finished, found = True, await translation.result()
        else:
            finished, found = await run_until_disconnect(translation.result(), caller.gone())
    except EngineError as e:
        raise engine_error(e) from e
    finally:
        translation.withdraw()
    if not finished or found is None:
        return None
    for i, result in zip(todo, found, strict=True):
        results[i] = result
    return results


async def translate_sentences(
    request: SentenceRequest, scheduler: Scheduler, recall: Recall
) -> list[SentenceResult] | None:
    """Each sentence's answer: its owner's memory's, the segment cache's, or the model's; None if
    the caller went away."""
    plan, terms, caller = request.plan, request.terms, request.caller
    sentences, routes = request.sentences, request.routes
    lookup: MemoryLookup | None = None
    if recall.memory is not None:
        languages, target = request.languages, request.target
        lookup = memory_lookup(recall.memory, recall.settings, caller.owner, languages, target)
    targets = terms.targets
    # (What was asked of the confidence is part of the key: an answer cached without it has none.)
    keys = [
        (
            cache_key(caller.identity, route, plan.beam_size, plan.n_best, own, sentence),
            plan.confidence,
            plan.pieces,
        )
        for route, own, sentence in zip(routes, targets, sentences, strict=True)
    ]

    def decode(asked: list[int]) -> Awaitable[list[SentenceResult] | None]:
        constraints = [targets[i] for i in asked] if terms else None
        part = [sentences[i] for i in asked]
        return decode_sentences(scheduler, part, [routes[i] for i in asked], plan, caller, constraints)

    def remembered(text: str) -> SentenceResult:
        return SentenceResult.of_texts([text], memory=True)

    return await answer(sentences, keys, decode, remembered, lookup=lookup, cache=recall.cache)
