"""GET /metrics: Prometheus text format, every process's samples merged (app.monitoring.metrics)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.http.deps import MetricsDep

api = APIRouter(tags=["metrics"])


@api.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.collect(), media_type=CONTENT_TYPE_LATEST)
