"""The front end's background loop that runs document jobs (``app.jobs.store``) to the end: the
stages of the documents' use case (``app.translation.documents``), each chunk saved as it ends.

A job goes queued -> reading -> translating -> writing -> done (or failed, or cancelled):

* **reading**: a reader process (``app.formats.sandbox``, with the job's limits: more text, time
  and memory than a /translate_file upload) parses the upload; its language is detected when
  the source is "auto"; the key is charged its characters; each sentence's terms are found.
* **translating**: the sentences go to the scheduler a chunk at a time (``CHUNK_SENTENCES``),
  ``IN_FLIGHT`` chunks at once so the workers never wait between them, through the same path as a
  /translate request (the key's translation memory, the segment cache, constraints), but as
  *background* work: the scheduler gives a job's sentences to a worker only within a share of its
  rows that leaves a batch free for typed requests, and the worker decodes them in a batch of
  their own that steps only when no typed sentence runs, or once in ``BACKGROUND_EVERY`` steps
  (``app.serving.worker.executor``). So a typed line decodes in its own steps beside a 200-page document,
  and alone the document fills the batch (benchmarks/jobs.py measures both). Each chunk is saved
  as it finishes.
* **writing**: a reader process writes the translations into the file.

At most ``max_running`` jobs run at a time in this process. A job that failed for a reason of
the moment (the queue full, a worker restarting, every reader busy) is not failed: its chunk is
tried again after ``RETRY_S``. A cancel or a delete is seen at the next chunk (the chunks in
flight are withdrawn from the workers). When the service stops, the running jobs are left as
they are, their leases given back: the next start takes them up after their last saved chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from fastapi import HTTPException

from app.formats.documents import MEDIA_TYPES, REVIEW_MARKS, download_name, extension
from app.formats.limits import DocumentError
from app.http.errors import status_of
from app.jobs.job import FINAL, ClaimedJob, Job, State
from app.jobs.store import JobStore, StorageFull
from app.keys.limits import KeyLimiter, charge_owner, key_identity
from app.stores.database.errors import StoreUnavailable
from app.translation.documents import Chunk, DocumentRequest, Documents, ReadDocument
from app.translation.errors import Busy, TranslationError, Unavailable
from app.translation.sentences import Caller, SearchPlan
from model.decoding.terms import Glossary, GlossaryEntry

log = logging.getLogger("uvicorn.error").getChild("jobs")

CHUNK_SENTENCES = 64  # sentences a chunk: progress is saved, and shown, chunk by chunk
# Chunks of one job given to the scheduler at once: the next is queued while the last sentences
# of the one before decode, so that the workers' batches of documents stay full.
IN_FLIGHT = 2
CHUNK_TIMEOUT_S = 900.0  # a chunk waits this long at most (it shares the workers with everyone)
RETRY_S = 2.0  # before trying a chunk (or a read) again after a refusal of the moment
POLL_S = 2.0  # between looks for new jobs when nobody said there is one
EXPIRE_EVERY_S = 60.0


class Stopped(Exception):
    """The job was cancelled or deleted while it ran."""


class JobRunner:
    def __init__(self, store: JobStore, documents: Documents, keys: KeyLimiter, max_running: int) -> None:
        self.store = store
        self.documents = documents  # the use case, with the readers of jobs (their larger limits)
        self.keys = keys
        self.max_running = max_running
        self.running: dict[str, asyncio.Task[None]] = {}  # job id -> its task
        self.owners: dict[str, str] = {}  # job id -> owner
        self.wake = asyncio.Event()
        self.loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.loop_task = asyncio.create_task(self._loop(), name="nmt-jobs")

    def notify(self) -> None:
        """A job was queued (or cancelled): look now, not at the next poll."""
        self.wake.set()

    async def stop(self) -> None:
        """Stop every running job where it is, giving its lease back."""
        running = list(self.running)  # (each task's end takes it out of self.running)
        tasks = [t for t in (self.loop_task, *self.running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job_id in running:
            with contextlib.suppress(StoreUnavailable):
                await asyncio.to_thread(self.store.release, job_id)

    async def _loop(self) -> None:
        try:  # what a process killed mid-write left (another's upload in progress is spared)
            await asyncio.to_thread(self.store.sweep)
        except StoreUnavailable as e:
            log.error("jobs: %s", e)
        expired_at = 0.0
        loop = asyncio.get_running_loop()
        while True:
            try:
                if loop.time() - expired_at > EXPIRE_EVERY_S:
                    expired_at = loop.time()
                    await asyncio.to_thread(self.store.remove_expired)
                while len(self.running) < self.max_running:
                    counts: dict[str, int] = {}
                    for owner in self.owners.values():
                        counts[owner] = counts.get(owner, 0) + 1
                    job = await asyncio.to_thread(self.store.claim, counts)
                    if job is None:
                        break
                    self.owners[job.id] = job.owner
                    task = asyncio.create_task(self._run(job), name=f"nmt-job-{job.id}")
                    self.running[job.id] = task
                    task.add_done_callback(partial(self._ended, job.id))
            except StoreUnavailable as e:
                log.error("jobs: %s", e)
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), POLL_S)

    def _ended(self, job_id: str, task: asyncio.Task[None]) -> None:
        self.running.pop(job_id, None)
        self.owners.pop(job_id, None)
        self.wake.set()

    async def _run(self, job: ClaimedJob) -> None:
        heartbeat = asyncio.create_task(self._heartbeat(job.id, asyncio.current_task()))
        try:
            await self._translate(job)
        except Stopped:
            pass
        except StoreUnavailable as e:
            # The store failed (its server restarting): the job is not failed for it. Its lease
            # runs out, and a runner (this one, or another replica's) takes it up again after its
            # last saved chunk.
            log.error("jobs: job %s paused, the store is unavailable: %s", job.id, e)
        except TranslationError as e:  # a refusal the request would have had: the job's answer
            await self._fail(job, status_of(e), str(e))
        except HTTPException as e:  # the key's limits (charge_owner): the job's answer too
            await self._fail(job, e.status_code, str(e.detail))
        except StorageFull as e:  # its result (or progress) would pass NMT_DATA_QUOTA_MB or fill the disk
            await self._fail(job, 507, str(e))
        except DocumentError as e:
            await self._fail(job, e.status, str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: the job fails, the runner goes on
            log.exception("jobs: job %s failed", job.id)
            await self._fail(job, 500, f"internal error: {type(e).__name__}")
        finally:
            heartbeat.cancel()

    async def _fail(self, job: Job, status: int, message: str) -> None:
        with contextlib.suppress(StoreUnavailable):
            await asyncio.to_thread(self.store.finish, job.id, "failed", error_status=status, error=message)

    async def _heartbeat(self, job_id: str, task: asyncio.Task[Any] | None) -> None:
        """Renew the job's lease; cancel its task when the job was cancelled or deleted."""
        while True:
            await asyncio.sleep(self.store.lease_s / 3)
            try:
                state = await asyncio.to_thread(self.store.renew, job_id)
            except StoreUnavailable:
                continue
            if (state is None or state in FINAL) and task is not None:
                task.cancel(msg="stopped")
                return

    async def _advance(self, job: Job, state: State, **values: Any) -> None:
        if not await asyncio.to_thread(self.store.advance, job.id, state, **values):
            raise Stopped

    async def _translate(self, job: ClaimedJob) -> None:
        await self._advance(job, "reading")
        data = await asyncio.to_thread(self.store.upload, job.id)
        options = job.options
        glossary = Glossary([GlossaryEntry(a, b) for a, b in options.glossary]) if options.glossary else None
        # The segment cache's owner, as ``client_identity`` names a request's: the key's, or
        # without keys the job's own (its client's address is not kept).
        cached_as = key_identity(job.owner) if job.owner else f"job {job.id}"
        asked = DocumentRequest(
            job.name,
            data,
            job.source,
            job.target,
            glossary,
            options.protect_placeholders,
            SearchPlan(beam_size=options.beam_size, n_best=1),
            Caller(job.owner, cached_as, CHUNK_TIMEOUT_S, background=True),
            chunk_sentences=CHUNK_SENTENCES,
            min_confidence=options.min_confidence,
        )

        async def charge(chars: int) -> None:
            if not job.total:  # charged once, not again when a restart reads it again
                await charge_owner(self.keys, job.owner, chars)

        document = await retrying(lambda: self.documents.read(asked, charge))
        total = len(document.sentences)
        done, low = await asyncio.to_thread(self.store.saved_chunks, job.id)
        await self._advance(
            job,
            "translating",
            language=document.language,
            total=total,
            chars=document.chars,
            done=len(done),
            notes=document.notes,
        )
        translations = await self._chunks(job, document, done, low)
        notes = document.notes
        if options.min_confidence is not None:  # (said even when none: the job was asked to look)
            notes += (flagged_note(len(low), len(translations), options.min_confidence, job.name),)
        await self._advance(job, "writing", notes=notes)
        output = await retrying(lambda: self.documents.write(document, translations, low))
        await asyncio.to_thread(self.store.save_result, job.id, output)
        name = download_name(job.name, job.target)
        if not await asyncio.to_thread(self.store.finish, job.id, "done", result_name=name):
            raise Stopped

    async def _chunks(
        self, job: Job, document: ReadDocument, done: list[str], low: dict[int, float]
    ) -> list[str]:
        """The translations of the document's sentences after the ``done`` ones, chunk by chunk,
        ``IN_FLIGHT`` at once, each saved as it finishes; the sentences flagged for review added to
        ``low``."""

        async def chunk(start: int) -> tuple[int, Chunk]:
            part = await retrying(lambda: self.documents.translate_chunk(document, start))
            assert part is not None  # no client to go away: cancelling raises instead
            return start, part

        out = list(done)
        pending: deque[asyncio.Task[tuple[int, Chunk]]] = deque()

        async def save_first() -> None:
            start, translated = await pending.popleft()
            flagged = translated.review(document, start)
            await asyncio.to_thread(self.store.save_translations, job.id, translated.translations, flagged)
            out.extend(translated.translations)
            low.update(flagged)
            await self._advance(job, "translating", done=len(out))

        try:
            for start in self.documents.chunk_starts(document, len(done)):
                pending.append(asyncio.create_task(chunk(start)))
                if len(pending) == IN_FLIGHT:
                    await save_first()
            while pending:
                await save_first()
        finally:
            for task in pending:
                task.cancel()
        return out


async def retrying(make: Callable[[], Awaitable[Any]]) -> Any:
    """``make()``'s result, tried again after ``RETRY_S`` while it fails for a reason of the moment
    (the queue full, every reader busy, no worker running)."""
    while True:
        try:
            return await make()
        except (Busy, Unavailable):
            pass
        await asyncio.sleep(RETRY_S)


def flagged_note(flagged: int, sentences: int, threshold: float, name: str) -> str:
    """The job's note on what it flagged for review, and where the format shows it."""
    where = REVIEW_MARKS.get(extension(name))
    shown = f" ({where})" if where else " (this format has no place to mark them)"
    return f"{flagged} of {sentences} sentences below confidence {threshold:g} flagged for review{shown}"


def media_type(name: str) -> str:
    return MEDIA_TYPES.get(extension(name), "application/octet-stream")
