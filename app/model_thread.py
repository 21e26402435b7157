"""The one thread on which the service runs torch: loading the model, warm-up and every batch.

Why one thread for all of it: torch's CPU kernels run OpenMP parallel regions, and libgomp gives
every thread that starts one its own team of helper threads. Once the process holds more such
threads than there are cores, libgomp stops spinning between regions (its "throttled" spin count)
and the helpers sleep and wake on a futex around every one of the ~75 regions of a decoding step.
Loading the model in the event-loop thread and decoding in another thread was enough to cross that
line on 2 cores: a decoding step took 17.0 ms instead of 12.2 at batch 64 and 6.2 ms instead of 2.8
at batch 1 (BENCHMARKS.md, "Levers measured"). So the event loop never runs a torch operator; it
hands work to this thread and awaits it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")


def _set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)  # OpenMP's thread count is per thread: set it in this one


class ModelThread:
    """A single worker thread; everything submitted runs on it, in order."""

    def __init__(self, threads: int | None = None) -> None:
        """``threads``: torch intra-op threads of the model thread (None: torch's default)."""
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="nmt-model", initializer=_set_threads, initargs=(threads,)
        )

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return self._executor.submit(fn, *args, **kwargs)

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the model thread, awaited from the event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Wait for what was submitted, then end the thread."""
        self._executor.shutdown(wait=True)
