"""A request's sentences along their routes (``app.serving.frontend.router``), through the scheduler.

A direct route is one scheduler request to its model's workers. A pivot is two, one after the
other: the first model's best translation of each sentence (text, decoded with its vocabulary)
is the second model's input (tokenized with the second's vocabulary), sentence by sentence, so
that a text keeps its sentence boundaries and its layout. The first hop searches with the
request's beam for one hypothesis; the alternatives asked for are the second hop's. One deadline
covers both hops.

The sentences of one request may take different routes (``source: "auto"`` detects each text's
language): each route's sentences are one scheduler request, all submitted at once, so that a
request is admitted or refused whole; its second hops are never refused for a full queue (their
sentences were counted when the request was admitted).

Terminology (``terms``: per sentence, the target strings its translation must contain) constrains
the last hop only: a pivot's English in between is nobody's output, and the terms are in the
target language.

Confidence (``model.decoding.confidence``): each hop's model calibrates its own hypotheses
(``ServedModel.render``); a pivot's is the lower of its two hops' (the best English's, and each
final hypothesis's): a confident second hop cannot vouch for a wrong English. Each sentence's
best confidence is recorded in its last model's ``nmt_sentence_confidence`` histogram.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

from app.models.served import ServedModel
from app.serving.errors import DeadlineExceeded
from app.serving.frontend.router import Route
from app.serving.frontend.scheduler import Request, Scheduler
from app.serving.protocol import Confidence, SentenceResult
from model.decoding.options import nonblank


class Translation:
    """Sentences on their way: submitted when made (``QueueFull``, ``TooLarge`` or
    ``EngineStopped`` raised then, nothing left behind); ``result()`` waits for each sentence's
    n-best texts; ``withdraw()`` drops whatever is not finished (call it once done, whatever the
    outcome)."""

    def __init__(
        self,
        scheduler: Scheduler,
        sentences: Sequence[str],
        routes: Sequence[Route[ServedModel]],
        *,
        beam_size: int,
        n_best: int,
        timeout_s: float,
        terms: Sequence[Sequence[str]] | None = None,
        background: bool = False,
        confidence: bool = False,
        pieces: bool = False,
    ) -> None:
        """``confidence``: every hop's token log-probs asked for (greedy search computes them then;
        beams carry them anyway), so that each result has its ``confidence``; ``pieces``: with each
        piece's probability (``Confidence.tokens``)."""
        self.scheduler = scheduler
        self.background = background
        self.confidence, self.pieces = confidence or pieces, pieces
        self.terms: Sequence[Sequence[str]] = terms if terms is not None else [()] * len(sentences)
        self.beam_size, self.n_best, self.timeout_s = beam_size, n_best, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.size = len(sentences)
        self.requests: list[Request] = []  # every scheduler request made for it, hop after hop
        groups: dict[tuple[str, str], tuple[Route[ServedModel], list[int]]] = {}
        for i, route in enumerate(routes):
            groups.setdefault((route.source, route.target), (route, []))[1].append(i)
        self._legs: list[tuple[Route[ServedModel], list[int], Request]] = []
        try:
            for route, indices in groups.values():
                first = self._submit(
                    route,
                    0,
                    [sentences[i] for i in indices],
                    admitted=False,
                    terms=[self.terms[i] for i in indices],
                )
                self._legs.append((route, indices, first))
        except BaseException:
            self.withdraw()
            raise

    def _submit(
        self,
        route: Route[ServedModel],
        hop: int,
        texts: list[str],
        *,
        admitted: bool,
        terms: Sequence[Sequence[str]] = (),
    ) -> Request:
        """``terms``: each text's, used on the route's last hop only."""
        step = route.hops[hop]
        last = hop == len(route.hops) - 1
        constraints = [step.model.constraints(t) for t in terms] if last and any(terms) else None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"not translated within {self.timeout_s:g} s")
        request = self.scheduler.submit(
            step.model.source_ids(texts, step.target),
            beam_size=self.beam_size,
            n_best=self.n_best if last else 1,
            timeout_s=remaining,
            model=step.model.name,
            admitted=admitted,
            constraints=constraints,
            background=self.background,
            scored=self.confidence,
        )
        self.requests.append(request)
        return request

    async def result(self) -> list[SentenceResult]:
        """The n-best translations of every sentence, in order, with where its terms were put
        (the first failure is raised)."""
        out: list[SentenceResult] = [SentenceResult(()) for _ in range(self.size)]
        legs = await asyncio.gather(
            *(
                self._follow(route, first, [self.terms[i] for i in indices])
                for route, indices, first in self._legs
            )
        )
        for (_, indices, _), rendered in zip(self._legs, legs, strict=True):
            for i, one in zip(indices, rendered, strict=True):
                out[i] = one
        return out

    async def _follow(
        self, route: Route[ServedModel], first: Request, terms: Sequence[Sequence[str]]
    ) -> list[SentenceResult]:
        """One route's sentences through its hops: each hop's best translations are the next's
        input (a blank one stays blank, without model work, as a blank sentence does)."""
        hops = len(route.hops)
        results = await first.future
        rendered = route.hops[0].model.render(
            results, terms if hops == 1 else (), pieces=self.pieces and hops == 1
        )
        request = first
        for hop in range(1, hops):
            last = hop == hops - 1
            inputs = [one.texts[0] for one in rendered]
            before = [one.confidence[0] if one.confidence else None for one in rendered]
            rendered = [SentenceResult.of_texts([""] * (self.n_best if last else 1)) for _ in inputs]
            todo = nonblank(inputs)
            if not todo:
                continue
            mine = [terms[i] for i in todo] if last else []
            request = self._submit(route, hop, [inputs[i] for i in todo], admitted=True, terms=mine)
            model = route.hops[hop].model
            found = model.render(await request.future, mine, pieces=self.pieces and last)
            for i, one in zip(todo, found, strict=True):
                rendered[i] = lowest(one, before[i])
        values = [one.confidence[0].value for one in rendered if one.confidence]
        if values and request.model.metrics is not None:
            for value in values:
                request.model.metrics.confidence.observe(value)
        return rendered

    def withdraw(self) -> None:
        for request in self.requests:
            self.scheduler.withdraw(request)


def lowest(result: SentenceResult, before: Confidence | None) -> SentenceResult:
    """A pivot's second hop's ``result`` with each hypothesis's confidence at most the first hop's
    (``before``: its best English's; None: the first hop had none, nor then has the pivot)."""
    if not result.confidence:
        return result
    if before is None:
        return replace(result, confidence=())
    lowered = tuple(replace(c, value=min(c.value, before.value)) for c in result.confidence)
    return replace(result, confidence=lowered)
