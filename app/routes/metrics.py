"""GET /metrics: Prometheus text format, from the app's own registry."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.deps import MetricsDep
from app.engine import TranslationEngine

router = APIRouter(tags=["metrics"])


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request, metrics: MetricsDep) -> Response:
    # Queue depth and batch occupancy are read at scrape time: they change every decoding step,
    # so pushing them from the engine would cost more than reading them when asked.
    engine: TranslationEngine | None = request.app.state.engine
    if engine is not None:
        metrics.queue_depth.set(engine.queue_depth)
        metrics.active_sequences.set(engine.active_sequences)
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
