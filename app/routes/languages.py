"""GET /languages: LibreTranslate's language list: every pair served, directly or through English."""

from __future__ import annotations

from fastapi import APIRouter

from app.deps import RouterDep
from app.languages import languages
from app.schemas import Language

api = APIRouter(tags=["languages"])


@api.get("/languages", response_model=list[Language], summary="Languages and their targets")
async def list_languages(router: RouterDep) -> list[dict[str, object]]:
    return languages(router)
