"""Event-loop lag: how long the front end's event loop keeps work waiting, and what holds it.

Every request of the front end is served by one event loop: a callback that computes for 300 ms
(a quadratic parse, a large glossary resolved on the loop) delays every other request by 300 ms,
``/health`` included. A **watchdog thread** looks at the loop every ``INTERVAL_S``:

- waiting for work (its thread's innermost frame is the selector's ``select``), the loop has no
  lag: the watchdog records 0 and leaves it asleep (an idle service is never woken);
- busy, the watchdog posts it a **beat** (``call_soon_threadsafe``): the time until the loop runs it
  is its lag, recorded in ``nmt_event_loop_lag_seconds``; ``nmt_event_loop_lag_max_seconds`` holds
  the largest of the last 30 to 60 s (a scrape every 30 s sees every stall's peak);
- a beat not run ``HOLD_WARNING_S`` after it was posted means something holds the loop: the
  watchdog names it in a warning, while it still holds it (the request being served, by method and
  route, from the loop's current task; the innermost frame of the service's own code in the loop's
  thread), and says how long the loop was held once the beat has run.

The first look after a hold began, at most ``INTERVAL_S`` later, posts the beat the hold delays:
every hold longer than ``HOLD_WARNING_S + INTERVAL_S`` is warned about, a shorter one if it began
just before a look, and none shorter than ``HOLD_WARNING_S`` (nor a run of callbacks shorter in all);
the lag recorded is at least the hold less ``INTERVAL_S``.
The cost is the watchdog's 20 wake-ups a second (about 0.2% of a core, the wake-ups themselves) and
a beat per look while the loop is busy; a request's, one context variable set and reset (0.2 us)
(docs/architecture.md "Watching the event loop"). asyncio's debug mode (``slow_callback_duration``)
would time every callback instead, too costly to run in production.

Which request a task serves: ``RequestMetricsMiddleware`` sets ``REQUEST`` to the request's ASGI
scope in the request's task; tasks started from it (``run_until_disconnect``'s, anyio's) copy the
context and so serve the same request. The watchdog reads the value in the current task's context.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import os
import selectors
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

from starlette.types import Scope

from app.monitoring.metrics import Metrics

logger = logging.getLogger("uvicorn.error").getChild("nmt")

INTERVAL_S = 0.05  # between the watchdog's looks at the loop
HOLD_WARNING_S = 0.1  # a beat waiting this long means the loop is held: warn
WINDOW_S = 30.0  # nmt_event_loop_lag_max_seconds covers the last one to two windows
MAX_PATH_CHARS = 200  # of an unmatched request path in a warning (the client chose it)

# The ASGI scope of the request the current task serves (None outside any request).
REQUEST: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("nmt_request", default=None)

# The warning names the innermost frame of the service's own code (its packages, wherever they are
# installed, or any other code outside Python's library and the installed packages): the line of
# ours that called into a library, rather than the library's.
_OWN_DIRS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), p, "") for p in ("app", "model")
)
_LIBRARY_DIRS = tuple(
    {os.path.join(path, "") for key, path in sysconfig.get_paths().items() if key.endswith(("stdlib", "lib"))}
)


def describe_request(scope: Scope) -> str:
    """``"POST /translate"``: the method and the matched route's template; an unmatched path as
    sent, escaped (no newline of a client's reaches the log) and cut to ``MAX_PATH_CHARS``."""
    route = getattr(scope.get("route"), "path", None)
    if not isinstance(route, str):
        path = str(scope.get("path", ""))
        route = path[:MAX_PATH_CHARS].encode("unicode_escape").decode("ascii")
    return f"{scope.get('method', '?')} {route}"


def task_request(task: asyncio.Task[Any]) -> Scope | None:
    """``REQUEST`` in the context ``task`` runs in, read from any thread."""
    get_context = getattr(task, "get_context", None)  # Python 3.12 and later
    if get_context is not None:
        context = get_context()
    else:
        # Python 3.11 has no public accessor: the C Task's first Context referent is its own
        # (CPython visits ``task_context`` before the contexts of the callbacks awaiting it).
        context = next((r for r in gc.get_referents(task) if isinstance(r, contextvars.Context)), None)
    return None if context is None else context.get(REQUEST)


def describe_task(task: asyncio.Task[Any] | None) -> str:
    """The request ``task`` serves, else the task by name and coroutine."""
    if task is None:
        return "a callback outside any task"
    scope = task_request(task)
    if scope is not None:
        return describe_request(scope)
    coroutine = task.get_coro()
    name = getattr(coroutine, "__qualname__", type(coroutine).__name__)
    return f"task {task.get_name()} ({name})"


def innermost_own_frame(frame: FrameType | None) -> str:
    """``"app/http/body.py:42 in parse"``: the innermost frame of ``frame``'s stack outside Python's
    library and installed packages (the service's code; the innermost frame if none is)."""
    chosen = frame
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_OWN_DIRS) or not filename.startswith(("<", *_LIBRARY_DIRS)):
            chosen = frame
            break
        frame = frame.f_back
    if chosen is None:
        return "no Python frame"
    code = chosen.f_code
    path = code.co_filename
    relative = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f"{relative}:{chosen.f_lineno} in {code.co_qualname}"


