"""Document jobs: POST /jobs, GET /jobs, GET /jobs/{id}, GET /jobs/{id}/result,
POST /jobs/{id}/cancel, DELETE /jobs/{id}.

For documents too long to translate while a request waits (DeepL's document API; LibreTranslate
clients raising their time-outs): the upload is stored and answered at once (202, the job), and
translated in the background (``app.jobs.runner``); the client polls the job for its state and
progress, and downloads the result until it expires. The form is /translate_file's (``file``,
``source``, ``target``, ``api_key``, terminology); the file may be larger (``NMT_JOB_MAX_BYTES``).

Each API key sees its own jobs only (a job of another key is a 404, as one that does not exist).
The key is in a header (``Authorization: Bearer KEY``, ``X-API-Key``) or the ``api_key`` query
parameter, checked before the upload is read or takes a place (``app.http.endpoints.access``), or else the
upload's ``api_key`` field. Making a job counts as one request under the key's limits, and its
characters are charged once it is read; looking at jobs (GET /jobs, a job, its result) counts as
one request each too, so that polling is bounded by the key's limits as any other request.

Without keys, a job is reachable by its id alone (unguessable: 128 random bits), and the list of
jobs, which would show every client's documents, is 403 unless the operator shares the stores
(``NMT_SHARED_STORES``). A POST or DELETE a page of another site sent is refused.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel, Field

from app.config import Settings
from app.formats.documents import MEDIA_TYPES, extension
from app.http.deps import (
    FileRequestsDep,
    GlossariesDep,
    JobRunnerDep,
    JobStoreDep,
    KeysDep,
    RouterDep,
    SettingsDep,
)
from app.http.endpoints.access import JOBS, ApiKeyQuery
from app.http.endpoints.files import FILE_FORM_BODY, TranslateFileForm, admit_form_key, read_form
from app.http.endpoints.request_glossary import request_glossary
from app.http.endpoints.stores import StoreCalls
from app.http.schemas import ErrorResponse
from app.http.slow_clients import client_address
from app.jobs.store import RESULT, Job, JobOptions, JobsFull, JobStore, StorageFull
from app.keys.limits import KeyLimiter, admit_key, key_owner, min_confidence, store_owner
from app.models.served import ServedModel
from app.serving.frontend.router import Router
from app.terminology.glossaries import GlossaryStore
from app.translation.documents import check_format
from app.translation.languages import check_languages

api = APIRouter(tags=["jobs"], dependencies=JOBS)

STORE_RETRY_AFTER_S = "2"
STORAGE_RETRY_AFTER_S = "60"  # room is made as jobs expire or are deleted
stored = StoreCalls("the job store", STORE_RETRY_AFTER_S)


class Progress(BaseModel):
    done: int = Field(description="Sentences translated")
    total: int | None = Field(description="Sentences in the document (null until it is read)")


class JobError(BaseModel):
    status: int = Field(description="The HTTP status the same refusal has elsewhere (400, 413, 429, ...)")
    message: str


class JobInfo(BaseModel):
    id: str
    name: str = Field(description="The upload's file name")
    state: Literal["queued", "reading", "translating", "writing", "done", "failed", "cancelled"]
    source: str
    target: str
    detectedLanguage: str | None = Field(description="The language it is translated from, once read")
    progress: Progress
    error: JobError | None
    notes: list[str] = Field(description="What was left untranslated and why (a scanned PDF page)")
    created: str = Field(description="ISO 8601, UTC")
    finished: str | None
    expires: str | None = Field(description="When the job and its result are deleted")
    resultUrl: str | None = Field(description="GET it for the translated file (until it expires)")

    @classmethod
    def of(cls, job: Job, request: Request) -> JobInfo:
        url = str(request.url_for("job_result", job_id=job.id)) if job.state == "done" else None
        return cls(
            id=job.id,
            name=job.name,
            state=job.state,
            source=job.source,
            target=job.target,
            detectedLanguage=job.language,
            progress=Progress(done=job.done, total=job.total),
            error=None if job.error is None else JobError(status=job.error_status or 500, message=job.error),
            notes=list(job.notes),
            created=iso(job.created),
            finished=None if job.finished is None else iso(job.finished),
            expires=None if job.expires is None else iso(job.expires),
            resultUrl=url,
        )


class JobList(BaseModel):
    jobs: list[JobInfo]


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def errors(**codes: str) -> dict[int | str, dict[str, Any]]:
    return {int(code[1:]): {"model": ErrorResponse, "description": text} for code, text in codes.items()}


async def owned_job(
    request: Request, keys: KeyLimiter, store: JobStore, job_id: str, api_key: str | None
) -> Job:
    """The job ``job_id`` of the request's key (404 if it has none of that id); one request under
    the key's limits."""
    await admit_key(request, keys, api_key, requests=1, text_lengths=[])
    job: Job | None = await stored(store.get, key_owner(request), job_id)
    if job is None:
        raise HTTPException(404, "no such job: it expired, was deleted, or is another key's")
    return job


