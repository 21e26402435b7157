"""A model worker seen from the front end: start its process, send it messages, hear its answers.

Why a process: the HTTP front end's event loop and a model thread in one process share one
interpreter lock. Under overload the loop is always busy (parsing requests, answering 503s), and a
thread that wants the lock back waits up to the interpreter's switch interval (5 ms) for it at
each of a decoding step's ~75 operator calls: at 2,048 connections a model in the front end's
process answered 2.9 sentences/s, under 1% of its capacity. In a process of its own the model
shares nothing with HTTP but the CPU, and of that it gets what the front end leaves: a worker runs
at a lower priority (``WORKER_NICENESS``), so that when the workers keep every core busy the event
loop that answers ``/health`` and admits or refuses requests still gets a core as soon as it has
work (at 2,048 connections on 2 cores, the slowest ``/health`` 31 -> 17 ms, ``benchmarks.overload``).

No torch here: the child's side is named, not imported (``WORKER_ENTRY``); the process's target,
``_serve``, imports it by that name in the child only. What travels on the pipe is
``app.serving.protocol``'s.
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Protocol

from app.config import Settings
from app.serving.cores import CoreShare
from app.serving.protocol import (
    Answers,
    FromWorker,
    Loaded,
    ModelDescription,
    ModelSpec,
    Ready,
    Sentence,
    StartFailed,
    Stop,
    ToWorker,
    Translate,
)
from app.serving.protocol import (
    send as send_message,
)

START_TIMEOUT_S = 300.0  # loading and warming up a worker's models, each (so many more for many)
STOP_TIMEOUT_S = 30.0
# Worker processes are started from this thread: starting one (fork and exec) takes tens of
# milliseconds that the event loop, answering requests meanwhile, should not wait for.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nmt-spawner")
# The child process's entry point, ``module:function`` (``serve_worker``'s signature): a name, so
# that the front end's modules import nothing of the worker's (``lint-imports`` checks it).
WORKER_ENTRY = "app.serving.worker.process:serve_worker"
# Added to a worker's nice value, before it starts any thread (Linux's nice is per thread and
# inherited): against the front end's weight of 1024 it weighs 335. Never above a document
# reader's (``app.formats.sandbox.NICENESS``), so that a document never slows a typed line.
WORKER_NICENESS = 5


class Listener(Protocol):
    """Who hears a worker (the scheduler): its answers, the models it holds, and its exit while it
    was running."""

    def on_message(self, worker: WorkerThread, message: Answers | Loaded) -> None: ...

    def on_exit(self, worker: WorkerThread) -> None: ...


def _serve(entry: str, *args: object) -> None:
    """The child process's target: import the worker's entry point by its name, in the child only
    (what imports torch and the models never loads in the front end), and run it, at a lower CPU
    priority than the front end's."""
    os.nice(WORKER_NICENESS)
    module, function = entry.split(":")
    getattr(importlib.import_module(module), function)(*args)


class WorkerProcess:
    """One worker process and its workers (``workers``: one ``WorkerThread`` per decoding thread in
    it, each with a pipe of its own), seen from the front end's event loop. The process is started
    by its workers' first ``start`` (and again by the first after it exited); when one of its pipes
    reaches its end, the process is gone and each of its workers exits (``Listener.on_exit``)."""

    def __init__(
        self,
        settings: Settings,
        models: tuple[ModelSpec, ...],
        *,
        threads: int | None,
        metrics_dir: str,
        name: str,
        workers: int = 1,
        cores: Sequence[CoreShare | None] = (),
    ) -> None:
        self.settings, self.threads, self.metrics_dir, self.name = settings, threads, metrics_dir, name
        self.models = models
        self.workers = [
            WorkerThread(self, name if workers == 1 else f"{name}.{i}", cores[i] if i < len(cores) else None)
            for i in range(workers)
        ]
        self.process: multiprocessing.process.BaseProcess | None = None
        self._launching: asyncio.Future[None] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def launch(self) -> None:
        """Start the process for every one of its workers, unless it runs (or is starting)."""
        if self._launching is not None and not self._launching.done():
            return await asyncio.shield(self._launching)
        if self.process is not None and self.process.is_alive() and any(w.attached for w in self.workers):
            return None
        loop = asyncio.get_running_loop()
        self._launching = loop.create_future()
        try:
            await self._start(loop)
            self._launching.set_result(None)
        except BaseException as e:
            self._launching.set_exception(e)
            self._launching.exception()  # (retrieved: the workers' starts raise it)
            raise
        return None

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        # spawn, not fork: a forked copy of a process that has started OpenMP and torch's threads
        # can deadlock; the child imports what it needs afresh.
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe() for _ in self.workers]
        self.process = context.Process(
            target=_serve,
            args=(
                WORKER_ENTRY,
                self.settings,
                self.models,
                self.threads,
                self.metrics_dir,
                [child for _, child in pipes],
                [w.cores for w in self.workers],
                [w.home for w in self.workers],
            ),
            name=self.name,
            daemon=True,
        )
        await loop.run_in_executor(_SPAWNER, self.process.start)
        for worker, (conn, child) in zip(self.workers, pipes, strict=True):
            child.close()  # the child's end lives in the child now: end of file here when it exits
            worker.attach(conn, loop)

    def exited(self) -> None:
        """A pipe reached its end: the process is gone, and each of its workers with it."""
        for worker in self.workers:
            worker.exited()

    def stopped(self) -> None:
        """A worker was stopped: once every one is, the process ends."""
        if self.process is None or any(w.attached for w in self.workers):
            return
        if self.process.pid is None:  # never started (another worker's start failed first)
            return
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():  # pragma: no cover - a worker that ignores Stop
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)


