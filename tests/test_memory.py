"""Translation memories (TMX and TSV imports, exact lookups, persistence, limits, /memories) and the
segment cache of recent translations (app/terminology/memory.py, cache.py, app/http/endpoints/memories.py)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.keys.accepted import owner_name
from app.monitoring.metrics import process_metrics
from app.stores.database.errors import StoreUnavailable
from app.terminology import precedence
from app.terminology.cache import ENTRY_OVERHEAD_BYTES, SegmentCache, approximate_size
from app.terminology.memory import (
    MAX_UNIT_LANGUAGES,
    MemoryImportError,
    PairCount,
    TmxReader,
    TranslationMemory,
    normalise,
)
from tests.test_api import assert_error, make_settings, serve

TMX = """<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE tmx SYSTEM "tmx14.dtd">
<tmx version="1.4">
  <header creationtool="test" creationtoolversion="1" segtype="sentence" o-tmf="test"
          adminlang="en-US" srclang="de-DE" datatype="plaintext"/>
  <body>
    <tu tuid="1">
      <tuv xml:lang="de-DE"><seg>Die Rechnung ist
          fällig.</seg></tuv>
      <tuv xml:lang="en-us"><seg>The invoice is due.</seg></tuv>
      <tuv lang="FR"><seg>La facture est due.</seg></tuv>
    </tu>
    <tu tuid="2">
      <tuv xml:lang="de"><seg>Klicken Sie <bpt i="1">&lt;b&gt;</bpt>hier<ept i="1">&lt;/b&gt;</ept>.</seg>
      </tuv>
      <tuv xml:lang="en_GB"><seg>Click <hi>here</hi>.</seg></tuv>
      <tuv xml:lang="en"><seg>A second English variant is ignored.</seg></tuv>
    </tu>
    <tu tuid="3"><tuv xml:lang="de"><seg>Nur eine Sprache.</seg></tuv></tu>
  </body>
