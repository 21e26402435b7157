"""Why a translation was refused, in the use case's own words: no HTTP status here. The HTTP edge
gives each kind its status in one table (``app.http.errors.TRANSLATION_STATUS``); a document job records
the same status as its answer (``app.jobs.runner``)."""

from __future__ import annotations


class TranslationError(Exception):
    """A translation refused. ``retry_after``: seconds after which the same request may succeed,
    where waiting helps (a full queue, a store restarting)."""

    retry_after: str | None = None

    def __init__(self, message: str, *, retry_after: str | None = None) -> None:
        super().__init__(message)
        if retry_after is not None:
            self.retry_after = retry_after


class Invalid(TranslationError):
    """The request cannot be translated as it was sent (a parameter missing or out of range, text
    that is not UTF-8, HTML that cannot be read)."""


def missing_parameter(name: str) -> Invalid:
    """LibreTranslate's words for a request without ``name`` (clients compare them)."""
    return Invalid(f"Invalid request: missing {name} parameter")


class Unsupported(Invalid):
    """A language, or a pair, that no served model translates; ``supported``: the pairs served."""

    def __init__(self, message: str, supported: list[str]) -> None:
        super().__init__(message)
        self.supported = supported


class TooLarge(TranslationError):
    """Past a limit: too many texts, characters, sentences, or a sentence's terms."""


class Busy(TranslationError):
    """Every queue full: the same request succeeds later (``retry_after``)."""


class Unavailable(TranslationError):
    """What the translation needs is not running now: the engine, or the translation memory."""


class TimedOut(TranslationError):
    """The translation did not finish within its time."""
