"""No request costs the front end more than linear time or memory in what it sends.

Each endpoint that takes text, lists, files, glossaries or memories gets the same request at size
n and 4n: the front end's CPU time (best of 3) and its peak of allocated memory (tracemalloc) may
grow at most 8 times. Linear work grows 4 times, quadratic 16: the bound leaves room for a loaded
machine's noise and catches any quadratic. Measured in this process, whose threads are the whole
front end (``TestClient`` runs the app here; the model worker and the document readers are other
processes, and each request keeps their work small: one sentence decoded to a few tokens, or none).

Each n is chosen so that the request costs the front end tens of milliseconds or more, where a
quadratic shows plainly; where a request is refused (413) the work before the refusal is measured.
A few cases cost a few milliseconds at any size now, their work bounded: a sentence's terms are
looked for in its first ``MAX_SEARCH_CHARS`` characters, a TMX unit is refused at its 101st
language. There the test guards against the unbounded work coming back (at the same n, the old
code took seconds and grew 15-fold).
The issue (#41) measured the old code's cases: 250,000 bare ``q`` fields 31 s, a file of 50,000
numbers 57 s, a TMX unit of 6,000 languages +3.4 GB.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from model.checkpoint import ModelInfo, save_model_dir
from model.decoding.terms import Glossary, GlossaryEntry, placeholders, resolve
from model.tokenizer import Tokenizer
from tests.conftest import random_model
from tests.test_api import make_settings, multipart, serve

GROWTH = 4  # the larger request is this many times the smaller
MAX_RATIO = 8  # linear is 4, quadratic 16
MIB = 1024 * 1024
# Below these, a measurement is mostly noise (another thread's allocation, a garbage collection):
# the smaller request counts as costing at least this much. Work whose growth matters costs far
# more at 4n (the old code: seconds, a gigabyte).
CPU_FLOOR_S = 0.010
MEMORY_FLOOR = 2 * MIB
FORM = {"source": "de", "target": "en"}


@pytest.fixture(scope="module")
def en_de(tmp_path_factory: pytest.TempPathFactory, spm_model: Path, tokenizer: Tokenizer) -> Path:
    """A second model, en->de: with two source languages, /detect has to identify the language."""
    model = random_model(seed=2, vocab_size=tokenizer.vocab_size, share_embeddings=False, tie_output=False)
    info = ModelInfo(config=model.cfg, source_lang="en", target_lang="de")
    return save_model_dir(tmp_path_factory.mktemp("model") / "tiny-en-de", model, info, spm_model)


@pytest.fixture(scope="module")
def client(model_dir: Path, en_de: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """Limits raised far enough for the 4n requests to be handled (or refused where the case is a
    refusal); decoding kept short (``max_output_tokens``); no keys, the stores shared."""
    settings = make_settings(
        (model_dir, en_de),  # type: ignore[arg-type]  # (Settings takes several directories)
        warmup=False,
        data_dir=tmp_path_factory.mktemp("data"),
        shared_stores=True,
        max_body_bytes=16 * MIB,
        max_chars=4_000_000,
        max_queue=64,  # a text of more sentences is a 413 once the front end has prepared it
        max_output_tokens=4,
        max_glossary_entries=100_000,
        max_file_bytes=8 * MIB,
        max_file_chars=2_000_000,
        max_file_sentences=100_000,
        job_max_chars=2_000_000,
        max_glossaries=1_000,
        glossary_max_entries=100_000,
        glossary_max_bytes=8 * MIB,
        memory_max_segments=1_000_000,
    )
    with serve(settings) as c:
        yield c


Send = Callable[[], None]


def measure(send: Send) -> tuple[float, int]:
    """``send()``'s CPU seconds in this process (best of 3) and its peak of memory allocated beyond
    what was allocated before it (tracemalloc, one more run, traced apart: tracing slows it)."""
    cpu = []
    for _ in range(3):
        start = time.process_time()
        send()
        cpu.append(time.process_time() - start)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        send()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    return min(cpu), peak


def assert_linear(make: Callable[[int], Send], n: int) -> None:
    """The request ``make(n)`` makes, and ``make(GROWTH * n)``'s, cost in proportion."""
    small_cpu, small_memory = measure(make(n))
    large_cpu, large_memory = measure(make(GROWTH * n))
    sizes = f"n={n}: {small_cpu * 1e3:.0f} ms, {small_memory / MIB:.1f} MiB; "
    sizes += f"{GROWTH}n: {large_cpu * 1e3:.0f} ms, {large_memory / MIB:.1f} MiB"
    assert large_cpu <= MAX_RATIO * max(small_cpu, CPU_FLOOR_S), (
        f"CPU time grows faster than linearly: {sizes}"
    )
    assert large_memory <= MAX_RATIO * max(small_memory, MEMORY_FLOOR), (
        f"memory grows faster than linearly: {sizes}"
    )


