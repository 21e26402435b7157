"""Routing: which model (or models) a (source, target) pair goes through.

Every model serves the directions its directory lists (``ModelInfo.directions``: one for a
bilingual model, several for a multilingual one, which is asked for a target by the tokens
``model.directory.source_prefix`` puts first). A pair is served

- **directly** by the first model (in ``NMT_MODEL_DIR``'s order) that lists it: one hop;
- else **through English** (``PIVOT``) when some model serves source->en and some model en->target:
  two hops, the first hop's translations being the second hop's input, sentence by sentence.

No other pivots, and never more than two hops: each hop loses a little, and English is what the
training data of such models is aligned on (Multi30k's languages all are). Plain Python over the
models' metadata; the models are whatever the caller serves (``app.models.served.ServedModel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from model.directory import ModelInfo

PIVOT = "en"


class Routable(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def info(self) -> ModelInfo: ...


M = TypeVar("M", bound=Routable)


@dataclass(frozen=True)
class Hop(Generic[M]):
    """One model's part of a route: translate into ``target`` (``source_prefix(model.info, target)``
    asks a multilingual model for it)."""

    model: M
    source: str
    target: str


@dataclass(frozen=True)
class Route(Generic[M]):
    source: str
    target: str
    hops: tuple[Hop[M], ...]  # one (direct) or two (through ``PIVOT``)

    @property
    def pivot(self) -> str | None:
        """The language between the hops, or None for a direct route."""
        return self.hops[0].target if len(self.hops) > 1 else None

    def describe(self) -> str:
        """``de->en``, or ``fr->de (via en)``."""
        return f"{self.source}->{self.target}" + (f" (via {self.pivot})" if self.pivot else "")


class Router(Generic[M]):
    """The routes of every pair the models serve, directly or through English."""

    def __init__(self, models: Sequence[M]) -> None:
        if not models:
            raise ValueError("no models to route to")
        self.models = list(models)
        direct: dict[tuple[str, str], Hop[M]] = {}
        for model in self.models:
            for source, target in model.info.directions:
                direct.setdefault((source, target), Hop(model, source, target))  # the first one listed
        routes = {pair: Route(*pair, (hop,)) for pair, hop in direct.items()}
        for (source, middle), first in direct.items():
            for (start, target), second in direct.items():
                pair = (source, target)
                if middle == start == PIVOT and source != target and pair not in routes:
                    routes[pair] = Route(source, target, (first, second))
        self.routes: list[Route[M]] = list(routes.values())  # direct routes first, in the models' order
        # Language codes are looked up without regard to case ("DE" is "de"): the case of an ISO 639
        # code means nothing, and clients send either.
        self._index = {(r.source.lower(), r.target.lower()): r for r in self.routes}

    def route(self, source: str, target: str) -> Route[M] | None:
        """The route of (``source``, ``target``), or None when it is not served."""
        return self._index.get((source.lower(), target.lower()))

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """Every served (source, target) pair, direct ones first."""
        return [(r.source, r.target) for r in self.routes]

    @property
    def direct(self) -> list[Route[M]]:
        return [r for r in self.routes if r.pivot is None]

    @property
    def pivots(self) -> list[Route[M]]:
        return [r for r in self.routes if r.pivot is not None]