class WorkerThread:
    """One worker, a decoding thread of a ``WorkerProcess``, serving every model, seen from the
    front end's event loop: start it, send it messages, and tell ``listener`` (the scheduler) what
    it answers and which models it holds (``on_message``) and when it exits (``on_exit``)."""

    def __init__(self, process: WorkerProcess, name: str, cores: CoreShare | None = None) -> None:
        self.host, self.name, self.cores = process, name, cores
        self.models = process.models
        self.listener: Listener | None = None
        # The models it loaded at start, as it described them when ready (the others load on demand).
        self.descriptions: dict[str, ModelDescription] = {}
        self.queued: tuple[str, ...] = ()  # the models it loads in the background once ready
        # Its own models (``placement.homes``, set by the scheduler): the first loaded at start,
        # the others in the background; () for every model, in order.
        self.home: tuple[str, ...] = ()
        self.running = False  # ready, and not stopped or exited since
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[dict[str, ModelDescription]] | None = None
        self._outbox: list[Sentence] = []  # given this loop turn, written at the start of the next

    @property
    def pid(self) -> int | None:
        return self.host.pid

    @property
    def process(self) -> multiprocessing.process.BaseProcess | None:
        return self.host.process

    @property
    def attached(self) -> bool:
        """Its pipe to the process is open."""
        return self._conn is not None and not self._conn.closed

    def attach(self, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
        """Its end of a pipe to the process just started: read in the event loop when readable."""
        self._conn, self._loop = conn, loop
        self._ready = loop.create_future()
        # Read in the event loop when the pipe is readable: no thread, no lock hand-over per message.
        loop.add_reader(conn.fileno(), self._read)

    async def start(self) -> dict[str, ModelDescription]:
        """Start its process (unless it runs already) and wait until the models this worker loads
        at start are loaded and warm (their descriptions, by name); ``RuntimeError`` with the
        worker's reason if it fails."""
        try:
            await self.host.launch()
            assert self._ready is not None
            timeout = START_TIMEOUT_S * len(self.models)
            self.descriptions = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except BaseException:
            self.stop()
            raise
        self.running = True
        return self.descriptions

    def send(self, message: ToWorker) -> bool:
        """Send ``message``; False if the worker is gone (its exit is being handled).

        The sentences of a ``Translate`` join those given to this worker in the same loop turn
        (each request is dispatched as it is admitted, several in a turn under load): written
        together at the start of the next turn, one message, one write and one read in the worker.
        Any other message is written now, after them. Where that write fails, the worker's exit
        (the pipe's end of file, read by the loop) gives them to another (``Scheduler.on_exit``)."""
        if isinstance(message, Translate) and self._loop is not None:
            if not self.attached:
                return False
            if not self._outbox:
                self._loop.call_soon(self._flush)
            self._outbox.extend(message.sentences)
            return True
        self._flush()
        return self._write(message)

    def _flush(self) -> None:
        if self._outbox:
            sentences, self._outbox = tuple(self._outbox), []
            self._write(Translate(sentences))

    def _write(self, message: ToWorker) -> bool:
        try:
            assert self._conn is not None
            send_message(self._conn, message)
            return True
        except (OSError, ValueError, AssertionError):  # closed pipe or connection
            return False

    def stop(self) -> None:
        self.running = False  # first: the exit that follows is not a crash
        if self.attached:
            self.send(Stop())
        self._close_pipe()
        self.host.stopped()

    def _read(self) -> None:
        """The pipe is readable: every message waiting there (a loop busy with thousands of
        connections calls this once per turn), or the process's exit."""
        conn = self._conn
        assert conn is not None
        try:
            while not conn.closed and conn.poll(0):
                self._dispatch(conn.recv())  # the worker writes whole messages: this does not wait long
        except (EOFError, OSError):
            self.host.exited()

    def _dispatch(self, message: FromWorker) -> None:
        match message:
            case Ready(models, queued):
                if self._ready is not None and not self._ready.done():
                    self.queued = queued
                    self._ready.set_result(dict(models))
            case StartFailed(reason):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_exception(RuntimeError(f"{self.name}: {reason}"))
            case Answers() | Loaded():
                if self.listener is not None:
                    self.listener.on_message(self, message)

    def exited(self) -> None:
        if not self.attached:  # stopped, or told already
            return
        self._close_pipe()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"{self.name}: the worker process exited"))
            return
        crashed = self.running
        self.running = False
        if crashed and self.listener is not None:
            self.listener.on_exit(self)

    def _close_pipe(self) -> None:
        self._outbox = []  # (given back by the exit's handling, or failed by the stop's)
        if self._conn is None or self._conn.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())
        self._conn.close()
