"""FastAPI dependencies: the service's state lives on ``app.state`` and reaches routes through these.

``app.state`` holds ``settings``, ``metrics``, ``translator``, ``engine`` and ``ready``; the
lifespan (app.main) fills them. Routes that need the model depend on ``TranslatorDep`` or
``EngineDep``, which answer 503 until the model is loaded and warmed up.

They are ``async def`` although they never await: FastAPI runs a plain ``def`` dependency in its
thread pool, and three thread hops per request cost the model thread the GIL (under load from 64
clients, throughput rose from ~95 to ~109 sentences/s (continuous) and ~111 to ~122 (dynamic)
when they went, two interleaved runs each).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from app.config import Settings
from app.engine import TranslationEngine
from app.metrics import Metrics
from model.translator import Translator

NOT_READY = "the model is not loaded yet (or the service is shutting down)"


async def get_settings(request: Request) -> Settings:
    settings: Settings | None = request.app.state.settings
    if settings is None:  # only before the lifespan has read the environment
        raise HTTPException(503, NOT_READY)
    return settings


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


async def get_translator(request: Request) -> Translator:
    translator: Translator | None = request.app.state.translator
    if translator is None:
        raise HTTPException(503, NOT_READY)
    return translator


async def get_engine(request: Request) -> TranslationEngine:
    engine: TranslationEngine | None = request.app.state.engine
    if engine is None or not request.app.state.ready:
        raise HTTPException(503, NOT_READY)
    return engine


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
TranslatorDep = Annotated[Translator, Depends(get_translator)]
EngineDep = Annotated[TranslationEngine, Depends(get_engine)]
