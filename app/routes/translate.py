"""POST /translate, LibreTranslate-compatible.

Each text is split into sentences (app.formats) and tokenized here; the sentences of one request
go to the workers of the model that serves its pair (``app.serving.router``; two models one after
the other for a pair served through English, ``app.serving.pipeline``), where they share batches
with each other and with other requests, and their translations are put back into each text's
layout. Terminology (``app.terminology.service``): each sentence's glossary terms and placeholders
are given to the decoder as constraints, and the response says where they are.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, HTTPException, Request, Response
from starlette.types import Receive

from app.body import parse_translate_request
from app.config import Settings
from app.deps import RouterDep, SchedulerDep, SettingsDep
from app.errors import ApiError, missing_parameter
from app.formats import Layout, PlainText, parse
from app.formats.html import HtmlDocument, HtmlError
from app.key_limits import admit_key, key_owner
from app.langid import detect
from app.languages import language_name, served_pairs, source_languages, supported_pairs, target_languages
from app.routes.openapi import openapi_body
from app.schemas import (
    BadRequestResponse,
    DetectedLanguage,
    ErrorResponse,
    Terminology,
    TranslateRequest,
    TranslateResponse,
    ValidationErrorResponse,
)
from app.served import Rendered, ServedModel
from app.serving.errors import DeadlineExceeded, EngineError, EngineStopped, QueueFull, TooLarge
from app.serving.pipeline import Translation
from app.serving.router import Route, Router
from app.serving.scheduler import Scheduler
from app.shedding import RETRY_AFTER_S, passed
from app.terminology.answers import MemoryLookup, answer, cache_key, memory_lookup, segment_cache
from app.terminology.cache import SegmentCache
from app.terminology.service import SentenceTerms, request_glossary, sentence_terms, text_terminology

T = TypeVar("T")

router = APIRouter(tags=["translate"])

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"
AUTO = "auto"

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        403: "Missing or invalid api_key (when the server requires keys)",
        404: "glossary_id names no glossary of this API key",
        408: "The request body did not arrive within 10 s",
        413: "Too many texts, characters, sentences or too large a body; a sentence with more "
        "glossary terms than NMT_MAX_TERMS_PER_SENTENCE",
        429: "Over a limit of the api_key (see Retry-After)",
        503: "Every queue full (see Retry-After), engine stopped, model not loaded yet, or the "
        "translation memory unreadable",
        504: "The translation did not finish within the request timeout",
    }.items()
}
_ERRORS[400] = {
    "model": BadRequestResponse,
    "description": (
        'A parameter missing ("Invalid request: missing q parameter": q or target absent or null, '
        'source or target empty), an unsupported language ("zz is not supported", with supportedPairs) '
        "or pair, as LibreTranslate words them; too large a beam size or too many alternatives; "
        "invalid UTF-8 or HTML; a glossary past its limits, or a stored one for another pair"
    ),
}
_ERRORS[422] = {
    "model": ValidationErrorResponse,
    "description": "Malformed body, a field of the wrong type or an unknown format",
}


_OPENAPI_BODY = openapi_body(TranslateRequest)


def document_served(
    openapi: dict[str, Any], router: Router[ServedModel], settings: Settings
) -> dict[str, Any]:
    """A copy of the OpenAPI document whose /translate body states what this server accepts, known
    only once the models are loaded: the served language codes and the limits. (Those on characters
    and sentences summed over ``q`` cannot be said in JSON Schema: they are 413s.)"""
    document = copy.deepcopy(openapi)
    sources = [AUTO, *source_languages(router)]
    targets = target_languages(router)
    for path in ("/translate", "/translate_file"):
        for media in document["paths"][path]["post"]["requestBody"]["content"].values():
            media["schema"]["properties"]["source"]["enum"] = sources
            media["schema"]["properties"]["target"]["enum"] = targets
    content = document["paths"]["/translate"]["post"]["requestBody"]["content"]
    for media in content.values():
        fields = media["schema"]["properties"]
        fields["alternatives"]["maximum"] = settings.max_alternatives
        for kind in fields["q"]["anyOf"]:
            if kind["type"] == "array":
                kind["maxItems"] = settings.max_texts
        beam = fields["beam_size"]
        next((kind for kind in beam.get("anyOf", ()) if kind.get("type") == "integer"), beam)["maximum"] = (
            settings.max_beam_size
        )
        for kind in fields.get("glossary", {}).get("anyOf", ()):
            if kind["type"] == "array":
                kind["maxItems"] = settings.max_glossary_entries
                for term in kind["items"]["properties"].values():
                    term["maxLength"] = settings.max_term_chars
    return document


@dataclass(frozen=True)
class SearchPlan:
    beam_size: int
    n_best: int  # alternatives + 1


@dataclass(frozen=True)
class SentenceResult:
    hypotheses: list[str]  # n-best translations, best first
    placed: tuple[tuple[int, int, int], ...] = ()  # its terms in hypotheses[0]: (term, start, end)
    memory: bool = False  # the translation memory's text (then the only hypothesis), not the model's


def clip(value: str, limit: int = 32) -> str:
    """A user-supplied value cut for an error message, so that messages stay small."""
    return value if len(value) <= limit else value[:limit] + "..."


def shorten(value: str, limit: int = 32) -> str:
    """A user-supplied value quoted for an error message, cut so that messages stay small."""
    return repr(clip(value, limit))


def check_limits(texts: Sequence[str], settings: Settings) -> None:
    if len(texts) > settings.max_texts:
        raise HTTPException(413, f"too many texts: {len(texts)} (at most {settings.max_texts} per request)")
    chars = sum(map(len, texts))
    if chars > settings.max_chars:
        raise HTTPException(
            413, f"too much text: {chars} characters (at most {settings.max_chars} per request)"
        )


def is_utf8(value: str) -> bool:
    """False for strings with lone surrogates: JSON can carry them ("\\ud800") but UTF-8 cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_encodable(req: TranslateRequest) -> None:
    fields = [*req.texts, req.source, req.target, req.api_key or "", req.glossary_id or ""]
    fields += [text for entry in req.glossary or () for text in (entry.source, entry.target)]
    if not all(map(is_utf8, fields)):
        raise HTTPException(400, "invalid text: unpaired surrogate (not representable in UTF-8)")