</tmx>
""".encode()


def tmx(units: str, prolog: str = "") -> bytes:
    return f'<?xml version="1.0"?>{prolog}<tmx version="1.4"><header/><body>{units}</body></tmx>'.encode()


# --- import and lookup ---------------------------------------------------------------------------


def test_tmx_units_give_every_language_pair(tmp_path: Path) -> None:
    memory = TranslationMemory(tmp_path)
    assert memory.import_tmx("", TMX) == 6 + 2  # three languages: 6 ordered pairs; two: 2
    assert memory.lookup("", "de", "en", "Die Rechnung ist fällig.") == "The invoice is due."
    assert memory.lookup("", "en", "fr", "The invoice is due.") == "La facture est due."
    assert memory.lookup("", "fr", "de", "La facture est due.") == "Die Rechnung ist fällig."
    # Inline native code (<bpt>, <ept>) is no text; <hi>'s is; the first variant of a language wins.
    assert memory.lookup("", "de", "en", "Klicken Sie hier.") == "Click here."
    assert memory.lookup("", "en", "de", "Click here.") == "Klicken Sie hier."
    assert memory.stats("") == [
        PairCount("de", "en", 2),
        PairCount("de", "fr", 1),
        PairCount("en", "de", 2),
        PairCount("en", "fr", 1),
        PairCount("fr", "de", 1),
        PairCount("fr", "en", 1),
    ]


def test_lookup_normalises_whitespace_and_languages(tmp_path: Path) -> None:
    memory = TranslationMemory(tmp_path)
    memory.import_tmx("", TMX)
    for segment in (
        "Die Rechnung ist fällig.",
        "  Die  Rechnung\tist\n fällig. ",
        "Die Rechnung ist\u00a0fällig.",
    ):
        assert memory.lookup("", "de-AT", "EN", segment) == "The invoice is due.", segment
    assert memory.lookup("", "de", "en", "Die Rechnung ist fällig") is None  # exact, not fuzzy
    assert memory.lookup("", "de", "en", "die Rechnung ist fällig.") is None
    assert memory.lookup("", "auto", "en", "Die Rechnung ist fällig.") is None
    assert memory.lookup("", "de", "es", "Die Rechnung ist fällig.") is None
    assert memory.lookup_many("", "de", "en", ["Klicken Sie hier.", "Nein.", "Die Rechnung ist fällig."]) == [
        "Click here.",
        None,
        "The invoice is due.",
    ]
    assert normalise(" a \n b ") == "a b"


def test_tsv_import_and_reimport(tmp_path: Path) -> None:
    memory = TranslationMemory(tmp_path)
    assert (
        memory.import_tsv("k", "de-DE", "en", "\ufeffGuten Tag.\tGood day.\r\n\nDanke.\tThanks.\n".encode())
        == 2
    )
    assert memory.lookup("k", "de", "en", "Danke.") == "Thanks."
    assert memory.import_tsv("k", "de", "en", b"Danke.\tThank you.\n") == 1  # the new target wins
    assert memory.lookup("k", "de", "en", "Danke.") == "Thank you."
    assert memory.stats("k") == [PairCount("de", "en", 2)]
    with pytest.raises(MemoryImportError, match="line 2: 1 field"):
        memory.import_tsv("k", "de", "en", b"a\tb\nc\n")
    with pytest.raises(MemoryImportError, match="both 'de'"):
        memory.import_tsv("k", "de", "de-AT", b"a\tb\n")
    with pytest.raises(MemoryImportError, match="not a language code"):
        memory.import_tsv("k", "deutsch!", "en", b"a\tb\n")


def test_memories_are_each_owners_and_persist(tmp_path: Path) -> None:
    memory = TranslationMemory(tmp_path)
    assert memory.lookup("a", "de", "en", "Danke.") is None and memory.stats("a") == []
    assert not (tmp_path / "memory.sqlite3").exists()  # reads create nothing
    memory.import_tsv("a", "de", "en", b"Danke.\tThanks.\n")
    assert memory.lookup("b", "de", "en", "Danke.") is None and memory.stats("b") == []
    reopened = TranslationMemory(tmp_path)
    assert reopened.lookup("a", "de", "en", "Danke.") == "Thanks."
    assert reopened.delete("b") == 0 and reopened.delete("a") == 1
    assert memory.lookup("a", "de", "en", "Danke.") is None


def test_memory_limits_leave_nothing_half_imported(tmp_path: Path) -> None:
    memory = TranslationMemory(tmp_path, max_segments=3, max_bytes=2000, max_segment_chars=40)
    memory.import_tsv("", "de", "en", b"a\tb\nc\td\n")
    with pytest.raises(MemoryImportError, match="would hold 4 segments, more than 3") as raised:
        memory.import_tsv("", "de", "en", b"e\tf\ng\th\n")
    assert raised.value.too_large and memory.stats("") == [PairCount("de", "en", 2)]
    with pytest.raises(MemoryImportError, match="more than 3 segments in the file"):
        memory.import_tmx("", TMX)
    with pytest.raises(MemoryImportError, match="larger than 2000 bytes"):
        memory.import_tsv("", "de", "en", b"a\tb\n" * 600)
    unit = '<tu><tuv xml:lang="de"><seg>{}</seg></tuv><tuv xml:lang="en"><seg>x</seg></tuv></tu>'
    with pytest.raises(MemoryImportError, match="a segment of 41 characters, more than 40"):
        memory.import_tmx("", tmx(unit.format("y" * 41)))
    assert memory.stats("") == [PairCount("de", "en", 2)]


def unit_in(codes: list[str]) -> str:
    return "<tu>" + "".join(f'<tuv xml:lang="{code}"><seg>s {code}</seg></tuv>' for code in codes) + "</tu>"


def test_a_unit_in_more_languages_than_allowed_is_too_large(tmp_path: Path) -> None:
    """Its n languages would be n * (n - 1) segments: refused at the language past the limit."""
    memory = TranslationMemory(tmp_path)
    codes = [a + b + c for a in "abc" for b in "abcdefghijklmnopqrstuvwxyz" for c in "abcdefghij"]
    assert memory.import_tmx("", tmx(unit_in(codes[:MAX_UNIT_LANGUAGES]))) == 100 * 99
    with pytest.raises(MemoryImportError, match="a translation unit in more than 100 languages") as raised:
        memory.import_tmx("", tmx(unit_in(codes[: MAX_UNIT_LANGUAGES + 1])))
    assert raised.value.too_large
    repeated = unit_in(codes[:MAX_UNIT_LANGUAGES] + codes[:5])  # a language again is no new one
    assert memory.import_tmx("", tmx(repeated)) == 100 * 99


def test_a_units_pairs_are_counted_before_they_are_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the file's limit, the unit's pairs are never made (a unit of 100 languages: 9,900)."""
    reader = TmxReader(max_rows=10, max_chars=100)
    appended: list[object] = []
    monkeypatch.setattr(reader, "rows", CountingList(appended))
    with pytest.raises(MemoryImportError, match="more than 10 segments in the file"):
        reader.read(tmx(unit_in(["de", "en", "fr"]) + unit_in(["de", "en", "fr", "it"])))
    assert len(appended) == 6  # the first unit's; none of the second's 12