@api.post(
    "/jobs",
    status_code=202,
    response_model=JobInfo,
    openapi_extra=FILE_FORM_BODY,
    summary="Translate a document in the background: the job is answered at once",
    responses=errors(
        _400="file or target missing, an unsupported format, language or pair; an api_key field other "
        "than the key of the header or query",
        _403="Missing or invalid api_key; a glossary_id without keys and NMT_SHARED_STORES; a cross-site "
        "request",
        _404="glossary_id names no glossary of this API key",
        _413="A file over NMT_JOB_MAX_BYTES",
        _422="A field of the wrong type",
        _429="The key holds NMT_MAX_JOBS_PER_KEY jobs, or is over one of its limits",
        _507="The jobs' files would pass NMT_DATA_QUOTA_MB, or leave less than NMT_DATA_RESERVE_MB free "
        "on the disk (see Retry-After)",
        _503="The service holds NMT_MAX_JOBS jobs, NMT_MAX_FILE_REQUESTS uploads are being received, "
        "or a job cannot be stored now (see Retry-After)",
    ),
)
async def create_job(
    request: Request,
    settings: SettingsDep,
    router: RouterDep,
    keys: KeysDep,
    glossaries: GlossariesDep,
    places: FileRequestsDep,
    store: JobStoreDep,
    runner: JobRunnerDep,
) -> Response:
    await admit_form_key(request, keys)  # a key in the form, before its file: refused before a place
    # Uploads in the front end's memory at once: these and /translate_file's.
    async with places.place(client_address(request.scope)):
        job = await store_upload(request, settings, router, keys, glossaries, store)
    runner.notify()
    location = str(request.url_for("get_job", job_id=job.id))
    body = JobInfo.of(job, request).model_dump_json()
    return Response(body, status_code=202, media_type="application/json", headers={"Location": location})


async def store_upload(
    request: Request,
    settings: Settings,
    router: Router[ServedModel],
    keys: KeyLimiter,
    glossaries: GlossaryStore,
    store: JobStore,
) -> Job:
    """The uploaded file as a new queued job (4xx for a form, file or pair refused now)."""
    form, name, data = await read_form(request, settings.job_max_bytes, TranslateFileForm)
    return await store_job(request, form, name, data, settings, router, keys, glossaries, store)


async def store_job(
    request: Request,
    form: TranslateFileForm,
    name: str,
    data: bytes,
    settings: Settings,
    router: Router[ServedModel],
    keys: KeyLimiter,
    glossaries: GlossaryStore,
    store: JobStore,
    secret: str = "",
) -> Job:
    """The file ``name`` (its bytes ``data``, the form's fields read) as a new queued job of the
    request's key (4xx for a file or pair refused now); ``secret``: ``JobStore.create``'s, for an
    API whose jobs are seen with a secret (DeepL's document key)."""
    await admit_key(
        request, keys, form.api_key, requests=1, text_lengths=[]
    )  # its characters once it is read
    check_format(name)
    check_languages(form.source, form.target, router)
    glossary = await request_glossary(request, form, settings, glossaries)
    options = JobOptions(
        [(e.source, e.target) for e in glossary.entries] if glossary is not None else [],
        form.protect_placeholders,
        settings.default_beam_size,
        min_confidence(request, settings, form.min_confidence),
    )
    try:
        owner, client = key_owner(request), client_address(request.scope)
        job: Job = await stored(
            store.create, owner, name, form.source, form.target, options, data, client, secret
        )
    except JobsFull as e:
        raise HTTPException(429 if e.per_key else 503, str(e), {"Retry-After": "60"}) from e
    except StorageFull as e:  # past NMT_DATA_QUOTA_MB, or the disk's reserve: until jobs expire
        raise HTTPException(507, str(e), {"Retry-After": STORAGE_RETRY_AFTER_S}) from e
    return job


