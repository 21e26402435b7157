"""The FastAPI application: ``uvicorn app.main:app`` serves the model directories in ``NMT_MODEL_DIR``.

This process is the HTTP front end: it parses and checks requests, tokenizes, admits or refuses,
and routes sentences to model workers, child processes that decode (``app.serving``; each worker
serves every model, loading one when a sentence first needs it); it never runs a model itself. Importing this
module is cheap: settings are read and the workers started in the lifespan, so a bad setting or a
broken model directory stops the server at start with a one-line message and a non-zero exit
status, instead of an import traceback or a server that answers 500s.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from types import FrameType
from typing import Any, NoReturn

from fastapi import FastAPI
from pydantic import ValidationError

from app.config import Settings, describe_settings_error, service_version
from app.http.deps import services_of
from app.http.direct import DirectRoute
from app.http.endpoints import (
    deepl,
    detect,
    files,
    frontend,
    glossaries,
    health,
    info,
    jobs,
    languages,
    memories,
    metrics,
    translate,
)
from app.http.entry import TranslationApp
from app.http.errors import install_error_handlers
from app.http.middleware import RequestMetricsMiddleware
from app.http.shedding import TURNS
from app.http.slow_clients import ClientLimit
from app.http.uploads import FileRequests
from app.jobs.disk import MIB
from app.jobs.runner import JobRunner
from app.jobs.store import JobStore
from app.keys.accepted import KeysError
from app.keys.limits import open_key_limiter
from app.models.fetched import named_model_dirs
from app.models.served import ServedModel, find_model_dirs, load_calibration, model_names
from app.monitoring.loop import watch_event_loop
from app.monitoring.metrics import Metrics, process_metrics
from app.services import AppServices
from app.serving.cores import CoreBoard, CoreShare
from app.serving.frontend.handle import WorkerProcess
from app.serving.frontend.router import Router
from app.serving.frontend.scheduler import Scheduler
from app.serving.protocol import ModelDescription, ModelSpec
from app.stores.database import Database, StoreUnavailable
from app.stores.database.postgres import DatabaseUnusable, Postgres, PostgresDatabase
from app.stores.downloads import SharedFileStore
from app.terminology.cache import SegmentCache
from app.terminology.glossaries import GlossaryStore
from app.terminology.memory import TranslationMemory
from app.translation.codes import source_languages, target_languages
from app.translation.documents import Documents
from app.translation.langid import prepare as prepare_langid
from app.translation.sentences import Recall
from model.directory import ModelDirError, ModelInfo
from model.fetch import FetchError
from model.tokenizer import Tokenizer

# A child of uvicorn's general logger: under uvicorn these lines get its handler and format
# ("ERROR:    cannot load model: ..."); elsewhere they propagate to the root logger as usual.
logger = logging.getLogger("uvicorn.error").getChild("nmt")


def fail(message: str) -> NoReturn:
    """Stop the server at start: one clear line in the log, then a non-zero exit."""
    logger.error(message)
    # "from None": the message above says it all; the chained traceback would only bury it.
    raise SystemExit(1) from None


def read_settings(services: AppServices) -> Settings:
    if services.settings is not None:
        return services.settings
    try:
        return Settings()
    except ValidationError as e:
        fail(describe_settings_error(e))


def worker_count(settings: Settings) -> int:
    """Workers, every one serving every model: ``NMT_REPLICAS``, or else one per usable core on CPU
    and one on a GPU (one single-threaded worker per core is the fastest way to run a model,
    docs/architecture.md "Worker processes"). Not per model: more models add weights to each
    worker's memory, not processes. A worker with nothing to translate sleeps on its pipe."""
    if settings.replicas:
        return settings.replicas
    on_gpu = settings.device.startswith("cuda") or (settings.device == "auto" and cuda_available())
    return 1 if on_gpu else len(os.sched_getaffinity(0))


