"""The front end's handle of a worker (``app.serving.frontend.handle.WorkerThread``): what it writes
to the worker's pipe, and when. A real pipe, no worker process: the test reads the other end."""

from __future__ import annotations

import asyncio
import multiprocessing
from multiprocessing.connection import Connection

from app.config import Settings
from app.serving.frontend.handle import WorkerProcess, WorkerThread
from app.serving.protocol import Cancel, Sentence, Translate


def sentence(sid: int) -> Sentence:
    return Sentence(sid, request=sid, src=[5, 2], beam_size=1, n_best=1, deadline=None, enqueued=0.0)


def attached(loop: asyncio.AbstractEventLoop) -> tuple[WorkerThread, Connection]:
    """A worker's handle on one end of a pipe, and the other end (the worker's side)."""
    handle = WorkerProcess(Settings(), (), threads=None, metrics_dir="", name="w").workers[0]
    ours, theirs = multiprocessing.Pipe()
    handle.attach(ours, loop)
    return handle, theirs


def received(conn: Connection) -> list[object]:
    """What the worker's side can read now (up to the pipe's end)."""
    messages = []
    try:
        while conn.poll(0):
            messages.append(conn.recv())
    except EOFError:
        pass
    return messages


def test_the_sentences_given_in_one_loop_turn_go_as_one_message_at_the_next() -> None:
    async def main() -> None:
        handle, worker = attached(asyncio.get_running_loop())
        assert handle.send(Translate((sentence(1),)))
        assert handle.send(Translate((sentence(2), sentence(3))))
        assert received(worker) == []  # not yet: others may come in this turn
        await asyncio.sleep(0)
        assert received(worker) == [Translate((sentence(1), sentence(2), sentence(3)))]
        assert handle.send(Translate((sentence(4),)))
        await asyncio.sleep(0)
        assert received(worker) == [Translate((sentence(4),))]
        handle.stop()

    asyncio.run(main())


def test_another_message_is_written_at_once_after_the_sentences_given_before_it() -> None:
    async def main() -> None:
        handle, worker = attached(asyncio.get_running_loop())
        handle.send(Translate((sentence(1), sentence(2))))
        assert handle.send(Cancel((1,)))
        assert received(worker) == [Translate((sentence(1), sentence(2))), Cancel((1,))]
        await asyncio.sleep(0)
        assert received(worker) == []  # nothing twice
        handle.stop()

    asyncio.run(main())


def test_sentences_given_before_the_pipe_closed_never_reach_the_next_process() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        handle, worker = attached(loop)
        handle.send(Translate((sentence(1),)))
        handle.exited()  # the process is gone: the scheduler gives its sentences to another
        assert handle._ready is not None and isinstance(handle._ready.exception(), RuntimeError)
        assert not handle.send(Translate((sentence(2),)))  # gone: the scheduler's to place
        ours, theirs = multiprocessing.Pipe()
        handle.attach(ours, loop)  # started again
        await asyncio.sleep(0)
        assert received(theirs) == [] and received(worker) == []
        handle.stop()

    asyncio.run(main())
