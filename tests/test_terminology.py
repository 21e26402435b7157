"""Terminology in the service: the constraints sent to the decoder, the rendering of constrained
hypotheses and their offsets, the request fields and their limits, and (through a real worker and
the tiny model) the translations. The matching rules: tests/test_terminology_match.py.

The tests marked "needs the constrained search" check what the decoder guarantees: that a term
given as a constraint appears in the translation. Those through the API use the tiny random model,
which produces a term only when the search forces it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from app.keys.accepted import owner_name
from app.models.served import ServedModel
from app.serving.frontend.pipeline import Translation
from app.serving.frontend.router import Hop, Route
from app.serving.protocol import (
    Answers,
    Constraints,
    Done,
    ModelDescription,
    Sentence,
    SentenceResult,
)
from app.serving.worker.executor import Executor
from app.serving.worker.held import HeldSentence
from app.serving.worker.inbox import Inbox
from app.serving.worker.models import ModelTable
from model.decoding.batch import RunningBatch, Source
from model.decoding.constraints import beam_for
from model.decoding.hypothesis import Hypothesis, Spans
from model.decoding.terms import GlossaryEntry
from model.tokenizer import Tokenizer
from model.translator import Translator
from tests.test_api import assert_error, best, make_settings, serve, translate

# -- rendering constrained hypotheses ---------------------------------------------------------------


def test_decode_spans_writes_each_term_exactly(tokenizer: Tokenizer) -> None:
    words = tokenizer.encode(["a man plays with the ball"], target=True)[0]
    term = tokenizer.encode(["{name}"], target=True)[0]  # "{" and "}": not in the vocabulary
    ids = words[:3] + term + words[3:]
    spans = [(3, 3 + len(term), 0)]
    text, placed = tokenizer.decode_spans_with_offsets(ids, spans, ["{name}"])
    assert text == tokenizer.decode_spans(ids, spans, ["{name}"]) == "a man plays {name} with the ball"
    assert placed == [(12, 18, 0)]
    assert tokenizer.decode_spans_with_offsets(ids, [], []) == (tokenizer.decode([ids])[0], [])


def served(model_dir: Path, name: str = "tiny") -> ServedModel:
    info, tokenizer = ServedModel.open(model_dir)
    return ServedModel(name, info, tokenizer, ModelDescription("cpu", "float32", "none"))


def test_served_model_renders_hypotheses_with_their_spans(model_dir: Path) -> None:
    model = served(model_dir)
    [term] = model.constraints(["Gärtner™"])  # one constraint, its target-side ids
    words = model.tokenizer.encode(["a man plays"], target=True)[0]
    ids = words + list(term)
    spans: Spans = ((len(words), len(ids), 0),)
    results = [nbest((ids, -1.0, spans), (words, -2.0, ())), nbest((words, -1.0, ()))]
    first, second = model.render(results, [["Gärtner™"], []])
    assert first.texts == ["a man plays Gärtner™", model.texts([nbest((words, 0.0, ()))])[0][0]]
    assert first.placed == ((0, 12, 20),)
    assert (second.texts, second.placed) == (model.texts([nbest((words, 0.0, ()))])[0], ())


def nbest(*hypotheses: tuple[list[int], float, Spans]) -> SentenceResult:
    """A sentence's result as a worker sends it: each hypothesis's tokens, score and spans."""
    found = (Hypothesis(tokens, score, spans=spans) for tokens, score, spans in hypotheses)
    return SentenceResult(tuple(found))


class FakeRequest:
    def __init__(self, results: list[SentenceResult]) -> None:
        self.future: asyncio.Future[list[SentenceResult]] = asyncio.get_running_loop().create_future()
        self.future.set_result(results)


class FakeScheduler:
    """Answers each sentence with its constraints' ids appended (as a constrained search would end
    a hypothesis), and records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[Constraints] | None]] = []

    def submit(
        self, sources: list[list[int]], *, model: str, constraints: list[Constraints] | None = None, **_: Any
    ) -> FakeRequest:
        self.calls.append((model, constraints))
        results: list[SentenceResult] = []
        for k in range(len(sources)):
            ids, own = [5, 6], []
            for c, tokens in enumerate(constraints[k] if constraints else ()):
                own.append((len(ids), len(ids) + len(tokens), c))
                ids += tokens
            results.append(nbest((ids, -1.0, tuple(own))))
        return FakeRequest(results)

    def withdraw(self, request: Any) -> None:
        pass


