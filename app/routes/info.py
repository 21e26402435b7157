"""GET /info: what is being served and how (model, device, batching, limits)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.config import service_version
from app.deps import ModelDep, SettingsDep
from app.languages import languages

router = APIRouter(tags=["info"])


@router.get("/info", summary="Model, device, batching and limits")
async def info(settings: SettingsDep, model: ModelDep) -> dict[str, Any]:
    meta = model.info
    return {
        "version": service_version(),
        # The directory's name only: its full path says nothing useful to clients.
        "model": {
            "name": model.name,
            "source": meta.source_lang,
            "target": meta.target_lang,
            "config": meta.config.to_dict(),
            "training": meta.training,
        },
        "languages": languages(meta),
        "device": model.description.device,
        "dtype": model.description.dtype,
        "quantization": model.description.quantization,
        # "compiled": each decoding step one AOTInductor graph, compiled (or loaded from the cache)
        # at start-up in compile_seconds; "eager": operator by operator (NMT_COMPILE=false, or not
        # on CPU).
        "decoding": model.description.decoding,
        "compile_seconds": model.description.compile_seconds,
        "batching": {
            "mode": settings.batching,
            "max_batch_size": settings.max_batch_size,
            "max_batch_tokens": settings.max_batch_tokens,
            "max_queue": settings.max_queue,
            "max_wait_ms": settings.max_wait_ms,
            "scheduling": settings.scheduling,
            "replicas": settings.replicas,  # worker processes, each with its own batch, queue and limits
        },
        "limits": {
            "max_chars": settings.max_chars,
            "max_texts": settings.max_texts,
            "max_body_bytes": settings.max_body_bytes,
            "request_timeout_s": settings.request_timeout_s,
            "default_beam_size": settings.default_beam_size,
            "max_beam_size": settings.max_beam_size,
            "max_alternatives": settings.max_alternatives,
        },
        "api_keys_required": bool(settings.api_keys),
    }
