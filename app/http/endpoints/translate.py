"""POST /translate, LibreTranslate-compatible: the body parsed and checked, the key admitted, then
the use case (``app.translation.texts``: split, memory and cache, the model, render) and its
result as LibreTranslate's response. Its refusals are answered by ``app.http.errors``' table.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response

from app.config import Settings
from app.http.body import parse_translate_request
from app.http.deps import GlossariesDep, KeysDep, RouterDep, SchedulerDep, SettingsDep
from app.http.endpoints.openapi import openapi_body
from app.http.endpoints.request_glossary import request_glossary
from app.http.endpoints.sentences import RecallDep, request_caller
from app.http.schemas import (
    BadRequestResponse,
    ErrorResponse,
    LowConfidence,
    SentenceConfidence,
    TokenConfidence,
    TranslateRequest,
    TranslateResponse,
    ValidationErrorResponse,
)
from app.keys.limits import admit_given_key, admit_key, client_identity, key_owner, min_confidence
from app.models.served import ServedModel
from app.serving.frontend.router import Router
from app.translation.codes import source_languages, target_languages
from app.translation.languages import AUTO
from app.translation.texts import TextRequest, TextResult, Translations, check_encodable, check_limits

api = APIRouter(tags=["translate"])

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"

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


def confidence_fields(req: TranslateRequest, result: TextResult, threshold: float | None) -> dict[str, Any]:
    """The confidence extension's fields, each a list over the texts (``build_response`` unwraps
    them for a single text): only those asked for; ``lowConfidence`` where ``threshold`` (the
    request's, its key's or the service's) applies."""
    found = result.confidence
    if found is None:
        return {}
    fields: dict[str, Any] = {}
    if req.confidence:
        fields["confidence"] = [c.values[0] for c in found]
        fields["sentenceConfidence"] = [
            [SentenceConfidence(start=a, end=b, confidence=v) for a, b, v in c.sentences or ()] for c in found
        ]
        if req.alternatives:
            fields["alternativesConfidence"] = [c.values[1:] for c in found]
    if req.confidence == "tokens":
        fields["tokenConfidence"] = [
            [TokenConfidence(token=t, probability=p) for t, p in c.tokens or ()] for c in found
        ]
    if threshold is not None:
        fields["lowConfidence"] = [
            LowConfidence(sentences=c.below or 0, withheld=c.withheld, threshold=threshold) for c in found
        ]
    return fields


def build_response(req: TranslateRequest, result: TextResult, threshold: float | None) -> TranslateResponse:
    """LibreTranslate's answer: a text's fields for a single text, lists for a batch."""
    outputs, detected, terminology = result.translations, result.detected, result.terminology
    best = [texts[0] for texts in outputs]
    alternatives = [texts[1:] for texts in outputs] if req.alternatives else None
    extra = confidence_fields(req, result, threshold)
    if req.is_batch:
        return TranslateResponse(
            translatedText=best,
            alternatives=alternatives,
            detectedLanguage=detected,
            terminology=terminology,
            **extra,
        )
    return TranslateResponse(
        translatedText=best[0],
        alternatives=alternatives[0] if alternatives else None,
        detectedLanguage=detected[0] if detected else None,
        terminology=terminology[0] if terminology else None,
        **{name: values[0] for name, values in extra.items()},
    )


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
    fields = [*texts, req.source, req.target, req.api_key or "", req.glossary_id or ""]
    check_encodable(fields + [text for entry in req.glossary or () for text in (entry.source, entry.target)])
    # LibreTranslate's cost: a list q counts as one request per text.
    await admit_key(
        request,
        keys,
        req.api_key,
        requests=max(1, len(texts)) if req.is_batch else 1,
        text_lengths=list(map(len, texts)),
    )
    threshold = min_confidence(request, settings, req.min_confidence)
    asked = TextRequest(
        texts,
        req.source,
        req.target,
        request_caller(request, key_owner(request), client_identity(request), settings.request_timeout_s),
        format=req.format,
        alternatives=req.alternatives,
        beam_size=req.beam_size,
        glossary=partial(request_glossary, request, req, settings, glossaries),
        protect_placeholders=req.protect_placeholders,
        confidence="tokens" if req.confidence == "tokens" else "sentence" if req.confidence else None,
        min_confidence=threshold,
        withhold=req.low_confidence == "withhold",
    )
    result = await Translations(settings, router, scheduler, recall).texts(asked)
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # The response as JSON here: FastAPI then skips validating it against the response model again
    # (the model still documents it in OpenAPI).
    body = build_response(req, result, threshold).model_dump_json(exclude_none=True)
    return Response(body, media_type="application/json")