def test_a_pivot_is_constrained_on_its_last_hop_only(model_dir: Path) -> None:
    first, second = served(model_dir, "fr-en"), served(model_dir, "en-de")
    # (Both hops are the tiny de->en model: the fake scheduler never runs them.)
    route = Route("fr", "en", (Hop(first, "fr", "en"), Hop(second, "en", "en")))
    fake = FakeScheduler()

    async def main() -> list[SentenceResult]:
        translation = Translation(
            fake,  # type: ignore[arg-type]
            ["Bonjour {name}.", "Rien."],
            [route, route],
            beam_size=2,
            n_best=1,
            timeout_s=10.0,
            terms=[["{name}"], []],
        )
        return await translation.result()

    rendered = asyncio.run(main())
    assert [model for model, _ in fake.calls] == ["fr-en", "en-de"]
    assert fake.calls[0][1] is None  # the first hop: unconstrained
    assert fake.calls[1][1] == [second.constraints(["{name}"]), ()]
    assert rendered[0].texts[0].endswith("{name}")
    start, end = rendered[0].placed[0][1:]
    assert rendered[0].texts[0][start:end] == "{name}"
    assert rendered[1].placed == ()


# -- the scheduler --------------------------------------------------------------------------------


def test_the_scheduler_gives_a_constrained_sentence_its_beam_and_keeps_its_spans() -> None:
    from tests.test_scheduler import FakeWorker, scheduler

    async def main() -> None:
        worker = FakeWorker("w")
        sched = scheduler([worker], max_batch_size=8)
        await sched.start()
        constraints: list[Constraints] = [((7, 8), (9,)), ()]
        request = sched.submit([[5, 2], [6, 2]], beam_size=1, n_best=1, constraints=constraints)
        given = worker.given()
        assert [(job.constraints, job.beam_size) for job in given] == [(constraints[0], 3), ((), 1)]
        assert sum(state.rows for state in sched.workers) == 4  # the rows of the beams they need
        spans: Spans = ((0, 2, 0), (2, 3, 1))
        del worker.pending[given[0].id], worker.pending[given[1].id]
        done = (Done(given[0].id, nbest(([7, 8, 9], -1.0, spans))), Done(given[1].id, nbest(([4], -1.0, ()))))
        sched.on_message(worker, Answers(done))
        results = await request.future
        assert [[(h.tokens, h.score) for h in r.hypotheses] for r in results] == [
            [([7, 8, 9], -1.0)],
            [([4], -1.0)],
        ]
        assert [tuple(h.spans for h in r.hypotheses) for r in results] == [(spans,), ((),)]
        with pytest.raises(ValueError, match="constraint lists"):
            sched.submit([[5, 2]], beam_size=1, n_best=1, constraints=[(), ()])
        sched.stop()

    asyncio.run(main())


# -- the worker's side -----------------------------------------------------------------------------


def decode_in_executor(
    translator: Translator, constraints: Constraints, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Source[Any]], HeldSentence, SentenceResult]:
    """One constrained sentence through a worker's inbox and executor: the sources its running
    batch was given, the job as the worker holds it, and its result."""
    given: list[Source[Any]] = []
    add = RunningBatch.add

    def spy(self: RunningBatch[Any], sources: Any) -> None:
        given.extend(sources)
        add(self, sources)

    monkeypatch.setattr(RunningBatch, "add", spy)
    src = translator.source_ids(["Der Hund läuft im Park."])[0]
    beam = beam_for(2, len(constraints))
    inbox = Inbox()
    inbox.add([Sentence(1, 0, src, beam, 2, None, time.monotonic(), "m", constraints)])
    executor = Executor(ModelTable.single(translator, "m"), inbox)
    with torch.inference_mode():
        for _ in range(1000):
            for job, result in executor.iteration():
                assert isinstance(job, HeldSentence) and not isinstance(result, BaseException)
                return given, job, result
    raise AssertionError("the executor does not finish")


