"""What the scheduler keeps of requests, sentences, models and workers (``app.serving.frontend.scheduler``
decides with them): a request and its sentences, each model's queues, each worker's rows in hand.
Plain data, no decisions but the one a worker's own state answers (``WorkerState.takes``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.monitoring.metrics import Metrics
from app.serving.fairqueue import FairQueue
from app.serving.frontend.handle import Listener
from app.serving.protocol import Sentence, SentenceResult, ToWorker


class Worker(Protocol):
    """What the scheduler needs of a worker (``app.serving.frontend.handle.WorkerProcess``): it serves every
    model."""

    name: str
    running: bool  # started, ready, and not stopped or exited since
    listener: Listener | None  # told of its answers and its exit: the scheduler
    home: tuple[str, ...]  # the models it loads when it starts (``homes``): set by the scheduler

    @property
    def pid(self) -> int | None: ...

    def send(self, message: ToWorker) -> bool: ...

    # What it reports when ready: a mapping whose keys are the models it loaded at start (a
    # ``WorkerProcess``), or anything else (no model known to be loaded).
    async def start(self) -> Any: ...

    def stop(self) -> None: ...


def homes(models: Sequence[str], workers: int) -> list[tuple[str, ...]]:
    """Each worker's own models: those it loads when it starts (the first before it is ready, the
    others in the background) and is given first. The models go to the workers in turn, so that
    the machine holds each once (20 models in every worker of two were twice the memory); a worker
    left without one takes a model in turn too (one model, two workers: both hold it). Any worker
    still translates any model: one is asked to load a model that has kept its owners busy for a
    while, and takes its sentences too (``app.serving.frontend.spreading``)."""
    own = [tuple(m for i, m in enumerate(models) if i % workers == w) for w in range(workers)]
    return [mine or (models[w % len(models)],) for w, mine in enumerate(own)]


@dataclass(eq=False)
class Request:
    id: int
    beam_size: int
    n_best: int
    future: asyncio.Future[list[SentenceResult]]  # each sentence's, or why it failed
    results: list[SentenceResult | None]  # each sentence's, once its worker answered
    model: ModelQueue  # the model that translates it
    left: int = 0  # sentences not finished yet
    deadline: float | None = None  # time.monotonic()
    timer: asyncio.TimerHandle | None = None
    sentences: list[PlacedSentence] = field(default_factory=list)  # all of them, in order
    background: bool = False  # a document job's: it takes what typed requests leave

    @property
    def done(self) -> bool:
        return self.future.done()


@dataclass(eq=False)
class PlacedSentence:
    """A sentence of a request, as the scheduler tracks it: what a worker is sent (``message``),
    and where it is."""

    message: Sentence
    request: Request
    index: int  # its position in the request
    worker: WorkerState | None = None  # where it is being translated
    attempts: int = 0

    @property
    def id(self) -> int:
        return self.message.id

    @property
    def rows(self) -> int:
        return self.message.beam_size


@dataclass(eq=False)
class ModelQueue:
    """One model's sentences waiting for a worker (fair order within the model), and how many rows
    of it the workers have in hand (its share of them)."""

    name: str
    queue: FairQueue[PlacedSentence]  # admitted, not given to a worker yet
    metrics: Metrics | None = None  # labelled with the model (``Metrics.of_model``)
    rows: int = 0  # given to workers, not finished
    # Document jobs' sentences, given only where the typed ones of ``queue`` leave room.
    background: FairQueue[PlacedSentence] = field(default_factory=FairQueue)

    @property
    def waiting(self) -> int:
        return len(self.queue) + len(self.background)

    def queue_of(self, request: Request) -> FairQueue[PlacedSentence]:
        return self.background if request.background else self.queue


@dataclass(eq=False)
class WorkerState:
    worker: Worker
    capacity: int  # rows it may hold, every model's together
    sentences: dict[int, PlacedSentence] = field(default_factory=dict)  # given to it, not finished
    rows: int = 0
    # Rows kept for typed requests: document jobs' sentences fill at most capacity - reserved.
    reserved: int = 0
    background_rows: int = 0  # of ``rows``, document jobs'
    held: dict[str, int] = field(default_factory=dict)  # of ``rows``, each model's
    # Since when each model has held half a batch or more of ``rows`` here, without a break
    # (``app.serving.frontend.spreading``: a model hot that long spreads to a lighter worker).
    hot_since: dict[str, float] = field(default_factory=dict)
    # Since when a model hot here has held less than half a batch (a dip shorter than
    # ``spreading.COOL_AFTER_S`` does not end its hot spell).
    cool_since: dict[str, float] = field(default_factory=dict)
    asked: set[str] = field(default_factory=set)  # models it was asked to load (``Load``), not held yet
    loaded: frozenset[str] = frozenset()  # the models it holds loaded, as it last said
    home: frozenset[str] = frozenset()  # the models it loads when it starts (``homes``)
    # A send failed: the process is gone, but the event loop has not read its end of file yet
    # (``on_exit`` will). Nothing more is given to it until it is started again.
    unreachable: bool = False

    @property
    def usable(self) -> bool:
        return self.worker.running and not self.unreachable

    @property
    def free(self) -> int:
        return self.capacity - self.rows if self.usable else 0

    def owns(self, model: str) -> bool:
        """It holds ``model``, or is loading it (its own, or a sentence of it is in its hands)."""
        return model in self.loaded or model in self.home or self.held.get(model, 0) > 0

    def takes(self, model: str, rows: int, background: bool = False) -> bool:
        """Whether it may be given a sentence of ``model`` of ``rows`` rows: it has room, or it is
        idle, or it holds nothing of that model (one sentence however full it is). A document
        sentence's only within its share, so that a typed line always finds room."""
        if background:
            room = self.background_rows + rows <= self.capacity - self.reserved
            return self.usable and (not self.rows or (room and self.free >= rows))
        return self.usable and (self.free >= rows or not self.rows or not self.held.get(model))
