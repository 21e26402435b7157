"""Label-smoothed cross-entropy (Szegedy et al. 2016; section 5.4 of the Transformer paper)."""

from __future__ import annotations

import torch
from torch import Tensor


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float, pad_id: int) -> tuple[Tensor, Tensor]:
    """Summed over real target tokens: (smoothed loss to optimise, plain NLL to report).

    logits (B, T, V), target (B, T). The smoothed target puts 1 - epsilon on the reference token and
    spreads epsilon uniformly over the vocabulary; both terms share one log_softmax.
    """
    lprobs = torch.log_softmax(logits.float(), dim=-1)  # float32 even under autocast: V-wide sums
    mask = target != pad_id
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T)
    uniform = -lprobs.mean(dim=-1)  # (B, T): cross-entropy against the uniform distribution
    loss = (1.0 - epsilon) * nll + epsilon * uniform
    return loss[mask].sum(), nll[mask].sum()
