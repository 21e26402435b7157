"""GET /languages: LibreTranslate's language list, from the loaded model's metadata."""

from __future__ import annotations

from fastapi import APIRouter

from app.deps import TranslatorDep
from app.languages import languages
from app.schemas import Language

router = APIRouter(tags=["languages"])


@router.get("/languages", response_model=list[Language], summary="Languages and their targets")
async def list_languages(translator: TranslatorDep) -> list[dict[str, object]]:
    return languages(translator.info)
