"""A worker's running batch, with the tiny real model: shared batches give the same answers as
translating alone, continuous batching lets short sentences overtake long ones, newcomers join in
groups, cancelled and expired sentences leave, and a failed step fails only the running batch. The
executor is driven by hand, one ``iteration()`` at a time, from an ``Inbox``; and the inbox itself."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SENTENCES, compile_cache_dir, needs_cpu_package, synthetic_sentences

from app.monitoring.metrics import Metrics, process_metrics
from app.serving.protocol import Sentence, SentenceResult
from app.serving.worker.executor import BACKGROUND_EVERY, JOIN_RATIO, JOIN_WAIT_STEPS, KEEP_EMPTY_S, Executor
from app.serving.worker.held import HeldSentence
from app.serving.worker.inbox import Inbox
from app.serving.worker.models import ModelTable
from model.cache import KVCache
from model.checkpoint import load_model, load_tokenizer, read_info
from model.decoding.options import DecodeOptions
from model.translator import Translator

LONG = [
    "Zwei kleinen Kinder sitzen auf dem roten Ball vor einem großen Gebäude im Park mit Hut und Hund.",
    "Der Hund läuft im Wasser und schaut auf die Straße vor dem großen blauen Gebäude im Park.",
]
SHORT = "Ein Mann."

_ids = itertools.count()
Finished = dict[int, tuple[int, SentenceResult | BaseException]]  # job id -> (iteration, outcome)


@pytest.fixture(scope="module")
def endless(model_dir: Path) -> Translator:
    """The tiny model, changed so that eos is never the best token: every output runs to its length
    limit (a*source_length + b), so long sources take many steps and short ones few."""
    info = read_info(model_dir)
    model = load_model(model_dir, info)
    with torch.no_grad():
        assert model.decoder_norm is not None and model.out_proj is not None
        model.decoder_norm.weight[0] = 0.0  # feature 0 of the final LayerNorm is the constant 1...
        model.decoder_norm.bias[0] = 1.0
        model.out_proj.weight[model.cfg.eos_id] = 0.0
        model.out_proj.weight[model.cfg.eos_id, 0] = -100.0  # ...so eos's logit is always -100
    return Translator(model, load_tokenizer(model_dir), info, torch.device("cpu"))


_COMPILED: dict[int, tuple[Translator, Translator]] = {}
_KEEP: list[Translator] = []  # translators made by tests, alive so that their ids stay their own


def compiled_twin(translator: Translator) -> Translator:
    """``translator``'s model with the compiled step (one package per model for the whole run:
    tests/test_runners.py compiles the same capacity and candidates)."""
    needs_cpu_package()
    if id(translator) not in _COMPILED:
        twin = Translator(
            translator.model,
            translator.tokenizer,
            translator.info,
            translator.device,
            options=translator.options,
            capacity=64,
            max_beam_size=8,
            compile=True,
            cache_dir=compile_cache_dir(),
        )
        assert twin.runner.kind == "compiled"
        _COMPILED[id(translator)] = (translator, twin)  # the original kept alive: its id stays its own
    return _COMPILED[id(translator)][1]


@pytest.fixture(params=["eager", "compiled"])
def make_executor(request: pytest.FixtureRequest) -> Callable[..., Executor]:
    """``Executor(translator, inbox, **options)`` with the translator's eager step, or with the same
    model's compiled step."""

    def make(translator: Translator, inbox: Inbox, **options: Any) -> Executor:
        if request.param == "compiled":
            translator = compiled_twin(translator)
        return Executor(ModelTable.single(translator, MODEL), inbox, **options)

    return make


def job(
    translator: Translator, text: str, beam_size: int = 1, n_best: int = 1, deadline: float | None = None
) -> Sentence:
    src = translator.source_ids([text])[0]
    return Sentence(next(_ids), 0, src, beam_size, n_best, deadline, time.monotonic(), MODEL)


def drive(
    executor: Executor, inbox: Inbox, arrivals: dict[int, list[Sentence]] | None = None, *, start: int = 0
) -> Finished:
    """Iterate until nothing runs or waits; ``arrivals[i]`` join the inbox before iteration ``i``."""
    arrivals = dict(arrivals or {})
    finished: Finished = {}
    with torch.inference_mode():
        for i in itertools.count(start):
            if i in arrivals:
                inbox.add(arrivals.pop(i))
            if not (arrivals or inbox.waiting or executor.busy):
                return finished
            assert i < 5000, "the executor does not finish"
            for done, result in executor.iteration():
                assert inbox.release(done)  # somebody waits for every outcome
                finished[done.id] = (i, result)
    raise AssertionError("unreachable")


