"""POST /memories, GET /memories, DELETE /memories: your API key's translation memory.

POST uploads a TMX file, or a TSV file of ``source<TAB>target`` lines with ``source_lang`` and
``target_lang`` (multipart: ``file`` and those fields, ``format`` tmx or tsv when the file's name
does not say); its segments are added to what the key's memory holds (a segment already there
gets the new translation). GET counts the segments per language pair; DELETE empties the memory.
A sentence of a /translate request found in the memory (exactly, whitespace aside) is answered from
it without decoding (``app.terminology.memory``).

The key and the checks before the body are the glossaries' (``app.http.endpoints.access``): without keys,
403 unless ``NMT_SHARED_STORES`` shares one memory among all clients.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from app.http.body import MULTIPART, media_type, validate_request
from app.http.deps import KeysDep, MemoryDep, SettingsDep
from app.http.endpoints.access import STORES, ApiKeyQuery
from app.http.endpoints.glossaries import (
    ERRORS,
    FORM_OVERHEAD_BYTES,
    in_store,
    owner_of,
    read_fields,
    store_error,
)
from app.http.endpoints.openapi import multipart_body
from app.terminology.memory import MemoryImportError, TranslationMemory
from app.translation.errors import missing_parameter

api = APIRouter(tags=["memories"], dependencies=STORES)

MEMORY_ERRORS: dict[int | str, dict[str, Any]] = {
    **{code: ERRORS[code] for code in (403, 429, 503)},
    400: {
        **ERRORS[400],
        "description": "Not a multipart upload, the file or a language missing; a key in the body "
        "other than the header's",
    },
    413: {
        **ERRORS[413],
        "description": "Over a limit: the file's bytes, a segment's length, the key's segments",
    },
    422: {
        **ERRORS[422],
        "description": "A malformed TMX or TSV file (the message names its line), a DTD with entities",
    },
}


_OPENAPI_BODY = multipart_body(
    {
        "file": {"type": "string", "format": "binary", "description": "A TMX or TSV file"},
        "format": {"type": "string", "enum": ["tmx", "tsv"]},
        "source_lang": {"type": "string", "description": "The TSV file's source language"},
        "target_lang": {"type": "string", "description": "The TSV file's target language"},
        "api_key": {"type": "string"},
    },
    ["file"],
)


class MemoryForm(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: Literal["tmx", "tsv"] | None = Field(None, description="tmx or tsv; by default the file name's")
    source_lang: str | None = Field(None, description="The TSV file's source language")
    target_lang: str | None = Field(None, description="The TSV file's target language")
    api_key: str | None = None


class ImportResult(BaseModel):
    imported: int = Field(description="Segments read from the file (a TMX unit gives one per language pair)")
    segments: int = Field(description="Segments the memory holds now")


class PairSegments(BaseModel):
    source_lang: str
    target_lang: str
    segments: int


class MemoryStats(BaseModel):
    segments: int
    pairs: list[PairSegments]


class Deleted(BaseModel):
    deleted: int


async def counts(memory: TranslationMemory, owner: str) -> MemoryStats:
    found = await in_store(memory.stats, owner)
    pairs = [
        PairSegments(source_lang=p.source_lang, target_lang=p.target_lang, segments=p.segments) for p in found
    ]
    return MemoryStats(segments=sum(p.segments for p in pairs), pairs=pairs)


@api.post("/memories", responses=MEMORY_ERRORS, openapi_extra=_OPENAPI_BODY)
async def import_memory(
    request: Request, settings: SettingsDep, keys: KeysDep, memory: MemoryDep
) -> ImportResult:
    """Add a TMX or TSV file's segments to your API key's translation memory."""
    if media_type(request) != MULTIPART:
        raise HTTPException(
            400, "send the file as multipart/form-data (fields file, and for TSV source_lang, target_lang)"
        )
    fields, upload, data = await read_fields(request, settings.memory_max_bytes + FORM_OVERHEAD_BYTES)
    if fields.get("api_key") == "":
        del fields["api_key"]
    values = validate_request(fields, MemoryForm)
    owner = await owner_of(request, keys, values.api_key)
    if upload is None:
        raise missing_parameter("file")
    name = (upload.filename or "").lower()
    fmt = values.format or ("tsv" if name.endswith((".tsv", ".txt", ".tab")) else "tmx")
    try:
        if fmt == "tmx":
            imported = await in_store(memory.import_tmx, owner, data)
        else:
            if not values.source_lang:
                raise missing_parameter("source_lang")
            if not values.target_lang:
                raise missing_parameter("target_lang")
            imported = await in_store(memory.import_tsv, owner, values.source_lang, values.target_lang, data)
    except MemoryImportError as e:
        raise store_error(e) from None
    return ImportResult(imported=imported, segments=(await counts(memory, owner)).segments)


@api.get("/memories", responses=MEMORY_ERRORS)
async def memory_stats(
    request: Request, keys: KeysDep, memory: MemoryDep, api_key: ApiKeyQuery = None
) -> MemoryStats:
    """How many segments your API key's memory holds, per language pair."""
    return await counts(memory, await owner_of(request, keys, api_key))


@api.delete("/memories", responses=MEMORY_ERRORS)
async def delete_memory(
    request: Request, keys: KeysDep, memory: MemoryDep, api_key: ApiKeyQuery = None
) -> Deleted:
    """Empty your API key's translation memory."""
    deleted = await in_store(memory.delete, await owner_of(request, keys, api_key))
    return Deleted(deleted=deleted)
