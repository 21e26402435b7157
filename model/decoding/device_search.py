"""The search state of unconstrained inputs, kept on the model's device.

``Beam`` (``model.decoding.search``) keeps an input's beams in Python lists: every step then reads
the step's candidates back to the host (``.tolist()``), and on a GPU each such read waits for the
whole queue of launched kernels, so the GPU idles while Python chooses tokens. Here the same rules
(``Beam.advance``: fairseq's; ``Beam.extend``: greedy) run as a few tensor ops per beam size for
all inputs at once, on tensors indexed by cache row, and nothing is read back until the running
batch asks which inputs finished (``SearchRows.finished``, every few steps): an input that
finishes meanwhile is frozen (its state no longer changes; its rows are still stepped and ignored).

The results are those of ``Beam``, bit for bit: the same float32 sums and top-k of the candidates,
greedy scores summed in float64 as Python sums them, and the length-normalized score computed on
the host, in Python, from the same values when the hypotheses are read (``Search.results``).

Inputs with constraints or under the repetition guard need Python per step (``ConstraintSet``,
``banned_tokens``) and keep ``Beam``; their rows here are unused.

An input's output prefix (``model.decoding.prefix``) is written at the start of its rows'
histories, with its length: while a row's steps are fewer, its token is the history's own
(``Beam.force``'s rule as tensor ops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from model import cache as caches
from model.cache import KVCache
from model.decoding.prefix import drop_secondary_eos, force_candidates
from model.runtime.step import StepChoice

# A finished hypothesis as read back: generated tokens (no eos), log-prob (eos included), length
# (eos included), and each token's log-prob, eos's last (``Hypothesis.token_log_probs``).
Found = tuple[list[int], float, int, list[float]]


@dataclass(frozen=True)
class Group:
    """The inputs of one beam size: their beams' cache rows, and where their rows' candidates are
    in the step's output (``beam_rows`` lists them consecutively, input by input)."""

    k: int
    rows: Tensor  # (A, k) long: row j of input a is its beam j
    # First of their rows in the step's candidates; None: none asked (unscored greedy: no log-probs).
    top: int | None
    # Whether any of them has an output prefix: without one a step skips the prefix's operations
    # (the host knows: no read; a GPU step is launch-bound, each operation costs a launch).
    prefixed: bool = False


