"""Uploads in progress: /translate_file and POST /jobs hold a place each while the upload sits in
the front end's memory (``NMT_MAX_FILE_REQUESTS`` at most), so that many large files at once
cannot fill it.

A place is taken once the request's key is admitted where it comes before the file (a header, the
query, or the form's ``api_key`` field sent first: ``app.http.endpoints.files.admit_form_key``), else
before the upload is read; and one client address holds at most ``1 / ADDRESS_SHARE`` of them:
uploads that trickle in from one address (each cut at ``app.http.slow_clients.MIN_UPLOAD_RATE``) leave
the other places to everyone else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import HTTPException

BUSY_RETRY_AFTER_S = "2"
ADDRESS_SHARE = 4  # one address holds at most a quarter of the places (one at least)


class FileRequests:
    """File requests in progress, at most ``limit``: each holds its upload until it is written."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.per_address = max(1, limit // ADDRESS_SHARE)
        self.count = 0
        self.held: dict[str, int] = {}  # address -> places it holds (no entry: none)

    @asynccontextmanager
    async def place(self, address: str = "") -> AsyncIterator[None]:
        if self.count >= self.limit:
            message = f"{self.limit} files are being translated; retry later"
            raise HTTPException(503, message, {"Retry-After": BUSY_RETRY_AFTER_S})
        mine = self.held.get(address, 0)
        if mine >= self.per_address:
            message = (
                f"{mine} of your files are being uploaded or translated at once "
                f"(at most {self.per_address}); retry later"
            )
            raise HTTPException(429, message, {"Retry-After": BUSY_RETRY_AFTER_S})
        self.count += 1
        self.held[address] = mine + 1
        try:
            yield
        finally:
            self.count -= 1
            left = self.held[address] - 1
            if left:
                self.held[address] = left
            else:
                del self.held[address]
