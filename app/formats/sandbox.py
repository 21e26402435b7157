"""Uploaded documents are read and written in child processes, never in the front end.

Reading a document builds a tree of it (python-docx's lxml tree, the HTML tokenizer's blocks):
memory and CPU that depend on what a stranger sent. In the front end, a document that passed every
check of ``app.formats.limits`` could still take hundreds of MB that the allocator keeps, and hold
the interpreter while the event loop waits. So each document gets a child process of its own:

* forked from a fork server that imported the format libraries once (a child starts in ~10 ms);
* with an address-space limit (``memory_bytes`` beyond what it had at start) and a CPU-time limit
  (``read_seconds``: CPU, not wall-clock time, so that a legitimate document is not refused for
  the load others put on the machine), so that a document that gets past the checks fails on its
  own, as a ``MemoryError`` answered 413 or a killed child, and never costs the front end or the
  pod more than that;
* at a lower CPU priority than everything else of the service (``NICENESS``);
* killed by the front end (413) once it has used no CPU for ``read_seconds`` of wall-clock time:
  a child that waits instead of computing. A child that computes is never killed for the time it
  takes, only for the CPU it uses: at its low priority on a busy core, its wall time is many times
  its CPU time (a reader at nice +10 beside three busy workers at +5 gets ~1/10 of the core), and a
  limit in wall-clock time (three times its CPU time, before) refused documents within every limit
  on a shared 2-core Xeon. The costliest legal .docx of the tests (180,000 elements) takes 2.6 s of
  CPU to read there, against ``read_seconds``' 10;
* at most ``readers`` at a time; a request waits for one at most ``read_seconds`` (then 503).

A document is read twice: once to find its text and sentences (``DocumentReaders.read``), and
again, after its sentences are translated, to write them into it (``DocumentReaders.write``). The
child is not kept alive in between: a document translates for seconds to minutes, and a child per
document in translation would hold a reader's place and memory all that time, for a second
reading that costs ~a tenth of the translation. Reading is deterministic, so both readings give the
same sentences (checked: a count that differs is an error).

What crosses the pipe is JSON and bytes, read with a size limit: the front end never unpickles
what a process that parsed a stranger's file sends it.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import resource
import signal
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, fields
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from app.formats.documents import MODULES, Document, Review, SplitDocument, read
from app.formats.limits import DocumentError, DocumentLimits, Forbidden, TooLarge

SAMPLE_CHARS = 10_000  # of a document's text, for language identification (its start is enough)
# Imported once by the fork server, so that each child starts with them loaded: every format's
# module (and with it its library). "__main__" too: multiprocessing imports the parent's main
# module in each child (uvicorn's console script, when the server runs as `uvicorn app.main:app`)
# unless the fork server already has.
PRELOAD = ["__main__", "app.formats.sandbox", *MODULES, "defusedxml.ElementTree", "sentencex"]
NICENESS = 10  # added to a reader's nice value: 5 below a worker's, so on a busy core it gets
# ~1/3 of a worker's share (``app.serving.frontend.handle.WORKER_NICENESS``)
POLL_S = 0.25  # how often the front end looks at a reader's CPU time while it waits for an answer
MiB = 1024 * 1024


@dataclass(frozen=True)
class ReadDocument:
    """What the front end learns of a document it does not read itself."""

    language: str
    sentences: tuple[str, ...]
    chars: int  # of its text
    notes: tuple[str, ...] = ()  # what the reader could not translate, and why (a scanned page)


class Busy(Exception):
    """Every reader was taken for ``read_seconds``: the service is busy reading documents (503)."""


# --- Messages: front end -> child ---------------------------------------------------------------


@dataclass(frozen=True)
class ReadFile:
    name: str
    data: bytes


@dataclass(frozen=True)
class SplitFile:
    language: str


@dataclass(frozen=True)
class JoinFile:
    translations: tuple[str, ...]
    # ``Review``: its threshold, and its sentences as [index, confidence] pairs (JSON has no int keys).
    threshold: float | None = None
    low: tuple[tuple[int, float], ...] = ()


# --- child -> front end --------------------------------------------------------------------------


@dataclass(frozen=True)
class Opened:
    sample: str  # the start of the document's text
    chars: int
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Split:
    sentences: tuple[str, ...]


@dataclass(frozen=True)
class Joined:
    data: bytes


@dataclass(frozen=True)
class Refused:
    status: int  # 400, 413 or 422: the kind of DocumentError
    message: str


Message = ReadFile | SplitFile | JoinFile | Opened | Split | Joined | Refused
KINDS: dict[str, type[Message]] = {
    cls.__name__: cls for cls in (ReadFile, SplitFile, JoinFile, Opened, Split, Joined, Refused)
}
ERRORS: dict[int, type[DocumentError]] = {400: DocumentError, 413: TooLarge, 422: Forbidden}
M = TypeVar("M", bound=Message)


def send(conn: Connection, message: Message) -> None:
    """A message as its JSON fields, then its bytes field (``data``) as they are, if it has one."""
    values = asdict(message)
    data = values.pop("data", None)
    conn.send_bytes(json.dumps({"kind": type(message).__name__, **values}).encode())
    if data is not None:
        conn.send_bytes(data)


def receive(conn: Connection, max_header: int, max_data: int) -> Message:
    """The next message, refusing (``OSError``) one longer than the limits; raises ``EOFError`` if
    the other side has gone."""
    values: dict[str, Any] = json.loads(conn.recv_bytes(max_header))
    cls = KINDS[values.pop("kind")]
    if any(f.name == "data" for f in fields(cls)):
        values["data"] = conn.recv_bytes(max_data)
    arguments: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**arguments)


# --- The child ------------------------------------------------------------------------------------


def confine(limits: DocumentLimits) -> None:
    """Limit this process: its address space to what it has now plus ``memory_bytes`` (beyond it,
    allocations fail: ``MemoryError``), its CPU time to ``read_seconds`` (beyond it, the kernel
    sends SIGXCPU, which ends it), and its share of a busy CPU: it runs at a lower priority
    (``NICENESS``) than the workers and the front end, so that reading a document never slows down
    someone's typed line."""
    os.nice(NICENESS)
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    memory = mapped + limits.memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = math.ceil(limits.read_seconds)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


