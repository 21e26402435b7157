"""POST /glossaries, GET /glossaries, GET /glossaries/{id}, DELETE /glossaries/{id}.

A glossary is made from JSON (``{"name", "source_lang", "target_lang", "entries": [{"source",
"target"}, ...]}``, or ``"entries"`` as the text of a CSV or TSV table with ``"entries_format"``)
or from a form (multipart or urlencoded: the same fields, or the table as the upload ``file``).
Each API key sees its own glossaries only (``app.terminology.glossaries``); the key is in a
header (``Authorization: Bearer KEY``, ``X-API-Key``) or the ``api_key`` query parameter, checked
before the body is read, or else the ``api_key`` field of the body; each request counts as one
under the key's limits, as a /translate request does. Without keys: 403 unless the operator
shares one set among all clients (``NMT_SHARED_STORES``). A POST or DELETE a page of another site
sent is refused (``app.http.endpoints.access``).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile

from app.config import Settings
from app.http.body import (
    MULTIPART,
    media_type,
    parse_text_body,
    read_within,
    replayed,
    validate_request,
)
from app.http.deps import GlossariesDep, KeysDep, SettingsDep
from app.http.endpoints.access import STORES, ApiKeyQuery
from app.http.endpoints.openapi import object_schema, request_body
from app.http.endpoints.stores import StoreCalls
from app.http.schemas import ErrorResponse
from app.keys.limits import KeyLimiter, admit_key, key_owner
from app.terminology.glossaries import (
    MAX_NAME_CHARS,
    GlossaryError,
    GlossaryInfo,
    GlossaryStore,
    StoreFull,
    check_entries,
    parse_entries,
)
from app.terminology.tables import TableError

api = APIRouter(tags=["glossaries"], dependencies=STORES)

FORM_OVERHEAD_BYTES = 64 * 1024  # the other fields and part headers, beyond the table itself
# A JSON list of entries spends ~30 bytes of syntax on each pair, and escapes what a table holds
# as is: the body may be this many times the table's limit (the entries' own limits still apply).
JSON_GROWTH = 3
STORE_BUSY_RETRY_S = "1"
# The calls of /glossaries and /memories to their stores.
in_store = StoreCalls("the store", STORE_BUSY_RETRY_S)


class Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str
    target: str


class GlossaryRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(description="A name of your choice")
    source_lang: str = Field(description="Language of the entries' sources (de, en, pt-br)")
    target_lang: str = Field(description="Language of their targets")
    entries: list[Entry] | str = Field(
        description="The entries, or the text of a CSV or TSV table of them (see entries_format); "
        "in a form, the table may be the upload `file` instead"
    )
    entries_format: Literal["csv", "tsv"] = Field("tsv", description="The table's format")
    api_key: str | None = None


class GlossarySummary(BaseModel):
    id: str
    name: str
    source_lang: str
    target_lang: str
    entry_count: int
    creation_time: str = Field(description="ISO 8601, UTC")

    @classmethod
    def of(cls, info: GlossaryInfo) -> GlossarySummary:
        created = datetime.fromtimestamp(info.created, UTC).isoformat(timespec="seconds")
        return cls(
            id=info.id,
            name=info.name,
            source_lang=info.source_lang,
            target_lang=info.target_lang,
            entry_count=info.entry_count,
            creation_time=created.replace("+00:00", "Z"),
        )


class GlossaryList(BaseModel):
    glossaries: list[GlossarySummary]


class GlossaryWithEntries(GlossarySummary):
    entries: list[Entry]


# The body is read by hand (one endpoint, three content types, a size limit while it streams in:
# app/http/body.py), so FastAPI cannot describe it: this is what /openapi.json says of it.
_LANGUAGE_CODE = {"type": "string", "pattern": "^[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8})*$"}
_TERM = {"type": "string", "minLength": 1}
_FIELDS = {
    "name": {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS},
    "source_lang": _LANGUAGE_CODE,
    "target_lang": _LANGUAGE_CODE,
    "entries_format": {"type": "string", "enum": ["csv", "tsv"], "default": "tsv"},
    "api_key": {"type": "string"},
}
_ENTRY = {
    "type": "object",
    "properties": {"source": _TERM, "target": _TERM},
    "required": ["source", "target"],
    "additionalProperties": False,
}
_ENTRIES = {
    "description": "The entries, or the text of a CSV or TSV table of them",
    "oneOf": [{"type": "array", "items": _ENTRY, "minItems": 1}, _TERM],
}
_TABLE = {"type": "string", "format": "binary", "description": "A CSV or TSV table"}
_OPENAPI_BODY = request_body(
    {
        "application/json": object_schema(
            {**_FIELDS, "entries": _ENTRIES}, ["name", "source_lang", "target_lang", "entries"]
        ),
        MULTIPART: object_schema({**_FIELDS, "file": _TABLE}, ["name", "source_lang", "target_lang", "file"]),
    }
)

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        400: "Not JSON or a form, or a field missing; a key in the body other than the header's",
        403: "Missing or invalid api_key; no keys and NMT_SHARED_STORES off; a cross-site write",
        404: "No glossary of this id for this api_key",
        409: "The api_key has NMT_MAX_GLOSSARIES glossaries already",
        413: "Over a limit: the body, the table's bytes, entries or a term's length",
        422: "A malformed table or entry (the message names its line), a bad language code or name",
        429: "Over a limit of the api_key (see Retry-After)",
        503: "The store cannot be read or written now (see Retry-After)",
    }.items()
}
# 422 is either a field of the wrong type (FastAPI's ``detail`` list beside ``error``) or a table
# or entry that is malformed (``error`` alone, naming its line): documented as ``error`` alone.


async def owner_of(request: Request, keys: KeyLimiter, api_key: str | None) -> str:
    """Admit the request under its key (403, 429 as for /translate); the key's name ("" without
    keys: the stores are shared then, or ``stores_first`` answered 403)."""
    await admit_key(request, keys, api_key or None, requests=1, text_lengths=[])
    return key_owner(request)


def store_error(e: Exception) -> HTTPException:
    """The answer for what a store refused: 413 over a limit, 422 malformed, 409 full (one that
    cannot be used is ``in_store``'s 503)."""
    if isinstance(e, TableError):
        return HTTPException(413 if e.too_large else 422, str(e))
    if isinstance(e, StoreFull):
        return HTTPException(409, str(e))
    raise e


async def read_fields(request: Request, limit: int) -> tuple[dict[str, Any], UploadFile | None, bytes]:
    """A JSON object or a form's fields, and a form's upload ``file`` with its bytes."""
    body = await read_within(request, limit)
    kind = media_type(request)
    if kind == MULTIPART:
        parsed = replayed(request, body).form(max_files=1, max_fields=16, max_part_size=limit)
        async with parsed as form:
            fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
            upload = form.get("file")
            if isinstance(upload, UploadFile):
                return fields, upload, await upload.read()
            return fields, None, b""
    data = await parse_text_body(body, kind)  # (a large body on a thread: up to ~1 s of parsing)
    if not isinstance(data, dict):
        raise HTTPException(400, "the body must be a JSON object (or a form)")
    return data, None, b""


@api.post("/glossaries", status_code=201, responses=ERRORS, openapi_extra=_OPENAPI_BODY)
async def create_glossary(
    request: Request, settings: SettingsDep, keys: KeysDep, store: GlossariesDep
) -> GlossarySummary:
    """Store a glossary for your API key; its `id` names it to /translate (`glossary_id`)."""
    return GlossarySummary.of(await new_glossary(request, settings, keys, store))


async def new_glossary(
    request: Request, settings: Settings, keys: KeyLimiter, store: GlossaryStore
) -> GlossaryInfo:
    """The glossary of the request's body (JSON or a form, the entries a list or a table), stored
    for the request's key (4xx for what is refused: ``store_error``)."""
    limits = settings.glossary_limits()
    fields, upload, data = await read_fields(request, JSON_GROWTH * limits.max_bytes + FORM_OVERHEAD_BYTES)
    if upload is not None:
        fields["entries"] = ""  # the table is the file's
        if "entries_format" not in fields and (upload.filename or "").lower().endswith(".csv"):
            fields["entries_format"] = "csv"
    if fields.get("api_key") == "":
        del fields["api_key"]
    values = validate_request(fields, GlossaryRequest)
    owner = await owner_of(request, keys, values.api_key)
    try:
        if upload is not None or isinstance(values.entries, str):
            table = data if upload is not None else str(values.entries).encode()
            entries = await asyncio.to_thread(parse_entries, table, values.entries_format, limits)
        else:
            pairs = [(e.source, e.target) for e in values.entries]  # (10,000 checked: ~15 ms)
            entries = await asyncio.to_thread(check_entries, pairs, limits)
        glossary = await in_store(
            store.create, owner, values.name, values.source_lang, values.target_lang, entries
        )
    except (GlossaryError, TableError, StoreFull) as e:
        raise store_error(e) from None
    return glossary.info


@api.get("/glossaries", responses=ERRORS)
async def list_glossaries(
    request: Request, keys: KeysDep, store: GlossariesDep, api_key: ApiKeyQuery = None
) -> GlossaryList:
    """Your API key's glossaries, oldest first, without their entries."""
    found = await in_store(store.list, await owner_of(request, keys, api_key))
    return GlossaryList(glossaries=[GlossarySummary.of(info) for info in found])


@api.get("/glossaries/{glossary_id}", responses=ERRORS)
async def get_glossary(
    glossary_id: str, request: Request, keys: KeysDep, store: GlossariesDep, api_key: ApiKeyQuery = None
) -> GlossaryWithEntries:
    """One of your API key's glossaries, with its entries."""
    glossary = await in_store(store.get, await owner_of(request, keys, api_key), glossary_id)
    if glossary is None:
        raise HTTPException(404, f"no glossary {glossary_id!r}")
    summary = GlossarySummary.of(glossary.info)
    entries = [Entry(source=e.source, target=e.target) for e in glossary.entries]
    return GlossaryWithEntries(**summary.model_dump(), entries=entries)


@api.delete("/glossaries/{glossary_id}", status_code=204, response_class=Response, responses=ERRORS)
async def delete_glossary(
    glossary_id: str, request: Request, keys: KeysDep, store: GlossariesDep, api_key: ApiKeyQuery = None
) -> Response:
    """Delete one of your API key's glossaries."""
    deleted = await in_store(store.delete, await owner_of(request, keys, api_key), glossary_id)
    if not deleted:
        raise HTTPException(404, f"no glossary {glossary_id!r}")
    return Response(status_code=204)
