"""Translated files waiting to be downloaded: in memory, each under an unguessable token, gone once
downloaded or after ``NMT_FILE_TTL_S``, whichever comes first.

Never written to disk: a translated document is someone's text, and it is needed only until its
one download (LibreTranslate's ``translatedFileUrl``: the client GETs it right after). The store is
bounded in bytes, so that files nobody fetches cannot fill the memory: when full, new files are
refused (503) until old ones are fetched or expire. Each owner (an API key's, or without keys a
client address) may hold at most ``1 / OWNER_SHARE`` of it, so that one client's files left
unfetched fill its own share only: past it that owner is refused, and everyone else is still served.
It lives in the front end's one process, which serves the download too (behind a load balancer over
several replicas, the download must reach the replica that translated: see the README).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

# An owner holds at most this fraction (1 / OWNER_SHARE) of the store: enough for several files
# waiting at once, and four owners at least must fill it before the others are refused.
OWNER_SHARE = 4


@dataclass(frozen=True)
class StoredFile:
    data: bytes
    name: str  # the name it is downloaded under
    media_type: str
    expires: float  # time.monotonic()
    owner: str


class NoRoom(Exception):
    """The store, or the owner's share of it, has no room for the file (503): the message says which."""


class FileStore:
    def __init__(self, ttl_s: float, max_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.owner_bytes = max_bytes // OWNER_SHARE
        self.files: OrderedDict[str, StoredFile] = OrderedDict()  # oldest first
        self.bytes = 0
        self.held: dict[str, int] = {}  # owner -> bytes of its files here (no entry: none)

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        while self.files:
            token, oldest = next(iter(self.files.items()))
            if oldest.expires > now:
                break
            self._remove(token)

    def put(self, data: bytes, name: str, media_type: str, owner: str) -> str:
        """The new file's token (``NoRoom`` when the store, or ``owner``'s share of it, has no
        room for it)."""
        self.expire()
        mine = self.held.get(owner, 0)
        if mine + len(data) > self.owner_bytes:
            raise NoRoom(
                f"your translated files waiting to be downloaded hold {mine} bytes (at most "
                f"{self.owner_bytes}): download them, or retry once they expire"
            )
        if self.bytes + len(data) > self.max_bytes:
            raise NoRoom("too many translated files are waiting to be downloaded; retry later")
        token = secrets.token_hex(16)
        self.files[token] = StoredFile(data, name, media_type, time.monotonic() + self.ttl_s, owner)
        self.bytes += len(data)
        self.held[owner] = mine + len(data)
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
        left = self.held[stored.owner] - len(stored.data)
        if left:
            self.held[stored.owner] = left
        else:  # no entry for an owner with nothing here: the dict holds the present owners only
            del self.held[stored.owner]
        return stored
