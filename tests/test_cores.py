"""The core board (``app.serving.cores``): a worker runs on its model's other workers' threads only
while every other worker has slept for ``QUIET_S``, and goes back to its own share as soon as
another has work; the board is shared memory that reaches workers started with ``spawn``."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator

import pytest
import torch

from app.serving.cores import QUIET_S, CoreBoard


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_worker_alone_at_work_takes_the_idle_workers_threads() -> None:
    board = CoreBoard(3)
    a, b, c = (board.share(i, own=1, alone=3) for i in range(3))
    assert a.update(busy=True) == 3 and torch.get_num_threads() == 3  # b and c sleep
    assert b.update(busy=True) == 1 and torch.get_num_threads() == 1  # a has work
    assert a.update(busy=True) == 1  # b has work now: back to its own share at the next step
    b.update(busy=False)
    assert a.update(busy=True) == 1  # b has only just gone to sleep: a client may keep it busy
    time.sleep(QUIET_S)
    assert a.update(busy=True) == 3
    c.update(busy=True)
    assert a.update(busy=True) == 1
    assert a.update(busy=False) == 1  # a sleeping worker keeps its own share
    time.sleep(QUIET_S)
    assert c.update(busy=True) == 3
    assert b.update(busy=False) == 1 and c.update(busy=True) == 3  # b slept on: still quiet


def test_a_worker_started_again_is_asleep_until_it_has_work() -> None:
    board = CoreBoard(2)
    crashed, other = board.share(0, own=1, alone=2), board.share(1, own=1, alone=2)
    crashed.update(busy=True)  # then killed: its slot says busy
    assert other.update(busy=True) == 1
    crashed.starting()
    time.sleep(QUIET_S)
    assert other.update(busy=True) == 2


def test_own_threads_are_never_cut() -> None:
    board = CoreBoard(2)
    share = board.share(0, own=4, alone=2)  # NMT_THREADS above the model's share: kept
    assert share.alone == 4 and share.update(busy=True) == 4


def test_the_board_is_shared_with_spawned_workers() -> None:
    board = CoreBoard(2)
    mine, theirs = board.share(0, own=1, alone=2), board.share(1, own=1, alone=2)
    child = multiprocessing.get_context("spawn").Process(target=theirs.update, args=(True,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert mine.update(busy=True) == 1  # the child's slot says busy
