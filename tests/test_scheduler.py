"""The scheduler in the front end, with fake workers: admission, dispatch in rows to the least-loaded
worker, fair order (across requests, and across models sharing the workers), answers in request
order, failures, deadlines, withdrawal, and retries when a worker exits. No model: a fake worker
records what it is sent, and the test answers for it."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

import app.serving.frontend.scheduler as scheduler_module
from app.monitoring.metrics import process_metrics
from app.serving.errors import DeadlineExceeded, EngineError, EngineStopped, QueueFull, TooLarge
from app.serving.frontend.scheduler import MAX_ATTEMPTS, Request, Scheduler
from app.serving.frontend.spreading import SPREAD_AFTER_S
from app.serving.protocol import (
    Answers,
    Cancel,
    Done,
    Failed,
    Hypothesis,
    Load,
    Loaded,
    Sentence,
    SentenceResult,
    ToWorker,
    Translate,
)

EOS = 2
MODEL = "m"  # the model served, unless a test says otherwise


class FakeWorker:
    """A worker without a process (serving every model): it records what it is sent; the test
    answers in its name."""

    def __init__(self, name: str, *, running: bool = True) -> None:
        self.name = name
        self.running = running
        self.listener: Any = None
        self.sent: list[ToWorker] = []  # every message, in order
        self.pending: dict[int, Sentence] = {}  # given, not answered, cancelled or lost in an exit
        self.accepts = True  # what send() answers (False: the pipe is broken)
        self.starts = 0
        self.failing_starts = 0  # the next start() calls that fail
        self.gate: asyncio.Event | None = None  # if set, start() waits for it

    @property
    def pid(self) -> int | None:
        return None  # (a real pid would make the scheduler drop that process's live gauges)

    def send(self, message: ToWorker) -> bool:
        if not self.accepts:
            return False
        self.sent.append(message)
        if isinstance(message, Translate):
            self.pending.update((job.id, job) for job in message.sentences)
        elif isinstance(message, Cancel):
            for sid in message.ids:
                self.pending.pop(sid)  # (KeyError: a cancel for something it was never given)
        return True

    async def start(self) -> str:
        self.starts += 1
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        if self.failing_starts:
            self.failing_starts -= 1
            raise RuntimeError(f"{self.name} could not start")
        self.running = True
        return f"{self.name} ready"

    def stop(self) -> None:
        self.running = False

    # -- what the test does in the worker's name -------------------------------------------------------
    def given(self) -> list[Sentence]:
        """Every sentence it was sent, in order (repeats included)."""
        return [job for m in self.sent if isinstance(m, Translate) for job in m.sentences]

    def cancelled(self) -> list[int]:
        return [sid for m in self.sent if isinstance(m, Cancel) for sid in m.ids]

    def answer(self, *jobs: Sentence, failed: str | None = None) -> None:
        """Answer these sentences in one message: done (the n-best echoes the source), or failed."""
        answers: list[Done | Failed] = []
        for job in jobs:
            del self.pending[job.id]
            answers.append(Failed(job.id, failed) if failed else Done(job.id, echo(job.src)))
        self.listener.on_message(self, Answers(tuple(answers)))

    def crash(self) -> None:
        """The process exits: what it was given is lost."""
        self.running = False
        self.pending.clear()
        self.listener.on_exit(self)


def echo(src: list[int]) -> SentenceResult:
    return SentenceResult((Hypothesis(src[:-1], -float(len(src))),))


def sources(n: int, tag: int = 0) -> list[list[int]]:
    """``n`` distinct sources; ``tag`` tells requests apart in what a worker is sent."""
    return [[100 + tag, 3 + i, EOS] for i in range(n)]


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.001)


def scheduler(
    workers: list[FakeWorker],
    *,
    max_batch_size: int = 2,
    max_queue: int = 1000,
    models: tuple[str, ...] = (MODEL,),
) -> Scheduler:
    """A scheduler of ``models`` with the process's metrics; each worker holds max_batch_size * 1.5
    rows."""
    return Scheduler(
        workers,
        models=models,
        max_queue=max_queue,
        max_batch_size=max_batch_size,
        prefetch=0.5,
        metrics=process_metrics(),
    )


def sample(name: str, labels: dict[str, str] | None = None, model: str = MODEL) -> float:
    """A metric of ``model`` (every one the scheduler records is labelled with its model)."""
    return process_metrics().sample(name, {"model": model, **(labels or {})})


def restarts_so_far() -> float:
    """Workers started again (not per model: every worker serves every model)."""
    return process_metrics().sample("nmt_worker_restarts_total")


@pytest.fixture
def no_restart_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_module, "RESTART_DELAYS_S", (0.0, 0.0))


# -- admission ---------------------------------------------------------------------------------------
def test_admission_refuses_what_does_not_fit_in_the_queue() -> None:
    async def main() -> None:
        worker = FakeWorker("w", running=False)  # no room anywhere: everything admitted waits
        s = scheduler([worker], max_queue=4)
        with pytest.raises(ValueError):
            s.submit([], beam_size=1, n_best=1)
        with pytest.raises(TooLarge):
            s.submit(sources(5), beam_size=1, n_best=1)  # could never fit: retrying will not help
        first = s.submit(sources(3), beam_size=1, n_best=1)
        assert s.waiting == 3
        with pytest.raises(QueueFull):
            s.submit(sources(2), beam_size=1, n_best=1)  # 3 + 2 > 4: later, maybe
        second = s.submit(sources(1), beam_size=1, n_best=1)  # 3 + 1 fits exactly
        with pytest.raises(QueueFull):
            s.submit(sources(1), beam_size=1, n_best=1)
        assert s.waiting == 4 and worker.sent == []
        s.stop()
        for request in (first, second):  # what was admitted fails, not hangs
            with pytest.raises(EngineStopped):
                await request.future
        assert s.waiting == 0 and not s.alive
        with pytest.raises(EngineStopped):
            s.submit(sources(1), beam_size=1, n_best=1)

    run(main)


def test_admission_counts_only_sentences_that_wait_for_a_worker() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_queue=3, max_batch_size=2)  # the worker holds 3 rows
        s.submit(sources(3), beam_size=1, n_best=1)  # all given to the worker at once
        assert s.waiting == 0 and len(worker.pending) == 3
        s.submit(sources(3), beam_size=1, n_best=1)  # all wait
        assert s.waiting == 3
        with pytest.raises(QueueFull):
            s.submit(sources(1), beam_size=1, n_best=1)

    run(main)


def test_enter_holds_a_place_in_the_queue_until_leave() -> None:
    async def main() -> None:
        s = scheduler([FakeWorker("w", running=False)], max_queue=3)
        assert [s.enter() for _ in range(4)] == [True, True, True, False]
        s.leave()
        assert s.enter()
        assert not s.enter()
        for _ in range(3):
            s.leave()
        s.submit(sources(2), beam_size=1, n_best=1)  # 2 wait: one place left
        assert s.enter()
        assert not s.enter()
        s.leave()
        assert s.enter()

    run(main)


# -- dispatch ----------------------------------------------------------------------------------------
def test_a_worker_is_given_sentences_up_to_its_capacity_in_rows() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=4)  # 4 + 2 = 6 rows
        before = time.monotonic()
        request = s.submit(sources(5), beam_size=2, n_best=2, timeout_s=None)
        after = time.monotonic()
        assert [job.id for job in worker.given()] == [job.id for job in worker.pending.values()]
        assert len(worker.given()) == 3 and s.waiting == 2 and s.active == 3  # 3 x 2 rows
        job = worker.given()[0]
        assert (job.request, job.src, job.beam_size, job.n_best, job.deadline) == (
            request.id,
            sources(5)[0],
            2,
            2,
            None,
        )
        assert before <= job.enqueued <= after  # when it was admitted, however slow the machine
        worker.answer(worker.given()[0])  # 2 rows free: one more sentence
        assert len(worker.given()) == 4 and s.waiting == 1
        wide = s.submit(sources(1, tag=1), beam_size=4, n_best=1)  # 4 rows: waits for room
        worker.answer(worker.given()[1])
        assert len(worker.given()) == 5 and s.waiting == 1  # the last of the first request, 2 rows
        worker.answer(worker.given()[2])  # 2 rows free, not enough
        assert len(worker.given()) == 5 and s.waiting == 1
        worker.answer(worker.given()[3])  # 4 rows free now
        assert worker.given()[-1].src == sources(1, tag=1)[0] and s.waiting == 0
        worker.answer(*worker.pending.values())
        assert request.future.done() and wide.future.done() and s.active == 0

    run(main)


def test_an_idle_worker_takes_one_sentence_wider_than_its_capacity() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=2)  # 3 rows
        request = s.submit(sources(2), beam_size=5, n_best=1)
        assert len(worker.given()) == 1 and s.waiting == 1  # one at a time, never two
        worker.answer(worker.given()[0])
        assert len(worker.given()) == 2 and s.waiting == 0
        worker.answer(worker.given()[1])
        assert request.future.result() == [echo(src) for src in sources(2)]

    run(main)


def test_sentences_go_to_the_least_loaded_running_worker() -> None:
    async def main() -> None:
        down, w1, w2 = FakeWorker("down", running=False), FakeWorker("w1"), FakeWorker("w2")
        s = scheduler([down, w1, w2], max_batch_size=4)  # 6 rows each
        s.submit(sources(1), beam_size=4, n_best=1)  # w1 (a tie: the first), 2 rows left
        s.submit(sources(3, tag=1), beam_size=1, n_best=1)  # w2 has more room for each: 6, 5, 4
        assert (len(w1.pending), len(w2.pending)) == (1, 3)
        s.submit(sources(2, tag=2), beam_size=2, n_best=1)  # w2 (3 free > 2), then w1 (2 free > 1)
        assert [job.src[0] for job in w1.given()] == [100, 102]
        assert [job.src[0] for job in w2.given()] == [101, 101, 101, 102]
        assert down.sent == [] and s.waiting == 0

    run(main)


# -- fair order --------------------------------------------------------------------------------------
def test_a_short_request_waits_behind_one_sentence_of_each_long_one_not_behind_whole_documents() -> None:
    """8 requests of 40 sentences, then one of 1, on one worker of 3 rows; the worker answers in the
    order it was given sentences: the short one is served within the first round."""
    long_requests, long_sentences = 8, 40

    async def main() -> tuple[list[int], int]:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=2)
        requests = [s.submit(sources(long_sentences, tag=i), beam_size=1, n_best=1) for i in range(8)]
        short = s.submit(sources(1, tag=long_requests), beam_size=1, n_best=1)
        requests.append(short)
        finished: list[int] = []  # request tags, in the order they completed
        while worker.pending:
            worker.answer(next(iter(worker.pending.values())))  # the oldest first
            finished += [i for i, r in enumerate(requests) if r.future.done() and i not in finished]
        tags = [job.src[0] - 100 for job in worker.given()]
        assert short.future.result() == [echo(sources(1, tag=long_requests)[0])]
        return finished, tags.index(long_requests)

    finished, short_given_at = asyncio.run(main())
    assert sorted(finished) == list(range(long_requests + 1))
    before_short = finished.index(long_requests)  # long requests that completed before the short one
    # The worker's first 3 sentences, then one of each long request: the short one is next.
    assert short_given_at <= 3 + long_requests
    assert before_short <= 1


# -- answers -----------------------------------------------------------------------------------------
def test_results_come_back_in_request_order_whatever_order_answers_arrive_in() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=8)
        task = asyncio.create_task(s.translate(sources(5), beam_size=2, n_best=1))
        await asyncio.sleep(0)
        jobs = worker.given()
        assert len(jobs) == 5
        worker.answer(jobs[4])
        worker.answer(jobs[2], jobs[0])
        worker.answer(jobs[3])
        assert not task.done()
        worker.answer(jobs[1])
        assert await task == [echo(src) for src in sources(5)]
        assert s.active == 0 and s.waiting == 0

    run(main)


def test_a_failed_sentence_fails_its_request_and_cancels_the_rest() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=2)  # 3 rows
        request = s.submit(sources(3), beam_size=1, n_best=1)
        other = s.submit(sources(1, tag=1), beam_size=1, n_best=1)  # waits for room
        jobs = worker.given()
        worker.answer(jobs[0])
        worker.answer(jobs[1], failed="out of memory")
        error = request.future.exception()
        assert type(error) is EngineError and "out of memory" in str(error)
        assert worker.cancelled() == [jobs[2].id]  # the one still being translated
        assert worker.given()[-1].src == sources(1, tag=1)[0]  # its room went to the next request
        worker.listener.on_message(worker, Answers((Done(jobs[2].id, echo(jobs[2].src)),)))  # late
        worker.answer(worker.given()[-1])
        assert other.future.result() == [echo(sources(1, tag=1)[0])]
        assert s.active == 0

    run(main)


# -- deadlines and withdrawal ------------------------------------------------------------------------
def test_a_request_past_its_deadline_leaves_the_queue_and_its_worker() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=2)  # 3 rows
        abandoned = sample("nmt_sentences_total", {"outcome": "abandoned"})
        before = time.monotonic()
        request = s.submit(sources(5), beam_size=1, n_best=1, timeout_s=0.05)
        after = time.monotonic()
        # (it cannot expire before the next await: the deadline's timer runs on this event loop)
        assert s.waiting == 2 and sample("nmt_queue_depth_sentences") == 2
        job = worker.given()[0]
        deadline, enqueued = job.deadline, job.enqueued
        # Workers know it: admission time + timeout, bracketed by the clock read around submit()
        # rather than compared with the clock now (which would need this line within 50 ms).
        assert deadline == enqueued + 0.05 and before <= enqueued <= after
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(request.future, 5.0)
        assert s.waiting == 0 and sample("nmt_queue_depth_sentences") == 0
        assert sorted(worker.cancelled()) == sorted(job.id for job in worker.given())
        assert worker.pending == {} and s.active == 0
        assert sample("nmt_sentences_total", {"outcome": "abandoned"}) == abandoned + 2  # the 2 waiting
        s.submit(sources(1, tag=1), beam_size=1, n_best=1)  # the worker's room is free again
        assert len(worker.pending) == 1

    run(main)


def test_a_withdrawn_request_frees_its_workers_room_for_others() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=2)  # 3 rows
        task = asyncio.create_task(s.translate(sources(3), beam_size=1, n_best=1))
        await asyncio.sleep(0)
        first = [job.id for job in worker.given()]
        other: Request = s.submit(sources(4, tag=1), beam_size=1, n_best=1)
        assert len(first) == 3 and s.waiting == 4
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(worker.cancelled()) == sorted(first)
        assert [job.src[0] for job in worker.pending.values()] == [101] * 3 and s.waiting == 1
        s.withdraw(other)
        assert other.future.cancelled() and s.waiting == 0 and worker.pending == {} and s.active == 0

    run(main)


# -- workers that exit -------------------------------------------------------------------------------
@pytest.mark.usefixtures("no_restart_delay")
def test_sentences_of_a_worker_that_exits_go_to_another_one() -> None:
    async def main() -> None:
        w1, w2 = FakeWorker("w1"), FakeWorker("w2")
        s = scheduler([w1, w2], max_batch_size=4)  # 6 rows each
        retried, restarts = sample("nmt_retried_sentences_total"), restarts_so_far()
        task = asyncio.create_task(s.translate(sources(4), beam_size=1, n_best=1))
        await asyncio.sleep(0)
        assert len(w1.pending) == len(w2.pending) == 2
        lost = list(w1.pending)
        w2.answer(*w2.pending.values())
        w1.crash()
        assert sorted(w2.pending) == sorted(lost)  # given again at once, to the live worker
        assert sample("nmt_retried_sentences_total") == retried + 2
        w2.answer(*w2.pending.values())
        assert await task == [echo(src) for src in sources(4)]  # nothing lost, nothing failed
        await until(lambda: w1.running)
        assert w1.starts == 1 and restarts_so_far() == restarts + 1

    run(main)


@pytest.mark.usefixtures("no_restart_delay")
def test_sentences_of_the_only_worker_wait_until_it_is_back() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=2)  # 3 rows
        retried, restarts = sample("nmt_retried_sentences_total"), restarts_so_far()
        request = s.submit(sources(4), beam_size=1, n_best=1)
        worker.answer(worker.given()[1])
        lost = [job.id for job in worker.given()[2:] + worker.given()[:1]]  # the 3rd went out 2nd
        assert len(lost) == 3 and s.waiting == 0
        worker.gate, worker.failing_starts = asyncio.Event(), 1  # it comes back on the 2nd try
        worker.crash()
        await asyncio.sleep(0.01)
        assert s.waiting == 3 and sample("nmt_queue_depth_sentences") == 3
        assert len(worker.given()) == 4 and not request.future.done()  # nothing sent to a dead worker
        assert sample("nmt_retried_sentences_total") == retried + 3
        worker.gate.set()
        await until(lambda: worker.running)
        assert worker.starts == 2 and restarts_so_far() == restarts + 1
        again = [job.id for job in worker.given()[4:]]
        assert sorted(again) == sorted(lost) and s.waiting == 0  # back in their order
        assert again == sorted(lost)
        worker.answer(*worker.pending.values())
        assert request.future.result() == [echo(src) for src in sources(4)]

    run(main)


@pytest.mark.usefixtures("no_restart_delay")
def test_a_sentence_fails_after_max_attempts_workers_exited_with_it() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=2)
        doomed = s.submit(sources(1), beam_size=1, n_best=1)
        sid = worker.given()[0].id
        later: Request | None = None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            assert sid in worker.pending and not doomed.future.done()
            if attempt == MAX_ATTEMPTS:
                later = s.submit(sources(1, tag=1), beam_size=1, n_best=1)  # given once so far
            worker.crash()
            await until(lambda: worker.running)
        assert [job.id for job in worker.given()].count(sid) == MAX_ATTEMPTS
        error = doomed.future.exception()
        assert type(error) is EngineError and "exited" in str(error)
        assert later is not None and not later.future.done()  # its count is its own: it is retried
        assert [job.src[0] for job in worker.pending.values()] == [101]
        worker.answer(*worker.pending.values())
        assert later.future.result() == [echo(sources(1, tag=1)[0])]

    run(main)


def test_a_sentence_whose_send_fails_goes_to_a_live_worker() -> None:
    async def main() -> None:
        broken, healthy = FakeWorker("broken"), FakeWorker("healthy")
        s = scheduler([broken, healthy], max_batch_size=2)
        broken.accepts = False  # its process died; the event loop has not read the end of file yet
        request = s.submit(sources(1), beam_size=1, n_best=1)
        assert not request.future.done(), request.future.exception()
        assert len(healthy.pending) == 1
        healthy.answer(*healthy.pending.values())
        assert request.future.result() == [echo(sources(1)[0])]

    run(main)


# -- starting and stopping ---------------------------------------------------------------------------
def test_start_starts_every_worker_and_stop_fails_what_is_pending() -> None:
    async def main() -> None:
        w1, w2 = FakeWorker("w1", running=False), FakeWorker("w2", running=False)
        s = scheduler([w1, w2], max_batch_size=2)
        assert w1.listener is s and w2.listener is s and not s.alive
        assert await s.start() == ["w1 ready", "w2 ready"]
        assert s.alive
        given = s.submit(sources(6), beam_size=1, n_best=1)  # 3 rows each
        waiting = s.submit(sources(1, tag=1), beam_size=1, n_best=1)
        assert s.active == 6 and s.waiting == 1
        s.stop()
        for request in (given, waiting):
            assert isinstance(request.future.exception(), EngineStopped)
        assert not s.alive and not w1.running and s.waiting == 0

    run(main)


def test_start_fails_if_a_worker_does_not_start_and_stops_the_others() -> None:
    async def main() -> None:
        good, bad = FakeWorker("good", running=False), FakeWorker("bad", running=False)
        bad.failing_starts = 1
        s = scheduler([good, bad])
        with pytest.raises(RuntimeError, match="bad could not start"):
            await s.start()
        assert not good.running and not s.alive

    run(main)


def test_a_finished_request_is_freed_without_the_garbage_collector() -> None:
    """No reference cycle outlives a request: under load the collector's full passes over every
    connection's objects held the event loop for 0.3-0.4 s (app.main.quiet_garbage_collector)."""

    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=4)
        gc.disable()
        try:
            request = s.submit(sources(3), beam_size=1, n_best=1)
            worker.answer(*worker.given())
            await request.future
            s.withdraw(request)  # what the route does once it has its answer
            ref = weakref.ref(request)
            del request
            assert ref() is None, gc.get_referrers(ref())
        finally:
            gc.enable()

    run(main)


