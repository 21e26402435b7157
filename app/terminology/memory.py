"""Translation memories: sentences an API key's team has already translated, answered verbatim.

Imported from TMX (the exchange format of translation tools, version 1.4: ``<tu>`` units of
``<tuv xml:lang="..."><seg>`` variants) or a two-column TSV, and kept per owner (the API key's
name when keys are on, "" otherwise) in ``<NMT_DATA_DIR>/memory.sqlite3``, or in the PostgreSQL of
``NMT_DATABASE_URL`` that every replica shares. A unit with variants in
several languages (at most ``MAX_UNIT_LANGUAGES``) gives a segment for every ordered pair of them.

A lookup is exact after whitespace is normalised (runs of whitespace are one space; none at the
ends): "one answer per input" makes a memory's answer as good as the model's for the service's
callers, and a fuzzy match would not be. Targets are stored with their whitespace normalised too
(a pretty-printed TMX breaks its segments' lines). Languages are compared on their primary subtag, so that
a memory exported as de-DE -> en-US answers de -> en requests.

TMX is parsed with ``defusedxml`` (no entity declarations, so no "billion laughs", no external
entity or DTD fetched), streamed through a target that keeps only the unit being read, with a
bound on the file's bytes and on nesting, so that a hostile file costs its bytes and no more.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from defusedxml import DefusedXmlException
from defusedxml.ElementTree import DefusedXMLParser

from app.stores.database import Postgres, open_database
from app.stores.database.migrations import both
from app.stores.database.sqlite import ABSENT_RECHECK_S
from app.terminology.tables import TableError, read_rows

DATABASE = "memory.sqlite3"
MAX_SEGMENTS = 100_000  # per owner (NMT_MEMORY_MAX_SEGMENTS)
MAX_BYTES = 16 * 1024 * 1024  # of an upload (NMT_MEMORY_MAX_BYTES)
MAX_SEGMENT_CHARS = 5_000  # a longer segment is no sentence (NMT_MAX_CHARS's default too)
MAX_DEPTH = 32  # TMX nests 5 deep (tmx/body/tu/tuv/seg) plus inline markup
# Languages of one <tu>. Its n languages give n * (n - 1) rows, one per ordered pair: real units hold
# a few (the EU's DGT-TM, 24), while a 251 KB unit of 6,000 made-up ones would give 36 million.
# More is refused (413) as the language past it is read, before any pair is built.
MAX_UNIT_LANGUAGES = 100
XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"
# Inline elements whose content is the native code of the original's markup (an RTF or HTML tag),
# not text: left out of the segment. <hi> and <sub>'s text is text.
NATIVE_CODE = frozenset({"bpt", "ept", "ph", "it", "ut"})
LANGUAGE = re.compile(r"([A-Za-z]{2,3})(?:[-_][A-Za-z0-9]{1,8})*")
FEED_BYTES = 64 * 1024

_SQLITE = """
CREATE TABLE IF NOT EXISTS segments (
    owner TEXT NOT NULL,
    source_lang TEXT NOT NULL,
    target_lang TEXT NOT NULL,
    source TEXT NOT NULL,
    target TEXT NOT NULL,
    PRIMARY KEY (owner, source_lang, target_lang, source)
) WITHOUT ROWID;
"""
MIGRATIONS = [both(1, _SQLITE)]


class MemoryImportError(TableError):
    """A memory file that cannot be imported: malformed (422) or over a limit (``too_large``: 413)."""


@dataclass(frozen=True)
class PairCount:
    source_lang: str
    target_lang: str
    segments: int


def normalise(text: str) -> str:
    """Runs of whitespace as one space, none at the ends: the form segments are matched in."""
    return " ".join(text.split())


def primary_language(code: str) -> str:
    """``de-DE``, ``de_de``, ``DE`` -> ``de`` (``MemoryImportError`` for what is no language code)."""
    found = LANGUAGE.fullmatch(code.strip())
    if found is None:
        raise MemoryImportError(f"{code!r} is not a language code (such as de, en-US)")
    return found.group(1).lower()


@dataclass
class _Unit:
    """The ``<tu>`` being read: its first segment in each language."""

    line: int
    segments: dict[str, str] = field(default_factory=dict)


class TmxReader:
    """ElementTree parser target that turns TMX units into (source_lang, target_lang, source,
    target) rows as they end, keeping nothing of the tree."""

    def __init__(self, max_rows: int, max_chars: int) -> None:
        self.max_rows, self.max_chars = max_rows, max_chars
        self.rows: list[tuple[str, str, str, str]] = []
        self.parser = DefusedXMLParser(target=self)  # entities and external references refused
        self.depth = 0
        self.units = 0
        self.unit: _Unit | None = None
        self.language: str | None = None
        self.text: list[str] | None = None  # inside a <seg> of a <tuv>
        self.native = 0  # inside inline native code

    def line(self) -> int:
        return int(self.parser.parser.CurrentLineNumber)

    def start(self, tag: str, attrib: dict[str, str]) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise MemoryImportError(f"line {self.line()}: elements nested more than {MAX_DEPTH} deep")
        if self.depth == 1 and tag != "tmx":
            raise MemoryImportError(f"not a TMX file: its root element is <{tag}>, not <tmx>")
        if tag == "tu":
            self.unit = _Unit(self.line())
        elif tag == "tuv" and self.unit is not None:
            # TMX 1.4 says xml:lang; 1.1 and some tools write lang.
            code = attrib.get(XML_LANG) or attrib.get("lang")
            if not code:
                raise MemoryImportError(f"line {self.line()}: a <tuv> without xml:lang")
            try:
                self.language = primary_language(code)
            except MemoryImportError as e:
                raise MemoryImportError(f"line {self.line()}: {e}") from None
        elif tag == "seg" and self.language is not None:
            self.text = []
        elif tag in NATIVE_CODE and self.text is not None:
            self.native += 1

    def data(self, text: str) -> None:
        if self.text is not None and not self.native:
            self.text.append(text)

    def end(self, tag: str) -> None:
        self.depth -= 1
        if tag in NATIVE_CODE and self.text is not None:
            self.native -= 1
        elif tag == "seg" and self.text is not None:
            # Normalised once here: a unit's rows share its strings (20 languages give 380 rows).
            segment = normalise("".join(self.text))
            self.text = None
            if len(segment) > self.max_chars:
                raise MemoryImportError(
                    f"line {self.line()}: a segment of {len(segment)} characters, more than {self.max_chars}",
                    too_large=True,
                )
            if self.unit is not None and self.language is not None and segment:
                segments = self.unit.segments
                if self.language not in segments and len(segments) == MAX_UNIT_LANGUAGES:
                    raise MemoryImportError(
                        f"line {self.unit.line}: a translation unit in more than "
                        f"{MAX_UNIT_LANGUAGES} languages",
                        too_large=True,
                    )
                segments.setdefault(self.language, segment)  # the first one of its language
        elif tag == "tuv":
            self.language = None
        elif tag == "tu" and self.unit is not None:
            self._add(self.unit)
            self.unit = None

    def _add(self, unit: _Unit) -> None:
        self.units += 1
        segments = unit.segments
        # Counted before they are built: the rows past the limit are never made.
        if len(self.rows) + len(segments) * (len(segments) - 1) > self.max_rows:
            raise MemoryImportError(
                f"line {unit.line}: more than {self.max_rows} segments in the file", too_large=True
            )
        for source_lang, source in segments.items():
            for target_lang, target in segments.items():
                if source_lang != target_lang:
                    self.rows.append((source_lang, target_lang, source, target))

    def close(self) -> None:
        return None

    def read(self, data: bytes) -> list[tuple[str, str, str, str]]:
        try:
            for offset in range(0, len(data), FEED_BYTES):
                self.parser.feed(data[offset : offset + FEED_BYTES])
            self.parser.close()
        except DefusedXmlException as e:
            raise MemoryImportError(
                f"refused: {type(e).__name__} (entities and external references are not allowed)"
            ) from None
        except SyntaxError as e:  # xml.etree.ElementTree.ParseError
            raise MemoryImportError(f"not well-formed XML: {e}") from None
        if not self.units:
            raise MemoryImportError("no translation units (<tu>) in the file")
        return self.rows


class TranslationMemory:
    """Every owner's segments, persisted in ``data_dir`` (module docstring)."""

    def __init__(
        self,
        data_dir: Path,
        max_segments: int = MAX_SEGMENTS,
        max_bytes: int = MAX_BYTES,
        max_segment_chars: int = MAX_SEGMENT_CHARS,
        server: Postgres | None = None,
    ) -> None:
        self.max_segments = max_segments
        self.max_bytes = max_bytes
        self.max_segment_chars = max_segment_chars
        self.db = open_database(server, Path(data_dir) / DATABASE, "memory", MIGRATIONS)
        # PostgreSQL: owners found to have no memory, until when (monotonic). A lookup for them asks
        # nothing of the server until then: most keys have no memory, and every /translate of a key
        # looks one up. Another replica's first import is seen within ABSENT_RECHECK_S, as another
        # process's first write to the SQLite file is (app.stores.database.sqlite).
        self._none_until: dict[str, float] = {}

    def known_empty(self, owner: str) -> bool:
        """Whether ``owner`` is known to have no memory now, without asking the database."""
        return self._none_until.get(owner, 0.0) > time.monotonic()

    def close(self) -> None:
        self.db.close()

    def import_tmx(self, owner: str, data: bytes) -> int:
        """Add a TMX file's segments (a segment already there gets the new target); how many rows
        it gave. ``MemoryImportError`` for a file that is malformed, hostile or over a limit, or an
        import that would leave the owner with more than ``max_segments``; nothing is added then."""
        self._check_size(data)
        rows = TmxReader(self.max_segments, self.max_segment_chars).read(data)
        return self._add(owner, rows)

    def import_tsv(self, owner: str, source_lang: str, target_lang: str, data: bytes) -> int:
        """Add a TSV file's ``source<TAB>target`` lines (as ``import_tmx``)."""
        self._check_size(data)
        source_lang, target_lang = primary_language(source_lang), primary_language(target_lang)
        if source_lang == target_lang:
            raise MemoryImportError(f"source_lang and target_lang are both {source_lang!r}")
        try:
            found = read_rows(
                data,
                "tsv",
                max_bytes=self.max_bytes,
                max_rows=self.max_segments,
                max_chars=self.max_segment_chars,
            )
        except TableError as e:
            raise MemoryImportError(str(e), too_large=e.too_large) from None
        if not found:
            raise MemoryImportError("no segments in the file")
        return self._add(
            owner, [(source_lang, target_lang, normalise(r.source), normalise(r.target)) for r in found]
        )

    def _check_size(self, data: bytes) -> None:
        if len(data) > self.max_bytes:
            raise MemoryImportError(f"the file is larger than {self.max_bytes} bytes", too_large=True)

    def _add(self, owner: str, rows: Sequence[tuple[str, str, str, str]]) -> int:
        with self.db.writing() as db:
            db.executemany(
                "INSERT INTO segments VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (owner, source_lang, target_lang, source) "
                "DO UPDATE SET target = excluded.target",
                ((owner, *row) for row in rows),
            )
            (count,) = db.execute("SELECT COUNT(*) FROM segments WHERE owner = ?", (owner,)).fetchone()
            if count > self.max_segments:  # rolled back: the import is all or nothing
                raise MemoryImportError(
                    f"the memory would hold {count} segments, more than {self.max_segments} "
                    "(NMT_MEMORY_MAX_SEGMENTS): delete it first, or import less",
                    too_large=True,
                )
        self._none_until.pop(owner, None)  # this process's own import is seen at once
        return len(rows)

    def lookup(self, owner: str, source_lang: str, target_lang: str, segment: str) -> str | None:
        """The stored translation of ``segment`` (whitespace normalised), or None."""
        return self.lookup_many(owner, source_lang, target_lang, [segment])[0]

    def lookup_many(
        self, owner: str, source_lang: str, target_lang: str, segments: Sequence[str]
    ) -> list[str | None]:
        """``lookup`` of each segment, in one pass over the database (None for each when nothing
        was ever stored, without creating the file)."""
        found: list[str | None] = [None] * len(segments)
        try:
            source_lang, target_lang = primary_language(source_lang), primary_language(target_lang)
        except MemoryImportError:  # "auto" or another code no memory is stored under
            return found
        with self.db.reading() as db:
            if db is None:
                return found
            if self.db.dialect == "postgresql":  # one round trip to the server, not one a segment
                if self.known_empty(owner):
                    return found
                keys = [normalise(segment) for segment in segments]
                rows = db.execute(
                    "SELECT source, target FROM segments "
                    "WHERE owner = ? AND source_lang = ? AND target_lang = ? AND source = ANY(?)",
                    (owner, source_lang, target_lang, keys),
                ).fetchall()
                if (
                    not rows
                    and db.execute("SELECT 1 FROM segments WHERE owner = ? LIMIT 1", (owner,)).fetchone()
                    is None
                ):
                    self._none_until[owner] = time.monotonic() + ABSENT_RECHECK_S
                targets = dict(rows)
                return [targets.get(key) for key in keys]
            query = (
                "SELECT target FROM segments "
                "WHERE owner = ? AND source_lang = ? AND target_lang = ? AND source = ?"
            )
            for i, segment in enumerate(segments):
                row = db.execute(query, (owner, source_lang, target_lang, normalise(segment))).fetchone()
                if row is not None:
                    found[i] = row[0]
        return found

    def stats(self, owner: str) -> list[PairCount]:
        """The owner's segments per language pair."""
        with self.db.reading() as db:
            if db is None:
                return []
            rows = db.execute(
                "SELECT source_lang, target_lang, COUNT(*) FROM segments WHERE owner = ? "
                "GROUP BY source_lang, target_lang ORDER BY source_lang, target_lang",
                (owner,),
            ).fetchall()
        return [PairCount(*row) for row in rows]

    def delete(self, owner: str) -> int:
        """Delete the owner's whole memory; how many segments it held."""
        if not self.db.exists():
            return 0
        with self.db.writing() as db:
            return int(db.execute("DELETE FROM segments WHERE owner = ?", (owner,)).rowcount)
