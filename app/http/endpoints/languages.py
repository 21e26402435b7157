"""GET /languages: LibreTranslate's language list: every pair served, directly or through English."""

from __future__ import annotations

from fastapi import APIRouter

from app.http.deps import RouterDep
from app.http.schemas import Language
from app.translation.codes import languages

api = APIRouter(tags=["languages"])


@api.get("/languages", response_model=list[Language], summary="Languages and their targets")
async def list_languages(router: RouterDep) -> list[dict[str, object]]:
    return languages(router)
