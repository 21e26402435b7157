"""The /v2 routes' refusals as DeepL answers them, in one place: ``DeepLRoute``, the route class of
every /v2 router, catches what a route or its dependencies raise (the use case's refusals, the
keys' limits, the stores' and the parsers' HTTP errors) and answers DeepL's status with DeepL's
body, ``{"message": "..."}``. The LibreTranslate routes keep their own answers
(``app.http.errors``): nothing here is installed on the app.

DeepL's clients act on the status alone: 403 a bad or missing key (``AuthorizationException``),
456 the character quota used up (``QuotaExceededException``), 429 too many requests (retried with
backoff, as 5xx are), 404 (``GlossaryNotFoundException`` on the glossary routes), 400 anything
malformed, 413 too large. A key's ``chars_per_day`` is the quota (DeepL's "character limit of the
billing period": 456, also for one request larger than all of it); its other limits are rates
(429, or 413 for a request larger than a whole window). FastAPI's 422 and the stores' 409 are 400
(DeepL has neither); every other status is the service's own (503 and 504 with Retry-After).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from app.http.errors import status_of, summarize_validation_errors
from app.keys.limits import LimitRefused
from app.translation.errors import TranslationError

QUOTA_EXCEEDED = 456  # DeepL's own status: the character quota of the period is used up
QUOTAS = frozenset({"chars_per_day"})  # the key's limits that are DeepL's quota
AS_DEEPL = {422: 400, 409: 400}  # statuses DeepL has no use for, as DeepL answers the same cases


class DeepLError(BaseModel):
    message: str


def deepl_status(status: int, exc: Exception) -> int:
    if isinstance(exc, LimitRefused) and exc.limit in QUOTAS:
        return QUOTA_EXCEEDED
    return AS_DEEPL.get(status, status)


def deepl_error(exc: Exception) -> JSONResponse | None:
    """DeepL's answer to ``exc``, or None for what is no refusal (a bug: the app's 500)."""
    headers: Mapping[str, str] | None = None
    if isinstance(exc, TranslationError):
        status, message = status_of(exc), str(exc)
        headers = {"Retry-After": exc.retry_after} if exc.retry_after else None
    elif isinstance(exc, HTTPException):
        status, message, headers = exc.status_code, str(exc.detail), exc.headers
    elif isinstance(exc, RequestValidationError):
        status, message = 400, summarize_validation_errors(list(exc.errors()))
    else:
        return None
    return JSONResponse({"message": message}, deepl_status(status, exc), headers)


class DeepLRoute(APIRoute):
    """A route that answers its refusals as DeepL does (this module's docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except (TranslationError, HTTPException, RequestValidationError) as e:
                response = deepl_error(e)
                assert response is not None
                return response

        return answer


def errors(**codes: str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of a /v2 route: ``errors(_403="...")``, each with DeepL's body."""
    return {int(code[1:]): {"model": DeepLError, "description": text} for code, text in codes.items()}


# What every /v2 route may answer, whatever it does.
COMMON = {
    "_400": "A parameter missing or malformed",
    "_403": "Missing or invalid key (Authorization: DeepL-Auth-Key KEY), when the server requires keys",
    "_429": "Over a rate of the key (see Retry-After)",
    "_503": "Not ready, or a store or the usage counts unavailable now (see Retry-After)",
}
