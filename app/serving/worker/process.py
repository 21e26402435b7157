"""A worker process, the child's side: its workers, one decoding thread each, load the models
they hold at start, then translate what the front end sends them, for any served model, until it
says stop or goes away (the front end's side is ``app.serving.frontend.handle``; the messages are
``app.serving.protocol``'s). A model a worker does not hold is loaded when a sentence for it comes
up (``app.serving.worker.models``).

One process, several workers (``NMT_WORKER_PROCESSES``): each worker is a thread with its own pipe,
inbox, running batches, caches and decoding steps, and the process opens each model's weights once
for all of them (``app.serving.worker.shared``): the front end places, spreads and shares sentences
among them as it did among processes. The compiled step runs without the interpreter lock
(``model.runtime.native``), so the threads step at once; what they do in Python between steps
(search, admission) takes turns.

Within a worker, its models load on its loader's threads; its decoding thread runs every decoding
step: one thread for all of a worker's torch work, as OpenMP slows down once two threads have
started parallel regions on one core. A second thread only reads the pipe into the ``Inbox``: it
must keep reading even while the decoding thread blocks writing answers to a front end that is
busy, or two full pipe buffers would block both processes for good.

A worker process ignores SIGINT and SIGTERM: a terminal's Ctrl-C or a service manager signals the
whole process group, and the front end decides when its workers stop (after draining its
requests). When the front end is gone, each pipe's end of file stops its worker; a worker whose
thread fails takes the process down (``os._exit``), so that the front end starts every worker of
it again, as after a crash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from app.config import Settings
from app.monitoring.metrics import Metrics, process_metrics
from app.serving.cores import CoreShare
from app.serving.protocol import (
    Answers,
    Cancel,
    Done,
    Failed,
    Load,
    Loaded,
    ModelSpec,
    Ready,
    StartFailed,
    Stop,
    ToWorker,
    Translate,
)
from app.serving.protocol import (
    send as send_message,
)
from app.serving.worker.executor import Executor
from app.serving.worker.inbox import Inbox
from app.serving.worker.models import model_table, open_translator
from app.serving.worker.shared import SharedModels
from model.runtime.allocator import release_freed_memory

log = logging.getLogger("uvicorn.error").getChild("worker")

# A worker idle this long gives its freed memory back to the OS (``release_freed_memory``): an
# OPUS-MT-sized int8 worker kept ~360 MB of freed heap after a burst of 128 sentences; giving it
# back costs the next burst its page faults, once.
IDLE_RELEASE_S = 1.0


# -- the worker process ----------------------------------------------------------------------------
def serve_worker(
    settings: Settings,
    models: Sequence[ModelSpec],
    threads: int | None,
    metrics_dir: str,
    conns: Sequence[Connection],
    cores: Sequence[CoreShare | None] = (),
    homes: Sequence[Sequence[str]] = (),
) -> None:
    """The child process: a worker per pipe of ``conns``, each on a thread of its own (with its
    slot ``cores[i]`` of the front end's ``CoreBoard`` and its own models ``homes[i]``), all
    opening each model's weights once (``SharedModels``). Returns when every worker has stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)  # (each worker's thread sets its own too)
    # Alone in its process, a worker's step keeps the GIL (torch's binding: ~25 us a step less).
    release = len(conns) > 1
    shared = SharedModels(lambda spec, like: open_translator(settings, spec.path, like, release_gil=release))
    metrics = process_metrics(metrics_dir)  # (made once: the workers share it)
    workers = [
        threading.Thread(
            target=_worker,
            args=(settings, models, threads, metrics, conn, shared),
            kwargs={
                "cores": cores[i] if i < len(cores) else None,
                "home": homes[i] if i < len(homes) else (),
            },
            name=f"nmt-worker-{i}",
        )
        for i, conn in enumerate(conns)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def _worker(*args: Any, **kwargs: Any) -> None:
    """One worker's thread; if it fails, the process exits at once (every worker of it is started
    again by the front end: a process with a dead worker in it would hold its sentences forever)."""
    try:
        _serve_one(*args, **kwargs)
    except BaseException:
        log.exception("a worker failed; its process exits")
        os._exit(70)


def _serve_one(
    settings: Settings,
    models: Sequence[ModelSpec],
    threads: int | None,
    metrics: Metrics,
    conn: Connection,
    shared: SharedModels,
    cores: CoreShare | None = None,
    home: Sequence[str] = (),
) -> None:
    """One worker: load the first of its own models (``home``; every model without), report
    ready, load its other own models that fit in ``NMT_WORKER_MODEL_MEMORY_MB`` in the background,
    and translate what the front end gives, for any of ``models`` (loaded when a sentence needs
    it), until it says stop or goes away. ``cores``: its slot on the front end's ``CoreBoard`` (on
    CPU), to run on the idle workers' cores too while it is the only one at work."""
    if threads:
        torch.set_num_threads(threads)
    try:
        inbox = Inbox(metrics)
        table = model_table(settings, models, metrics, wake=inbox.wake, opener=shared.open)
        loaded = table.load_at_start(home)
        executor = Executor.from_settings(table, inbox, settings, metrics=metrics)
        if table.loader is not None:  # loads ahead of need wait while the machine has work
            table.loader.idle = lambda: (
                not executor.busy and not inbox.waiting and (cores is None or cores.machine_idle())
            )
            if cores is not None:
                share = cores

                def core_taken() -> None:
                    # A load takes this worker's core: no neighbour alone at work may run a thread
                    # on it (a step on two threads, one sharing its core with a load, waits for it).
                    share.update(busy=True)

                table.loader.on_start = core_taken
    except Exception as e:  # the front end fails its start-up with this reason
        with contextlib.suppress(OSError):
            send_message(conn, StartFailed(f"{type(e).__name__}: {e}"))
        conn.close()
        return
    queued = tuple(table.loader.pending) if table.loader is not None else ()
    send_message(conn, Ready(tuple((m.name, m.description) for m in loaded), queued))
    told = table.changes  # what the front end knows of the models held
    threading.Thread(target=_read, args=(conn, inbox), name="nmt-worker-inbox", daemon=True).start()
    if cores is not None:
        cores.starting()
    try:
        with torch.inference_mode():
            while True:
                if not executor.busy and inbox.quiet(IDLE_RELEASE_S):
                    # Idle: the emptied batches' caches go, and what the last burst's peak left in
                    # the heap goes back to the OS (kept for reuse while busy: model.runtime.allocator).
                    executor.drop_empty()
                    release_freed_memory()
                if not inbox.wait_until(executor.runnable):
                    break
                if cores is not None:
                    use_threads(cores.update(busy=True))
                answers: list[Done | Failed] = []
                for sentence, result in executor.iteration():
                    if not inbox.release(sentence):
                        continue
                    if isinstance(result, BaseException):
                        answers.append(Failed(sentence.id, str(result)))
                    else:
                        answers.append(Done(sentence.id, result))
                loading = table.loader is not None and table.loader.active
                if cores is not None and not executor.busy and not inbox.waiting and not loading:
                    use_threads(cores.update(busy=False))  # asleep: its core is free for the others
                with contextlib.suppress(OSError):  # the front end is gone: the reader stops us
                    if table.changes != told:
                        told = table.changes
                        send_message(conn, Loaded(tuple(table.loaded)))
                    if answers:
                        send_message(conn, Answers(tuple(answers)))
    finally:
        if table.loader is not None:
            table.loader.close()
        if cores is not None:
            cores.update(busy=False)
        conn.close()


def use_threads(threads: int) -> None:
    """Run torch's operators on ``threads`` threads from the next one on (``CoreShare.update``)."""
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def _read(conn: Connection, inbox: Inbox) -> None:
    """The pipe's reader: sentences and cancellations go to the inbox at once."""
    while True:
        try:
            message: ToWorker = conn.recv()
        except (EOFError, OSError):  # the front end is gone
            message = Stop()
        match message:
            case Translate(sentences):
                inbox.add(sentences)
            case Cancel(ids):
                inbox.cancel(ids)
            case Load(model):
                inbox.load(model)
            case Stop():
                inbox.stop()
                return
