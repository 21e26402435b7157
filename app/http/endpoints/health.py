"""Health checks: /health/live (the process answers), /health/ready and /health (it can translate).

/health answers LibreTranslate's body, ``{"status": "ok"}`` and nothing more (its clients and tests
compare the whole body); /health/ready adds the models served and the device.

Orchestrators restart on a failing liveness probe and stop routing on a failing readiness probe,
so liveness never depends on the models, and readiness turns 503 while loading, while shutting
down, while some model has no worker running (one that exited is being started again), and while
the Redis that counts the keys' usage (NMT_REDIS_URL) or the database of the stores
(NMT_DATABASE_URL) is unreachable, naming it: a service that cannot translate one of its pairs,
count a key's request or find a job is not ready.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.http.deps import ServicesDep
from app.http.schemas import HealthResponse, NotReadyResponse, StatusResponse
from app.services import AppServices

api = APIRouter(tags=["health"])
_NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {
        "model": NotReadyResponse,
        "description": "Loading, shutting down, a model without a worker, Redis or the database unreachable",
    }
}


def readiness(services: AppServices, details: bool = True) -> JSONResponse:
    """200 when ready (with the models and device if ``details``), else 503 saying why."""
    if not services.ready or services.scheduler is None or services.router is None:
        return JSONResponse({"status": "loading", "error": "the models are not ready"}, status_code=503)
    if not services.scheduler.alive:  # every worker of some model has exited (being started again) or stopped
        return JSONResponse(
            {"status": "error", "error": "the translation engine is not running"}, status_code=503
        )
    down = services.keys.unavailable() if services.keys is not None else None
    if down is None and services.database is not None:
        down = services.database.down()
    if down is not None:  # every request with a counted key (or for a job) would get 503: not ready either
        return JSONResponse({"status": "error", "error": down}, status_code=503)
    if not details:
        return JSONResponse(StatusResponse(status="ok").model_dump())
    models = services.router.models
    body = HealthResponse(
        status="ok", model=",".join(m.name for m in models), device=models[0].description.device
    )
    return JSONResponse(body.model_dump())


@api.get(
    "/health",
    response_model=StatusResponse,
    responses=_NOT_READY,
    summary="Ready to translate (200) or not (503), LibreTranslate's answer",
)
async def health(services: ServicesDep) -> JSONResponse:
    return readiness(services, details=False)


@api.get("/health/ready", response_model=HealthResponse, responses=_NOT_READY, summary="Readiness probe")
async def ready(services: ServicesDep) -> JSONResponse:
    return readiness(services)


@api.get("/health/live", summary="Liveness probe: 200 while the process serves requests")
async def live() -> dict[str, str]:
    return {"status": "alive"}
