"""The scheduler: admission, the queues, fair order, deadlines and retries, in the HTTP front end.

Plain Python on the event loop, no torch: it decides *what* runs next; the workers decide *how*
(``app.serving.worker.executor``, in processes of their own). A test drives it with fake workers.

- **Models**: every worker serves every model (``app.serving.worker.models``: a worker loads a model when
  a sentence first needs it). Each model has its own queue (a ``ModelQueue``), and a worker with
  free rows takes from the models' queues, first from the model with the fewest rows in the
  workers' hands (round-robin among equals): a model that has nothing being translated goes first,
  so a request for one model never waits behind another model's backlog. A worker holding no
  sentence of a model takes one of its sentences however full it is (as an idle worker takes any
  one sentence), so neither does it wait for another model's batches to drain; and a sentence goes
  to a worker that owns its model, where one has room, rather than make another load it
  (``app.serving.frontend.spreading``: a model busy for a while spreads to another worker).
- **Admission** from exact counts, without asking anyone: at most ``max_queue`` sentences wait
  here for a worker, all models together (the gate below is passed before the body says which
  model a request is for); a request that does not fit is refused at once (``QueueFull``: 503 with
  Retry-After), one that could never fit too (``TooLarge``: 413). Before that, ``app.http.shedding``
  lets a request's body be read only if there is room (``enter``): each request let through holds
  a place until it is admitted or refused, so that when one place frees up, one request is parsed,
  not every request that arrived meanwhile.
- **Dispatch**: each worker is given sentences up to ``1 + prefetch`` times its running batch's
  rows (all models together), as places free up: when an answer arrives, the next sentences
  leave in the same turn of the event loop. Under overload a turn of the loop takes a few hundred
  milliseconds of HTTP work (thousands of connections to read and refuse), and workers given half
  a batch ahead ran dry meanwhile (0.63-0.73x capacity at 2,048 connections); two batches ahead
  cover it.
- **Fair order** (``app.serving.fairqueue``): round-robin over the requests that have sentences
  waiting, one sentence per request per turn, so a one-line request waits behind at most one
  sentence of each other request, not behind whole documents; a worker takes what it was given
  in the same order, so the sentences given ahead do not undo it.
- **Deadlines and cancellation**: a request's sentences leave the queue, and its workers drop
  the ones they have, when its deadline passes or its client goes away.
- **Retries**: a worker that exits (a crash, a kill) is started again; its sentences, of every
  model, go back to the head of their model's queue, for another worker or the same one once back
  (``MAX_ATTEMPTS`` in all): nothing accepted is lost.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from app.monitoring.metrics import Metrics
from app.serving.errors import DeadlineExceeded, EngineError, EngineStopped, QueueFull, TooLarge
from app.serving.fairqueue import FairQueue
from app.serving.frontend.placement import ModelQueue, PlacedSentence, Request, Worker, WorkerState, homes
from app.serving.frontend.spreading import Spreading
from app.serving.protocol import (
    Answers,
    Cancel,
    Constraints,
    Done,
    Loaded,
    Sentence,
    SentenceResult,
    Translate,
)
from model.decoding.constraints import beam_for

log = logging.getLogger("uvicorn.error").getChild("scheduler")

__all__ = ["ModelQueue", "Request", "Scheduler", "Worker"]

MAX_ATTEMPTS = 3  # workers a sentence may be given to, when the ones before exited with it
RESTART_DELAYS_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)  # before each try to start a worker again
PREFETCH = 2.0  # rows given to a worker beyond its running batch, in batches


class Scheduler:
    def __init__(
        self,
        workers: Sequence[Worker],
        *,
        models: Sequence[str],
        max_queue: int,
        max_batch_size: int,
        prefetch: float = PREFETCH,
        metrics: Metrics | None = None,
    ) -> None:
        if not models:
            raise ValueError("the scheduler needs at least one model")
        capacity = max_batch_size + int(max_batch_size * prefetch)
        self.models: dict[str, ModelQueue] = {
            name: ModelQueue(name, FairQueue(), metrics.of_model(name) if metrics is not None else None)
            for name in models
        }
        self._turns: list[ModelQueue] = list(self.models.values())  # who goes first among equals
        self.workers = [WorkerState(worker, capacity, reserved=max_batch_size) for worker in workers]
        for state, home in zip(self.workers, homes(list(models), len(self.workers)), strict=True):
            state.home = frozenset(home)
            state.worker.home = home
            state.worker.listener = self
        self.max_batch_size = max_batch_size
        self.spreading = Spreading(self.workers, max_batch_size)  # which worker takes a sentence
        self.max_queue = max_queue
        self.metrics = metrics
        self.start_seconds = 0.0  # how long the workers took to start (load, compile, warm up)
        self._ids = itertools.count()
        self._entered = 0  # requests let in by ``enter`` and not admitted or refused yet
        self._stopping = False
        self._restarts: set[asyncio.Task[None]] = set()

    # -- workers ---------------------------------------------------------------------------------------
    async def start(self) -> list[Any]:
        """Start every worker (what each reports when ready, in order): the first alone, then the
        others together. The first compiles each model's decoding step (up to a minute of CPU per
        model), and the others load them from the on-disk cache in a second each instead of
        compiling them again, with the CPU that other work on the machine needs meanwhile (one
        model on 2 cores, empty cache: ready in 60-69 s against 76 s with every worker started at
        once). The first failure is raised, after stopping the others."""
        started = time.monotonic()
        reports: list[Any] = []
        first, *others = self.workers
        for group in ([first], others):
            done = await asyncio.gather(*(s.worker.start() for s in group), return_exceptions=True)
            failures = [e for e in done if isinstance(e, BaseException)]
            if failures:
                self.stop()
                raise failures[0]
            for state, report in zip(group, done, strict=True):
                self._loaded(state, report)
            reports += done
        self.start_seconds = time.monotonic() - started
        return reports

    @staticmethod
    def _loaded(state: WorkerState, report: Any) -> None:
        """What a worker reported when ready: the models it loaded at start, if it says."""
        state.loaded = frozenset(report) if isinstance(report, Mapping) else frozenset()

    def stop(self) -> None:
        """Stop the workers; whatever is not answered yet fails with ``EngineStopped``."""
        self._stopping = True
        for task in self._restarts:
            task.cancel()
        for state in self.workers:
            state.worker.stop()
        stopped = EngineStopped("the translation service stopped")
        given = {s.request for state in self.workers for s in state.sentences.values()}
        queued = [
            owner
            for model in self.models.values()
            for owner in [*model.queue.owners(), *model.background.owners()]
        ]
        for request in [*given, *queued]:
            self._fail(request, stopped)  # type: ignore[arg-type]

    @property
    def waiting(self) -> int:
        """Sentences in the queues, not given to a worker yet (every model's)."""
        return sum(model.waiting for model in self.models.values())

    @property
    def active(self) -> int:
        """Sentences given to workers and not finished."""
        return sum(len(s.sentences) for s in self.workers)

    @property
    def alive(self) -> bool:
        """Some worker is running, so every model can be translated (each worker serves them all;
        one that exited is being started again meanwhile)."""
        return not self._stopping and any(s.worker.running for s in self.workers)

    # -- admission -------------------------------------------------------------------------------------
    def has_room(self) -> bool:
        """Whether ``enter`` would let a request in now (nothing taken)."""
        return self.waiting + self._entered < self.max_queue

    def enter(self) -> bool:
        """Before a request's body is read: whether the queue has room for one more sentence,
        counting the requests let in before and not admitted yet; if so, it holds a place until
        ``leave``."""
        if self.waiting + self._entered >= self.max_queue:
            return False
        self._entered += 1
        return True

    def leave(self) -> None:
        """The request let in by ``enter`` is being admitted, or was refused, or failed."""
        self._entered -= 1

    def submit(
        self,
        sources: list[list[int]],
        *,
        beam_size: int,
        n_best: int,
        timeout_s: float | None = None,
        model: str | None = None,
        admitted: bool = False,
        constraints: Sequence[Constraints] | None = None,
        background: bool = False,
        scored: bool = False,
    ) -> Request:
        """Admit a request (source token ids, eos included, at least one) for ``model`` (None: the
        only one); its future gives the n-best of each source, in order, or raises
        ``DeadlineExceeded`` or ``EngineError``. Raises ``QueueFull``, ``TooLarge`` or
        ``EngineStopped`` at once. ``admitted``: the second hop of a request admitted before (a
        pivot, ``app.serving.frontend.pipeline``), whose sentences were counted then: not refused for a
        full queue, so that work already done is not thrown away (the queue may then hold up to
        these sentences more than ``max_queue``, until they leave it). ``constraints``: each
        source's (terminology); a constrained sentence takes the rows of the beam it needs
        (``beam_for``), and its result's hypotheses say where they realised them (``spans``).
        ``background``: a document job's sentences, which take what typed requests leave.
        ``scored``: their token log-probs asked for (``Sentence.scored``: greedy search then
        computes them; a beam's hypotheses carry them anyway)."""
        if self._stopping:
            raise EngineStopped("the translation service is shutting down")
        queue = self._model(model)
        n = len(sources)
        if n == 0:
            raise ValueError("a request needs at least one sentence")
        if constraints is not None and len(constraints) != n:
            raise ValueError(f"{len(constraints)} constraint lists for {n} sentences")
        wanted = constraints or [()] * n
        if n > self.max_queue:
            raise TooLarge(f"{n} sentences in one request; the queue holds at most {self.max_queue}")
        if not admitted and self.waiting + n > self.max_queue:
            raise QueueFull(f"{self.waiting} sentences are waiting (limit {self.max_queue})")
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        request = Request(next(self._ids), beam_size, n_best, loop.create_future(), [None] * n, queue, left=n)
        request.background = background
        if timeout_s is not None:
            request.deadline = now + timeout_s
            request.timer = loop.call_later(timeout_s, self._expire, request, timeout_s)
        rid, deadline, name = request.id, request.deadline, queue.name
        request.sentences = [
            PlacedSentence(
                Sentence(next(self._ids), rid, s, beam, n_best, deadline, now, name, c, background, scored),
                request,
                k,
            )
            for k, (s, c) in enumerate(zip(sources, wanted, strict=True))
            for beam in [beam_for(beam_size, len(c))]
        ]
        queue.queue_of(request).push(request, request.sentences)
        self._queued(queue)
        self._dispatch()
        return request

    def _model(self, name: str | None) -> ModelQueue:
        if name is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        queue = self.models.get(name) if name is not None else None
        if queue is None:
            raise ValueError(f"no model {name!r} (models: {', '.join(self.models)})")
        return queue

    def withdraw(self, request: Request) -> None:
        """Its client went away (or stopped waiting): drop what is left of it."""
        if not request.done:
            request.future.cancel()
        self._drop(request)

    async def translate(
        self,
        sources: list[list[int]],
        *,
        beam_size: int,
        n_best: int,
        timeout_s: float | None = None,
        model: str | None = None,
    ) -> list[SentenceResult]:
        """``submit`` and wait for the answer (withdrawn if the caller is cancelled)."""
        request = self.submit(sources, beam_size=beam_size, n_best=n_best, timeout_s=timeout_s, model=model)
        try:
            return await request.future
        finally:
            self.withdraw(request)

    # -- dispatch --------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Give waiting sentences to the workers that may take them: each time from the model with
        the fewest rows in the workers' hands (the first in turn among equals, which then goes last),
        in its queue's order, to the worker that holds the model loaded, then to the one with the
        most free rows."""
        batches: dict[int, tuple[WorkerState, list[PlacedSentence]]] = {}
        candidates = [m for m in self._turns if m.waiting]
        touched: list[ModelQueue] = []
        while candidates:
            model = min(candidates, key=lambda m: m.rows)  # (the first of the least served)
            # A typed sentence first; a document job's where a worker has room for it within its
            # share (a typed one that no worker may take now does not hold it back).
            state, source = None, model.queue
            sentence = source.peek()
            if sentence is not None:
                state = self.spreading.worker_for(model.name, sentence.rows)
            if state is None and (waiting := model.background.peek()) is not None:
                sentence, source = waiting, model.background
                state = self.spreading.worker_for(model.name, sentence.rows, background=True)
            if state is None or sentence is None:
                candidates.remove(model)  # none may take it now; the other models may still go
                continue
            source.pop()
            sentence.worker = state
            sentence.attempts += 1
            state.sentences[sentence.id] = sentence
            state.rows += sentence.rows
            state.background_rows += sentence.rows if sentence.request.background else 0
            state.held[model.name] = state.held.get(model.name, 0) + sentence.rows
            self.spreading.held_changed(state, model.name)
            model.rows += sentence.rows
            batches.setdefault(id(state), (state, []))[1].append(sentence)
            self._turns.remove(model)  # its turn is over
            self._turns.append(model)
            candidates.remove(model)
            if model.waiting:
                candidates.append(model)
            if model not in touched:
                touched.append(model)
        for model in touched:
            self._queued(model)
        for state, given in batches.values():
            if not state.worker.send(Translate(tuple(s.message for s in given))):
                state.unreachable = True  # gone meanwhile: its exit is on its way
                for sentence in given:
                    sentence.attempts -= 1  # it never reached the worker
                self._lost(state)

    def _queued(self, model: ModelQueue) -> None:
        if model.metrics is not None:
            model.metrics.queue_depth.set(model.waiting)

    def _release(self, state: WorkerState, sentence: PlacedSentence) -> None:
        """``sentence`` is no longer in ``state``'s hands (answered, withdrawn or lost)."""
        del state.sentences[sentence.id]
        state.rows -= sentence.rows
        state.background_rows -= sentence.rows if sentence.request.background else 0
        name = sentence.request.model.name
        state.held[name] -= sentence.rows
        if not state.held[name]:
            del state.held[name]
        self.spreading.held_changed(state, name)
        sentence.request.model.rows -= sentence.rows
        sentence.worker = None

    # -- answers ---------------------------------------------------------------------------------------
    def on_message(self, worker: Worker, message: Answers | Loaded) -> None:
        """A worker's answers (each sentence done with its n-best, or failed with the reason), or
        the models it holds now."""
        state = self._state(worker)
        if isinstance(message, Loaded):
            state.loaded = frozenset(message.models)
            if state.asked & state.loaded:  # a model it was asked to load: its sentences may go
                state.asked -= state.loaded
                self._dispatch()
            return
        for answer in message.results:
            sentence = state.sentences.get(answer.id)
            if sentence is None:
                continue  # withdrawn meanwhile
            self._release(state, sentence)
            request = sentence.request
            if request.done:
                continue
            if isinstance(answer, Done):
                request.results[sentence.index] = answer.result
                request.left -= 1
                if not request.left:
                    self._finish(request)
            else:
                self._fail(request, EngineError(answer.reason))
        self._dispatch()

    def _finish(self, request: Request) -> None:
        if request.timer is not None:
            request.timer.cancel()
        request.future.set_result([r for r in request.results if r is not None])

    def _fail(self, request: Request, error: BaseException) -> None:
        if not request.done:
            request.future.set_exception(error)
        self._drop(request)

    def _expire(self, request: Request, timeout_s: float) -> None:
        self._fail(request, DeadlineExceeded(f"not translated within {timeout_s:g} s"))

    def _drop(self, request: Request) -> None:
        """Take what is left of a request out of the queue and out of its workers."""
        if request.timer is not None:
            request.timer.cancel()
            request.timer = None
        model = request.model
        dropped = model.queue_of(request).drop(request)
        if dropped:
            if model.metrics is not None:
                model.metrics.sentences.labels("abandoned").inc(len(dropped))
            self._queued(model)
        cancels: dict[int, tuple[WorkerState, list[int]]] = {}
        for sentence in request.sentences:  # (not the workers' sentences: thousands under load)
            state = sentence.worker
            if state is not None and state.sentences.get(sentence.id) is sentence:
                self._release(state, sentence)
                cancels.setdefault(id(state), (state, []))[1].append(sentence.id)
        # PlacedSentence.request and Request.sentences form cycles: broken here, so that a finished
        # request is freed at once rather than by the cyclic garbage collector, whose full passes
        # over the objects of thousands of open connections held the event loop for 0.3-0.4 s
        # every 1.5 s under overload.
        request.sentences = []
        for state, sids in cancels.values():
            state.worker.send(Cancel(tuple(sids)))  # they stop costing model time
        if cancels:
            self._dispatch()

    # -- a worker that exits ---------------------------------------------------------------------------
    def on_exit(self, worker: Worker) -> None:
        log.error("%s (pid %s) exited; starting it again", worker.name, worker.pid)
        if self.metrics is not None and worker.pid is not None:
            self.metrics.process_exited(worker.pid)
        state = self._state(worker)
        self._lost(state)
        state.unreachable = False  # ``running`` says when it is back
        state.loaded, state.asked = frozenset(), set()
        task = asyncio.ensure_future(self._start_again(worker))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    def _lost(self, state: WorkerState) -> None:
        """The worker is gone with its sentences, of every model: back to the head of their model's
        queue, in order, for the other workers (or this one once it is back)."""
        lost: dict[Request, list[PlacedSentence]] = {}
        for sentence in sorted(state.sentences.values(), key=lambda s: (s.request.id, s.index)):
            lost.setdefault(sentence.request, []).append(sentence)
        for sentence in list(state.sentences.values()):
            self._release(state, sentence)
        touched: set[ModelQueue] = set()
        for request, sentences in reversed(lost.items()):  # the oldest request ends up first
            if request.done:
                continue
            attempts = max(s.attempts for s in sentences)
            if attempts >= MAX_ATTEMPTS:
                self._fail(request, EngineError(f"a worker exited while translating it, {attempts} times"))
                continue
            model = request.model
            if model.metrics is not None:
                model.metrics.retried.inc(len(sentences))
            model.queue_of(request).push(request, sentences, first=True)
            touched.add(model)
        for model in touched:
            self._queued(model)
        self._dispatch()

    async def _start_again(self, worker: Worker) -> None:
        for attempt in itertools.count():
            await asyncio.sleep(RESTART_DELAYS_S[min(attempt, len(RESTART_DELAYS_S) - 1)])
            if self._stopping:
                return
            try:
                report = await worker.start()
            except (RuntimeError, TimeoutError) as e:  # it stays down meanwhile; deadlines still hold
                log.error("%s could not be started again: %s", worker.name, e)
                continue
            self._loaded(self._state(worker), report)
            if self.metrics is not None:
                self.metrics.worker_restarts.inc()
            self._dispatch()
            return

    def _state(self, worker: Worker) -> WorkerState:
        return next(s for s in self.workers if s.worker is worker)
