"""The choice of tokens: a step's candidates in, each input's next tokens out.

Each input's search state is a ``Beam`` (greedy is a beam of one). ``Search.step`` takes what a
decoding step chose on the device (``model.runtime.step.StepChoice``: every row's argmax, and the
best candidates of the rows that asked for them) and advances a list of beams by one token,
whatever their sizes and however many steps each has taken: the same code serves a batch decoded
from start to end and the service's running batch that inputs join and leave at any step.

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
from dataclasses import dataclass, field

import torch
from torch import Tensor

from model.decoding.constraints import ConstraintSet, ConstraintState
from model.decoding.device_search import Found, Group, SearchRows, advance
from model.decoding.hypothesis import Hypothesis, Spans
from model.decoding.prefix import drop_secondary_eos
from model.runtime.step import StepChoice


def length_normalized(log_prob: float, length: int, length_penalty: float) -> float:
    """Score used to rank hypotheses of different lengths; ``length`` counts the eos token."""
    return log_prob / (max(length, 1) ** length_penalty)


@dataclass
class Beam:
    """The search state of one input: its K live beams (K cache rows) and the hypotheses that
    have ended."""

    k: int  # beam size; 1 is greedy search
    limit: int  # maximum output length in tokens, eos included
    scores: list[float]  # cumulative log-probs of the live beams, best first
    history: list[list[int]]  # tokens of each live beam
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False
    constraints: ConstraintSet | None = None  # None: unconstrained (the plain path)
    states: list[ConstraintState] = field(default_factory=list)  # each live beam's, with constraints
    forced: list[list[int]] = field(default_factory=list)  # per beam: the tokens forced this step
    prefix: tuple[int, ...] = ()  # the output prefix: the first tokens of every hypothesis
    # Each live beam's token log-probs, as ``history`` its tokens (``Hypothesis.token_log_probs``).
    lprobs: list[list[float]] = field(default_factory=list)
    # Token log-probs asked for: a greedy beam then asks the step for its candidates even where the
    # search's greedy rows are unscored (``Search.greedy_scores``); beams always keep them.
    scored: bool = False

    @classmethod
    def start(
        cls,
        k: int,
        limit: int,
        constraints: ConstraintSet | None = None,
        prefix: tuple[int, ...] = (),
        scored: bool = False,
    ) -> Beam:
        # K copies of the first row; only the first copy is alive, so step 0 expands one beam.
        beam = cls(
            k,
            limit,
            [0.0] + [-math.inf] * (k - 1),
            [[] for _ in range(k)],
            prefix=tuple(prefix),
            lprobs=[[] for _ in range(k)],
            scored=scored,
        )
        if constraints is not None:
            beam.constraints, beam.states = constraints, [constraints.start()] * k
        return beam

    @property
    def steps(self) -> int:
        return len(self.history[0])

    @property
    def at_limit(self) -> bool:
        """The next token is the last allowed: it must be eos."""
        return self.steps + 1 >= self.limit

    @property
    def forcing(self) -> bool:
        """Whether the next token is the output prefix's (``force``); at the limit it is eos."""
        return self.steps < len(self.prefix) and not self.at_limit

    @property
    def after_prefix(self) -> bool:
        """Whether this is the first step after an output prefix, where CTranslate2 lets only the
        best candidate of beams end (``model.decoding.prefix.drop_secondary_eos``)."""
        return bool(self.prefix) and self.steps == len(self.prefix) and not self.at_limit

    def force(self) -> list[int]:
        """Every beam takes the output prefix's next token, its score unchanged (CTranslate2 counts
        nothing for it), its constraint state too (a prefix is not the output's text); returns the
        parent of each beam: itself (the rows are alike until the prefix ends: one beam is alive)."""
        token = self.prefix[self.steps]
        # (New lists: the dead copies of a beam share one.)
        self.history = [h + [token] for h in self.history]
        self.lprobs = [lp + [0.0] for lp in self.lprobs]
        return list(range(self.k))

    def best(self, n_best: int = 1) -> list[Hypothesis]:
        if self.constraints is not None:
            # Only the hypotheses that met every constraint (fewer than n_best where the search
            # found fewer: alternatives that drop a term would break the promise); where none did
            # (the constraints did not fit in the length limit: hypotheses end there, met or not,
            # so that the input ends), those that met the most.
            ranked = sorted(self.finished, key=lambda h: (len(h.spans), h.score), reverse=True)
            complete = [h for h in ranked if len(h.spans) == self.constraints.needed]
            return (complete or ranked)[:n_best]
        return sorted(self.finished, key=lambda h: h.score, reverse=True)[:n_best]

    def advance(
        self,
        cand_scores: list[float],
        cand_tokens: list[int],
        cand_beams: list[int],
        eos: int,
        alpha: float,
        cand_lprobs: list[float] | None = None,
    ) -> list[int]:
        """Take one step's candidates (best first); returns the parent beam of each new beam.
        ``cand_lprobs``: each candidate's own token log-prob, as the step gave it (default: its
        score less its beam's, equal to float32 rounding).

        eos among the K best candidates ends a hypothesis; the K best others continue. The input is
        done once it has K finished hypotheses (fairseq's stopping rule) or reaches its limit.
        """
        length = self.steps + 1  # tokens of a hypothesis ending now, eos included
        scores: list[float] = []
        history: list[list[int]] = []
        lprobs: list[list[float]] = []
        parents: list[int] = []
        if cand_lprobs is None:
            cand_lprobs = [s - self.scores[b] for s, b in zip(cand_scores, cand_beams, strict=True)]
        for rank, (score, token, beam, lp) in enumerate(
            zip(cand_scores, cand_tokens, cand_beams, cand_lprobs, strict=True)
        ):
            if score == -math.inf or len(parents) == self.k:
                break
            if token == eos:
                if rank < self.k and len(self.finished) < self.k:
                    hyp = Hypothesis(
                        self.history[beam],
                        length_normalized(score, length, alpha),
                        score,
                        token_log_probs=(*self.lprobs[beam], lp),
                    )
                    self.finished.append(hyp)
            else:
                parents.append(beam)
                scores.append(score)
                history.append(self.history[beam] + [token])
                lprobs.append(self.lprobs[beam] + [lp])
        self.done = len(self.finished) >= self.k or length >= self.limit or not parents
        if not self.done:
            while len(parents) < self.k:  # keep K rows per input: dead copies of the first beam
                parents.append(parents[0])
                scores.append(-math.inf)
                history.append(history[0])
                lprobs.append(lprobs[0])
            self.scores, self.history, self.lprobs = scores, history, lprobs
        elif not self.finished:  # every candidate banned (repetition guard): the best beam ends
            self.finished.append(self._ended(0, self.scores[0], length, alpha, 0.0))
        return parents

    def advance_constrained(
        self,
        best: list[tuple[float, int, int]],
        top: list[list[tuple[float, int]]],
        forced: list[list[tuple[float, int]]],
        eos_lprobs: list[float],
        eos: int,
        alpha: float,
        guard: int = 0,
    ) -> list[int]:
        """``advance`` for an input with constraints (``ConstraintSet.choose``), given the best 2K
        (score, token, beam) extensions, each beam's best (log-prob, token) pairs, the (log-prob,
        token) of its forced tokens and its eos log-prob; returns the parent beam of each new beam.

        Only a hypothesis that has met every constraint may end before the limit; at the limit
        every live beam ends (met or not: the input must end), and ``best`` ranks those that met
        every constraint first.

        The input stops once no live beam's length-normalized score (as if it ended with its next
        token) reaches the best finished one's, not once K hypotheses have ended (fairseq's rule,
        ``advance``): the hypotheses that forced a term where the model would not put it meet
        their constraints first and end soon after, and K of them would stop the input before the
        hypothesis that places the term where the model wants it (and is the better translation)
        gets there. Finished hypotheses are kept K at most, the best (met constraints, score)."""
        cs = self.constraints
        assert cs is not None
        length = self.steps + 1  # tokens of a hypothesis ending now, eos included
        if length >= self.limit:
            live = [j for j in range(self.k) if self.scores[j] != -math.inf]
            for j in live:
                score = self.scores[j] + eos_lprobs[j]
                self._finish(self._ended(j, score, length, alpha, eos_lprobs[j], self.states[j].spans))
            self.done = True
            return []
        banned = [banned_tokens(h, guard) for h in self.history] if guard > 0 else None
        enders, continuing = cs.choose(
            self.k, self.steps, self.scores, self.states, best, top, forced, (eos, eos_lprobs), banned
        )
        for j, score, state in enders:
            # (The chosen scores are the beam's plus the step's log-prob, so the difference is the
            # token's, to float32 rounding: ``choose`` hands back scores, not log-probs.)
            self._finish(self._ended(j, score, length, alpha, score - self.scores[j], state.spans))
        parents = [j for j, _, _, _ in continuing]
        self.done = not parents
        if self.finished and parents:
            leader = max(h.score for h in self.finished)
            # (length + 1: a continuation's tokens and its eos. An estimate, as Hugging Face's
            # early_stopping=False: log-probs only fall, but the length term may still lift a
            # long beam's normalized score; the length limit bounds the search either way.)
            self.done = all(length_normalized(c[2], length + 1, alpha) < leader for c in continuing)
        if not self.done:
            scores = [score for _, _, score, _ in continuing]
            history = [self.history[j] + [t] for j, t, _, _ in continuing]
            lprobs = [self.lprobs[j] + [s - self.scores[j]] for j, _, s, _ in continuing]
            states = [state for _, _, _, state in continuing]
            while len(parents) < self.k:  # keep K rows per input: dead copies of the first beam
                parents.append(parents[0])
                scores.append(-math.inf)
                history.append(history[0])
                lprobs.append(lprobs[0])
                states.append(states[0])
            self.scores, self.history, self.lprobs, self.states = scores, history, lprobs, states
        elif not self.finished:  # nothing may continue or end (the guard): the best beam ends
            self.finished.append(self._ended(0, self.scores[0], length, alpha, 0.0, self.states[0].spans))
        return parents

    def _ended(
        self, j: int, score: float, length: int, alpha: float, eos_lprob: float, spans: Spans = ()
    ) -> Hypothesis:
        """Beam ``j`` ended with cumulative log-prob ``score``, eos counting ``eos_lprob`` (0.0
        where it ends without one)."""
        return Hypothesis(
            self.history[j],
            length_normalized(score, length, alpha),
            score,
            spans,
            token_log_probs=(*self.lprobs[j], eos_lprob),
        )

    def _finish(self, hyp: Hypothesis) -> None:
        """Keep ``hyp`` among the K best finished (those that met the most constraints, then by
        score: the order ``best`` returns them in)."""
        self.finished.append(hyp)
        if len(self.finished) > self.k:
            self.finished.sort(key=lambda h: (len(h.spans), h.score), reverse=True)
            del self.finished[self.k :]

    def extend(self, lprob: float, token: int, eos: int, alpha: float, scored: bool = True) -> list[int]:
        """``advance`` for a beam of one (greedy), given the best next token and its log-prob
        (unscored: 0.0, and the hypothesis keeps no token log-probs)."""
        score = self.scores[0] + lprob
        history = self.history[0]
        length = len(history) + 1  # tokens of the hypothesis if it ends now, eos included
        if token == eos or length >= self.limit:
            lprobs = (*self.lprobs[0], lprob) if scored else ()
            self.finished.append(
                Hypothesis(history, length_normalized(score, length, alpha), score, token_log_probs=lprobs)
            )
            self.done = True
            return []
        history.append(token)  # greedy histories are never shared, so in place
        self.lprobs[0].append(lprob)
        self.scores[0] = score
        return [0]


def banned_tokens(history: list[int], n: int) -> set[int]:
    """Tokens that would repeat an n-gram of ``history`` if they came next (none when n is 0)."""
    if n <= 0 or len(history) < n - 1:
        return set()
    if n == 1:
        return set(history)
    prefix = history[len(history) - n + 1 :]
    return {history[i + n - 1] for i in range(len(history) - n + 1) if history[i : i + n - 1] == prefix}


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
