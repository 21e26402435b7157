"""DeepL's document API on the service's document jobs (``app.http.endpoints.jobs``, ``app.jobs``):
POST /v2/document (the upload: a new job), POST /v2/document/{document_id} (its status),
POST /v2/document/{document_id}/result (the translated file).

A document is a job: the same store, runner, formats, limits and key; ``document_id`` is the job's
id. DeepL also gives a ``document_key``, without which the document cannot be seen: here a random
secret made at the upload, of which the job keeps only the SHA-256 (``app.jobs.store.SECRET``).
Stored rather than derived (an HMAC of the id under a service secret) because a stored digest needs
no secret to configure, share among the replicas and rotate, works the same with SQLite and with
PostgreSQL, and tells nothing to whoever reads the table. The id travels in URLs (and their logs),
the key only in bodies. A wrong key is the 404 of a job that does not exist, as is another key's.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from app.formats.documents import extension
from app.http.body import parse_request
from app.http.deps import (
    FileRequestsDep,
    GlossariesDep,
    JobRunnerDep,
    JobStoreDep,
    KeysDep,
    RouterDep,
    SettingsDep,
)
from app.http.endpoints.access import JOBS
from app.http.endpoints.deepl.codes import served_code
from app.http.endpoints.deepl.errors import COMMON, DeepLRoute, errors
from app.http.endpoints.files import TranslateFileForm, read_form
from app.http.endpoints.jobs import result_response, store_job, stored
from app.http.endpoints.openapi import multipart_body
from app.http.slow_clients import client_address
from app.jobs.job import Job, State
from app.jobs.store import JobStore
from app.keys.limits import KeyLimiter, admit_key, key_owner
from app.translation.codes import source_languages, target_languages
from app.translation.errors import Invalid
from app.translation.languages import AUTO

api = APIRouter(tags=["deepl"], route_class=DeepLRoute, dependencies=JOBS)

Status = Literal["queued", "translating", "done", "error"]
# A job's states as DeepL's four (its clients know no others).
STATUS: dict[State, Status] = {
    "queued": "queued",
    "reading": "queued",
    "translating": "translating",
    "writing": "translating",
    "done": "done",
    "failed": "error",
    "cancelled": "error",
}
NOT_READY_RETRY_S = "5"  # DeepL's clients poll every 5 s
KEY_BODY_BYTES = 4096


class DocumentForm(BaseModel):
    """The upload's fields beside its ``file``."""

    model_config = ConfigDict(extra="ignore")  # formality, DeepL's newer fields: accepted, unused

    target_lang: str
    source_lang: str | None = None
    glossary_id: str | None = None
    glossary_ids: str | None = None  # comma-separated, as DeepL's clients send it in a form
    output_format: str | None = None
    filename: str | None = None


class DocumentHandle(BaseModel):
    document_id: str
    document_key: str


class DocumentKey(BaseModel):
    model_config = ConfigDict(extra="ignore")

    document_key: str = Field(min_length=1)


class DocumentStatus(BaseModel):
    document_id: str
    status: Status
    seconds_remaining: int | None = Field(None, description="An estimate, while it is translated")
    billed_characters: int | None = None
    error_message: str | None = None


def digest(document_key: str) -> str:
    return hashlib.sha256(document_key.encode("utf-8", "surrogatepass")).hexdigest()


async def read_document(request: Request, max_bytes: int) -> tuple[DocumentForm, str, bytes]:
    """The upload's fields, file name (the ``filename`` field's where the part has none) and bytes
    (at most ``max_bytes``: 413)."""
    form, name, data = await read_form(request, max_bytes, DocumentForm, "file, target_lang", max_fields=32)
    return form, name or form.filename or "", data


def job_form(form: DocumentForm, name: str, sources: list[str], targets: list[str]) -> TranslateFileForm:
    """The upload as /jobs' form: served codes, one stored glossary; an ``output_format`` other than
    the file's own is refused (documents are written in their own format)."""
    wanted = (form.output_format or "").strip().lower().lstrip(".")
    own = extension(name).lstrip(".")
    if wanted and wanted != own and {wanted, own} != {"htm", "html"}:
        raise Invalid(f"output_format {wanted[:16]!r}: a document is written in its own format ({own})")
    ids = [i.strip() for i in (form.glossary_ids or "").split(",") if i.strip()]
    ids = list(dict.fromkeys(([form.glossary_id] if form.glossary_id else []) + ids))
    if len(ids) > 1:
        raise Invalid("this service applies one glossary per document: give one glossary_id")
    source = served_code(form.source_lang, sources) if form.source_lang else AUTO
    target = served_code(form.target_lang, targets)
    return TranslateFileForm(source=source, target=target, glossary_id=ids[0] if ids else None)


