"""The core board (``app.serving.cores``): a worker runs on its model's other workers' threads only
while every other worker has slept for ``QUIET_S``, and goes back to its own share as soon as
another has work; the machine is idle (loads ahead of need may begin) only while no worker has work;
the board is shared memory that reaches workers started with ``spawn``."""

from __future__ import annotations

import multiprocessing

from app.serving.cores import QUIET_S, CoreBoard


class Clock:
    """The board's clock, moved by the test: "slept for ``QUIET_S``" is decided by the time the
    test says has passed, never by how fast two calls follow each other on a busy machine."""

    def __init__(self) -> None:
        self.now = 1000.0  # the slots start at 0: asleep since long ago

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_worker_alone_at_work_takes_the_idle_workers_threads() -> None:
    clock = Clock()
    board = CoreBoard(3, clock)
    a, b, c = (board.share(i, own=1, alone=3) for i in range(3))
    assert a.update(busy=True) == 3  # b and c sleep
    assert b.update(busy=True) == 1  # a has work
    assert a.update(busy=True) == 1  # b has work now: back to its own share at the next step
    b.update(busy=False)
    clock.advance(QUIET_S * 0.9)
    assert a.update(busy=True) == 1  # b has slept for less than QUIET_S: a client may keep it busy
    clock.advance(QUIET_S * 0.2)
    assert a.update(busy=True) == 3  # and now for longer
    c.update(busy=True)
    assert a.update(busy=True) == 1
    assert a.update(busy=False) == 1  # a sleeping worker keeps its own share
    clock.advance(QUIET_S * 0.9)
    assert c.update(busy=True) == 1  # a went to sleep just now
    clock.advance(QUIET_S * 0.2)
    assert c.update(busy=True) == 3
    assert b.update(busy=False) == 1 and c.update(busy=True) == 3  # b slept on: still quiet


def test_the_machine_is_idle_only_while_no_worker_has_work() -> None:
    board = CoreBoard(2, Clock())
    a, b = board.share(0, own=1, alone=2), board.share(1, own=1, alone=2)
    assert a.machine_idle() and b.machine_idle()  # before any work
    b.update(busy=True)
    assert not a.machine_idle() and not b.machine_idle()  # a neighbour's work counts
    b.update(busy=False)
    assert a.machine_idle()
    a.update(busy=True)
    assert not a.machine_idle()  # and its own


def test_a_worker_started_again_is_asleep_until_it_has_work() -> None:
    clock = Clock()
    board = CoreBoard(2, clock)
    crashed, other = board.share(0, own=1, alone=2), board.share(1, own=1, alone=2)
    crashed.update(busy=True)  # then killed: its slot says busy
    clock.advance(QUIET_S * 10)
    assert other.update(busy=True) == 1  # busy for ever, unless the slot is reset
    crashed.starting()
    assert other.update(busy=True) == 1  # asleep only from now
    clock.advance(QUIET_S * 1.1)
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