def ids(jobs: Sequence[HeldSentence]) -> list[int]:
    """The ids of these jobs: the inbox hands the executor its own wrappers of what it was given."""
    return [j.id for j in jobs]


def tokens(outcome: SentenceResult | BaseException) -> list[list[int]]:
    assert not isinstance(outcome, BaseException), outcome
    return [h.tokens for h in outcome.hypotheses]


def scores(outcome: SentenceResult | BaseException) -> list[float]:
    assert not isinstance(outcome, BaseException), outcome
    return [h.score for h in outcome.hypotheses]


MODEL = "m"  # the model of these executors' jobs: the label of what they record


def metrics() -> Metrics:
    return process_metrics()  # (each model's recorded with its label: MODEL's here)


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return process_metrics().sample(name, {"model": MODEL, **(labels or {})})


# -- the same answers as translating alone -----------------------------------------------------------
def test_jobs_joining_a_running_batch_get_what_they_get_alone(
    make_executor: Callable[..., Executor], translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = synthetic_sentences(40, seed=7)[::2]  # the German-looking ones
    beams = [1 if i % 3 else 3 for i in range(len(texts))]
    alone = [translator.translate_batch([t], beam_size=b)[0] for t, b in zip(texts, beams, strict=True)]
    moved: list[int] = []  # rows moved into the places of finished ones, per removal

    def counting(
        remove: Callable[[Any, list[int]], dict[int, int]],
    ) -> Callable[[Any, list[int]], dict[int, int]]:
        def counting_remove(slots: Any, leaving: list[int]) -> dict[int, int]:
            moves = remove(slots, leaving)
            moved.append(len(moves))
            return moves

        return counting_remove

    monkeypatch.setattr(KVCache, "remove", counting(KVCache.remove))
    joined_running: list[int] = []  # jobs that joined a batch already decoding
    inbox = Inbox()
    executor = make_executor(translator, inbox, max_batch_size=32, metrics=metrics())
    admit = executor._admit

    def recording_admit(jobs: list[Any], lane: Any) -> None:
        if executor.busy:
            joined_running.extend(j.id for j in jobs)
        admit(jobs, lane)

    monkeypatch.setattr(executor, "_admit", recording_admit)
    steps, rows = sample("nmt_batch_size_sequences_count"), sample("nmt_batch_size_sequences_sum")
    translated = sample("nmt_sentences_total", {"outcome": "translated"})
    jobs = [job(translator, t, b) for t, b in zip(texts, beams, strict=True)]
    finished = drive(executor, inbox, {2 * i: [j] for i, j in enumerate(jobs)})  # staggered arrivals

    for j, expected in zip(jobs, alone, strict=True):
        assert tokens(finished[j.id][1]) == expected.tokens[:1], j.id
        if j.beam_size > 1:  # (greedy jobs skip the log-softmax: their score is 0.0 by design)
            assert scores(finished[j.id][1]) == pytest.approx(expected.scores[:1], abs=1e-4)
    assert len(joined_running) >= len(jobs) // 2  # most joined a batch at a later step than others
    steps = sample("nmt_batch_size_sequences_count") - steps
    rows = sample("nmt_batch_size_sequences_sum") - rows
    assert steps > 0 and rows / steps > 2.0  # the model really ran shared batches
    assert sample("nmt_sentences_total", {"outcome": "translated"}) == translated + len(jobs)
    assert executor.running.rows == 0 and inbox.waiting == 0
    # Finished rows left while others ran on: rows from the end of the batch took their places,
    # beams included (jobs of 3 rows), without changing anyone's result.
    assert max(moved) > 0


def test_n_best_hypotheses_are_translate_batchs(
    make_executor: Callable[..., Executor], translator: Translator
) -> None:
    cases = [(SHORT, 3, 2), (LONG[0], 2, 2), (SENTENCES[3], 4, 4), (SENTENCES[2], 1, 1)]
    inbox = Inbox()
    executor = make_executor(translator, inbox)
    jobs = [job(translator, text, b, n) for text, b, n in cases]
    finished = drive(executor, inbox, {0: jobs[:2], 1: jobs[2:]})
    for j, (text, b, n) in zip(jobs, cases, strict=True):
        expected = translator.translate_batch([text], beam_size=b, n_best=n)[0]
        assert len(tokens(finished[j.id][1])) == n
        assert tokens(finished[j.id][1]) == expected.tokens
        if b > 1:  # (greedy jobs skip the log-softmax: their score is 0.0 by design)
            assert scores(finished[j.id][1]) == pytest.approx(expected.scores, abs=1e-4)


@pytest.mark.parametrize(("max_batch_size", "max_batch_tokens"), [(4, 8192), (64, 100)])
def test_the_running_batch_stays_within_its_limits(
    make_executor: Callable[..., Executor],
    translator: Translator,
    monkeypatch: pytest.MonkeyPatch,
    max_batch_size: int,
    max_batch_tokens: int,
) -> None:
    texts = [*LONG, *SENTENCES]
    inbox = Inbox()
    executor = make_executor(
        translator, inbox, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens
    )
    seen: list[tuple[int, int, int]] = []  # (rows, rows x source width, jobs) after each admission
    admit = executor._admit

    def recording_admit(jobs: list[Any], lane: Any) -> None:
        admit(jobs, lane)
        run = executor.running
        seen.append((run.rows, run.rows * run.width, len(run)))

    monkeypatch.setattr(executor, "_admit", recording_admit)
    jobs = [job(translator, t, 2) for t in texts] + [job(translator, SHORT, 5)]  # 5 rows: wider than 4
    finished = drive(executor, inbox, {0: jobs})
    for j, text in zip(jobs, texts + [SHORT], strict=True):
        expected = translator.translate_batch([text], beam_size=j.beam_size)[0]
        assert tokens(finished[j.id][1]) == expected.tokens
    for rows, area, n in seen:
        assert n == 1 or (rows <= max_batch_size and area <= max_batch_tokens), seen
    assert max(n for _, _, n in seen) > 1  # some batches were shared all the same


def test_beam_rows_moved_out_of_job_order_keep_their_own_tokens(
    make_executor: Callable[..., Executor], endless: Translator
) -> None:
    """A greedy job leaves first and the last beam row moves into its place: a job's rows are then
    neither consecutive nor in job order, and every later step must still read and write the right
    rows (moved rows included, in steps where no beam is reordered)."""
    cases = [(SHORT, 1), (LONG[0], 2), (LONG[1], 2)]
    inbox = Inbox()
    executor = make_executor(endless, inbox)
    run = executor.running
    jobs = [job(endless, text, b) for text, b in cases]
    inbox.add(jobs)
    finished: Finished = {}
    out_of_order = 0  # steps that started with rows out of job order
    with torch.inference_mode():
        while inbox.waiting or executor.busy:
            run = executor.running
            out_of_order += [r for e in run.entries for r in e.rows] != list(range(run.rows))
            finished.update((j.id, (0, r)) for j, r in executor.iteration())
    assert out_of_order > 3
    for j, (text, b) in zip(jobs, cases, strict=True):
        assert tokens(finished[j.id][1]) == endless.translate_batch([text], beam_size=b)[0].tokens[:1]


# -- continuous batching -----------------------------------------------------------------------------
def test_a_short_job_overtakes_a_long_batch(
    make_executor: Callable[..., Executor], endless: Translator
) -> None:
    inbox = Inbox()
    executor = make_executor(endless, inbox)
    long_jobs = [job(endless, t, 2) for t in LONG]
    short = job(endless, SHORT)
    finished = drive(executor, inbox, {0: long_jobs, 3: [short]})  # the long batch is decoding
    short_done = finished[short.id][0]
    long_done = min(finished[j.id][0] for j in long_jobs)
    # It joined the running batch, finished and left while the long batch decoded on.
    assert short_done < long_done - 10
    expected = endless.translate_batch([SHORT], beam_size=1)[0].tokens
    assert tokens(finished[short.id][1]) == expected


def test_an_emptied_batch_keeps_its_cache_for_the_next_job_until_it_has_been_empty_a_while(
    translator: Translator, make_executor: Callable[..., Executor]
) -> None:
    inbox = Inbox()
    executor = make_executor(translator, inbox)
    first, second = job(translator, SHORT, beam_size=2), job(translator, LONG[0], beam_size=2)
    drive(executor, inbox, {0: [first]})
    [lane] = executor.lanes.values()
    assert not len(lane.running) and lane.emptied is not None
    cache = lane.running.cache
    executor.drop_empty(lane.emptied - KEEP_EMPTY_S)  # not empty long enough: kept
    finished = drive(executor, inbox, {0: [second]})
    assert executor.lanes == {(MODEL, False): lane} and lane.running.cache is cache  # decoded in it
    assert tokens(finished[second.id][1]) == translator.translate_batch([LONG[0]], beam_size=2)[0].tokens
    executor.drop_empty(lane.emptied + KEEP_EMPTY_S)
    assert executor.lanes == {}  # the cache is gone with the lane


def test_newcomers_join_a_running_batch_in_groups(
    make_executor: Callable[..., Executor], endless: Translator
) -> None:
    """While 5 long sentences decode, a lone newcomer joins only JOIN_WAIT_STEPS steps after the
    last join; two newcomers (>= JOIN_RATIO x the running ones) join at the next step."""
    inbox = Inbox()
    # Outputs of 3 x the source length: the long sentences outlast the short ones.
    longer = Translator(
        endless.model,
        endless.tokenizer,
        endless.info,
        endless.device,
        options=DecodeOptions(max_length_a=3.0, max_length_b=0),
    )
    _KEEP.append(longer)
    executor = make_executor(longer, inbox)
    run = executor.running

    def steps_until_taken() -> int:
        steps = 0
        while inbox.waiting:
            assert executor.iteration() == []
            steps += 1
            # Greedy jobs only: rows follow job order, so a step's logits need no reordering.
            assert [r for e in run.entries for r in e.rows] == list(range(run.rows))
        return steps

    inbox.add([job(endless, t) for t in LONG * 2 + LONG[:1]])
    with torch.inference_mode():
        assert steps_until_taken() == 1 and len(run) == 5
        inbox.add([job(endless, SHORT)])
        assert steps_until_taken() == JOIN_WAIT_STEPS and len(run) == 6
        assert 1 < JOIN_RATIO * len(run) <= 2  # the arithmetic this test relies on
        pair = [job(endless, SHORT), job(endless, SENTENCES[0])]
        inbox.add(pair)
        assert steps_until_taken() == 1 and ids([e.key for e in run.entries[-2:]]) == ids(
            pair
        )  # together, at once
        inbox.add([job(endless, SENTENCES[4])])  # alone again: it waits as long as the first one
        assert steps_until_taken() == JOIN_WAIT_STEPS
        finished = 0
        while executor.busy:  # the short ones leave first: rows move into their places
            finished += len(executor.iteration())
            assert [r for e in run.entries for r in e.rows] == list(range(run.rows))
    assert finished == 9


# -- jobs nobody waits for -----------------------------------------------------------------------------
def test_cancelled_and_expired_jobs_leave_the_batch_and_the_inbox(
    make_executor: Callable[..., Executor], endless: Translator
) -> None:
    inbox = Inbox(metrics())
    executor = make_executor(endless, inbox, metrics=metrics())
    abandoned = sample("nmt_sentences_total", {"outcome": "abandoned"})
    translated = sample("nmt_sentences_total", {"outcome": "translated"})
    cancelled, expired, stays = job(endless, LONG[0], 2), job(endless, LONG[1], 2), job(endless, LONG[1])
    inbox.add([cancelled, expired, stays])
    with torch.inference_mode():
        for _ in range(3):
            assert executor.iteration() == []
        assert executor.running.rows == 5
        waiting_cancelled, waiting_expired = job(endless, SHORT), job(endless, SHORT, deadline=0.0)
        inbox.add([waiting_cancelled, waiting_expired])
        inbox.cancel([cancelled.id, waiting_cancelled.id])
        running = next(e.key for e in executor.running.entries if e.key.id == expired.id)
        running.message = dataclasses.replace(expired, deadline=time.monotonic() - 1.0)  # it passes now
        assert executor.iteration() == []  # no outcome: nobody waits for them
    assert (
        ids([e.key for e in executor.running.entries]) == [stays.id]
        and executor.running.rows == 1
        and inbox.waiting == 0
    )
    assert sample("nmt_sentences_total", {"outcome": "abandoned"}) == abandoned + 4
    for gone in (cancelled, expired, waiting_cancelled, waiting_expired):
        assert not inbox.release(gone)  # forgotten already
    finished = drive(executor, inbox)
    assert list(finished) == [stays.id]  # its row moved into a leaving one's place: the same result
    assert tokens(finished[stays.id][1]) == endless.translate_batch([LONG[1]], beam_size=1)[0].tokens
    assert sample("nmt_sentences_total", {"outcome": "translated"}) == translated + 1


def test_active_sequences_drop_to_zero_when_every_running_job_is_cancelled(
    make_executor: Callable[..., Executor], endless: Translator
) -> None:
    inbox = Inbox()
    executor = make_executor(endless, inbox, metrics=metrics())
    jobs = [job(endless, t) for t in LONG]
    inbox.add(jobs)
    with torch.inference_mode():
        executor.iteration()
        assert sample("nmt_active_sequences") == 2
        inbox.cancel([j.id for j in jobs])
        executor.iteration()
    assert not executor.busy
    assert sample("nmt_active_sequences") == 0


# -- failures ----------------------------------------------------------------------------------------
def test_a_failed_step_fails_only_the_running_jobs(
    endless: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    inbox = Inbox()
    executor = Executor(ModelTable.single(endless, MODEL), inbox)
    texts = synthetic_sentences(10, seed=3)[::2]
    running = [job(endless, t, 1 + i % 2) for i, t in enumerate(texts)]
    inbox.add(running)
    step = endless.model.step
    calls = 0

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("CUDA out of memory")
        return step(*args, **kwargs)

    monkeypatch.setattr(endless.model, "step", failing_once)
    newcomer = job(endless, SHORT)
    with torch.inference_mode():
        assert executor.iteration() == []
        inbox.add([newcomer])  # 1 < JOIN_RATIO x 5 running: it waits to join
        assert executor.iteration() == []
        outcomes = executor.iteration()
    assert {j.id for j, _ in outcomes} == {j.id for j in running}
    for _, result in outcomes:
        assert isinstance(result, RuntimeError) and "CUDA out of memory" in str(result)
    assert all(inbox.release(j) for j, _ in outcomes)
    assert not executor.busy and executor.running.rows == 0 and inbox.waiting == 1  # the newcomer waits on
    again = job(endless, texts[1], 2)
    finished = drive(executor, inbox, {3: [again]}, start=3)  # and the executor goes on
    assert tokens(finished[newcomer.id][1]) == endless.translate_batch([SHORT], beam_size=1)[0].tokens
    assert tokens(finished[again.id][1]) == endless.translate_batch([texts[1]], beam_size=2)[0].tokens


def test_jobs_whose_admission_fails_are_answered(
    endless: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    inbox = Inbox()
    executor = Executor(ModelTable.single(endless, MODEL), inbox)
    encode = endless.model.encode
    calls = 0

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("CUDA out of memory")
        return encode(*args, **kwargs)

    monkeypatch.setattr(endless.model, "encode", failing_once)
    newcomer = job(endless, SHORT)
    inbox.add([newcomer])
    with torch.inference_mode():
        outcomes = executor.iteration()
    answered = [j.id for j, _ in outcomes]
    assert answered == [newcomer.id] or inbox.waiting == 1  # failed, or still waiting for a later step


def test_a_typed_line_decodes_apart_from_a_documents_batch_in_its_own_steps(
    make_executor: Callable[..., Executor], translator: Translator
) -> None:
    inbox = Inbox()
    executor = make_executor(translator, inbox, max_batch_size=32)
    typed = job(translator, LONG[0])
    texts = [*LONG, *SENTENCES]
    document = [dataclasses.replace(job(translator, s), background=True) for s in texts]
    alone = drive(executor, inbox, {0: [dataclasses.replace(typed, id=next(_ids))]})
    steps_alone = max(i for i, _ in alone.values()) + 1
    finished = drive(executor, inbox, {0: document, 3: [typed]}, start=0)
    typed_at, outcome = finished[typed.id]
    # Its steps are its own (the document's batch steps once in BACKGROUND_EVERY meanwhile) ...
    assert typed_at - 3 < steps_alone + steps_alone // BACKGROUND_EVERY + 2
    assert tokens(outcome) == tokens(next(iter(alone.values()))[1])
    # ... and the document's sentences translate as they would alone.
    for j, text in zip(document, texts, strict=True):
        assert tokens(finished[j.id][1]) == translator.translate_batch([text], beam_size=1)[0].tokens[:1]
    assert typed_at < max(finished[j.id][0] for j in document)  # the line did not wait for it
