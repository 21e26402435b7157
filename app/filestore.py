"""Translated files waiting to be downloaded: in memory, each under an unguessable token, gone once
downloaded or after ``NMT_FILE_TTL_S``, whichever comes first.

Never written to disk: a translated document is someone's text, and it is needed only until its
one download (LibreTranslate's ``translatedFileUrl``: the client GETs it right after). The store is
bounded in bytes, so that files nobody fetches cannot fill the memory: when full, new files are
refused (503) until old ones are fetched or expire. It lives in the front end's one process, which
serves the download too (behind a load balancer over several replicas, the download must reach
the replica that translated: see the README).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredFile:
    data: bytes
    name: str  # the name it is downloaded under
    media_type: str
    expires: float  # time.monotonic()


class FileStore:
    def __init__(self, ttl_s: float, max_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.files: OrderedDict[str, StoredFile] = OrderedDict()  # oldest first
        self.bytes = 0

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        while self.files:
            token, oldest = next(iter(self.files.items()))
            if oldest.expires > now:
                break
            self._remove(token)

    def put(self, data: bytes, name: str, media_type: str) -> str | None:
        """The new file's token, or None when the store has no room for it."""
        self.expire()
        if self.bytes + len(data) > self.max_bytes:
            return None
        token = secrets.token_hex(16)
        self.files[token] = StoredFile(data, name, media_type, time.monotonic() + self.ttl_s)
        self.bytes += len(data)
        return token

    def take(self, token: str, name: str) -> StoredFile | None:
        """The file stored under ``token`` and ``name``, removed from the store (a second download
        finds nothing); None if there is none."""
        self.expire()
        stored = self.files.get(token)
        if stored is None or stored.name != name:
            return None
        return self._remove(token)

    def _remove(self, token: str) -> StoredFile:
        stored = self.files.pop(token)
        self.bytes -= len(stored.data)
        return stored
