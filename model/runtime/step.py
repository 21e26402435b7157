"""One decoding step and the choice it makes, with one signature however it runs.

``DecodeStep`` is ``Transformer.step`` followed by the part of the token choice worth doing on the
device: every row's argmax (greedy rows need nothing else, not even a log-softmax), and for the
rows listed in ``beam_rows`` their ``top`` best log-probabilities and the log-probability of eos
(the best 2K extensions of K beams are always among each beam's own best 2K; a row at its length
limit may only end), and the log-probabilities of the tokens that constrained decoding forces on
those rows (``forced``), wherever they rank. Its inputs are the cache's views
(``model.cache.KVCache.views``) and tensors: no shape steers the code, so it compiles into one
graph that serves every batch.

A runner (``model.runtime.runners``) calls it: eagerly, or as a compiled graph. Runners share its
signature (``StepRunner``), so the code that drives decoding never knows which one it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import KVCache
from model.transformer import Transformer

# (choice, top_tokens, top_lprobs, eos_lprob, new_kv, forced_lprobs): see DecodeStep.forward.
StepOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@dataclass
class StepChoice:
    """What a step chose: for every row, and for the rows asked for (``beam_rows``)."""

    choice: Tensor  # (R,) argmax of each row's logits
    top_tokens: Tensor  # (B, top) best next tokens of each of beam_rows, best first
    top_lprobs: Tensor  # (B, top) their log-probs
    eos_lprob: Tensor  # (B,) log-prob of eos of each of beam_rows
    # (B, F) log-probs of the tokens forced on each of beam_rows (``Search.forced``); None when
    # no input has constraints (the step's output for its dummy column is then not read).
    forced_lprobs: Tensor | None = None


class StepRunner(Protocol):
    """``DecodeStep.forward``'s signature: what decoding calls, eager or compiled."""

    align: int  # the cache's views read positions in multiples of this (``KVCache.views``)

    def new_cache(self, *, capacity: int, positions: int) -> KVCache:
        """An empty cache of the step's model for ``capacity`` rows of ``positions`` positions, that
        this runner's calls read (a graph runner hands out caches whose buffers it captured)."""
        ...

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """The cross-attention keys/values (B, L, 2, H, S, Dh) of ``src`` (B, S) right-padded
        token ids, and its mask (B, S), True on real tokens: what ``KVCache.append`` takes. Eager
        or compiled (``model.runtime.encoder``), the same bits."""
        ...

    def __call__(
        self,
        tokens: Tensor,
        positions: Tensor,
        self_kv: Tensor,
        cross_kv: Tensor,
        src_bias: Tensor,
        sources: Tensor,
        beam_rows: Tensor,
        forced: Tensor,
        /,
    ) -> StepOutputs: ...


def _blocks(x: Tensor, block: int) -> tuple[Tensor, Tensor | None, Tensor]:
    """(N, V) rows as whole blocks of ``block`` columns (a view, (N, V // block, block)); the rest
    of each row, if ``block`` does not divide V, as one more block padded with -inf ((N, block),
    else None); and the max of every block, the last one's included.

    OPUS-MT's 58,101 pieces are not a multiple of 64: without the padded last block every row fell
    back to torch's element-at-a-time argmax and top-k (2.7 and 4.3 ms at 64 rows, one thread)."""
    whole = x.unfold(1, block, block)  # (N, nb, block), a view
    rest = x[:, whole.size(1) * block :]  # (N, V % block)
    maxima = whole.amax(-1)  # (N, nb)
    if not rest.size(1):
        return whole, None, maxima
    maxima = torch.cat([maxima, rest.amax(-1, keepdim=True)], dim=1)  # (N, nb + 1)
    return whole, F.pad(rest, (0, block - rest.size(1)), value=float("-inf")), maxima


def _gather_blocks(whole: Tensor, last: Tensor | None, which: Tensor) -> Tensor:
    """The values of blocks ``which`` ((N, k) block indices; the padded last block is
    V // block) of each row: (N, k, block)."""
    nb, block = whole.size(1), whole.size(2)
    values = whole.gather(1, which.clamp(max=nb - 1)[:, :, None].expand(-1, -1, block))
    if last is None:
        return values
    return torch.where((which == nb)[:, :, None], last[:, None, :].expand_as(values), values)


