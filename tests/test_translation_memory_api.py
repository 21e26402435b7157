"""The translation memory and the segment cache in /translate and /translate_file: who answers each
sentence, memory > glossary > model, the cache invisible but for its metrics
(app/terminology/answers.py, precedence.py; the stores themselves: tests/test_memory.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.serving.protocol import Sentence
from app.stores.database.errors import StoreUnavailable
from app.terminology.answers import answer
from app.terminology.cache import SegmentCache
from model.translator import Translator
from tests.test_api import assert_error, best, make_settings, serve
from tests.test_terminology import target_ids

IN_MEMORY = "Der Hund läuft im Park."
REMEMBERED = "The dog runs in the park (from memory)."
TMX_SOURCE = "Die Rechnung ist fällig."
TMX_TARGET = "The invoice is due."
TMX = f"""<?xml version="1.0" encoding="UTF-8"?>
<tmx version="1.4"><header srclang="de-DE"/><body>
  <tu><tuv xml:lang="de-DE"><seg>{TMX_SOURCE}</seg></tuv>
      <tuv xml:lang="en-US"><seg>{TMX_TARGET}</seg></tuv></tu>
</body></tmx>""".encode()


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """Keys on: k1 has a memory (TSV and TMX), k2 none."""
    settings = make_settings(
        model_dir, api_keys="k1,k2", warmup=False, data_dir=tmp_path_factory.mktemp("data")
    )
    with serve(settings) as c:
        tsv = f"{IN_MEMORY}\t{REMEMBERED}\n".encode()
        fields = {"api_key": "k1", "source_lang": "de", "target_lang": "en"}
        assert c.post("/memories", data=fields, files={"file": ("m.tsv", tsv)}).status_code == 200
        assert c.post("/memories", data={"api_key": "k1"}, files={"file": ("m.tmx", TMX)}).status_code == 200
        yield c


def translate(client: TestClient, key: str = "k1", **body: Any) -> Any:
    response = client.post("/translate", json={"source": "de", "target": "en", "api_key": key, **body})
    assert response.status_code == 200, response.text
    return response.json()


def cache_of(client: TestClient) -> SegmentCache[Any]:
    cache: SegmentCache[Any] = client.app.state.services.segment_cache  # type: ignore[attr-defined]
    return cache


def sample(client: TestClient, name: str) -> float:
    return float(client.app.state.services.metrics.sample(name))  # type: ignore[attr-defined]


def memory_only(text: str, start: int = 0) -> dict[str, Any]:
    """The terminology of a text whose one sentence, ``text``, the memory answered."""
    return {"memory": True, "terms": [], "segments": [{"start": start, "end": start + len(text)}]}


MEMORY_ONLY = memory_only(REMEMBERED)


def test_an_imported_segment_is_answered_verbatim_without_decoding(
    client: TestClient, jobs: list[Sentence]
) -> None:
    assert translate(client, q=IN_MEMORY) == {"translatedText": REMEMBERED, "terminology": MEMORY_ONLY}
    assert translate(client, q=TMX_SOURCE) == {
        "translatedText": TMX_TARGET,
        "terminology": memory_only(TMX_TARGET),
    }
    # "auto": the memory of the detected language; a form too.
    auto = translate(client, q=IN_MEMORY, source="auto")
    assert auto["translatedText"] == REMEMBERED and auto["terminology"] == MEMORY_ONLY
    form = client.post("/translate", data={"q": IN_MEMORY, "source": "de", "target": "en", "api_key": "k1"})
    assert form.json() == {"translatedText": REMEMBERED, "terminology": MEMORY_ONLY}
    assert jobs == []


def test_the_match_is_exact_after_whitespace_is_normalised(
    client: TestClient, translator: Translator
) -> None:
    spaced = translate(client, q="Der  Hund läuft\tim\u00a0Park.")
    assert spaced["translatedText"] == REMEMBERED and spaced["terminology"] == MEMORY_ONLY
    other = "Der Hund läuft im Garten."  # not in the memory: the model's, as before (no field)
    assert translate(client, q=other) == {"translatedText": best(translator, [other])[0]}


def test_another_keys_memory_is_not_used(client: TestClient, translator: Translator) -> None:
    assert translate(client, "k2", q=IN_MEMORY) == {"translatedText": best(translator, [IN_MEMORY])[0]}


def test_memory_then_glossary_then_model_per_sentence(
    client: TestClient, jobs: list[Sentence], model_dir: Path
) -> None:
    glossary = [{"source": "Hund", "target": "hound"}]
    # The remembered sentence keeps the memory's words, glossary or not; the other is decoded with
    # the glossary's term as its constraint.
    answer = translate(client, q=[f"{IN_MEMORY} Ein Hund schläft.", "Ein Hund bellt."], glossary=glossary)
    first, second = answer["translatedText"]
    assert first.startswith(REMEMBERED + " ") and "hound" not in REMEMBERED
    assert [job.constraints for job in jobs] == [target_ids(model_dir, "hound")] * 2
    memory, model = answer["terminology"]
    assert memory["memory"] is True and not second.startswith(REMEMBERED)
    # Where the memory's sentence is: for the page's marks, as terms have theirs; the glossary's
    # term is marked in the model's sentence only.
    assert memory["segments"] == [{"start": 0, "end": len(REMEMBERED)}]
    hound = {"source": "Hund", "target": "hound"}
    [mark] = memory["terms"]
    assert mark["start"] > len(REMEMBERED) and first[mark["start"] : mark["end"]] == "hound"
    assert {k: mark[k] for k in hound} == hound
    assert model["memory"] is False and "segments" not in model
    assert [second[m["start"] : m["end"]] for m in model["terms"]] == ["hound"]


def test_a_remembered_sentence_is_marked_where_it_is(client: TestClient) -> None:
    text = f"Ein Hund schläft.\n\n  {IN_MEMORY}"
    answer = translate(client, q=text)
    start = answer["translatedText"].index(REMEMBERED)
    assert answer["terminology"] == memory_only(REMEMBERED, start)
    html = translate(client, q=f"<p>Ein Hund schläft.</p><p><b>{IN_MEMORY}</b></p>", format="html")
    start = html["translatedText"].index(REMEMBERED)
    assert html["translatedText"].endswith(f"<b>{REMEMBERED}</b></p>")
    assert html["terminology"] == memory_only(REMEMBERED, start)


def test_alternatives_of_a_remembered_sentence_are_the_memory_text(client: TestClient) -> None:
    answer = translate(client, q=IN_MEMORY, alternatives=2)
    assert answer["translatedText"] == REMEMBERED and answer["alternatives"] == [REMEMBERED] * 2


def test_a_file_is_answered_from_the_memory_too(client: TestClient) -> None:
    form = {"source": "de", "target": "en", "api_key": "k1"}
    response = client.post("/translate_file", data=form, files={"file": ("a.txt", IN_MEMORY.encode())})
    assert response.status_code == 200, response.text
    url = response.json()["translatedFileUrl"]
    assert client.get(url[url.index("/download_file") :]).text == REMEMBERED


def test_a_repeated_sentence_is_answered_from_the_cache(
    client: TestClient, jobs: list[Sentence], translator: Translator
) -> None:
    sentence = "Eine Katze sitzt auf dem Dach."
    decoded = translate(client, "k2", q=sentence, alternatives=1)
    assert len(jobs) == 1
    hits, misses = (
        sample(client, "nmt_segment_cache_hits_total"),
        sample(client, "nmt_segment_cache_misses_total"),
    )
    again = translate(client, "k2", q=[sentence, sentence], alternatives=1)
    assert len(jobs) == 1  # nothing decoded
    assert again == {
        "translatedText": [decoded["translatedText"]] * 2,
        "alternatives": [decoded["alternatives"]] * 2,
    }
    assert decoded["translatedText"] == best(translator, [sentence])[0]
    assert sample(client, "nmt_segment_cache_hits_total") == hits + 2
    assert sample(client, "nmt_segment_cache_misses_total") == misses
    # Each key's own: another key's answer is decoded (its time would tell what the first one asked).
    assert translate(client, "k1", q=sentence, alternatives=1) == decoded
    assert len(jobs) == 2
    # Another search is another answer: decoded again.
    assert translate(client, q=sentence, beam_size=2)["translatedText"] == best(translator, [sentence], 2)[0]
    assert len(jobs) == 3


def test_the_cache_keeps_within_its_bytes(client: TestClient, jobs: list[Sentence]) -> None:
    cache = cache_of(client)
    limit, cache.max_bytes = cache.max_bytes, 2000  # a few entries' worth
    try:
        sentences = [f"Der Mann Nummer {n} liest ein Buch." for n in range(12)]
        translate(client, q=sentences, protect_placeholders=False)
        assert len(jobs) == 12
        assert 0 < cache.bytes <= 2000 and len(cache) < 12
        assert 0 < sample(client, "nmt_segment_cache_bytes") <= 2000
    finally:
        cache.clear()
        cache.max_bytes = limit


def test_an_unreadable_memory_is_503_not_the_models_answer_and_names_no_path(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    detail = "cannot read /srv/nmt-data/memory.sqlite3: disk I/O error"

    def broken(*args: Any) -> Any:
        raise StoreUnavailable(detail)

    monkeypatch.setattr(client.app.state.services.memory, "lookup_many", broken)  # type: ignore[attr-defined]
    with caplog.at_level(logging.ERROR):
        response = client.post(
            "/translate", json={"q": IN_MEMORY, "source": "de", "target": "en", "api_key": "k1"}
        )
    assert_error(response, 503, "translation memory is unavailable")
    assert "/srv" not in response.text and "sqlite3" not in response.text  # the client gets no path
    assert response.headers["Retry-After"] == "1"
    assert detail in caplog.text  # the operator does


def test_answer_leaves_blanks_to_the_decoder_and_returns_none_when_the_client_went() -> None:
    cache: SegmentCache[str] = SegmentCache(1 << 20)
    asked: list[list[int]] = []

    def run(sentences: list[str], *, client_gone: bool = False) -> list[str] | None:
        async def decode(indices: list[int]) -> list[str] | None:
            asked.append(indices)
            return None if client_gone else [sentences[i].upper() for i in indices]

        def lookup(indices: Sequence[int], texts: Sequence[str]) -> list[str | None]:
            return ["remembered" if text == "b" else None for text in texts]

        return asyncio.run(
            answer(sentences, sentences, decode, lambda t: f"<{t}>", lookup=lookup, cache=cache)
        )

    assert run(["a", " ", "b", "c", "a"]) == ["A", " ", "<remembered>", "C", "A"]
    assert asked == [[0, 1, 3]]  # the blank too (no model work there), "a" once, not "b"
    assert " " not in cache and "a" in cache and "b" not in cache
    assert run(["c", "d"]) == ["C", "D"] and asked[-1] == [1]
    assert run(["b", "c"]) == ["<remembered>", "C"] and asked[-1] == []  # still asked: ends the wait
    assert run(["e"], client_gone=True) is None and "e" not in cache
    many = ["b", "a"] * 10  # looked up on a thread: the same answers
    assert run(many) == ["<remembered>", "A"] * 10


def test_the_memory_persists_across_a_restart(model_dir: Path, tmp_path: Path) -> None:
    settings = make_settings(model_dir, warmup=False, data_dir=tmp_path, shared_stores=True)
    with serve(settings) as c:
        fields = {"source_lang": "de", "target_lang": "en"}
        tsv = f"{IN_MEMORY}\t{REMEMBERED}\n".encode()
        assert c.post("/memories", data=fields, files={"file": ("m.tsv", tsv)}).status_code == 200
    with serve(settings) as c:
        answer = c.post("/translate", json={"q": IN_MEMORY, "source": "de", "target": "en"}).json()
        assert answer == {"translatedText": REMEMBERED, "terminology": MEMORY_ONLY}
