"""The encoder-decoder Transformer of "Attention Is All You Need", with an explicit KV cache.

``forward`` runs teacher-forced training; inference is ``encode`` once, ``source_kv`` once, then
``step`` per generated token over the KV cache (model.cache), which is data the caller keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import ModelConfig
from model.layers import (
    DecoderLayer,
    EncoderLayer,
    Packing,
    Positions,
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
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        # Target embedding; also the source embedding with share_embeddings and the output projection
        # with tie_output.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.src_embed = (
            None
            if cfg.share_embeddings
            else nn.Embedding(cfg.source_vocab, cfg.d_model, padding_idx=cfg.pad_id)
        )
        self.out_proj = None if cfg.tie_output else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.output_bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.output_bias else None
        # Set by model.runtime.prepack for CPU inference: the output projection (and its bias) with
        # its weight prepared.
        self.logits_proj: nn.Module | None = None
        self.positions = Positions(cfg)
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

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in: its position table's (the embeddings of a model served
        in int8 are int8, ``model.runtime.prepack.Int8Embedding``)."""
        return self.positions.table.dtype

    @property
    def device(self) -> torch.device:
        return self.positions.table.device

    # -- embeddings -------------------------------------------------------------------------------
    def _embed(self, ids: Tensor, positions: Tensor, source: bool) -> Tensor:
        emb = self.src_embed if source and self.src_embed is not None else self.embed
        return self.dropout(emb(ids) * self.embed_scale + self.positions(positions))

    @property
    def output_weight(self) -> Tensor:
        """(V, D): the output projection's weight, the target embedding's when tied."""
        if self.out_proj is None and not self.cfg.tie_output:  # (model.runtime.prepack, keep_float=False)
            raise RuntimeError("a model prepared to serve keeps its output projection packed only")
        return self.out_proj.weight if self.out_proj is not None else self.embed.weight

    def _logits(self, x: Tensor) -> Tensor:
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        if self.logits_proj is not None:
            return self.logits_proj(x)
        return F.linear(x, self.output_weight, self.output_bias)

    # -- encoder ----------------------------------------------------------------------------------
    def encode(self, src: Tensor, packing: Packing | None = None) -> EncoderOutput:
        """src (B, S) token ids, right-padded with pad_id. ``packing``: where its real tokens are
        (``Packing.of`` its mask), for the position-wise layers to run on those only; by default
        made when padding is worth skipping (``PACK_PADDING``). A row's result is the same either
        way: every position-wise layer computes each position on its own."""
        src_mask = src != self.cfg.pad_id  # (B, S)
        x = self._embed(src, torch.arange(src.size(1), device=src.device), source=True)  # (B, S, D)
        key_mask = src_mask[:, None, None, :]  # (B, 1, 1, S): broadcast over heads and queries
        real = None if packing is not None or self.training else int(src_mask.sum())
        if real is not None and real <= (1 - PACK_PADDING) * src_mask.numel():
            packing = Packing.of(src_mask)  # padding is worth skipping: real tokens only
        if packing is not None:
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

    # -- decoder, incremental: one token per row over the KV cache (model.cache) ------------------
    def source_kv(self, enc: EncoderOutput) -> Tensor:
        """The cross-attention keys/values of ``enc``'s rows, projected once per input and read at
        every step: (B, L, 2, H, S, Dh), row-major as the cache keeps them."""
        memory = enc.memory if enc.packed is None else enc.packed
        kv = torch.stack([layer.cross_attn.project_kv(memory, enc.packing) for layer in self.decoder])
        return kv.permute(2, 0, 1, 3, 4, 5)  # (L, 2, B, H, S, Dh) -> (B, L, 2, H, S, Dh)

    def step(
        self,
        tokens: Tensor,
        positions: Tensor,
        self_kv: Tensor,
        cross_kv: Tensor,
        src_bias: Tensor,
        sources: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Feed one token per row: ``tokens``, ``positions`` (R,) (each row's written positions, and
        the position of its new token); ``self_kv`` (R, L, 2, H, C, Dh) holds each row's
        ``positions[r]`` keys/values (the rest is masked); ``cross_kv`` (N, L, 2, H, S, Dh) and
        ``src_bias`` (N, 1, 1, S) (additive, 0 on real source tokens and -inf on padding) hold N
        sources, row r reading source ``sources[r]`` ((R,) long; None: row r reads source r).

        Returns next-token logits (R, V) and the new keys/values (R, L, 2, H, Dh), written into the
        cache by the caller. Rows never mix (every operator is row-wise but the linear layers' matrix
        products, whose rows are independent), and no shape steers the code: one graph serves every
        batch when compiled (model.runtime). Compiled, a row's source is read where it lies (the
        index is part of each layer's attention kernel): the beams of an input read one copy.
        """
        keys = torch.arange(self_kv.size(4), device=tokens.device)  # (C,)
        hidden = (keys[None, :] >= positions[:, None])[:, None, :]  # (R, 1, C): not written yet
        self_bias = torch.zeros(hidden.shape, dtype=src_bias.dtype, device=tokens.device)
        self_bias = self_bias.masked_fill(hidden, float("-inf"))  # (R, 1, C)
        if sources is not None and _reads_its_own(sources, cross_kv):
            sources = None
        bias = src_bias[:, 0] if sources is None else src_bias[sources, 0]  # (R, 1, S)
        x = self._embed(tokens[:, None], positions[:, None], source=False)  # (R, 1, D)
        new_kv: list[Tensor] = []
        for i, layer in enumerate(self.decoder):
            kv = cross_kv[:, i] if sources is None else cross_kv[sources, i]  # (R, 2, H, S, Dh)
            x, new = layer.step(x, self_kv[:, i], kv, self_bias, bias)
            new_kv.append(new)  # (R, 2, H, Dh)
        return self._logits(x)[:, 0], torch.stack(new_kv, dim=1)  # (R, V), (R, L, 2, H, Dh)


def _reads_its_own(sources: Tensor, cross_kv: Tensor) -> bool:
    """Whether row r reads source r, known without waiting: run eagerly on the CPU, a gather
    of the sources would copy them at every step (OPUS-MT size, 64 rows: 56 -> 72 ms a step);
    compiled, a row's source is read in place anyway, and a device would have to be waited for."""
    if torch.compiler.is_compiling() or sources.device.type != "cpu" or len(sources) != len(cross_kv):
        return False
    return bool(torch.equal(sources, torch.arange(len(sources))))


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
    (paired A/B)."""
    return replace_modules(model, lambda m: nn.Identity() if isinstance(m, nn.Dropout) else None)