# -- several models sharing the workers ------------------------------------------------------------
def test_each_model_has_its_own_queue_and_a_request_for_one_never_waits_behind_anothers_backlog() -> None:
    """A document for model a fills the worker and a's queue; a one-line request for model b goes to
    the same, full worker at once (it holds nothing of b), past a's sentences waiting."""

    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=2, models=("a", "b"))  # 3 rows
        document = s.submit(sources(10), beam_size=1, n_best=1, model="a")
        assert len(worker.pending) == 3 and s.waiting == 7
        line = s.submit(sources(1, tag=1), beam_size=1, n_best=1, model="b")
        b_jobs = [job for job in worker.pending.values() if job.model == "b"]
        assert [job.src[0] for job in b_jobs] == [101] and s.waiting == 7  # at once, past a's 7
        worker.answer(*b_jobs)
        assert line.future.result() == [echo(sources(1, tag=1)[0])]
        assert sample("nmt_queue_depth_sentences", model="a") == 7
        assert sample("nmt_queue_depth_sentences", model="b") == 0
        while not document.done:
            worker.answer(*worker.pending.values())
        assert document.future.result() == [echo(src) for src in sources(10)]
        assert {job.model for job in worker.given()} == {"a", "b"}

    run(main)


def test_freed_rows_go_to_the_model_with_the_fewest_rows_in_the_workers_hands() -> None:
    """Fair across models: backlogs of 20 sentences for a and 3 for b, one worker of 3 rows. Each
    time rows free up, the next sentence comes from the model with the fewest rows given out
    (taking turns when equal), so b's sentences are not held behind a's 20: b's request is done
    after a few answers, not after a's document."""

    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=2, models=("a", "b"))  # 3 rows
        big = s.submit(sources(20), beam_size=1, n_best=1, model="a")
        small = s.submit(sources(3, tag=1), beam_size=1, n_best=1, model="b")
        given = lambda: [job.model for job in worker.given()]  # noqa: E731
        assert given() == ["a", "a", "a", "b"]  # b's first at once, however full the worker
        answered = 0
        while not small.done:
            worker.answer(next(iter(worker.pending.values())))  # the oldest first
            answered += 1
            assert answered <= 8, given()
        # Freed rows go to the model with fewer rows out; with equal shares (1 each) the models take
        # turns: a went first (b had just been served), then b.
        assert given()[4:6] == ["a", "b"]
        assert small.future.result() == [echo(src) for src in sources(3, tag=1)]
        while not big.done:
            worker.answer(*worker.pending.values())
        assert big.future.result() == [echo(src) for src in sources(20)]

    run(main)