def post(client: TestClient, path: str, status: int, **kwargs: Any) -> Send:
    """A ``send`` that posts to ``path`` and checks the answer's status."""

    def send() -> None:
        response = client.post(path, **kwargs)
        assert response.status_code == status, response.text[:300]

    return send


# Numbers in one sentence: the front end searches only its start for terms (MAX_SEARCH_CHARS), so
# what grows with n is parsing and splitting the text, cheap per character.
LOTS_OF_NUMBERS = 250_000


def calling(function: Callable[..., object], *args: object) -> Send:
    """A ``send`` that calls ``function(*args)``."""

    def send() -> None:
        function(*args)

    return send


def numbers(n: int) -> str:
    """One sentence of ``n`` numbers, each a placeholder term ("1 1 1 ...")."""
    return " ".join(["1"] * n)


def shared_first_word(n: int) -> list[dict[str, str]]:
    """``n`` glossary entries that all begin with the same word."""
    return [{"source": f"Wort {i}", "target": f"word {i}"} for i in range(n)]


def not_matching(words: int) -> str:
    """A sentence whose every other word begins entries of ``shared_first_word`` and matches none."""
    return " ".join(["Wort x"] * words)


# -- /translate ------------------------------------------------------------------------------------


def test_translate_bare_q_fields_urlencoded_cost_linear_time(client: TestClient) -> None:
    """The issue's first case (250,000 ``q`` fields: 31 s): too many texts (413) once parsed."""

    def make(n: int) -> Send:
        body = b"&".join([b"q"] * n) + b"&source=de&target=en"
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        return post(client, "/translate", 413, content=body, headers=headers)

    assert_linear(make, 60_000)


def test_translate_q_list_as_json_costs_linear_time(client: TestClient) -> None:
    def make(n: int) -> Send:
        return post(client, "/translate", 413, json={**FORM, "q": ["a"] * n})

    assert_linear(make, 500_000)


def test_translate_q_fields_multipart_cost_linear_time(client: TestClient) -> None:
    def make(n: int) -> Send:
        # (by hand: httpx sends a form as multipart only with a file, which /translate refuses)
        body, content_type = multipart([*FORM.items(), *[("q", "Ein Satz.")] * n])
        return post(client, "/translate", 413, content=body, headers={"Content-Type": content_type})

    assert_linear(make, 20_000)


def test_translate_a_long_text_of_many_sentences_costs_linear_time(client: TestClient) -> None:
    """Parsed, split, each sentence routed and its terms found: then more sentences than the
    queue holds (413), before any decoding."""

    def make(n: int) -> Send:
        text = " ".join(f"Der Mann {i} spielt im Park." for i in range(n))
        return post(client, "/translate", 413, json={**FORM, "q": text})

    assert_linear(make, 4_000)


def test_translate_a_text_full_of_numbers_costs_linear_time(client: TestClient) -> None:
    """One sentence of n numbers, each a placeholder term (the issue's quadratic ``resolve``)."""

    def make(n: int) -> Send:
        return post(client, "/translate", 200, json={**FORM, "q": numbers(n)})

    assert_linear(make, LOTS_OF_NUMBERS)


