"""Which worker a model's sentence goes to, and when a hot model spreads to another worker.

Each model is one worker's own (``placement.homes``): a sentence goes to a worker that owns its
model (holds it, is loading it, or has its sentences in hand: ``WorkerState.owns``), the one with
the most free rows; when none of them may take it now, it waits for an owner's room (a cold model
stays in one worker's memory). Once every owner has held half a batch or more of the model's rows
for ``SPREAD_AFTER_S``, a worker running less than half a batch is asked to load it
(``protocol.Load``), and owns it once it says it holds it (``Loaded``).

Why the model's own rows, and for a while: a copy costs a load (1-2 s of a core at OPUS-MT's size)
and its weights' memory, which a sustained load repays and a burst does not. Spreading whenever
the owners were saturated, whatever their rows were, copied cold models under a uniform beam-4
load over 20 pairs each time one worker had a moment's fewer rows (5 copies in one run, none in
another: 27 against 47 sentences/s); and one pair alone under 64 connections never saturated its
owner, so that whether the other worker joined in was chance (281 sentences/s when it did, 222-230
when not). Why a ``Load`` first: a sentence given to a worker that still had to load the model
waited for that load, and a one-pair load's p99 was 2.7x its steady one while the model spread.
AVX-512 VNNI, 2 workers (BENCHMARKS.md "Many models on one machine").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from app.serving.frontend.placement import WorkerState
from app.serving.protocol import Load

SPREAD_AFTER_S = 2.0  # a model hot at its owners this long spreads


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
        since = self.clock() - SPREAD_AFTER_S
        if all(s.hot_since.get(model, math.inf) <= since for s in owners):
            self._spread(model, [s for s in takers if s not in owners])
        owning = [s for s in takers if s in owners]
        return max(owning, key=lambda s: s.free, default=None)

    def held_changed(self, state: WorkerState, model: str) -> None:
        """``state.held[model]`` changed: keep when it began to hold half a batch of ``model``."""
        if 2 * state.held.get(model, 0) >= self.max_batch_size:
            state.hot_since.setdefault(model, self.clock())
        else:
            state.hot_since.pop(model, None)

    def _spread(self, model: str, others: list[WorkerState]) -> None:
        """Ask the lightest of ``others`` running less than half a batch (a worker busy with its
        own models has no room to spare) to load ``model``, once."""
        lighter = [s for s in others if 2 * s.rows < self.max_batch_size and model not in s.asked]
        if lighter:
            other = min(lighter, key=lambda s: s.rows)
            other.asked.add(model)
            other.worker.send(Load(model))