def test_a_sentence_goes_to_a_worker_that_holds_its_model_loaded() -> None:
    """Workers say which models they hold (``Loaded``): a sentence goes to one that holds its model,
    where one may take it, rather than make another worker load the model."""

    async def main() -> None:
        w1, w2 = FakeWorker("w1"), FakeWorker("w2")
        s = scheduler([w1, w2], max_batch_size=4, models=("a", "b"))  # 6 rows each
        s.on_message(w2, Loaded(("b",)))
        s.on_message(w1, Loaded(("a",)))
        s.submit(sources(2), beam_size=1, n_best=1, model="b")
        s.submit(sources(2, tag=1), beam_size=1, n_best=1, model="a")
        assert {job.model for job in w2.given()} == {"b"} and {job.model for job in w1.given()} == {"a"}
        s.submit(sources(8, tag=2), beam_size=1, n_best=1, model="b")  # 4 more rows fit in w2, not 8
        assert [job.model for job in w2.given()].count("b") == 6
        assert [job.model for job in w1.given()].count("b") == 0  # a burst: the rest wait for w2
        w1.answer(*w1.pending.values())  # w1 is idle, and has not been asked to load b
        assert [job.model for job in w1.given()].count("b") == 0
        s.spreading.clock = lambda: time.monotonic() + SPREAD_AFTER_S  # b has filled w2 for a while now
        s.submit(sources(1, tag=3), beam_size=1, n_best=1, model="b")
        assert [m for m in w1.sent if isinstance(m, Load)] == [Load("b")]  # w1 loads b
        s.on_message(w1, Loaded(("a", "b")))
        assert [job.model for job in w1.given()].count("b") == 5  # then takes b's that wait

    run(main)


