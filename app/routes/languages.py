"""GET /languages: LibreTranslate's language list, from the served model's metadata."""

from __future__ import annotations

from fastapi import APIRouter

from app.deps import ModelDep
from app.languages import languages
from app.schemas import Language

router = APIRouter(tags=["languages"])


@router.get("/languages", response_model=list[Language], summary="Languages and their targets")
async def list_languages(model: ModelDep) -> list[dict[str, object]]:
    return languages(model.info)
