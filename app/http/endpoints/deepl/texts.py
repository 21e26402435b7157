"""DeepL's API v2: POST /v2/translate, GET/POST /v2/usage, GET/POST /v2/languages and
GET /v2/glossary-language-pairs.

Thin routes over what the LibreTranslate routes use: the same use case (``Translations``), keys
and limits (``app.keys.limits``: ``Authorization: DeepL-Auth-Key KEY`` is one of the headers it
reads), glossary store, jobs and models; DeepL's language codes are mapped onto the served ones
(``codes``) and the refusals answered as DeepL answers them (``errors``). What each
DeepL field does here: docs/deepl.md.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, ClassVar, Literal

from fastapi import APIRouter, HTTPException, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from app.http.body import parse_request, parse_text_body, read_within
from app.http.deps import GlossariesDep, KeysDep, RouterDep, SchedulerDep, SettingsDep
from app.http.endpoints.deepl.codes import deepl_code, served_code, source_entries, target_entries
from app.http.endpoints.deepl.errors import COMMON, DeepLRoute, errors
from app.http.endpoints.deepl.markup import IgnoredTags, tag_names
from app.http.endpoints.openapi import openapi_body
from app.http.endpoints.request_glossary import request_glossary
from app.http.endpoints.sentences import RecallDep, request_caller
from app.http.endpoints.translate import CLIENT_CLOSED_REQUEST
from app.http.schemas import GlossaryEntryBody
from app.keys.limits import admit_given_key, admit_key, admitted_key, client_identity, key_owner
from app.terminology.terms import INLINE_CHARS
from app.translation.codes import served_pairs, source_languages, target_languages
from app.translation.errors import Invalid
from app.translation.languages import AUTO
from app.translation.texts import TextRequest, Translations, check_encodable, check_limits

api = APIRouter(tags=["deepl"], route_class=DeepLRoute)

# DeepL's answer for an account without a character limit (a Pro plan without cost control).
UNLIMITED = 1_000_000_000_000
SMALL_BODY_BYTES = 4096  # /v2/languages' form body: its ``type``
TagList = list[str] | str | None


class DeepLTranslateRequest(BaseModel):
    """DeepL's /v2/translate body (JSON, or a form with ``text`` repeated)."""

    model_config = ConfigDict(extra="ignore")  # DeepL's newer fields (style_id, ...): accepted, unused
    form_lists: ClassVar[frozenset[str]] = frozenset(
        {"text", "glossary_ids", "ignore_tags", "non_splitting_tags", "splitting_tags"}
    )

    text: list[str] | str = Field(description="The texts to translate")
    target_lang: str = Field(description="EN-US, EN-GB, DE, PT-BR...: a served target (GET /v2/languages)")
    source_lang: str | None = Field(None, description="Absent: detected among the served languages")
    formality: Literal["default", "more", "less", "prefer_more", "prefer_less"] | None = Field(
        None, description="Accepted; no served model has a formality"
    )
    glossary_id: str | None = Field(None, description="A glossary of POST /v2/glossaries")
    glossary_ids: list[str] | str | None = Field(None, description="At most one id here")
    tag_handling: Literal["xml", "html"] | None = Field(
        None, description="Translate the text between tags, keep the markup"
    )
    ignore_tags: TagList = Field(None, description="Elements kept untranslated (with tag_handling)")
    non_splitting_tags: TagList = Field(None, description="Accepted: inline HTML tags never split")
    splitting_tags: TagList = Field(None, description="Accepted: any other tag splits")
    split_sentences: Literal["0", "1", "nonewlines"] | None = Field(
        None, description="Accepted: texts are split into sentences, newlines kept"
    )
    preserve_formatting: bool | None = Field(None, description="Accepted: formatting is always kept")
    outline_detection: bool | None = None
    context: str | None = Field(None, description="Accepted, not translated, not billed")
    show_billed_characters: bool | None = Field(None, description="billed_characters is always shown")
    model_type: str | None = None
    tag_handling_version: str | None = None

    @property
    def texts(self) -> list[str]:
        return [self.text] if isinstance(self.text, str) else list(self.text)

    def stored_glossary(self) -> str | None:
        """The one glossary asked for (``glossary_id``, or a ``glossary_ids`` of one)."""
        ids = [self.glossary_ids] if isinstance(self.glossary_ids, str) else list(self.glossary_ids or ())
        ids = [i for value in ids for i in value.split(",") if i.strip()]
        if self.glossary_id is not None:
            ids.insert(0, self.glossary_id)
        if len(set(ids)) > 1:
            raise Invalid("this service applies one glossary per request: give one glossary_id")
        return ids[0] if ids else None

    def ignored(self) -> IgnoredTags:
        values = [self.ignore_tags] if isinstance(self.ignore_tags, str) else list(self.ignore_tags or ())
        return IgnoredTags(tag_names(values) if self.tag_handling else frozenset())


class DeepLTranslation(BaseModel):
    detected_source_language: str
    text: str
    billed_characters: int = Field(description="The characters of the source text")


class DeepLTranslations(BaseModel):
    translations: list[DeepLTranslation]


@dataclass
class Terminology:
    """The request's terminology as ``request_glossary`` reads it (a stored glossary only)."""

    source: str
    target: str
    glossary: list[GlossaryEntryBody] | None
    glossary_id: str | None


