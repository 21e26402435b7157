"""An input's search state on the host: ``Beam``, a beam of K rows (greedy is a beam of one) with
its live hypotheses, their scores and tokens' log-probs, its finished ones, and, for terminology,
its constraints' states (``advance_constrained``: dynamic beam allocation). ``Search`` in
``model.decoding.search`` advances beams by a step's candidates; the device search
(``model.decoding.device_search``) is the same rules as tensor ops, with ``Beam`` its reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from model.decoding.constraints import ConstraintSet, ConstraintState
from model.decoding.hypothesis import Hypothesis, Spans


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
