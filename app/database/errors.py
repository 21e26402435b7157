"""What a store's failure is, and the answer a client gets for it."""

from __future__ import annotations

import logging

from fastapi import HTTPException

logger = logging.getLogger("uvicorn.error").getChild("nmt")


class StoreUnavailable(RuntimeError):
    """The database cannot be opened, read or written (HTTP 503): the message says why, naming the
    file or the server (for the log: ``unavailable`` answers the client)."""


def unavailable(e: StoreUnavailable, what: str, retry_after_s: str) -> HTTPException:
    """The 503 for a store that failed: ``what`` ("the job store") and Retry-After, never the file's
    path or the database's words, which are logged for the operator instead."""
    logger.error("%s is unavailable: %s", what, e)
    return HTTPException(503, f"{what} is unavailable now; retry later", {"Retry-After": retry_after_s})
