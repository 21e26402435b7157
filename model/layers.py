"""The blocks of the Transformer figure: attention, feed-forward, Add & Norm, encoder and decoder layers.

Shapes: B batch, T target positions, S source positions, C cache capacity, H heads, Dh head width,
D model width. Boolean masks are True where attention is allowed (the convention of
``F.scaled_dot_product_attention``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import ModelConfig
from model.reproducible import ensure_strict

# Before MKL's first product in this process: a row's float32 bits must not depend on its
# neighbours or on the thread count (model/reproducible.py says why and what it costs).
ensure_strict()

# Attention reads its keys in whole multiples of KEY_ALIGN positions, the extra ones masked: a
# row's result then does not depend on how long its neighbours make the batch. With keys cut to
# the longest row, SDPA's vectorized softmax sums added a row's scores in an order that changed
# with the padding (16 floats a vector here; the rest one at a time): the encoder's output moved by
# ~1e-6, which int8's rounding turned into different translations for some sentences. Aligned to
# 16 positions, 40 of 40 encoder outputs were bit for bit those computed alone (8: 30 of 40).
KEY_ALIGN = 16


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``KEY_ALIGN``."""
    return -(-n // KEY_ALIGN) * KEY_ALIGN


def split_heads(x: Tensor, n: int, heads: int) -> Tensor:
    """(B, T, n*D) -> (n, B, H, T, Dh): n stacked projections (q/k/v) split into heads."""
    b, t, _ = x.shape
    return x.view(b, t, n, heads, -1).permute(2, 0, 3, 1, 4)  # (n, B, H, T, Dh)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, Dh) -> (B, T, D)."""
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)  # (B, T, D)


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a right-padded (B, S) batch are, so that the position-wise layers
    (linear projections, feed-forward, LayerNorm: most of the encoder's work) run on those N tokens
    only, as (1, N, D); attention alone needs the padded (B, S) layout. For inference: in a batch of
    sentences in arrival order, padding was ~40% of the positions."""

    index: Tensor  # (N,) flat positions b * S + s of the real tokens, in order
    batch: int  # B
    length: int  # S

    @classmethod
    def of(cls, mask: Tensor) -> Packing:
        """``mask`` (B, S): True on real tokens."""
        return cls(mask.reshape(-1).nonzero().squeeze(1), mask.size(0), mask.size(1))

    def pack(self, x: Tensor) -> Tensor:
        """(B, S, F) -> (1, N, F)."""
        return x.reshape(-1, x.size(-1)).index_select(0, self.index)[None]

    def unpack(self, x: Tensor) -> Tensor:
        """(1, N, F) -> (B, S, F), zeros at the padding."""
        out = x.new_zeros(self.batch * self.length, x.size(-1))
        out.index_copy_(0, self.index, x[0])
        return out.view(self.batch, self.length, -1)


def sinusoids(max_positions: int, d_model: int, *, halves: bool = False) -> Tensor:
    """The paper's sin/cos table (section 3.5), (max_positions, d_model): frequency i in dimensions
    2i (sin) and 2i+1 (cos), or with ``halves`` sin in the first half and cos in the second
    (Marian, fairseq and CTranslate2 lay it out so)."""
    pos = torch.arange(max_positions, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    sin, cos = torch.sin(pos * inv_freq), torch.cos(pos * inv_freq)  # each (P, D/2)
    if halves:
        return torch.cat([sin, cos], dim=1)
    return torch.stack([sin, cos], dim=2).flatten(1)  # (P, D/2, 2) -> interleaved (P, D)


class Positions(nn.Module):
    """Position encodings: a fixed sinusoidal buffer (not in the checkpoint: a function of the
    config) or, for ``positions="learned"``, a table in the weights."""

    table: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.positions == "learned":
            self.table = nn.Parameter(torch.zeros(cfg.max_positions, cfg.d_model))
        else:
            halves = cfg.positions == "sinusoidal_halves"
            table = sinusoids(cfg.max_positions, cfg.d_model, halves=halves)
            self.register_buffer("table", table, persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        return self.table[positions]


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused QKV projection (one matmul instead of three)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.n_heads
        self.dropout = cfg.attention_dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(
        self,
        x: Tensor,
        *,
        key_mask: Tensor | None = None,
        causal: bool = False,
        packing: Packing | None = None,
    ) -> Tensor:
        """Attention over the whole sequence ``x`` (B, T, D): encoder, or decoder in training.
        With ``packing``, ``x`` is (1, N, D), the real tokens only, and so is the result."""
        qkv = self.qkv(x)
        if packing is not None:
            qkv = packing.unpack(qkv)  # (B, T, 3D)
        q, k, v = split_heads(qkv, 3, self.heads)  # each (B, H, T, Dh)
        p = self.dropout if self.training else 0.0
        y = merge_heads(
            F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=p, is_causal=causal)
        )  # (B, T, D)
        return self.out(y if packing is None else packing.pack(y))

    def step(self, x: Tensor, kv: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """One new position per row: ``x`` (R, 1, D) attends to its row's cached keys (``kv``
        (R, 2, H, C, Dh), masked by the additive ``bias`` (R, 1, C)) and to its own new key.
        Returns the output (R, 1, D) and the new key/value (R, 2, H, Dh), which the caller writes
        into the cache (a step that wrote into its input buffer would copy all of it when compiled).

        Products and sums over the head width instead of ``matmul``: the cache's row views are
        strided by its capacity, and a matmul first copied every key of every layer into a batch of
        small contiguous matrices (half of a compiled step at 32 rows); the sums read in place.
        """
        q, k, v = (t[:, :, 0] for t in split_heads(self.qkv(x), 3, self.heads))  # each (R, H, Dh)
        scale = q.size(-1) ** -0.5
        cached = (q[:, :, None] * kv[:, 0]).sum(-1) * scale + bias  # (R, H, C)
        own = (q * k).sum(-1, keepdim=True) * scale  # (R, H, 1)
        # The row's own key first: each score then sits at the same place of the softmax's
        # vectorized sums whatever C (the longest row) is, and the masked keys after a row's own add
        # exact zeros, so a row's result does not depend on the other rows' lengths.
        p = torch.softmax(torch.cat([own, cached], dim=-1), dim=-1)  # (R, H, 1+C)
        y = p[..., :1] * v + (p[..., 1:, None] * kv[:, 1]).sum(-2)  # (R, H, Dh)
        return self.out(merge_heads(y[:, :, None])), torch.stack([k, v], dim=1)


class CrossAttention(nn.Module):
    """Decoder-to-encoder attention; keys/values depend only on the encoder output, so they are
    projected once per input (``project_kv``) and reused at every decoding step."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.n_heads
        self.dropout = cfg.attention_dropout
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def project_kv(self, memory: Tensor, packing: Packing | None = None) -> Tensor:
        """``memory`` (B, S, D), or (1, N, D) real tokens with ``packing``."""
        kv = self.kv(memory)
        if packing is not None:
            kv = packing.unpack(kv)  # (B, S, 2D), zeros at the padding (masked out anyway)
        return split_heads(kv, 2, self.heads)  # (2, B, H, S, Dh)

    def forward(self, x: Tensor, kv: Tensor, key_mask: Tensor) -> Tensor:
        q = split_heads(self.q(x), 1, self.heads)[0]  # (B, H, T, Dh)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=key_mask, dropout_p=p)
        return self.out(merge_heads(y))

    def step(self, x: Tensor, kv: Tensor, bias: Tensor) -> Tensor:
        """One position per row: ``x`` (R, 1, D) over its source (``kv`` (R, 2, H, S, Dh), padding
        masked by the additive ``bias`` (R, 1, S)); sums over the head width as ``SelfAttention.step``."""
        q = split_heads(self.q(x), 1, self.heads)[0, :, :, 0]  # (R, H, Dh)
        scores = (q[:, :, None] * kv[:, 0]).sum(-1) * q.size(-1) ** -0.5 + bias  # (R, H, S)
        y = (torch.softmax(scores, dim=-1)[..., None] * kv[:, 1]).sum(-2)  # (R, H, Dh)
        return self.out(merge_heads(y[:, :, None]))  # (R, 1, D)