class CountingList(list[object]):
    """A list that records what is appended to it, in ``seen``."""

    def __init__(self, seen: list[object]) -> None:
        super().__init__()
        self.seen = seen

    def append(self, item: object) -> None:
        self.seen.append(item)
        super().append(item)


def test_reads_never_wait_for_a_write_and_a_locked_store_is_unavailable(tmp_path: Path) -> None:
    memory = TranslationMemory(tmp_path)
    memory.import_tsv("", "de", "en", b"a\tb\n")
    other = sqlite3.connect(tmp_path / "memory.sqlite3", isolation_level=None)  # another process, say
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO segments VALUES ('', 'de', 'en', 'c', 'd')")
    started = time.perf_counter()
    assert memory.lookup("", "de", "en", "a") == "b" and memory.lookup("", "de", "en", "c") is None
    assert time.perf_counter() - started < 0.5  # the last commit's data, without waiting
    impatient = TranslationMemory(tmp_path)
    impatient.db.timeout_s = 0.05
    with pytest.raises(StoreUnavailable, match="cannot write .*memory.sqlite3: database is locked"):
        impatient.import_tsv("", "de", "en", b"e\tf\n")
    other.execute("COMMIT")
    other.close()
    assert memory.lookup("", "de", "en", "c") == "d"


BOMB = """<!DOCTYPE tmx [
  <!ENTITY a "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa">
  <!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">
  <!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">
  <!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">
]>"""
BOMB_UNIT = '<tu><tuv xml:lang="de"><seg>&d;</seg></tuv><tuv xml:lang="en"><seg>x</seg></tuv></tu>'
XXE = '<!DOCTYPE tmx [<!ENTITY secret SYSTEM "file:///etc/passwd">]>'
XXE_UNIT = '<tu><tuv xml:lang="de"><seg>&secret;</seg></tuv><tuv xml:lang="en"><seg>x</seg></tuv></tu>'


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (tmx(BOMB_UNIT, BOMB), "refused: EntitiesForbidden"),
        (tmx(XXE_UNIT, XXE), "refused: EntitiesForbidden"),
        (tmx("<tu>" * 40), "nested more than 32 deep"),
        (b"<tmx><body><tu>", "not well-formed XML"),
        (b"<html><body/></html>", "not a TMX file"),
        (tmx(""), "no translation units"),
        (tmx("<tu><tuv><seg>a</seg></tuv></tu>"), "line 1: a <tuv> without xml:lang"),
        (tmx('<tu><tuv xml:lang="??"><seg>a</seg></tuv></tu>'), "not a language code"),
    ],
)
def test_hostile_or_broken_tmx_is_refused(tmp_path: Path, data: bytes, message: str) -> None:
    memory = TranslationMemory(tmp_path)
    with pytest.raises(MemoryImportError, match=message) as raised:
        memory.import_tmx("", data)
    assert not raised.value.too_large
    assert memory.stats("") == []


# --- the endpoints -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = make_settings(
        model_dir,
        api_keys="k1,k2",
        warmup=False,
        data_dir=tmp_path_factory.mktemp("data"),
        memory_max_segments=10,
        memory_max_bytes=4096,
    )
    with serve(settings) as client:
        yield client