@api.get(
    "/jobs",
    response_model=JobList,
    summary="Your jobs, newest first",
    responses=errors(_403="Missing or invalid api_key; without keys, unless NMT_SHARED_STORES is on"),
)
async def list_jobs(
    request: Request, settings: SettingsDep, keys: KeysDep, store: JobStoreDep, api_key: ApiKeyQuery = None
) -> JobList:
    await admit_key(request, keys, api_key, requests=1, text_lengths=[])
    jobs: list[Job] = await stored(store.jobs_of, store_owner(request, settings))
    return JobList(jobs=[JobInfo.of(job, request) for job in jobs])


@api.get(
    "/jobs/{job_id}",
    response_model=JobInfo,
    summary="A job's state and progress",
    responses=errors(_404="No such job of this key"),
)
async def get_job(
    request: Request, keys: KeysDep, store: JobStoreDep, job_id: str, api_key: ApiKeyQuery = None
) -> JobInfo:
    return JobInfo.of(await owned_job(request, keys, store, job_id, api_key), request)


@api.get(
    "/jobs/{job_id}/result",
    summary="The translated file (until the job expires)",
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The translated file"},
        **errors(_404="No such job of this key", _409="The job is not done (its state says why)"),
    },
)
async def job_result(
    request: Request, keys: KeysDep, store: JobStoreDep, job_id: str, api_key: ApiKeyQuery = None
) -> Response:
    job = await owned_job(request, keys, store, job_id, api_key)
    if job.state != "done" or job.result_name is None:
        raise HTTPException(409, f"the job is {job.state}, not done")
    return result_response(job, store)


def result_response(job: Job, store: JobStore) -> Response:
    """The translated file of a done job (``result_name`` set), streamed from where it is kept."""
    assert job.result_name is not None
    media = MEDIA_TYPES.get(extension(job.name), "application/octet-stream")
    path = store.files.path(job.id, RESULT)
    if path is not None:
        return FileResponse(path, media_type=media, filename=job.result_name)
    # In the shared database: streamed a part at a time, named as FileResponse names a file.
    headers = {"Content-Disposition": attachment(job.result_name)}
    return StreamingResponse(store.files.chunks(job.id, RESULT), media_type=media, headers=headers)


def attachment(filename: str) -> str:
    """The Content-Disposition of a download named ``filename`` (RFC 6266; Starlette's form)."""
    quoted = quote(filename)
    if quoted != filename:
        return f"attachment; filename*=utf-8''{quoted}"
    return f'attachment; filename="{filename}"'


@api.post(
    "/jobs/{job_id}/cancel",
    response_model=JobInfo,
    summary="Stop a job (it is kept, cancelled, until it expires)",
    responses=errors(
        _403="A cross-site request", _404="No such job of this key", _409="The job had finished already"
    ),
)
async def cancel_job(
    request: Request,
    keys: KeysDep,
    store: JobStoreDep,
    runner: JobRunnerDep,
    job_id: str,
    api_key: ApiKeyQuery = None,
) -> JobInfo:
    job = await owned_job(request, keys, store, job_id, api_key)
    if job.state in ("done", "failed"):
        raise HTTPException(409, f"the job is {job.state} already")
    cancelled: Job | None = await stored(store.cancel, key_owner(request), job_id)
    if cancelled is None:
        raise HTTPException(404, "no such job: it was deleted meanwhile")
    runner.notify()
    return JobInfo.of(cancelled, request)


@api.delete(
    "/jobs/{job_id}",
    status_code=204,
    summary="Delete a job and its files (stopping it if it runs)",
    responses=errors(_403="A cross-site request", _404="No such job of this key"),
)
async def delete_job(
    request: Request, keys: KeysDep, store: JobStoreDep, job_id: str, api_key: ApiKeyQuery = None
) -> Response:
    await owned_job(request, keys, store, job_id, api_key)
    if not await stored(store.delete, key_owner(request), job_id):
        raise HTTPException(404, "no such job: it was deleted meanwhile")
    return Response(status_code=204)