@pytest.mark.usefixtures("no_restart_delay")
def test_a_worker_that_exits_gives_back_the_sentences_of_every_model() -> None:
    async def main() -> None:
        w1, w2 = FakeWorker("w1"), FakeWorker("w2")
        # 12 rows each; a and c are w1's own models, b is w2's (``placement.homes``).
        s = scheduler([w1, w2], max_batch_size=8, models=("a", "b", "c"))
        retried = {m: sample("nmt_retried_sentences_total", model=m) for m in ("a", "c")}
        first = s.submit(sources(4), beam_size=1, n_best=1, model="a")
        second = s.submit(sources(4, tag=1), beam_size=1, n_best=1, model="c")
        assert {job.model for job in w1.pending.values()} == {"a", "c"}
        lost = dict(w1.pending)
        w1.crash()
        assert set(lost) <= set(w2.pending)  # given again at once, to the live worker
        for m in ("a", "c"):
            mine = sum(job.model == m for job in lost.values())
            assert sample("nmt_retried_sentences_total", model=m) == retried[m] + mine
        while w2.pending:
            w2.answer(*w2.pending.values())
        assert first.future.result() == [echo(src) for src in sources(4)]
        assert second.future.result() == [echo(src) for src in sources(4, tag=1)]
        assert s.active == 0 and all(m.rows == 0 for m in s.models.values())

    run(main)


