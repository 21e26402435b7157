"""Load shedding: refuse translation requests before anything reads them when there is no room.

Under overload most requests are refused, and each refusal costs the front end CPU that the
workers could use. Here it costs as little as an answer can: checked first thing
(``app.http.entry.TranslationApp``, before FastAPI's own layers), no body read, no routing, no
validation, a fixed response. A request let through holds a place (``Scheduler.enter``) until the
route is about to admit it (``passed``) or it ends, so that one freed place lets one request be
parsed, not every one that arrived meanwhile; its sentences are then counted exactly at admission
(``Scheduler.submit``).

A request let through then waits for its turn (``take_turn``): at most ``TURNS`` requests at a
time are between the gate and admission, where the front end spends its CPU on them (reading,
parsing, validating, splitting, tokenizing). Without that bound, a burst (2,048 clients connecting
at once, or held-back clients all coming back) would be let through in one turn of the event
loop, which would then spend over a second on it before anything else, /health included, got its
turn.

A client that retries at once, ignoring Retry-After, is held to it: the connection that got the
503 is not read again for ``RETRY_AFTER_S`` (its answer was sent at once; its next request waits in
the socket, costing nothing). Without that, 2,048 connections retrying in a loop keep the front
end reading and refusing ~1,600 requests a second, and each turn of its event loop takes so long
that a new connection waits 1.7-2 s for ``/health`` (measured with ``python -m benchmarks.overload``
on 2 cores; with the hold-back, under 1 s).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import Scope, Send

from app.services import AppServices

SHED_PATHS = frozenset({"/translate", "/v2/translate"})  # LibreTranslate's and DeepL's
DEEPL_PATHS = "/v2/"  # DeepL's API: its errors say ``message``, LibreTranslate's ``error``
RETRY_AFTER_S = "1"
BUSY = "server busy: every translation queue is full, retry later"


def error_body(scope: Scope, message: str) -> bytes:
    """An error's JSON body in the words of the API ``scope`` asks."""
    field = "message" if scope["path"].startswith(DEEPL_PATHS) else "error"
    return json.dumps({field: message}).encode()


BUSY_BODIES = {path: error_body({"path": path}, BUSY) for path in SHED_PATHS}
GATE_KEY = "nmt.gate"  # in the scope: the scheduler whose place the request holds
TURN_KEY = "nmt.turn"  # in the scope: the semaphore whose turn the request holds
TURNS = 32  # requests parsed at a time: ~15 ms of the event loop's time per turn, not seconds


def shed(scope: Scope) -> bool:
    """Whether ``scope`` is a translation request: one the gate lets through or refuses."""
    return scope["type"] == "http" and scope["path"] in SHED_PATHS


async def refused_at_once(services: AppServices, scope: Scope, send: Send) -> bool:
    """``refused``'s answer, if there is no room now, without taking a place when there is: before
    the body is read (``app.http.slow_clients``), so that a body that trickles in holds no place."""
    scheduler = services.scheduler
    if not shed(scope) or scheduler is None or scheduler.has_room():
        return False
    await refuse(services, scope, send)
    return True


async def refused(services: AppServices, scope: Scope, send: Send) -> bool:
    """Answer 503 at once if ``scope`` is a translation request and there is no room for it."""
    scheduler = services.scheduler
    if not shed(scope) or scheduler is None:
        return False
    if scheduler.enter():
        scope[GATE_KEY] = scheduler
        return False
    await refuse(services, scope, send)
    return True


async def refuse(services: AppServices, scope: Scope, send: Send) -> None:
    body = BUSY_BODIES[scope["path"]]
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", RETRY_AFTER_S.encode()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    if services.metrics is not None:  # (it is: the lifespan makes it before the scheduler)
        services.metrics.requests.labels(endpoint=scope["path"], status="503").inc()
    hold_back(send, float(RETRY_AFTER_S))


def hold_back(send: Send, seconds: float) -> None:
    """Read nothing more from this connection for ``seconds``, where the server lets us: uvicorn's
    ``send`` is a method of the request's cycle, whose flow control pauses and resumes reading (it
    resumed it when the answer above was complete). Elsewhere, nothing happens."""
    flow: Any = getattr(getattr(send, "__self__", None), "flow", None)
    if flow is None or not hasattr(flow, "pause_reading") or not hasattr(flow, "resume_reading"):
        return
    flow.pause_reading()
    asyncio.get_running_loop().call_later(seconds, flow.resume_reading)


async def take_turn(services: AppServices, scope: Scope) -> None:
    """Wait until fewer than ``TURNS`` requests let through by the gate are being parsed (only
    those: other requests go on at once). The turn is given back by ``passed``."""
    turns = services.turns
    if turns is None or GATE_KEY not in scope:
        return
    await turns.acquire()
    scope[TURN_KEY] = turns


def passed(scope: Scope) -> None:
    """The request no longer needs the place it held at the gate, nor its turn (its sentences are
    about to be counted, or it ended); a second call does nothing."""
    scheduler = scope.pop(GATE_KEY, None)
    if scheduler is not None:
        scheduler.leave()
    turns = scope.pop(TURN_KEY, None)
    if turns is not None:
        turns.release()
