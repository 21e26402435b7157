"""The process boundary: a model worker in a child process, and its handle in the front end.

Why a process: the HTTP front end's event loop and a model thread in one process share one
interpreter lock. Under overload the loop is always busy (parsing requests, answering 503s), and a
thread that wants the lock back waits up to the interpreter's switch interval (5 ms) for it at
each of a decoding step's ~75 operator calls: at 2,048 connections the model answered 2.9
sentences/s, under 1% of its capacity (BENCHMARKS.md, "Overload"). In a process of its own the
model shares nothing with HTTP but the CPU.

A worker loads the model on its main thread, which then runs every decoding step (one thread for
all torch work: OpenMP slows down once two threads have started parallel regions). A second thread
only reads the pipe into the ``Inbox``: it must keep reading even while the main thread blocks
writing answers to a front end that is busy, or two full pipe buffers would block both processes
for good. Messages (tuples, pickled by ``multiprocessing.Connection``):

- front end -> worker: ``("translate", [(id, request id, source ids, beam_size, n_best, deadline,
  enqueued), ...])`` (deadline and enqueued: ``time.monotonic()``, one clock for every process here),
  ``("cancel", [id, ...])``, ``("stop",)``;
- worker -> front end: ``("ready", description)``, ``("failed", reason)`` (it could not start), and
  after each decoding step that finished sentences, ``("answers", [("done", id, n-best) |
  ("failed", id, reason), ...])``.

A worker ignores SIGINT and SIGTERM: a terminal's Ctrl-C or a service manager signals the whole
process group, and the front end decides when its workers stop (after draining its requests).
When the front end is gone, the pipe's end of file stops the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from app.config import Settings
from app.metrics import Metrics, process_metrics
from app.serving.cores import CoreShare
from app.serving.executor import Executor, Job
from app.serving.fairqueue import FairQueue, Policy
from model.decoding.translator import Translator

log = logging.getLogger("uvicorn.error").getChild("worker")

START_TIMEOUT_S = 300.0  # loading and warming up a worker
STOP_TIMEOUT_S = 30.0
# Translated once before a worker reports ready: the first request should not pay for lazy
# initialisation (allocator, kernels, thread pools).
WARMUP_SENTENCES = ["Hallo Welt."]
# Worker processes are started from this thread: starting one (fork and exec) takes tens of
# milliseconds that the event loop, answering requests meanwhile, should not wait for.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nmt-spawner")


@dataclass(frozen=True)
class ModelSpec:
    """The model a worker serves: its directory, and its name for the scheduler and metrics."""

    name: str
    path: Path


@dataclass(frozen=True)
class ModelDescription:
    """What a worker runs, as it reports it when ready (for /info and the model metric)."""

    device: str
    dtype: str
    quantization: str
    decoding: str = "eager"  # or "compiled" (model.static_slots)
    compile_seconds: float = 0.0  # how long compiling the decoding step took at start-up


def open_translator(settings: Settings, model_dir: Path) -> Translator:
    """The model in ``model_dir`` as a worker runs it with ``settings``, its decoding step made
    (compiled or loaded from the cache where ``NMT_COMPILE``, on CPU and CUDA alike; eager where
    compiling fails) and warmed up."""
    translator = Translator.load(
        model_dir,
        device=settings.device,
        dtype=settings.dtype,
        quantization=settings.quantization,
        options=settings.decode_options(),
        capacity=max(settings.max_batch_size, settings.max_beam_size),
        max_beam_size=settings.max_beam_size,
        compile=settings.compile,
        cache_dir=settings.compile_cache_dir,
    )
    translator.runner  # noqa: B018 - made now, before the worker reports ready
    return translator


def describe(translator: Translator) -> ModelDescription:
    runner = translator.runner
    return ModelDescription(
        device=str(translator.device),
        dtype=str(translator.dtype).removeprefix("torch."),
        quantization=translator.quantization,
        decoding=runner.kind,
        compile_seconds=round(runner.compile_seconds, 1),
    )


@dataclass(eq=False)
class WorkerJob:
    """A sentence the front end gave this worker."""

    id: int
    request: int  # the request it belongs to
    src: list[int]  # source ids, eos included
    beam_size: int
    n_best: int
    deadline: float | None
    enqueued: float
    cancelled: bool = field(default=False)

    def expired(self, now: float) -> bool:
        return self.cancelled or (self.deadline is not None and now > self.deadline)


class Inbox:
    """The sentences given to this worker and not taken into its batch yet, in the order the front
    end's scheduler uses (``app.serving.fairqueue``, round-robin over requests by default): the
    front end gives a worker up to two batches ahead, and a one-line request given after a document
    must still join before the rest of the document. The pipe's reader thread adds and cancels;
    the model thread takes."""

    def __init__(self, metrics: Metrics | None = None, policy: Policy = "fair") -> None:
        self.metrics = metrics
        self._queue: FairQueue[WorkerJob] = FairQueue(policy)
        self._rows = 0  # rows of the jobs in the queue
        self._by_id: dict[int, WorkerJob] = {}  # every job given and not finished
        self._cond = threading.Condition()
        self._stopping = False

    def add(self, jobs: list[WorkerJob]) -> None:
        with self._cond:
            by_request: dict[int, list[WorkerJob]] = {}
            for job in jobs:
                by_request.setdefault(job.request, []).append(job)
                self._by_id[job.id] = job
            for rid, mine in by_request.items():
                self._queue.push(rid, mine)
            self._rows += sum(j.beam_size for j in jobs)
            self._cond.notify()

    def cancel(self, ids: list[int]) -> None:
        """Drop these jobs: waiting ones when they come up, running ones at the executor's next step."""
        with self._cond:
            for jid in ids:
                job = self._by_id.pop(jid, None)
                if job is not None:
                    job.cancelled = True
            self._cond.notify()

    def release(self, job: Job) -> bool:
        """Forget a job that left the batch; False if it had been cancelled (nobody waits for it)."""
        with self._cond:
            return self._by_id.pop(job.id, None) is not None

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # -- what the executor uses ------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._queue)

    def wait(self, busy: Callable[[], bool]) -> bool:
        """Block until jobs wait or ``busy()`` (a batch is running); False once stopping."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or len(self._queue) > 0 or busy())
            return not self._stopping

    def wait_for_more(self, rows: int, timeout: float) -> None:
        """Block until ``rows`` rows' worth of jobs wait, for at most ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or self._rows >= rows, timeout)

    def take(self, fits: Callable[[Job], bool]) -> list[Job]:
        """Jobs in the queue's order for as long as ``fits(job)``; cancelled or expired ones are
        dropped on the way."""
        taken: list[Job] = []
        now = time.monotonic()
        with self._cond:
            while (job := self._queue.peek()) is not None:
                if job.expired(now):
                    self._pop()
                    self._by_id.pop(job.id, None)
                    if self.metrics is not None:
                        self.metrics.sentences.labels("abandoned").inc()
                    continue
                if not fits(job):
                    break
                taken.append(self._pop())
        return taken

    def _pop(self) -> WorkerJob:
        job = self._queue.pop()
        self._rows -= job.beam_size
        return job