class Reading:
    """One document in the child, as the front end asks for it: read, split, joined."""

    def __init__(self, limits: DocumentLimits) -> None:
        self.limits = limits
        self.document: Document | None = None
        self.split: SplitDocument | None = None

    def answer(self, message: Message) -> Message:
        try:
            return self._answer(message)
        except DocumentError as e:
            return Refused(e.status, str(e))
        except MemoryError:
            return Refused(413, f"reading the file takes more than {self.limits.memory_bytes // MiB} MiB")
        except RecursionError:
            return Refused(413, "the file nests too deep to be read")
        except Exception as e:  # a library's own error on a file it cannot read: unreadable, logged
            traceback.print_exc()
            return Refused(400, f"cannot read the file: {type(e).__name__}: {e}")

    def _answer(self, message: Message) -> Message:
        if isinstance(message, ReadFile):
            self.document = read(message.name, message.data, self.limits)
            text = self.document.text
            notes = tuple(getattr(self.document, "notes", ()))  # a format may say what it left
            return Opened(text[:SAMPLE_CHARS], len(text), notes)
        if isinstance(message, SplitFile) and self.document is not None:
            self.split = self.document.split(message.language)
            self.limits.check_sentences(len(self.split.sentences))
            return Split(self.split.sentences)
        if isinstance(message, JoinFile) and self.split is not None:
            review = None
            if message.threshold is not None:
                review = Review(message.threshold, {int(i): float(c) for i, c in message.low})
            return Joined(self.split.join(message.translations, review))
        raise ValueError(f"{type(message).__name__} out of order")


def serve(conn: Connection, limits: DocumentLimits) -> None:
    """The child's life: answer the front end's messages about one document until it hangs up."""
    confine(limits)
    reading = Reading(limits)
    while True:
        try:
            message = receive(conn, 2**31 - 1, 2**31 - 1)  # the front end's: checked already
        except EOFError:
            return
        send(conn, reading.answer(message))


def _nothing() -> None:
    """A child that does nothing: starting one starts the fork server."""


# --- The front end's side ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user and system) process ``pid`` has used, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (name) ": state is field 3
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15


