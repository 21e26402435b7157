"""The front end's side of a document reader (``app.formats.sandbox.Reader``): what it does with a
child that answers, refuses, waits, or computes slowly on a busy core.

A reader is limited in the CPU it uses, not in the wall-clock time it takes: a legal document read
at low priority on a slow or shared machine is still translated, while a child that stops computing
is killed after ``read_seconds`` without CPU. Every refusal reaches the caller as its own error (413
or 422 with the child's message), never as an answer "not understood".
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from multiprocessing.connection import Connection

import pytest

from app.config import Settings
from app.formats.limits import DocumentError, DocumentLimits, Forbidden, TooLarge
from app.formats.sandbox import Opened, Reader, ReadFile, Refused, confine, receive, send
from app.serving.frontend.handle import WORKER_NICENESS

LIMITS = replace(Settings().document_limits(), read_seconds=1.0)
MB = 1024 * 1024
FORK = multiprocessing.get_context("fork")  # the targets below are this module's functions


def ask(target: object, limits: DocumentLimits = LIMITS) -> Opened:
    reader = Reader(FORK, limits, MB, target=target)  # type: ignore[arg-type]
    try:
        return reader.ask(ReadFile("a.txt", b"Hallo."), Opened)
    finally:
        reader.close()


def waits(conn: Connection, limits: DocumentLimits) -> None:
    receive(conn, MB, MB)
    time.sleep(60)


def refuses_413(conn: Connection, limits: DocumentLimits) -> None:
    receive(conn, MB, MB)
    send(conn, Refused(413, "too many sentences in the file: 12 (at most 10)"))


def refuses_422(conn: Connection, limits: DocumentLimits) -> None:
    receive(conn, MB, MB)
    send(conn, Refused(422, "XML entity declarations are refused"))


def babbles(conn: Connection, limits: DocumentLimits) -> None:
    receive(conn, MB, MB)
    conn.send_bytes(b'{"kind": "Nonsense"}')


CPU_NEEDED = 0.6  # s of CPU the slow child computes before it answers (under LIMITS' 1 s)


def computes_on_core_0(conn: Connection, limits: DocumentLimits) -> None:
    """A reader as ``serve`` confines it (niced, CPU-limited), on the core the hogs hold."""
    os.sched_setaffinity(0, {0})
    confine(limits)
    receive(conn, MB, MB)
    start = time.process_time()
    while time.process_time() - start < CPU_NEEDED:
        pass
    send(conn, Opened("Hallo.", 6))


def hog(seconds: float) -> None:
    os.sched_setaffinity(0, {0})
    os.nice(WORKER_NICENESS)  # as a busy model worker
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@contextmanager
def busy_core_0(hogs: int) -> Iterator[None]:
    """``hogs`` processes at a model worker's priority, computing on core 0 (for 60 s at most)."""
    processes = [FORK.Process(target=hog, args=(60.0,), daemon=True) for _ in range(hogs)]
    for p in processes:
        p.start()
    try:
        yield
    finally:
        for p in processes:
            p.kill()
            p.join()


def test_a_reader_slowed_by_a_busy_core_answers_however_long_it_takes() -> None:
    """Three hogs at a worker's nice +5 beside a reader at +10 on one core: the reader gets ~1/10 of it, so
    its 0.6 s of CPU take ~6 s, past three times its 1 s of CPU (the old wall-clock limit)."""
    with busy_core_0(hogs=3):
        start = time.monotonic()
        opened = ask(computes_on_core_0)
        took = time.monotonic() - start
    assert opened == Opened("Hallo.", 6)
    assert took > 3 * LIMITS.read_seconds, f"the core was not busy enough to test this ({took:.1f} s)"


def test_a_reader_that_waits_instead_of_reading_is_killed_after_read_seconds_without_cpu() -> None:
    start = time.monotonic()
    with pytest.raises(TooLarge, match="used no CPU for 1 s"):
        ask(waits)
    assert time.monotonic() - start < 1 + 2  # read_seconds, and the polls around it


@pytest.mark.parametrize(
    ("target", "error", "status", "message"),
    [
        (refuses_413, TooLarge, 413, "too many sentences in the file: 12 (at most 10)"),
        (refuses_422, Forbidden, 422, "XML entity declarations are refused"),
        (waits, TooLarge, 413, "the file's reader stopped reading: it used no CPU for 1 s"),
        (babbles, DocumentError, 400, "the reader's answer was not understood: KeyError"),
    ],
    ids=["refused-413", "refused-422", "waits", "not-a-message"],
)
def test_each_refusal_reaches_the_caller_as_its_own_status_and_message(
    target: object, error: type[DocumentError], status: int, message: str
) -> None:
    with pytest.raises(DocumentError) as caught:
        ask(target)
    assert type(caught.value) is error
    assert (caught.value.status, str(caught.value)) == (status, message)
