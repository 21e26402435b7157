"""Models opened off the decode loop (``app.serving.worker.loader``): while one model loads on the
worker's loader thread, the models it holds keep stepping and answer as alone; a model a sentence
waits for goes before those loaded ahead of need, and does not wait for one under way (loads ahead
of need run at a lower priority); a load that fails fails that model's sentences only; the worker
waits for a load without spinning; and the wait is recorded."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import synthetic_sentences
from test_many_models import alone, de_en, en_de, job, two_dirs  # noqa: F401 - fixtures

from app.monitoring.metrics import Metrics, process_metrics
from app.serving.protocol import ModelSpec, Sentence, SentenceResult
from app.serving.worker import models as models_module
from app.serving.worker.executor import Executor
from app.serving.worker.inbox import Inbox
from app.serving.worker.loader import BACKGROUND_NICE, Loader
from app.serving.worker.models import ModelTable
from model.translator import Translator

WAIT_S = 60.0  # a bound for a load of the tiny model on a loaded machine, not a timing


class Gated:
    """An opener that opens a model only once its gate is open, and records the order of loads."""

    def __init__(self, translators: dict[str, Translator], failing: str = "") -> None:
        self.translators = translators
        self.failing = failing
        self.opened: list[str] = []
        self.gates = {name: threading.Event() for name in translators}
        self.started = {name: threading.Event() for name in translators}

    def __call__(self, spec: ModelSpec) -> Translator:
        self.started[spec.name].set()
        assert self.gates[spec.name].wait(WAIT_S), f"{spec.name}'s gate never opened"
        self.opened.append(spec.name)
        if spec.name == self.failing:
            raise OSError("model.safetensors: not weights")
        return self.translators[spec.name]


def loading(opener: Gated, inbox: Inbox, metrics: Metrics | None = None) -> Executor:
    """An executor whose table opens models on a loader, as a worker's does."""
    return loading_with(opener, list(opener.translators), inbox, metrics)


def loading_with(
    opener: Callable[[ModelSpec], Translator], names: list[str], inbox: Inbox, metrics: Metrics | None = None
) -> Executor:
    specs = [ModelSpec(name, Path("nowhere")) for name in names]
    table = ModelTable(specs, opener, metrics=metrics, loader=Loader(opener, inbox.wake))
    return Executor(table, inbox)


Results = dict[int, SentenceResult | BaseException]


def run_until(executor: Executor, inbox: Inbox, done: Callable[[Results], bool]) -> Results:
    """Iterate as the worker's loop does (``wait_until`` while nothing can run) until ``done``."""
    results: Results = {}
    deadline = time.monotonic() + WAIT_S
    with torch.inference_mode():
        while not done(results):
            assert time.monotonic() < deadline, "the executor does not finish"
            waited = threading.Thread(target=inbox.wait_until, args=(executor.runnable,), daemon=True)
            waited.start()
            waited.join(WAIT_S)
            assert not waited.is_alive(), "the worker would wait for ever"
            for sentence, result in executor.iteration():
                inbox.release(sentence)
                results[sentence.id] = result
    return results


def finished(*sentences: Sentence) -> Callable[[Results], bool]:
    return lambda results: all(s.id in results for s in sentences)


def test_held_models_keep_stepping_and_answer_as_alone_while_another_loads(
    de_en: Translator,  # noqa: F811
    en_de: Translator,  # noqa: F811
) -> None:
    opener = Gated({"de-en": de_en, "en-de": en_de})
    inbox = Inbox()
    executor = loading(opener, inbox)
    opener.gates["de-en"].set()
    executor.models.load("de-en")  # held; en-de is not
    texts = synthetic_sentences(6, seed=3)
    mine = [job(de_en, "de-en", t, beam_size=2) for t in texts]
    other = job(en_de, "en-de", "A dog runs.")
    inbox.add([other, *mine])
    results = run_until(executor, inbox, finished(*mine))  # en-de's gate is still shut
    assert opener.started["en-de"].is_set() and other.id not in results
    for sentence, text in zip(mine, texts, strict=True):
        result = results[sentence.id]
        assert isinstance(result, SentenceResult)
        assert result.hypotheses[0].tokens == alone(de_en, text, 2)
    opener.gates["en-de"].set()
    result = run_until(executor, inbox, finished(other))[other.id]
    assert isinstance(result, SentenceResult)
    assert result.hypotheses[0].tokens == alone(en_de, "A dog runs.", 1)
    assert opener.opened == ["de-en", "en-de"]


