"""POST /translate without FastAPI's layers: the same endpoint, its handlers and metrics, less CPU.

A request through FastAPI passes five middleware layers, the router's match over every route,
``solve_dependencies`` and two request-response wrappers before the endpoint runs: about a
quarter of the front end's CPU per /translate request, on the two cores the workers decode on
(py-spy, 64 connections). ``DirectRoute`` serves the one path that matters for throughput
straight from ``TranslationApp.__call__``, after the shedding gate and the turn, as FastAPI would
have served it:

- the endpoint is the route's own function (``app.http.endpoints.translate.translate``), called with its
  dependencies' own functions, found in the dependency tree FastAPI built from the endpoint's
  signature (``route.dependant``: nothing here names them or their order), each called once per
  request as FastAPI caches them: a 503 before the models are loaded comes from the same code. A
  dependency that needs FastAPI's own parsing (a query, header or body parameter, a sync
  function run on a thread, a security scope) is refused when the app starts;
- ``RequestMetricsMiddleware`` counts it (with the matched route in ``scope``, as the router
  leaves it: the same labels);
- an exception is answered by the handler the app registered for it (``app.http.errors``), looked up
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
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from app.http.deps import services_of
from app.http.endpoints.translate import api as translate_routes
from app.http.middleware import RequestMetricsMiddleware

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
        check_plain(self.route.dependant)
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
            dependant = self.route.dependant
            assert dependant.call is not None
            response = await dependant.call(**await solve(dependant, request, {}))
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


def check_plain(dependant: Dependant) -> None:
    """``RuntimeError`` unless every dependency of ``dependant`` (and it) takes only the request and
    other such dependencies, and is a coroutine function: what ``solve`` can call as FastAPI would."""
    parsed = (
        dependant.path_params,
        dependant.query_params,
        dependant.header_params,
        dependant.cookie_params,
        dependant.body_params,
    )
    others = (
        dependant.websocket_param_name,
        dependant.http_connection_param_name,
        dependant.response_param_name,
        dependant.background_tasks_param_name,
        dependant.security_scopes_param_name,
    )
    name = getattr(dependant.call, "__qualname__", repr(dependant.call))
    plain = inspect.iscoroutinefunction(dependant.call) and dependant.use_cache
    if any(parsed) or any(others) or not plain:
        raise RuntimeError(f"{PATH}: {name} needs more than the request and its dependencies")
    for sub in dependant.dependencies:
        check_plain(sub)


async def solve(dependant: Dependant, request: Request, solved: dict[Any, Any]) -> dict[str, Any]:
    """The keyword arguments of ``dependant.call``: the request, and each dependency's value, each
    dependency called once per request (``solved``: by function, as FastAPI's cache does)."""
    values: dict[str, Any] = {}
    if dependant.request_param_name:
        values[dependant.request_param_name] = request
    for sub in dependant.dependencies:
        if sub.call not in solved:
            assert sub.call is not None
            solved[sub.call] = await sub.call(**await solve(sub, request, solved))
        if sub.name is not None:
            values[sub.name] = solved[sub.call]
    return values