def unsupported(message: str, router: Router[ServedModel]) -> ApiError:
    """A 400 in LibreTranslate's words, which clients compare exactly; the served pairs, which it
    does not name, go beside them."""
    return ApiError(400, message, supportedPairs=[route.describe() for route in router.routes])


def check_languages(source: str, target: str, router: Router[ServedModel]) -> list[str]:
    """400 unless (``source``, ``target``) is served, directly or through English (``source`` may
    be "auto"); the served source languages it stands for (one, or every source language
    translated into ``target``).

    The messages are LibreTranslate's: in its order (source, then target), "zz is not supported"
    for a code the service does not know at all, and "German (de) is not available as a target
    language from English (en)" for two it knows but no route joins."""
    if not source:
        raise missing_parameter("source")
    if not target:
        raise missing_parameter("target")
    known = {code.lower(): code for pair in served_pairs(router) for code in pair}
    auto = source.lower() == AUTO
    for code in ([] if auto else [source]) + [target]:
        if code.lower() not in known:
            raise unsupported(f"{clip(code)} is not supported", router)

    def named(code: str) -> str:
        served = known[code.lower()]
        return f"{language_name(served)} ({served})"

    candidates = source_languages(router, target)
    if auto:
        if not candidates:
            raise unsupported(f"{named(target)} is not available as a target language", router)
        return candidates
    chosen = [code for code in candidates if code.lower() == source.lower()]
    if not chosen:
        message = f"{named(target)} is not available as a target language from {named(source)}"
        raise unsupported(message, router)
    return chosen


def parse_texts(texts: Sequence[str], format: str) -> list[PlainText | HtmlDocument]:
    """Each text read as ``format`` (400 for HTML that cannot be read)."""
    try:
        return [parse(text, "html" if format == "html" else "text") for text in texts]
    except HtmlError as e:
        raise HTTPException(400, str(e)) from e


def source_language(text: str, candidates: Sequence[str]) -> DetectedLanguage:
    """The language of ``text`` among ``candidates``: the only one, or the identifier's best."""
    best = detect(text, candidates)[0]
    return DetectedLanguage(confidence=best.confidence, language=best.language)


def search_plan(req: TranslateRequest, settings: Settings) -> SearchPlan:
    if req.alternatives > settings.max_alternatives:
        raise HTTPException(400, f"alternatives must be at most {settings.max_alternatives}")
    n_best = req.alternatives + 1
    # The beam must hold every hypothesis asked for, so alternatives can raise the beam size.
    beam_size = max(req.beam_size or settings.default_beam_size, n_best)
    if beam_size > settings.max_beam_size:
        raise HTTPException(400, f"beam_size must be at most {settings.max_beam_size}")
    return SearchPlan(beam_size=beam_size, n_best=n_best)


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
    results = [SentenceResult([""] * plan.n_best)] * len(sentences)
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
        found: list[Rendered] | None
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
    for i, rendered in zip(todo, found, strict=True):
        results[i] = SentenceResult(rendered.texts, rendered.placed)
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
) -> list[SentenceResult] | None:
    """``translate_sentences``, after the owner's translation memory and the segment cache
    (``app.terminology.answers``); ``languages[i]``: sentence i's source language."""

    def decode(part: list[str], own: list[Route[ServedModel]], constraints: list[list[str]] | None) -> Any:
        return translate_sentences(request, part, own, scheduler, plan, timeout_s, constraints)

    lookup = memory_lookup(request, languages, target)
    owner, cache = key_owner(request), segment_cache(request)
    return await answer_with(sentences, routes, plan, terms, decode, owner, lookup, cache)


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
        return SentenceResult([text], memory=True)

    return await answer(sentences, keys, decode_asked, remembered, lookup=lookup, cache=cache)


