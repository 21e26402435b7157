"""A forced output prefix: target tokens every output of an input starts with, decoded as
CTranslate2 decodes ``translate_batch(..., target_prefix=[[...]])`` (an Argos package's
``target_prefix``, kept in a model directory as ``ModelInfo.output_prefix``: the target-language
token of a multilingual model).

CTranslate2's rules (``update_sample_with_prefix`` in its decoding.cc), which both searches follow
(``Beam``'s in Python, ``Beam.force``; the device's, ``model.decoding.device_search``):

- For the first len(prefix) steps every beam of the input takes the prefix's token, whatever the
  model prefers, and only the first beam stays alive (as at the start). The prefix adds nothing
  to the score: CTranslate2 overwrites the score of those steps with 0, so a hypothesis's log-prob
  is that of its continuation given the prefix (no log-prob of the forced token is needed, nor the
  step's ``forced`` columns). Only the length limit ends an input during its prefix.
- The prefix is part of the hypothesis: its tokens (CTranslate2 returns them), its length limit
  and its length normalization count it. It decodes to nothing (``model.directory.load_tokenizer``
  skips its ids, as Argos strips it).
- With beams (K > 1), at the first step after the prefix an eos among the candidates other than
  the best does not end a hypothesis: CTranslate2 turns it into a dead beam (token 0, score -1e10:
  finite, so the slot is taken), to keep prefix-only outputs from winning (its issue #277).
  ``drop_secondary_eos`` does the same. (Greedy search has no such rule; nor do constrained
  inputs here, which CTranslate2 does not decode.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# CTranslate2's score and token for an eos candidate dropped at the first step after the prefix:
# finite, so that the candidate still takes a beam's slot (a dead one: it never ranks again).
DROPPED_SCORE = -1e10
DROPPED_TOKEN = 0


def check_prefix(prefix: tuple[int, ...], vocab_size: int, specials: set[int]) -> None:
    """``ValueError`` for a prefix token the decoder cannot take: outside the vocabulary (it would
    fail the whole batch's step) or a special (pad, bos, eos)."""
    bad = sorted({t for t in prefix if not 0 <= t < vocab_size} | (set(prefix) & specials))
    if bad:
        raise ValueError(f"output prefix tokens {bad} cannot be generated")


def drop_secondary_eos(scores: Tensor, tokens: Tensor, free: Tensor, eos: int) -> tuple[Tensor, Tensor]:
    """Candidates (A, C), best first, with CTranslate2's rule for the inputs at their first step
    after a prefix (``free``, (A,) bool): an eos ranked after the best becomes a dead candidate
    (``DROPPED_SCORE``, ``DROPPED_TOKEN``). Candidates already impossible (-inf) stay so."""
    rank = torch.arange(scores.size(1), device=scores.device)
    dropped = free[:, None] & (rank >= 1) & (tokens == eos) & (scores != -math.inf)
    return torch.where(dropped, DROPPED_SCORE, scores), torch.where(dropped, DROPPED_TOKEN, tokens)


def force_candidates(
    scores: Tensor, tokens: Tensor, beams: Tensor, *, forcing: Tensor, token: Tensor, first: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Candidates (A, C) scores, tokens and source beams, best first, where the inputs in their
    prefix (``forcing``, (A,) bool) have one: their first beam (score ``first``, (A,)) extended by
    ``token`` (A,), the prefix's; the others impossible (-inf). The beam rule then keeps that one
    beam alive and ends nothing (``model.decoding.device_search._beams``), as ``Beam.force``."""
    rank = torch.arange(scores.size(1), device=scores.device)
    forced = forcing[:, None]
    only = torch.where(rank == 0, first[:, None].to(scores.dtype), -math.inf)
    return (
        torch.where(forced, only, scores),
        torch.where(forced, token[:, None], tokens),
        torch.where(forced, 0, beams),
    )
