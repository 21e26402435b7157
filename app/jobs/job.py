"""A document job as the store keeps it: its options, and its row as listed, polled and claimed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

State = Literal["queued", "reading", "translating", "writing", "done", "failed", "cancelled"]
RUNNING: tuple[State, ...] = ("reading", "translating", "writing")
FINAL: tuple[State, ...] = ("done", "failed", "cancelled")


@dataclass(frozen=True)
class JobOptions:
    """What decides the translation besides the file and the languages."""

    glossary: list[tuple[str, str]] = field(default_factory=list)  # resolved when the job was made
    protect_placeholders: bool = True
    beam_size: int = 5
    # Sentences below this confidence are flagged for review in the translated file (None: none).
    min_confidence: float | None = None

    def encoded(self) -> bytes:
        options = {
            "glossary": self.glossary,
            "protect_placeholders": self.protect_placeholders,
            "beam_size": self.beam_size,
            "min_confidence": self.min_confidence,
        }
        return json.dumps(options, ensure_ascii=False).encode()

    @classmethod
    def decoded(cls, text: str | bytes) -> JobOptions:
        options = json.loads(text)
        return cls(
            [(s, t) for s, t in options["glossary"]],
            options["protect_placeholders"],
            options["beam_size"],
            options.get("min_confidence"),  # (absent from the options of a job made before it existed)
        )


@dataclass(frozen=True)
class Job:
    """A job as listed and polled (without its options: ``ClaimedJob``)."""

    id: str
    owner: str
    name: str
    source: str
    target: str
    state: State
    language: str | None
    done: int
    total: int | None
    error_status: int | None
    error: str | None
    notes: tuple[str, ...]
    created: float  # time.time()
    finished: float | None
    expires: float | None
    result_name: str | None
    chars: int | None  # of its text, once read: what its owner was charged

    @classmethod
    def of(cls, row: Sequence[Any]) -> Job:
        values = list(row)
        values[11] = tuple(json.loads(values[11]))
        return cls(*values)


@dataclass(frozen=True)
class ClaimedJob(Job):
    """A job as the runner that claimed it has it: with its options."""

    options: JobOptions

    @classmethod
    def with_options(cls, job: Job, options: JobOptions) -> ClaimedJob:
        return cls(**{f.name: getattr(job, f.name) for f in fields(Job)}, options=options)