def route_of(router: Router[ServedModel], source: str, target: str) -> Route[ServedModel]:
    """The route of a pair ``check_languages`` let through (or a language it detected)."""
    route = router.route(source, target)
    if route is None:  # pragma: no cover - check_languages answered 400 before
        raise HTTPException(
            400, f"{source}->{target} is not served; supported pairs: {supported_pairs(router)}"
        )
    return route


def hypothesis(result: SentenceResult, k: int) -> str:
    """The k-th best translation, or the best when the search found fewer distinct ones."""
    return result.hypotheses[k] if k < len(result.hypotheses) else result.hypotheses[0]


def assemble(layouts: Sequence[Layout], results: Sequence[SentenceResult], n_best: int) -> list[list[str]]:
    """For each text, its ``n_best`` translations (best first), each in the text's layout."""
    outputs = []
    start = 0
    for layout in layouts:
        own = results[start : start + len(layout.sentences)]
        start += len(layout.sentences)
        outputs.append([layout.join([hypothesis(r, k) for r in own]) for k in range(n_best)])
    if start != len(results):
        raise RuntimeError(f"engine returned {len(results)} results for {start} sentences")
    return outputs


def build_response(
    req: TranslateRequest,
    outputs: list[list[str]],
    detected: list[DetectedLanguage] | None,
    terminology: list[Terminology | None] | None = None,
) -> TranslateResponse:
    """``detected``: each text's detected language when the source was "auto", else None;
    ``terminology``: each text's, present only when some text has one."""
    best = [texts[0] for texts in outputs]
    alternatives = [texts[1:] for texts in outputs] if req.alternatives else None
    if terminology is not None and not any(terminology):
        terminology = None
    if req.is_batch:
        return TranslateResponse(
            translatedText=best, alternatives=alternatives, detectedLanguage=detected, terminology=terminology
        )
    return TranslateResponse(
        translatedText=best[0],
        alternatives=alternatives[0] if alternatives else None,
        detectedLanguage=detected[0] if detected else None,
        terminology=terminology[0] if terminology else None,
    )


def marks(
    layouts: Sequence[Layout],
    terms: SentenceTerms,
    results: Sequence[SentenceResult],
    outputs: Sequence[Sequence[str]],
) -> list[Terminology | None] | None:
    """Each text's terminology, where its sentences had terms or came from the memory (else None:
    no field at all)."""
    memory = [r.memory for r in results]
    if not terms and not any(memory):
        return None
    best = [hypothesis(r, 0) for r in results]
    placed = [r.placed for r in results]
    return text_terminology(layouts, terms, best, placed, [texts[0] for texts in outputs], memory)


@router.post(
    "/translate",
    response_model=TranslateResponse,
    response_model_exclude_none=True,
    responses=_ERRORS,
    openapi_extra=_OPENAPI_BODY,
    summary="Translate text (LibreTranslate-compatible)",
)
async def translate(
    request: Request, settings: SettingsDep, router: RouterDep, scheduler: SchedulerDep
) -> Response:
    req = await parse_translate_request(request, settings.max_body_bytes)
    texts = req.texts
    check_limits(texts, settings)
    check_encodable(req)
    # LibreTranslate's cost: a list q counts as one request per text.
    admit_key(
        request,
        req.api_key,
        requests=max(1, len(texts)) if req.is_batch else 1,
        text_lengths=list(map(len, texts)),
    )
    candidates = check_languages(req.source, req.target, router)
    plan = search_plan(req, settings)
    glossary = request_glossary(request, req, settings)

    documents = parse_texts(texts, req.format)
    detected = None
    if req.source.lower() == AUTO:
        detected = [source_language(document.text, candidates) for document in documents]
    languages = [d.language for d in detected] if detected else candidates * len(documents)
    layouts = [document.split(language) for document, language in zip(documents, languages, strict=True)]
    sentences = [s for layout in layouts for s in layout.sentences]
    routes = [
        route_of(router, language, req.target)
        for layout, language in zip(layouts, languages, strict=True)
        for _ in layout.sentences
    ]
    limit = settings.max_terms_per_sentence
    terms = sentence_terms(sentences, glossary, protect=req.protect_placeholders, limit=limit)
    sources = [
        language for layout, language in zip(layouts, languages, strict=True) for _ in layout.sentences
    ]
    timeout_s = settings.request_timeout_s
    results = await answer_sentences(
        request, sentences, routes, sources, req.target, scheduler, plan, timeout_s, terms
    )
    if results is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    outputs = assemble(layouts, results, plan.n_best)
    body = build_response(req, outputs, detected, marks(layouts, terms, results, outputs))
    # The response as JSON here: FastAPI then skips validating it against the response model again
    # (the model still documents it in OpenAPI).
    return Response(body.model_dump_json(exclude_none=True), media_type="application/json")
