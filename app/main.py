"""The FastAPI application: ``uvicorn app.main:app`` serves the model directory in ``NMT_MODEL_DIR``.

Importing this module is cheap: settings are read and the model is loaded in the lifespan, so a
bad setting or a broken model directory stops the server at start with a one-line message and a
non-zero exit status, instead of an import traceback or a server that answers 500s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NoReturn

from fastapi import FastAPI
from pydantic import ValidationError

from app.config import Settings, describe_settings_error, service_version
from app.engine import WARMUP_SENTENCES, Engine, EngineError, TranslationEngine, open_translator
from app.errors import install_error_handlers
from app.metrics import Metrics
from app.middleware import RequestMetricsMiddleware
from app.model_thread import ModelThread
from app.replicas import EnginePool, RemoteEngine
from app.routes import health, info, languages, metrics, translate
from app.routes.info import dtype_name
from model.checkpoint import ModelDirError
from model.translator import Translator

# A child of uvicorn's general logger: under uvicorn these lines get its handler and format
# ("ERROR:    cannot load model: ..."); elsewhere they propagate to the root logger as usual.
logger = logging.getLogger("uvicorn.error").getChild("nmt")


def fail(message: str) -> NoReturn:
    """Stop the server at start: one clear line in the log, then a non-zero exit."""
    logger.error(message)
    # "from None": the message above says it all; the chained traceback would only bury it.
    raise SystemExit(1) from None


def read_settings(app: FastAPI) -> Settings:
    settings: Settings | None = app.state.settings
    if settings is not None:
        return settings
    try:
        return Settings()
    except ValidationError as e:
        fail(describe_settings_error(e))


def load_translator(settings: Settings) -> Translator:
    try:
        return open_translator(settings)
    except ModelDirError as e:  # names the missing or corrupted file
        fail(f"cannot load model: {e}")
    except ValueError as e:  # e.g. NMT_DEVICE=cuda on a machine without CUDA
        fail(f"cannot load model from {settings.model_dir}: {e}")


def replica_threads(settings: Settings) -> int | None:
    """torch threads of each replica's model thread: ``NMT_THREADS``, or else torch's default for a
    single replica and the usable cores shared out among several."""
    if settings.threads or settings.replicas == 1:
        return settings.threads or None
    return max(1, len(os.sched_getaffinity(0)) // settings.replicas)


async def start_replicas(settings: Settings, metrics: Metrics, threads: int | None) -> EnginePool:
    """``settings.replicas`` child processes, each running the model and an engine, started together."""
    remotes = [
        RemoteEngine(settings, threads=threads or 1, metrics=metrics, name=f"replica-{i}")
        for i in range(settings.replicas)
    ]
    started = await asyncio.gather(*(r.start() for r in remotes), return_exceptions=True)
    failures = [e for e in started if isinstance(e, BaseException)]
    if failures:
        for remote in remotes:
            remote.stop()
        if isinstance(failures[0], EngineError):
            fail(f"cannot start a model replica: {failures[0]}")
        raise failures[0]
    return EnginePool(remotes)


async def warm_up(engine: Engine) -> None:
    """One translation before accepting traffic: the first request should not pay for lazy
    initialisation (allocator, kernels, thread pools)."""
    try:
        await engine.translate(WARMUP_SENTENCES, beam_size=1)
    except Exception as e:
        logger.exception("warm-up translation failed")
        fail(f"warm-up translation failed: {type(e).__name__}: {e}")


def record_model(metrics: Metrics, settings: Settings, translator: Translator, seconds: float) -> None:
    metrics.model_load.set(seconds)
    metrics.model_info.info(
        {
            "model": settings.model_dir.name,
            "source": translator.info.source_lang,
            "target": translator.info.target_lang,
            "device": str(translator.device),
            "dtype": dtype_name(translator),
            "quantization": translator.quantization,
            "version": service_version(),
        }
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings = read_settings(app)
    app.state.settings = settings
    metrics: Metrics = app.state.metrics
    started = time.perf_counter()
    # The model is loaded on the thread that will run it, and the event loop never runs torch:
    # OpenMP is much slower once two threads have started parallel work (app/model_thread.py).
    # With replicas, this copy only answers what the routes ask (languages, tokenizer, /info).
    threads = replica_threads(settings)
    model_thread = ModelThread(threads=threads)
    try:
        translator = await model_thread.run(load_translator, settings)
    except BaseException:
        model_thread.shutdown()
        raise
    engine: TranslationEngine | None = None
    try:
        if settings.replicas == 1:
            engine = Engine.from_settings(translator, settings, metrics=metrics, model_thread=model_thread)
            engine.start()
            if settings.warmup:
                await warm_up(engine)
        else:  # the model runs (and warms up) in the replicas; this process keeps HTTP and metrics
            engine = await start_replicas(settings, metrics, threads)
        record_model(metrics, settings, translator, time.perf_counter() - started)
        app.state.translator = translator
        app.state.engine = engine
        app.state.ready = True
        logger.info(
            "serving %s (%s->%s) on %s",
            settings.model_dir,
            translator.info.source_lang,
            translator.info.target_lang,
            translator.device,
        )
        yield
    finally:
        app.state.ready = False  # readiness fails first, so load balancers stop sending traffic
        if engine is not None:
            engine.stop()
        model_thread.shutdown()


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app; ``settings`` None reads ``NMT_*`` from the environment when the app starts."""
    app = FastAPI(
        title="nmt-service",
        version=service_version(),
        description="Self-hosted neural machine translation, LibreTranslate-compatible API.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.translator = None
    app.state.engine = None
    app.state.ready = False
    app.add_middleware(RequestMetricsMiddleware, metrics=app.state.metrics)
    install_error_handlers(app)
    for module in (translate, languages, health, info, metrics):
        app.include_router(module.router)
    return app


app = create_app()
