"""Which model route translates a request's texts: the pair checked against what is served, a
source of "auto" detected among the languages that reach the target."""

from __future__ import annotations

from collections.abc import Sequence

from app.models.served import ServedModel
from app.serving.frontend.router import Route, Router
from app.translation.codes import language_name, served_pairs, source_languages
from app.translation.errors import Unsupported, missing_parameter
from app.translation.langid import detect
from app.translation.results import DetectedLanguage

AUTO = "auto"


def clip(value: str, limit: int = 32) -> str:
    """A user-supplied value cut for an error message, so that messages stay small."""
    return value if len(value) <= limit else value[:limit] + "..."


def shorten(value: str, limit: int = 32) -> str:
    """A user-supplied value quoted for an error message, cut so that messages stay small."""
    return repr(clip(value, limit))


def unsupported(message: str, router: Router[ServedModel]) -> Unsupported:
    """A refusal in LibreTranslate's words, which clients compare exactly; the served pairs, which
    it does not name, go beside them."""
    return Unsupported(message, [route.describe() for route in router.routes])


def check_languages(source: str, target: str, router: Router[ServedModel]) -> list[str]:
    """``Unsupported`` unless (``source``, ``target``) is served, directly or through English
    (``source`` may be "auto"); the served source languages it stands for (one, or every source
    language translated into ``target``).

    The messages are LibreTranslate's: in its order (source, then target), "zz is not supported"
    for a code the service does not know at all, and "German (de) is not available as a target
    language from English (en)" for two it knows but no route joins."""
    if not source:
        raise missing_parameter("source")
    if not target:
        raise missing_parameter("target")
    known = {code.lower(): code for pair in served_pairs(router) for code in pair}
    auto = source.lower() == AUTO
    for code in ([] if auto else [source]) + [target]:
        if code.lower() not in known:
            raise unsupported(f"{clip(code)} is not supported", router)

    def named(code: str) -> str:
        served = known[code.lower()]
        return f"{language_name(served)} ({served})"

    candidates = source_languages(router, target)
    if auto:
        if not candidates:
            raise unsupported(f"{named(target)} is not available as a target language", router)
        return candidates
    chosen = [code for code in candidates if code.lower() == source.lower()]
    if not chosen:
        message = f"{named(target)} is not available as a target language from {named(source)}"
        raise unsupported(message, router)
    return chosen


def source_language(text: str, candidates: Sequence[str]) -> DetectedLanguage:
    """The language of ``text`` among ``candidates``: the only one, or the identifier's best."""
    best = detect(text, candidates)[0]
    return DetectedLanguage(confidence=best.confidence, language=best.language)


def route_of(router: Router[ServedModel], source: str, target: str) -> Route[ServedModel]:
    """The route of a pair ``check_languages`` let through (or a language it detected)."""
    route = router.route(source, target)
    if route is None:  # pragma: no cover - check_languages refused it before
        raise unsupported(f"{source}->{target} is not served", router)
    return route
