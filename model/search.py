"""Greedy and beam search over the cached decoder, apart from the model.

The model says what a step computes (``decode_step``); this module decides which tokens to keep.
Rows whose sentence is finished leave the batch (and the cache) at once, so later steps only compute
the rows still decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from model.cache import KVCache
from model.transformer import EncoderOutput, Transformer


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids, without bos and eos
    score: float  # sum of token log-probs (eos included) / length**length_penalty
    log_prob: float  # sum of token log-probs, eos included


def length_normalized(log_prob: float, length: int, length_penalty: float) -> float:
    """Score used to rank hypotheses of different lengths; ``length`` counts the eos token."""
    return log_prob / (max(length, 1) ** length_penalty)


def max_lengths(src_lengths: Tensor, a: float, b: int, limit: int) -> Tensor:
    """Per-input decoding budget a*source_length + b tokens (eos included), capped at ``limit``."""
    return (src_lengths.float() * a + b).floor().long().clamp(1, limit)


def initial_capacity(limits: Tensor, most: int = 64) -> int:
    """Cache positions to preallocate: enough for the longest allowed output, so that the cache
    never grows mid-search, up to ``most`` (longer outputs are rare; the cache grows for them)."""
    return min(int(limits.max()), most)


class BeamSearch:
    """One step of beam search: the best 2K extensions of K beams, for every sentence at once.

    Twice the beam is kept so that K candidates that do not end in eos remain even when up to K of
    the best candidates are finished hypotheses.
    """

    def __init__(self, beam_size: int) -> None:
        self.beam_size = beam_size

    def step(self, lprobs: Tensor, scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """lprobs (N, K, V) next-token log-probs; scores (N, K) cumulative log-probs of the beams.

        Returns candidate scores, tokens and source beams, each (N, 2K), best first.
        """
        n, k, v = lprobs.shape
        total = (scores[:, :, None] + lprobs).view(n, k * v)  # (N, K*V)
        cand_scores, flat = total.topk(min(2 * k, k * v), dim=1)  # (N, 2K)
        return cand_scores, flat % v, flat // v


@torch.inference_mode()
def greedy_search(
    model: Transformer, enc: EncoderOutput, limits: Tensor, *, length_penalty: float = 1.0
) -> list[list[Hypothesis]]:
    """Argmax decoding; ``limits`` (B,) is each input's maximum length in tokens, eos included."""
    eos = model.cfg.eos_id
    batch = enc.memory.size(0)
    cache = model.start_cache(enc, capacity=initial_capacity(limits))
    tokens = torch.full((batch,), model.cfg.bos_id, dtype=torch.long, device=enc.memory.device)
    active = torch.arange(batch, device=tokens.device)  # original row of every active row
    out = torch.full((batch, int(limits.max())), eos, dtype=torch.long, device=tokens.device)
    log_probs = torch.zeros(batch, device=tokens.device)
    lengths = limits.clone()
    for t in range(out.size(1)):
        logits, cache = model.decode_step(tokens, cache)
        lprobs = torch.log_softmax(logits.float(), dim=-1)  # (A, V)
        best, tokens = lprobs.max(dim=-1)  # (A,)
        # At its length limit a row is made to end: eos with its own probability (as beam search does).
        forced = limits[active] <= t + 1
        tokens = torch.where(forced, eos, tokens)
        best = torch.where(forced, lprobs[:, eos], best)
        out[active, t] = tokens
        log_probs[active] += best
        done = tokens == eos
        if bool(done.any()):
            lengths[active[done]] = t + 1
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            active, tokens, cache = active[keep], tokens[keep], cache.index_select(keep)
    results = []
    for row, n, lp in zip(out.tolist(), lengths.tolist(), log_probs.tolist(), strict=True):
        results.append([Hypothesis(row[: n - 1], length_normalized(lp, n, length_penalty), lp)])
    return results


@torch.inference_mode()
def beam_search(
    model: Transformer,
    enc: EncoderOutput,
    limits: Tensor,
    *,
    beam_size: int = 5,
    length_penalty: float = 1.0,
    n_best: int = 1,
) -> list[list[Hypothesis]]:
    """Beam search; returns the ``n_best`` hypotheses of every input, best first.

    A sentence is done once it has ``beam_size`` finished hypotheses (or reaches its length limit,
    where eos is forced); its K rows then leave the batch and the cache.
    """
    k, eos = beam_size, model.cfg.eos_id
    device = enc.memory.device
    batch = enc.memory.size(0)
    search = BeamSearch(k)
    # Every input starts as K copies of one row; only the first copy is alive at step 0.
    cache: KVCache = model.start_cache(enc, capacity=initial_capacity(limits)).index_select(
        torch.arange(batch, device=device).repeat_interleave(k)
    )
    scores = torch.zeros(batch, k, device=device)
    scores[:, 1:] = -math.inf
    tokens = torch.full((batch * k,), model.cfg.bos_id, dtype=torch.long, device=device)
    history = torch.empty(batch * k, 0, dtype=torch.long, device=device)  # (A*K, t)
    active = torch.arange(batch, device=device)  # original index of every active sentence
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    offsets = torch.arange(batch, device=device)[:, None] * k  # (A, 1): first row of each sentence
    ranks = torch.arange(2 * k, device=device)
    for t in range(int(limits.max())):
        logits, cache = model.decode_step(tokens, cache)
        lprobs = torch.log_softmax(logits.float(), dim=-1).view(len(active), k, -1)  # (A, K, V)
        at_limit = limits[active] <= t + 1  # (A,)
        if bool(at_limit.any()):  # force eos, keeping its probability
            eos_lp = lprobs[at_limit, :, eos]
            lprobs[at_limit] = -math.inf
            lprobs[at_limit, :, eos] = eos_lp
        cand_scores, cand_tokens, cand_beams = search.step(lprobs, scores)  # (A, 2K)
        is_eos = cand_tokens == eos
        # Finished hypotheses: eos among the K best candidates.
        ended = is_eos[:, :k] & (cand_scores[:, :k] > -math.inf)
        for a, r in ended.nonzero().tolist():
            hyps = finished[int(active[a])]
            if len(hyps) < k:
                lp = float(cand_scores[a, r])
                prefix = history[a * k + int(cand_beams[a, r])].tolist()
                hyps.append(Hypothesis(prefix, length_normalized(lp, t + 1, length_penalty), lp))
        # The next beams: the K best candidates that do not end in eos.
        order = (is_eos.long() * 2 * k + ranks).argsort(dim=1)[:, :k]  # (A, K)
        scores = cand_scores.gather(1, order)
        next_tokens = cand_tokens.gather(1, order)
        rows = (offsets[: len(active)] + cand_beams.gather(1, order)).view(-1)  # (A*K,) parent rows
        done = at_limit | torch.tensor([len(finished[int(i)]) >= k for i in active.tolist()], device=device)
        if bool(done.all()):
            break
        dropped = bool(done.any())
        if dropped:  # drop finished sentences in the same index_select that reorders beams
            keep = (~done).nonzero().squeeze(1)
            rows = rows.view(-1, k)[keep].view(-1)
            active, scores, next_tokens = active[keep], scores[keep], next_tokens[keep]
        history = torch.cat([history[rows], next_tokens.view(-1, 1)], dim=1)
        tokens = next_tokens.view(-1)
        # Beams only move within their sentence: the source side of the cache changes only on a drop.
        cache = cache.index_select(rows, same_sources=not dropped)
    return [sorted(hyps, key=lambda h: h.score, reverse=True)[:n_best] for hyps in finished]