def test_the_queue_limit_counts_every_models_sentences_and_a_second_hop_is_never_refused() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=2, max_queue=4, models=("a", "b"))
        s.submit(sources(3), beam_size=1, n_best=1, model="a")  # given to the worker
        s.submit(sources(4, tag=4), beam_size=1, n_best=1, model="a")  # waiting: the queue is full
        assert s.waiting == 4 and not s.enter()
        with pytest.raises(QueueFull):
            s.submit(sources(1, tag=1), beam_size=1, n_best=1, model="b")
        # A pivot's second hop: its sentences were counted when its request was admitted.
        hop = s.submit(sources(1, tag=2), beam_size=1, n_best=1, model="b", admitted=True)
        worker.answer(*[job for job in worker.pending.values() if job.model == "b"])
        assert hop.future.result() == [echo(sources(1, tag=2)[0])]
        with pytest.raises(TooLarge):  # (still refused: it could never fit)
            s.submit(sources(5, tag=3), beam_size=1, n_best=1, model="b", admitted=True)

    run(main)


def test_requests_name_their_model_unless_there_is_only_one() -> None:
    async def main() -> None:
        s = scheduler([FakeWorker("w")], models=("a", "b"))
        for model in (None, "c"):
            with pytest.raises(ValueError, match="models: a, b"):
                s.submit(sources(1), beam_size=1, n_best=1, model=model)
        only = scheduler([FakeWorker("w")])
        request = only.submit(sources(1), beam_size=1, n_best=1)
        assert request.model.name == MODEL and request.sentences[0].message.model == MODEL

    run(main)


