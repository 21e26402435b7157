"""The service's ASGI entry: FastAPI, with what must happen before FastAPI's layers done first.

A translation request is refused first thing when there is no room for it (``app.http.shedding``),
before FastAPI's and Starlette's layers, which cost more than the refusal; a client address past
its bound of open requests is answered 429 (``app.http.slow_clients``); a /translate body is read whole
before the request takes the gate's place or a parsing turn; POST /translate then goes to its
endpoint directly (``app.http.direct``), everything else through FastAPI. Made by ``app.main.create_app``.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from starlette.types import Receive, Scope, Send

from app.http.body import too_large
from app.http.deps import services_of
from app.http.direct import DirectRoute
from app.http.endpoints import translate
from app.http.endpoints.deepl.errors import deepl_error
from app.http.errors import http_exception_handler
from app.http.middleware import UNKNOWN_ENDPOINT
from app.http.shedding import DEEPL_PATHS, error_body, passed, refused, refused_at_once, shed, take_turn
from app.http.slow_clients import (
    BODY_TIMEOUT_S,
    CLIENT_GONE,
    HEALTH,
    BodyError,
    answer,
    client_address,
    declared_length,
    receive_body,
    replayed,
    too_many,
)
from app.keys.limits import admit_given_key, release_key
from app.services import AppServices


class TranslationApp(FastAPI):
    """FastAPI, with translation requests refused first thing when there is no room for them
    (``app.http.shedding``): before FastAPI's and Starlette's layers, which cost more than the refusal.
    POST /translate then goes to its endpoint directly (``app.http.direct``), everything else through
    FastAPI."""

    direct: DirectRoute | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        clients = self.services.clients
        if scope["type"] != "http" or clients is None or scope["path"].startswith(HEALTH):
            await self._serve(scope, receive, send)  # (probes are never held back by a client's count)
            return
        address = client_address(scope)
        if not clients.take(address):  # this address has as many requests open as it may
            self._count(scope, "429")
            await too_many(send)
            return
        try:
            await self._serve(scope, receive, send)
        finally:
            clients.give(address)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        services = self.services
        if shed(scope) and scope["method"] == "POST" and services.settings is not None:
            # The body first, holding nothing the service has few of (app.http.slow_clients); before
            # it, what the headers alone refuse: a full queue, a key given in a header or the query
            # (unknown, or over its limits), a body announced larger than any allowed.
            if await refused_at_once(services, scope, send):
                return
            request = Request(scope, receive)
            try:
                if services.keys is not None:
                    await admit_given_key(request, services.keys)
                declared = declared_length(scope)
                if declared is not None and declared > services.settings.max_body_bytes:
                    raise too_large(services.settings.max_body_bytes)
            except HTTPException as e:
                self._count(scope, str(e.status_code))
                deepl = scope["path"].startswith(DEEPL_PATHS)
                response = deepl_error(e) if deepl else await http_exception_handler(request, e)
                assert response is not None
                await response(scope, receive, send)
                return
            try:
                body = await receive_body(
                    receive, services.settings.max_body_bytes, time.monotonic() + BODY_TIMEOUT_S
                )
            except BodyError as e:
                if e.status != CLIENT_GONE:
                    self._count(scope, str(e.status))
                    await answer(send, e.status, error_body(scope, str(e)), close=True)
                return
            receive = replayed(body, receive)
        if await refused(services, scope, send):
            return
        try:
            await take_turn(services, scope)
            if self.direct is not None and DirectRoute.matches(scope):
                await self.direct(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)
        finally:
            passed(scope)
            await release_key(scope)

    def _count(self, scope: Scope, status: str) -> None:
        """A request answered here, before the metrics middleware saw it, counted as it would."""
        if self.services.metrics is not None:  # (the path only where it is a known one: labels stay few)
            endpoint = scope["path"] if shed(scope) else UNKNOWN_ENDPOINT
            self.services.metrics.requests.labels(endpoint=endpoint, status=status).inc()

    @property
    def services(self) -> AppServices:
        return services_of(self)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's document; once the models are loaded, with their languages and the limits."""
        document = super().openapi()  # built once and cached by FastAPI
        services = self.services
        if services.router is None or services.settings is None:
            return document
        return translate.document_served(document, services.router, services.settings)