class SearchRows:
    """Each cache row's search state, on the device (row ``capacity`` is scratch: masked writes
    go there, so that no write depends on a count the host would have to read).

    Per row: its beam's generated tokens, cumulative log-prob (float64: greedy sums are Python's;
    a beam's scores are float32 values, exact in float64), steps taken, length limit, and whether
    its input is done (the same in every row of an input), its output prefix's length (the prefix
    itself is the start of the row's history, written when the input joins). An input's finished
    hypotheses are kept in its own rows, the j-th to end in its row j (an input ends at most K of
    them), with their count in every row of the input."""

    def __init__(self, capacity: int, positions: int, device: torch.device) -> None:
        n = capacity + 1
        self.scratch = capacity
        self.width = max(positions, 1)  # generated tokens a row can hold (its length limit - 1 at most)
        self.history = torch.zeros((n, self.width), dtype=torch.long, device=device)
        self.score = torch.zeros(n, dtype=torch.float64, device=device)
        self.steps = torch.zeros(n, dtype=torch.long, device=device)
        self.limit = torch.ones(n, dtype=torch.long, device=device)
        self.done = torch.zeros(n, dtype=torch.bool, device=device)
        self.found_tokens = torch.zeros((n, self.width), dtype=torch.long, device=device)
        self.found_lprob = torch.zeros(n, dtype=torch.float64, device=device)
        self.found_length = torch.zeros(n, dtype=torch.long, device=device)
        self.found = torch.zeros(n, dtype=torch.long, device=device)  # finished hypotheses of the input
        self.prefix_len = torch.zeros(n, dtype=torch.long, device=device)  # output prefix tokens
        # Each generated token's log-prob as the step gave it (float32), and a finished
        # hypothesis's, eos's at its last column (one more column than ``history``: eos's).
        self.history_lprob = torch.zeros((n, self.width + 1), dtype=torch.float32, device=device)
        self.found_token_lprob = torch.zeros((n, self.width + 1), dtype=torch.float32, device=device)

    def _tensors(self) -> tuple[Tensor, ...]:
        return (
            self.history,
            self.score,
            self.steps,
            self.limit,
            self.done,
            self.found_tokens,
            self.found_lprob,
            self.found_length,
            self.found,
            self.prefix_len,
            self.history_lprob,
            self.found_token_lprob,
        )

    def start(
        self, first: int, ks: list[int], limits: list[int], prefixes: list[tuple[int, ...]] | None = None
    ) -> None:
        """Inputs of beam sizes ``ks``, length limits ``limits`` and output prefixes ``prefixes``
        (default none) join at rows ``first``... (as ``Beam.start``: only the first beam of each is
        alive)."""
        n, device = sum(ks), self.score.device
        self.prefix_len[first : first + n] = 0
        if prefixes and any(prefixes):
            # (A prefix longer than a row's history is never read that far: the limit comes first.)
            rows = [p[: self.width] for k, p in zip(ks, prefixes, strict=True) for _ in range(k)]
            longest = max(map(len, rows))
            self.prefix_len[first : first + n] = torch.tensor([len(p) for p in rows], device=device)
            table = [[*p, *[0] * (longest - len(p))] for p in rows]
            self.history[first : first + n, :longest] = torch.tensor(table, device=device)
        scores = [s for k in ks for s in [0.0] + [-math.inf] * (k - 1)]
        self.score[first : first + n] = torch.tensor(scores, dtype=torch.float64, device=device)
        self.limit[first : first + n] = torch.tensor(
            [limit for k, limit in zip(ks, limits, strict=True) for _ in range(k)], device=device
        )
        for t in (self.steps, self.done, self.found):
            t[first : first + n] = 0

    def move(self, moves: dict[int, int]) -> None:
        """Rows moved (old row -> new row: ``KVCache.remove``'s moves) take their state along."""
        if not moves:
            return
        device = self.score.device
        dst = torch.tensor(list(moves.values()), dtype=torch.long, device=device)
        src = torch.tensor(list(moves.keys()), dtype=torch.long, device=device)
        for t in self._tensors():  # gathered first, so rows both read and written are safe
            t.index_copy_(0, dst, t.index_select(0, src))

    def finished(self, firsts: list[int]) -> list[bool]:
        """Whether the inputs whose first rows are ``firsts`` are done: one read."""
        index = torch.tensor(firsts, dtype=torch.long, device=self.done.device)
        return [bool(d) for d in self.done.index_select(0, index).tolist()]

    def hypotheses(self, rows: list[list[int]]) -> list[list[Found]]:
        """The finished hypotheses of the inputs whose rows are ``rows`` (done ones), in the order
        they ended: one read for them all."""
        flat = [r for rs in rows for r in rs]
        if not flat:
            return []
        index = torch.tensor(flat, dtype=torch.long, device=self.done.device)
        packed = torch.cat(
            [
                self.found_tokens.index_select(0, index),
                self.found_length.index_select(0, index)[:, None],
                self.found.index_select(0, index)[:, None],
                self.found_lprob.index_select(0, index).view(torch.long)[:, None],
                self.found_token_lprob.index_select(0, index).double().view(torch.long),
            ],
            dim=1,
        ).cpu()  # the one transfer; what follows runs on the host
        lcols = self.width + 1
        token_lprobs = packed[:, -lcols:].contiguous().view(torch.float64).tolist()
        lprobs = packed[:, -lcols - 1].contiguous().view(torch.float64).tolist()
        table = packed[:, : -lcols - 1].tolist()
        out: list[list[Found]] = []
        at = 0
        for rs in rows:
            count = table[at][-1]
            out.append(
                [
                    (
                        table[at + j][: table[at + j][-2] - 1],
                        lprobs[at + j],
                        table[at + j][-2],
                        token_lprobs[at + j][: table[at + j][-2]],
                    )
                    for j in range(count)
                ]
            )
            at += len(rs)
        return out


def advance(
    rows: SearchRows, groups: list[Group], step: StepChoice, tokens: Tensor, *, eos: int
) -> tuple[Tensor, Tensor] | None:
    """Advance every input of ``groups`` by one token: writes each row's next token into
    ``tokens`` (by cache row); returns (dst, src) rows for the beams' cache reorder (row dst takes
    row src's prefix: every beam row, moved or not; None without beams)."""
    moved: list[tuple[Tensor, Tensor]] = []
    for g in groups:
        if g.k == 1:
            _greedy(rows, g, step, tokens, eos=eos)
        else:
            moved.append(_beams(rows, g, step, tokens, eos=eos))
    rows.steps.add_(1)
    if not moved:
        return None
    return torch.cat([d for d, _ in moved]), torch.cat([s for _, s in moved])