def test_alive_while_some_worker_runs(no_restart_delay: None) -> None:
    async def main() -> None:
        w1, w2 = FakeWorker("w1"), FakeWorker("w2")
        s = scheduler([w1, w2], models=("a", "b"))
        assert s.alive
        w1.crash()
        assert s.alive  # w2 serves every model meanwhile
        w2.crash()
        assert not s.alive  # nothing serves any model until one is back
        await until(lambda: w1.running and w2.running)
        assert s.alive

    run(main)


def test_start_starts_the_first_worker_alone_then_the_others() -> None:
    """The first worker compiles every model's decoding step; the others wait and load them from
    the cache."""

    async def main() -> None:
        w1, w2, w3 = (FakeWorker(f"w{i}", running=False) for i in (1, 2, 3))
        for worker in (w1, w2, w3):
            worker.gate = asyncio.Event()
        s = scheduler([w1, w2, w3], models=("a", "b"))
        starting = asyncio.ensure_future(s.start())
        await until(lambda: w1.starts == 1)
        await asyncio.sleep(0.01)
        assert w2.starts == 0 and w3.starts == 0  # not before w1 is ready
        assert w1.gate is not None and w2.gate is not None and w3.gate is not None
        w1.gate.set()
        await until(lambda: w2.starts == 1 and w3.starts == 1)  # together
        w2.gate.set()
        w3.gate.set()
        assert await starting == ["w1 ready", "w2 ready", "w3 ready"]
        assert s.start_seconds > 0 and s.alive

    run(main)


