"""One HTTP connection as uvicorn serves it, with a deadline and a size limit for its request's head.

uvicorn gives a connection no time limit until its request's headers are complete: its keep-alive
timeout starts only after a response, and any byte received cancels it. A client that opens a
connection and sends nothing, or a header line a minute, holds a socket, a parser and its buffered
headers for as long as it likes; 10,000 of them hold 10,000 file descriptors. Nor does its
httptools parser bound a head's size: a header a client never ends grows in memory. nginx's
``client_header_timeout`` and ``large_client_header_buffers`` are what this adds:

- **a deadline for the head** (``HEADER_TIMEOUT_S``), counted from when the connection was opened
  and again from the end of each response (the next request's head): past it, the connection is
  answered 408 and closed. A request whose headers arrived is the app's to time
  (``app.http.slow_clients``: its body's deadline, its place in the queue), never this deadline's.
- **a size for the head** (``MAX_HEAD_BYTES``, the request line and headers): past it, 431 and
  closed. (A head is counted from the packets received wholly within it, and from the pieces the
  parser hands over: past the limit by at most one packet of 256 KiB, never refused within it.)

It is uvicorn's own protocol (``HttpToolsProtocol``) otherwise, named on the command line:
``uvicorn app.main:app --http app.http.connections:GuardedHttp`` (the Dockerfile, ``make serve``, the
tests' and benchmarks' servers). Run without it, the service works as before, without these bounds.

On Python 3.11 a closed connection's transport also keeps a reference to itself (its
``_read_ready_cb``, a bound method of its own; CPython gh-100348, fixed in 3.12), which only a full
collection of the garbage collector frees: at 2,048 connections from one address, the 300 a second
closed past the address's bound left 235,000 such objects in three minutes, and the full collection
that freed them held the event loop for 0.46 s (``app.main.quiet_garbage_collector``). The cycle is
broken here when the connection is lost, as 3.12 does in ``close()``.
"""

from __future__ import annotations

import asyncio
import sys

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# uvicorn's options as the Dockerfile and ``make serve`` give them (the tests' and benchmarks' servers
# use these): this protocol; asyncio's event loop, not uvloop (under a flood uvloop left new
# connections unanswered for seconds); no access log (a line per request cost ~0.4 ms of the
# event loop's CPU; ``/metrics`` counts requests instead).
SERVE_OPTIONS = ("--http", "app.http.connections:GuardedHttp", "--loop", "asyncio", "--no-access-log")
HEADER_TIMEOUT_S = 10.0  # from a connection's start, or a response's end, to its next head's end
MAX_HEAD_BYTES = 64 * 1024  # a request line and its headers (nginx's default allows 32 KiB)
HEAD_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline and a size limit for each request's head."""

    _head_deadline: asyncio.TimerHandle | None = None
    _in_head = False  # between a request's first byte and its headers' end
    _head_pieces = 0  # the head's bytes the parser has handed over (its URL and whole headers)
    _head_chunks = 0  # the bytes of the packets received wholly within the head

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        transport = self.transport
        super().connection_lost(exc)
        if sys.version_info < (3, 12) and hasattr(transport, "_read_ready_cb"):
            transport._read_ready_cb = None  # the cycle 3.12 breaks in close() (gh-100348)

    def data_received(self, data: bytes) -> None:
        within = self._in_head
        super().data_received(data)
        if within and self._in_head:
            self._head_chunks += len(data)
        # Either count is at most the head's true size: the parser holds a header back until it
        # ends (so a header that never ends is counted by the packets), and a packet that also
        # holds a body or the head's start is counted by the pieces.
        if max(self._head_pieces, self._head_chunks) > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._refuse(HEAD_TOO_LARGE)

    # The parser's callbacks.
    def on_message_begin(self) -> None:
        self._in_head, self._head_pieces, self._head_chunks = True, 0, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_pieces += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_pieces += len(name) + len(value) + 4  # ": " and the line's end
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:  # the next request's head is due
            self._await_head()

    def _await_head(self) -> None:
        self._stop_deadline()
        self._head_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._refuse, HEAD_TIMED_OUT)

    def _stop_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _refuse(self, answer: bytes) -> None:
        """Answer ``answer`` and close: a head took too long or grew too large. While an earlier
        request's answer is being sent (a pipelined head), close without a word: the two would mix."""
        self._stop_deadline()
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(answer)
        self.transport.close()