def test_memories_through_the_api(keyed: TestClient) -> None:
    k1 = {"api_key": "k1"}
    assert keyed.delete("/memories", params=k1).status_code == 200
    uploaded = keyed.post("/memories", data=k1, files={"file": ("memory.tmx", TMX)})
    assert uploaded.status_code == 200, uploaded.text
    assert uploaded.json() == {"imported": 8, "segments": 8}
    tsv = keyed.post(
        "/memories",
        data={**k1, "source_lang": "de", "target_lang": "en"},
        files={"file": ("more.tsv", b"Danke.\tThanks.\n")},
    )
    assert tsv.json() == {"imported": 1, "segments": 9}
    stats = keyed.get("/memories", params=k1).json()
    assert stats["segments"] == 9
    assert {"source_lang": "de", "target_lang": "en", "segments": 3} in stats["pairs"]
    assert keyed.get("/memories", params={"api_key": "k2"}).json() == {"segments": 0, "pairs": []}
    memory = keyed.app.state.services.memory  # type: ignore[attr-defined]
    assert memory.lookup(owner_name("k1"), "de", "en", "Danke.") == "Thanks."
    assert (
        keyed.post("/memories", data=k1, files={"file": ("m.tmx", TMX)}).json()["segments"] == 9
    )  # the same
    more = {**k1, "source_lang": "de", "target_lang": "en"}
    over = keyed.post("/memories", data=more, files={"file": ("m.tsv", b"x\ty\nz\tw\n")})
    assert_error(over, 413, "would hold 11 segments, more than 10")
    assert keyed.delete("/memories", params=k1).json() == {"deleted": 9}
    assert keyed.get("/memories", params=k1).json() == {"segments": 0, "pairs": []}


def test_memory_uploads_that_are_refused(keyed: TestClient) -> None:
    k1 = {"api_key": "k1"}
    assert_error(keyed.get("/memories"), 403, "api_key")
    assert_error(keyed.post("/memories", files={"file": ("m.tmx", TMX)}), 403)
    assert_error(keyed.post("/memories", json={"api_key": "k1"}), 400, "multipart")
    assert_error(keyed.post("/memories", data=k1, files={"other": ("m.tmx", TMX)}), 400, "missing file")
    tsv = keyed.post("/memories", data=k1, files={"file": ("m.tsv", b"a\tb\n")})
    assert_error(tsv, 400, "missing source_lang")
    assert_error(
        keyed.post("/memories", data=k1, files={"file": ("m.tmx", tmx(BOMB_UNIT, BOMB))}), 422, "Entities"
    )
    big = keyed.post("/memories", data=k1, files={"file": ("m.tmx", b" " * 5000)})
    assert_error(big, 413, "4096 bytes")
    assert keyed.get("/memories", params=k1).json()["segments"] == 0


def test_memories_survive_a_restart(model_dir: Path, tmp_path: Path) -> None:
    settings = make_settings(model_dir, warmup=False, data_dir=tmp_path, shared_stores=True)
    with serve(settings) as client:
        assert client.post("/memories", files={"file": ("m.tmx", TMX)}).status_code == 200
    with serve(settings) as client:
        assert client.get("/memories").json()["segments"] == 8


# --- the segment cache ---------------------------------------------------------------------------


def test_segment_cache_evicts_the_least_recently_used_by_bytes() -> None:
    entry = ENTRY_OVERHEAD_BYTES + approximate_size(("m", 1, "a")) + approximate_size("x" * 100)
    cache: SegmentCache[str] = SegmentCache(3 * entry)
    for key in "abc":
        cache.put(("m", 1, key), "x" * 100)
    assert len(cache) == 3 and cache.bytes == 3 * entry
    assert cache.get(("m", 1, "a")) == "x" * 100  # a is now the most recent: b goes first
    cache.put(("m", 1, "d"), "x" * 100)
    assert ("m", 1, "b") not in cache and ("m", 1, "a") in cache and cache.bytes <= 3 * entry
    cache.put(("m", 1, "e"), "y" * 250)  # larger: takes the room of two
    assert [k in cache for k in (("m", 1, "c"), ("m", 1, "a"), ("m", 1, "d"), ("m", 1, "e"))] == [
        False,
        False,
        True,
        True,
    ]
    cache.put(("m", 1, "huge"), "z" * 10 * entry)  # larger than the whole cache: not stored
    assert ("m", 1, "huge") not in cache and cache.bytes <= 3 * entry
    cache.put(("m", 1, "d"), "w")  # replaced, its bytes accounted anew
    assert cache.get(("m", 1, "d")) == "w"
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0