def worker_threads(settings: Settings) -> int:
    """torch threads of each worker: ``NMT_THREADS``, or else the usable cores shared out among the
    workers."""
    return settings.threads or max(1, len(os.sched_getaffinity(0)) // worker_count(settings))


def worker_processes(settings: Settings, count: int) -> list[list[int]]:
    """Which workers (by index, of ``count``) each worker process runs: ``NMT_WORKER_PROCESSES``
    of them, the workers dealt out in turn; a process per worker with 0."""
    processes = min(settings.worker_processes or count, count)
    return [list(range(p, count, processes)) for p in range(processes)]


def cuda_available() -> bool:
    """Whether the CUDA driver sees a device (``CUDA_VISIBLE_DEVICES`` applies), asked of the driver
    itself: the front end never imports torch (its memory and import time, for this one answer).
    What the workers run on is what they report when ready: ``lifespan`` warns when a torch
    without CUDA runs on the CPU of a machine whose driver sees a device."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver
        return False
    count = ctypes.c_int(0)
    return driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def quiet_garbage_collector() -> None:
    """Keep the cyclic garbage collector's pauses short under load.

    What start-up made stays for good: frozen, out of the collector's sight. A full collection walks
    every live object, thousands per open connection: at the default thresholds it came every 1-1.5 s
    at 2,048 connections and held the event loop for 0.3-0.4 s each time. It now comes after 1,000
    collections of the middle generation, not 10 (minutes apart under that load; each held the loop
    for 80-100 ms there, with the closed connections' cycles broken: ``app.http.connections``).

    The young generation keeps its default of 700: its threshold counts allocations *less
    deallocations of any generation's objects*, so under a steady flow of requests, whose objects die
    as fast as new ones are made, 10,000 let it swell to 100,000 live objects between collections,
    and each of them walked them all: 40 ms, many times a second (``/health`` then took up to 0.3 s,
    not 17 ms: ``benchmarks.overload``).
    """
    gc.freeze()
    gc.set_threshold(700, 10, 1_000)


def open_models(settings: Settings) -> list[tuple[ModelSpec, ModelInfo, Tokenizer]]:
    """Every model directory ``NMT_MODEL_DIR`` names, then those of ``NMT_MODELS`` (fetched now where
    they were not before: app/models/fetched.py), with their metadata and vocabulary; a missing or broken
    one stops the start here, named, before any worker starts."""
    try:
        dirs = find_model_dirs(settings.model_dir)
        if settings.models:
            named = named_model_dirs(settings.models, settings.model_store, settings.argos_index)
            # NMT_MODEL_DIR may name the store too: each directory once.
            known = {d.resolve() for d in dirs}
            dirs += [d for d in named if d.resolve() not in known]
        return [
            (ModelSpec(name, path), *ServedModel.open(path))
            for name, path in zip(model_names(dirs), dirs, strict=True)
        ]
    except FetchError as e:
        fail(str(e))
    except ModelDirError as e:
        fail(f"cannot load model: {e}")


def record_model(metrics: Metrics, model: ServedModel) -> None:
    """The model's description (its load time is the workers' to record, as they load it)."""
    metrics.model_info.labels(
        model=model.name,
        source=model.info.source_lang,
        target=model.info.target_lang,
        device=model.description.device,
        dtype=model.description.dtype,
        quantization=model.description.quantization,
        version=service_version(),
    ).set(1)


# The signals on which uvicorn begins its graceful shutdown (uvicorn.server.HANDLED_SIGNALS on POSIX).
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def readiness_fails_on_shutdown(services: AppServices) -> Iterator[None]:
    """Fail readiness the moment a shutdown signal arrives, then pass the signal on to the handler
    that was there: uvicorn's, which starts its drain.

    uvicorn runs the lifespan's end only after the drain, once every request in flight is answered;
    readiness failing only then would say "ready" for the whole drain. uvicorn installs its handlers
    (``signal.signal``, in ``Server.capture_signals``) before it starts the lifespan, so the one
    found here is uvicorn's; it is put back when the block ends. Signals reach only the main thread:
    elsewhere (Starlette's TestClient runs the lifespan on another thread) nothing is installed.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in SHUTDOWN_SIGNALS}

    def on_shutdown_signal(sig: int, frame: FrameType | None) -> None:
        services.ready = False
        # Logged from the event loop: a write to stderr from inside a signal handler can interrupt
        # another write to it ("reentrant call" on the buffered stream).
        loop.call_soon_threadsafe(
            logger.info, "%s: not ready; answering the requests in flight", signal.Signals(sig).name
        )
        handler = previous[signal.Signals(sig)]
        if callable(handler):
            handler(sig, frame)
        elif handler == signal.SIG_DFL:  # nobody else handles it: what the signal would have done
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)

    for sig in SHUTDOWN_SIGNALS:
        signal.signal(sig, on_shutdown_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is on_shutdown_signal:
                signal.signal(sig, handler)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    services = services_of(app)
    settings = read_settings(services)
    services.settings = settings
    metrics = process_metrics()
    services.metrics = metrics
    try:
        keys = await open_key_limiter(settings, metrics)
    except KeysError as e:
        fail(f"invalid configuration: {e}")
    services.keys = keys
    services.clients = ClientLimit.of(settings.max_connections_per_client)
    database = await open_shared_database(settings)
    services.database = database
    if database is not None and keys.store is not None and not settings.redis_url:
        logger.warning(
            "NMT_DATABASE_URL is set without NMT_REDIS_URL: the keys' limits are counted in this "
            "replica's NMT_DATA_DIR, so with N replicas a key gets up to N times its limits"
        )
    # SQLite files are opened on first use (app/stores/database/): nothing touches NMT_DATA_DIR until then.
    glossaries = GlossaryStore(
        settings.data_dir, settings.max_glossaries, settings.glossary_max_entries, server=database
    )
    services.glossaries = glossaries
    memory = TranslationMemory(
        settings.data_dir,
        settings.memory_max_segments,
        settings.memory_max_bytes,
        max_segment_chars=settings.max_chars,
        server=database,
    )
    services.memory = memory
    jobs_store = JobStore(
        settings.data_dir / "jobs",
        settings.max_jobs_per_key,
        settings.max_jobs,
        settings.job_ttl_s,
        quota_bytes=settings.data_quota_mb * MIB,
        reserve_bytes=settings.data_reserve_mb * MIB,
        server=database,
        lease_s=settings.job_lease_s,
    )
    file_store = files.new_file_store(settings, database)
    if database is not None:
        shared = [glossaries.db, memory.db, jobs_store.db]
        if isinstance(file_store, SharedFileStore):
            shared.append(file_store.db)
        await migrate_stores(database, shared)
    segment_cache: SegmentCache[Any] = SegmentCache(settings.segment_cache_mb * 1024 * 1024, metrics)
    services.segment_cache = segment_cache
    opened = open_models(settings)  # checked here too, so that a broken directory is named first
    specs = tuple(spec for spec, _, _ in opened)
    threads, count = worker_threads(settings), worker_count(settings)
    # A lone worker may run on the other workers' threads too (app/serving/cores.py).
    board = CoreBoard(count) if settings.idle_cores else None
    per_process = worker_processes(settings, count)

    def share(i: int) -> CoreShare | None:
        return None if board is None else board.share(i, own=threads, alone=count * threads)

    processes = [
        WorkerProcess(
            settings,
            specs,
            threads=threads,
            metrics_dir=str(metrics.directory),
            name=f"nmt-worker-{mine[0]}" if len(mine) == 1 else f"nmt-workers-{mine[0]}",
            workers=len(mine),
            cores=[share(i) for i in mine],
        )
        for mine in per_process
    ]
    workers = [worker for process in processes for worker in process.workers]
    scheduler = Scheduler(
        workers,
        models=[spec.name for spec in specs],
        max_queue=settings.max_queue,
        max_batch_size=settings.max_batch_size,
        metrics=metrics,
    )
    try:
        await scheduler.start()
    except (RuntimeError, TimeoutError) as e:  # a worker's reason: a bad device, weights that do not load
        fail(f"cannot start a model worker: {e}")
    try:
        models = []
        # The models the workers loaded at start (each its first own one), and those they load
        # in the background once ready (their other own ones that fit in their budgets).
        descriptions = {name: d for worker in reversed(workers) for name, d in worker.descriptions.items()}
        queued = {name for worker in workers for name in worker.queued}
        for spec, model_info, tokenizer in opened:
            description = descriptions.get(spec.name) or on_demand(
                settings, descriptions, after_start=spec.name in queued
            )
            on_cpu_as_if_gpu = count == 1 < len(os.sched_getaffinity(0)) and not settings.replicas
            if on_cpu_as_if_gpu and not description.device.startswith("cuda"):
                logger.warning(
                    "%s runs on %s with one worker: the CUDA driver sees a device, but the workers' "
                    "torch does not use it; set NMT_DEVICE=cpu for one worker per core",
                    spec.name,
                    description.device,
                )
            try:
                calibration = load_calibration(spec.path)
            except ModelDirError as e:
                fail(f"cannot load model: {e}")
            model = ServedModel(
                spec.name,
                model_info,
                tokenizer,
                description,
                workers=count,
                options=settings.decode_options(),
                calibration=calibration,
            )
            record_model(metrics, model)
            models.append(model)
        router = Router(models)
        quiet_garbage_collector()
        services.router = router
        services.files = file_store
        services.file_requests = FileRequests(settings.max_file_requests)
        services.readers = files.new_readers(settings)
        services.jobs = jobs_store
        recall = Recall(settings, memory, segment_cache)
        job_documents = Documents(settings, router, scheduler, recall, files.new_job_readers(settings))
        job_runner = JobRunner(jobs_store, job_documents, keys, settings.max_running_jobs)
        services.job_runner = job_runner
        await asyncio.to_thread(prepare_detection, router)
        services.scheduler = scheduler
        services.turns = asyncio.Semaphore(TURNS)
        # The loop's lag recorded, and a request that holds the loop named, while ready
        # (app/monitoring/loop.py); start-up's own work on the loop is not what it warns about.
        with readiness_fails_on_shutdown(services), watch_event_loop(metrics):
            services.ready = True
            for model in models:
                logger.info(
                    "serving %s (%s) on %s, %s",
                    model.name,
                    ", ".join(f"{s}->{t}" for s, t in model.info.directions),
                    model.description.device,
                    f"loaded {model.description.loaded}",
                )
            logger.info(
                "%d worker(s), each serving every model, started in %.1f s", count, scheduler.start_seconds
            )
            if router.pivots:
                logger.info(
                    "through English: %s", ", ".join(f"{r.source}->{r.target}" for r in router.pivots)
                )
            job_runner.start()  # jobs left by a previous run go on now
            yield
    finally:
        # On SIGTERM (or SIGINT) readiness failed at the signal, and uvicorn then stopped accepting
        # connections and answered the requests in flight (its drain) before running this. A
        # shutdown without a signal (TestClient's exit) fails readiness only here.
        services.ready = False
        runner, jobs = services.job_runner, services.jobs
        if runner is not None and jobs is not None:
            await runner.stop()  # before the workers: its chunks are withdrawn, not failed
            jobs.close()
        scheduler.stop()
        await keys.close()
        # The stores in place now: a test may have put one of its own there.
        for store in (services.glossaries, services.memory):
            if store is not None:
                store.close()
        if database is not None:
            await database.close()


async def open_shared_database(settings: Settings) -> Postgres | None:
    """The PostgreSQL of NMT_DATABASE_URL, checked every few seconds for /health/ready (None
    without it); one line and exit if it cannot be used."""
    if not settings.database_url:
        return None
    try:
        database = await asyncio.to_thread(Postgres.connect, settings.database_url)
    except DatabaseUnusable as e:
        fail(str(e))
    database.start()
    return database


async def migrate_stores(database: Postgres, stores: list[Database]) -> None:
    """Each store's migrations, applied once however many replicas start at once."""
    try:
        for store in stores:
            assert isinstance(store, PostgresDatabase)
            applied = await asyncio.to_thread(store.migrate)
            if applied:
                logger.info("the database: %d migration(s) of the %s store applied", applied, store.store)
    except StoreUnavailable as e:
        await database.close()
        fail(f"NMT_DATABASE_URL: cannot prepare the stores' tables: {e}")


def on_demand(
    settings: Settings, loaded: dict[str, ModelDescription], *, after_start: bool
) -> ModelDescription:
    """The description of a model the workers load after start, in the background, or on its
    first request (it did not fit in ``NMT_WORKER_MODEL_MEMORY_MB`` beside those): where and in
    what it will run, as for those loaded at start (one torch build, one device, the same
    settings)."""
    like = next(iter(loaded.values()))
    return replace(
        like,
        decoding="compiled" if settings.compile else "eager",
        compile_seconds=0.0,
        loaded="after start" if after_start else "on first request",
        load_seconds=0.0,
        weight_bytes=0,
    )


def prepare_detection(router: Router[ServedModel]) -> None:
    """Load language identification for every set of candidates ``source: "auto"`` and /detect
    choose among: all source languages, and those of each target."""
    prepare_langid(source_languages(router))
    for target in target_languages(router):
        prepare_langid(source_languages(router, target))


def create_app(settings: Settings | None = None) -> TranslationApp:
    """The app; ``settings`` None reads ``NMT_*`` from the environment when the app starts."""
    app = TranslationApp(
        title="nmt-service",
        version=service_version(),
        description="Self-hosted neural machine translation, LibreTranslate-compatible API.",
        lifespan=lifespan,
    )
    services = AppServices(settings=settings)
    app.state.services = services  # the lifespan fills it in
    app.add_middleware(RequestMetricsMiddleware, services=services)
    install_error_handlers(app)
    for module in (
        translate,
        detect,
        files,
        jobs,
        glossaries,
        memories,
        languages,
        frontend,
        health,
        info,
        metrics,
        deepl,
    ):
        app.include_router(module.api)
    app.mount("/static", frontend.static_files(), name="static")
    app.direct = DirectRoute(app)
    return app


app = create_app()
