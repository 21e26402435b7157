"""The use case "translate these texts", in the order its stages run (``translate_texts``):

1. **check** the pair (``app.translation.languages``) and the search asked for;
2. **terminology**: the request's glossary, resolved where the caller says (inline entries, a
   stored one);
3. **split**: each text parsed (plain or HTML), its language detected (a source of "auto"), cut into
   sentences, each sentence routed and its terms found (on a thread unless the request is small);
4. **answer** each sentence: its owner's memory, the segment cache, or the model
   (``app.translation.sentences``, where sentences are tokenized: ``ServedModel.source_ids`` in
   the front end's pipeline);
5. **confidence** (when asked, or a threshold applies): each sentence below the threshold flagged
   or withheld, each text's confidence (``app.translation.confidence``);
6. **render**: each text's n-best translations in its layout, and where its terms are.

One request in (``TextRequest``), one result out (``TextResult``, or None when the caller went
away); refusals are ``app.translation.errors``'. No HTTP here: the routes parse and map.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from app.config import Settings
from app.formats import Layout, PlainText, parse
from app.formats.html import HtmlDocument, HtmlError
from app.models.served import ServedModel
from app.serving.frontend.router import Route, Router
from app.serving.frontend.scheduler import Scheduler
from app.serving.protocol import SentenceResult
from app.terminology.terms import INLINE_CHARS, SentenceTerms, sentence_terms, text_terminology
from app.translation.confidence import (
    TextConfidence,
    below_threshold,
    sentence_spans,
    text_confidence,
    withhold,
)
from app.translation.errors import Invalid, TooLarge
from app.translation.languages import AUTO, check_languages, route_of, source_language
from app.translation.results import DetectedLanguage, Terminology
from app.translation.sentences import Caller, Recall, SearchPlan, SentenceRequest, translate_sentences
from model.decoding.terms import Glossary


@dataclass(frozen=True)
class TextRequest:
    """Texts to translate from ``source`` (or "auto") into ``target``.

    ``format``: "text" or "html"; ``alternatives``: how many translations besides the best;
    ``beam_size``: None for the service's default; ``glossary``: resolves the request's glossary
    (None without one), called once the pair and the search are checked; ``protect_placeholders``:
    placeholders ({name}, %s, URLs...) kept as they are. ``confidence``: None, "sentence" (each
    text's confidence) or "tokens" (and each piece's probability); ``min_confidence``: the
    threshold (None: the service's ``NMT_MIN_CONFIDENCE``), below which sentences are flagged, or
    answered empty with ``withhold``."""

    texts: list[str]
    source: str
    target: str
    caller: Caller
    format: str = "text"
    alternatives: int = 0
    beam_size: int | None = None
    glossary: Callable[[], Awaitable[Glossary | None]] | None = None
    protect_placeholders: bool = False
    confidence: str | None = None
    min_confidence: float | None = None
    withhold: bool = False


@dataclass(frozen=True)
class TextResult:
    """Each text's translations, best first (``alternatives + 1`` of them, the best repeated where
    the search found fewer); each text's detected language, when the source was "auto"; each
    text's terminology, when some text has one; each text's confidence, when asked for or a
    threshold applies."""

    translations: list[list[str]]
    detected: list[DetectedLanguage] | None
    terminology: list[Terminology | None] | None
    confidence: list[TextConfidence] | None = None


@dataclass(frozen=True)
class Translations:
    """What translating needs: the limits, the served routes, the workers' queues, and what may
    answer before the model (built per request from the app's services: nothing of its own)."""

    settings: Settings
    router: Router[ServedModel]
    scheduler: Scheduler
    recall: Recall

    async def texts(self, request: TextRequest) -> TextResult | None:
        return await translate_texts(self, request)

    async def sentences(self, request: SentenceRequest) -> list[SentenceResult] | None:
        return await translate_sentences(request, self.scheduler, self.recall)


# --- checks the HTTP edge runs while it parses (before a key is charged) ---------------------------


def check_limits(texts: Sequence[str], settings: Settings) -> None:
    if len(texts) > settings.max_texts:
        raise TooLarge(f"too many texts: {len(texts)} (at most {settings.max_texts} per request)")
    chars = sum(map(len, texts))
    if chars > settings.max_chars:
        raise TooLarge(f"too much text: {chars} characters (at most {settings.max_chars} per request)")


def is_utf8(value: str) -> bool:
    """False for strings with lone surrogates: JSON can carry them ("\\ud800") but UTF-8 cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_encodable(fields: Sequence[str]) -> None:
    if not all(map(is_utf8, fields)):
        raise Invalid("invalid text: unpaired surrogate (not representable in UTF-8)")


# --- the stages --------------------------------------------------------------------------------------


def search_plan(
    alternatives: int,
    beam_size: int | None,
    settings: Settings,
    confidence: bool = False,
    pieces: bool = False,
) -> SearchPlan:
    if alternatives > settings.max_alternatives:
        raise Invalid(f"alternatives must be at most {settings.max_alternatives}")
    n_best = alternatives + 1
    # The beam must hold every hypothesis asked for, so alternatives can raise the beam size.
    beam = max(beam_size or settings.default_beam_size, n_best)
    if beam > settings.max_beam_size:
        raise Invalid(f"beam_size must be at most {settings.max_beam_size}")
    return SearchPlan(beam_size=beam, n_best=n_best, confidence=confidence or pieces, pieces=pieces)


def parse_texts(texts: Sequence[str], format: str) -> list[PlainText | HtmlDocument]:
    """Each text read as ``format`` (``Invalid`` for HTML that cannot be read)."""
    try:
        return [parse(text, "html" if format == "html" else "text") for text in texts]
    except HtmlError as e:
        raise Invalid(str(e)) from e


@dataclass(frozen=True)
class Split:
    """A request's texts made ready to be answered (``split``)."""

    detected: list[DetectedLanguage] | None  # each text's language, when the source is "auto"
    layouts: list[Layout]  # each text's
    sentences: list[str]  # of all the texts, in order
    routes: list[Route[ServedModel]]  # each sentence's
    sources: list[str]  # each sentence's language
    terms: SentenceTerms  # each sentence's


def split(
    request: TextRequest,
    candidates: Sequence[str],
    glossary: Glossary | None,
    router: Router[ServedModel],
    max_terms: int,
) -> Split:
    """Each text parsed (``format``), its language detected (a source of "auto"), split into
    sentences, each sentence routed and its terms found."""
    documents = parse_texts(request.texts, request.format)
    detected = None
    if request.source.lower() == AUTO:
        detected = [source_language(document.text, candidates) for document in documents]
    languages = [d.language for d in detected] if detected else list(candidates) * len(documents)
    layouts = [document.split(language) for document, language in zip(documents, languages, strict=True)]
    sentences = [s for layout in layouts for s in layout.sentences]
    sources = [lang for layout, lang in zip(layouts, languages, strict=True) for _ in layout.sentences]
    routes = [route_of(router, language, request.target) for language in sources]
    terms = sentence_terms(sentences, glossary, protect=request.protect_placeholders, limit=max_terms)
    return Split(detected, layouts, sentences, routes, sources, terms)


def hypothesis(result: SentenceResult, k: int) -> str:
    """The k-th best translation, or the best when the search found fewer distinct ones."""
    texts = result.texts
    return texts[k] if k < len(texts) else texts[0]


def assemble(layouts: Sequence[Layout], results: Sequence[SentenceResult], n_best: int) -> list[list[str]]:
    """For each text, its ``n_best`` translations (best first), each in the text's layout."""
    outputs = []
    start = 0
    for layout in layouts:
        own = results[start : start + len(layout.sentences)]
        start += len(layout.sentences)
        outputs.append([layout.join([hypothesis(r, k) for r in own]) for k in range(n_best)])
    if start != len(results):
        raise RuntimeError(f"engine returned {len(results)} results for {start} sentences")
    return outputs


def marks(
    layouts: Sequence[Layout],
    terms: SentenceTerms,
    results: Sequence[SentenceResult],
    outputs: Sequence[Sequence[str]],
) -> list[Terminology | None] | None:
    """Each text's terminology, where its sentences had terms or came from the memory; None when no
    text has one."""
    memory = [r.memory for r in results]
    if not terms and not any(memory):
        return None
    best = [hypothesis(r, 0) for r in results]
    placed = [r.placed for r in results]
    found = text_terminology(layouts, terms, best, placed, [texts[0] for texts in outputs], memory)
    return found if any(found) else None


async def translate_texts(service: Translations, request: TextRequest) -> TextResult | None:
    """``request``'s texts translated, stage by stage (this module's docstring); None if the caller
    went away."""
    settings = service.settings
    candidates = check_languages(request.source, request.target, service.router)
    if request.confidence not in (None, "sentence", "tokens"):
        raise Invalid('confidence must be true, false or "tokens"')
    threshold = request.min_confidence if request.min_confidence is not None else settings.min_confidence
    scored = request.confidence is not None or threshold is not None
    plan = search_plan(
        request.alternatives, request.beam_size, settings, scored, request.confidence == "tokens"
    )
    glossary = None if request.glossary is None else await request.glossary()
    work = partial(split, request, candidates, glossary, service.router, settings.max_terms_per_sentence)
    if glossary is None and sum(map(len, request.texts)) <= INLINE_CHARS:
        done = work()
    else:  # (parsing, splitting and terms grow with the text: the event loop answers others meanwhile)
        done = await asyncio.to_thread(work)
    asked = SentenceRequest(
        done.sentences, done.routes, done.sources, request.target, plan, done.terms, request.caller
    )
    results = await service.sentences(asked)
    if results is None:
        return None
    confidence = None
    if scored:
        low = below_threshold(results, threshold)
        if request.withhold:
            results = withhold(results, low)
        confidence = text_confidence(
            done.layouts,
            results,
            plan.n_best,
            pieces=plan.pieces,
            low=low,
            threshold=threshold,
            withheld=request.withhold,
        )
    outputs = assemble(done.layouts, results, plan.n_best)
    if confidence is not None:
        where = sentence_spans(done.layouts, results, [texts[0] for texts in outputs])
        confidence = [replace(c, sentences=s) for c, s in zip(confidence, where, strict=True)]
    return TextResult(outputs, done.detected, marks(done.layouts, done.terms, results, outputs), confidence)
