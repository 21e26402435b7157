"""Architecture hyper-parameters of the Transformer (one dataclass, saved as config.json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

ACTIVATIONS = ("relu", "swish", "gelu")  # of the feed-forward block; swish is SiLU (Marian)
# "sinusoidal": the paper's table with sin and cos interleaved (dimension 2i sin, 2i+1 cos: our
# trained models); "sinusoidal_halves": [sin | cos] halves (Marian, fairseq, CTranslate2);
# "learned": a table in the weights (``positions.table``), e.g. imported as the toolkit stored it.
POSITIONS = ("sinusoidal", "sinusoidal_halves", "learned")


@dataclass
class ModelConfig:
    vocab_size: int = 8000  # the target vocabulary; also the source's unless source_vocab_size is set
    source_vocab_size: int = 0  # 0: the source shares the target's vocabulary
    d_model: int = 512  # width of every residual stream
    n_heads: int = 8  # attention heads; d_model must be divisible by it
    encoder_layers: int = 6
    decoder_layers: int = 6
    d_ff: int = 2048  # inner width of the position-wise feed-forward block
    dropout: float = 0.1  # on embeddings and on every residual branch
    attention_dropout: float = 0.0  # on attention probabilities (inside SDPA)
    activation_dropout: float = 0.0  # after the activation of the feed-forward block
    activation: str = "relu"  # one of ACTIVATIONS
    pre_norm: bool = False  # False: post-LN as in the paper; True: pre-LN (+ a final LayerNorm per stack)
    positions: str = "sinusoidal"  # one of POSITIONS; position p of a sequence reads row p
    max_positions: int = 1024  # rows of the position table; longest source or target in tokens
    scale_embeddings: bool = True  # token embeddings times sqrt(d_model) before the positions are added
    share_embeddings: bool = True  # the source embedding is the target embedding
    tie_output: bool = True  # the output projection is the target embedding
    output_bias: bool = False  # a bias on the output projection (Marian's final_logits_bias)
    layer_norm_eps: float = 1e-5
    source_eos: bool = True  # sources end with eos (ours, Marian); OpenNMT-py's (most Argos) do not
    # Special ids. Our trained models use SentencePiece's ids (model.tokenizer: 0..3); imported ones
    # keep their toolkit's. bos_id is the decoder's first input: Marian starts from pad.
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2
    eos_id: int = 3

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions {self.positions!r} is not one of {', '.join(POSITIONS)}")
        if self.share_embeddings and self.source_vocab_size not in (0, self.vocab_size):
            raise ValueError("share_embeddings needs one vocabulary: source_vocab_size must be 0")
        for name in ("pad_id", "unk_id", "bos_id", "eos_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name} {getattr(self, name)} is not an id of the vocabulary")

    @property
    def source_vocab(self) -> int:
        """Rows of the source embedding."""
        return self.source_vocab_size or self.vocab_size

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        if "tie_embeddings" in data:  # config.json written before the two were separate options
            tied = bool(data.pop("tie_embeddings"))
            data.setdefault("share_embeddings", tied)
            data.setdefault("tie_output", tied)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**data)
