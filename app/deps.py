"""FastAPI dependencies: the service's state lives on ``app.state`` and reaches routes through these.

``app.state`` holds ``settings``, ``metrics``, ``router`` (the served models, ``ServedModel``, and
the routes of every pair), ``scheduler`` (which holds the workers) and ``ready``; the lifespan
(app.main) fills them. Routes that need the models depend on ``RouterDep`` or ``SchedulerDep``,
which answer 503 until the workers are started and warm.

They are ``async def`` although they never await: FastAPI runs a plain ``def`` dependency in its
thread pool, a thread hop per request that the event loop pays for in CPU.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from app.config import Settings
from app.metrics import Metrics
from app.served import ServedModel
from app.serving.frontend.router import Router
from app.serving.frontend.scheduler import Scheduler

NOT_READY = "the models are not loaded yet (or the service is shutting down)"


async def get_settings(request: Request) -> Settings:
    settings: Settings | None = request.app.state.settings
    if settings is None:  # only before the lifespan has read the environment
        raise HTTPException(503, NOT_READY)
    return settings


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics | None = request.app.state.metrics
    if metrics is None:
        raise HTTPException(503, NOT_READY)
    return metrics


async def get_router(request: Request) -> Router[ServedModel]:
    router: Router[ServedModel] | None = request.app.state.router
    if router is None:
        raise HTTPException(503, NOT_READY)
    return router


async def get_scheduler(request: Request) -> Scheduler:
    scheduler: Scheduler | None = request.app.state.scheduler
    if scheduler is None or not request.app.state.ready:
        raise HTTPException(503, NOT_READY)
    return scheduler


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
RouterDep = Annotated[Router[ServedModel], Depends(get_router)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
