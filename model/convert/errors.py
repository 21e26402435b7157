"""The one error a converter raises: the input is not what it claims, or uses an option we lack."""

from __future__ import annotations

from model.directory import ModelDirError


class ConversionError(ModelDirError):
    """The message names the file and the problem; nothing has been written to the output."""
