"""POST /translate without FastAPI's layers: the same endpoint, its handlers and metrics, less CPU.

A request through FastAPI passes five middleware layers, the router's match over every route,
``solve_dependencies`` and two request-response wrappers before the endpoint runs: about a
quarter of the front end's CPU per /translate request, on the two cores the workers decode on
(py-spy, 64 connections). ``DirectRoute`` serves the one path that matters for throughput
straight from ``TranslationApp.__call__``, after the shedding gate and the turn, as FastAPI would
have served it:

- the endpoint is the route's own function (``app.routes.translate.translate``), called with the
  dependencies' own functions (``app.deps``): a 503 before the models are loaded comes from the
  same code;
- ``RequestMetricsMiddleware`` counts it (with the matched route in ``scope``, as the router
  leaves it: the same labels);
- an exception is answered by the handler the app registered for it (``app.errors``), looked up
  as Starlette's ``ExceptionMiddleware`` and ``ServerErrorMiddleware`` do: by status code for an
  ``HTTPException``, then along the exception's class hierarchy; an unexpected one is answered 500
  and raised again, for the server to log.

Everything else (other paths and methods, /translate/ with a slash, HEAD, OPTIONS) goes through
FastAPI. The route stays registered there too: it is what OpenAPI documents.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from app.deps import (
    get_glossaries,
    get_keys,
    get_memory,
    get_router,
    get_scheduler,
    get_segment_cache,
    get_settings,
    services_of,
)
from app.middleware import RequestMetricsMiddleware
from app.routes.sentences import get_recall
from app.routes.translate import api as translate_routes
from app.routes.translate import translate

PATH = "/translate"


class DirectRoute:
    """``POST /translate`` as an ASGI app of its own (``matches`` says which requests it takes)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        routes = [
            r
            for r in translate_routes.routes
            if isinstance(r, APIRoute) and r.path == PATH and "POST" in (r.methods or ())
        ]
        if len(routes) != 1:
            raise RuntimeError(f"expected one POST {PATH} route, found {len(routes)}")
        self.route = routes[0]
        self.asgi = RequestMetricsMiddleware(self._serve, services_of(app))

    @staticmethod
    def matches(scope: Scope) -> bool:
        return scope["type"] == "http" and scope["path"] == PATH and scope["method"] == "POST"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self.app  # (Starlette.__call__ sets it; Request.app reads it)
        if self.app.root_path:
            scope["root_path"] = self.app.root_path
        scope["route"] = self.route  # what the router would have matched: the metrics' label
        await self.asgi(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            # In the order of the endpoint's parameters, as FastAPI solves them.
            settings, router, scheduler = (
                await get_settings(request),
                await get_router(request),
                await get_scheduler(request),
            )
            keys, glossaries = await get_keys(request), await get_glossaries(request)
            recall = await get_recall(settings, await get_memory(request), await get_segment_cache(request))
            response = await translate(request, settings, router, scheduler, keys, glossaries, recall)
        except Exception as exc:
            key = self._handler(exc)
            if key is None:
                raise
            answer = self.app.exception_handlers[key](request, exc)
            response = await answer if inspect.isawaitable(answer) else answer
            await response(scope, receive, send)
            if key in (Exception, 500):
                raise  # as ServerErrorMiddleware: answered 500, and raised for the server's log
            return
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Any:
        """Which of the app's handlers Starlette would call for ``exc`` (its key): its status
        code's, then its class's, nearest first."""
        handlers = self.app.exception_handlers
        if isinstance(exc, HTTPException) and exc.status_code in handlers:
            return exc.status_code
        return next((cls for cls in type(exc).__mro__ if cls in handlers), None)
