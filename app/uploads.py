"""Uploads in progress: /translate_file and POST /jobs hold a place each while the upload sits in
the front end's memory (``NMT_MAX_FILE_REQUESTS`` at most), so that many large files at once
cannot fill it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import HTTPException

BUSY_RETRY_AFTER_S = "2"


class FileRequests:
    """File requests in progress, at most ``limit``: each holds its upload until it is written."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    @asynccontextmanager
    async def place(self) -> AsyncIterator[None]:
        if self.count >= self.limit:
            message = f"{self.limit} files are being translated; retry later"
            raise HTTPException(503, message, {"Retry-After": BUSY_RETRY_AFTER_S})
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
