"""A worker's inbox (app.serving.worker.Inbox): typed sentences join a batch before document
jobs' ones, which take at most ``background_rows`` of it while typed ones run or wait, and the
whole of it otherwise."""

from __future__ import annotations

import time

from app.serving.protocol import SentenceJob
from app.serving.worker import Inbox

MODEL = "m"


def job(sid: int, request: int, *, background: bool = False, beam: int = 2) -> SentenceJob:
    return SentenceJob(sid, request, [5, 2], beam, 1, None, time.monotonic(), MODEL, (), background)


def take_all(inbox: Inbox) -> list[int]:
    return [j.id for j in inbox.take(lambda j: True, MODEL)]


def test_typed_sentences_join_first_and_a_jobs_take_at_most_its_rows_beside_them() -> None:
    inbox = Inbox(background_rows=4)
    inbox.add([job(i, 1, background=True) for i in range(5)])  # a document job's, given first
    inbox.add([job(10, 2), job(11, 3)])  # two typed lines, given after it
    taken = inbox.take(lambda j: True, MODEL)
    assert [j.id for j in taken] == [10, 11, 0, 1]  # the typed ones first, then 4 rows of the job's
    assert take_all(inbox) == []  # typed ones still run: no more of the job's
    for typed in taken[:2]:
        inbox.release(typed)
    assert take_all(inbox) == [2, 3, 4]  # alone, the job fills the batch


def test_a_typed_sentence_that_does_not_fit_is_not_jumped_by_a_jobs() -> None:
    inbox = Inbox(background_rows=64)
    inbox.add([job(0, 1, background=True, beam=1)])
    inbox.add([job(1, 2, beam=8)])
    assert [j.id for j in inbox.take(lambda j: j.beam_size < 8, MODEL)] == []
    assert inbox.waiting == 2


def test_alone_a_jobs_sentences_take_at_most_their_own_share_of_the_batch() -> None:
    inbox = Inbox(background_rows=2, background_alone_rows=6)
    inbox.add([job(i, 1, background=True) for i in range(5)])
    assert take_all(inbox) == [0, 1, 2]  # 6 rows: room left for a typed line's beams beside them
    assert take_all(inbox) == []
