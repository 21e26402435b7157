"""POST /translate_file and GET /download_file/{filename}, LibreTranslate-compatible.

The upload (multipart: ``file``, ``source``, ``target``, ``api_key``; the key may be in a header
or the query instead, checked before the upload is read: ``app.keys.limits``) is translated while the
request waits, and the answer is ``{"translatedFileUrl": ...}``; a GET of that URL returns the
translated file once (``app.stores.downloads``). Formats: ``app.formats.documents``.

The route reads the form and calls the use case (``app.translation.documents``: read in a reader
process, translated a chunk at a time, written), so that a hostile file costs the front end no
more than its bytes. At most ``NMT_MAX_FILE_REQUESTS`` files are in progress at a time.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any, TypeVar
from urllib.parse import quote

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect

from app.config import Settings
from app.formats.documents import MEDIA_TYPES, download_name, extension
from app.formats.limits import DocumentError
from app.formats.sandbox import DocumentReaders
from app.http.body import MULTIPART, media_type, replayed, too_large, validate_request
from app.http.deps import (
    FileRequestsDep,
    FileStoreDep,
    GlossariesDep,
    KeysDep,
    ReadersDep,
    RouterDep,
    SchedulerDep,
    SettingsDep,
)
from app.http.endpoints.openapi import multipart_body
from app.http.endpoints.request_glossary import request_glossary
from app.http.endpoints.sentences import RecallDep, request_caller
from app.http.endpoints.translate import CLIENT_CLOSED_REQUEST
from app.http.errors import unavailable
from app.http.schemas import (
    BadRequestResponse,
    ErrorResponse,
    GlossaryEntryBody,
    TranslateFileResponse,
    ValidationErrorResponse,
    glossary_from_json_text,
)
from app.http.slow_clients import (
    CLIENT_GONE,
    FORM_PREFIX_BYTES,
    MIN_UPLOAD_RATE,
    UPLOAD_GRACE_S,
    BodyError,
    client_address,
    declared_length,
    form_key_first,
    receive_body,
    upload_seconds,
)
from app.keys.limits import (
    LEASE_KEY,
    GivenKey,
    KeyLimiter,
    admit_given_key,
    admit_key,
    charge_key,
    client_identity,
    key_owner,
    min_confidence,
)
from app.models.served import ServedModel
from app.serving.frontend.router import Router
from app.serving.frontend.scheduler import Scheduler
from app.stores.database import StoreUnavailable
from app.stores.database.postgres import Postgres
from app.stores.downloads import MIGRATIONS as DOWNLOAD_MIGRATIONS
from app.stores.downloads import FileStore, NoRoom, SharedDownload, SharedFileStore, StoredFile
from app.terminology.glossaries import GlossaryStore
from app.translation.documents import DocumentRequest, Documents, check_format
from app.translation.errors import missing_parameter
from app.translation.languages import check_languages
from app.translation.sentences import Recall, SearchPlan

api = APIRouter(tags=["files"])
Form = TypeVar("Form", bound=BaseModel)

FORM_OVERHEAD_BYTES = 64 * 1024  # the form's other fields and part headers, beyond the file itself
CHUNK_SENTENCES = 256  # sentences of one file in the queue at a time (at most half the queue)
STORE_FILES = 32  # the store holds this many maximal files' bytes
# A translated file may be this many times larger than NMT_MAX_FILE_BYTES (text grows in
# translation; a .docx is also written with python-docx's compression): more is refused (413).
OUTPUT_GROWTH = 8


class TranslateFileForm(BaseModel):
    model_config = ConfigDict(extra="ignore")

    source: str = Field("auto", description='Source language code, or "auto"')
    target: str = Field(description="Target language code")  # "": missing (check_languages)
    api_key: str | None = None
    # Terminology, as /translate takes it (the glossary as JSON text).
    glossary: list[GlossaryEntryBody] | None = None
    glossary_id: str | None = None
    protect_placeholders: bool = True
    # Extension: sentences below this confidence are flagged for review in the translated file
    # (XLIFF, .docx, .xlsx: ``app.formats.documents.Review``); default NMT_MIN_CONFIDENCE.
    min_confidence: float | None = Field(default=None, ge=0, le=1)

    _glossary = field_validator("glossary", mode="before")(glossary_from_json_text)


_FORM = TranslateFileForm.model_json_schema()
FILE_FORM_BODY = multipart_body(
    {
        "file": {"type": "string", "format": "binary", "description": "The file"},
        "source": {"type": "string", "default": "auto"},
        "target": {"type": "string"},
        "api_key": {"type": "string"},
        "glossary_id": {"type": "string"},
        "protect_placeholders": {"type": "boolean", "default": True},
        "min_confidence": {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "description": "Extension: sentences below this confidence are flagged for review in the file "
            "(an XLIFF note and state, a .docx comment, an .xlsx sheet named Review); default "
            "NMT_MIN_CONFIDENCE",
        },
    },
    ["file", *_FORM["required"]],
)
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        400: (
            'file or target missing or empty ("Invalid request: missing file parameter"), an '
            'unsupported language ("zz is not supported", with supportedPairs) or pair, as '
            "LibreTranslate words them; an unsupported file format, a file that cannot be read as its "
            "format, not a form"
        ),
        403: "Missing or invalid api_key (when the server requires keys)",
        408: "The upload did not arrive within its time",
        413: "A file over NMT_MAX_FILE_BYTES, or over another of the file limits (text, sentences, "
        "a .docx's files, inflated size or XML elements, HTML depth, time or memory to read it), "
        "or a sentence with more glossary terms than NMT_MAX_TERMS_PER_SENTENCE",
        404: "glossary_id names no glossary of this API key",
        422: "A field of the wrong type; a file with a DTD or XML entities, or NUL characters",
        429: "Over a limit of the api_key (see Retry-After)",
        503: "Queue full, too many files in progress or waiting for download (see Retry-After), not ready",
        504: "A part of the file did not finish within the request timeout",
    }.items()
}
_ERRORS[400]["model"] = BadRequestResponse
_ERRORS[422] = {"model": ValidationErrorResponse, "description": _ERRORS[422]["description"]}


def new_file_store(settings: Settings, database: Postgres | None = None) -> FileStore | SharedFileStore:
    """In this process, or with ``database`` in the PostgreSQL every replica shares."""
    if database is not None:
        db = database.database("downloads", DOWNLOAD_MIGRATIONS)
        return SharedFileStore(db, settings.file_ttl_s, STORE_FILES * settings.max_file_bytes)
    return FileStore(settings.file_ttl_s, STORE_FILES * settings.max_file_bytes)


def new_readers(settings: Settings) -> DocumentReaders:
    """The document readers. Their fork server starts with the first document (~1 s, off the
    event loop), not with the service: it holds the format libraries (~70 MiB resident on the
    AMD EPYC of BENCHMARKS.md), which a service that never sees a document need not hold."""
    return DocumentReaders(
        settings.document_limits(), settings.file_readers, OUTPUT_GROWTH * settings.max_file_bytes
    )


def new_job_readers(settings: Settings) -> DocumentReaders:
    """The readers of document jobs: one per running job, with the job limits (the fork server is
    the one of ``new_readers``: the process's one, started by whichever reads first)."""
    return DocumentReaders(
        settings.job_limits(), settings.max_running_jobs, OUTPUT_GROWTH * settings.job_max_bytes
    )


async def admit_form_key(request: Request, keys: KeyLimiter) -> None:
    """A key in the form's ``api_key`` field, sent before the file part: admitted before the upload
    takes a place, as one in a header is (403 or 429 at once); the bytes read looking for it are
    read again by the form's parser. Nothing without keys, or once admitted."""
    if not keys.keys or LEASE_KEY in request.scope or media_type(request) != MULTIPART:
        return
    deadline = time.monotonic() + upload_seconds(FORM_PREFIX_BYTES)
    try:
        key, receive = await form_key_first(request.scope, request.receive, deadline)
    except BodyError as e:
        raise upload_error(e) from None
    request._receive = receive  # (Starlette's Request reads its body through it)
    if key:
        await admit_given_key(request, keys, GivenKey(key, "the form's api_key field"))


async def read_upload(request: Request, limit: int) -> bytes:
    """An upload's whole body (at most ``limit`` bytes: 413), arriving at ``MIN_UPLOAD_RATE`` past
    its first ``UPLOAD_GRACE_S`` and within ``upload_seconds`` of its declared size (408)."""
    declared = declared_length(request.scope)
    if declared is not None and declared > limit:
        raise too_large(limit)
    deadline = time.monotonic() + upload_seconds(declared if declared is not None else limit)
    try:
        return await receive_body(request.receive, limit, deadline, MIN_UPLOAD_RATE, UPLOAD_GRACE_S)
    except BodyError as e:
        raise upload_error(e) from None


def upload_error(e: BodyError) -> Exception:
    """What an upload whose body failed raises: its client gone, or a 408/413 that closes the
    connection (the rest of the body may still come, and would be read as the next request)."""
    if e.status == CLIENT_GONE:
        return ClientDisconnect()
    return HTTPException(e.status, str(e), {"Connection": "close"})


async def read_form(
    request: Request,
    max_bytes: int,
    schema: type[Form],
    fields_named: str = "file, source, target",
    max_fields: int = 16,
) -> tuple[Form, str, bytes]:
    """The form's fields as ``schema``, and the file's name and bytes, at most ``max_bytes`` (4xx
    for anything else). ``fields_named``: the fields a refusal names."""
    if media_type(request) != MULTIPART:
        raise HTTPException(400, f"send the file as multipart/form-data (fields {fields_named})")
    limit = max_bytes + FORM_OVERHEAD_BYTES
    body = await read_upload(request, limit)
    parsed = replayed(request, body).form(
        max_files=1, max_fields=max_fields, max_part_size=FORM_OVERHEAD_BYTES
    )
    async with parsed as form:
        fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise missing_parameter("file")
        data = await upload.read()
        name = upload.filename or ""
    if fields.get("api_key") == "":
        del fields["api_key"]
    values = validate_request(fields, schema)
    if len(data) > max_bytes:
        raise HTTPException(413, f"the file is larger than {max_bytes} bytes")
    return values, name, data


@api.post(
    "/translate_file",
    response_model=TranslateFileResponse,
    responses=_ERRORS,
    openapi_extra=FILE_FORM_BODY,
    summary="Translate a .txt, .html or .docx file (LibreTranslate-compatible)",
)
async def translate_file(
    request: Request,
    settings: SettingsDep,
    router: RouterDep,
    scheduler: SchedulerDep,
    keys: KeysDep,
    glossaries: GlossariesDep,
    recall: RecallDep,
    places: FileRequestsDep,
    store: FileStoreDep,
    readers: ReadersDep,
) -> Response:
    await admit_given_key(request, keys)  # a key in a header or the query: refused before the upload is read
    await admit_form_key(request, keys)  # or in the form, before its file: refused before it takes a place
    async with places.place(client_address(request.scope)):
        return await translate_upload(
            request, settings, router, scheduler, keys, glossaries, recall, store, readers
        )


def document_error(e: DocumentError) -> HTTPException:
    return HTTPException(e.status, str(e))


async def translate_upload(
    request: Request,
    settings: Settings,
    router: Router[ServedModel],
    scheduler: Scheduler,
    keys: KeyLimiter,
    glossaries: GlossaryStore,
    recall: Recall,
    store: FileStore | SharedFileStore,
    readers: DocumentReaders,
) -> Response:
    form, name, data = await read_form(request, settings.max_file_bytes, TranslateFileForm)
    await admit_key(
        request, keys, form.api_key, requests=1, text_lengths=[]
    )  # its characters once it is read
    check_format(name)
    check_languages(form.source, form.target, router)  # before the glossary is looked up
    glossary = await request_glossary(request, form, settings, glossaries)
    caller = request_caller(request, key_owner(request), client_identity(request), settings.request_timeout_s)
    asked = DocumentRequest(
        name,
        data,
        form.source,
        form.target,
        glossary,
        form.protect_placeholders,
        SearchPlan(beam_size=settings.default_beam_size, n_best=1),
        caller,
        chunk_sentences=max(1, min(CHUNK_SENTENCES, settings.max_queue // 2)),
        min_confidence=min_confidence(request, settings, form.min_confidence),
    )
    documents = Documents(settings, router, scheduler, recall, readers)
    try:
        translated = await documents.translate(asked, partial(charge_key, request))
    except DocumentError as e:
        raise document_error(e) from e
    if translated is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    output = translated.data
    saved = download_name(name, form.target)
    try:
        media, owner = MEDIA_TYPES[extension(name)], client_identity(request)
        if isinstance(store, SharedFileStore):
            token = await asyncio.to_thread(store.put, output, saved, media, owner)
        else:
            token = store.put(output, saved, media, owner)
    except NoRoom as e:
        raise HTTPException(503, str(e), {"Retry-After": "10"}) from e
    except StoreUnavailable as e:
        raise unavailable(e, "the download store", "10") from e
    url = str(request.url_for("download_file", filename=f"{token}.{saved}"))
    flagged = translated.flagged if asked.min_confidence is not None else None
    response = TranslateFileResponse(translatedFileUrl=url, lowConfidence=flagged)
    body = response.model_dump_json(exclude_none=True)
    return Response(body, media_type="application/json")


@api.get(
    "/download_file/{filename}",
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The translated file"},
        404: {"model": ErrorResponse, "description": "Downloaded already, expired, or never made"},
    },
    summary="Download a translated file (once)",
)
async def download_file(filename: str, store: FileStoreDep) -> Response:
    token, _, name = filename.partition(".")
    stored: StoredFile | SharedDownload | None
    if isinstance(store, SharedFileStore):
        try:
            stored = await asyncio.to_thread(store.take, token, name)
        except StoreUnavailable as e:
            raise unavailable(e, "the download store", "10") from e
    else:
        stored = store.take(token, name)
    if stored is None:
        raise HTTPException(
            404, "no such file: it was downloaded already, expired, or never existed; translate it again"
        )
    disposition = f"attachment; filename=\"{stored.name}\"; filename*=UTF-8''{quote(stored.name)}"
    headers = {"Content-Disposition": disposition}
    if isinstance(stored, SharedDownload):
        return StreamingResponse(stored.chunks, media_type=stored.media_type, headers=headers)
    return Response(stored.data, media_type=stored.media_type, headers=headers)