def selector_codes() -> frozenset[CodeType]:
    """The code of every ``select`` in ``selectors``: a thread whose innermost Python frame runs one
    is an asyncio loop waiting for work (``BaseEventLoop._run_once`` waits there, nowhere else)."""
    classes = (getattr(selectors, name, None) for name in dir(selectors) if name.endswith("Selector"))
    methods = (getattr(cls, "select", None) for cls in classes)
    return frozenset(m.__code__ for m in methods if m is not None and hasattr(m, "__code__"))


class LoopMonitor:
    """The watchdog of one event loop (the module's docstring): ``start`` on the loop's thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        metrics: Metrics,
        interval: float = INTERVAL_S,
        threshold: float = HOLD_WARNING_S,
        window: float = WINDOW_S,
    ) -> None:
        self.loop, self.metrics = loop, metrics
        self.interval, self.threshold, self.window = interval, threshold, window
        self._waiting = selector_codes()
        self._thread_id = 0  # the loop's thread
        # The beat in flight: when it was posted to the loop, and when the loop ran it (written by the
        # loop's thread, read by the watchdog's: one attribute store, atomic under the GIL).
        self._posted: float | None = None
        self._ran: float | None = None
        self._holder: str | None = None  # what held the loop during the beat in flight, if it was reported
        self._window_start = self._window_max = self._previous_max = self._published = 0.0
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="nmt-loop-watchdog", daemon=True)

    def start(self) -> None:
        self._thread_id = threading.get_ident()
        self._window_start = time.monotonic()
        self._watchdog.start()

    def stop(self) -> None:
        self._stopped.set()
        self._watchdog.join(timeout=5)

    def _beat(self) -> None:
        """On the loop: the only work the monitor gives it, and only when it is busy."""
        self._ran = time.monotonic()

    def _watch(self) -> None:
        wait = self.interval
        while not self._stopped.wait(wait):
            try:
                wait = self._look()
            except RuntimeError:  # the loop is closed: nothing left to watch
                return

    def _look(self) -> float:
        """Look at the loop once; returns how long to wait before the next look."""
        now = time.monotonic()
        posted = self._posted
        if posted is not None:
            ran = self._ran
            if ran is None:  # the loop has not come to the beat yet
                held = now - posted
                if held <= self.threshold:
                    return min(self.interval, self.threshold - held + 0.001)
                if self._holder is None:
                    self._report_hold(held)
                return self.interval
            self._record(ran - posted, now)
            if self._holder is not None:
                logger.info("event loop free again after %.2f s, held by %s", ran - posted, self._holder)
            self._posted = self._holder = None
        frame = sys._current_frames().get(self._thread_id)
        if frame is not None and frame.f_code in self._waiting:
            self._record(0.0, now)  # waiting for work: no lag, and nothing to wake it for
            return self.interval
        # Busy (or a loop without a Python selector, uvloop's): how long until it runs a callback?
        self._ran, self._posted = None, now
        self.loop.call_soon_threadsafe(self._beat)
        return self.interval

    def _report_hold(self, held: float) -> None:
        """Warn, naming what the loop's thread is running, ``"POST /translate (app/http/body.py:42 in
        parse)"``: its current task (the request it serves) and its innermost frame of ours."""
        task = asyncio.current_task(self.loop)
        frame = sys._current_frames().get(self._thread_id)
        holder = f"{describe_task(task)} ({innermost_own_frame(frame)})"
        if self._ran is not None:
            return  # the loop came to the beat while we looked: what we saw may be the next callback
        self._holder = holder
        logger.warning("event loop held for over %.1f s by %s; every other request waits", held, holder)

    def _record(self, lag: float, now: float) -> None:
        """One sample of the lag, taken at ``now``: into the histogram, and the gauge holds the
        largest of the window under way and the one before."""
        self.metrics.loop_lag.observe(lag)
        if now - self._window_start >= self.window:
            self._previous_max, self._window_max, self._window_start = self._window_max, 0.0, now
        self._window_max = max(self._window_max, lag)
        largest = max(self._previous_max, self._window_max)
        if largest != self._published:  # (each gauge write is one to the metrics' shared file)
            self.metrics.loop_lag_max.set(largest)
            self._published = largest


@contextmanager
def watch_event_loop(metrics: Metrics) -> Iterator[LoopMonitor]:
    """Monitor the running event loop (call it on the loop) for the duration of the block."""
    monitor = LoopMonitor(asyncio.get_running_loop(), metrics)
    monitor.start()
    try:
        yield monitor
    finally:
        monitor.stop()
