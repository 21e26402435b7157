"""POST /detect, LibreTranslate-compatible: the languages a text may be in, most likely first.

Only languages the service translates from are candidates (``app.translation.codes.source_languages``):
knowing that a text is Portuguese helps no one who cannot have it translated here. Confidences are
percentages (``app.translation.langid``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response

from app.http.body import parse_request
from app.http.deps import KeysDep, RouterDep, SettingsDep
from app.http.endpoints.openapi import openapi_body
from app.http.schemas import DetectRequest, ErrorResponse, ValidationErrorResponse
from app.keys.limits import admit_given_key, admit_key
from app.translation.codes import source_languages
from app.translation.langid import detect
from app.translation.results import DetectedLanguage
from app.translation.texts import check_encodable, check_limits

api = APIRouter(tags=["translate"])

# A text of up to this many characters is identified on the event loop (~1.5 ms; a thread hop costs
# ~0.1 ms), a longer one on a thread (NMT_MAX_CHARS may allow far more than its default 5,000).
INLINE_CHARS = 20_000

_OPENAPI_BODY = openapi_body(DetectRequest)
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "model": ErrorResponse,
        "description": 'q missing or empty ("Invalid request: missing q parameter", LibreTranslate\'s '
        "words), or invalid UTF-8",
    },
    403: {"model": ErrorResponse, "description": "Missing or invalid api_key (when keys are required)"},
    408: {"model": ErrorResponse, "description": "The request body did not arrive within 10 s"},
    413: {"model": ErrorResponse, "description": "More characters than NMT_MAX_CHARS, or too large a body"},
    422: {"model": ValidationErrorResponse, "description": "Malformed body, or q not a string"},
    429: {"model": ErrorResponse, "description": "Over a limit of the api_key (see Retry-After)"},
    503: {"model": ErrorResponse, "description": "The models are not loaded yet"},
}


@api.post(
    "/detect",
    response_model=list[DetectedLanguage],
    responses=_ERRORS,
    openapi_extra=_OPENAPI_BODY,
    summary="Detect the language of a text (LibreTranslate-compatible)",
)
async def detect_language(
    request: Request, settings: SettingsDep, router: RouterDep, keys: KeysDep
) -> Response:
    await admit_given_key(request, keys)  # a key in a header or the query: refused before the body is read
    req = await parse_request(request, settings.max_body_bytes, DetectRequest)
    check_limits([req.q], settings)
    check_encodable([req.q, req.api_key or ""])
    await admit_key(request, keys, req.api_key, requests=1, text_lengths=[len(req.q)])
    candidates = source_languages(router)
    if len(req.q) <= INLINE_CHARS:
        detections = detect(req.q, candidates)
    else:  # (time linear in the text: the event loop answers others meanwhile)
        detections = await asyncio.to_thread(detect, req.q, candidates)
    found = [DetectedLanguage(confidence=d.confidence, language=d.language) for d in detections]
    body = "[" + ",".join(d.model_dump_json() for d in found) + "]"
    return Response(body, media_type="application/json")