ACTIVATION_FUNCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,  # the paper's
    "swish": F.silu,  # x * sigmoid(x): Marian (OPUS-MT)
    "gelu": F.gelu,  # the erf form
}


class FeedForward(nn.Module):
    """Position-wise FFN(x) = act(x W1 + b1) W2 + b2; act is ReLU in the paper."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.act = ACTIVATION_FUNCTIONS[cfg.activation]
        self.dropout = nn.Dropout(cfg.activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(self.act(self.fc1(x))))


class AddNorm(nn.Module):
    """Residual connection around a sublayer, with LayerNorm after it (post-LN, the paper) or
    before it (pre-LN: the residual stream is never normalised, which trains more stably)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.pre_norm

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.ff = FeedForward(cfg)
        self.attn_norm = AddNorm(cfg)
        self.ff_norm = AddNorm(cfg)

    def forward(self, x: Tensor, key_mask: Tensor, packing: Packing | None = None) -> Tensor:
        x = self.attn_norm(x, lambda y: self.self_attn(y, key_mask=key_mask, packing=packing))
        return self.ff_norm(x, self.ff)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.cross_attn = CrossAttention(cfg)
        self.ff = FeedForward(cfg)
        self.self_norm = AddNorm(cfg)
        self.cross_norm = AddNorm(cfg)
        self.ff_norm = AddNorm(cfg)

    def forward(self, x: Tensor, cross_kv: Tensor, src_mask: Tensor) -> Tensor:
        """Whole target prefix at once (training, and the reference for incremental decoding)."""
        x = self.self_norm(x, lambda y: self.self_attn(y, causal=True))
        x = self.cross_norm(x, lambda y: self.cross_attn(y, cross_kv, src_mask))
        return self.ff_norm(x, self.ff)

    def step(
        self, x: Tensor, self_kv: Tensor, cross_kv: Tensor, self_bias: Tensor, src_bias: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One position per row (``x`` (R, 1, D)) over this layer's part of the cache: ``self_kv``
        (R, 2, H, C, Dh) masked by ``self_bias`` (R, 1, C), ``cross_kv`` (R, 2, H, S, Dh) masked by
        ``src_bias`` (R, 1, S). Returns the output and the row's new key/value (R, 2, H, Dh)."""
        new: list[Tensor] = []

        def attend(y: Tensor) -> Tensor:
            out, kv = self.self_attn.step(y, self_kv, self_bias)
            new.append(kv)
            return out

        x = self.self_norm(x, attend)
        x = self.cross_norm(x, lambda y: self.cross_attn.step(y, cross_kv, src_bias))
        return self.ff_norm(x, self.ff), new[0]
