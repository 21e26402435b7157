"""Many models on one set of workers: a worker's executor runs a batch per model, stepping them in
turn, with answers token for token each model's ``Translator`` alone; models load on demand and the
least recently used idle one is evicted under a memory budget; and behind the app, workers shared
by two models answer both pairs, lazily loaded and evicted under ``NMT_WORKER_MODEL_MEMORY_MB``."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import random_model, synthetic_sentences
from fastapi.testclient import TestClient
from test_api import make_settings, serve

from app.monitoring.metrics import process_metrics
from app.serving.protocol import ModelSpec, Sentence
from app.serving.worker.executor import Executor
from app.serving.worker.inbox import Inbox
from app.serving.worker.models import ModelTable, weight_bytes
from model.checkpoint import ModelInfo, save_model_dir
from model.tokenizer import Tokenizer
from model.translator import Translator

_ids = itertools.count(1000)


def make_model_dir(
    root: Path,
    name: str,
    source: str,
    target: str,
    tokenizer: Tokenizer,
    spm: Path,
    *,
    seed: int,
    **sizes: object,
) -> Path:
    model = random_model(seed=seed, sharpen=2.0, eos_boost=1.5, vocab_size=tokenizer.vocab_size, **sizes)
    info = ModelInfo(config=model.cfg, source_lang=source, target_lang=target, training={"note": "random"})
    return save_model_dir(root / name, model, info, spm)


@pytest.fixture(scope="module")
def two_dirs(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, spm_model: Path, tokenizer: Tokenizer
) -> Path:
    """A directory of two tiny models: the shared tiny de-en, and an en-de of other weights."""
    root = tmp_path_factory.mktemp("two-models")
    shutil.copytree(model_dir, root / "tiny-de-en")
    make_model_dir(root, "tiny-en-de", "en", "de", tokenizer, spm_model, seed=5)
    return root


def job(translator: Translator, model: str, text: str, beam_size: int = 1) -> Sentence:
    src = translator.source_ids([text])[0]
    return Sentence(next(_ids), 0, src, beam_size, 1, None, time.monotonic(), model)


def drive(executor: Executor, inbox: Inbox) -> tuple[dict[int, list[list[int]]], list[int]]:
    """Iterate until nothing runs or waits, then as the worker does when idle (``drop_empty``): each
    job's n-best tokens, and the iteration each finished at."""
    finished: dict[int, list[list[int]]] = {}
    order: list[int] = []
    with torch.inference_mode():
        for i in itertools.count():
            if not (inbox.waiting or executor.busy):
                executor.drop_empty()
                return finished, order
            assert i < 5000, "the executor does not finish"
            for done, result in executor.iteration():
                assert inbox.release(done)
                assert not isinstance(result, BaseException), result
                finished[done.id] = [h.tokens for h in result.hypotheses]
                order.append(done.id)
    raise AssertionError("unreachable")


def alone(translator: Translator, text: str, beam_size: int) -> list[int]:
    return translator.translate_batch([text], beam_size=beam_size)[0].tokens[0]


def table(translators: dict[str, Translator], budget: int = 0) -> tuple[ModelTable, list[str]]:
    """A table of these translators, loaded on demand; and the names in the order they were loaded."""
    loads: list[str] = []

    def opener(spec: ModelSpec) -> Translator:
        loads.append(spec.name)
        return translators[spec.name]

    specs = [ModelSpec(name, Path("nowhere")) for name in translators]
    return ModelTable(specs, opener, budget_bytes=budget, metrics=process_metrics()), loads


@pytest.fixture(scope="module")
def de_en(two_dirs: Path) -> Translator:
    return Translator.load(two_dirs / "tiny-de-en", device="cpu")


@pytest.fixture(scope="module")
def en_de(two_dirs: Path) -> Translator:
    return Translator.load(two_dirs / "tiny-en-de", device="cpu")


# -- the executor ----------------------------------------------------------------------------------------
def test_one_executor_answers_two_models_as_each_alone(de_en: Translator, en_de: Translator) -> None:
    models, loads = table({"de-en": de_en, "en-de": en_de})
    inbox = Inbox()
    executor = Executor(models, inbox, max_batch_size=16)
    texts = synthetic_sentences(24, seed=11)
    jobs = [
        (job(de_en if i % 2 else en_de, "de-en" if i % 2 else "en-de", t, 1 + i % 3), t)
        for i, t in enumerate(texts)
    ]
    inbox.add([j for j, _ in jobs])
    finished, _ = drive(executor, inbox)
    for j, text in jobs:
        translator = de_en if j.model == "de-en" else en_de
        assert finished[j.id][0] == alone(translator, text, j.beam_size), (j.model, text)
    assert sorted(loads) == ["de-en", "en-de"]  # each loaded once, on demand
    assert executor.lanes == {}  # idle: no batch, no cache held