def test_the_worker_does_not_spin_while_its_only_work_waits_for_a_load(
    de_en: Translator,  # noqa: F811
) -> None:
    opener = Gated({"de-en": de_en})
    inbox = Inbox()
    executor = loading(opener, inbox)
    sentence = job(de_en, "de-en", "Ein Hund.")
    inbox.add([sentence])
    with torch.inference_mode():
        assert executor.iteration() == []  # the load begins
    assert opener.started["de-en"].wait(WAIT_S)
    assert not executor.runnable()  # nothing to step: the loop would block in wait_until
    woken = threading.Event()
    waiter = threading.Thread(target=lambda: inbox.wait_until(executor.runnable) and woken.set(), daemon=True)
    waiter.start()
    assert not woken.wait(0.2)  # still loading: asleep
    opener.gates["de-en"].set()  # the loader finishes and wakes the inbox
    assert woken.wait(WAIT_S)
    results = run_until(executor, inbox, finished(sentence))
    assert isinstance(results[sentence.id], SentenceResult)


def test_a_model_a_sentence_waits_for_loads_before_those_loaded_ahead_of_need(
    de_en: Translator,  # noqa: F811
) -> None:
    opener = Gated({name: de_en for name in ("a", "b", "c", "d")})
    inbox = Inbox()
    executor = loading(opener, inbox)
    opener.gates["a"].set()
    held = executor.models.load_at_start()  # a now; b, c, d queued behind any need
    assert [m.name for m in held] == ["a"]
    assert opener.started["b"].wait(WAIT_S)  # b is being opened, c and d wait
    wanted = job(de_en, "d", "Ein Hund.")
    inbox.add([wanted])
    with torch.inference_mode():
        assert executor.iteration() == []  # d's load is asked for, while b's is under way
    assert opener.started["d"].wait(WAIT_S)  # at once, beside b's
    assert not opener.started["c"].is_set()
    for name in "bcd":
        opener.gates[name].set()
    run_until(executor, inbox, finished(wanted))
    assert "c" not in opener.opened[: opener.opened.index("d")]  # d before c: a sentence waited for it


def test_a_failed_load_fails_that_models_sentences_and_the_others_go_on(
    de_en: Translator,  # noqa: F811
) -> None:
    opener = Gated({"good": de_en, "broken": de_en}, failing="broken")
    inbox = Inbox()
    executor = loading(opener, inbox)
    for gate in opener.gates.values():
        gate.set()
    bad, good = job(de_en, "broken", "Ein Hund."), job(de_en, "good", "Ein Hund.")
    inbox.add([bad, good])
    results = run_until(executor, inbox, finished(bad, good))
    assert isinstance(results[bad.id], RuntimeError) and "not weights" in str(results[bad.id])
    assert isinstance(results[good.id], SentenceResult)
    assert "broken" not in executor.models.loaded


def test_the_wait_for_a_load_is_recorded_per_model(de_en: Translator) -> None:  # noqa: F811
    metrics = process_metrics()
    opener = Gated({"waited-for": de_en})
    inbox = Inbox()
    executor = loading(opener, inbox, metrics)
    sentence = job(de_en, "waited-for", "Ein Hund.")
    inbox.add([sentence])
    with torch.inference_mode():
        executor.iteration()
    time.sleep(0.05)  # at least this long waited
    opener.gates["waited-for"].set()
    run_until(executor, inbox, finished(sentence))
    text = metrics.collect().decode()
    count = next(
        line
        for line in text.splitlines()
        if line.startswith("nmt_model_load_wait_seconds_count{") and 'model="waited-for"' in line
    )
    assert float(count.rsplit(" ", 1)[1]) == 1.0
    total = next(
        line
        for line in text.splitlines()
        if line.startswith("nmt_model_load_wait_seconds_sum{") and 'model="waited-for"' in line
    )
    assert float(total.rsplit(" ", 1)[1]) >= 0.05