def argmax_rows(x: Tensor, block: int = 64, min_rows: int = 8) -> Tensor:
    """``x.argmax(-1)`` for (N, V) rows, ties to the first index as torch's: 5x faster at N = 64.

    torch's CPU argmax walks the row one element at a time; a max without the index is vectorized.
    So: the max of each block of ``block`` columns, the first block holding the row's max, then the
    argmax inside that block only (the row's last columns, when ``block`` does not divide V, are one
    more block padded with -inf, which never wins).
    """
    n, v = x.shape
    if n < min_rows or v < block or not x.is_contiguous():  # small batches: the plain argmax is cheaper
        return x.argmax(-1)
    whole, last, maxima = _blocks(x, block)
    first = maxima.argmax(-1)  # (N,) the first block holding the max
    within = _gather_blocks(whole, last, first[:, None])[:, 0].argmax(-1)  # (N,)
    return first * block + within


def topk_rows(x: Tensor, k: int, block: int = 64) -> tuple[Tensor, Tensor]:
    """``x.topk(k, -1)`` for (N, V) rows, best first, ~1.5-2x faster at V = 8,000 (ties aside).

    The k best of a row lie in at most k blocks of ``block`` columns: those whose maxima are the k
    largest. So: each block's max (vectorized), the k best blocks, and the k best of their
    k * ``block`` values only (a row's last columns, when ``block`` does not divide V, are one more
    block padded with -inf)."""
    n, v = x.shape
    if v < 2 * k * block or not x.is_contiguous():
        return x.topk(k, dim=-1)
    whole, last, maxima = _blocks(x, block)
    chosen = maxima.topk(k, dim=-1).indices  # (N, k) blocks holding the k best
    candidates = _gather_blocks(whole, last, chosen).reshape(n, k * block)
    values, where = candidates.topk(k, dim=-1)  # (N, k)
    return values, chosen.gather(1, where // block) * block + where % block


class DecodeStep(nn.Module):
    """``forward(tokens, positions, self_kv, cross_kv, src_bias, sources, beam_rows, forced)``: one
    token per row.

    ``tokens``, ``positions`` (R,) long and the cache views (``KVCache.views``) as
    ``Transformer.step`` takes them;
    ``beam_rows`` (B,) long, B >= 1: the rows whose best ``top`` candidates the search needs (a
    batch of greedy rows passes one row, unused); ``forced`` (B, F) long, F >= 1: token ids per
    beam row whose log-probs the search needs whatever their rank (constrained decoding's next
    constraint tokens; without constraints dummy columns of pad; decoding passes F >= 2, so that
    ``torch.compile`` never specializes a width of 1). F is a symbol of the compiled
    graph like the rows: one graph serves every width.

    Returns ``(choice, top_tokens, top_lprobs, eos_lprob, new_kv, forced_lprobs)``: the argmax of
    each row's logits (R,); the best ``top`` next tokens of each of ``beam_rows`` and their
    log-probs (B, top); the log-prob of eos (B,); the new keys/values (R, L, 2, H, Dh), which the
    caller writes into the cache (``KVCache.advance``); the log-probs of ``forced`` (B, F).
    """

    def __init__(self, model: Transformer, *, top: int) -> None:
        super().__init__()
        self.model = model
        self.top = min(top, model.cfg.vocab_size)  # candidates per beam row: at least twice the largest beam
        self.eos = model.cfg.eos_id

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        self_kv: Tensor,
        cross_kv: Tensor,
        src_bias: Tensor,
        sources: Tensor,
        beam_rows: Tensor,
        forced: Tensor,
    ) -> StepOutputs:
        logits, new_kv = self.model.step(tokens, positions, self_kv, cross_kv, src_bias, sources)  # (R, V)
        # Blocked (a compiled plain argmax walked each row one element at a time: a sixth of a step
        # at 64 rows); min_rows=0: no branch on the batch size.
        choice = argmax_rows(logits, min_rows=0)
        # The best candidates of the beam rows: the top logits are the top log-probs; only those,
        # and eos's, are normalized (as log_softmax does: x - max - log(sum(exp(x - max)))).
        rows = logits.index_select(0, beam_rows).float()  # (B, V)
        top_logits, indices = topk_rows(rows, self.top)  # (B, top), best first
        most = top_logits[:, :1]  # (B, 1) each row's max: its best, no pass over the row again
        log_sum = torch.log(torch.exp(rows - most).sum(-1, keepdim=True))  # (B, 1)
        values = top_logits - most - log_sum  # (B, top)
        eos = (rows[:, self.eos : self.eos + 1] - most - log_sum)[:, 0]  # (B,)
        # The same arithmetic as the top log-probs, so a forced token that is also among the top
        # gets the same value from both.
        forced_values = rows.gather(1, forced) - most - log_sum  # (B, F)
        return choice, indices, values, eos, new_kv, forced_values
