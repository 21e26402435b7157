"""A request's sentences to their answers, for /translate, /translate_file and document jobs:
the key's translation memory, the segment cache, then the model through the scheduler
(``decode_sentences``, withdrawn when the client goes away or the caller is cancelled), with the
engine's refusals as HTTP statuses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Depends, HTTPException, Request
from starlette.types import Receive

from app.config import Settings
from app.deps import MemoryDep, SegmentCacheDep, SettingsDep
from app.key_limits import client_identity, key_owner
from app.served import ServedModel
from app.serving.errors import DeadlineExceeded, EngineError, EngineStopped, QueueFull, TooLarge
from app.serving.frontend.pipeline import Translation
from app.serving.frontend.router import Route
from app.serving.frontend.scheduler import Scheduler
from app.serving.protocol import SentenceResult
from app.shedding import RETRY_AFTER_S, passed
from app.terminology.answers import MemoryLookup, answer, cache_key, memory_lookup
from app.terminology.cache import SegmentCache
from app.terminology.memory import TranslationMemory
from app.terminology.service import SentenceTerms

T = TypeVar("T")


@dataclass(frozen=True)
class SearchPlan:
    beam_size: int
    n_best: int  # alternatives + 1


@dataclass(frozen=True)
class Recall:
    """What may answer a request's sentences before the model (``app.terminology.answers``): the
    translation memory, where the request's owner may use it (``stores_on``: ``settings``), and
    the segment cache."""

    settings: Settings
    memory: TranslationMemory
    cache: SegmentCache[Any]


async def get_recall(settings: SettingsDep, memory: MemoryDep, cache: SegmentCacheDep) -> Recall:
    return Recall(settings, memory, cache)


RecallDep = Annotated[Recall, Depends(get_recall)]


def engine_error(exc: EngineError) -> HTTPException:
    if isinstance(exc, QueueFull):
        return HTTPException(503, "server busy: translation queue is full", {"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, TooLarge):
        return HTTPException(413, f"too many sentences: {exc}")
    if isinstance(exc, DeadlineExceeded):
        return HTTPException(504, "translation timed out")
    if isinstance(exc, EngineStopped):
        return HTTPException(503, "translation engine is not running")
    return HTTPException(503, f"translation engine error: {exc}")


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has gone. Called after the body is read, so the server's next ASGI
    message for this request is ``http.disconnect`` (uvicorn sends it when the connection drops, or
    once the response is complete): no polling, nothing runs until then."""
    while (await receive())["type"] != "http.disconnect":
        pass  # a pipelined request's data: not ours to handle, keep waiting


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


async def translate_sentences(
    request: Request,
    sentences: list[str],
    routes: Sequence[Route[ServedModel]],
    scheduler: Scheduler,
    plan: SearchPlan,
    timeout_s: float,
    terms: Sequence[Sequence[str]] | None = None,
) -> list[SentenceResult] | None:
    """``decode_sentences`` for a request: admission counts its sentences now, and they are
    withdrawn if its client goes away (None)."""
    passed(request.scope)
    disconnected = wait_for_disconnect(request.receive)
    return await decode_sentences(sentences, routes, scheduler, plan, timeout_s, terms, disconnected)


async def decode_sentences(
    sentences: list[str],
    routes: Sequence[Route[ServedModel]],
    scheduler: Scheduler,
    plan: SearchPlan,
    timeout_s: float,
    terms: Sequence[Sequence[str]] | None = None,
    disconnected: Coroutine[Any, Any, None] | None = None,
    background: bool = False,
) -> list[SentenceResult] | None:
    """Each sentence's n-best translations along its route (blank sentences give "" without model
    work), or None if ``disconnected`` completed first (its sentences are then withdrawn from the
    workers, as they are if this is cancelled). ``terms``: each sentence's target strings its
    translation must contain; ``background``: a document job's, which take what typed requests
    leave of the workers."""
    todo = [i for i, s in enumerate(sentences) if s.strip()]
    results = [SentenceResult.of_texts([""] * plan.n_best)] * len(sentences)
    if not todo:
        if disconnected is not None:
            disconnected.close()
        return results
    try:
        translation = Translation(
            scheduler,
            [sentences[i] for i in todo],
            [routes[i] for i in todo],
            beam_size=plan.beam_size,
            n_best=plan.n_best,
            timeout_s=timeout_s,
            terms=[terms[i] for i in todo] if terms else None,
            background=background,
        )
    except EngineError as e:
        if disconnected is not None:
            disconnected.close()
        raise engine_error(e) from e
    try:
        found: list[SentenceResult] | None
        if disconnected is None:
            finished, found = True, await translation.result()
        else:
            finished, found = await run_until_disconnect(translation.result(), disconnected)
    except EngineError as e:
        raise engine_error(e) from e
    finally:
        translation.withdraw()
    if not finished or found is None:
        return None
    for i, result in zip(todo, found, strict=True):
        results[i] = result
    return results


async def answer_sentences(
    request: Request,
    sentences: list[str],
    routes: Sequence[Route[ServedModel]],
    languages: Sequence[str],
    target: str,
    scheduler: Scheduler,
    plan: SearchPlan,
    timeout_s: float,
    terms: SentenceTerms,
    recall: Recall,
) -> list[SentenceResult] | None:
    """``translate_sentences``, after the owner's translation memory and the segment cache
    (``recall``); ``languages[i]``: sentence i's source language."""

    def decode(part: list[str], own: list[Route[ServedModel]], constraints: list[list[str]] | None) -> Any:
        return translate_sentences(request, part, own, scheduler, plan, timeout_s, constraints)

    lookup = memory_lookup(recall.memory, recall.settings, key_owner(request), languages, target)
    owner = client_identity(request)
    return await answer_with(sentences, routes, plan, terms, decode, owner, lookup, recall.cache)


Decode = Callable[
    [list[str], list[Route[ServedModel]], list[list[str]] | None], Awaitable[list[SentenceResult] | None]
]


async def answer_with(
    sentences: list[str],
    routes: Sequence[Route[ServedModel]],
    plan: SearchPlan,
    terms: SentenceTerms,
    decode: Decode,
    owner: str,
    lookup: MemoryLookup | None,
    cache: SegmentCache[Any] | None,
) -> list[SentenceResult] | None:
    """Each sentence's answer: ``lookup``'s (the owner's memory), ``cache``'s, or ``decode``'s
    (sentences, their routes, their constraints); None if ``decode`` gave None."""
    targets = terms.targets
    keys = [
        cache_key(owner, route, plan.beam_size, plan.n_best, own, sentence)
        for route, own, sentence in zip(routes, targets, sentences, strict=True)
    ]

    def decode_asked(asked: list[int]) -> Awaitable[list[SentenceResult] | None]:
        constraints = [targets[i] for i in asked] if terms else None
        return decode([sentences[i] for i in asked], [routes[i] for i in asked], constraints)

    def remembered(text: str) -> SentenceResult:
        return SentenceResult.of_texts([text], memory=True)

    return await answer(sentences, keys, decode_asked, remembered, lookup=lookup, cache=cache)