def _greedy(rows: SearchRows, g: Group, step: StepChoice, tokens: Tensor, *, eos: int) -> None:
    """``Beam.extend`` for the greedy inputs of ``g``: the argmax, eos at the limit; the input ends
    with eos. Scored (``g.top`` given): the argmax's log-prob (the best candidate's; eos's at the
    limit) is summed in float64, as Python sums it, and kept per token; unscored, every score stays
    0.0."""
    r = g.rows[:, 0]  # (A,)
    steps = rows.steps.index_select(0, r)
    length = steps + 1  # tokens of the hypothesis if it ends now, eos included
    at_limit = length >= rows.limit.index_select(0, r)
    active = ~rows.done.index_select(0, r)
    column = steps.clamp(max=rows.width - 1)
    chosen = step.choice.index_select(0, r)
    forcing = None
    if g.prefixed:  # in the output prefix: its token (the history's own), which adds nothing to the score
        forcing = steps < rows.prefix_len.index_select(0, r)
        chosen = torch.where(forcing, rows.history[r, column], chosen)
    token = torch.where(at_limit, eos, chosen)
    score = rows.score.index_select(0, r)
    ended = active & (token == eos)  # (at the limit the token is eos)
    target = torch.where(ended, r, rows.scratch)
    if g.top is not None:
        a, n = g.top, r.size(0)
        best = step.top_lprobs[a : a + n, 0]
        if forcing is not None:
            best = torch.where(forcing, 0.0, best)
        lprob = torch.where(at_limit, step.eos_lprob[a : a + n], best)
        score = score + lprob.double()
        rows.history_lprob.index_put_((r, steps.clamp(max=rows.width)), lprob.float())
        rows.found_token_lprob.index_copy_(0, target, rows.history_lprob.index_select(0, r))
    rows.found_tokens.index_copy_(0, target, rows.history.index_select(0, r))
    rows.found_lprob.index_copy_(0, target, score)
    rows.found_length.index_copy_(0, target, length)
    rows.found.index_copy_(0, r, rows.found.index_select(0, r) + ended.long())
    rows.done.index_copy_(0, r, ~active | ended)
    # (A row that ended, or was done before, writes too: its history is no longer read.)
    rows.history.index_put_((r, column), token)
    rows.score.index_copy_(0, r, score)
    tokens.index_copy_(0, r, token)


