"""The choice of tokens: a step's candidates in, each input's next tokens out.

Each input's search state is a ``Beam`` (``model.decoding.beam``; greedy is a beam of one).
``Search.step`` takes what a decoding step chose on the device (``model.runtime.step.StepChoice``:
every row's argmax, and the best candidates of the rows that asked for them) and advances a list of
beams by one token, whatever their sizes and however many steps each has taken: the same code
serves a batch decoded from start to end and the service's running batch that inputs join and
leave at any step.

Inputs without constraints or the repetition guard are searched on the device instead
(``Search.step_rows``, ``model.decoding.device_search``): the same rules as tensor ops, nothing read
back per step; ``Beam`` stays their reference, and the path of the inputs that need Python.

An input with constraints (``model.decoding.constraints``) keeps a ``ConstraintState`` per beam and
is advanced by dynamic beam allocation (``Beam.advance_constrained``), from the same step's
candidates plus the log-probs of the tokens it forced (``Search.forced``); inputs without
constraints never reach that code, and pay for it only an attribute check.

An input with an output prefix (``model.decoding.prefix``) takes the prefix's tokens first
(``Beam.force``), then searches as any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from model.decoding.beam import Beam, banned_tokens, length_normalized
from model.decoding.constraints import ConstraintSet
from model.decoding.device_search import Found, Group, SearchRows, advance
from model.decoding.hypothesis import Hypothesis
from model.decoding.prefix import drop_secondary_eos
from model.runtime.step import StepChoice


@dataclass(frozen=True)
class Search:
    """Chooses each input's next tokens from a step's choice (fairseq's ``Search.step`` contract:
    scores in, chosen tokens and their beams out), and owns every rule of that choice: beams,
    length limits, the repetition guard."""

    eos: int
    length_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    # Greedy hypotheses' scores: their log-probs (the step then normalizes greedy rows too) or 0.0
    # (the service, which does not return them: the argmax alone decides).
    greedy_scores: bool = True

    def wants_candidates(self, beam: Beam) -> bool:
        """Whether ``beam``'s rows need their best candidates from the step (``beam_rows``)."""
        return (
            self.wants_rows(beam.k)
            or beam.scored
            or self.no_repeat_ngram_size > 0
            or beam.constraints is not None
        )

    def on_device(self, constraints: ConstraintSet | None) -> bool:
        """Whether an input's search state lives on the device (``model.decoding.device_search``):
        without constraints or the repetition guard, whose rules need Python at every step."""
        return constraints is None and self.no_repeat_ngram_size <= 0

    def wants_rows(self, k: int) -> bool:
        """``wants_candidates`` for the inputs on the device, of beam size ``k``."""
        return k > 1 or self.greedy_scores

    def step_rows(
        self, rows: SearchRows, groups: list[Group], step: StepChoice, tokens: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """``step`` for the inputs on the device: the same rules (``Beam.advance``, ``Beam.extend``)
        as tensor ops over all of them, reading nothing back (``device_search.advance``); their
        next tokens go into ``tokens`` (by cache row). Returns the beams' cache reorder (dst, src)."""
        return advance(rows, groups, step, tokens, eos=self.eos)

    def results(self, found: list[Found], n_best: int, scored: bool = True) -> list[Hypothesis]:
        """An input's n-best, best first, from its finished hypotheses as read back from the device
        (in the order they ended, as ``Beam.finished``; normalized here, in Python, as ``advance``).
        ``scored``: whether its rows kept token log-probs (an unscored greedy input's are not)."""
        hyps = [
            Hypothesis(
                tokens,
                length_normalized(lprob, length, self.length_penalty),
                lprob,
                token_log_probs=tuple(lprobs) if scored else (),
            )
            for tokens, lprob, length, lprobs in found
        ]
        return sorted(hyps, key=lambda h: h.score, reverse=True)[:n_best]

    def forced(self, beams: list[Beam]) -> list[list[int]]:
        """The tokens whose log-probs the step must return (``DecodeStep``'s ``forced``) for each
        row that ``wants_candidates``, in ``step``'s order: each live constrained beam's ``allowed``
        tokens (whatever their rank), none for other rows; padded with pad (0) to one width, at
        least 2 (``torch.compile`` would specialize a width of 1, and compile again for more).
        ``step`` reads them back from the beams."""
        rows: list[list[int]] = []
        for b in beams:
            if not self.wants_candidates(b):
                continue
            cs = b.constraints
            if cs is None:
                rows += [[]] * b.k
                continue
            b.forced = [
                cs.allowed(s) if score != -math.inf else []
                for s, score in zip(b.states, b.scores, strict=True)
            ]
            rows += b.forced
        width = max(2, *map(len, rows)) if rows else 2
        return [r + [0] * (width - len(r)) for r in rows]

    def step(self, beams: list[Beam], step: StepChoice) -> tuple[Tensor | None, Tensor]:
        """Advance every beam by one token.

        ``step.choice`` holds every row's argmax, ``beams[0].k`` rows for the first beam, then the
        next beam's, and so on; ``step.top_*`` and ``step.eos_lprob`` hold the candidates of the
        beams that ``wants_candidates``, in the same order (``top`` >= 2K is exact: the best 2K
        extensions of K beams are among each beam's own best 2K).
        Returns the rows to keep for the beams still not done, in that order (``None``: every row
        in place, nothing to reorder), and their next tokens (R',).
        """
        offsets = [0]
        for b in beams:
            offsets.append(offsets[-1] + b.k)
        parents: dict[int, list[int]] = {}
        choice = step.choice.tolist()
        top_at: dict[int, int] = {}  # input -> its first row in step.top_*
        top_rows = 0
        for i, b in enumerate(beams):
            if self.wants_candidates(b):
                top_at[i], top_rows = top_rows, top_rows + b.k
            if b.forcing:  # the output prefix's token, whatever the step chose
                parents[i] = b.force()
            elif i not in top_at:  # the argmax decides; at the limit only eos may come: the hypothesis ends
                token = self.eos if b.at_limit else choice[offsets[i]]
                parents[i] = b.extend(0.0, token, self.eos, self.length_penalty, scored=False)
        guard = self.no_repeat_ngram_size > 0
        greedy = [
            i
            for i in top_at
            if i not in parents and beams[i].k == 1 and not guard and beams[i].constraints is None
        ]
        if greedy:  # the argmax's log-prob is the best candidate's
            rows = torch.tensor([top_at[i] for i in greedy], device=step.top_lprobs.device)
            best = step.top_lprobs.index_select(0, rows)[:, 0].tolist()
            eos_lp = step.eos_lprob.index_select(0, rows).tolist()
            for i, lp, end in zip(greedy, best, eos_lp, strict=True):
                b = beams[i]
                token, lp = (self.eos, end) if b.at_limit else (choice[offsets[i]], lp)
                parents[i] = b.extend(lp, token, self.eos, self.length_penalty)
        by_k: dict[int, list[int]] = {}
        constrained: list[int] = []
        for i in top_at:
            if i not in parents:
                if beams[i].constraints is None:
                    by_k.setdefault(beams[i].k, []).append(i)
                else:
                    constrained.append(i)
        if constrained:
            self._constrained(beams, constrained, top_at, step, parents)
        for k, members in by_k.items():  # one batched top-k per beam size
            cand = self._candidates(beams, members, k, top_at, step)
            if k > 1 and any(beams[i].after_prefix for i in members):
                free = torch.tensor([beams[i].after_prefix for i in members], device=step.choice.device)
                cand = (*drop_secondary_eos(cand[0], cand[1], free, self.eos), cand[2], cand[3])
            for i, s, t, b, lp in zip(members, *(c.tolist() for c in cand), strict=True):
                parents[i] = beams[i].advance(s, t, b, self.eos, self.length_penalty, lp)
        return _next_rows(beams, offsets, parents, step.choice.device)

    def _candidates(
        self, beams: list[Beam], members: list[int], k: int, top_at: dict[int, int], step: StepChoice
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The best 2K extensions of the K beams of each of ``members``: scores, tokens, source
        beams and the tokens' own log-probs, each (A, 2K), best first."""
        device = step.choice.device
        rows = torch.tensor([top_at[i] + j for i in members for j in range(k)], device=device)
        top = step.top_tokens.size(1)
        # (A constrained input's beam may outgrow the step's top, beam_for: it then takes the best
        # of its rows' candidates, and its forced tokens.)
        constrained = beams[members[0]].constraints is not None
        assert top >= 2 * k or constrained, f"{top} candidates per row cannot serve a beam of {k}"
        values = step.top_lprobs.index_select(0, rows).view(len(members), k, top)  # (A, K, top)
        tokens = step.top_tokens.index_select(0, rows).view(len(members), k, top)
        limited = [beams[i].at_limit for i in members]
        if any(limited):  # the last allowed token must be eos (with its own probability)
            at_limit = torch.tensor(limited, device=device)[:, None, None]
            eos_lp = step.eos_lprob.index_select(0, rows).view(len(members), k, 1)
            first = torch.arange(top, device=device) == 0
            values = torch.where(at_limit, torch.where(first, eos_lp, -math.inf), values)
            tokens = torch.where(at_limit, torch.full_like(tokens, self.eos), tokens)
        if self.no_repeat_ngram_size > 0:
            values = self._guard(beams, members, values, tokens)
        scores = torch.tensor([beams[i].scores for i in members], device=device)
        total = (scores[:, :, None] + values).view(len(members), k * top)  # (A, K*top)
        cand_scores, flat = total.topk(min(2 * k, k * top), dim=1)  # (A, 2K)
        cand_tokens = tokens.view(len(members), k * top).gather(1, flat)
        cand_lprobs = values.reshape(len(members), k * top).gather(1, flat)
        return cand_scores, cand_tokens, flat // top, cand_lprobs

    def _constrained(
        self,
        beams: list[Beam],
        members: list[int],
        top_at: dict[int, int],
        step: StepChoice,
        parents: dict[int, list[int]],
    ) -> None:
        """Advance the constrained inputs ``members``: their rows' candidates, eos and forced
        log-probs come to Python once for all of them (only constrained inputs pay for this)."""
        device = step.choice.device
        best: dict[int, list[tuple[float, int, int]]] = {}
        by_k: dict[int, list[int]] = {}
        for i in members:
            by_k.setdefault(beams[i].k, []).append(i)
        for k, group in by_k.items():  # the best 2K extensions, as for unconstrained beams
            scores, tokens, parents_of = (
                c.tolist() for c in self._candidates(beams, group, k, top_at, step)[:3]
            )
            for a, i in enumerate(group):
                best[i] = list(zip(scores[a], tokens[a], parents_of[a], strict=True))
        rows = torch.tensor([top_at[i] + j for i in members for j in range(beams[i].k)], device=device)
        top_lp = step.top_lprobs.index_select(0, rows).tolist()
        top_token = step.top_tokens.index_select(0, rows).tolist()
        eos_lp = step.eos_lprob.index_select(0, rows).tolist()
        forced_lp = None if step.forced_lprobs is None else step.forced_lprobs.index_select(0, rows).tolist()
        at = 0
        for i in members:
            b = beams[i]
            forced: list[list[tuple[float, int]]] = [[] for _ in range(b.k)]
            if forced_lp is not None and b.forced:  # (the padding columns are not read)
                forced = [list(zip(forced_lp[at + j], b.forced[j], strict=False)) for j in range(b.k)]
            parents[i] = b.advance_constrained(
                best[i],
                [list(zip(top_lp[r], top_token[r], strict=True)) for r in range(at, at + b.k)],
                forced,
                eos_lp[at : at + b.k],
                self.eos,
                self.length_penalty,
                self.no_repeat_ngram_size,
            )
            at += b.k

    def _guard(self, beams: list[Beam], members: list[int], values: Tensor, tokens: Tensor) -> Tensor:
        """``values`` with -inf for candidates that would repeat an n-gram of their beam."""
        listed = tokens.tolist()  # (A, K, top)
        hits = [
            (a, j, c)
            for a, i in enumerate(members)
            for j, history in enumerate(beams[i].history)
            if (banned := banned_tokens(history, self.no_repeat_ngram_size))
            for c, token in enumerate(listed[a][j])
            if token in banned
        ]
        if not hits:
            return values
        a, j, c = (torch.tensor(x, device=values.device) for x in zip(*hits, strict=True))
        values = values.clone()
        values[a, j, c] = -math.inf
        return values


def _next_rows(
    beams: list[Beam], offsets: list[int], parents: dict[int, list[int]], device: torch.device
) -> tuple[Tensor | None, Tensor]:
    """The rows that feed the beams still not done (``None``: every row, in place) and their tokens."""
    keep: list[int] = []
    tokens: list[int] = []
    for i, b in enumerate(beams):
        if not b.done:
            keep += [offsets[i] + p for p in parents[i]]
            tokens += [h[-1] for h in b.history]
    token_tensor = torch.tensor(tokens, dtype=torch.long, device=device)
    if keep == list(range(offsets[-1])):
        return None, token_tensor
    return torch.tensor(keep, dtype=torch.long, device=device), token_tensor
