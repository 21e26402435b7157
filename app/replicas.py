"""Model replicas in child processes: several running batches decoded in parallel (``NMT_REPLICAS``).

Why: on a 2-core CPU one replica spreading each decoding step over both cores (2 OpenMP threads)
wastes much of them: a step is ~75 small operators, each a parallel region whose threads meet at a
barrier, and whenever the event loop (HTTP, tokenization) takes a core, the other thread spins at
the barrier. Two replicas with one thread each have no barriers; in child processes they do not
share the event loop's GIL either (two model threads in one process spent ~40% of their time
waiting for it). At 64 concurrent clients: BENCHMARKS.md, "Levers measured".

Layout: every replica is a ``RemoteEngine``, a child process (``serve_replica``) that loads the
model and runs an ``Engine`` of its own; the service's process keeps HTTP, routing and metrics
(with the model in it too, the event loop and that model thread competed for the GIL: 64 clients,
3 interleaved runs, 162.3/197.6/161.3 sentences/s with both replicas in children against
139.5/179.2/153.6 with one in the service's process). Sentences go over a pipe as text (tokenizing
happens in the child too) and come back as ``SentenceResult``s. ``EnginePool`` gives each request
to the replica with the fewest sentences in flight. Metrics stay in the parent: a child records
what its engine reports (``MetricEvents``) and ships the events with its status every
``STATUS_INTERVAL_S``.

Messages (tuples, pickled by ``multiprocessing.Connection``):

- parent -> child: ``("translate", id, sentences, beam_size, n_best, timeout_s)``, ``("cancel", id)``,
  ``("stop",)``;
- child -> parent: ``("ready",)``, ``("failed", message)``, ``("done", id, results)``,
  ``("error", id, exception)``, ``("status", queue_depth, active_sequences, metric_events)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import signal
import threading
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

from app.config import Settings
from app.engine import (
    WARMUP_SENTENCES,
    DeadlineExceeded,
    Engine,
    EngineError,
    EngineStopped,
    SentenceResult,
    TranslationEngine,
    open_translator,
)
from app.metrics import Metrics
from app.model_thread import ModelThread

log = logging.getLogger("uvicorn.error").getChild("replicas")

STATUS_INTERVAL_S = 0.25  # how often a child reports its queue, its batch and its metric events
START_TIMEOUT_S = 300.0  # loading and warming up a replica
STOP_TIMEOUT_S = 30.0
DEADLINE_GRACE_S = 5.0  # past a request's deadline, stop waiting for a child that has not answered

# The engine metrics a child may report, with what the engine does to them (app.engine.Engine).
# Gauges (queue depth, active sequences) are not events: the pool sums the replicas' at scrape time.
ENGINE_EVENTS = {
    "queue_wait": "observe",
    "batch_size": "observe",
    "decode_steps": "inc",
    "input_tokens": "inc",
    "generated_tokens": "inc",
    "sentences": "inc",
}

MetricEvent = tuple[str, tuple[str, ...], float]  # (Metrics attribute, label values, amount)


# -- child side ------------------------------------------------------------------------------------
class _Recorder:
    """Stands for one prometheus metric of ``Metrics``: records inc/observe, ignores set."""

    def __init__(self, name: str, events: deque[MetricEvent], labels: tuple[str, ...] = ()) -> None:
        self.name, self.events, self.label_values = name, events, labels

    def labels(self, *values: str) -> _Recorder:
        return _Recorder(self.name, self.events, values)

    def inc(self, amount: float = 1.0) -> None:
        self.events.append((self.name, self.label_values, amount))

    observe = inc  # a histogram observation is (name, labels, value) too

    def set(self, value: float) -> None:
        pass  # gauges are reported as the replica's status


class MetricEvents:
    """The part of ``Metrics`` an ``Engine`` uses, recording into a queue the parent replays.
    A deque: the model thread appends while the child's event loop drains."""

    def __init__(self) -> None:
        self.events: deque[MetricEvent] = deque()
        for name in (*ENGINE_EVENTS, "queue_depth", "active_sequences"):
            setattr(self, name, _Recorder(name, self.events))

    def drain(self) -> list[MetricEvent]:
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out


def replay(metrics: Metrics, events: Sequence[MetricEvent]) -> None:
    """Apply a child's metric events to the service's metrics (unknown names are ignored)."""
    for name, labels, amount in events:
        op = ENGINE_EVENTS.get(name)
        if op is None:
            continue
        metric = getattr(metrics, name)
        if labels:
            metric = metric.labels(*labels)
        getattr(metric, op)(amount)


