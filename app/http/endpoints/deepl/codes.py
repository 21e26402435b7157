"""DeepL's language codes and the service's: a plain mapping (no torch, no HTTP).

DeepL writes a language upper-case (``DE``), and some targets only with their variant (``EN-GB``,
``EN-US``, ``PT-BR``, ``PT-PT``), which it requires: a client sends ``EN-US``, never ``EN``. The
service's codes are its models' (ISO 639-1, lower-case: ``en``, ``de``), and a model translates
into a language, not into one of its variants. So a DeepL code is the served code it names (the
whole code where a model serves it, as ``pt-br``; else its primary subtag: ``EN-US`` is ``en``),
and a served ``en`` or ``pt`` is listed as DeepL's two variants, each translated by the same model.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.translation.codes import language_name

# Served targets that DeepL lists only as their variants, with DeepL's names for them.
TARGET_VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {
    "en": (("EN-GB", "English (British)"), ("EN-US", "English (American)")),
    "pt": (("PT-BR", "Portuguese (Brazilian)"), ("PT-PT", "Portuguese (European)")),
}


def deepl_code(code: str) -> str:
    """A served code as DeepL writes it: ``de`` -> ``DE``, ``pt_br`` -> ``PT-BR``."""
    return code.replace("_", "-").upper()


def served_code(code: str, served: Sequence[str]) -> str:
    """The served code that DeepL's ``code`` names: the whole code where it is served (``PT-BR`` ->
    ``pt-br``), else its primary subtag (``EN-US`` -> ``en``). A code that names nothing served is
    given as its primary subtag, lower-case: the use case refuses it in its own words (400)."""
    wanted = code.strip().replace("_", "-").lower()
    by_code = {s.replace("_", "-").lower(): s for s in served}
    if wanted in by_code:
        return by_code[wanted]
    primary = wanted.split("-", 1)[0]
    return by_code.get(primary, primary)


def source_entries(codes: Sequence[str]) -> list[dict[str, object]]:
    """DeepL's list of source languages: ``[{"language": "DE", "name": "German"}]``."""
    return [{"language": deepl_code(code), "name": language_name(code)} for code in codes]


def target_entries(codes: Sequence[str]) -> list[dict[str, object]]:
    """DeepL's list of target languages, ``en`` and ``pt`` as their variants. No model here takes
    a formality, so none ``supports_formality`` (a request's ``formality`` is ignored, as DeepL
    ignores ``prefer_more`` for such a language)."""
    entries: list[dict[str, object]] = []
    own = {deepl_code(code) for code in codes}  # a variant a model serves itself is listed as its own
    for code in codes:
        variants = [(c, name) for c, name in TARGET_VARIANTS.get(code.lower(), ()) if c not in own]
        named = variants or [(deepl_code(code), language_name(code))]
        entries += [{"language": c, "name": name, "supports_formality": False} for c, name in named]
    return entries
