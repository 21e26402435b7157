"""A worker's inbox (app.serving.worker.inbox.Inbox): jobs taken in the scheduler's order while they
fit, cancelled and expired ones dropped and forgotten, the waits of the worker's loop; document jobs'
sentences wait apart from typed ones, for the executor's batches of documents."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from app.monitoring.metrics import process_metrics
from app.serving.protocol import Sentence
from app.serving.worker.held import HeldSentence
from app.serving.worker.inbox import Inbox

MODEL = "m"


def job(sid: int, request: int, *, background: bool = False, beam: int = 2) -> Sentence:
    return Sentence(sid, request, [5, 2], beam, 1, None, time.monotonic(), MODEL, (), background)


def test_typed_and_document_sentences_wait_apart_and_are_taken_apart() -> None:
    inbox = Inbox()
    inbox.add([job(i, 1, background=True) for i in range(3)])  # a document job's, given first
    inbox.add([job(10, 2), job(11, 3)])  # two typed lines, given after it
    assert (inbox.waiting, inbox.waiting_for(MODEL)) == (5, 5)
    assert (inbox.waiting_for(MODEL, False), inbox.waiting_for(MODEL, True)) == (2, 3)
    assert [j.id for j in inbox.take(lambda j: True, MODEL)] == [10, 11]
    assert [j.id for j in inbox.take(lambda j: True, MODEL, background=True)] == [0, 1, 2]
    assert inbox.waiting == 0


def test_quiet_is_true_only_when_nothing_arrives_in_time() -> None:
    inbox = Inbox()
    started = time.monotonic()
    assert inbox.quiet(0.05)  # nothing came
    assert time.monotonic() - started >= 0.05
    inbox.add([job(1, 1)])
    started = time.monotonic()
    assert not inbox.quiet(5.0)  # a job waits: at once
    assert time.monotonic() - started < 1.0
    stopping = Inbox()
    stopping.stop()
    assert not stopping.quiet(5.0)  # stopping: not quiet, at once


def ids(jobs: Sequence[HeldSentence]) -> list[int]:
    """The ids of these jobs: the inbox hands the executor its own wrappers of what it was given."""
    return [j.id for j in jobs]


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return process_metrics().sample(name, {"model": MODEL, **(labels or {})})


def test_inbox_take_stops_at_the_first_job_that_does_not_fit() -> None:
    inbox = Inbox()
    jobs = [Sentence(i, 0, [5, 2], beam, 1, None, time.monotonic()) for i, beam in enumerate([1, 2, 3, 1])]
    inbox.add(jobs)
    rows = 0

    def fits(j: Any) -> bool:
        nonlocal rows
        if rows + j.beam_size > 3:
            return False
        rows += j.beam_size
        return True

    assert ids(inbox.take(fits)) == ids(jobs[:2])  # the last one would fit, but the order is the scheduler's
    assert inbox.waiting == 2
    assert ids(inbox.take(lambda j: True)) == ids(jobs[2:])
    assert inbox.waiting == 0 and inbox.take(lambda j: True) == []


def test_inbox_drops_cancelled_and_expired_jobs_and_forgets_them() -> None:
    inbox = Inbox(process_metrics())
    abandoned = sample("nmt_sentences_total", {"outcome": "abandoned"})
    now = time.monotonic()
    keep, cancelled, expired, later = (
        Sentence(i, 0, [5, 2], 1, 1, deadline, now, MODEL)
        for i, deadline in enumerate([None, None, now - 1, now + 60])
    )
    inbox.add([keep, cancelled, expired, later])
    inbox.cancel([cancelled.id, 99])  # an id it does not know is ignored
    assert inbox.take(lambda j: True, "another model") == []
    taken = inbox.take(lambda j: True, MODEL)
    assert ids(taken) == ids([keep, later])
    assert sample("nmt_sentences_total", {"outcome": "abandoned"}) == abandoned + 2
    assert not inbox.release(cancelled) and not inbox.release(expired)
    inbox.cancel([later.id])  # while it runs: the executor drops it at its next step
    assert taken[1].expired(time.monotonic()) and not taken[0].expired(time.monotonic())
    assert not inbox.release(later)  # nobody waits for it
    assert inbox.release(keep) and not inbox.release(keep)


def within(seconds: float, call: Callable[[], bool]) -> bool:
    """``call()`` on another thread; fails instead of hanging if it blocks for longer than ``seconds``."""
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"still blocked after {seconds} s"
    return result[0]


def test_inbox_wait_returns_when_there_is_work_and_false_once_stopped() -> None:
    inbox = Inbox()
    assert within(5.0, lambda: inbox.wait(lambda: True))  # a batch is running
    job_ = Sentence(0, 0, [5, 2], 1, 1, None, time.monotonic())
    later = threading.Timer(0.05, inbox.add, [[job_]])
    started = time.monotonic()
    later.start()
    assert within(5.0, lambda: inbox.wait(lambda: False))  # blocks until the job arrives
    assert time.monotonic() - started >= 0.04 and inbox.waiting == 1
    later.join()
    stopper = threading.Timer(0.02, inbox.stop)
    stopper.start()
    inbox.take(lambda j: True)
    assert not within(5.0, lambda: inbox.wait(lambda: False))  # woken by stop
    stopper.join()
    inbox.add([Sentence(1, 0, [5, 2], 1, 1, None, time.monotonic())])
    assert not within(5.0, lambda: inbox.wait(lambda: True))  # stopping wins over work


def test_inbox_wait_for_more_waits_for_rows_or_the_timeout() -> None:
    inbox = Inbox()
    inbox.add([Sentence(0, 0, [5, 2], 2, 1, None, time.monotonic())])
    started = time.monotonic()
    inbox.wait_for_more(4, 0.05)  # 2 rows wait, not 4
    assert time.monotonic() - started >= 0.04
    inbox.add([Sentence(1, 0, [5, 2], 2, 1, None, time.monotonic())])
    started = time.monotonic()
    inbox.wait_for_more(4, 10.0)
    assert time.monotonic() - started < 5.0  # 4 rows are there: it did not wait out its 10 s