def test_a_failed_load_is_not_tried_again_at_once(de_en: Translator, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    calls: list[str] = []

    def opener(spec: ModelSpec) -> Translator:
        calls.append(spec.name)
        raise OSError("model.safetensors: not weights")

    table = ModelTable([ModelSpec("broken", Path("x"))], opener)
    for _ in range(3):
        with pytest.raises(OSError, match="not weights"):
            table.load("broken")
    assert calls == ["broken"]  # the reason given again, the file not read again
    monkeypatch.setattr(models_module, "FAILED_RETRY_S", 0.0)
    with pytest.raises(OSError):
        table.load("broken")
    assert calls == ["broken", "broken"]  # past the delay it is tried again


def test_loads_ahead_of_need_wait_while_the_worker_is_busy_and_a_wanted_one_does_not(
    de_en: Translator,  # noqa: F811
) -> None:
    opener = Gated({name: de_en for name in ("a", "b", "c")})
    for gate in opener.gates.values():
        gate.set()
    busy = threading.Event()
    busy.set()
    done: list[str] = []
    loader = Loader(opener, lambda: None)
    loader.idle = lambda: not busy.is_set()
    loader.want(ModelSpec("a", Path("x")), urgent=False)
    assert not opener.started["a"].wait(0.3)  # busy: the load ahead of need waits
    loader.want(ModelSpec("b", Path("x")), urgent=True)
    assert opener.started["b"].wait(WAIT_S)  # a sentence waits for b: at once
    deadline = time.monotonic() + WAIT_S
    while "b" not in done:
        assert time.monotonic() < deadline
        done += [o.name for o in loader.done()]
        time.sleep(0.01)
    assert not opener.started["a"].is_set()
    busy.clear()  # idle now: a loads
    assert opener.started["a"].wait(WAIT_S)
    loader.close()


def test_a_sentence_for_a_model_queued_ahead_of_need_is_answered_while_the_worker_is_busy(
    de_en: Translator,  # noqa: F811
) -> None:
    """The background load waits for an idle worker; the sentence that wants the model must not
    wait for it (the worker is not idle while the sentence waits)."""
    opener = Gated({"a": de_en, "b": de_en})
    for gate in opener.gates.values():
        gate.set()
    inbox = Inbox()
    executor = loading(opener, inbox)
    assert executor.models.loader is not None
    executor.models.loader.idle = lambda: False  # busy for good: b would never load ahead of need
    executor.models.load_at_start()  # a now, b queued
    wanted = job(de_en, "b", "Ein Hund.")
    inbox.add([wanted])
    results = run_until(executor, inbox, finished(wanted))
    assert isinstance(results[wanted.id], SentenceResult)


class Recording:
    """An opener that waits for its gate per load, and records each load's thread priority."""

    def __init__(self, translator: Translator) -> None:
        self.translator = translator
        self.gate = threading.Event()
        self.started: list[str] = []
        self.nice: dict[str, list[int]] = {}
        self.lock = threading.Lock()

    def __call__(self, spec: ModelSpec) -> Translator:
        with self.lock:
            self.started.append(spec.name)
            nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            self.nice.setdefault(spec.name, []).append(nice)
        assert self.gate.wait(WAIT_S), "the gate never opened"
        return self.translator

    def wait_started(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while len(self.started) < count:
            assert time.monotonic() < deadline, self.started
            time.sleep(0.01)


def collected(loader: Loader, names: int) -> list[str]:
    done: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while len(done) < names:
        assert time.monotonic() < deadline, done
        done += [o.name for o in loader.done()]
        time.sleep(0.01)
    return done


def ahead_then_wanted(opener: Recording, ahead: str, wanted: str) -> Loader:
    """A loader opening ``ahead`` ahead of need (its gate shut), then asked for ``wanted``: returned
    once both loads have begun (the second at once, beside the first)."""
    loader = Loader(opener, lambda: None)
    loader.want(ModelSpec(ahead, Path("x")), urgent=False)
    opener.wait_started(1)
    loader.want(ModelSpec(wanted, Path("x")), urgent=True)  # a sentence waits for it
    opener.wait_started(2)
    return loader


def test_a_wanted_model_is_opened_while_a_load_ahead_of_need_is_under_way_and_at_a_higher_priority(
    de_en: Translator,  # noqa: F811
) -> None:
    opener = Recording(de_en)
    loader = ahead_then_wanted(opener, "ahead", "wanted")
    assert opener.started == ["ahead", "wanted"]  # the gate is still shut: "ahead" not finished
    opener.gate.set()
    assert sorted(collected(loader, 2)) == ["ahead", "wanted"]
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert opener.nice == {"ahead": [min(own + BACKGROUND_NICE, 19)], "wanted": [own]}
    loader.close()


def test_a_model_wanted_while_it_loads_ahead_of_need_is_opened_again_at_once_and_delivered_once(
    de_en: Translator,  # noqa: F811
) -> None:
    opener = Recording(de_en)
    loader = ahead_then_wanted(opener, "m", "m")  # the urgent thread opens it too
    assert loader.loading("m") and loader.pending == ["m"]
    opener.gate.set()
    assert collected(loader, 1) == ["m"]
    deadline = time.monotonic() + WAIT_S
    while loader.loading("m"):  # both loads over
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert loader.done() == []  # the second copy was dropped
    loader.close()


def test_a_model_the_front_end_asks_for_is_loaded_at_once_and_no_wait_is_recorded(
    de_en: Translator,  # noqa: F811
) -> None:
    """``protocol.Load``: the worker loads the model before any of its sentences come (the front
    end spreads a hot model so), at the worker's priority though it is busy, and records no wait."""
    metrics = process_metrics()
    opener = Recording(de_en)
    opener.gate.set()
    inbox = Inbox()
    executor = loading_with(opener, ["held", "asked"], inbox, metrics)
    assert executor.models.loader is not None
    executor.models.loader.idle = lambda: False  # busy: nothing would load ahead of need
    waits = metrics.sample("nmt_model_load_wait_seconds_count", {"model": "asked"})
    inbox.load("asked")
    assert executor.runnable()  # the worker wakes for it
    deadline = time.monotonic() + WAIT_S
    with torch.inference_mode():
        while "asked" not in executor.models.loaded:
            assert time.monotonic() < deadline, opener.started
            executor.iteration()
            time.sleep(0.01)
    assert opener.started == ["asked"]
    assert opener.nice["asked"] == [os.getpriority(os.PRIO_PROCESS, 0)]  # not niced
    assert metrics.sample("nmt_model_load_wait_seconds_count", {"model": "asked"}) == waits


def test_a_load_is_announced_as_it_begins_and_active_until_it_ends(
    de_en: Translator,  # noqa: F811
) -> None:
    """The worker marks its core taken when a load begins (``on_start``) and keeps it marked while
    one is ``active``: a neighbour alone at work must not run a thread on it meanwhile."""
    opener = Recording(de_en)
    loader = Loader(opener, lambda: None)
    begun: list[bool] = []
    loader.on_start = lambda: begun.append(loader.active)
    assert not loader.active
    loader.want(ModelSpec("m", Path("x")), urgent=False)
    opener.wait_started(1)
    assert begun == [True] and loader.active
    opener.gate.set()
    assert collected(loader, 1) == ["m"]
    assert not loader.active
    loader.close()
