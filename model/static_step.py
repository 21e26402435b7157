"""One decoding step with static shapes, so that it compiles into one graph.

``Transformer.decode_step`` is the eager reference: it slices the cache to the longest row, picks a
plain or scattered cache write by looking at the rows, and leaves token choice to Python. Each of
those is a decision made on data, so a compiler would have to guard on it and recompile. Here the
running batch has a fixed capacity (``Bucket``: rows, cached positions, source positions), and
everything that varies is data in tensors:

- rows beyond the live ones are padding: token ``pad``, position 0, one visible source key (their
  results are finite and ignored, and rows never mix: every operator here is row-wise but the
  matrix products, whose rows are independent);
- each row writes its new key/value at its own position (one scatter for all rows, in place into
  the cache buffers, which are graph inputs) and attends to positions ``<= position`` through an
  additive mask built in the graph;
- source padding is an additive mask too (``src_bias``), computed once when the row joins;
- the next-token choice is in the graph: greedy rows take ``argmax`` (and need no log-softmax),
  beam rows the ``top`` best log-probabilities of their row (the best 2K extensions of K beams are
  always among each beam's own best 2K) and the log-probability of eos (a row at its length limit
  may only end).

What remains on the host per step is the search's bookkeeping (``model.search``) on (R, top) numbers.
The same function runs eagerly (the reference in tests) or compiled (``model.compiled``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.layers import CrossAttention, SelfAttention, merge_heads, split_heads
from model.search import argmax_rows
from model.transformer import Transformer


class StaticStep(nn.Module):
    """``forward(tokens, positions, self_kv, cross_kv, src_bias)``: one token per row, for R rows.

    The cache is row-major (``model.static_slots.StaticSlots``: the first R rows of a buffer with
    room for more are a view whose strides do not depend on R): ``self_kv`` (R, L, 2, H, C, Dh)
    holds each row's ``positions[r]`` written positions (the rest is masked); ``cross_kv``
    (R, L, 2, H, S, Dh); ``src_bias`` (R, 1, 1, S) additive, 0 on real source tokens, -inf after.
    ``tokens``, ``positions`` (R,) long.

    Returns ``(choice, top_tokens, top_lprobs, eos_lprob, new_kv)``: the argmax of each row's logits
    (R,); with ``top`` > 0 the best ``top`` next tokens of each row and their log-probs (R, top) and
    the log-prob of eos (R,) (with ``top`` = 0, zero-width and zeros); the new keys/values
    (R, L, 2, H, Dh), which the caller writes into the cache at ``positions`` after the step (a
    graph that mutates its input buffer copied all of it at every step).
    """

    def __init__(self, model: Transformer, *, top: int = 0) -> None:
        super().__init__()
        self.model = model
        self.top = top  # 0: greedy only (argmax); else also the best ``top`` log-probs of each row
        self.eos = model.cfg.eos_id

    def forward(
        self, tokens: Tensor, positions: Tensor, self_kv: Tensor, cross_kv: Tensor, src_bias: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        m = self.model
        keys = torch.arange(self_kv.size(4), device=tokens.device)  # (C,)
        # Each row reads the positions it has written before; its own new key is added apart.
        self_bias = torch.zeros(
            tokens.size(0), 1, 1, keys.size(0), dtype=src_bias.dtype, device=tokens.device
        ).masked_fill_((keys[None, :] >= positions[:, None])[:, None, None, :], float("-inf"))  # (R,1,1,C)
        x = m._embed(tokens[:, None], positions[:, None], source=False)  # (R, 1, D)
        new_kv: list[Tensor] = []  # per layer (R, 2, H, Dh), appended by _self_attn
        for i, layer in enumerate(m.decoder):
            kv, ckv = self_kv[:, i], cross_kv[:, i]  # (R, 2, H, C, Dh), (R, 2, H, S, Dh)
            x = layer.self_norm(x, lambda y: _self_attn(layer.self_attn, y, kv, self_bias, new_kv))  # noqa: B023
            x = layer.cross_norm(x, lambda y: _cross_attn(layer.cross_attn, y, ckv, src_bias))  # noqa: B023
            x = layer.ff_norm(x, layer.ff)
        logits = m._logits(x)[:, 0]  # (R, V)
        # (R,): greedy needs no normalisation; blocked (the compiled plain argmax walked each row one
        # element at a time: a sixth of a step at 64 rows); min_rows=0: no branch on the batch size
        choice = argmax_rows(logits, min_rows=0)
        new = torch.stack(new_kv, dim=1)  # (R, L, 2, H, Dh)
        if self.top == 0:
            empty = logits.new_zeros(logits.size(0), 0)
            return choice, empty.long(), empty, logits.new_zeros(logits.size(0)), new
        lp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
        values, indices = lp.topk(self.top, dim=-1)  # (R, top), best first
        return choice, indices, values, lp[:, self.eos], new


def _self_attn(attn: SelfAttention, x: Tensor, kv: Tensor, bias: Tensor, new_kv: list[Tensor]) -> Tensor:
    """Attention over the cached keys (``kv`` (R, 2, H, C, Dh), masked by ``bias``) and the row's own
    new key; appends the new key/value (R, 2, H, Dh) to ``new_kv``."""
    q, k, v = split_heads(attn.qkv(x), 3, attn.heads)  # each (R, H, 1, Dh)
    scale = q.size(-1) ** -0.5
    cached = torch.matmul(q, kv[:, 0].transpose(-1, -2)) * scale + bias  # (R, H, 1, C)
    own = (q * k).sum(-1, keepdim=True) * scale  # (R, H, 1, 1)
    p = torch.softmax(torch.cat([cached, own], dim=-1), dim=-1)  # (R, H, 1, C+1)
    y = torch.matmul(p[..., :-1], kv[:, 1]) + p[..., -1:] * v  # (R, H, 1, Dh)
    new_kv.append(torch.stack([k[:, :, 0], v[:, :, 0]], dim=1))  # (R, 2, H, Dh)
    return attn.out(merge_heads(y))


def _cross_attn(attn: CrossAttention, x: Tensor, kv: Tensor, bias: Tensor) -> Tensor:
    q = split_heads(attn.q(x), 1, attn.heads)[0]  # (R, H, 1, Dh)
    scores = torch.matmul(q, kv[:, 0].transpose(-1, -2)) * q.size(-1) ** -0.5 + bias  # (R, H, 1, S)
    return attn.out(merge_heads(torch.matmul(torch.softmax(scores, dim=-1), kv[:, 1])))
