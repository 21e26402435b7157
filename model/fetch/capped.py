"""huggingface_hub's HTTP client with every answer's body capped in bytes (NMT_FETCH_MAX_BYTES) and
in time from the request to its last byte (NMT_FETCH_TIMEOUT_S), whatever its headers and the hub's
metadata declare: huggingface_hub's own timeout is per read, and a server that sends a byte every
few seconds, or without end, would hold a start-up for ever. Imported only to fetch (httpx2 costs
the front end's start 20 ms)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx2

from model.fetch.names import (
    DEADLINE_ENV,
    DOWNLOAD_DEADLINE_S,
    MAX_BYTES_ENV,
    MAX_DOWNLOAD_BYTES,
    FetchError,
    env_number,
    printable,
)


class _CappedBody(httpx2.SyncByteStream):
    """A response's body, refused past ``limit`` bytes or after ``deadline`` (``time.monotonic()``)."""

    def __init__(self, body: httpx2.SyncByteStream, url: str, limit: int, deadline: float) -> None:
        self.body, self.url, self.limit, self.deadline = body, url, limit, deadline

    def __iter__(self) -> Iterator[bytes]:
        size = 0
        for chunk in self.body:
            size += len(chunk)
            if size > self.limit:
                raise FetchError(f"{self.url}: the download passed {self.limit} bytes ({MAX_BYTES_ENV})")
            if time.monotonic() > self.deadline:
                raise FetchError(
                    f"{self.url}: the download took longer than its {DEADLINE_ENV} ({size} bytes in)"
                )
            yield chunk

    def close(self) -> None:
        self.body.close()


class _CappedTransport(httpx2.BaseTransport):
    """httpx's transport, with every response's body capped (the settings read at each request)."""

    def __init__(self) -> None:
        self.inner = httpx2.HTTPTransport()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        deadline = time.monotonic() + env_number(DEADLINE_ENV, DOWNLOAD_DEADLINE_S)
        limit = int(env_number(MAX_BYTES_ENV, MAX_DOWNLOAD_BYTES))
        response = self.inner.handle_request(request)
        assert isinstance(response.stream, httpx2.SyncByteStream)
        url = printable(request.url.copy_with(query=None), 120)
        response.stream = _CappedBody(response.stream, url, limit, deadline)
        return response

    def close(self) -> None:
        self.inner.close()


def capped_client() -> httpx2.Client:
    """huggingface_hub's client (its default factory's, whose request hook blocks requests in offline
    mode and tags downloads), over the capped transport."""
    from huggingface_hub.utils._http import hf_request_event_hook  # (not exported; version pinned)

    return httpx2.Client(
        transport=_CappedTransport(),
        event_hooks={"request": [hf_request_event_hook]},
        follow_redirects=True,
        timeout=None,
    )