def test_models_step_in_turn_so_a_short_sentence_of_one_is_not_held_behind_anothers_long_batch(
    de_en: Translator, en_de: Translator
) -> None:
    """Model a has a long batch running (outputs of 3 x the source length); a one-word sentence for
    model b, arriving meanwhile, steps every other iteration and finishes long before a's batch."""
    from model.decoding.options import DecodeOptions

    longer = Translator(
        de_en.model, de_en.tokenizer, de_en.info, de_en.device, options=DecodeOptions(max_length_a=3.0)
    )
    models, _ = table({"a": longer, "b": en_de})
    inbox = Inbox()
    executor = Executor(models, inbox)
    long_jobs = [job(longer, "a", t, 2) for t in synthetic_sentences(8, seed=2)]
    inbox.add(long_jobs)
    stepped: list[str] = []
    with torch.inference_mode():
        for _ in range(4):
            executor.iteration()
        short = job(en_de, "b", "a dog")
        inbox.add([short])
        done_at = None
        for i in itertools.count():
            turn = executor._turns[0]
            outcomes = executor.iteration()
            stepped.append(turn)
            if any(j.id == short.id for j, _ in outcomes):
                done_at = i
                break
            assert i < 500
        assert executor.busy  # a's batch still runs
    assert done_at is not None and done_at < 2 * (longer.options.max_length_b + 10)
    assert set(stepped[:4]) == {"a", "b"}  # the two models took turns