# -- the worker process ----------------------------------------------------------------------------
def serve_worker(
    settings: Settings,
    model: ModelSpec,
    threads: int | None,
    metrics_dir: str,
    conn: Connection,
    cores: CoreShare | None = None,
) -> None:
    """The child process: load the model, report ready, then translate what the front end gives
    until it says stop or goes away. ``cores``: its slot on the front end's ``CoreBoard`` (on CPU),
    to run on the idle workers' cores too while it is the only one at work."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    try:
        metrics = process_metrics(metrics_dir).of_model(model.name)
        inbox = Inbox(metrics, settings.scheduling)
        translator = open_translator(settings, model.path)
        executor = Executor.from_settings(translator, inbox, settings, metrics=None)
        if settings.warmup:  # without metrics: the warm-up is not traffic
            warm_up(executor, inbox)
        executor.metrics = metrics
    except Exception as e:  # the front end fails its start-up with this reason
        with contextlib.suppress(OSError):
            conn.send(("failed", f"{type(e).__name__}: {e}"))
        conn.close()
        return
    conn.send(("ready", describe(translator)))
    threading.Thread(target=_read, args=(conn, inbox), name="nmt-worker-inbox", daemon=True).start()
    if cores is not None:
        cores.starting()
    try:
        with torch.inference_mode():
            while inbox.wait(lambda: executor.busy):
                if cores is not None:
                    cores.update(busy=True)
                answers: list[tuple[Any, ...]] = []
                for job, result in executor.iteration():
                    if not inbox.release(job):
                        continue
                    if isinstance(result, BaseException):
                        answers.append(("failed", job.id, str(result)))
                    else:
                        answers.append(("done", job.id, result))
                if cores is not None and not executor.busy and not inbox.waiting:
                    cores.update(busy=False)  # going to sleep: its core is free for the others
                if answers:
                    with contextlib.suppress(OSError):  # the front end is gone: the reader stops us
                        conn.send(("answers", answers))
    finally:
        if cores is not None:
            cores.update(busy=False)
        conn.close()


def warm_up(executor: Executor, inbox: Inbox) -> None:
    translator = executor.translator
    src = translator.source_ids(WARMUP_SENTENCES, target=translator.info.directions[0][1])
    inbox.add([WorkerJob(-1 - i, -1, s, 1, 1, None, time.monotonic()) for i, s in enumerate(src)])
    with torch.inference_mode():
        while inbox.waiting or executor.busy:
            for job, result in executor.iteration():
                inbox.release(job)
                if isinstance(result, BaseException):
                    raise result


def _read(conn: Connection, inbox: Inbox) -> None:
    """The pipe's reader: jobs and cancellations go to the inbox at once."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the front end is gone
            message = ("stop",)
        kind = message[0]
        if kind == "translate":
            inbox.add([WorkerJob(*fields) for fields in message[1]])
        elif kind == "cancel":
            inbox.cancel(message[1])
        elif kind == "stop":
            inbox.stop()
            return


