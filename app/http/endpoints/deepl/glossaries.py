"""DeepL's glossaries on the service's stored glossaries (``app.terminology.glossaries``, through
``app.http.endpoints.glossaries``): POST/GET /v2/glossaries, GET/DELETE /v2/glossaries/{id}, GET
/v2/glossaries/{id}/entries.

The same store, limits and owners as /glossaries (a glossary made here is one of /glossaries and
the other way round), the entries read as DeepL reads them (TSV or CSV: ``app.terminology.tables``),
the answers in DeepL's shape. Without keys: 403 unless the operator shares the stores
(``NMT_SHARED_STORES``), as for /glossaries.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, Field

from app.http.body import URLENCODED
from app.http.deps import GlossariesDep, KeysDep, SettingsDep
from app.http.endpoints.access import STORES
from app.http.endpoints.deepl.errors import COMMON, DeepLRoute, errors
from app.http.endpoints.glossaries import in_store, new_glossary, owner_of
from app.http.endpoints.openapi import object_schema, request_body
from app.keys.limits import KeyLimiter
from app.terminology.glossaries import MAX_NAME_CHARS, Glossary, GlossaryInfo, GlossaryStore

api = APIRouter(tags=["deepl"], route_class=DeepLRoute, dependencies=STORES)

TSV = "text/tab-separated-values"


class DeepLGlossary(BaseModel):
    glossary_id: str
    name: str
    ready: bool = Field(description="Always true: a glossary is usable once made")
    source_lang: str
    target_lang: str
    creation_time: str = Field(description="ISO 8601, UTC, with microseconds")
    entry_count: int

    @classmethod
    def of(cls, info: GlossaryInfo) -> DeepLGlossary:
        # DeepL's clients parse the time with a fraction and a zone (%Y-%m-%dT%H:%M:%S.%f%z).
        created = datetime.fromtimestamp(info.created, UTC).isoformat(timespec="microseconds")
        return cls(
            glossary_id=info.id,
            name=info.name,
            ready=True,
            source_lang=info.source_lang,
            target_lang=info.target_lang,
            creation_time=created.replace("+00:00", "Z"),
            entry_count=info.entry_count,
        )


class DeepLGlossaries(BaseModel):
    glossaries: list[DeepLGlossary]


_FIELDS = {
    "name": {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS},
    "source_lang": {"type": "string", "pattern": "^[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8})*$"},
    "target_lang": {"type": "string", "pattern": "^[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8})*$"},
    "entries": {"type": "string", "minLength": 1, "description": "A TSV or CSV table"},
    "entries_format": {"type": "string", "enum": ["tsv", "csv"], "default": "tsv"},
}
_REQUIRED = ["name", "source_lang", "target_lang", "entries"]
_CREATE_BODY = request_body(
    {"application/json": object_schema(_FIELDS, _REQUIRED), URLENCODED: object_schema(_FIELDS, _REQUIRED)}
)
_ERRORS = {
    **COMMON,
    "_400": "A field missing, a malformed table (the message names its line), a bad language code, "
    "or the key's glossaries at NMT_MAX_GLOSSARIES",
    "_403": "Missing or invalid key; without keys, unless NMT_SHARED_STORES is on",
}


@api.post(
    "/v2/glossaries",
    status_code=201,
    response_model=DeepLGlossary,
    openapi_extra=_CREATE_BODY,
    summary="Make a glossary (DeepL API v2)",
    responses=errors(**_ERRORS, _413="Over a limit: the body, the table's bytes, entries or a term's length"),
)
async def create_glossary(
    request: Request, settings: SettingsDep, keys: KeysDep, store: GlossariesDep
) -> DeepLGlossary:
    return DeepLGlossary.of(await new_glossary(request, settings, keys, store))


@api.get(
    "/v2/glossaries",
    response_model=DeepLGlossaries,
    summary="The key's glossaries",
    responses=errors(**_ERRORS),
)
async def list_glossaries(request: Request, keys: KeysDep, store: GlossariesDep) -> DeepLGlossaries:
    found = await in_store(store.list, await owner_of(request, keys, None))
    return DeepLGlossaries(glossaries=[DeepLGlossary.of(info) for info in found])


async def owned(request: Request, keys: KeyLimiter, store: GlossaryStore, glossary_id: str) -> Glossary:
    """The key's glossary of that id (404 if it has none)."""
    glossary = await in_store(store.get, await owner_of(request, keys, None), glossary_id)
    if glossary is None:
        raise HTTPException(404, f"no glossary {glossary_id[:64]!r}")
    return glossary


@api.get(
    "/v2/glossaries/{glossary_id}",
    response_model=DeepLGlossary,
    summary="One of the key's glossaries",
    responses=errors(**_ERRORS, _404="No glossary of this id for this key"),
)
async def get_glossary(
    glossary_id: str, request: Request, keys: KeysDep, store: GlossariesDep
) -> DeepLGlossary:
    return DeepLGlossary.of((await owned(request, keys, store, glossary_id)).info)


@api.get(
    "/v2/glossaries/{glossary_id}/entries",
    response_class=Response,
    summary="A glossary's entries, as TSV",
    responses={
        200: {"content": {TSV: {"schema": {"type": "string"}}}, "description": "source<TAB>target lines"},
        **errors(**_ERRORS, _404="No glossary of this id for this key"),
    },
)
async def glossary_entries(
    glossary_id: str, request: Request, keys: KeysDep, store: GlossariesDep
) -> Response:
    glossary = await owned(request, keys, store, glossary_id)
    # (A term holds no tab nor newline: app.terminology.tables refuses control characters.)
    table = "".join(f"{entry.source}\t{entry.target}\n" for entry in glossary.entries)
    return Response(table, media_type=TSV)


@api.delete(
    "/v2/glossaries/{glossary_id}",
    status_code=204,
    response_class=Response,
    summary="Delete one of the key's glossaries",
    responses=errors(**_ERRORS, _404="No glossary of this id for this key"),
)
async def delete_glossary(
    glossary_id: str, request: Request, keys: KeysDep, store: GlossariesDep
) -> Response:
    if not await in_store(store.delete, await owner_of(request, keys, None), glossary_id):
        raise HTTPException(404, f"no glossary {glossary_id[:64]!r}")
    return Response(status_code=204)