def test_translate_an_inline_glossary_sharing_a_first_word_costs_linear_time(client: TestClient) -> None:
    def make(n: int) -> Send:
        body = {**FORM, "q": not_matching(n // 10), "glossary": shared_first_word(n)}
        return post(client, "/translate", 200, json=body)

    assert_linear(make, 15_000)


def test_translate_a_stored_glossary_sharing_a_first_word_costs_linear_time(client: TestClient) -> None:
    def make(n: int) -> Send:
        made = {"name": "g", "source_lang": "de", "target_lang": "en", "entries": shared_first_word(n)}
        response = client.post("/glossaries", json=made)
        assert response.status_code == 201, response.text
        body = {**FORM, "q": not_matching(n // 10), "glossary_id": response.json()["id"]}
        return post(client, "/translate", 200, json=body)

    assert_linear(make, 20_000)


def test_detect_a_long_text_costs_linear_time(client: TestClient) -> None:
    def make(n: int) -> Send:
        return post(client, "/detect", 200, json={"q": "Der Mann spielt im Park. " * n})

    assert_linear(make, 20_000)


# -- DeepL's /v2/translate ----------------------------------------------------------------------------


def test_deepl_text_fields_urlencoded_cost_linear_time(client: TestClient) -> None:
    """DeepL's form repeats ``text`` as LibreTranslate's repeats ``q``: too many texts (413)."""

    def make(n: int) -> Send:
        body = b"&".join([b"text=a"] * n) + b"&target_lang=EN-US"
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        return post(client, "/v2/translate", 413, content=body, headers=headers)

    assert_linear(make, 60_000)


def test_deepl_markup_with_ignore_tags_costs_linear_time(client: TestClient) -> None:
    """The ignored elements marked (app/http/endpoints/deepl/markup.py), then parsed and split: more
    sentences than the queue holds (413), before any decoding."""

    def make(n: int) -> Send:
        text = "".join(f"<p>Der Mann {i} <keep>x</keep> spielt.</p>" for i in range(n))
        body = {"text": [text], "target_lang": "EN-US", "tag_handling": "xml", "ignore_tags": ["keep"]}
        return post(client, "/v2/translate", 413, json=body)

    assert_linear(make, 4_000)


# -- files and jobs --------------------------------------------------------------------------------


def test_translate_file_of_numbers_costs_linear_time(client: TestClient) -> None:
    """The issue's second case: a .txt of one sentence of numbers (50,000: 57 s)."""

    def make(n: int) -> Send:
        data = numbers(n).encode()
        return post(client, "/translate_file", 200, data=FORM, files={"file": ("n.txt", data)})

    assert_linear(make, LOTS_OF_NUMBERS)


def test_translate_file_of_many_lines_costs_linear_time(client: TestClient) -> None:
    """Many sentences, each with numbers: every one answered by the segment cache (filled first by
    /translate), so that the front end's work per sentence is what is measured."""
    line = "Um 3 Uhr kamen 12 Hunde."
    assert client.post("/translate", json={**FORM, "q": line}).status_code == 200

    def make(n: int) -> Send:
        data = "\n".join([line] * n).encode()
        return post(client, "/translate_file", 200, data=FORM, files={"file": ("lines.txt", data)})

    assert_linear(make, 5_000)


def test_a_job_of_numbers_costs_linear_time(client: TestClient) -> None:
    """The issue's poison job: submitted, read, its terms found and translated, to the end."""

    def make(n: int) -> Send:
        data = numbers(n).encode()

        def send() -> None:
            response = client.post("/jobs", data=FORM, files={"file": ("n.txt", data)})
            assert response.status_code == 202, response.text
            job_id = response.json()["id"]
            deadline = time.monotonic() + 120
            while (state := client.get(f"/jobs/{job_id}").json()["state"]) not in ("done", "failed"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert state == "done"

        return send

    assert_linear(make, LOTS_OF_NUMBERS)


# -- glossaries and memories -----------------------------------------------------------------------


def glossary_form(**fields: str) -> dict[str, str]:
    return {"name": "g", "source_lang": "de", "target_lang": "en", **fields}


def test_glossaries_from_json_entries_cost_linear_time(client: TestClient) -> None:
    def make(n: int) -> Send:
        body = {"name": "g", "source_lang": "de", "target_lang": "en", "entries": shared_first_word(n)}
        return post(client, "/glossaries", 201, json=body)

    assert_linear(make, 15_000)


@pytest.mark.parametrize(("name", "separator"), [("g.tsv", "\t"), ("g.csv", ",")])
def test_glossaries_from_a_table_cost_linear_time(client: TestClient, name: str, separator: str) -> None:
    def make(n: int) -> Send:
        table = "".join(f"Wort {i}{separator}word {i}\n" for i in range(n)).encode()
        return post(client, "/glossaries", 201, data=glossary_form(), files={"file": (name, table)})

    assert_linear(make, 5_000)


def tmx(units: list[list[tuple[str, str]]]) -> bytes:
    body = "".join(
        "<tu>" + "".join(f'<tuv xml:lang="{lang}"><seg>{text}</seg></tuv>' for lang, text in unit) + "</tu>\n"
        for unit in units
    )
    return f'<?xml version="1.0"?><tmx version="1.4"><header/><body>{body}</body></tmx>'.encode()


def languages(n: int) -> list[str]:
    """``n`` made-up three-letter language codes."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [letters[i // 676 % 26] + letters[i // 26 % 26] + letters[i % 26] for i in range(n)]


def test_memories_from_tmx_units_of_many_languages_cost_linear_time(client: TestClient) -> None:
    """Units of 100 languages (the most a unit may have), each giving 9,900 segments."""

    def make(n: int) -> Send:
        units = [[(lang, f"Satz {u} in {lang}") for lang in languages(100)] for u in range(n)]
        return post(client, "/memories", 200, files={"file": ("m.tmx", tmx(units))})

    assert_linear(make, 2)


def test_memories_from_a_tmx_unit_of_too_many_languages_cost_linear_time(client: TestClient) -> None:
    """The issue's third case (a unit of 6,000 languages: +3.4 GB): refused (413), its pairs
    never built."""

    def make(n: int) -> Send:
        data = tmx([[(lang, "x") for lang in languages(n)]])
        return post(client, "/memories", 413, files={"file": ("m.tmx", data)})

    assert_linear(make, 1_000)


def test_memories_from_tsv_cost_linear_time(client: TestClient) -> None:
    def make(n: int) -> Send:
        data = "".join(f"Satz {i}\tSentence {i}\n" for i in range(n)).encode()
        fields = {"source_lang": "de", "target_lang": "en"}
        return post(client, "/memories", 200, data=fields, files={"file": ("m.tsv", data)})

    assert_linear(make, 10_000)


def test_the_bare_q_body_of_the_issue_is_refused_within_two_seconds(client: TestClient) -> None:
    """250,000 bare ``q`` fields (500 KB): 413 after 31 s before; the issue's target is 2 s (a
    loose bound for a loaded machine: it takes ~0.2 s)."""
    body = b"&".join([b"q"] * 250_000) + b"&source=de&target=en"
    start = time.monotonic()
    response = client.post(
        "/translate", content=body, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert response.status_code == 413 and "too many texts" in response.text
    assert time.monotonic() - start < 2.0


def test_the_tmx_unit_of_the_issue_is_refused_without_building_its_pairs(client: TestClient) -> None:
    """A unit of 6,000 languages (36 million pairs, +3.4 GB before): 413 naming the limit, within
    2 s, the front end's allocations at their peak under 32 MiB (the 250 KB file, parsed)."""
    data = tmx([[(lang, "x") for lang in languages(6_000)]])
    tracemalloc.start()
    try:
        start = time.monotonic()
        response = client.post("/memories", files={"file": ("m.tmx", data)})
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert response.status_code == 413 and "more than 100 languages" in response.text, response.text
    assert elapsed < 2.0
    assert peak < 32 * MIB, f"{peak / MIB:.0f} MiB"


# -- the term matcher itself, past the part of a sentence the service searches ---------------------

HOSTILE = {
    "printf flags then width": lambda n: "%" + "0" * n + "!",
    "named printf flags then width": lambda n: "%(a)" + "0" * n + "!",
    "a URL followed by brackets": lambda n: "http://a" + ")" * n,
    "a URL followed by dots": lambda n: "http://a" + "." * n,
    "an e-mail address's domain": lambda n: "a@" + "b" * n,
    "a number's groups": lambda n: "1." * n + "a",
    "braces and spaces": lambda n: "{{" + " " * n,
}


@pytest.mark.parametrize("name", HOSTILE)
def test_placeholder_patterns_cost_linear_time_on_hostile_strings(name: str) -> None:
    """No pattern backtracks more than linearly (two took minutes on 100,000 zeros)."""
    assert_linear(lambda n: calling(placeholders, HOSTILE[name](n)), 50_000)


def test_overlapping_terms_are_resolved_in_linear_time() -> None:
    """``resolve`` compared every term with every other: 50,000 numbers took a minute."""

    def make(n: int) -> Send:
        return calling(resolve, placeholders(numbers(n)))

    assert_linear(make, 20_000)


def test_glossary_matches_cost_linear_time_when_entries_share_a_first_word() -> None:
    """Each word is looked up once per distinct entry length, not once per entry sharing it."""

    def make(n: int) -> Send:
        glossary = Glossary(GlossaryEntry(e["source"], e["target"]) for e in shared_first_word(n))
        return calling(glossary.candidates, not_matching(n // 10))

    assert_linear(make, 20_000)
