"""Request and response bodies, compatible with LibreTranslate's ``/translate`` and ``/languages``.

LibreTranslate clients (browser extensions, CAT tools, bots) work unchanged: same field names, same
response shapes, errors as ``{"error": "message"}``. ``beam_size`` and terminology (``glossary``,
``glossary_id``, ``protect_placeholders``; ``terminology`` in the response) and confidence
(``confidence``, ``min_confidence``, ``low_confidence``; ``confidence``, ``alternativesConfidence``,
``tokenConfidence``, ``lowConfidence`` in the response) are our own optional extensions: a request
without them is answered as LibreTranslate's is.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.translation.results import DetectedLanguage, Terminology


class GlossaryEntryBody(BaseModel):
    """A glossary entry: ``source`` is translated as ``target`` (equal: left untranslated)."""

    model_config = ConfigDict(extra="ignore")

    # Not empty (422); one of spaces only is ignored (``app.terminology.terms``).
    source: str = Field(min_length=1)
    target: str = Field(min_length=1)


def glossary_from_json_text(value: Any) -> Any:
    """A form carries the glossary as JSON text: ``glossary=[{"source": ..., "target": ...}]``."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"glossary is not a JSON list of {{source, target}} entries: {e}") from e
    return value


class TranslateRequest(BaseModel):
    # Unknown fields are ignored, as LibreTranslate does (clients send extras such as "model").
    model_config = ConfigDict(extra="ignore")

    q: str | list[str] = Field(description="Text, or list of texts, to translate")
    source: str = Field("auto", description='Source language code, or "auto"')
    # Not min_length=1, though "" is a missing target (400, routes.translate.check_languages): with
    # a length constraint pydantic refuses a lone surrogate as a type error (422), not our 400.
    target: str = Field(description="Target language code")
    format: Literal["text", "html"] = Field(
        "text", description="text, or html: tags kept, the text between them translated"
    )
    alternatives: int = Field(0, ge=0, description="Number of alternative translations to return")
    api_key: str | None = None
    beam_size: int | None = Field(None, ge=1, description="Beam size (extension; default from settings)")
    glossary: list[GlossaryEntryBody] | None = Field(
        None,
        description=(
            "Terms the translation must use (extension): [{source, target}], a do-not-translate "
            "term has target == source. In a form: the list as JSON text"
        ),
    )
    glossary_id: str | None = Field(None, description="A stored glossary's id (extension; POST /glossaries)")
    protect_placeholders: bool = Field(
        True,
        description=(
            "Keep {name}, {{var}}, %s, %1$s, %(name)s, URLs, e-mail addresses and numbers verbatim "
            "(extension)"
        ),
    )

    confidence: bool | Literal["tokens"] = Field(
        False,
        description=(
            "Extension: true adds each text's confidence (the model's calibrated probability that "
            "the translation's chrF against a reference is >= 50; a text of several sentences: its "
            "lowest sentence's); \"tokens\" adds tokenConfidence too (each piece's probability)"
        ),
    )
    min_confidence: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Extension: sentences below this confidence are flagged (default NMT_MIN_CONFIDENCE)",
    )
    low_confidence: Literal["flag", "withhold"] = Field(
        "flag", description='Extension: "withhold" answers sentences below min_confidence with ""'
    )

    _glossary = field_validator("glossary", mode="before")(glossary_from_json_text)

    @field_validator("alternatives", "beam_size", mode="before")
    @classmethod
    def not_a_boolean(cls, value: Any) -> Any:
        """``true`` is not a number of alternatives (pydantic would read it as 1); a form's "2" is."""
        if isinstance(value, bool):
            raise ValueError("must be an integer, not a boolean")
        return value

    @property
    def texts(self) -> list[str]:
        """``q`` as a list, whatever its shape."""
        return [self.q] if isinstance(self.q, str) else list(self.q)

    @property
    def is_batch(self) -> bool:
        return isinstance(self.q, list)


class DetectRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    q: str = Field(min_length=1, description="Text whose language to detect")
    api_key: str | None = None


class TranslateFileResponse(BaseModel):
    translatedFileUrl: str = Field(description="GET it for the translated file (once, then it is deleted)")
    # Only where a threshold applies (``min_confidence`` or NMT_MIN_CONFIDENCE).
    lowConfidence: int | None = Field(
        None, description="Extension: sentences below min_confidence, flagged for review in the file"
    )


class FrontendSettings(BaseModel):
    """LibreTranslate's /frontend/settings: what a front end needs to configure itself."""

    charLimit: int
    frontendTimeout: int = Field(description="Milliseconds of quiet typing before translating")
    apiKeys: bool
    keyRequired: bool
    suggestions: bool
    filesTranslation: bool
    supportedFilesFormat: list[str]
    filesFormats: list[FileFormatName] = Field(description="The formats by name, for a page to list")
    language: DefaultLanguages


class FileFormatName(BaseModel):
    name: str
    extensions: list[str]


class LanguageName(BaseModel):
    code: str
    name: str


class DefaultLanguages(BaseModel):
    source: LanguageName  # "auto" where detection is offered
    target: LanguageName


class TokenConfidence(BaseModel):
    token: str = Field(description='A SentencePiece piece of the translation ("\u2581" starts a word)')
    probability: float = Field(description="The probability the model gave it, 0-1")


class SentenceConfidence(BaseModel):
    """A sentence of the text: ``translatedText[start:end]``, and its confidence."""

    start: int = Field(description="Character offset into the text's translatedText")
    end: int = Field(description="End offset, exclusive")
    confidence: float


class LowConfidence(BaseModel):
    sentences: int = Field(description="Sentences of the text whose confidence is below the threshold")
    withheld: bool = Field(description='They were answered with "" (low_confidence: withhold)')
    threshold: float


class TranslateResponse(BaseModel):
    """Mirrors the shape of ``q``: a string in, strings out; a list in, lists out."""

    translatedText: str | list[str]  # LibreTranslate's camelCase field names
    alternatives: list[str] | list[list[str]] | None = None  # present only when asked for
    detectedLanguage: DetectedLanguage | list[DetectedLanguage] | None = None
    # Only when terminology decided something (per text of a list: null where nothing was).
    terminology: Terminology | list[Terminology | None] | None = None
    # Only when asked for (``confidence``); null for a text no model translated.
    confidence: float | None | list[float | None] = None
    alternativesConfidence: list[float | None] | list[list[float | None]] | None = None
    sentenceConfidence: list[SentenceConfidence] | list[list[SentenceConfidence]] | None = None
    tokenConfidence: list[TokenConfidence] | list[list[TokenConfidence]] | None = None
    # Only where a threshold applies (``min_confidence`` or NMT_MIN_CONFIDENCE).
    lowConfidence: LowConfidence | list[LowConfidence] | None = None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class Language(BaseModel):
    code: str
    name: str
    targets: list[str]


class ErrorResponse(BaseModel):
    error: str


class BadRequestResponse(ErrorResponse):
    """400: ``error`` is LibreTranslate's message where it has one ("Invalid request: missing q
    parameter", "zz is not supported"); an unsupported language adds the pairs that are served."""

    supportedPairs: list[str] | None = Field(
        None, description='With an unsupported language or pair: the served pairs ("fr->de (via en)")'
    )


class ValidationErrorResponse(BaseModel):
    """422: ``error`` names the fields in one line; ``detail`` is FastAPI's usual list."""

    error: str
    detail: list[dict[str, Any]]


class StatusResponse(BaseModel):
    """/health when ready: LibreTranslate's body, exactly."""

    status: str = Field(description='"ok"')


class HealthResponse(BaseModel):
    status: str
    model: str | None = Field(None, description="The served models' names, comma-separated")
    device: str | None = None


class NotReadyResponse(BaseModel):
    status: str  # "loading" or "error"
    error: str
