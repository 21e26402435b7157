"""Architecture hyper-parameters of the Transformer (one dataclass, saved as config.json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class ModelConfig:
    vocab_size: int = 8000  # joint SentencePiece vocabulary (source and target share it)
    d_model: int = 512  # width of every residual stream
    n_heads: int = 8  # attention heads; d_model must be divisible by it
    encoder_layers: int = 6
    decoder_layers: int = 6
    d_ff: int = 2048  # inner width of the position-wise feed-forward block
    dropout: float = 0.1  # on embeddings and on every residual branch
    attention_dropout: float = 0.0  # on attention probabilities (inside SDPA)
    activation_dropout: float = 0.0  # after the ReLU of the feed-forward block
    pre_norm: bool = False  # False: post-LN as in the paper; True: pre-LN (+ a final LayerNorm per stack)
    max_positions: int = 1024  # rows of the sinusoidal table; longest source or target in tokens
    tie_embeddings: bool = True  # one matrix for source embedding, target embedding and output projection
    layer_norm_eps: float = 1e-5
    pad_id: int = 0  # special ids are fixed by model.tokenizer; stored here so the model needs no tokenizer
    bos_id: int = 2
    eos_id: int = 3

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**data)
