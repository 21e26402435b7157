"""Stored glossaries: CSV and TSV tables as DeepL accepts them, the store (per owner, persisted) and
the /glossaries endpoints (app/terminology/glossaries.py, app/http/endpoints/glossaries.py)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.terminology.glossaries import (
    GlossaryError,
    GlossaryLimits,
    GlossaryStore,
    StoreFull,
    check_entries,
    parse_entries,
)
from model.decoding.terms import GlossaryEntry
from tests.test_api import assert_error, make_settings, serve

E = GlossaryEntry


# --- tables --------------------------------------------------------------------------------------


def test_csv_with_quotes_a_bom_crlf_and_blank_lines() -> None:
    data = (
        '\ufeffRechnung,invoice\r\n\r\n"Müller, GmbH","Müller, GmbH"\r\n'
        '"sagt ""hallo""",says "hello"\r\n  Auto , car \r\n'
    ).encode()
    assert parse_entries(data, "csv") == [
        E("Rechnung", "invoice"),
        E("Müller, GmbH", "Müller, GmbH"),  # a do-not-translate entry: target == source
        E('sagt "hallo"', 'says "hello"'),
        E("Auto", "car"),  # surrounding whitespace dropped
    ]


def test_tsv_with_a_bom_and_deepls_language_columns() -> None:
    data = '\ufeffRechnung\tinvoice\r\nHaus\thouse\tde\ten\n\nsagt "hallo"\tsays hi\n'.encode()
    assert parse_entries(data, "tsv") == [
        E("Rechnung", "invoice"),
        E("Haus", "house"),
        E('sagt "hallo"', "says hi"),  # TSV has no quoting: quotes are text
    ]


@pytest.mark.parametrize(
    ("data", "fmt", "message"),
    [
        (b"a,b\nc,d\ne\n", "csv", "line 3: 1 field(s); expected source and target separated by a comma"),
        (b"a\tb\nc\td\te\n", "tsv", "line 2: 3 field(s)"),
        (b'a,b\n"c,d\n', "csv", "line 2: not valid CSV"),
        (b'a,b\n"c"x,d\n', "csv", "line 2: not valid CSV"),
        (b"a,b\nc,\xff\n", "csv", "line 2: not valid UTF-8"),
        (b'a,b\n"zwei\nZeilen",c\n', "csv", "line 2: the source holds a control character"),
        (b"a\tb\n \tb\n", "tsv", "line 2: the source is empty"),
        (b"a\tb\nc\td\x07\n", "tsv", "line 2: the target holds a control character"),
        (b"a\tb\nc\td\na\te\n", "tsv", "line 3: the source 'a' is also that of line 1"),
    ],
)
def test_a_bad_table_is_an_error_naming_its_line(data: bytes, fmt: str, message: str) -> None:
    with pytest.raises(GlossaryError) as raised:
        parse_entries(data, fmt)  # type: ignore[arg-type]
    assert message in str(raised.value)
    assert not raised.value.too_large


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"a\tb\nc\td\ne\tf\n", "line 3: more than 2 entries"),
        (b"a\tb\n" + b"x" * 11 + b"\ty\n", "line 2: the source is 11 characters long, more than 10"),
        (b"a\tb\n" * 20, "larger than 64 bytes"),
    ],
)
def test_a_table_over_a_limit_is_too_large(data: bytes, message: str) -> None:
    limits = GlossaryLimits(max_bytes=64, max_entries=2, max_term_chars=10)
    with pytest.raises(GlossaryError) as raised:
        parse_entries(data, "tsv", limits)
    assert message in str(raised.value)
    assert raised.value.too_large


def test_entries_given_one_by_one_are_checked_as_a_tables() -> None:
    assert check_entries([(" a ", "b")]) == [E("a", "b")]
    with pytest.raises(GlossaryError, match=r"entries\[1\]: the source 'a' is also that of entries\[0\]"):
        check_entries([("a", "b"), ("a", "c")])
    with pytest.raises(GlossaryError, match=r"entries\[0\]: the target is empty"):
        check_entries([("a", " ")])
    with pytest.raises(GlossaryError, match="more than 1 entries") as raised:
        check_entries([("a", "b"), ("c", "d")], GlossaryLimits(max_entries=1))
    assert raised.value.too_large


# --- the store -----------------------------------------------------------------------------------


