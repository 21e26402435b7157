"""Language codes and names for /languages (the model directory stores codes only)."""

from __future__ import annotations

from model.checkpoint import ModelInfo

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


def languages(info: ModelInfo) -> list[dict[str, object]]:
    """LibreTranslate's /languages list for the one pair a model directory serves."""
    source, target = info.source_lang, info.target_lang
    if source == target:  # e.g. a monolingual rewriting model: one entry, not a duplicate code
        return [{"code": source, "name": language_name(source), "targets": [target]}]
    return [
        {"code": source, "name": language_name(source), "targets": [target]},
        {"code": target, "name": language_name(target), "targets": []},
    ]


def supported_pairs(info: ModelInfo) -> str:
    return f"{info.source_lang}->{info.target_lang}"