# -- the front end's handle ------------------------------------------------------------------------
class WorkerProcess:
    """One worker process, seen from the front end's event loop: start it, send it messages, and
    tell ``listener`` (the scheduler) what it answers (``on_message``) and when it exits
    (``on_exit``)."""

    def __init__(
        self,
        settings: Settings,
        spec: ModelSpec,
        *,
        threads: int | None,
        metrics_dir: str,
        name: str,
        cores: CoreShare | None = None,
    ) -> None:
        self.settings, self.threads, self.metrics_dir, self.name = settings, threads, metrics_dir, name
        self.cores = cores
        self.spec = spec
        self.model = spec.name  # the scheduler's key: this worker's model
        self.listener: Any = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self.description: ModelDescription | None = None
        self.running = False  # ready, and not stopped or exited since
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[ModelDescription] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def start(self) -> ModelDescription:
        """Start the process and wait until its model is loaded and warm; ``RuntimeError`` with the
        worker's reason if it fails."""
        # spawn, not fork: a forked copy of a process that has started OpenMP and torch's threads
        # can deadlock; the child imports what it needs afresh.
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=serve_worker,
            args=(self.settings, self.spec, self.threads, self.metrics_dir, child_conn, self.cores),
            name=self.name,
            daemon=True,
        )
        self._loop = asyncio.get_running_loop()
        await self._loop.run_in_executor(_SPAWNER, self.process.start)
        child_conn.close()  # the child's end lives in the child now: end of file here when it exits
        self._ready = self._loop.create_future()
        # Read in the event loop when the pipe is readable: no thread, no lock hand-over per message.
        self._loop.add_reader(self._conn.fileno(), self._read)
        try:
            self.description = await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        self.running = True
        return self.description

    def send(self, message: tuple[Any, ...]) -> bool:
        """Send ``message`` now; False if the worker is gone (its exit is being handled)."""
        try:
            assert self._conn is not None
            self._conn.send(message)
            return True
        except (OSError, ValueError, AssertionError):  # closed pipe or connection
            return False

    def stop(self) -> None:
        self.running = False  # first: the exit that follows is not a crash
        if self.process is None:
            return
        if self.process.pid is None:  # never started (another worker's start failed first)
            self._close_pipe()
            return
        self.send(("stop",))
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():  # pragma: no cover - a worker that ignores "stop"
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)
        self._close_pipe()

    def _read(self) -> None:
        """The pipe is readable: every message waiting there (a loop busy with thousands of
        connections calls this once per turn), or the worker's exit."""
        conn = self._conn
        assert conn is not None
        try:
            while not conn.closed and conn.poll(0):
                self._dispatch(conn.recv())  # the worker writes whole messages: this does not wait long
        except (EOFError, OSError):
            self._exited()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(message[1])
        elif kind == "failed":
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(RuntimeError(f"{self.name}: {message[1]}"))
        elif self.listener is not None:
            self.listener.on_message(self, message)

    def _exited(self) -> None:
        self._close_pipe()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"{self.name}: the worker process exited"))
            return
        crashed = self.running
        self.running = False
        if crashed and self.listener is not None:
            self.listener.on_exit(self)

    def _close_pipe(self) -> None:
        if self._conn is None or self._conn.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())
        self._conn.close()