def serve_replica(settings: Settings, threads: int, conn: Connection) -> None:
    """The child process: load the model, then translate what the parent sends until it says stop
    or goes away."""
    # Ctrl-C in a terminal reaches the whole process group; the parent shuts its replicas down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        asyncio.run(_serve(settings, threads, conn))
    finally:
        conn.close()


async def _serve(settings: Settings, threads: int, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    model_thread = ModelThread(threads)

    def send(message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):  # the parent is gone: the reader thread says stop
            conn.send(message)

    engine: Engine | None = None
    try:
        translator = await model_thread.run(open_translator, settings)
        events = MetricEvents()
        engine = Engine.from_settings(
            translator, settings, metrics=cast(Metrics, events), model_thread=model_thread
        )
        engine.start()
        if settings.warmup:
            await engine.translate(WARMUP_SENTENCES, beam_size=1)
        events.drain()  # the warm-up is not traffic
    except Exception as e:  # reported to the parent, which fails its start-up with this message
        send(("failed", f"{type(e).__name__}: {e}"))
        if engine is not None:
            engine.stop()
        model_thread.shutdown()
        return

    inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

    # A thread, not the event loop's add_reader as in RemoteEngine: this end must keep reading even
    # while the loop blocks writing a reply to a parent that is not reading. If both ends read only
    # in their event loops, two full pipe buffers would leave each loop blocked in a write forever.
    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                message = ("stop",)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "stop":
                return

    async def translate(
        rid: int, sentences: list[str], beam: int, n_best: int, timeout: float | None
    ) -> None:
        try:
            results = await engine.translate(sentences, beam_size=beam, n_best=n_best, timeout_s=timeout)
            reply: tuple[Any, ...] = ("done", rid, results)
        except asyncio.CancelledError:
            return  # the parent cancelled it and waits for nothing
        except (EngineError, ValueError) as e:
            reply = ("error", rid, e)
        except Exception as e:  # pragma: no cover - Engine.translate raises the above only
            reply = ("error", rid, EngineError(f"translation failed: {e}"))
        finally:
            tasks.pop(rid, None)
        send(reply)

    async def report() -> None:
        while True:
            send(("status", engine.queue_depth, engine.active_sequences, events.drain()))
            await asyncio.sleep(STATUS_INTERVAL_S)

    tasks: dict[int, asyncio.Task[None]] = {}
    threading.Thread(target=read, name="nmt-replica-inbox", daemon=True).start()
    reporter = asyncio.create_task(report())
    send(("ready",))
    try:
        while True:
            message = await inbox.get()
            if message[0] == "translate":
                rid = message[1]
                tasks[rid] = asyncio.create_task(translate(*message[1:]))
            elif message[0] == "cancel" and message[1] in tasks:
                tasks[message[1]].cancel()
            elif message[0] == "stop":
                break
    finally:
        reporter.cancel()
        for task in list(tasks.values()):
            task.cancel()
        engine.stop()
        model_thread.shutdown()


# -- parent side -----------------------------------------------------------------------------------
class RemoteEngine:
    """A replica in a child process, with ``Engine``'s async interface."""

    def __init__(self, settings: Settings, *, threads: int, metrics: Metrics, name: str = "replica") -> None:
        self.settings, self.threads, self.metrics, self.name = settings, threads, metrics, name
        self._pending: dict[int, asyncio.Future[list[SentenceResult]]] = {}
        self._ids = itertools.count()
        self._queue_depth = self._active = 0  # as last reported by the child
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[None] | None = None
        self._running = False
        self._restart: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the child and wait until its model is loaded and warm; ``EngineError`` if it fails."""
        # spawn, not fork: a forked copy of a process that has started OpenMP and torch's threads
        # can deadlock; the child imports what it needs afresh.
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=serve_replica, args=(self.settings, self.threads, child_conn), name=self.name, daemon=True
        )
        self._process.start()
        child_conn.close()  # the child's end lives in the child now: EOF here when it exits
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        # Read in the event loop when the pipe is readable, not in a thread of our own: a reader
        # thread cost a wake-up of the loop and two GIL hand-overs per message.
        self._loop.add_reader(self._conn.fileno(), self._read)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        self._running = True

    @property
    def queue_depth(self) -> int:
        return self._queue_depth

    @property
    def active_sequences(self) -> int:
        return self._active

    @property
    def alive(self) -> bool:
        # Not Process.is_alive(): a waitpid per request showed in profiles. A child that exits
        # closes its end of the pipe, and the event loop reads EOF from it at once.
        return self._running

    async def translate(
        self, sentences: list[str], *, beam_size: int = 5, n_best: int = 1, timeout_s: float | None = None
    ) -> list[SentenceResult]:
        if not self.alive or self._loop is None:
            raise EngineStopped("the translation engine is not running")
        rid = next(self._ids)
        future: asyncio.Future[list[SentenceResult]] = self._loop.create_future()
        self._pending[rid] = future
        try:
            self._send(("translate", rid, sentences, beam_size, n_best, timeout_s))
            # The child enforces the deadline; this one only guards against a child that hangs.
            async with asyncio.timeout(None if timeout_s is None else timeout_s + DEADLINE_GRACE_S):
                return await future
        except (TimeoutError, asyncio.CancelledError) as e:  # the child drops the sentences too
            with contextlib.suppress(EngineError):
                self._send(("cancel", rid))
            if isinstance(e, TimeoutError):
                raise DeadlineExceeded(f"not translated within {timeout_s:g} s") from e
            raise  # cancelled: the client went away
        finally:
            self._pending.pop(rid, None)

    def stop(self) -> None:
        self._running = False  # first: the child's exit that follows is not a crash
        if self._restart is not None:
            self._restart.cancel()
        if self._process is None:
            return
        with contextlib.suppress(EngineError):
            self._send(("stop",))
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():  # pragma: no cover - a child that ignores "stop"
            self._process.terminate()
            self._process.join(STOP_TIMEOUT_S)
        self._close_pipe()
        self._fail_pending()

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            assert self._conn is not None
            self._conn.send(message)
        except (OSError, ValueError, AssertionError) as e:  # closed pipe or connection
            raise EngineStopped("the translation engine is not running") from e

    def _read(self) -> None:
        """The pipe is readable: hand the child's next message (or its exit) to ``_on_message``."""
        assert self._conn is not None
        try:
            message = self._conn.recv()  # the child writes whole messages: this does not wait long
        except (EOFError, OSError):
            self._close_pipe()
            message = ("exited",)
        self._on_message(message)

    def _close_pipe(self) -> None:
        if self._conn is None or self._conn.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())
        self._conn.close()

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind in ("done", "error"):
            future = self._pending.get(message[1])
            if future is not None and not future.done():
                if kind == "done":
                    future.set_result(message[2])
                else:
                    future.set_exception(message[2])
        elif kind == "status":
            self._queue_depth, self._active = message[1], message[2]
            replay(self.metrics, message[3])
        elif kind == "ready":
            assert self._ready is not None
            if not self._ready.done():
                self._ready.set_result(None)
        elif kind in ("failed", "exited"):
            reason = message[1] if kind == "failed" else "the replica process exited"
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(EngineError(f"{self.name}: {reason}"))
            crashed = kind == "exited" and self._running
            self._running = False
            self._fail_pending()
            if crashed:  # like a process supervisor: its requests failed, start a fresh one
                code = self._process.exitcode if self._process is not None else None
                log.error("%s exited (exit code %s); starting it again", self.name, code)
                self._restart = asyncio.ensure_future(self._start_again())

    async def _start_again(self) -> None:
        self._close_pipe()
        try:
            await self.start()
        except Exception as e:  # it stays down; the pool sends its share to the other replicas
            log.error("%s could not be started again: %s", self.name, e)

    def _fail_pending(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineStopped("the translation engine stopped"))


class EnginePool:
    """Several engines behind ``Engine``'s interface: each request goes, whole, to the running
    engine with the fewest of its sentences in flight (ties: the first)."""

    def __init__(self, engines: Sequence[TranslationEngine]) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)
        self._in_flight = [0] * len(self.engines)

    @property
    def queue_depth(self) -> int:
        return sum(e.queue_depth for e in self.engines)

    @property
    def active_sequences(self) -> int:
        return sum(e.active_sequences for e in self.engines)

    @property
    def alive(self) -> bool:
        """Some engine can translate (a replica that died is being started again meanwhile)."""
        return any(e.alive for e in self.engines)

    async def translate(
        self, sentences: list[str], *, beam_size: int = 5, n_best: int = 1, timeout_s: float | None = None
    ) -> list[SentenceResult]:
        running = [i for i, e in enumerate(self.engines) if e.alive]
        if not running:
            raise EngineStopped("the translation engine is not running")
        i = min(running, key=self._in_flight.__getitem__)
        self._in_flight[i] += len(sentences)
        try:
            return await self.engines[i].translate(
                sentences, beam_size=beam_size, n_best=n_best, timeout_s=timeout_s
            )
        finally:
            self._in_flight[i] -= len(sentences)

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()
