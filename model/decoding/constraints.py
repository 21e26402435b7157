"""Lexically constrained decoding: the rules, in plain Python (torch-free, for the front end too).

An input with constraints (target token sequences that every finished hypothesis must contain)
is searched with dynamic beam allocation (Post & Vilar 2018, "Fast Lexically Constrained Decoding
with Dynamic Beam Allocation"): at every step the candidates are the usual best 2K extensions of
its K beams, plus, for each live beam, its single best token and the next token of each constraint
it has not met (for a constraint in progress, its continuation); candidates are grouped into banks
by how many constraint tokens they have met (a constraint in progress counts its tokens so far:
without that, a multi-token constraint's first token would have to win a slot on its probability
alone, and rarely does), the K slots are shared out across the banks, and eos is allowed only to
hypotheses that have met every constraint. Right after a constraint is met no piece that continues
a word may come (``ConstraintSet``'s ``continuations``): the term stays a word of its own. (When an
input stops: ``model.decoding.search.Beam.advance_constrained``.) This module holds what that needs and
nothing of tensors: ``beam_for`` (how many rows such an input takes, which the front end counts
too), ``ConstraintSet`` (an input's constraints: how a token advances a hypothesis' state, which
tokens the step must score for it) and ``ConstraintSet.choose`` (one step's choice of an input's
beams). ``model.decoding.search.Beam`` keeps the states and the hypotheses.

A hypothesis' state (``ConstraintState``) says which constraints it has met, how far it is inside
one (a mismatch mid-constraint resets that progress, as in Post & Vilar and Hu et al. 2019, and the
token may then start a constraint itself) and where each met constraint was realised (``spans``:
token positions, end exclusive). A constraint is met by its own occurrence: two constraints with
the same tokens need two occurrences, and an occurrence never overlaps another's, so each span can
be replaced by its term's exact text (``model.tokenizer.Tokenizer.decode_spans``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Sequence
from typing import NamedTuple

# Above this a constrained input's beam stops growing with its constraints: banks then share slots
# (``bank_sizes``: the spare ones go to the hypotheses that have met the most), which still meets
# them, and each extra row costs a row of every step plus a row's candidates in Python.
MAX_CONSTRAINED_BEAM = 8

Span = tuple[int, int, int]  # (start, end, constraint index): tokens [start, end) realise it


def beam_for(beam_size: int, n_constraints: int) -> int:
    """The beam an input with ``n_constraints`` constraints decodes with (its cache rows).

    ``beam_size`` without constraints. With them ``max(n_constraints + 1, beam_size +
    n_constraints - 1)``, capped at ``MAX_CONSTRAINED_BEAM`` (a request's own larger beam is kept):
    room for a hypothesis at each number of constraints met (0, 1, ..., n_constraints), so that
    those that met one early do not crowd out the others, and from the second constraint on a row
    more per constraint (measured, multi30k de->en, beam 5, two glossary terms per sentence: BLEU
    +0.9 for ~10 % of the throughput; a row per constraint from the first cost ~30 % for no more
    BLEU, and without more rows the banks of few constraints met hold 1 slot of 5). A greedy
    request with one constraint thus decodes with a beam of 2. (Banks count tokens,
    ``ConstraintSet.choose``; with fewer slots than banks the hypotheses furthest on keep them.)"""
    if n_constraints <= 0:
        return beam_size
    grown = max(n_constraints + 1, beam_size + n_constraints - 1)
    return max(beam_size, min(grown, MAX_CONSTRAINED_BEAM))


class ConstraintState(NamedTuple):
    """Where one hypothesis stands with its input's constraints (immutable: beams share it)."""

    met: int  # bit c set: constraint c is met
    n_met: int  # how many are met
    bank: int  # constraint tokens generated: those of the met constraints and of the one in progress
    matched: int  # tokens of the constraint(s) in progress already generated (0: none in progress)
    partial: tuple[int, ...]  # the unmet constraints whose first ``matched`` tokens end the output
    spans: tuple[Span, ...]  # where each met constraint was realised, in the order they were met


class ConstraintSet:
    """One input's constraints (non-empty target token sequences; an empty one is met from the
    start) and how hypotheses advance through them."""

    def __init__(self, constraints: Sequence[Sequence[int]], continuations: Collection[int] = ()) -> None:
        """``continuations``: the target ids that continue a word (``Tokenizer.word_continuations``):
        none may come right after a met constraint, which would glue a piece onto the term
        ("fangen" + "de": the term is then not in the output as a word). A constraint's own first
        token begins a word (terms are encoded on their own, with SentencePiece's dummy prefix), so
        the term never glues onto the word before it."""
        self.seqs = tuple(tuple(c) for c in constraints)
        self.continuations = continuations
        self.n = len(self.seqs)
        self.all_met = (1 << self.n) - 1
        self.tokens = sum(map(len, self.seqs))  # the top bank: every constraint met
        self.needed = sum(1 for seq in self.seqs if seq)  # spans of a hypothesis that met them all
        by_first: dict[int, list[int]] = {}
        for c, seq in enumerate(self.seqs):
            if seq:
                by_first.setdefault(seq[0], []).append(c)
        self.by_first = {t: tuple(cs) for t, cs in by_first.items()}
        empty = [c for c, seq in enumerate(self.seqs) if not seq]
        self._start = ConstraintState(sum(1 << c for c in empty), len(empty), 0, 0, (), ())
        self._firsts: dict[int, list[int]] = {}  # met -> first tokens of the unmet constraints

    def start(self) -> ConstraintState:
        return self._start

    def complete(self, state: ConstraintState) -> bool:
        return state.met == self.all_met

    def allowed(self, state: ConstraintState) -> list[int]:
        """The tokens that advance ``state`` (each unmet constraint's first token, the continuation
        of those in progress): the step scores them however far outside its top-k they are."""
        firsts = self._firsts.get(state.met)
        if firsts is None:
            firsts = self._firsts[state.met] = list(
                dict.fromkeys(seq[0] for c, seq in enumerate(self.seqs) if not state.met >> c & 1)
            )
        if not state.matched:
            return firsts
        nexts = [self.seqs[c][state.matched] for c in state.partial]
        return list(dict.fromkeys(nexts + firsts))

    def advance(self, state: ConstraintState, token: int, position: int) -> ConstraintState:
        """The state after ``token`` is generated at ``position`` (its index in the output)."""
        matched = state.matched
        if matched:
            going = tuple(c for c in state.partial if self.seqs[c][matched] == token)
            if going:
                for c in going:
                    if len(self.seqs[c]) == matched + 1:
                        return self._meet(state, c, position - matched, position + 1)
                return ConstraintState(
                    state.met, state.n_met, state.bank + 1, matched + 1, going, state.spans
                )
            # A mismatch: the progress is lost (the constraint must start again), and the token
            # may start a constraint of its own, below.
        bank = state.bank - matched
        starts = self.by_first.get(token)
        if starts is not None:
            unmet = tuple(c for c in starts if not state.met >> c & 1)
            if unmet:
                for c in unmet:
                    if len(self.seqs[c]) == 1:
                        return self._meet(state, c, position, position + 1)
                return ConstraintState(state.met, state.n_met, bank + 1, 1, unmet, state.spans)
        if not matched:
            return state
        return ConstraintState(state.met, state.n_met, bank, 0, (), state.spans)

    def _meet(self, state: ConstraintState, c: int, start: int, end: int) -> ConstraintState:
        """``state`` with constraint c met by tokens [start, end) (the progress before it dropped)."""
        bank = state.bank - state.matched + len(self.seqs[c])
        spans = (*state.spans, (start, end, c))
        return ConstraintState(state.met | 1 << c, state.n_met + 1, bank, 0, (), spans)

    def choose(
        self,
        k: int,
        position: int,
        scores: Sequence[float],
        states: Sequence[ConstraintState],
        best: Sequence[tuple[float, int, int]],
        top: Sequence[Sequence[tuple[float, int]]],
        forced: Sequence[Sequence[tuple[float, int]]],
        eos: tuple[int, Sequence[float]],
        banned: Sequence[Collection[int]] | None = None,
    ) -> tuple[list[tuple[int, float, ConstraintState]], list[tuple[int, int, float, ConstraintState]]]:
        """One step of dynamic beam allocation for an input's K beams.

        ``scores``: the beams' cumulative log-probs (-inf: a dead copy); ``best``: the best 2K
        extensions of the K beams as (score, token, beam), best first (what an unconstrained beam
        chooses from; the repetition guard already applied); ``top[j]``: beam j's best (log-prob,
        token) pairs, best first, as the step returned them; ``forced[j]``: the (log-prob, token)
        of the tokens ``allowed`` gave for beam j; ``eos``: (eos id, each beam's eos log-prob);
        ``banned[j]``: the tokens the repetition guard forbids after beam j, for its best token
        (forced tokens all advance a constraint: the guard must not make a constraint
        impossible). ``position``: the index of the tokens generated now. A beam whose last
        token met a constraint takes none of ``continuations`` (each such beam's best token is
        then its best other one).

        Returns (enders, continuing): the beams that end now with eos, as (beam, score, state),
        best first; and at most K continuations (beam, token, score, state), best first, taken
        bank by bank (``bank_sizes``; a candidate's bank: its state's ``bank``, constraint tokens
        met). A beam that has met every constraint ends when its eos is among the K best
        extensions of all such beams (their ``top`` and eos): the stopping rule of unconstrained
        beams, among the hypotheses allowed to stop. (Ranked within its bank's candidates
        instead, eos came first too easily: a bank holds few candidates, and hypotheses ended
        as soon as their constraints were met.)"""
        eos_id, eos_lprobs = eos
        # The beams that met a constraint with their last token: no word continuation after it.
        glue = self.continuations
        glued = [bool(glue) and bool(s.spans) and s.spans[-1][1] == position for s in states]
        # Every extension considered, once, in the order listed (the best 2K first, as an
        # unconstrained beam ranks them; a stable sort keeps that order among equal scores).
        cands: dict[tuple[int, int], float] = {}
        for score, t, j in best:
            if score != -math.inf and not (glued[j] and t in glue):  # (-inf: a dead copy's)
                cands.setdefault((j, t), score)
        for j in range(k):
            base = scores[j]
            if base == -math.inf:
                continue
            # Its best token, whatever the others' scores (Post & Vilar): the best it may take.
            for lp, t in top[j]:
                if not (glued[j] and t in glue):
                    if banned is None or t not in banned[j]:
                        cands.setdefault((j, t), base + lp)
                    break
            for lp, t in forced[j]:
                if not (glued[j] and t in glue):
                    cands.setdefault((j, t), base + lp)
        ranked: list[tuple[float, int, int, ConstraintState]] = []  # (score, beam, token, state)
        by_first = self.by_first
        for (j, t), score in sorted(cands.items(), key=lambda c: -c[1]):
            state = states[j]
            if t == eos_id:  # (ending is decided below)
                continue
            if state.matched or t in by_first:
                ranked.append((score, j, t, self.advance(state, t, position)))
            else:  # (the common case: a token that neither starts nor continues anything)
                ranked.append((score, j, t, state))
        enders: list[tuple[int, float, ConstraintState]] = []
        complete = [j for j in range(k) if scores[j] != -math.inf and states[j].met == self.all_met]
        if complete:  # only hypotheses that have met everything may end
            ending = [(scores[j] + eos_lprobs[j], j) for j in complete]
            pool = [
                scores[j] + lp
                for j in complete
                for lp, t in top[j]
                if t != eos_id and not (glued[j] and t in glue)
            ]
            kth = heapq.nlargest(k, pool + [e for e, _ in ending])[-1]
            enders = [(j, e, states[j]) for e, j in sorted(ending, reverse=True) if e >= kth]
        counts = [0] * (self.tokens + 1)
        for _, _, _, after in ranked:
            counts[after.bank] += 1
        sizes = bank_sizes(k, counts)
        continuing: list[tuple[int, int, float, ConstraintState]] = []
        for score, j, t, after in ranked:
            if sizes[after.bank] > 0:
                sizes[after.bank] -= 1
                continuing.append((j, t, score, after))
        return enders, continuing


def bank_sizes(k: int, counts: Sequence[int]) -> list[int]:
    """How many of ``k`` slots each bank gets, given its candidates ``counts`` (bank b: the
    candidates that have met b constraint tokens).

    An even share, the remainder to the highest bank (Post & Vilar); slots a bank cannot fill go
    to the highest banks that have candidates left, so that no slot stays empty while a candidate
    waits, and with fewer slots than banks the hypotheses that have met the most keep them."""
    n = len(counts)
    base, extra = divmod(k, n)
    sizes = [base] * n
    sizes[-1] += extra
    spare = 0
    for b in range(n):
        if sizes[b] > counts[b]:
            spare += sizes[b] - counts[b]
            sizes[b] = counts[b]
    for b in reversed(range(n)):
        if not spare:
            break
        more = min(spare, counts[b] - sizes[b])
        sizes[b] += more
        spare -= more
    return sizes
