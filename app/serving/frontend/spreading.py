"""Which worker a model's sentence goes to, and when a hot model spreads to another worker.

Each model is one worker's own (``placement.homes``): a sentence goes to a worker that owns its
model (holds it, is loading it, or has its sentences in hand: ``WorkerState.owns``), the one with
the most free rows; when none of them may take it now, it waits for an owner's room (a cold model
stays in one worker's memory). Once every owner has held half a batch or more of the model's rows
for ``SPREAD_AFTER_S`` (through dips shorter than ``COOL_AFTER_S``), a worker running less than a
quarter of a batch (``LIGHT``) is asked to load it (``protocol.Load``), and owns it once it says
it holds it (``Loaded``).

Why the model's own rows, and for a while: a copy costs a load (1-2 s of a core at OPUS-MT's size)
and its weights' memory, which a sustained load repays and a burst does not. Spreading whenever
the owners were saturated, whatever their rows were, copied cold models under a uniform beam-4
load over 20 pairs each time one worker had a moment's fewer rows (5 copies in one run, none in
another: 27 against 47 sentences/s); and one pair alone under 64 connections never saturated its
owner, so that whether the other worker joined in was chance (281 sentences/s when it did, 222-230
when not). Why a dip does not end a hot spell at once: ``COOL_AFTER_S``. Why a ``Load`` first: a
sentence given to a worker that still had to load the model waited for that load, and a one-pair
load's p99 was 2.7x its steady one while the model spread. AVX-512 VNNI, 2 workers (BENCHMARKS.md
"Many models on one machine").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from app.serving.frontend.placement import WorkerState
from app.serving.protocol import Load

SPREAD_AFTER_S = 2.0  # a model hot at its owners this long spreads
# A hot model's dip below half a batch ends its hot spell only when it lasts this long: a batch
# whose sentences end together (the same length) empties the owner's rows for a moment at each
# round, and one pair under 64 connections (twenty OPUS-size pairs' benchmark, every output 12
# tokens) never stayed hot 2 s on end: it spread or not by the rounds' phase (171 or 111
# sentences/s, 2-vCPU AMD EPYC avx512_vnni).
COOL_AFTER_S = 1.0
# The share of a batch below which a worker's rows leave it room for a hot model of another's.
# A worker stepping its own models is busy whatever its rows: under a skewed load (80 % of 64
# connections on 2 of 20 OPUS-size pairs) with half a batch here, the second hot pair spread too
# and both workers stepped both: 89.1-89.9 sentences/s against 97.7-98.0 where neither spread,
# 92.5 with a quarter (2-vCPU AMD EPYC avx512_vnni). One pair alone leaves the other worker
# nothing: it spreads.
LIGHT = 0.25


class Spreading:
    """The choice of a worker for each sentence (``worker_for``), over the scheduler's workers."""

    def __init__(self, workers: Sequence[WorkerState], max_batch_size: int) -> None:
        self.workers = workers
        self.max_batch_size = max_batch_size
        self.clock: Callable[[], float] = time.monotonic  # (tests move it)

    def worker_for(self, model: str, rows: int, background: bool = False) -> WorkerState | None:
        """The worker a sentence of ``model`` (``rows`` rows; a document job's if ``background``)
        goes to now, or None: it waits. Asks another worker to load a model hot for a while."""
        owners = [s for s in self.workers if s.usable and s.owns(model)]
        takers = [s for s in self.workers if s.takes(model, rows, background)]
        if not owners:
            return max(takers, key=lambda s: s.free, default=None)
        now = self.clock()
        if all(self._hot_since(s, model, now) <= now - SPREAD_AFTER_S for s in owners):
            self._spread(model, [s for s in takers if s not in owners])
        owning = [s for s in takers if s in owners]
        return max(owning, key=lambda s: s.free, default=None)

    def held_changed(self, state: WorkerState, model: str) -> None:
        """``state.held[model]`` changed: keep when it began to hold half a batch of ``model``
        (through dips shorter than ``COOL_AFTER_S``), and when a dip began."""
        now = self.clock()
        if self._hot_since(state, model, now) == math.inf:  # cold, or cooled down for good since
            state.hot_since.pop(model, None)
            state.cool_since.pop(model, None)
        if 2 * state.held.get(model, 0) >= self.max_batch_size:
            state.hot_since.setdefault(model, now)
            state.cool_since.pop(model, None)
        elif model in state.hot_since:
            state.cool_since.setdefault(model, now)

    @staticmethod
    def _hot_since(state: WorkerState, model: str, now: float) -> float:
        """Since when ``model`` has been hot at ``state`` (inf: it is not), counting a dip that has
        lasted ``COOL_AFTER_S`` as its end even where no change has said so since."""
        cool = state.cool_since.get(model)
        if cool is not None and now - cool >= COOL_AFTER_S:
            return math.inf
        return state.hot_since.get(model, math.inf)

    def _spread(self, model: str, others: list[WorkerState]) -> None:
        """Ask the lightest of ``others`` running less than ``LIGHT`` of a batch (a worker busy
        with its own models has no room to spare) to load ``model``, once."""
        light = LIGHT * self.max_batch_size
        lighter = [s for s in others if s.rows < light and model not in s.asked]
        if lighter:
            other = min(lighter, key=lambda s: s.rows)
            other.asked.add(model)
            other.worker.send(Load(model))