def test_store_create_get_list_delete(tmp_path: Path) -> None:
    store = GlossaryStore(tmp_path, max_glossaries=10)
    assert store.list("") == [] and store.get("", "nope") is None
    assert not (tmp_path / "glossaries.sqlite3").exists()  # reads create nothing
    first = store.create("", " Produkte ", "de-DE", "EN", [E("Rechnung", "invoice"), E("ACME", "ACME")])
    second = store.create("", "other", "en", "de", [E("invoice", "Rechnung")])
    assert first.name == "Produkte" and (first.source_lang, first.target_lang) == ("de-de", "en")
    assert len(first.id) == 36 and first.id != second.id  # uuid4: not guessable, not sequential
    got = store.get("", first.id)
    assert got == first and got.entries == (E("Rechnung", "invoice"), E("ACME", "ACME"))
    assert [g.id for g in store.list("")] == [first.id, second.id]
    assert store.list("")[0].entry_count == 2
    assert store.delete("", first.id) and not store.delete("", first.id)
    assert store.get("", first.id) is None and [g.id for g in store.list("")] == [second.id]
    with sqlite3.connect(tmp_path / "glossaries.sqlite3") as db:  # its entries went with it
        assert db.execute("SELECT COUNT(*) FROM entries WHERE glossary = ?", (first.id,)).fetchone() == (0,)


def test_one_owner_never_sees_anothers_glossaries(tmp_path: Path) -> None:
    store = GlossaryStore(tmp_path)
    mine = store.create("acme", "g", "de", "en", [E("a", "b")])
    assert store.get("other", mine.id) is None
    assert store.list("other") == [] and store.list("") == []
    assert not store.delete("other", mine.id)
    assert store.get("acme", mine.id) == mine


def test_glossaries_persist_in_the_data_directory(tmp_path: Path) -> None:
    made = GlossaryStore(tmp_path).create("k", "g", "de", "en", [E("Haus", "house")])
    reopened = GlossaryStore(tmp_path)
    assert reopened.get("k", made.id) == made


def test_glossaries_are_kept_in_memory_but_a_deletion_elsewhere_counts(tmp_path: Path) -> None:
    store, elsewhere = GlossaryStore(tmp_path), GlossaryStore(tmp_path)  # two processes, say
    made = store.create("k", "g", "de", "en", [E(f"Wort{i}", f"word{i}") for i in range(2000)])
    assert store.get("k", made.id) is store.get("k", made.id)  # kept, not read again
    assert store.get("other", made.id) is None  # the owner is still asked of the database
    assert elsewhere.get("k", made.id) == made
    assert elsewhere.delete("k", made.id)
    assert store.get("k", made.id) is None


def test_store_limits(tmp_path: Path) -> None:
    store = GlossaryStore(tmp_path, max_glossaries=2, max_entries=2)
    store.create("a", "one", "de", "en", [E("x", "y")])
    store.create("a", "two", "de", "en", [E("x", "y")])
    with pytest.raises(StoreFull, match="has 2 glossaries, the most allowed"):
        store.create("a", "three", "de", "en", [E("x", "y")])
    store.create("b", "one", "de", "en", [E("x", "y")])  # a limit per owner
    with pytest.raises(GlossaryError, match="more than 2 entries") as raised:
        store.create("b", "two", "de", "en", [E("x", "y"), E("z", "y"), E("w", "y")])
    assert raised.value.too_large
    for args, message in [
        (("", "de", "en"), "needs a name"),
        (("g", "deutsch!", "en"), "source_lang: 'deutsch!' is not a language code"),
        (("g", "de", "e"), "target_lang"),
    ]:
        with pytest.raises(GlossaryError, match=message):
            store.create("c", *args, [E("x", "y")])
    with pytest.raises(GlossaryError, match="no entries"):
        store.create("c", "g", "de", "en", [])


# --- the endpoints -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = make_settings(
        model_dir,
        api_keys="k1,k2",
        warmup=False,
        data_dir=tmp_path_factory.mktemp("data"),
        max_glossaries=3,
        glossary_max_entries=4,
        glossary_max_term_chars=20,
        glossary_max_bytes=200,
    )
    with serve(settings) as client:
        yield client


def create(client: TestClient, key: str = "k1", **body: object) -> dict[str, object]:
    payload = {"name": "g", "source_lang": "de", "target_lang": "en", "api_key": key, **body}
    response = client.post("/glossaries", json=payload)
    assert response.status_code == 201, response.text
    result: dict[str, object] = response.json()
    return result


def clear(client: TestClient, key: str) -> None:
    for g in client.get("/glossaries", params={"api_key": key}).json()["glossaries"]:
        assert client.delete(f"/glossaries/{g['id']}", params={"api_key": key}).status_code == 204


def test_glossaries_through_the_api(keyed: TestClient) -> None:
    clear(keyed, "k1")
    made = create(
        keyed, entries=[{"source": "Rechnung", "target": "invoice"}, {"source": "ACME", "target": "ACME"}]
    )
    assert made["entry_count"] == 2 and made["name"] == "g" and str(made["creation_time"]).endswith("Z")
    listed = keyed.get("/glossaries", params={"api_key": "k1"}).json()["glossaries"]
    assert listed == [made]  # without entries
    got = keyed.get(f"/glossaries/{made['id']}", params={"api_key": "k1"}).json()
    assert got == {
        **made,
        "entries": [{"source": "Rechnung", "target": "invoice"}, {"source": "ACME", "target": "ACME"}],
    }
    assert keyed.delete(f"/glossaries/{made['id']}", params={"api_key": "k1"}).status_code == 204
    assert_error(keyed.get(f"/glossaries/{made['id']}", params={"api_key": "k1"}), 404, "no glossary")
    assert_error(keyed.delete(f"/glossaries/{made['id']}", params={"api_key": "k1"}), 404)


