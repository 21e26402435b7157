"""The models a worker process has opened, shared by its workers (decoding threads): a model's
weights are read, packed and quantized once per process, however many of its workers hold it.

A worker that opens a model another worker of the process holds gets a ``Translator`` of its own
on the same weights (``open_translator(like=...)``): its own decoding step (a compiled step's
package loaded again and handed the same tensors; no weight copied) and its own caches, so that
the workers never share anything that a step writes. Two workers opening one model at once: the
second waits for the first's weights, then makes its own step.

What is kept is a weak reference: a model leaves memory when the last worker holding it evicts it
(``app.serving.worker.models.ModelTable``), as it did with a worker per process.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from app.serving.protocol import ModelSpec
from model.decoding.translator import Translator

# Opens ``spec``: on weights of its own (``like`` None), or on those of ``like`` (a Translator of the
# same model that another worker of the process holds).
SharedOpener = Callable[[ModelSpec, Translator | None], Translator]


class SharedModels:
    """``open(spec)``: ``spec``'s model for the calling worker, on the weights the process already
    holds where another worker holds it."""

    def __init__(self, opener: SharedOpener) -> None:
        self.opener = opener
        self._held: dict[str, list[weakref.ref[Translator]]] = {}  # by model: every worker's
        self._locks: dict[str, threading.Lock] = {}  # by model: one open at a time
        self._lock = threading.Lock()  # of the two dicts

    def open(self, spec: ModelSpec) -> Translator:
        with self._lock:
            opening = self._locks.setdefault(spec.name, threading.Lock())
        with opening:
            like = self.holding(spec.name)
            translator = self.opener(spec, like)
            with self._lock:
                alive = [r for r in self._held.get(spec.name, []) if r() is not None]
                self._held[spec.name] = [*alive, weakref.ref(translator)]
            return translator

    def holding(self, name: str) -> Translator | None:
        """A Translator of ``name`` that some worker of the process holds, if any."""
        with self._lock:
            for ref in self._held.get(name, []):
                translator = ref()
                if translator is not None:
                    return translator
        return None