@api.post(
    "/v2/document",
    response_model=DocumentHandle,
    openapi_extra=multipart_body(
        {
            "file": {"type": "string", "format": "binary"},
            "target_lang": {"type": "string"},
            "source_lang": {"type": "string"},
            "glossary_id": {"type": "string"},
            "output_format": {"type": "string"},
            "formality": {"type": "string"},
        },
        ["file", "target_lang"],
    ),
    summary="Upload a document to translate (DeepL API v2): translated in the background",
    responses=errors(
        **COMMON,
        _404="glossary_id names no glossary of this key",
        _408="The upload did not arrive within its time",
        _413="A file over NMT_JOB_MAX_BYTES",
        _507="The jobs' files would pass their quota (see Retry-After)",
    ),
)
async def upload_document(
    request: Request,
    settings: SettingsDep,
    router: RouterDep,
    keys: KeysDep,
    glossaries: GlossariesDep,
    places: FileRequestsDep,
    store: JobStoreDep,
    runner: JobRunnerDep,
) -> DocumentHandle:
    async with places.place(client_address(request.scope)):
        form, name, data = await read_document(request, settings.job_max_bytes)
        fields = job_form(form, name, source_languages(router), target_languages(router))
        document_key = secrets.token_hex(32)
        job = await store_job(
            request, fields, name, data, settings, router, keys, glossaries, store, digest(document_key)
        )
    runner.notify()
    return DocumentHandle(document_id=job.id, document_key=document_key)


async def keyed_job(request: Request, keys: KeyLimiter, store: JobStore, document_id: str) -> Job:
    """The job of ``document_id`` whose key the body gives (JSON or a form), of the request's API
    key: 404 for a wrong key as for no such job. One request under the key's limits."""
    document_key = (await parse_request(request, KEY_BODY_BYTES, DocumentKey)).document_key
    await admit_key(request, keys, None, requests=1, text_lengths=[])
    job: Job | None = await stored(store.get, key_owner(request), document_id, digest(document_key))
    if job is None:
        raise HTTPException(404, "no such document: it expired, or the id or its document_key is wrong")
    return job


def seconds_remaining(job: Job, now: float) -> int | None:
    """At the pace so far; None until a sentence is done."""
    if STATUS[job.state] != "translating" or not job.total or not job.done:
        return None
    return max(1, math.ceil((now - job.created) * (job.total - job.done) / job.done))


def failure(job: Job) -> str | None:
    if job.state == "cancelled":
        return "cancelled"
    return job.error if job.state == "failed" else None


_KEY_BODY = {"application/json": {"schema": DocumentKey.model_json_schema()}}


@api.post(
    "/v2/document/{document_id}",
    response_model=DocumentStatus,
    response_model_exclude_none=True,
    openapi_extra={"requestBody": {"required": True, "content": _KEY_BODY}},
    summary="A document's status",
    responses=errors(**COMMON, _404="No such document of this key, or a wrong document_key"),
)
async def document_status(
    document_id: str, request: Request, keys: KeysDep, store: JobStoreDep
) -> DocumentStatus:
    job = await keyed_job(request, keys, store, document_id)
    return DocumentStatus(
        document_id=job.id,
        status=STATUS[job.state],
        seconds_remaining=seconds_remaining(job, time.time()),
        billed_characters=job.chars,
        error_message=failure(job),
    )


_RESULT: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "The translated document"},
    **errors(
        **{**COMMON, "_503": "Not translated yet (see Retry-After), or not ready"},
        _404="No such document of this key, or a wrong document_key",
    ),
}


@api.post(
    "/v2/document/{document_id}/result",
    openapi_extra={"requestBody": {"required": True, "content": _KEY_BODY}},
    summary="The translated document (until it expires)",
    responses=_RESULT,
)
async def document_result(document_id: str, request: Request, keys: KeysDep, store: JobStoreDep) -> Response:
    job = await keyed_job(request, keys, store, document_id)
    if job.state == "done" and job.result_name is not None:
        return result_response(job, store)
    if STATUS[job.state] == "error":
        raise HTTPException(400, f"the document was not translated: {failure(job)}")
    raise HTTPException(503, f"the document is {STATUS[job.state]}", {"Retry-After": NOT_READY_RETRY_S})