def test_the_executor_passes_constraints_to_the_batch_and_spans_back(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    constraints = translator.tokenizer.encode(["garden", "Hund"], target=True)
    wanted = tuple(map(tuple, constraints))
    given, _, result = decode_in_executor(translator, wanted, monkeypatch)
    assert [(s.constraints, s.beam_size) for s in given] == [(wanted, 3)]
    for h in result.hypotheses:  # each hypothesis's own spans, for ``Done``
        for start, end, which in h.spans:
            assert tuple(h.tokens[start:end]) == wanted[which]


def test_every_hypothesis_realises_every_constraint(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Needs the constrained search.)"""
    wanted = tuple(map(tuple, translator.tokenizer.encode(["garden", "Hund"], target=True)))
    _, _, result = decode_in_executor(translator, wanted, monkeypatch)
    for h in result.hypotheses:
        assert sorted(which for _, _, which in h.spans) == [0, 1]
        for start, end, which in h.spans:
            assert tuple(h.tokens[start:end]) == wanted[which]


# -- through the API --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    # These tests look at what the workers are given: without the segment cache, which would answer
    # a sentence an earlier test had translated (tests/test_translation_memory_api.py tests it).
    # shared_stores: a glossary_id without keys (tests below give the app a store of their own).
    with serve(make_settings(model_dir, segment_cache_mb=0, shared_stores=True)) as c:
        yield c


def target_ids(model_dir: Path, *terms: str) -> Constraints:
    return served(model_dir).constraints(list(terms))


def test_glossary_targets_are_sent_as_constraints_with_the_beam_they_need(
    client: TestClient, jobs: list[Sentence], model_dir: Path
) -> None:
    glossary = [{"source": "Park", "target": "garden"}, {"source": "Hund", "target": "Hund"}]
    response = translate(client, q=["Der Hund läuft im Park.", "Eine Katze."], glossary=glossary)
    assert response.status_code == 200, response.text
    assert [job.constraints for job in jobs] == [target_ids(model_dir, "Hund", "garden"), ()]
    assert [job.beam_size for job in jobs] == [beam_for(5, 2), 5]


def test_placeholders_are_sent_as_constraints_by_default_and_not_when_turned_off(
    client: TestClient, jobs: list[Sentence], model_dir: Path, translator: Translator
) -> None:
    text = "Hallo {name}, %1$s schreibt an info@example.com über https://example.com/x um 3.14 Uhr."
    assert translate(client, q=text).status_code == 200
    placeholders_ = ["{name}", "%1$s", "info@example.com", "https://example.com/x", "3.14"]
    assert jobs[-1].constraints == target_ids(model_dir, *placeholders_)
    off = translate(client, q=text, protect_placeholders=False).json()
    assert jobs[-1].constraints == ()
    assert off == {"translatedText": best(translator, [text])[0]}  # as before terminology


def test_an_entry_whose_source_is_absent_changes_nothing(client: TestClient, jobs: list[Sentence]) -> None:
    texts = ["Ein Mann spielt.", "Eine Katze"]
    without = client.post("/translate", json={"q": texts, "source": "de", "target": "en"})
    glossary = [{"source": "Rechnung", "target": "invoice"}]
    with_glossary = translate(client, q=texts, glossary=glossary)
    assert with_glossary.status_code == 200
    assert with_glossary.content == without.content  # byte for byte: no terminology field either
    assert all(job.constraints == () for job in jobs)


def test_a_form_carries_the_glossary_as_json_text(
    client: TestClient, jobs: list[Sentence], model_dir: Path
) -> None:
    glossary = json.dumps([{"source": "Park", "target": "garden"}])
    form = {"q": "Ein Mann im Park.", "source": "de", "target": "en", "glossary": glossary}
    assert client.post("/translate", data=form).status_code == 200
    assert jobs[-1].constraints == target_ids(model_dir, "garden")
    bad = client.post("/translate", data={**form, "glossary": "[{"})
    assert_error(bad, 422, "glossary")
    off = {**form, "glossary": "[]", "protect_placeholders": "false", "q": "Um 3 Uhr."}
    assert client.post("/translate", data=off).status_code == 200
    assert jobs[-1].constraints == ()


def test_a_file_takes_a_glossary_and_protects_its_placeholders(
    client: TestClient, jobs: list[Sentence], model_dir: Path
) -> None:
    glossary = json.dumps([{"source": "Park", "target": "garden"}])
    form = {"source": "de", "target": "en", "glossary": glossary}
    text = b"Ein Mann im Park.\nUm 3 Uhr."
    response = client.post("/translate_file", data=form, files={"file": ("a.txt", text)})
    assert response.status_code == 200, response.text
    assert [job.constraints for job in jobs] == [target_ids(model_dir, "garden"), target_ids(model_dir, "3")]
    plain = {"source": "de", "target": "en", "protect_placeholders": "false"}
    assert client.post("/translate_file", data=plain, files={"file": ("a.txt", text)}).status_code == 200
    assert [job.constraints for job in jobs[2:]] == [(), ()]
    bad = client.post("/translate_file", data={**form, "glossary": "{"}, files={"file": ("a.txt", text)})
    assert_error(bad, 422, "glossary")


def test_glossary_limits_are_4xx(client: TestClient) -> None:
    entry = {"source": "Hund", "target": "dog"}
    assert_error(translate(client, q="Hund", glossary=[entry] * 1001), 400, "1001 entries", "at most 1000")
    long = {"source": "H" * 201, "target": "dog"}
    assert_error(translate(client, q="Hund", glossary=[long]), 400, "201 characters", "at most 200")
    assert_error(translate(client, q="Hund", glossary=[{"source": "", "target": "x"}]), 422, "glossary")
    assert_error(translate(client, q="Hund", glossary=[{"source": "Hund"}]), 422, "glossary")
    assert_error(translate(client, q="Hund", glossary="nope"), 422, "glossary")
    many = [{"source": f"Wort{i}", "target": f"word{i}"} for i in range(11)]
    sentence = " ".join(e["source"] for e in many)
    # (refused as the 11th is found: the terms past it are not looked for)
    assert_error(
        translate(client, q=sentence, glossary=many), 413, "more than 10 glossary terms", "at most 10"
    )


def test_html_sentences_take_the_glossary_and_placeholders(
    client: TestClient, jobs: list[Sentence], model_dir: Path
) -> None:
    glossary = [{"source": "Park", "target": "garden"}]
    html = "<p>Ein <b>Mann</b> im Park.</p><p>Um 3 Uhr.</p>"
    assert translate(client, q=html, format="html", glossary=glossary).status_code == 200
    assert [job.constraints for job in jobs] == [target_ids(model_dir, "garden"), target_ids(model_dir, "3")]


def test_the_served_document_states_the_glossary_limits(client: TestClient) -> None:
    body = client.get("/openapi.json").json()["paths"]["/translate"]["post"]["requestBody"]["content"]
    [listed] = [
        kind
        for kind in body["application/json"]["schema"]["properties"]["glossary"]["anyOf"]
        if kind["type"] == "array"
    ]
    assert listed["maxItems"] == 1000
    assert listed["items"]["properties"]["source"]["maxLength"] == 200
    assert "glossary" not in body["application/x-www-form-urlencoded"]["schema"]["properties"]  # JSON text
    assert "404" in client.get("/openapi.json").json()["paths"]["/translate"]["post"]["responses"]


def test_an_unknown_glossary_id_is_404(client: TestClient) -> None:
    assert_error(translate(client, q="Hund", glossary_id="nope"), 404, "unknown glossary")


class FakeStore:
    """What /translate asks of the glossary store (``app.state.services.glossaries``)."""

    def __init__(self, **glossaries: Any) -> None:
        self.glossaries = glossaries
        self.asked: list[tuple[str, str]] = []

    def get(self, owner: str, glossary_id: str) -> Any:
        self.asked.append((owner, glossary_id))
        return self.glossaries.get(glossary_id)

    def close(self) -> None:
        """(The app closes its stores at shutdown.)"""


class Stored:
    def __init__(self, source_lang: str, target_lang: str, *entries: tuple[str, str]) -> None:
        self.source_lang, self.target_lang = source_lang, target_lang
        self.entries = tuple(GlossaryEntry(s, t) for s, t in entries)


def test_a_stored_glossary_is_used_by_id(
    client: TestClient, jobs: list[Sentence], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FakeStore(g1=Stored("de", "en", ("Park", "garden")), g2=Stored("de", "fr", ("Park", "jardin")))
    state = client.app.state.services  # type: ignore[attr-defined]
    real, state.glossaries = state.glossaries, store  # the app closes its own store at shutdown
    inline = [{"source": "Park", "target": "lawn"}]
    try:
        assert translate(client, q="Im Park.", glossary_id="g1").status_code == 200
        assert jobs[-1].constraints == target_ids(model_dir, "garden")
        assert translate(client, q="Im Park.", glossary_id="g1", glossary=inline).status_code == 200
        assert jobs[-1].constraints == target_ids(model_dir, "lawn")  # an inline entry wins
        assert store.asked[0] == ("", "g1")  # no keys: the owner is ""
        assert_error(translate(client, q="Im Park.", glossary_id="g2"), 400, "target fr")
        assert_error(translate(client, q="Im Park.", glossary_id="g3"), 404, "unknown glossary")
    finally:
        state.glossaries = real


def test_a_stored_glossary_is_the_api_keys_own(model_dir: Path) -> None:
    store = FakeStore(g1=Stored("de", "en", ("Park", "garden")))
    with serve(make_settings(model_dir, api_keys="k1,k2", warmup=False)) as keyed:
        keyed.app.state.services.glossaries = store  # type: ignore[attr-defined]
        body = {"q": "Im Park.", "source": "de", "target": "en", "glossary_id": "g1", "api_key": "k2"}
        assert keyed.post("/translate", json=body).status_code == 200
    assert store.asked == [(owner_name("k2"), "g1")]  # a key of NMT_API_KEYS is named by its digest


# -- end to end: needs the constrained search (model.decoding) ---------------------------------------


def assert_terms(answer: dict[str, Any], *targets: str) -> None:
    """Every target is in the translation, and ``terminology`` marks each where it is."""
    text = answer["translatedText"]
    for target in targets:
        assert target in text, answer
    marks = answer["terminology"]["terms"]
    assert sorted(m["target"] for m in marks) == sorted(targets), answer
    for mark in marks:
        assert text[mark["start"] : mark["end"]] == mark["target"], answer
    assert answer["terminology"]["memory"] is False


def test_a_glossary_terms_target_appears_in_the_translation(client: TestClient) -> None:
    glossary = [{"source": "Park", "target": "garden"}]
    answer = translate(client, q="Ein Mann spielt im Park.", glossary=glossary)
    assert answer.status_code == 200
    assert_terms(answer.json(), "garden")


def test_a_do_not_translate_entry_is_kept_verbatim(client: TestClient) -> None:
    answer = translate(client, q="Der Hund läuft.", glossary=[{"source": "Hund", "target": "Hund"}])
    assert_terms(answer.json(), "Hund")


def test_placeholders_come_back_verbatim(client: TestClient) -> None:
    text = "Hallo {name}, %1$s schreibt an info@example.com über https://example.com/x um 3.14 Uhr."
    answer = translate(client, q=text).json()
    assert_terms(answer, "{name}", "%1$s", "info@example.com", "https://example.com/x", "3.14")


def test_terms_in_html_are_marked_in_the_markup(client: TestClient) -> None:
    glossary = [{"source": "Park", "target": "AT&T"}]
    answer = translate(client, q="<p>Ein <b>Mann</b> im Park.</p>", format="html", glossary=glossary).json()
    [mark] = answer["terminology"]["terms"]
    assert answer["translatedText"][mark["start"] : mark["end"]] == "AT&amp;T"


def test_terms_of_a_list_are_marked_per_text(client: TestClient) -> None:
    answer = translate(client, q=["Eine Katze.", "Zwei Hunde.  Um 12:30 im Park."]).json()
    assert answer["terminology"][0] is None
    text = answer["translatedText"][1]
    [mark] = answer["terminology"][1]["terms"]
    assert text[mark["start"] : mark["end"]] == "12:30"
