"""What a store's failure is, and the answer a client gets for it."""

from __future__ import annotations

import logging

logger = logging.getLogger("uvicorn.error").getChild("nmt")


class StoreUnavailable(RuntimeError):
    """The database cannot be opened, read or written (HTTP 503): the message says why, naming the
    file or the server (for the log: ``logged`` says what a client is told)."""


def logged(e: StoreUnavailable, what: str) -> str:
    """What a caller is told of a store that failed (``what``, "the job store"): the error itself,
    the file's path or the database's words, is logged for the operator instead."""
    logger.error("%s is unavailable: %s", what, e)
    return f"{what} is unavailable now; retry later"
