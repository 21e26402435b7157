"""FastAPI dependencies: each part of the running service, for a route to declare as a parameter.

The parts live in one ``app.services.AppServices``, stored on ``app.state.services`` by
``create_app`` and filled in by the lifespan (app.main); ``services_of`` is the one place that reads
it. Each ``...Dep`` here is one part, made by ``needs``: 503 (``NOT_READY``) while that part is
None, before the lifespan has made it. ``SchedulerDep`` is also 503 while the service is not ready
(loading, or shutting down), so a route that translates depends on it. ``ServicesDep`` is the
whole object, for /health, which says itself what is missing.

They are ``async def`` although they never await: FastAPI runs a plain ``def`` dependency in its
thread pool, a thread hop per request that the event loop pays for in CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Annotated, Any, TypeVar

from fastapi import Depends, HTTPException, Request
from starlette.applications import Starlette

from app.config import Settings
from app.formats.sandbox import DocumentReaders
from app.http.uploads import FileRequests
from app.jobs.store import JobStore
from app.keys.limits import KeyLimiter
from app.models.served import ServedModel
from app.monitoring.metrics import Metrics
from app.services import AppServices, JobQueue
from app.serving.frontend.router import Router
from app.serving.frontend.scheduler import Scheduler
from app.stores.downloads import FileStore, SharedFileStore
from app.terminology.cache import SegmentCache
from app.terminology.glossaries import GlossaryStore
from app.terminology.memory import TranslationMemory

NOT_READY = "the models are not loaded yet (or the service is shutting down)"
T = TypeVar("T")


def services_of(app: Starlette) -> AppServices:
    services: AppServices = app.state.services
    return services


async def get_services(request: Request) -> AppServices:
    return services_of(request.app)


def needs(part: Callable[[AppServices], T | None]) -> Callable[[Request], Coroutine[Any, Any, T]]:
    """The dependency on one part of the service (``part`` picks it): 503 while it is None."""

    async def dependency(request: Request) -> T:
        found = part(services_of(request.app))
        if found is None:
            raise HTTPException(503, NOT_READY)
        return found

    return dependency


get_settings = needs(lambda s: s.settings)
get_metrics = needs(lambda s: s.metrics)
get_keys = needs(lambda s: s.keys)
get_glossaries = needs(lambda s: s.glossaries)
get_memory = needs(lambda s: s.memory)
get_segment_cache = needs(lambda s: s.segment_cache)
get_router = needs(lambda s: s.router)
get_file_store = needs(lambda s: s.files)
get_file_requests = needs(lambda s: s.file_requests)
get_readers = needs(lambda s: s.readers)
get_job_store = needs(lambda s: s.jobs)
get_job_runner = needs(lambda s: s.job_runner)
get_scheduler = needs(lambda s: s.scheduler if s.ready else None)

ServicesDep = Annotated[AppServices, Depends(get_services)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
KeysDep = Annotated[KeyLimiter, Depends(get_keys)]
GlossariesDep = Annotated[GlossaryStore, Depends(get_glossaries)]
MemoryDep = Annotated[TranslationMemory, Depends(get_memory)]
SegmentCacheDep = Annotated[SegmentCache[Any], Depends(get_segment_cache)]
RouterDep = Annotated[Router[ServedModel], Depends(get_router)]
FileStoreDep = Annotated[FileStore | SharedFileStore, Depends(get_file_store)]
FileRequestsDep = Annotated[FileRequests, Depends(get_file_requests)]
ReadersDep = Annotated[DocumentReaders, Depends(get_readers)]
JobStoreDep = Annotated[JobStore, Depends(get_job_store)]
JobRunnerDep = Annotated[JobQueue, Depends(get_job_runner)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
