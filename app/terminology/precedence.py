"""Who answers each sentence of a request: the translation memory, the segment cache or the model.

The order is the issue's: memory > glossary > model. A sentence the key's memory holds (exactly,
whitespace aside) is answered with the memory's text, whatever glossary the request names: the
team translated that sentence, terms included. Every other sentence is the model's, decoded with
the glossary's constraints; the cache of recent translations is asked first, under a key that the
caller makes of everything that decides the model's answer (the model route, beam size, n-best,
the constraints, the sentence), so that a cached answer is exactly what decoding would give. A
sentence that occurs twice in one request (under one key) is decoded once.

Torch-free and independent of HTTP: the caller (``app/http/endpoints/translate.py``) gives the sentences,
their cache keys and the memory's lookup, sends ``Plan.decode`` to the model, and gets each
sentence's ``Answer`` from ``Plan.finish``, which also stores the decoded results in the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.terminology.cache import SegmentCache

V = TypeVar("V")
# The memory's lookup of a request's sentences (one language pair, one owner), e.g.
# ``functools.partial(memory.lookup_many, owner, source_lang, target_lang)``.
Lookup = Callable[[Sequence[str]], Sequence[str | None]]


@dataclass(frozen=True)
class Answer(Generic[V]):
    """One sentence's answer: the memory's text, or the model's result (decoded now or cached)."""

    memory: str | None = None
    result: V | None = None
    cached: bool = False

    @property
    def from_memory(self) -> bool:
        return self.memory is not None


@dataclass
class Plan(Generic[V]):
    """What ``plan`` decided; ``decode`` lists the indices of the sentences the model translates."""

    size: int
    memory: dict[int, str] = field(default_factory=dict)
    cached: dict[int, V] = field(default_factory=dict)
    decode: list[int] = field(default_factory=list)
    # Each sentence the model answers: its cache key, and the index in ``decode`` of the sentence
    # whose decoding it shares (itself, or an earlier one under the same key).
    keys: dict[int, Hashable] = field(default_factory=dict)
    shares: dict[int, int] = field(default_factory=dict)
    cache: SegmentCache[V] | None = None

    def finish(self, decoded: Sequence[V]) -> list[Answer[V]]:
        """Each sentence's answer, in order, given the model's results for ``decode`` (in its
        order); the decoded results are stored in the cache."""
        if len(decoded) != len(self.decode):
            raise ValueError(f"{len(decoded)} results for {len(self.decode)} sentences decoded")
        if self.cache is not None:
            for index, result in zip(self.decode, decoded, strict=True):
                self.cache.put(self.keys[index], result)
        answers: list[Answer[V]] = []
        for i in range(self.size):
            if i in self.memory:
                answers.append(Answer(memory=self.memory[i]))
            elif i in self.cached:
                answers.append(Answer(result=self.cached[i], cached=True))
            else:
                answers.append(Answer(result=decoded[self.shares[i]]))
        return answers


def plan(
    sentences: Sequence[str],
    keys: Sequence[Hashable],
    *,
    lookup: Lookup | None = None,
    cache: SegmentCache[V] | None = None,
) -> Plan[V]:
    """Decide who answers each of ``sentences`` (``keys[i]``: sentence i's cache key). ``lookup``
    None: no memory for this request (none stored, or the caller's choice); ``cache`` None or
    disabled: every sentence not in the memory is decoded."""
    if len(keys) != len(sentences):
        raise ValueError(f"{len(keys)} cache keys for {len(sentences)} sentences")
    result: Plan[V] = Plan(len(sentences), cache=cache if cache is not None and cache.enabled else None)
    found = list(lookup(sentences)) if lookup is not None and sentences else [None] * len(sentences)
    first: dict[Hashable, int] = {}  # cache key -> its index in result.decode
    for i, key in enumerate(keys):
        if found[i] is not None:
            result.memory[i] = str(found[i])
            continue
        result.keys[i] = key
        if key in first:  # the same sentence again in this request: decoded once
            result.shares[i] = first[key]
            continue
        hit = result.cache.get(key) if result.cache is not None else None
        if hit is not None:
            result.cached[i] = hit
            continue
        first[key] = len(result.decode)
        result.shares[i] = first[key]
        result.decode.append(i)
    return result
