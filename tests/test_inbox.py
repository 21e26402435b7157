"""A worker's inbox (app.serving.worker.inbox.Inbox): document jobs' sentences wait apart from typed
ones, for the executor's batches of documents."""

from __future__ import annotations

import time

from app.serving.protocol import Sentence
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