def _beams(
    rows: SearchRows, g: Group, step: StepChoice, tokens: Tensor, *, eos: int
) -> tuple[Tensor, Tensor]:
    """``Beam.advance`` for the inputs of ``g`` (K > 1 beams each), all at once; returns their
    rows' cache reorder (dst, src)."""
    k, idx = g.k, g.rows  # (A, K)
    assert g.top is not None
    a_n, top = idx.size(0), step.top_tokens.size(1)
    assert top >= 2 * k, f"{top} candidates per row cannot serve a beam of {k}"
    flat = idx.reshape(-1)
    first = idx[:, 0]
    steps = rows.steps.index_select(0, first)  # (A,)
    length = steps + 1  # tokens of a hypothesis ending now, eos included
    at_limit = length >= rows.limit.index_select(0, first)
    active = ~rows.done.index_select(0, first)
    found = rows.found.index_select(0, first)  # finished hypotheses so far
    scores = rows.score.index_select(0, flat).view(a_n, k).float()  # float32, as ``_candidates``
    span = slice(g.top, g.top + a_n * k)
    values = step.top_lprobs[span].view(a_n, k, top)
    cand = step.top_tokens[span].view(a_n, k, top)
    # At the limit each beam's only candidate is eos, with its own log-prob (``_candidates``).
    limited = at_limit[:, None, None]
    first_col = torch.arange(top, device=idx.device) == 0
    eos_lp = step.eos_lprob[span].view(a_n, k, 1)
    values = torch.where(limited, torch.where(first_col, eos_lp, -math.inf), values)
    cand = torch.where(limited, eos, cand)
    total = (scores[:, :, None] + values).view(a_n, k * top)
    cand_scores, picked = total.topk(2 * k, dim=1)  # (A, 2K) best first
    cand_tokens = cand.view(a_n, k * top).gather(1, picked)
    cand_lprobs = values.reshape(a_n, k * top).gather(1, picked)  # each candidate token's own
    cand_beams = picked // top
    # The output prefix (``model.decoding.prefix``): in it, the first beam takes its token (the
    # history's own); at the first step after it, an eos below the best cannot end a hypothesis.
    if g.prefixed:
        prefix_len = rows.prefix_len.index_select(0, first)
        forcing = (steps < prefix_len) & ~at_limit
        token_now = rows.history[first, steps.clamp(max=rows.width - 1)]
        cand_scores, cand_tokens, cand_beams = force_candidates(
            cand_scores, cand_tokens, cand_beams, forcing=forcing, token=token_now, first=scores[:, 0]
        )
        cand_lprobs = torch.where(forcing[:, None], 0.0, cand_lprobs)  # a prefix token counts nothing
        free = (prefix_len > 0) & (steps == prefix_len) & ~at_limit
        cand_scores, cand_tokens = drop_secondary_eos(cand_scores, cand_tokens, free, eos)

    # fairseq's rule (``Beam.advance``) over the 2K candidates, best first: stop at the first -inf
    # (sorted: the finite ones are a prefix) or once K continue; eos ranked < K ends a hypothesis
    # while fewer than K have ended.
    rank = torch.arange(2 * k, device=idx.device)
    finite = cand_scores != -math.inf
    is_eos = cand_tokens == eos
    going = finite & ~is_eos
    going_before = going.long().cumsum(1) - going.long()  # continuing candidates ranked before
    seen = finite & (going_before < k)  # the candidates the loop reaches
    taken = seen & going
    ending = seen & is_eos & (rank < k) & active[:, None]
    ending_before = ending.long().cumsum(1) - ending.long()
    slot = found[:, None] + ending_before  # where it goes among the input's finished hypotheses
    ended = ending & (slot < k)
    n_ended = ended.long().sum(1)
    n_going = taken.long().sum(1)
    done = active & ((found + n_ended >= k) | at_limit | (n_going == 0))
    best_ends = done & (found + n_ended == 0)  # nothing may continue or end: the best beam ends

    # Finished hypotheses, written into the input's rows (masked ones into the scratch row):
    # the tokens of their beam before this step's token.
    target = torch.where(ended, idx.gather(1, slot.clamp(max=k - 1)), rows.scratch).view(-1)
    target = torch.cat([target, torch.where(best_ends, first, rows.scratch)])
    source = torch.cat([idx.gather(1, cand_beams).view(-1), first])
    lprob = torch.cat([cand_scores.view(-1), scores[:, 0]]).double()
    lengths = torch.cat([length[:, None].expand(a_n, 2 * k).reshape(-1), length])
    rows.found_tokens.index_copy_(0, target, rows.history.index_select(0, source))
    rows.found_lprob.index_copy_(0, target, lprob)
    # Their token log-probs: their beam's, then eos's (0.0 for a best beam that ends without one).
    ending_lprobs = rows.history_lprob.index_select(0, source)
    eos_column = torch.cat([steps[:, None].expand(a_n, 2 * k).reshape(-1), steps]).clamp(max=rows.width)
    eos_values = torch.cat([cand_lprobs.reshape(-1), torch.zeros_like(scores[:, 0])])
    ending_lprobs[torch.arange(source.size(0), device=idx.device), eos_column] = eos_values
    rows.found_token_lprob.index_copy_(0, target, ending_lprobs)
    rows.found_length.index_copy_(0, target, lengths)
    count = found + n_ended + best_ends.long()
    rows.found.index_copy_(0, flat, count[:, None].expand(a_n, k).reshape(-1))
    rows.done.index_copy_(0, flat, (~active | done)[:, None].expand(a_n, k).reshape(-1))

    # The continuing beams, in rank order (keys: taken candidates by rank, then the others), fewer
    # than K padded with dead copies of the first. (An input that is done writes too: its rows are
    # no longer read.)
    order = torch.where(taken, rank, rank + 2 * k).topk(k, dim=1, largest=False).indices  # (A, K)
    live = rank[None, :k] < n_going[:, None]
    order = torch.where(live, order, order[:, :1])
    parent = cand_beams.gather(1, order)  # (A, K) the beam each new beam extends
    token = cand_tokens.gather(1, order)
    score = torch.where(live, cand_scores.gather(1, order), -math.inf)
    src = idx.gather(1, parent).view(-1)
    history = rows.history.index_select(0, src)  # (A*K, width)
    column = steps.clamp(max=rows.width - 1).repeat_interleave(k)
    history[torch.arange(a_n * k, device=idx.device), column] = token.view(-1)
    rows.history.index_copy_(0, flat, history)
    history_lprob = rows.history_lprob.index_select(0, src)
    lcolumn = steps.clamp(max=rows.width).repeat_interleave(k)
    history_lprob[torch.arange(a_n * k, device=idx.device), lcolumn] = cand_lprobs.gather(1, order).view(-1)
    rows.history_lprob.index_copy_(0, flat, history_lprob)
    rows.score.index_copy_(0, flat, score.view(-1).double())
    tokens.index_copy_(0, flat, token.view(-1))
    return flat, src


def reorder_cache(cache: KVCache, dst: Tensor, src: Tensor) -> None:
    """Row ``dst[i]`` takes the self-attention prefix of row ``src[i]`` (beams of one input: the
    same source and length, so only the decoded keys/values), from device indices: on an
    accelerator every beam row is copied, moved or not, since choosing the moved ones would read
    the device (``KVCache.reorder`` takes a host list); on the CPU there is no device to wait for:
    the indices are read and only the rows that change parents are copied, one at a time
    (``KVCache.take_prefixes``; beam 5 at 64 rows: 1.98 -> 1.81 s for 256 sentences, int8, one
    thread, AVX-512 VNNI, with the moved rows gathered then)."""
    if caches.copies_on_host(dst.device):
        cache.take_prefixes(dst.tolist(), src.tolist())
        return
    kv = cache.self_kv[:, :, :, :, : cache.max_length]
    kv.index_copy_(0, dst, kv.index_select(0, src))
