"""One decoding step with shapes that do not steer the code, so that it compiles into one graph.

``Transformer.decode_step`` is the eager reference: it slices the cache to the longest row, picks a
plain or scattered cache write by looking at the rows, and leaves token choice to Python. Each of
those is a decision made on data, so a compiler would have to guard on it and recompile. Here the
running batch lives in buffers of fixed capacity (``model.static_slots.StaticSlots``) and the step
sees the first R rows and the first C cached / S source positions of them; R, C and S are symbols
of the graph, and everything else that varies is data in tensors:

- each row attends to its own ``positions[r]`` written positions (the rest masked by an additive
  bias built in the graph) and to its new key apart; its new key/value is returned, and written
  into the cache by the caller;
- source padding is an additive bias too (``src_bias``), computed once when the row joins;
- the next-token choice is in the graph: every row's ``argmax`` (greedy rows need nothing else, and
  no log-softmax), and for the rows listed in ``beam_rows`` the ``top`` best log-probabilities and
  the log-probability of eos (the best 2K extensions of K beams are always among each beam's own
  best 2K; a row at its length limit may only end). A batch of greedy and beam inputs is one graph.

Attention is written as products and sums over the head width (``(q * k).sum(-1)``) rather than
``matmul``: the cache views are not contiguous (their rows are strided by the buffer's capacity), so
a matmul copied every key and value of every layer into a batch of tiny matrices at every step
(half of a compiled step's time at 32 rows); the sums read the buffers in place, vectorized over
the head width. The rows never mix: every operator is row-wise but the matrix products of the
linear layers, whose rows are independent.

What remains on the host per step is the search's bookkeeping (``model.search.choose_step``). The
same module runs eagerly (the reference in tests) or compiled (``model.compiled_step``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.layers import CrossAttention, SelfAttention, merge_heads, split_heads
from model.search import argmax_rows, topk_rows
from model.transformer import Transformer

# What a step returns: (choice, top_tokens, top_lprobs, eos_lprob, new_kv), see StaticStep.forward.
StepOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


class StaticStep(nn.Module):
    """``forward(tokens, positions, self_kv, cross_kv, src_bias, beam_rows)``: one token per row, R rows.

    The cache is row-major (``model.static_slots.StaticSlots``): ``self_kv`` (R, L, 2, H, C, Dh)
    holds each row's ``positions[r]`` written positions (the rest is masked); ``cross_kv``
    (R, L, 2, H, S, Dh); ``src_bias`` (R, 1, 1, S) additive, 0 on real source tokens, -inf after.
    ``tokens``, ``positions`` (R,) long; ``beam_rows`` (B,) long, B >= 1: the rows whose best
    ``top`` candidates the search needs (a batch of greedy inputs only passes one row, unused).

    Returns ``(choice, top_tokens, top_lprobs, eos_lprob, new_kv)``: the argmax of each row's
    logits (R,); the best ``top`` next tokens of each of ``beam_rows`` and their log-probs (B, top),
    and the log-prob of eos (B,); the new keys/values (R, L, 2, H, Dh), which the caller writes into
    the cache at ``positions`` after the step (a graph that wrote into its input buffer copied all of
    it at every step).
    """

    def __init__(self, model: Transformer, *, top: int) -> None:
        super().__init__()
        self.model = model
        self.top = top  # candidates per beam row: at least twice the largest beam
        self.eos = model.cfg.eos_id

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        self_kv: Tensor,
        cross_kv: Tensor,
        src_bias: Tensor,
        beam_rows: Tensor,
    ) -> StepOutputs:
        m = self.model
        keys = torch.arange(self_kv.size(4), device=tokens.device)  # (C,)
        # Each row reads the positions it has written before; its own new key is added apart.
        hidden = (keys[None, :] >= positions[:, None])[:, None, :]  # (R, 1, C)
        self_bias = torch.zeros(hidden.shape, dtype=src_bias.dtype, device=tokens.device)
        self_bias = self_bias.masked_fill(hidden, float("-inf"))  # (R, 1, C)
        x = m._embed(tokens[:, None], positions[:, None], source=False)  # (R, 1, D)
        new_kv: list[Tensor] = []  # per layer (R, 2, H, Dh), appended by _self_attn
        for i, layer in enumerate(m.decoder):
            kv, ckv = self_kv[:, i], cross_kv[:, i]  # (R, 2, H, C, Dh), (R, 2, H, S, Dh)
            x = layer.self_norm(x, lambda y: _self_attn(layer.self_attn, y, kv, self_bias, new_kv))  # noqa: B023
            x = layer.cross_norm(x, lambda y: _cross_attn(layer.cross_attn, y, ckv, src_bias[:, 0]))  # noqa: B023
            x = layer.ff_norm(x, layer.ff)
        logits = m._logits(x)[:, 0]  # (R, V)
        # (R,): greedy needs no normalisation; blocked (the compiled plain argmax walked each row one
        # element at a time: a sixth of a step at 64 rows); min_rows=0: no branch on the batch size
        choice = argmax_rows(logits, min_rows=0)
        # The best candidates of the beam rows: the top logits are the top log-probs; only those,
        # and eos's, are normalized (as log_softmax does: x - max - log(sum(exp(x - max)))).
        rows = logits.index_select(0, beam_rows).float()  # (B, V)
        top_logits, indices = topk_rows(rows, self.top)  # (B, top), best first
        most = rows.amax(-1, keepdim=True)  # (B, 1)
        log_sum = torch.log(torch.exp(rows - most).sum(-1, keepdim=True))  # (B, 1)
        values = top_logits - most - log_sum  # (B, top)
        eos = (rows[:, self.eos : self.eos + 1] - most - log_sum)[:, 0]  # (B,)
        return choice, indices, values, eos, torch.stack(new_kv, dim=1)  # new: (R, L, 2, H, Dh)


def _self_attn(attn: SelfAttention, x: Tensor, kv: Tensor, bias: Tensor, new_kv: list[Tensor]) -> Tensor:
    """Attention over the cached keys (``kv`` (R, 2, H, C, Dh), masked by ``bias`` (R, 1, C)) and
    the row's own new key; appends the new key/value (R, 2, H, Dh) to ``new_kv``."""
    q, k, v = (t[:, :, 0] for t in split_heads(attn.qkv(x), 3, attn.heads))  # each (R, H, Dh)
    scale = q.size(-1) ** -0.5
    cached = (q[:, :, None] * kv[:, 0]).sum(-1) * scale + bias  # (R, H, C)
    own = (q * k).sum(-1, keepdim=True) * scale  # (R, H, 1)
    # The row's own key first: each score then sits at the same place of the softmax's vectorized
    # sums whatever C (the longest row) is, and the masked keys after a row's own add exact zeros,
    # so a row's result does not depend on the other rows' lengths.
    p = torch.softmax(torch.cat([own, cached], dim=-1), dim=-1)  # (R, H, 1+C)
    y = p[..., :1] * v + (p[..., 1:, None] * kv[:, 1]).sum(-2)  # (R, H, Dh)
    new_kv.append(torch.stack([k, v], dim=1))  # (R, 2, H, Dh)
    return attn.out(merge_heads(y[:, :, None]))  # (R, 1, D)


def _cross_attn(attn: CrossAttention, x: Tensor, kv: Tensor, bias: Tensor) -> Tensor:
    """Attention over the source (``kv`` (R, 2, H, S, Dh), padding masked by ``bias`` (R, 1, S))."""
    q = split_heads(attn.q(x), 1, attn.heads)[0, :, :, 0]  # (R, H, Dh)
    scores = (q[:, :, None] * kv[:, 0]).sum(-1) * q.size(-1) ** -0.5 + bias  # (R, H, S)
    y = (torch.softmax(scores, dim=-1)[..., None] * kv[:, 1]).sum(-2)  # (R, H, Dh)
    return attn.out(merge_heads(y[:, :, None]))  # (R, 1, D)
