"""What the translation use case answers beside the translated text: the language it detected, and
what terminology decided (a term placed, a sentence from the translation memory).

Pydantic models, not HTTP ones: the LibreTranslate response (``app.http.schemas``) nests them as
they are, and their descriptions are the OpenAPI document's.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class DetectedLanguage(BaseModel):
    confidence: float = Field(description="Percent, 0-100")
    language: str


class TermMark(BaseModel):
    """A term a glossary or placeholder decided: ``translatedText[start:end] == target``."""

    source: str = Field(description="As it is in the source text")
    target: str
    start: int = Field(description="Character offset into the text's translatedText")
    end: int = Field(description="End offset, exclusive")


class Span(BaseModel):
    """A stretch of a text's translatedText: ``translatedText[start:end]``."""

    start: int = Field(description="Character offset into the text's translatedText")
    end: int = Field(description="End offset, exclusive")


class Terminology(BaseModel):
    memory: bool = Field(description="Some sentence of the text came from the key's translation memory")
    terms: list[TermMark]
    # Absent unless ``memory``: the page marks these sentences as it marks terms.
    segments: list[Span] | None = Field(
        None, description="Where the sentences answered from the translation memory are (when memory is true)"
    )