def test_glossaries_from_a_table_as_text_or_an_upload(keyed: TestClient) -> None:
    clear(keyed, "k1")
    csv_text = create(keyed, entries='"Müller, GmbH",Müller\nHaus,house\n', entries_format="csv")
    tsv_text = create(keyed, entries="Haus\thouse\n")
    assert (csv_text["entry_count"], tsv_text["entry_count"]) == (2, 1)
    fields = {"name": "upload", "source_lang": "de", "target_lang": "en", "api_key": "k1"}
    uploaded = keyed.post(
        "/glossaries", data=fields, files={"file": ("terms.csv", b"\xef\xbb\xbfa,b\nc,d\n")}
    )
    assert uploaded.status_code == 201, uploaded.text
    entries = keyed.get(f"/glossaries/{uploaded.json()['id']}", params={"api_key": "k1"}).json()["entries"]
    assert entries == [{"source": "a", "target": "b"}, {"source": "c", "target": "d"}]
    clear(keyed, "k1")


def test_glossaries_are_each_keys_own(keyed: TestClient) -> None:
    clear(keyed, "k1")
    clear(keyed, "k2")
    made = create(keyed, "k1", entries=[{"source": "a", "target": "b"}])
    assert keyed.get("/glossaries", params={"api_key": "k2"}).json() == {"glossaries": []}
    assert_error(keyed.get(f"/glossaries/{made['id']}", params={"api_key": "k2"}), 404)
    assert_error(keyed.delete(f"/glossaries/{made['id']}", params={"api_key": "k2"}), 404)
    assert_error(keyed.get("/glossaries"), 403, "api_key")
    assert_error(keyed.get("/glossaries", params={"api_key": "nope"}), 403, "invalid api_key")
    body = {
        "name": "g",
        "source_lang": "de",
        "target_lang": "en",
        "entries": [{"source": "a", "target": "b"}],
    }
    assert_error(keyed.post("/glossaries", json=body), 403)
    assert keyed.get(f"/glossaries/{made['id']}", params={"api_key": "k1"}).status_code == 200
    clear(keyed, "k1")


def test_glossary_limits_and_bad_requests(keyed: TestClient) -> None:
    clear(keyed, "k1")
    base = {"name": "g", "source_lang": "de", "target_lang": "en", "api_key": "k1"}
    many = [{"source": f"s{i}", "target": "t"} for i in range(5)]
    assert_error(keyed.post("/glossaries", json={**base, "entries": many}), 413, "more than 4 entries")
    long = [{"source": "x" * 21, "target": "t"}]
    assert_error(keyed.post("/glossaries", json={**base, "entries": long}), 413, "more than 20")
    assert_error(keyed.post("/glossaries", json={**base, "entries": "a\tb\n" * 60}), 413, "200 bytes")
    assert_error(keyed.post("/glossaries", json={**base, "entries": "x" * 70_000}), 413, "request body")
    assert_error(keyed.post("/glossaries", json={**base, "entries": "a\tb\nc\n"}), 422, "line 2")
    assert_error(keyed.post("/glossaries", json={**base, "entries": []}), 422, "no entries")
    assert_error(
        keyed.post("/glossaries", json={**base, "source_lang": "??", "entries": "a\tb"}), 422, "source_lang"
    )
    assert_error(keyed.post("/glossaries", json={**base, "entries": 5}), 422, "entries")
    assert_error(
        keyed.post("/glossaries", json={k: v for k, v in base.items() if k != "name"}), 400, "missing name"
    )
    assert_error(keyed.post("/glossaries", content=b"[1]", headers={"content-type": "application/json"}), 400)
    for _ in range(3):
        create(keyed, entries="a\tb")
    assert_error(keyed.post("/glossaries", json={**base, "entries": "a\tb"}), 409, "the most allowed")
    clear(keyed, "k1")


def test_glossaries_survive_a_restart(model_dir: Path, tmp_path: Path) -> None:
    settings = make_settings(model_dir, warmup=False, data_dir=tmp_path, shared_stores=True)
    with serve(settings) as client:
        made = create(client, key="", entries=[{"source": "Haus", "target": "house"}])
    with serve(settings) as client:
        got = client.get(f"/glossaries/{made['id']}")
        assert got.status_code == 200 and got.json()["entries"] == [{"source": "Haus", "target": "house"}]
