"""app.serving.fairqueue: round-robin over owners, retries first, and the worker's inbox keeping
that order for what it was given ahead."""

from __future__ import annotations

import time

import pytest

from app.serving.fairqueue import FairQueue
from app.serving.protocol import Sentence
from app.serving.worker.inbox import Inbox


def drain(queue: FairQueue[str]) -> list[str]:
    out = []
    while queue.peek() is not None:
        assert queue.peek() == (item := queue.pop())
        out.append(item)
    assert len(queue) == 0
    return out


def test_fair_serves_one_item_per_owner_per_turn() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("doc1", ["a1", "a2", "a3"])
    q.push("doc2", ["b1", "b2"])
    q.push("line", ["c1"])
    assert len(q) == 6
    assert drain(q) == ["a1", "b1", "c1", "a2", "b2", "a3"]


def test_more_items_of_a_waiting_owner_go_behind_its_own() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("doc1", ["a1", "a2"])
    q.push("line", ["c1"])
    q.push("doc1", ["a3"])
    assert drain(q) == ["a1", "c1", "a2", "a3"]


def test_items_pushed_first_are_served_before_everything_in_their_order() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("doc1", ["a3", "a4"])
    q.push("doc2", ["b1"])
    q.push("doc2", ["b0"], first=True)  # an owner already waiting moves to the head
    q.push("doc3", ["c1", "c2"], first=True)
    assert q.owners() == ["doc3", "doc2", "doc1"]
    assert drain(q) == ["c1", "b0", "a3", "c2", "b1", "a4"]


def test_drop_takes_out_one_owner() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("doc1", ["a1", "a2"])
    q.push("doc2", ["b1"])
    assert q.drop("doc1") == ["a1", "a2"] and q.drop("doc1") == []
    assert len(q) == 1 and drain(q) == ["b1"]
    with pytest.raises(IndexError):
        q.pop()


def job(jid: int, request: int) -> Sentence:
    return Sentence(jid, request, [5, 3], 1, 1, None, time.monotonic())


def test_a_worker_takes_a_late_short_request_before_the_rest_of_the_documents() -> None:
    inbox = Inbox()
    inbox.add([job(i, request=1) for i in range(40)])  # a document given ahead
    inbox.add([job(100 + i, request=2) for i in range(40)])
    inbox.add([job(999, request=3)])  # one line, given last
    taken = [j.id for j in inbox.take(lambda j: True)][:5]
    assert taken == [0, 100, 999, 1, 101]