@api.post(
    "/v2/translate",
    response_model=DeepLTranslations,
    openapi_extra=openapi_body(DeepLTranslateRequest),
    summary="Translate texts (DeepL API v2)",
    responses=errors(
        **COMMON,
        _404="glossary_id names no glossary of this key",
        _413="Too many texts or characters, or too large a body",
        _456="The key's characters of the day (chars_per_day) are used up",
        _504="The translation did not finish within the request timeout",
    ),
)
async def translate(
    request: Request,
    settings: SettingsDep,
    router: RouterDep,
    scheduler: SchedulerDep,
    keys: KeysDep,
    glossaries: GlossariesDep,
    recall: RecallDep,
) -> Response:
    await admit_given_key(request, keys)  # DeepL's Authorization header: refused before the body is read
    req = await parse_request(request, settings.max_body_bytes, DeepLTranslateRequest)
    texts, glossary_id = req.texts, req.stored_glossary()
    check_limits(texts, settings)
    check_encodable([*texts, req.target_lang, req.source_lang or "", glossary_id or ""])
    # As /translate counts a list: a request per text.
    await admit_key(request, keys, None, requests=max(1, len(texts)), text_lengths=list(map(len, texts)))
    source = served_code(req.source_lang, source_languages(router)) if req.source_lang else AUTO
    target = served_code(req.target_lang, target_languages(router))
    terminology = Terminology(source, target, None, glossary_id)
    ignored = req.ignored()
    # (Finding the tags grows with the text: a long one is read on a thread, as the use case does.)
    inline = not ignored.names or sum(map(len, texts)) <= INLINE_CHARS
    marked = ignored.mark(texts) if inline else await asyncio.to_thread(ignored.mark, texts)
    asked = TextRequest(
        marked,
        source,
        target,
        request_caller(request, key_owner(request), client_identity(request), settings.request_timeout_s),
        format="html" if req.tag_handling else "text",
        glossary=partial(request_glossary, request, terminology, settings, glossaries),
        protect_placeholders=True,  # as /translate's default
    )
    result = await Translations(settings, router, scheduler, recall).texts(asked)
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    languages = [d.language for d in result.detected] if result.detected else [source] * len(texts)
    body = DeepLTranslations(
        translations=[
            DeepLTranslation(
                detected_source_language=deepl_code(language),
                text=ignored.unmark(translated[0]),
                billed_characters=len(text),
            )
            for text, translated, language in zip(texts, result.translations, languages, strict=True)
        ]
    )
    return Response(body.model_dump_json(), media_type="application/json")


class DeepLUsage(BaseModel):
    character_count: int = Field(description="Characters of the key's last 24 hours (chars_per_day)")
    character_limit: int = Field(description="Its chars_per_day; 10^12 where nothing limits it")


@api.get("/v2/usage", response_model=DeepLUsage, responses=errors(**COMMON), summary="The key's usage")
@api.post("/v2/usage", response_model=DeepLUsage, responses=errors(**COMMON), summary="The key's usage")
async def usage(request: Request, keys: KeysDep) -> DeepLUsage:
    await admit_given_key(request, keys)
    await admit_key(request, keys, None, requests=1, text_lengths=[])
    key = admitted_key(request)
    counted = None if key is None else await keys.characters(key)
    count, limit = counted or (0, UNLIMITED)
    return DeepLUsage(character_count=count, character_limit=limit)


class DeepLLanguage(BaseModel):
    language: str
    name: str
    supports_formality: bool | None = Field(None, description="Target languages only")


LanguageType = Literal["source", "target"]
TypeQuery = Annotated[
    LanguageType | None, Query(alias="type", description="source (the default) or target; or in a form body")
]


@api.get(
    "/v2/languages",
    response_model=list[DeepLLanguage],
    response_model_exclude_none=True,
    responses=errors(**COMMON),
    summary="Source or target languages",
)
@api.post(
    "/v2/languages",
    response_model=list[DeepLLanguage],
    response_model_exclude_none=True,
    responses=errors(**COMMON),
    summary="Source or target languages",
)
async def languages(
    request: Request,
    router: RouterDep,
    keys: KeysDep,
    kind: TypeQuery = None,
) -> list[dict[str, object]]:
    await admit_given_key(request, keys)
    # DeepL's clients send ``type`` as a form body, a GET's too.
    if kind is None:
        kind = await body_type(request)
    await admit_key(request, keys, None, requests=1, text_lengths=[])
    if kind == "target":
        return target_entries(target_languages(router))
    return source_entries(source_languages(router))


async def body_type(request: Request) -> LanguageType | None:
    """The ``type`` of a small JSON or urlencoded body (400 for another value)."""
    body = await read_within(request, SMALL_BODY_BYTES)
    fields: Any = await parse_text_body(body, request.headers.get("content-type", "").split(";")[0].strip())
    value = fields.get("type") if isinstance(fields, dict) else None
    if value is None or value in ("source", "target"):
        return value  # type: ignore[no-any-return]
    raise HTTPException(400, "type must be source or target")


class GlossaryPair(BaseModel):
    source_lang: str
    target_lang: str


class GlossaryPairs(BaseModel):
    supported_languages: list[GlossaryPair]


@api.get(
    "/v2/glossary-language-pairs",
    response_model=GlossaryPairs,
    responses=errors(**COMMON),
    summary="The pairs a glossary may be made for: every served pair",
)
async def glossary_language_pairs(request: Request, router: RouterDep, keys: KeysDep) -> GlossaryPairs:
    await admit_given_key(request, keys)
    await admit_key(request, keys, None, requests=1, text_lengths=[])
    pairs = [GlossaryPair(source_lang=s.lower(), target_lang=t.lower()) for s, t in served_pairs(router)]
    return GlossaryPairs(supported_languages=pairs)
