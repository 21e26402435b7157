"""The encoder-decoder Transformer of "Attention Is All You Need", with an explicit KV cache.

``forward`` runs teacher-forced training; inference is ``encode`` once, ``start_cache`` once, then
``decode_step`` per generated token. The cache is data (model.cache.KVCache) passed in and out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import KVCache
from model.config import ModelConfig
from model.layers import (
    DecoderLayer,
    EncoderLayer,
    Packing,
    SinusoidalPositions,
    StepInfo,
    aligned,
    attention_bias,
)

# Inference packs the encoder's real tokens when padding is at least this share of the batch.
PACK_PADDING = 0.1

M = TypeVar("M", bound=nn.Module)


@dataclass
class EncoderOutput:
    memory: Tensor  # (B, S, D)
    src_mask: Tensor  # (B, S) bool, True on real tokens
    packed: Tensor | None = None  # (1, N, D): memory's real tokens, when the encoder ran packed
    packing: Packing | None = None


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_scale = math.sqrt(cfg.d_model)
        # Target embedding; with tie_embeddings it is also the source embedding and the output projection.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.src_embed = (
            None if cfg.tie_embeddings else nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        )
        self.out_proj = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Set by model.prepack for CPU inference: the tied projection with its weight pre-packed.
        self.logits_proj: nn.Module | None = None
        self.positions = SinusoidalPositions(cfg.max_positions, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        # ModuleList registers the layers; the annotation tells type checkers what they hold.
        self.encoder: list[EncoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            EncoderLayer(cfg) for _ in range(cfg.encoder_layers)
        )
        self.decoder: list[DecoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            DecoderLayer(cfg) for _ in range(cfg.decoder_layers)
        )
        # Pre-LN leaves the residual stream unnormalised, so each stack ends with a LayerNorm.
        self.encoder_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.pre_norm else None
        self.decoder_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.pre_norm else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for emb in (self.embed, self.src_embed):
            if emb is not None:
                # N(0, D^-1/2): after the sqrt(D) scale, embeddings have unit variance like the positions.
                nn.init.normal_(emb.weight, std=self.cfg.d_model**-0.5)
                with torch.no_grad():
                    emb.weight[self.cfg.pad_id].zero_()

    # -- embeddings -------------------------------------------------------------------------------
    def _embed(self, ids: Tensor, positions: Tensor, source: bool) -> Tensor:
        emb = self.src_embed if source and self.src_embed is not None else self.embed
        return self.dropout(emb(ids) * self.embed_scale + self.positions(positions))

    def _logits(self, x: Tensor) -> Tensor:
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        if self.logits_proj is not None:
            return self.logits_proj(x)
        return self.out_proj(x) if self.out_proj is not None else F.linear(x, self.embed.weight)

    # -- encoder ----------------------------------------------------------------------------------
    def encode(self, src: Tensor) -> EncoderOutput:
        """src (B, S) token ids, right-padded with pad_id."""
        src_mask = src != self.cfg.pad_id  # (B, S)
        x = self._embed(src, torch.arange(src.size(1), device=src.device), source=True)  # (B, S, D)
        key_mask = src_mask[:, None, None, :]  # (B, 1, 1, S): broadcast over heads and queries
        packing = None
        if not self.training and int(src_mask.sum()) <= (1 - PACK_PADDING) * src_mask.numel():
            packing = Packing.of(src_mask)  # padding is worth skipping: real tokens only
            x = packing.pack(x)  # (1, N, D)
        for layer in self.encoder:
            x = layer(x, key_mask, packing)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        if packing is None:
            return EncoderOutput(memory=x, src_mask=src_mask)
        return EncoderOutput(memory=packing.unpack(x), src_mask=src_mask, packed=x, packing=packing)

    # -- decoder, whole prefix (training; the reference for the cache) ----------------------------
    def decode(self, tgt_in: Tensor, enc: EncoderOutput) -> Tensor:
        """tgt_in (B, T) = bos + target[:-1]; returns logits (B, T, V)."""
        x = self._embed(tgt_in, torch.arange(tgt_in.size(1), device=tgt_in.device), source=False)
        key_mask = enc.src_mask[:, None, None, :]  # (B, 1, 1, S)
        for layer in self.decoder:
            x = layer(x, layer.cross_attn.project_kv(enc.memory), key_mask)
        return self._logits(x)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode(tgt_in, self.encode(src))

    # -- decoder, incremental ---------------------------------------------------------------------
    def start_cache(self, enc: EncoderOutput, capacity: int = 32) -> KVCache:
        """A cache for ``enc``'s rows: cross-attention K/V projected now, once; self-attention K/V
        preallocated for ``capacity`` positions (it grows if decoding goes further)."""
        memory = enc.memory if enc.packed is None else enc.packed
        cross_kv = torch.stack([layer.cross_attn.project_kv(memory, enc.packing) for layer in self.decoder])
        n_layers, _, b, h, _, dh = cross_kv.shape  # (L, 2, B, H, S, Dh)
        return KVCache(
            self_kv=cross_kv.new_zeros(n_layers, 2, b, h, capacity, dh),
            cross_kv=cross_kv,
            src_mask=enc.src_mask,
            lengths=torch.zeros(b, dtype=torch.long, device=cross_kv.device),
            max_length=0,
            uniform=True,
        )

    def decode_step(self, tokens: Tensor, cache: KVCache) -> tuple[Tensor, KVCache]:
        """Feed one token per row, (B,); returns next-token logits (B, V) and the extended cache."""
        positions = cache.lengths  # (B,): each row's new token goes at its own prefix length
        length = cache.max_length + 1
        keys = aligned(length)  # KEY_ALIGN: the same keys whatever the other rows' lengths
        cache.reserve(keys)
        x = self._embed(tokens[:, None], positions[:, None], source=False)  # (B, 1, D)
        # Each row sees its written positions only (the others: unwritten, or beyond its length).
        arange = torch.arange(keys, device=tokens.device)
        self_mask = attention_bias((arange[None, :] <= positions[:, None])[:, None, None, :], x.dtype)
        step = StepInfo(length=length, keys=keys, uniform=cache.uniform, self_mask=self_mask)  # (B, 1, 1, T)
        src_mask = attention_bias(cache.src_mask[:, None, None, :], x.dtype)  # (B, 1, 1, S)
        for i, layer in enumerate(self.decoder):
            x = layer.step(x, cache.self_kv[i], cache.cross_kv[i], src_mask, positions, step)
        cache.lengths = positions + 1
        cache.max_length = length
        return self._logits(x)[:, 0], cache


def replace_modules(root: M, replacement: Callable[[nn.Module], nn.Module | None]) -> M:
    """Swap, in place, every submodule of ``root`` for which ``replacement`` returns a module."""
    for module in list(root.modules()):
        for name, child in list(module.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(module, name, new)
    return root


def strip_dropout(model: M) -> M:
    """Replace every ``nn.Dropout`` with ``nn.Identity``, for a model that only runs inference.

    In eval mode a Dropout changes nothing but is still a module call and an ``aten::dropout``
    dispatch: 13 of them per decoding step cost ~6% of a step at 1 and 30 rows on one CPU thread
    (paired A/B, BENCHMARKS.md "Levers measured")."""
    return replace_modules(model, lambda m: nn.Identity() if isinstance(m, nn.Dropout) else None)
