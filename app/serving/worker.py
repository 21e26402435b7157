"""A model worker, the child process's side: load the models it holds at start, then translate
what the front end sends, for any served model, until it says stop or goes away (the front end's
side is ``app.serving.handle``; the messages are ``app.serving.protocol``'s). A model it does not
hold is loaded when a sentence for it comes up (``app.serving.models``).

The models load on the process's main thread, which then runs every decoding step: one thread for
all torch work, as OpenMP slows down once two threads have started parallel regions. A second
thread only reads the pipe into the ``Inbox``: it must keep reading even while the main thread
blocks writing answers to a front end that is busy, or two full pipe buffers would block both
processes for good.

A worker ignores SIGINT and SIGTERM: a terminal's Ctrl-C or a service manager signals the whole
process group, and the front end decides when its workers stop (after draining its requests).
When the front end is gone, the pipe's end of file stops the worker.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from app.config import Settings
from app.metrics import Metrics, process_metrics
from app.serving.cores import CoreShare
from app.serving.executor import Executor, Job
from app.serving.fairqueue import FairQueue
from app.serving.models import ModelTable
from app.serving.protocol import (
    Answers,
    Cancel,
    Done,
    Failed,
    Loaded,
    ModelSpec,
    Ready,
    SentenceJob,
    Spans,
    StartFailed,
    Stop,
    ToWorker,
    Translate,
)
from app.serving.protocol import (
    send as send_message,
)
from model.decoding.constraints import beam_for
from model.decoding.translator import Translator
from model.runtime.allocator import release_freed_memory

log = logging.getLogger("uvicorn.error").getChild("worker")

# A worker idle this long gives its freed memory back to the OS (``release_freed_memory``): an
# OPUS-MT-sized int8 worker kept ~360 MB of freed heap after a burst of 128 sentences; giving it
# back costs the next burst its page faults, once.
IDLE_RELEASE_S = 1.0

# Translated once before a worker reports ready: the first request should not pay for lazy
# initialisation (allocator, kernels, thread pools).
WARMUP_SENTENCES = ["Hallo Welt."]


def open_translator(settings: Settings, model_dir: Path) -> Translator:
    """The model in ``model_dir`` as a worker runs it with ``settings``, its decoding step made
    (compiled or loaded from the cache where ``NMT_COMPILE``, on CPU and CUDA alike; eager where
    compiling fails) and, where ``NMT_WARMUP``, warmed up."""
    translator = Translator.load(
        model_dir,
        device=settings.device,
        dtype=settings.dtype,
        quantization=settings.quantization,
        options=settings.decode_options(),
        # Room for the largest batch, or for one constrained input's beams (``beam_for``).
        capacity=max(
            settings.max_batch_size, beam_for(settings.max_beam_size, settings.max_terms_per_sentence)
        ),
        max_beam_size=settings.max_beam_size,
        compile=settings.compile,
        cache_dir=settings.compile_cache_dir,
    )
    translator.runner  # noqa: B018 - made now, before the worker reports ready
    if settings.warmup:
        warm_up(translator)
    return translator


def model_table(settings: Settings, models: Sequence[ModelSpec], metrics: Metrics | None) -> ModelTable:
    return ModelTable(
        models,
        lambda spec: open_translator(settings, spec.path),
        budget_bytes=settings.worker_model_memory_mb << 20,
        metrics=metrics,
    )


class HeldJob:
    """A ``SentenceJob`` in this worker's hands, as the executor runs it (``executor.Job``): the
    message is frozen, and ``cancelled`` is set here when the front end withdraws it, so that the
    executor drops it at its next step even while it runs."""

    __slots__ = (
        "job",
        "id",
        "model",
        "src",
        "beam_size",
        "n_best",
        "enqueued",
        "constraints",
        "spans",
        "cancelled",
        "background",
    )

    def __init__(self, job: SentenceJob) -> None:
        self.job = job
        self.id, self.model, self.src, self.beam_size = job.id, job.model, job.src, job.beam_size
        self.n_best, self.enqueued, self.constraints = job.n_best, job.enqueued, job.constraints
        self.spans: tuple[Spans, ...] = ()  # the executor's, when it finishes
        self.cancelled = False
        self.background = job.background

    def expired(self, now: float) -> bool:
        return self.cancelled or self.job.past_deadline(now)


class Inbox:
    """The sentences given to this worker and not taken into a batch yet, a queue per model, each in
    the order the front end's scheduler uses (``app.serving.fairqueue``, round-robin over
    requests): the front end gives a worker up to two batches ahead, and a one-line request given
    after a document must still join before the rest of the document. The pipe's reader thread
    adds and cancels; the model thread takes. ``metrics``: the process's (each model's label).

    Document jobs' sentences (``SentenceJob.background``) wait in queues of their own, for the
    executor's batches of documents (``app.serving.executor``: they step only when no typed
    sentence runs or waits, or one step in ``BACKGROUND_EVERY``)."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self._queues: dict[str, FairQueue[HeldJob]] = {}  # by model
        self._background: dict[str, FairQueue[HeldJob]] = {}  # by model: document jobs'
        self._size = 0  # jobs in the queues
        self._rows = 0  # rows of the jobs in the queues
        self._by_id: dict[int, HeldJob] = {}  # every job given and not finished
        self._cond = threading.Condition()
        self._stopping = False

    def add(self, jobs: Sequence[SentenceJob]) -> None:
        with self._cond:
            by_request: dict[tuple[str, int], list[HeldJob]] = {}
            for job in jobs:
                held = self._by_id[job.id] = HeldJob(job)
                by_request.setdefault((job.model, job.request), []).append(held)
            for (model, rid), mine in by_request.items():
                background = mine[0].background
                queues = self._background if background else self._queues
                queues.setdefault(model, FairQueue()).push(rid, mine)
            self._size += len(jobs)
            self._rows += sum(j.beam_size for j in jobs)
            self._cond.notify()

    def cancel(self, ids: Iterable[int]) -> None:
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
        """Jobs waiting, every model's."""
        return self._size

    def waiting_for(self, model: str, background: bool | None = None) -> int:
        """``model``'s jobs waiting: typed ones, documents' (``background``), or both (None)."""
        kinds = (False, True) if background is None else (background,)
        queues = [(self._background if kind else self._queues).get(model) for kind in kinds]
        return sum(len(q) for q in queues if q is not None)

    def wait(self, busy: Callable[[], bool]) -> bool:
        """Block until jobs wait or ``busy()`` (a batch is running); False once stopping."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or self._size > 0 or busy())
            return not self._stopping

    def quiet(self, seconds: float) -> bool:
        """Whether ``seconds`` pass with no job arriving and no stop (returns early otherwise)."""
        with self._cond:
            return not self._cond.wait_for(lambda: self._stopping or self._size > 0, seconds)

    def wait_for_more(self, rows: int, timeout: float) -> None:
        """Block until ``rows`` rows' worth of jobs wait, for at most ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or self._rows >= rows, timeout)

    def take(self, fits: Callable[[Job], bool], model: str = "", background: bool = False) -> list[Job]:
        """``model``'s jobs (typed ones, or documents') in the queue's order for as long as
        ``fits(job)``; cancelled or expired ones are dropped on the way."""
        taken: list[Job] = []
        now = time.monotonic()
        with self._cond:
            queue = (self._background if background else self._queues).get(model)
            while queue is not None and (job := queue.peek()) is not None:
                if job.expired(now):
                    self._pop(queue)
                    self._by_id.pop(job.id, None)
                    if self.metrics is not None:
                        self.metrics.sentences.labels(job.model, "abandoned").inc()
                    continue
                if not fits(job):
                    break
                taken.append(self._pop(queue))
        return taken

    def _pop(self, queue: FairQueue[HeldJob]) -> HeldJob:
        job = queue.pop()
        self._size -= 1
        self._rows -= job.beam_size
        return job


