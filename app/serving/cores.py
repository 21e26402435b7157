"""Cores that idle workers leave: a worker alone at work runs on them too.

Each worker is single-threaded by default, one per core: under load that is the most sentences/s
(docs/architecture.md, "Worker processes, one single-threaded worker per core"). But a request
that arrives alone, the web page's translate-as-you-type, then runs on one core while the others
sleep. The ``CoreBoard`` tells each worker whether it is
alone: a small array in shared memory with one slot per worker process, holding
``inf`` while that worker has sentences in hand (running or waiting) and, while it sleeps, the
``time.monotonic()`` at which it went to sleep (one clock for every process of the machine). Before
every iteration a worker writes its slot and reads the others'; when they have all slept for
``QUIET_S`` it runs with the threads of every worker (``alone``), otherwise with its own
(``own``). No lock: each slot is written by one process, and a stale read costs one step at the
other thread count.

Why ``QUIET_S``: with two clients in a closed loop, each worker sleeps a millisecond between one
answer and the next request. Switching at every such gap cost 25% of the sentences/s at two
connections (float32, 2 cores), likely because the worker
that had taken two threads kept them for a step after its neighbour woke, three OpenMP threads
sharing two cores. A neighbour idle for ``QUIET_S`` is one that no client keeps busy.

The number of threads did not change a bit of the results: the encoder's output and the compiled
step's on 1 and 2 threads, int8 and float32 (``tests/test_determinism.py`` checks it). On a GPU,
one worker by default, ``alone`` is ``own``: nothing changes there.

No torch here: the front end makes the board. A worker sets its torch threads to what ``update``
answers (``app.serving.worker``).
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import time
from collections.abc import Callable
from typing import Any

QUIET_S = 0.05  # how long every other worker must have slept before one takes their threads
Clock = Callable[[], float]


class CoreBoard:
    """The shared slots, made by the front end before its workers start (``spawn`` passes them to
    each child); ``share(i, ...)`` is what worker ``i`` takes with it.

    ``clock``: ``time.monotonic``, one clock for every process of the machine; tests pass their own
    (it travels to a spawned worker, so it must pickle), to decide what "slept for ``QUIET_S``" means
    without sleeping and without depending on how fast two calls follow each other."""

    def __init__(self, workers: int, clock: Clock = time.monotonic) -> None:
        # Zero: asleep since the clock's start (before the first request, every worker sleeps).
        self.slots: Any = multiprocessing.get_context("spawn").RawArray(ctypes.c_double, workers)
        self.clock = clock

    def share(self, index: int, *, own: int, alone: int) -> CoreShare:
        return CoreShare(self.slots, index, own=own, alone=max(own, alone), clock=self.clock)


class CoreShare:
    """One worker's view of the board: its slot, and the thread counts it switches between."""

    def __init__(
        self, slots: Any, index: int, *, own: int, alone: int, clock: Clock = time.monotonic
    ) -> None:
        self.slots, self.index = slots, index
        self.own, self.alone = own, alone
        self.clock = clock

    def starting(self) -> None:
        """Asleep from now: a worker started again after a crash may have left its slot busy."""
        self.slots[self.index] = self.clock()

    def update(self, busy: bool) -> int:
        """Record whether this worker has work; the threads it should run torch with: ``alone``
        while it is the only worker with work and the others have slept for ``QUIET_S``, else
        ``own``."""
        slots, now = self.slots, self.clock()
        if busy:
            slots[self.index] = math.inf
        elif slots[self.index] == math.inf:
            slots[self.index] = now  # going to sleep now
        quiet = now - QUIET_S
        lone = busy and all(slots[i] <= quiet for i in range(len(slots)) if i != self.index)
        return self.alone if lone else self.own

    def machine_idle(self) -> bool:
        """Whether no worker of the machine has work, this one included (as last recorded): when
        loads ahead of need may begin (``app.serving.worker.loader``). A load reads and repacks
        hundreds of MB, and its lower CPU priority does not share out memory bandwidth or the
        cores a lone worker runs on: begun whenever their own worker was idle, niced loads beside a
        busy neighbour left a one-pair load's p99 at 2.0x its steady one (AVX-512 VNNI, 2 workers)."""
        return all(slot != math.inf for slot in self.slots)
