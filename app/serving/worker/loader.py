"""Models opened off the decode loop: threads of the worker's own open models (weights read, linear
layers packed, the step made or loaded, one sentence translated) while the model thread keeps
stepping the models already held. Loading on the model thread held every other model's batch for
the whole load (5-10 s at OPUS-MT's size on 2 cores).

The loader only opens: what the worker holds (``ModelTable``) changes on the model thread alone,
which takes finished loads with ``done`` before each step. Two threads open, one model each at a
time:

- **urgent**: a model a sentence waits for (``want(urgent=True)``), opened at once, at the
  worker's own priority;
- **background**: models loaded ahead of need (after start), begun only while the worker (and,
  in a server, every worker of the machine: ``CoreShare.machine_idle``) is ``idle`` and no urgent
  load runs, at a lower CPU priority (``BACKGROUND_NICE``): a load takes
  ~1 s of a core, and under a steady one-pair load the background loads of the other 19 models
  made its p99 9x (3.2 s against 0.35 s; AVX-512 VNNI, 2 workers on 2 cores) while they ran at
  the same priority as decoding. A load begun while the worker was idle goes on when work
  arrives; niced, it takes what the decoding threads (and the front end, and the other workers)
  leave. A thread's priority can be lowered but not raised again without privileges, hence a
  thread per kind; a sentence that comes to wait for the model the background thread is opening
  has it opened again at once by the urgent thread, and the first of the two to finish is kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.serving.protocol import ModelSpec
from model.decoding.translator import Translator
from model.runtime import lower_priority

log = logging.getLogger("uvicorn.error").getChild("worker")


@dataclass(frozen=True)
class Opened:
    """A finished load: the model, or why it could not be opened, and how long it took."""

    name: str
    result: Translator | BaseException
    seconds: float


BACKGROUND_NICE = 10  # added to the background thread's nice value (Linux: per thread)
URGENT, BACKGROUND = "urgent", "background"


class Loader:
    """``want`` a model, get it from ``done`` once opened; ``wake`` is called after each load (the
    worker's inbox: its model thread may wait for nothing else)."""

    IDLE_POLL_S = 0.1  # how often a background load waiting for the worker to be idle looks again

    def __init__(self, opener: Callable[[ModelSpec], Translator], wake: Callable[[], None]) -> None:
        self.opener = opener
        self.wake = wake
        # Whether the worker has nothing to step (set by the worker once its executor exists):
        # loads ahead of need wait for it.
        self.idle: Callable[[], bool] = lambda: True
        # Called as each load begins (the worker marks its core taken: ``app.serving.cores``).
        self.on_start: Callable[[], None] = lambda: None
        self._queue: deque[ModelSpec] = deque()
        self._urgent: set[str] = set()  # of the queue: models a sentence waits for
        self._current: dict[str, str] = {}  # thread (URGENT, BACKGROUND) -> the model it opens
        self._superseded: set[str] = set()  # opened by both threads, one finished: drop the other
        self._done: list[Opened] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._run, args=(kind,), name=f"nmt-worker-loader-{kind}", daemon=True)
            for kind in (URGENT, BACKGROUND)
        ]
        for thread in self._threads:
            thread.start()

    def want(self, spec: ModelSpec, urgent: bool = True) -> None:
        """Open ``spec`` after the loads queued before it, or before them all when ``urgent``; a
        model queued already only moves to the front (when ``urgent``)."""
        with self._cond:
            if spec.name == self._current.get(URGENT) or (
                not urgent and spec.name == self._current.get(BACKGROUND)
            ):
                return
            queued = next((s for s in self._queue if s.name == spec.name), None)
            if queued is not None:
                if not urgent:
                    return
                self._queue.remove(queued)
            if urgent:
                self._queue.appendleft(spec)
                self._urgent.add(spec.name)
            else:
                self._queue.append(spec)
            self._cond.notify_all()

    def loading(self, name: str) -> bool:
        """Being opened now, or queued for a sentence that waits for it. (Queued ahead of need, it
        is not: the model thread must ask for it again, as urgent, or it would wait for an idle
        worker that its own waiting sentence keeps busy.)"""
        with self._cond:
            return name in self._current.values() or name in self._urgent

    @property
    def pending(self) -> list[str]:
        """The models queued or being opened, those being opened first."""
        with self._cond:
            current = list(dict.fromkeys(self._current.values()))
            return current + [s.name for s in self._queue if s.name not in current]

    @property
    def active(self) -> bool:
        """A load is under way."""
        with self._cond:
            return bool(self._current)

    @property
    def finished(self) -> bool:
        """Loads finished and not taken by ``done`` yet."""
        with self._cond:
            return bool(self._done)

    def done(self) -> list[Opened]:
        """The loads finished since the last call."""
        with self._cond:
            done, self._done = self._done, []
            return done

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._urgent.clear()
            self._cond.notify_all()

    def _next(self, kind: str) -> ModelSpec | None:
        """The load ``kind``'s thread may begin now: for the urgent thread, one a sentence waits
        for; for the background one, the next ahead of need while the worker is idle and no urgent
        load runs."""
        if not self._queue:
            return None
        first = self._queue[0]
        if kind == URGENT:
            return first if first.name in self._urgent else None
        if first.name in self._urgent or URGENT in self._current or not self.idle():
            return None
        return first

    def _run(self, kind: str) -> None:
        if kind == BACKGROUND:
            lower_priority(BACKGROUND_NICE)
        while True:
            with self._cond:
                while (spec := self._next(kind)) is None:
                    if self._stopping:
                        return
                    # Nothing to do: until ``want`` (or the end of an urgent load). Loads ahead of
                    # need: until the worker is idle, looked at again every IDLE_POLL_S (nothing
                    # tells the loader it became idle).
                    waits_for_idle = kind == BACKGROUND and bool(self._queue)
                    self._cond.wait(self.IDLE_POLL_S if waits_for_idle else None)
                if self._stopping:
                    return
                self._queue.popleft()
                self._urgent.discard(spec.name)
                self._current[kind] = spec.name
            started = time.monotonic()
            self.on_start()
            result: Translator | BaseException
            try:
                # A thread starts outside inference mode, as loading must be: weights made under it
                # are inference tensors, and exporting the step to compile it fails on those.
                assert not torch.is_inference_mode_enabled()
                result = self.opener(spec)
            except Exception as e:  # the model's sentences fail with the reason, the others go on
                log.exception("cannot load model %s", spec.name)
                result = e
            with self._cond:
                del self._current[kind]
                if spec.name in self._superseded:  # the other thread's copy was kept
                    self._superseded.discard(spec.name)
                else:
                    if spec.name in self._current.values():  # the other thread opens it too
                        self._superseded.add(spec.name)
                    self._done.append(Opened(spec.name, result, time.monotonic() - started))
                self._cond.notify_all()  # (an urgent load's end lets the background thread go on)
            self.wake()
