"""Stored glossaries: each API key's own, kept in ``<NMT_DATA_DIR>/glossaries.sqlite3``, or in the
PostgreSQL of ``NMT_DATABASE_URL`` that every replica shares.

A glossary is a name, a language pair and its entries (``GlossaryEntry``), as DeepL's are; its id
is a random UUID, so that ids cannot be guessed, and every read and delete is asked for with its
owner: the name of the API key that made it when keys are on, "" otherwise. Another owner's
glossary is "not found" (404), never "forbidden", which would say that the id exists.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from app.stores.database import Postgres, open_database
from app.stores.database.migrations import both
from app.terminology.tables import Format, TableError, check_term, read_rows
from model.decoding.terms import GlossaryEntry

DATABASE = "glossaries.sqlite3"
# Defaults of the settings (app.config): a DeepL glossary may be 10 MB; ours are matched in every
# sentence of a request, so they are smaller.
MAX_BYTES = 1024 * 1024
MAX_ENTRIES = 10_000
MAX_TERM_CHARS = 256
MAX_NAME_CHARS = 200
CACHED_ENTRIES = 100_000  # entries of the glossaries ``GlossaryStore.get`` keeps in memory (~15 MB)
LANGUAGE = re.compile(r"[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8})*")

_SQLITE = """
CREATE TABLE IF NOT EXISTS glossaries (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    source_lang TEXT NOT NULL,
    target_lang TEXT NOT NULL,
    entry_count INTEGER NOT NULL,
    created REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS glossaries_by_owner ON glossaries (owner, created);
CREATE TABLE IF NOT EXISTS entries (
    glossary TEXT NOT NULL REFERENCES glossaries (id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    source TEXT NOT NULL,
    target TEXT NOT NULL,
    PRIMARY KEY (glossary, position)
) WITHOUT ROWID;
"""
MIGRATIONS = [both(1, _SQLITE)]


class GlossaryError(TableError):
    """A glossary that cannot be stored: malformed (422) or over a limit (``too_large``: 413)."""


class StoreFull(Exception):
    """The owner already has as many glossaries as allowed (HTTP 409)."""


@dataclass(frozen=True)
class GlossaryInfo:
    """A glossary without its entries (what a listing shows)."""

    id: str
    name: str
    source_lang: str
    target_lang: str
    entry_count: int
    created: float  # seconds since the epoch


@dataclass(frozen=True)
class Glossary:
    id: str
    name: str
    source_lang: str
    target_lang: str
    entries: tuple[GlossaryEntry, ...]
    created: float = 0.0

    @property
    def info(self) -> GlossaryInfo:
        return GlossaryInfo(
            self.id, self.name, self.source_lang, self.target_lang, len(self.entries), self.created
        )


@dataclass(frozen=True)
class GlossaryLimits:
    max_bytes: int = MAX_BYTES  # of an uploaded table
    max_entries: int = MAX_ENTRIES
    max_term_chars: int = MAX_TERM_CHARS


def parse_entries(data: bytes, fmt: Format, limits: GlossaryLimits | None = None) -> list[GlossaryEntry]:
    """The entries of a CSV or TSV glossary as DeepL accepts them (``app.terminology.tables``);
    ``GlossaryError`` naming the line for anything wrong, a source listed twice included (which
    target would win?)."""
    limits = limits or GlossaryLimits()
    try:
        rows = read_rows(
            data,
            fmt,
            max_bytes=limits.max_bytes,
            max_rows=limits.max_entries,
            max_chars=limits.max_term_chars,
        )
    except TableError as e:
        raise GlossaryError(str(e), too_large=e.too_large) from None
    first: dict[str, int] = {}
    for row in rows:
        if row.source in first:
            raise GlossaryError(
                f"line {row.line}: the source {row.source!r} is also that of line {first[row.source]}"
            )
        first[row.source] = row.line
    return [GlossaryEntry(row.source, row.target) for row in rows]


def check_entries(
    pairs: Iterable[tuple[str, str]], limits: GlossaryLimits | None = None
) -> list[GlossaryEntry]:
    """Entries given one by one (a JSON list), checked as ``parse_entries`` checks a file's, each
    named by its index in the list."""
    limits = limits or GlossaryLimits()
    entries: list[GlossaryEntry] = []
    first: dict[str, int] = {}
    for i, (source, target) in enumerate(pairs):
        if i >= limits.max_entries:
            raise GlossaryError(f"more than {limits.max_entries} entries", too_large=True)
        where = f"entries[{i}]"
        try:
            source = check_term(source, where=where, what="source", max_chars=limits.max_term_chars)
            target = check_term(target, where=where, what="target", max_chars=limits.max_term_chars)
        except TableError as e:
            raise GlossaryError(str(e), too_large=e.too_large) from None
        if source in first:
            raise GlossaryError(f"{where}: the source {source!r} is also that of entries[{first[source]}]")
        first[source] = i
        entries.append(GlossaryEntry(source, target))
    return entries


def check_language(code: str, field: str) -> str:
    """A language code as BCP 47 writes it ("de", "pt-BR"), lower-cased for comparison."""
    if not LANGUAGE.fullmatch(code):
        raise GlossaryError(f"{field}: {code!r} is not a language code (such as de, en or pt-br)")
    return code.lower()


def check_name(name: str) -> str:
    name = name.strip()
    if not name:
        raise GlossaryError("name: the glossary needs a name")
    if len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise GlossaryError(f"name: at most {MAX_NAME_CHARS} printable characters")
    return name


class GlossaryStore:
    """Every owner's glossaries, persisted in ``data_dir`` (module docstring)."""

    def __init__(
        self,
        data_dir: Path,
        max_glossaries: int = 100,
        max_entries: int = MAX_ENTRIES,
        server: Postgres | None = None,
    ) -> None:
        self.max_glossaries = max_glossaries
        self.max_entries = max_entries
        self.db = open_database(server, Path(data_dir) / DATABASE, "glossaries", MIGRATIONS)
        self._cache: OrderedDict[str, Glossary] = OrderedDict()  # by id (owners are checked)
        self._cached_entries = 0
        self._cache_lock = threading.Lock()

    def close(self) -> None:
        self.db.close()

    def create(
        self, owner: str, name: str, source_lang: str, target_lang: str, entries: Sequence[GlossaryEntry]
    ) -> Glossary:
        """Store a glossary (entries checked by ``parse_entries`` or ``check_entries``); ``StoreFull``
        when the owner has ``max_glossaries`` already, ``GlossaryError`` for a bad name or language."""
        name = check_name(name)
        source_lang = check_language(source_lang, "source_lang")
        target_lang = check_language(target_lang, "target_lang")
        if not entries:
            raise GlossaryError("entries: the glossary has no entries")
        if len(entries) > self.max_entries:
            raise GlossaryError(f"more than {self.max_entries} entries", too_large=True)
        glossary = Glossary(str(uuid.uuid4()), name, source_lang, target_lang, tuple(entries), time.time())
        with self.db.writing() as db:
            (count,) = db.execute("SELECT COUNT(*) FROM glossaries WHERE owner = ?", (owner,)).fetchone()
            if count >= self.max_glossaries:
                raise StoreFull(
                    f"this API key has {count} glossaries, the most allowed "
                    f"(NMT_MAX_GLOSSARIES={self.max_glossaries}): delete one first"
                )
            db.execute(
                "INSERT INTO glossaries VALUES (?, ?, ?, ?, ?, ?, ?)",
                (glossary.id, owner, name, source_lang, target_lang, len(entries), glossary.created),
            )
            db.executemany(
                "INSERT INTO entries VALUES (?, ?, ?, ?)",
                ((glossary.id, i, e.source, e.target) for i, e in enumerate(entries)),
            )
        self._remember(glossary)  # made to be used: /translate will ask for it
        return glossary

    def get(self, owner: str, glossary_id: str) -> Glossary | None:
        """The owner's glossary of that id with its entries; None if there is none (or another's).

        /translate asks for it on the event loop, request after request: a glossary never changes
        once made, so its entries are kept here (``CACHED_ENTRIES`` of them in all, the least
        recently used glossaries dropped first), and only whether it still exists is asked of the
        database (another process may have deleted it): ~20 us instead of 15-60 ms for 10,000 entries."""
        with self.db.reading() as db:
            if db is None:
                return None
            with self._cache_lock:
                cached = self._cache.get(glossary_id)
            if cached is not None:
                query = "SELECT 1 FROM glossaries WHERE id = ? AND owner = ?"
                if db.execute(query, (glossary_id, owner)).fetchone() is None:
                    return None
                with self._cache_lock:
                    if glossary_id in self._cache:
                        self._cache.move_to_end(glossary_id)
                return cached
            row = db.execute(
                "SELECT id, name, source_lang, target_lang, entry_count, created FROM glossaries "
                "WHERE id = ? AND owner = ?",
                (glossary_id, owner),
            ).fetchone()
            if row is None:
                return None
            entries = tuple(
                GlossaryEntry(source, target)
                for source, target in db.execute(
                    "SELECT source, target FROM entries WHERE glossary = ? ORDER BY position", (glossary_id,)
                )
            )
        glossary = Glossary(row[0], row[1], row[2], row[3], entries, row[5])
        self._remember(glossary)
        return glossary

    def _remember(self, glossary: Glossary) -> None:
        with self._cache_lock:
            if glossary.id in self._cache:  # two threads read it at once
                return
            self._cache[glossary.id] = glossary
            self._cached_entries += len(glossary.entries)
            while self._cached_entries > CACHED_ENTRIES and self._cache:
                _, dropped = self._cache.popitem(last=False)
                self._cached_entries -= len(dropped.entries)

    def list(self, owner: str) -> list[GlossaryInfo]:
        """The owner's glossaries, oldest first, without their entries."""
        with self.db.reading() as db:
            if db is None:
                return []
            rows = db.execute(
                "SELECT id, name, source_lang, target_lang, entry_count, created FROM glossaries "
                "WHERE owner = ? ORDER BY created, id",
                (owner,),
            ).fetchall()
        return [GlossaryInfo(*row) for row in rows]

    def delete(self, owner: str, glossary_id: str) -> bool:
        """Delete the owner's glossary of that id (its entries too); whether there was one."""
        if not self.db.exists():  # nothing was ever stored: create nothing
            return False
        with self.db.writing() as db:
            deleted = db.execute("DELETE FROM glossaries WHERE id = ? AND owner = ?", (glossary_id, owner))
        if deleted.rowcount > 0:
            with self._cache_lock:
                dropped = self._cache.pop(glossary_id, None)
                self._cached_entries -= len(dropped.entries) if dropped is not None else 0
        return deleted.rowcount > 0
