"""POST /translate, LibreTranslate-compatible.

Each text is split into sentences (app.formats) and tokenized here; the sentences of one request
go to the workers of the model that serves its pair (``app.serving.frontend.router``; two models one after
the other for a pair served through English, ``app.serving.frontend.pipeline``), where they share batches
with each other and with other requests, and their translations are put back into each text's
layout. Terminology (``app.terminology.service``): each sentence's glossary terms and placeholders
are given to the decoder as constraints, and the response says where they are.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from fastapi import APIRouter, HTTPException, Request, Response

from app.body import parse_translate_request
from app.config import Settings
from app.deps import GlossariesDep, KeysDep, RouterDep, SchedulerDep, SettingsDep
from app.errors import ApiError, missing_parameter
from app.formats import Layout, PlainText, parse
from app.formats.html import HtmlDocument, HtmlError
from app.key_limits import admit_given_key, admit_key
from app.langid import detect
from app.languages import language_name, served_pairs, source_languages, supported_pairs, target_languages
from app.routes.openapi import openapi_body
from app.routes.sentences import (
    RecallDep,
    SearchPlan,
    answer_sentences,
)
from app.schemas import (
    BadRequestResponse,
    DetectedLanguage,
    ErrorResponse,
    Terminology,
    TranslateRequest,
    TranslateResponse,
    ValidationErrorResponse,
)
from app.served import ServedModel
from app.serving.frontend.router import Route, Router
from app.serving.protocol import SentenceResult
from app.terminology.service import (
    INLINE_CHARS,
    SentenceTerms,
    request_glossary,
    sentence_terms,
    text_terminology,
)
from model.decoding.terms import Glossary

T = TypeVar("T")

api = APIRouter(tags=["translate"])

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
    texts = result.texts
    return texts[k] if k < len(texts) else texts[0]


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


@dataclass(frozen=True)
class Prepared:
    """A request's texts made ready to be decoded (``prepare``)."""

    detected: list[DetectedLanguage] | None  # each text's language, when the source is "auto"
    layouts: list[Layout]  # each text's
    sentences: list[str]  # of all the texts, in order
    routes: list[Route[ServedModel]]  # each sentence's
    sources: list[str]  # each sentence's language
    terms: SentenceTerms  # each sentence's


def prepare(
    req: TranslateRequest,
    candidates: Sequence[str],
    glossary: Glossary | None,
    router: Router[ServedModel],
    max_terms: int,
) -> Prepared:
    """Each text parsed (``format``), its language detected (a source of "auto"), split into
    sentences, each sentence routed and its terms found. Work that grows with the text: the
    route runs it on a thread unless the request is small (``INLINE_CHARS``, no glossary)."""
    documents = parse_texts(req.texts, req.format)
    detected = None
    if req.source.lower() == AUTO:
        detected = [source_language(document.text, candidates) for document in documents]
    languages = [d.language for d in detected] if detected else list(candidates) * len(documents)
    layouts = [document.split(language) for document, language in zip(documents, languages, strict=True)]
    sentences = [s for layout in layouts for s in layout.sentences]
    routes = [
        route_of(router, language, req.target)
        for layout, language in zip(layouts, languages, strict=True)
        for _ in layout.sentences
    ]
    terms = sentence_terms(sentences, glossary, protect=req.protect_placeholders, limit=max_terms)
    sources = [
        language for layout, language in zip(layouts, languages, strict=True) for _ in layout.sentences
    ]
    return Prepared(detected, layouts, sentences, routes, sources, terms)


@api.post(
    "/translate",
    response_model=TranslateResponse,
    response_model_exclude_none=True,
    responses=_ERRORS,
    openapi_extra=_OPENAPI_BODY,
    summary="Translate text (LibreTranslate-compatible)",
)
async def translate(
    request: Request,
    settings: SettingsDep,
    router: RouterDep,
    scheduler: SchedulerDep,
    keys: KeysDep,
    glossaries: GlossariesDep,
    recall: RecallDep,
) -> Response:
    await admit_given_key(request, keys)  # a key in a header or the query: refused before the body is read
    req = await parse_translate_request(request, settings.max_body_bytes)
    texts = req.texts
    check_limits(texts, settings)
    check_encodable(req)
    # LibreTranslate's cost: a list q counts as one request per text.
    await admit_key(
        request,
        keys,
        req.api_key,
        requests=max(1, len(texts)) if req.is_batch else 1,
        text_lengths=list(map(len, texts)),
    )
    candidates = check_languages(req.source, req.target, router)
    plan = search_plan(req, settings)
    glossary = await request_glossary(request, req, settings, glossaries)
    work = partial(prepare, req, candidates, glossary, router, settings.max_terms_per_sentence)
    if glossary is None and sum(map(len, texts)) <= INLINE_CHARS:
        prepared = work()
    else:  # (parsing, splitting and terms grow with the text: the event loop answers others meanwhile)
        prepared = await asyncio.to_thread(work)
    timeout_s = settings.request_timeout_s
    sentences, terms, layouts = prepared.sentences, prepared.terms, prepared.layouts
    results = await answer_sentences(
        request,
        sentences,
        prepared.routes,
        prepared.sources,
        req.target,
        scheduler,
        plan,
        timeout_s,
        terms,
        recall,
    )
    if results is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    outputs = assemble(layouts, results, plan.n_best)
    body = build_response(req, outputs, prepared.detected, marks(layouts, terms, results, outputs))
    # The response as JSON here: FastAPI then skips validating it against the response model again
    # (the model still documents it in OpenAPI).
    return Response(body.model_dump_json(exclude_none=True), media_type="application/json")