class Reader:
    """One child process reading one document; its methods block (call them in a thread)."""

    def __init__(
        self, context: Any, limits: DocumentLimits, max_output: int, target: Callable[..., None] = serve
    ) -> None:
        self.limits = limits
        self.max_output = max_output
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=target, args=(theirs, limits), name="nmt-reader", daemon=True)
        self.process.start()
        theirs.close()

    def ask(self, message: Message, expected: type[M]) -> M:
        """The child's answer to ``message``: ``expected``, or the ``DocumentError`` it reported."""
        try:
            send(self.conn, message)
        except (EOFError, ConnectionError):
            raise self.died() from None
        if not self.answered():
            self.process.kill()
            idle = self.limits.read_seconds
            raise TooLarge(f"the file's reader stopped reading: it used no CPU for {idle:g} s")
        try:
            # Its sentences, escaped as JSON (6 bytes a character at most), or the translated file.
            reply = receive(self.conn, 6 * self.limits.max_chars + MiB, self.max_output)
        except (EOFError, ConnectionError):  # the child died
            raise self.died() from None
        except OSError as e:  # an answer longer than allowed (Connection.recv_bytes's maxlength)
            raise TooLarge(f"the translated file would be larger than {self.max_output:,} bytes") from e
        except (KeyError, TypeError, ValueError) as e:  # not one of the messages
            raise DocumentError(f"the reader's answer was not understood: {type(e).__name__}") from e
        if isinstance(reply, Refused):
            raise ERRORS.get(reply.status, DocumentError)(reply.message)
        if not isinstance(reply, expected):
            raise DocumentError(f"the reader answered {type(reply).__name__} to {type(message).__name__}")
        return reply

    def answered(self) -> bool:
        """Wait for the child's answer (or its end) while it computes: False once it has used no CPU
        for ``read_seconds`` of wall-clock time. Its CPU time is bounded by its own limit (SIGXCPU)."""
        used, since = cpu_seconds(self.process.pid), time.monotonic()
        while not self.conn.poll(POLL_S):
            now, cpu = time.monotonic(), cpu_seconds(self.process.pid)
            if cpu is None:  # reaped: its pipe reads EOF next
                return True
            if used is None or cpu > used:
                used, since = cpu, now
            elif now - since > self.limits.read_seconds:
                return False
        return True

    def died(self) -> TooLarge:
        """Why the child died: its CPU time ran out (SIGXCPU), or its memory did where Python could
        not raise ``MemoryError`` (a library's own allocation)."""
        self.process.join(1)
        if self.process.exitcode == -signal.SIGXCPU:
            return TooLarge(f"reading the file takes more than {self.limits.read_seconds:g} s of CPU")
        return TooLarge(
            f"the file cannot be read within {self.limits.memory_bytes // MiB} MiB "
            f"(reader exit code {self.process.exitcode})"
        )

    def close(self) -> None:
        self.conn.close()  # the child reads EOF and returns
        self.process.join(1)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class DocumentReaders:
    """The child processes that read and write documents: at most ``readers`` at a time."""

    def __init__(self, limits: DocumentLimits, readers: int, max_output: int) -> None:
        self.limits = limits
        self.max_output = max_output
        self.slots = asyncio.Semaphore(readers)
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)

    def start(self) -> None:
        """Start the fork server now (it imports the format libraries: ~1 s), not on the first upload."""
        process = self.context.Process(target=_nothing, daemon=True)
        process.start()
        process.join()

    @asynccontextmanager
    async def reader(self) -> AsyncIterator[Reader]:
        try:
            await asyncio.wait_for(self.slots.acquire(), self.limits.read_seconds)
        except TimeoutError:
            raise Busy("every document reader is busy; retry later") from None
        try:
            reader = await asyncio.to_thread(Reader, self.context, self.limits, self.max_output)
            try:
                yield reader
            finally:
                await asyncio.to_thread(reader.close)
        finally:
            self.slots.release()

    async def read(self, name: str, data: bytes, language: Callable[[str], str]) -> ReadDocument:
        """The document's language (``language`` of the start of its text), sentences and size."""
        async with self.reader() as reader:
            opened = await asyncio.to_thread(reader.ask, ReadFile(name, data), Opened)
            chosen = language(opened.sample)
            split = await asyncio.to_thread(reader.ask, SplitFile(chosen), Split)
        return ReadDocument(chosen, split.sentences, opened.chars, opened.notes)

    async def write(
        self,
        name: str,
        data: bytes,
        language: str,
        sentences: int,
        translations: Sequence[str],
        review: Review | None = None,
    ) -> bytes:
        """The document with its ``sentences`` sentences (as ``read`` found them) translated, and
        ``review``'s sentences flagged where the format can."""
        async with self.reader() as reader:
            await asyncio.to_thread(reader.ask, ReadFile(name, data), Opened)
            split = await asyncio.to_thread(reader.ask, SplitFile(language), Split)
            if len(split.sentences) != sentences:
                raise DocumentError(f"the file read as {len(split.sentences)} sentences, then {sentences}")
            join = JoinFile(tuple(translations))
            if review is not None:
                join = JoinFile(join.translations, review.threshold, tuple(sorted(review.low.items())))
            joined = await asyncio.to_thread(reader.ask, join, Joined)
        return joined.data