def test_segment_cache_counts_hits_and_misses_and_its_bytes() -> None:
    metrics = process_metrics()
    hits, misses = (
        metrics.sample("nmt_segment_cache_hits_total"),
        metrics.sample("nmt_segment_cache_misses_total"),
    )
    cache: SegmentCache[tuple[str, ...]] = SegmentCache(1 << 20, metrics)
    assert cache.get("Hallo") is None
    cache.put("Hallo", ("Hello", "Hi"))
    assert cache.get("Hallo") == ("Hello", "Hi") and cache.get("Hallo") == ("Hello", "Hi")
    assert metrics.sample("nmt_segment_cache_hits_total") == hits + 2
    assert metrics.sample("nmt_segment_cache_misses_total") == misses + 1
    assert metrics.sample("nmt_segment_cache_bytes") >= cache.bytes > 0


def test_a_segment_cache_of_zero_bytes_is_off() -> None:
    metrics = process_metrics()
    misses = metrics.sample("nmt_segment_cache_misses_total")
    cache: SegmentCache[str] = SegmentCache(0, metrics)
    cache.put("a", "b")
    assert not cache.enabled and cache.get("a") is None and len(cache) == 0
    assert metrics.sample("nmt_segment_cache_misses_total") == misses


def test_the_app_has_a_segment_cache_of_the_configured_size(keyed: TestClient) -> None:
    cache = keyed.app.state.services.segment_cache  # type: ignore[attr-defined]
    assert isinstance(cache, SegmentCache) and cache.max_bytes == 64 * 1024 * 1024
    assert make_settings(Path("artifacts"), segment_cache_mb=0).segment_cache_mb == 0


# --- precedence: memory, then the cache, then the model ------------------------------------------


def test_memory_answers_first_then_the_cache_then_the_model(tmp_path: Path) -> None:
    memory = TranslationMemory(tmp_path)
    memory.import_tsv("k", "de", "en", b"Danke.\tThanks.\n")
    cache: SegmentCache[str] = SegmentCache(1 << 20)
    cache.put(("m", "Hallo."), "Hello (cached).")
    cache.put(("m", "Danke."), "Thanks (model).")  # the memory wins over a cached model answer
    sentences = ["Danke.", "Hallo.", "Neu.", " Danke. ", "Neu.", "Anders."]
    keys = [("m", " ".join(s.split())) for s in sentences]
    lookup = partial(memory.lookup_many, "k", "de-DE", "en")
    plan = precedence.plan(sentences, keys, lookup=lookup, cache=cache)
    assert plan.decode == [2, 5]  # "Neu." once, though it occurs twice
    answers = plan.finish(["New.", "Different."])
    assert [(a.memory, a.result, a.cached) for a in answers] == [
        ("Thanks.", None, False),
        (None, "Hello (cached).", True),
        (None, "New.", False),
        ("Thanks.", None, False),
        (None, "New.", False),
        (None, "Different.", False),
    ]
    assert answers[0].from_memory and not answers[2].from_memory
    # What the model decoded is cached for the next request; the memory's answers are not.
    again = precedence.plan(["Neu.", "Anders."], [("m", "Neu."), ("m", "Anders.")], cache=cache)
    assert again.decode == [] and [a.result for a in again.finish([])] == ["New.", "Different."]


def test_without_a_memory_or_a_cache_every_sentence_is_decoded() -> None:
    plan: precedence.Plan[str] = precedence.plan(["a", "b"], ["a", "b"], cache=SegmentCache(0))
    assert plan.decode == [0, 1]
    assert [a.result for a in plan.finish(["A", "B"])] == ["A", "B"]
    with pytest.raises(ValueError, match="1 results for 2 sentences"):
        plan.finish(["A"])
    with pytest.raises(ValueError, match="1 cache keys for 2 sentences"):
        precedence.plan(["a", "b"], ["a"])
