"""Request metrics: a count per (endpoint, status) and a latency histogram per endpoint; and which
request the current task serves, for the event loop's monitor (``app.monitoring.loop.REQUEST``).

A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware
wraps ``receive``, which gets in the way of the disconnect polling of /translate.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.monitoring.loop import REQUEST
from app.services import AppServices

UNKNOWN_ENDPOINT = "other"


def endpoint_label(scope: Scope) -> str:
    """The matched route's path template ("/translate"), never the raw URL: the label set stays
    bounded whatever paths clients send. Unmatched paths (404s) share ``UNKNOWN_ENDPOINT``."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) else UNKNOWN_ENDPOINT


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, services: AppServices) -> None:
        self.app = app
        self.services = services  # its metrics are there once the lifespan has started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.services.metrics
        if scope["type"] != "http" or metrics is None:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def send_and_record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        serving = REQUEST.set(scope)  # (tasks started from here copy it: they serve it too)
        try:
            await self.app(scope, receive, send_and_record_status)
        finally:
            REQUEST.reset(serving)
            # The router has written the matched route into ``scope`` by now.
            endpoint = endpoint_label(scope)
            metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
            metrics.request_latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)
