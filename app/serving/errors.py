"""Why a translation was not served; the API maps each to its status code
(app.translation.sentences.engine_error)."""

from __future__ import annotations


class EngineError(Exception):
    """A sentence the service could not translate."""


class QueueFull(EngineError):
    """Every worker has as many sentences in flight as it may: the client should retry later."""


class TooLarge(EngineError):
    """More sentences in one request than a worker may ever hold: retrying will not help."""


class DeadlineExceeded(EngineError):
    """The request's deadline passed before all its sentences were translated."""


class EngineStopped(EngineError):
    """No worker can take the request (starting up, shutting down, or failed)."""