def test_a_document_jobs_sentences_leave_a_batch_of_room_for_typed_ones_and_never_hold_them_back() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=4)  # 4 + 2 = 6 rows, 4 kept for typed sentences
        job = s.submit(sources(10), beam_size=1, n_best=1, background=True)
        assert len(worker.given()) == 2 and all(j.background for j in worker.given())  # 6 - 4 rows
        typed = s.submit(sources(3, tag=1), beam_size=1, n_best=1)
        assert [j.src for j in worker.given()[2:]] == sources(3, tag=1)  # at once, past the job's
        assert not any(j.background for j in worker.given()[2:])
        worker.answer(*worker.given()[2:])
        assert typed.future.done() and len(worker.given()) == 5  # the job's share is 2 rows: no more
        worker.answer(*worker.given()[:2])
        assert len(worker.given()) == 7  # as its sentences finish, the next ones go
        while not job.future.done():
            worker.answer(*worker.pending.values())
        assert s.active == 0 and s.waiting == 0

    run(main)


def test_an_idle_worker_takes_a_document_jobs_sentence_whatever_its_share() -> None:
    async def main() -> None:
        worker = FakeWorker("w")
        s = scheduler([worker], max_batch_size=4)
        s.submit(sources(1), beam_size=8, n_best=1, background=True)  # wider than its 2 rows
        assert len(worker.given()) == 1

    run(main)
