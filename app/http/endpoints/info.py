"""GET /info: what is being served and how (models, routes, device, batching, limits); GET /spec:
the API's description, where LibreTranslate serves its own."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app.config import service_version
from app.http.deps import RouterDep, SchedulerDep, SettingsDep
from app.models.served import ServedModel
from app.translation.codes import languages

api = APIRouter(tags=["info"])


def describe_model(model: ServedModel) -> dict[str, Any]:
    meta, description = model.info, model.description
    return {
        # The directory's name only: its full path says nothing useful to clients.
        "name": model.name,
        "source": meta.source_lang,  # "mul" for a multilingual model: see directions
        "target": meta.target_lang,
        "directions": [f"{s}-{t}" for s, t in meta.directions],
        "config": meta.config.to_dict(),
        "training": meta.training,
        "workers": model.workers,
        "device": description.device,
        "dtype": description.dtype,
        "quantization": description.quantization,
        # "compiled": each decoding step one AOTInductor graph, compiled (or loaded from the cache)
        # at start-up in compile_seconds; "eager": operator by operator (NMT_COMPILE=false, or not
        # on CPU).
        "decoding": description.decoding,
        "compile_seconds": description.compile_seconds,
        # "at start": a worker that owns it (each model is one worker's own, a single model every
        # worker's) loaded it before the service was ready, as each its first own model;
        # "after start": its owner loads it in the background once ready, one model at a time;
        # "on first request": it did not fit in NMT_WORKER_MODEL_MEMORY_MB beside those, and a
        # worker loads it when a sentence needs it. A sentence whose model is not loaded yet waits
        # for the load (about load_seconds of a model this size; nmt_model_load_wait_seconds),
        # while the worker's other models go on; a worker evicts its least recently used idle
        # model to make room.
        "loaded": description.loaded,
        "load_seconds": description.load_seconds,  # in a worker, at start (0: not loaded yet)
        "weight_mb": round(description.weight_bytes / 2**20, 1),  # in each worker that holds it
    }


def resident_mb(pid: int | None) -> float | None:
    """A process's resident memory in MiB (Linux: /proc/<pid>/status), None where unknown."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


@api.get("/info", summary="Models, routes, device, batching and limits")
async def info(settings: SettingsDep, router: RouterDep, scheduler: SchedulerDep) -> dict[str, Any]:
    # A process's memory once, however many of its workers (threads) it runs.
    workers = [resident_mb(pid) for pid in dict.fromkeys(state.worker.pid for state in scheduler.workers)]
    front_end = resident_mb(os.getpid())
    known = [m for m in (front_end, *workers) if m is not None]
    return {
        "version": service_version(),
        "models": [
            # held_by: the workers that hold it loaded now, as they last said (0: none yet; a
            # sentence for it waits for a load).
            {**describe_model(model), "held_by": sum(model.name in s.loaded for s in scheduler.workers)}
            for model in router.models
        ],
        # Resident memory now, in MiB: the front end's process and each worker's (a model's own
        # share is its weight_mb in each worker that holds it). None where the OS does not say.
        "memory": {
            "front_end_mb": front_end,
            "workers_mb": workers,
            "total_mb": round(sum(known), 1) if known else None,
        },
        "routes": {
            "direct": [
                {"source": r.source, "target": r.target, "model": r.hops[0].model.name} for r in router.direct
            ],
            # A pair no model serves, translated into English by one model and from English by another.
            "pivot": [
                {
                    "source": r.source,
                    "target": r.target,
                    "via": r.pivot,
                    "models": [hop.model.name for hop in r.hops],
                }
                for r in router.pivots
            ],
        },
        "languages": languages(router),
        "batching": {
            "max_batch_size": settings.max_batch_size,
            "max_batch_tokens": settings.max_batch_tokens,
            "max_queue": settings.max_queue,  # all models together
            # worker processes, each serving every model with a batch per model (0: one per core)
            "replicas": settings.replicas,
            # the models' weights one worker may hold, in MiB (0: no limit: each worker loads all
            # its own models, and any other a sentence brings it)
            "worker_model_memory_mb": settings.worker_model_memory_mb,
        },
        "decoding": asdict(settings.decode_options()),
        "limits": {
            "max_chars": settings.max_chars,
            "max_texts": settings.max_texts,
            "max_body_bytes": settings.max_body_bytes,
            "request_timeout_s": settings.request_timeout_s,
            "default_beam_size": settings.default_beam_size,
            "max_beam_size": settings.max_beam_size,
            "max_alternatives": settings.max_alternatives,
        },
        "api_keys_required": settings.keys_required,
    }


@api.get(
    "/spec",
    summary="This API's OpenAPI document, with the served languages (LibreTranslate's /spec)",
    responses={200: {"content": {"application/json": {"schema": {"type": "object"}}}}},
)
async def spec(request: Request) -> JSONResponse:
    # LibreTranslate clients and tools look for the API description at /spec (LibreTranslate's is
    # Swagger 2.0; ours is the OpenAPI 3 document of /openapi.json, the same one /docs shows).
    return JSONResponse(request.app.openapi())