# -- the worker process ----------------------------------------------------------------------------
def serve_worker(
    settings: Settings,
    models: Sequence[ModelSpec],
    threads: int | None,
    metrics_dir: str,
    conn: Connection,
    cores: CoreShare | None = None,
) -> None:
    """The child process: load the models it holds at start (all of them, or those that fit in
    ``NMT_WORKER_MODEL_MEMORY_MB``), report ready, then translate what the front end gives, for any
    of ``models``, until it says stop or goes away. ``cores``: its slot on the front end's
    ``CoreBoard`` (on CPU), to run on the idle workers' cores too while it is the only one at work."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    try:
        metrics = process_metrics(metrics_dir)
        inbox = Inbox(metrics)
        table = model_table(settings, models, metrics)
        loaded = table.load_at_start()
        executor = Executor.from_settings(table, inbox, settings, metrics=metrics)
    except Exception as e:  # the front end fails its start-up with this reason
        with contextlib.suppress(OSError):
            send_message(conn, StartFailed(f"{type(e).__name__}: {e}"))
        conn.close()
        return
    send_message(conn, Ready(tuple((m.name, m.description) for m in loaded)))
    told = table.changes  # what the front end knows of the models held
    threading.Thread(target=_read, args=(conn, inbox), name="nmt-worker-inbox", daemon=True).start()
    if cores is not None:
        cores.starting()
    try:
        with torch.inference_mode():
            while True:
                if not executor.busy and inbox.quiet(IDLE_RELEASE_S):
                    # Idle: what the last burst's peak left in the heap goes back to the OS
                    # (kept for reuse while busy: model.runtime.allocator).
                    release_freed_memory()
                if not inbox.wait(lambda: executor.busy):
                    break
                if cores is not None:
                    use_threads(cores.update(busy=True))
                answers: list[Done | Failed] = []
                for job, result in executor.iteration():
                    if not inbox.release(job):
                        continue
                    if isinstance(result, BaseException):
                        answers.append(Failed(job.id, str(result)))
                    else:
                        answers.append(Done(job.id, result, job.spans))
                if cores is not None and not executor.busy and not inbox.waiting:
                    use_threads(cores.update(busy=False))  # asleep: its core is free for the others
                with contextlib.suppress(OSError):  # the front end is gone: the reader stops us
                    if table.changes != told:
                        told = table.changes
                        send_message(conn, Loaded(tuple(table.loaded)))
                    if answers:
                        send_message(conn, Answers(tuple(answers)))
    finally:
        if cores is not None:
            cores.update(busy=False)
        conn.close()


def use_threads(threads: int) -> None:
    """Run torch's operators on ``threads`` threads from the next one on (``CoreShare.update``)."""
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def warm_up(translator: Translator) -> None:
    """Translate ``WARMUP_SENTENCES`` once, on the decoding step and cache size the worker uses."""
    target = translator.info.directions[0][1]
    translator.generate(translator.source_ids(WARMUP_SENTENCES, target=target), beam_size=1)


def _read(conn: Connection, inbox: Inbox) -> None:
    """The pipe's reader: jobs and cancellations go to the inbox at once."""
    while True:
        try:
            message: ToWorker = conn.recv()
        except (EOFError, OSError):  # the front end is gone
            message = Stop()
        match message:
            case Translate(jobs):
                inbox.add(jobs)
            case Cancel(ids):
                inbox.cancel(ids)
            case Stop():
                inbox.stop()
                return