def test_lru_eviction_under_a_tiny_budget_loads_evicts_and_answers_correctly(
    de_en: Translator, en_de: Translator
) -> None:
    size = max(weight_bytes(de_en.model), weight_bytes(en_de.model))
    models, loads = table({"de-en": de_en, "en-de": en_de}, budget=size + size // 2)  # room for one
    metrics = process_metrics()
    evictions = metrics.sample("nmt_model_evictions_total", {"model": "de-en"})
    inbox = Inbox()
    executor = Executor(models, inbox)
    texts = synthetic_sentences(6, seed=12)
    for model, translator in [("de-en", de_en), ("en-de", en_de), ("de-en", de_en)]:
        jobs = [job(translator, model, t, 2) for t in texts]
        inbox.add(jobs)
        finished, _ = drive(executor, inbox)
        assert [finished[j.id][0] for j in jobs] == [alone(translator, t, 2) for t in texts]
        assert list(models.loaded) == [model]  # the other one was evicted to make room
    assert loads == ["de-en", "en-de", "de-en"]
    assert metrics.sample("nmt_model_evictions_total", {"model": "de-en"}) == evictions + 1
    assert metrics.sample("nmt_model_loads_total", {"model": "de-en"}) >= 2


def test_a_busy_model_is_not_evicted_the_newcomer_loads_over_the_budget_until_it_is_idle(
    de_en: Translator, en_de: Translator
) -> None:
    size = max(weight_bytes(de_en.model), weight_bytes(en_de.model))
    models, _ = table({"de-en": de_en, "en-de": en_de}, budget=size + size // 2)
    inbox = Inbox()
    executor = Executor(models, inbox)
    texts = synthetic_sentences(8, seed=13)
    a = [job(de_en, "de-en", t, 2) for t in texts]
    b = [job(en_de, "en-de", t, 2) for t in texts[:2]]
    inbox.add(a)
    with torch.inference_mode():
        executor.iteration()  # de-en loads and runs
        inbox.add(b)
        executor.iteration()  # en-de's turn: de-en is busy, so both are held
        assert set(models.loaded) == {"de-en", "en-de"}
    finished, _ = drive(executor, inbox)
    assert len(models.loaded) == 1  # trimmed back to the budget once idle
    assert [finished[j.id][0] for j in a] == [alone(de_en, t, 2) for t in texts]
    assert [finished[j.id][0] for j in b] == [alone(en_de, t, 2) for t in texts[:2]]


def test_a_model_that_cannot_load_fails_its_sentences_and_only_those(de_en: Translator) -> None:
    def opener(spec: ModelSpec) -> Translator:
        if spec.name == "broken":
            raise OSError("model.safetensors: not weights")
        return de_en

    specs = [ModelSpec("good", Path("x")), ModelSpec("broken", Path("y"))]
    inbox = Inbox()
    executor = Executor(ModelTable(specs, opener), inbox)
    bad, good = job(de_en, "broken", "Ein Hund."), job(de_en, "good", "Ein Hund.")
    inbox.add([bad, good])
    outcomes = []
    with torch.inference_mode():
        while inbox.waiting or executor.busy:
            outcomes += executor.iteration()
    results = {j.id: r for j, r in outcomes}
    assert isinstance(results[bad.id], RuntimeError) and "not weights" in str(results[bad.id])
    assert not isinstance(results[good.id], BaseException)


# -- behind the app -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bigger_dirs(tmp_path_factory: pytest.TempPathFactory, spm_model: Path, tokenizer: Tokenizer) -> Path:
    """Two models of ~14 MB of weights each (as loaded: the linear layers packed, no float copy
    kept), de-en and en-de: a 20 MB budget holds one of them."""
    root = tmp_path_factory.mktemp("bigger")
    sizes = {"d_model": 256, "d_ff": 1024, "n_heads": 4}
    make_model_dir(root, "mid-de-en", "de", "en", tokenizer, spm_model, seed=7, **sizes)
    make_model_dir(root, "mid-en-de", "en", "de", tokenizer, spm_model, seed=8, **sizes)
    return root


@pytest.fixture(scope="module")
def shared_workers(two_dirs: Path) -> Iterator[TestClient]:
    with serve(make_settings(two_dirs, replicas=2, threads=1)) as client:
        yield client


def test_two_workers_serve_both_models_as_each_alone(
    shared_workers: TestClient, de_en: Translator, en_de: Translator
) -> None:
    scheduler = shared_workers.app.state.services.scheduler  # type: ignore[attr-defined]
    assert len(scheduler.workers) == 2 and list(scheduler.models) == ["tiny-de-en", "tiny-en-de"]
    texts = synthetic_sentences(12, seed=14)
    for source, target, translator in [("de", "en", de_en), ("en", "de", en_de)]:
        answer = shared_workers.post("/translate", json={"q": texts, "source": source, "target": target})
        assert answer.status_code == 200, answer.text
        expected = [r.hypotheses[0] for r in translator.translate_batch(texts, beam_size=5)]
        assert answer.json()["translatedText"] == expected
    info = shared_workers.get("/info").json()
    assert [m["loaded"] for m in info["models"]] == ["at start", "at start"]
    assert all(m["workers"] == 2 for m in info["models"])
    assert [m["held_by"] for m in info["models"]] == [1, 1]  # each model is one worker's own


def test_models_beyond_the_budget_load_on_demand_and_the_idle_one_is_evicted(bigger_dirs: Path) -> None:
    settings = make_settings(bigger_dirs, replicas=1, threads=1, worker_model_memory_mb=20, warmup=False)
    de_en = Translator.load(bigger_dirs / "mid-de-en", device="cpu")
    en_de = Translator.load(bigger_dirs / "mid-en-de", device="cpu")
    assert 10 << 20 < weight_bytes(de_en.model) < 20 << 20  # one fits, two do not
    with serve(settings) as client:
        info = client.get("/info").json()
        assert [m["loaded"] for m in info["models"]] == ["at start", "on first request"]
        assert info["batching"]["worker_model_memory_mb"] == 20
        metrics = client.app.state.services.metrics  # type: ignore[attr-defined]
        evicted = metrics.sample("nmt_model_evictions_total", {"model": "mid-de-en"})
        texts = synthetic_sentences(4, seed=15)
        for source, target, translator in [("en", "de", en_de), ("de", "en", de_en), ("en", "de", en_de)]:
            client.app.state.services.segment_cache.clear()  # type: ignore[attr-defined]  # (the model decodes)
            answer = client.post("/translate", json={"q": texts, "source": source, "target": target})
            assert answer.status_code == 200, answer.text
            expected = [r.hypotheses[0] for r in translator.translate_batch(texts, beam_size=5)]
            assert answer.json()["translatedText"] == expected
        assert metrics.sample("nmt_model_evictions_total", {"model": "mid-de-en"}) == evicted + 2  # twice
        assert metrics.sample("nmt_model_loads_total", {"model": "mid-en-de"}) >= 2
        [state] = client.app.state.services.scheduler.workers  # type: ignore[attr-defined]
        assert state.loaded == frozenset({"mid-en-de"})  # as the worker told the front end


@pytest.fixture(scope="module")
def one_corrupt(tmp_path_factory: pytest.TempPathFactory, two_dirs: Path) -> Path:
    """The two tiny models, en-de's weights file overwritten with bytes that are not weights."""
    root = tmp_path_factory.mktemp("one-corrupt")
    shutil.copytree(two_dirs, root, dirs_exist_ok=True)
    (root / "tiny-en-de" / "model.safetensors").write_bytes(b"\x00" * 4096)
    return root


def test_a_model_that_does_not_load_answers_503_and_the_others_keep_serving(
    one_corrupt: Path, de_en: Translator
) -> None:
    # Two workers: en-de is the second one's own, which loads de-en instead to start.
    with serve(make_settings(one_corrupt, replicas=2, threads=1)) as client:
        for _ in range(2):  # the second fails from the worker's memory of the first failure
            broken = client.post("/translate", json={"q": "A dog.", "source": "en", "target": "de"})
            assert broken.status_code == 503 and "cannot load model tiny-en-de" in broken.json()["error"]
            texts = synthetic_sentences(4, seed=16)
            good = client.post("/translate", json={"q": texts, "source": "de", "target": "en"})
            assert good.status_code == 200, good.text
            expected = [r.hypotheses[0] for r in de_en.translate_batch(texts, beam_size=5)]
            assert good.json()["translatedText"] == expected
