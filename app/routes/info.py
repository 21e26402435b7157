"""GET /info: what is being served and how (model, device, batching, limits)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.config import service_version
from app.deps import SettingsDep, TranslatorDep
from app.languages import languages
from model.translator import Translator

router = APIRouter(tags=["info"])


def dtype_name(translator: Translator) -> str:
    return str(translator.dtype).removeprefix("torch.")


@router.get("/info", summary="Model, device, batching and limits")
async def info(settings: SettingsDep, translator: TranslatorDep) -> dict[str, Any]:
    meta = translator.info
    return {
        "version": service_version(),
        # The directory's name only: its full path says nothing useful to clients.
        "model": {
            "name": settings.model_dir.name,
            "source": meta.source_lang,
            "target": meta.target_lang,
            "config": meta.config.to_dict(),
            "training": meta.training,
        },
        "languages": languages(meta),
        "device": str(translator.device),
        "dtype": dtype_name(translator),
        "quantization": translator.quantization,
        "batching": {
            "mode": settings.batching,
            "max_batch_size": settings.max_batch_size,
            "max_batch_tokens": settings.max_batch_tokens,
            "max_queue": settings.max_queue,
            "max_wait_ms": settings.max_wait_ms,
            "replicas": settings.replicas,  # each with its own batch, queue and limits above
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
