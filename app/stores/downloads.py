"""Translated files waiting to be downloaded: in memory, each under an unguessable token, gone once
downloaded or after ``NMT_FILE_TTL_S``, whichever comes first.

Never written to disk: a translated document is someone's text, and it is needed only until its
one download (LibreTranslate's ``translatedFileUrl``: the client GETs it right after). The store is
bounded in bytes, so that files nobody fetches cannot fill the memory: when full, new files are
refused (503) until old ones are fetched or expire. Each owner (an API key's, or without keys a
client address) may hold at most ``1 / OWNER_SHARE`` of it, so that one client's files left
unfetched fill its own share only: past it that owner is refused, and everyone else is still served.
``FileStore`` lives in the front end's one process, which serves the download too. With
``NMT_DATABASE_URL``, ``SharedFileStore`` keeps the files in the PostgreSQL every replica shares,
with the same bounds, so that the download link works whichever replica the balancer picks: taken
in one transaction (a second download, on any replica, finds nothing), then streamed a part at a
time and its parts deleted.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from app.jobs.files import TableFiles, files_schema
from app.stores.database.migrations import Migration
from app.stores.database.postgres import PostgresDatabase

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


# A download in the shared database: its row (what ``StoredFile`` says but its bytes), and its bytes
# in ``download_files`` (``app.jobs.files.TableFiles``), removed once streamed or expired.
DOWNLOADS = """
CREATE TABLE downloads (
    id TEXT PRIMARY KEY, -- the token
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    media_type TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    expires DOUBLE PRECISION NOT NULL
);
CREATE INDEX downloads_owner ON downloads (owner);
CREATE INDEX downloads_expires ON downloads (expires);
""" + files_schema("download_files")
MIGRATIONS = [Migration(1, "", DOWNLOADS)]
FILE = "file"
ORPHAN_GRACE_S = 300.0  # a download's parts without a row (being streamed, or a write cut short)
SWEEP_EVERY_S = 60.0


@dataclass(frozen=True)
class SharedDownload:
    name: str
    media_type: str
    chunks: Iterator[bytes]  # the file a part at a time, its parts deleted once read


class SharedFileStore:
    """``FileStore``'s contract in the shared PostgreSQL (its methods block: call them on a thread)."""

    def __init__(self, db: PostgresDatabase, ttl_s: float, max_bytes: int) -> None:
        self.db = db
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.owner_bytes = max_bytes // OWNER_SHARE
        self.files = TableFiles(db, table="download_files", owners="downloads")
        self._swept_at = time.monotonic()

    def put(self, data: bytes, name: str, media_type: str, owner: str) -> str:
        now = time.time()
        with self.db.writing() as db:
            db.execute("SELECT pg_advisory_xact_lock(hashtext('nmt-downloads'))")  # the bounds' checks
            expired = [
                row[0] for row in db.execute("DELETE FROM downloads WHERE expires <= ? RETURNING id", (now,))
            ]
            (mine,) = db.execute(
                "SELECT COALESCE(SUM(bytes), 0) FROM downloads WHERE owner = ?", (owner,)
            ).fetchone()
            if mine + len(data) > self.owner_bytes:
                raise NoRoom(
                    f"your translated files waiting to be downloaded hold {mine} bytes (at most "
                    f"{self.owner_bytes}): download them, or retry once they expire"
                )
            (held,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM downloads").fetchone()
            if held + len(data) > self.max_bytes:
                raise NoRoom("too many translated files are waiting to be downloaded; retry later")
            token = secrets.token_hex(16)
            db.execute(
                "INSERT INTO downloads (id, owner, name, media_type, bytes, expires) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (token, owner, name, media_type, len(data), now + self.ttl_s),
            )
        self.files.remove(expired)
        if time.monotonic() - self._swept_at > SWEEP_EVERY_S:
            self._swept_at = time.monotonic()
            self.sweep()
        try:
            self.files.write(token, FILE, data)
        except BaseException:
            with contextlib.suppress(Exception), self.db.writing() as db:
                db.execute("DELETE FROM downloads WHERE id = ?", (token,))
            raise
        return token

    def take(self, token: str, name: str) -> SharedDownload | None:
        """The file, its row removed (a second download, on any replica, finds nothing); None if
        there is none. Its parts are deleted as the download reads the last one (or, if the
        download stops before, by a later sweep)."""
        with self.db.writing() as db:
            row = db.execute(
                "DELETE FROM downloads WHERE id = ? AND name = ? AND expires > ? RETURNING name, media_type",
                (token, name, time.time()),
            ).fetchone()
        if row is None:
            return None
        return SharedDownload(row[0], row[1], self._streamed(token))

    def _streamed(self, token: str) -> Iterator[bytes]:
        yield from self.files.chunks(token, FILE)
        self.files.remove([token])

    def sweep(self, grace_s: float = ORPHAN_GRACE_S) -> int:
        """The parts of downloads whose rows are gone, once older than ``grace_s``."""
        return self.files.sweep(set, time.time() - grace_s)
