"""The batch-first ``Translator`` under its first name (``model.decoding.translator``)."""

from model.decoding.translator import (
    DTYPES,
    QUANTIZATIONS,
    TranslationResult,
    Translator,
    resolve_device,
    resolve_dtype,
)

__all__ = ["DTYPES", "QUANTIZATIONS", "TranslationResult", "Translator", "resolve_device", "resolve_dtype"]
