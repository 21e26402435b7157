"""Slow clients cost only themselves: no scarce place is held while a body trickles in, a body has a
deadline, and one client address has a bounded number of requests open at once.

The places the service has few of are taken only once a request's body is in memory (``receive_body``,
``replayed``): the gate's place in the translation queue and a parsing turn (``app.http.shedding``), and an
upload's place (``app.http.uploads``). A client that sends headers and then nothing (or a byte a second)
holds a coroutine and a socket, and is answered 408 and closed once its deadline passes, counted from
when its request reached the app (right after its headers): ``BODY_TIMEOUT_S`` for a /translate body,
more for a large upload (``upload_seconds``).

``ClientLimit`` bounds the requests open at once per client address (``NMT_MAX_CONNECTIONS_PER_CLIENT``;
the address is the peer's, or the one a trusted proxy forwarded, uvicorn's ``FORWARDED_ALLOW_IPS``):
past it a request is answered 429 with ``Connection: close`` after ``EXCESS_HOLD_S`` on average,
before anything else is done for it, so that 2,000 connections from one address cannot hold 2,000
of anything, and a client that reconnects at once does so every 5 s per connection, not in a busy
loop (held 1 s, 2,000 of them opened 1,700 connections a second, and a real client's p99 was 308 ms,
not 133: ``benchmarks.slow_clients``). Each is held a random time between half and one and a half
times that: held alike, 1,536 connections opened at once were answered, closed and reopened at
once every 5 s, and the event loop's turn that served them delayed ``/health`` by up to 0.2 s
(``benchmarks.overload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass

from starlette.types import Message, Receive, Scope, Send

BODY_TIMEOUT_S = 10.0  # a /translate body, from when the request reached the app
CLIENT_GONE = 499  # (nginx's code: no answer is sent)
HEALTH = "/health"  # the probes' paths start so: never counted against an address
EXCESS_HOLD_S = 5.0  # on average; each request past the bound: between 0.5 and 1.5 times it
# An upload (/translate_file, POST /jobs) keeps up with this rate on average past its first
# UPLOAD_GRACE_S, or is answered 408: a slow link uploads a 2 MiB file in ~18 s, and a client that
# sends a byte a second holds an upload's place for UPLOAD_GRACE_S, not minutes.
MIN_UPLOAD_RATE = 128 * 1024
UPLOAD_GRACE_S = 5.0
TOO_MANY = b'{"error":"too many requests open from your address at once; retry later"}'


class BodyError(Exception):
    """The body did not arrive whole: too slowly (408), or too large (413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ClientLimit:
    """Requests open at once per client address, at most ``per_client`` (0: no bound)."""

    per_client: int
    open: dict[str, int]

    @classmethod
    def of(cls, per_client: int) -> ClientLimit:
        return cls(per_client, {})

    def take(self, address: str) -> bool:
        held = self.open.get(address, 0)
        if self.per_client and held >= self.per_client:
            return False
        self.open[address] = held + 1
        return True

    def give(self, address: str) -> None:
        left = self.open[address] - 1
        if left:
            self.open[address] = left
        else:  # (only the addresses with a request open are kept)
            del self.open[address]


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else ""


async def answer(send: Send, status: int, body: bytes, *, close: bool = False, retry_after: str = "") -> None:
    """A JSON answer sent straight through the ASGI ``send`` (nothing of FastAPI's runs)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    if retry_after:
        headers.append((b"retry-after", retry_after.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def too_many(send: Send) -> None:
    """The answer to a request past its address's bound: after ``EXCESS_HOLD_S`` on average (spread,
    so that connections refused together are not answered and reopened together), then closed."""
    await asyncio.sleep(EXCESS_HOLD_S * random.uniform(0.5, 1.5))
    await answer(send, 429, TOO_MANY, close=True, retry_after="1")


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.strip().isdigit() else None
    return None


async def receive_body(
    receive: Receive, limit: int, deadline: float, min_rate: float = 0.0, grace_s: float = 0.0
) -> bytes:
    """The request's whole body, read by ``deadline`` (``time.monotonic()``), at most ``limit`` bytes,
    and, past ``grace_s`` from now, at ``min_rate`` bytes a second at least on average (``BodyError``
    otherwise: 408 or 413)."""
    chunks: list[bytes] = []
    size = 0
    started = time.monotonic()
    while True:
        due = deadline
        if min_rate > 0:  # when the bytes so far fall behind the rate, unless more come
            due = min(due, started + grace_s + size / min_rate)
        message = await next_message(receive, due)
        size += len(message.get("body", b""))
        if size > limit:
            raise BodyError(413, f"request body is larger than {limit} bytes")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def next_message(receive: Receive, due: float) -> Message:
    """The body's next message, by ``due`` (``time.monotonic()``; ``BodyError`` 408 past it, and
    ``CLIENT_GONE`` for a client that went away)."""
    left = due - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        async with asyncio.timeout(left):
            message = await receive()
    except TimeoutError:
        raise BodyError(408, "request body not received in time") from None
    if message["type"] == "http.disconnect":
        raise BodyError(CLIENT_GONE, "the client went away")
    return message


def upload_seconds(size: int) -> float:
    """The most time an upload of ``size`` bytes may take: ``UPLOAD_GRACE_S``, plus a second per
    ``MIN_UPLOAD_RATE`` bytes."""
    return UPLOAD_GRACE_S + size / MIN_UPLOAD_RATE


def replayed(body: bytes, receive: Receive, more: bool = False) -> Receive:
    """A ``receive`` that gives ``body`` (the whole body, or with ``more`` its start), then what the
    connection says next (the rest, or a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replay


# -- a form's key before its file --------------------------------------------------------------------

FORM_PREFIX_BYTES = 64 * 1024  # read at most this much of a form looking for its key


def form_fields_before_file(prefix: bytes, boundary: bytes) -> tuple[dict[str, str], bool]:
    """The fields complete in ``prefix`` (the start of a multipart body) before its first file part,
    and whether that part (or the body's end) was reached: nothing more can come before it."""
    fields: dict[str, str] = {}
    delimiter = b"--" + boundary
    start = prefix.find(delimiter)
    while start >= 0:
        after = start + len(delimiter)
        if prefix[after : after + 2] == b"--":  # the closing delimiter
            return fields, True
        head_end = prefix.find(b"\r\n\r\n", after)
        if head_end < 0:
            return fields, False
        headers = prefix[after:head_end].decode("latin-1").lower()
        disposition = next((h for h in headers.split("\r\n") if h.startswith("content-disposition:")), "")
        if "filename=" in disposition:
            return fields, True
        end = prefix.find(b"\r\n" + delimiter, head_end + 4)
        if end < 0:
            return fields, False
        name = disposition.split('name="', 1)[1].split('"', 1)[0] if 'name="' in disposition else ""
        with contextlib.suppress(UnicodeDecodeError):  # (the form's own parser answers it 400 later)
            fields.setdefault(name, prefix[head_end + 4 : end].decode("utf-8"))
        start = end + 2
    return fields, False


async def form_key_first(scope: Scope, receive: Receive, deadline: float) -> tuple[str | None, Receive]:
    """An upload's ``api_key`` field, if the client sent it before the file part: read from the
    first ``FORM_PREFIX_BYTES`` at most, at ``MIN_UPLOAD_RATE`` past ``UPLOAD_GRACE_S``, by
    ``deadline``; and the ``receive`` that gives the bytes read again, then the rest."""
    content_type = dict(scope.get("headers", ())).get(b"content-type", b"")
    _, _, param = content_type.partition(b"boundary=")
    boundary = param.split(b";")[0].strip().strip(b'"')
    prefix, more, started = b"", True, time.monotonic()
    key: str | None = None
    while boundary and more and len(prefix) < FORM_PREFIX_BYTES:
        due = min(deadline, started + UPLOAD_GRACE_S + len(prefix) / MIN_UPLOAD_RATE)
        message = await next_message(receive, due)
        prefix += message.get("body", b"")
        more = bool(message.get("more_body", False))
        fields, done = form_fields_before_file(prefix, boundary)
        key = fields.get("api_key") or None
        if done or key:
            break
    return key, replayed(prefix, receive, more)
