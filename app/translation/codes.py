"""Language codes and names, and the languages served (the routes of ``app.serving.frontend.router``)."""

from __future__ import annotations

from typing import Any

from app.serving.frontend.router import Router

# ISO 639-1 codes of the languages most often trained; anything else is shown by its code.
LANGUAGE_NAMES = {
    "ar": "Arabic",
    "bg": "Bulgarian",
    "ca": "Catalan",
    "cs": "Czech",
    "da": "Danish",
    "de": "German",
    "el": "Greek",
    "en": "English",
    "es": "Spanish",
    "et": "Estonian",
    "fa": "Persian",
    "fi": "Finnish",
    "fr": "French",
    "ga": "Irish",
    "he": "Hebrew",
    "hi": "Hindi",
    "hr": "Croatian",
    "hu": "Hungarian",
    "id": "Indonesian",
    "it": "Italian",
    "ja": "Japanese",
    "ko": "Korean",
    "lt": "Lithuanian",
    "lv": "Latvian",
    "ms": "Malay",
    "nb": "Norwegian Bokmål",
    "nl": "Dutch",
    "no": "Norwegian",
    "pl": "Polish",
    "pt": "Portuguese",
    "ro": "Romanian",
    "ru": "Russian",
    "sk": "Slovak",
    "sl": "Slovenian",
    "sq": "Albanian",
    "sr": "Serbian",
    "sv": "Swedish",
    "th": "Thai",
    "tr": "Turkish",
    "uk": "Ukrainian",
    "ur": "Urdu",
    "vi": "Vietnamese",
    "zh": "Chinese",
}


def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code.lower(), code)


def served_pairs(router: Router[Any]) -> list[tuple[str, str]]:
    """The (source, target) pairs the service translates, every route of every model (direct,
    then through English): the one place that says so, for /languages, the page's pickers, the
    checks of /translate and the candidates of detection."""
    return router.pairs


def source_languages(router: Router[Any], target: str | None = None) -> list[str]:
    """The languages the service translates from (into ``target``, if given), in served order:
    what language identification chooses among for ``source: "auto"`` and /detect."""
    codes = [s for s, t in served_pairs(router) if target is None or t.lower() == target.lower()]
    return list(dict.fromkeys(codes))


def target_languages(router: Router[Any]) -> list[str]:
    return list(dict.fromkeys(t for _, t in served_pairs(router)))


def languages(router: Router[Any]) -> list[dict[str, object]]:
    """LibreTranslate's /languages list: every served language with the targets it translates into
    (those reached through English included)."""
    pairs = served_pairs(router)
    codes = list(dict.fromkeys(code for pair in pairs for code in pair))
    return [
        {"code": code, "name": language_name(code), "targets": [t for s, t in pairs if s == code]}
        for code in codes
    ]


def supported_pairs(router: Router[Any]) -> str:
    """``de->en, en->de, fr->de (via en)``: for error messages."""
    return ", ".join(route.describe() for route in router.routes)
