"""Models opened off the decode loop: a thread of the worker's own opens one model at a time
(weights read, linear layers packed, the step made or loaded, one sentence translated) while the
model thread keeps stepping the models already held. Loading on the model thread held every other
model's batch for the whole load (5-10 s at OPUS-MT's size on 2 cores).

The loader only opens: what the worker holds (``ModelTable``) changes on the model thread alone,
which takes finished loads with ``done`` before each step. A model a sentence waits for goes to the
front of the queue (``want(urgent=True)``) and is opened at once. Those loaded ahead of need (after
start) wait behind, and are opened only while the worker is ``idle``: a load takes ~1 s of a core,
and under a steady one-pair load the background loads of the other 19 models made its p99 9x
(3.2 s against 0.35 s; AVX-512 VNNI, 2 workers on 2 cores).
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

log = logging.getLogger("uvicorn.error").getChild("worker")


@dataclass(frozen=True)
class Opened:
    """A finished load: the model, or why it could not be opened, and how long it took."""

    name: str
    result: Translator | BaseException
    seconds: float


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
        self._queue: deque[ModelSpec] = deque()
        self._urgent: set[str] = set()  # of the queue: models a sentence waits for
        self._current: str | None = None
        self._done: list[Opened] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nmt-worker-loader", daemon=True)
        self._thread.start()

    def want(self, spec: ModelSpec, urgent: bool = True) -> None:
        """Open ``spec`` after the loads queued before it, or before them all when ``urgent``; a
        model queued already only moves to the front (when ``urgent``)."""
        with self._cond:
            if spec.name == self._current:
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
            self._cond.notify()

    def loading(self, name: str) -> bool:
        """Being opened now, or queued for a sentence that waits for it. (Queued ahead of need, it
        is not: the model thread must ask for it again, as urgent, or it would wait for an idle
        worker that its own waiting sentence keeps busy.)"""
        with self._cond:
            return name == self._current or name in self._urgent

    @property
    def pending(self) -> list[str]:
        """The models queued or being opened, the one being opened first."""
        with self._cond:
            current = [] if self._current is None else [self._current]
            return current + [s.name for s in self._queue]

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
            self._cond.notify()

    def _startable(self) -> bool:
        """A load may begin: one a sentence waits for at once, one ahead of need while the worker
        is idle."""
        return bool(self._queue) and (self._queue[0].name in self._urgent or self.idle())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._startable():
                    # Nothing queued: until ``want``. Loads ahead of need: until the worker is idle,
                    # looked at again every IDLE_POLL_S (nothing tells the loader it became idle).
                    self._cond.wait(self.IDLE_POLL_S if self._queue else None)
                if self._stopping:
                    return
                spec = self._queue.popleft()
                self._urgent.discard(spec.name)
                self._current = spec.name
            started = time.monotonic()
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
                self._current = None
                self._done.append(Opened(spec.name, result, time.monotonic() - started))
            self.wake()
