"""The use case "translate this document": read it, translate its sentences a chunk at a time,
write it. /translate_file runs the three in one request (``Documents.translate``); a document job
runs them as its stages, saving each chunk and resuming after the last saved one
(``app.jobs.runner``).

The document is never parsed here: a reader process parses it within its limits and gives back
its sentences, and another writes their translations into it (``app.formats.sandbox``). A
document can hold far more sentences than a request to /translate, so they go to the scheduler a
chunk at a time: the queue never holds more than a chunk or two of one document, and the
scheduler's round-robin over requests keeps everyone else's one-liners moving meanwhile.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from app.config import Settings
from app.formats.documents import SUPPORTED, Review, extension
from app.formats.sandbox import Busy as ReadersBusy
from app.formats.sandbox import DocumentReaders
from app.models.served import ServedModel
from app.serving.frontend.router import Route, Router
from app.serving.frontend.scheduler import Scheduler
from app.terminology.terms import SentenceTerms, find_sentence_terms
from app.translation.errors import Busy, Invalid
from app.translation.languages import AUTO, check_languages, route_of, shorten, source_language
from app.translation.sentences import Caller, Recall, SearchPlan, SentenceRequest, translate_sentences
from model.decoding.terms import Glossary

# When every reader is busy: as an upload refused for want of a place (app.http.uploads).
READERS_RETRY_AFTER_S = "2"


@dataclass(frozen=True)
class DocumentRequest:
    """One document to translate, and for whom."""

    name: str  # the file's name: its extension says its format
    data: bytes
    source: str  # a language code, or "auto" (detected from the start of the document's text)
    target: str
    glossary: Glossary | None  # resolved by the caller (inline entries, or a stored glossary)
    protect_placeholders: bool
    plan: SearchPlan
    caller: Caller
    chunk_sentences: int  # sentences given to the scheduler at a time
    # Sentences whose confidence is below it are flagged for review in the file, where its format
    # can (``app.formats.documents.Review``); None: nothing flagged, no confidence asked.
    min_confidence: float | None = None


@dataclass(frozen=True)
class Chunk:
    """A chunk's translations, and each one's confidence (None: not asked, or no model's)."""

    translations: list[str]
    confidences: list[float | None]

    def review(self, document: ReadDocument, start: int) -> dict[int, float]:
        """The chunk's sentences (by their index in the document) below the request's threshold."""
        threshold = document.request.min_confidence
        if threshold is None:
            return {}
        return {start + i: c for i, c in enumerate(self.confidences) if c is not None and c < threshold}


@dataclass(frozen=True)
class ReadDocument:
    """A document read: its sentences, the model path of its pair and each sentence's terms."""

    request: DocumentRequest
    language: str  # as given, or detected
    sentences: tuple[str, ...]
    chars: int  # of its text: what the owner is charged
    notes: tuple[str, ...]  # what the reader could not translate, and why (a scanned page)
    route: Route[ServedModel]
    terms: SentenceTerms


@dataclass(frozen=True)
class Translated:
    """A translated file, its sentences, and how many were flagged for review."""

    data: bytes
    sentences: int
    flagged: int


def check_format(name: str) -> None:
    """``Invalid`` unless the file's extension names a format the service reads."""
    if extension(name) not in SUPPORTED:
        kind = shorten(extension(name) or name)
        raise Invalid(f"unsupported file format {kind}; supported: {', '.join(SUPPORTED)}")


class Documents:
    """The use case over the running service's parts: its stages, and all three in order."""

    def __init__(
        self,
        settings: Settings,
        router: Router[ServedModel],
        scheduler: Scheduler,
        recall: Recall,
        readers: DocumentReaders,
    ) -> None:
        self.settings = settings
        self.router = router
        self.scheduler = scheduler
        self.recall = recall
        self.readers = readers

    async def read(self, request: DocumentRequest, charge: Callable[[int], Awaitable[None]]) -> ReadDocument:
        """The document read in a reader process, its language found where the source is "auto",
        ``charge`` called with its characters before anything is translated, each sentence's
        terms found (``TooLarge`` past ``NMT_MAX_TERMS_PER_SENTENCE``)."""
        check_format(request.name)
        candidates = check_languages(request.source, request.target, self.router)

        def language(sample: str) -> str:
            if request.source.lower() == AUTO:
                return source_language(sample, candidates).language
            return candidates[0]

        try:
            read = await self.readers.read(request.name, request.data, language)
        except ReadersBusy as e:
            raise Busy(str(e), retry_after=READERS_RETRY_AFTER_S) from e
        await charge(read.chars)
        route = route_of(self.router, read.language, request.target)
        limit = self.settings.max_terms_per_sentence
        terms = await find_sentence_terms(
            read.sentences, request.glossary, protect=request.protect_placeholders, limit=limit
        )
        return ReadDocument(request, read.language, read.sentences, read.chars, read.notes, route, terms)

    def chunk_starts(self, document: ReadDocument, done: int = 0) -> range:
        """Where each chunk after the first ``done`` sentences starts."""
        return range(done, len(document.sentences), document.request.chunk_sentences)

    async def translate_chunk(self, document: ReadDocument, start: int) -> Chunk | None:
        """The best translation of each sentence of the chunk at ``start`` (the owner's
        translation memory and the segment cache first, as for /translate), with its confidence
        where the request has a threshold; None if the caller went away."""
        end = start + document.request.chunk_sentences
        part = list(document.sentences[start:end])
        route, request = document.route, document.request
        plan = request.plan
        if request.min_confidence is not None and not plan.confidence:
            plan = replace(plan, confidence=True)
        asked = SentenceRequest(
            part,
            [route] * len(part),
            [route.source] * len(part),
            request.target,
            plan,
            SentenceTerms(document.terms.terms[start:end]),
            request.caller,
        )
        results = await translate_sentences(asked, self.scheduler, self.recall)
        if results is None:
            return None
        confidences = [r.confidence[0].value if r.confidence else None for r in results]
        return Chunk([result.texts[0] for result in results], confidences)

    async def write(self, document: ReadDocument, translations: list[str], low: dict[int, float]) -> bytes:
        """The document with its sentences replaced by ``translations``, written by a reader; the
        sentences of ``low`` (index -> confidence, below the request's threshold) flagged."""
        request = document.request
        threshold = request.min_confidence
        review = None if threshold is None else Review(threshold, low)
        try:
            return await self.readers.write(
                request.name, request.data, document.language, len(document.sentences), translations, review
            )
        except ReadersBusy as e:
            raise Busy(str(e), retry_after=READERS_RETRY_AFTER_S) from e

    async def translate(
        self, request: DocumentRequest, charge: Callable[[int], Awaitable[None]]
    ) -> Translated | None:
        """Read, translate chunk after chunk, write: the translated file, or None if the caller
        went away."""
        document = await self.read(request, charge)
        out: list[str] = []
        low: dict[int, float] = {}
        for start in self.chunk_starts(document):
            part = await self.translate_chunk(document, start)
            if part is None:
                return None
            out += part.translations
            low |= part.review(document, start)
        return Translated(await self.write(document, out, low), len(out), len(low))
