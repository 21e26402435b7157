"""Error responses: every error body has an ``error`` key, as LibreTranslate clients expect.

Bad input is always a 4xx with a message saying what to change; a 500 means a bug in the service
and is logged. Where LibreTranslate has a message for a case (a missing parameter, an unsupported
language) the ``error`` is its message word for word, since clients and LibreTranslate's own tests
compare it; anything more we have to say goes in other fields of the body (``supportedPairs``
beside an unsupported language: ``translation_error_handler``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.stores.database.errors import StoreUnavailable, logged
from app.translation.errors import (
    Busy,
    Invalid,
    TimedOut,
    TooLarge,
    TranslationError,
    Unavailable,
    Unsupported,
)

logger = logging.getLogger(__name__)

# Keys of a pydantic error worth returning; "input" is left out so that a 1 MiB body is not echoed.
_ERROR_KEYS = ("type", "loc", "msg", "ctx")
_MAX_LISTED_ERRORS = 5


def error_response(
    status_code: int,
    message: str,
    headers: Mapping[str, str] | None = None,
    fields: Mapping[str, Any] | None = None,
) -> JSONResponse:
    return JSONResponse({"error": message, **(fields or {})}, status_code=status_code, headers=headers)


def summarize_validation_errors(errors: list[dict[str, Any]]) -> str:
    """``"q: Input should be a valid string; alternatives: ..."`` (the field first, then the problem)."""
    parts = []
    for err in errors[:_MAX_LISTED_ERRORS]:
        if err.get("type") == "json_invalid":  # loc holds a character offset, not a field
            position = err["loc"][-1]
            parts.append(f"invalid JSON at character {position}: {err.get('ctx', {}).get('error', '')}")
            continue
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    more = len(errors) - _MAX_LISTED_ERRORS
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


# The use case's refusals (``app.translation.errors``) as HTTP statuses, nearest class first. A
# document job records the same status as its answer.
TRANSLATION_STATUS: dict[type[TranslationError], int] = {
    Invalid: 400,
    TooLarge: 413,
    Busy: 503,
    Unavailable: 503,
    TimedOut: 504,
    TranslationError: 400,
}


def status_of(error: TranslationError) -> int:
    return next(TRANSLATION_STATUS[cls] for cls in type(error).__mro__ if cls in TRANSLATION_STATUS)


async def translation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """A refusal of the use case: its status, its message as ``error``, Retry-After where waiting
    helps, and the served pairs beside LibreTranslate's words for a pair not served."""
    assert isinstance(exc, TranslationError)
    headers = {"Retry-After": exc.retry_after} if exc.retry_after else None
    fields = {"supportedPairs": exc.supported} if isinstance(exc, Unsupported) else None
    return error_response(status_of(exc), str(exc), headers, fields)


def unavailable(e: StoreUnavailable, what: str, retry_after_s: str) -> StarletteHTTPException:
    """The 503 for a store that failed: ``what`` ("the job store") and Retry-After, never the file's
    path or the database's words, which are logged for the operator instead."""
    return StarletteHTTPException(503, logged(e, what), {"Retry-After": retry_after_s})


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail), exc.headers)


async def validation_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    """422 with FastAPI's usual ``detail`` list plus a one-line ``error`` naming the fields."""
    assert isinstance(exc, RequestValidationError)
    errors = [{k: e[k] for k in _ERROR_KEYS if k in e} for e in exc.errors()]
    body = {"error": summarize_validation_errors(errors), "detail": jsonable_encoder(errors)}
    return JSONResponse(body, status_code=422)


async def unhandled_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    # The server logs the traceback too (Starlette re-raises after this handler has answered).
    logger.error("unhandled error in %s %s: %r", request.method, request.url.path, exc)
    return error_response(500, "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(TranslationError, translation_error_handler)
    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    app.add_exception_handler(Exception, unhandled_exception_handler)
