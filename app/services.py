"""The running service's parts, in one typed object: ``AppServices``.

``create_app`` (app.main) stores one on ``app.state.services``, empty but for the settings it was
given; the lifespan fills it in as it opens and starts each part, and closes them at shutdown.
Routes reach a part through its dependency (``app.http.deps``: 503 while it is None); the layers that
run before FastAPI's (``app.http.shedding``, ``app.http.middleware``) are given the object itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from app.config import Settings
from app.formats.sandbox import DocumentReaders
from app.http.slow_clients import ClientLimit
from app.http.uploads import FileRequests
from app.jobs.store import JobStore
from app.keys.limits import KeyLimiter
from app.models.served import ServedModel
from app.monitoring.metrics import Metrics
from app.serving.frontend.router import Router
from app.serving.frontend.scheduler import Scheduler
from app.stores.database.postgres import Postgres
from app.stores.downloads import FileStore, SharedFileStore
from app.terminology.cache import SegmentCache
from app.terminology.glossaries import GlossaryStore
from app.terminology.memory import TranslationMemory


class JobQueue(Protocol):
    """What the app asks of the document jobs' runner (``app.jobs.runner.JobRunner``; named by
    this protocol because the runner imports ``app.http.errors``, which imports FastAPI: nothing of this
    module needs it)."""

    def start(self) -> None: ...

    def notify(self) -> None: ...  # a job was queued or cancelled: look now

    async def stop(self) -> None: ...


@dataclass
class AppServices:
    """Each part is None until the lifespan has made it (and stays set after shutdown)."""

    # NMT_*: given to create_app, or else read first thing in the lifespan.
    settings: Settings | None = None
    # Made in the lifespan before the workers start (the stores are opened on first use):
    metrics: Metrics | None = None
    keys: KeyLimiter | None = None  # the API keys, their limits and usage
    clients: ClientLimit | None = None  # requests open per client address (app.http.slow_clients)
    database: Postgres | None = None  # the stores' shared PostgreSQL (NMT_DATABASE_URL), if any
    glossaries: GlossaryStore | None = None  # stored glossaries (/glossaries, glossary_id)
    memory: TranslationMemory | None = None  # the keys' translation memories (/memories)
    segment_cache: SegmentCache[Any] | None = None  # recent translations, per owner
    # Made once the workers are started and the models described:
    router: Router[ServedModel] | None = None  # the served models and the route of every pair
    files: FileStore | SharedFileStore | None = None  # translated files waiting for their download
    file_requests: FileRequests | None = None  # uploads in progress, at most NMT_MAX_FILE_REQUESTS
    readers: DocumentReaders | None = None  # read and write documents in child processes
    jobs: JobStore | None = None  # document jobs, on disk or in the database
    job_runner: JobQueue | None = None  # runs the queued jobs
    scheduler: Scheduler | None = None  # the workers, and the queues in front of them
    turns: asyncio.Semaphore | None = None  # requests parsed at a time past the gate (app.http.shedding)
    # True from the end of start-up until shutdown begins (a signal, or the lifespan's end).
    ready: bool = False
