"""A prepared corpus (``training.prepare``), opened, and the padded batches read from it.

The token arrays stay on disk: a batch reads its pairs' tokens from them (``training.arrays``),
so the trainer's resident memory stays the same whether the corpus has thousands of pairs or
hundreds of millions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from model.checkpoint import (
    ModelDirError,
    ModelInfo,
    load_tokenizer,
    read_info,
    source_prefix,
    tokenizer_files,
)
from model.config import ModelConfig
from model.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from training.arrays import DiskArray
from training.prepare import MANIFEST, SPM_FILE, TOKENIZER_DIR, model_info
from training.sampling import EpochPlan, PlannedBatch
from training.text import DataError, read_lines

__all__ = ["Batch", "DataError", "PreparedCorpus", "Specials", "collate", "iterate", "read_lines"]


@dataclass(frozen=True)
class Specials:
    """The ids a batch adds around the tokens: padding, the decoder's first input, the end."""

    pad: int = PAD_ID
    bos: int = BOS_ID
    eos: int = EOS_ID
    source_eos: bool = True  # whether sources end with eos too (not OpenNMT-py's: Argos models)

    @classmethod
    def of(cls, config: ModelConfig) -> Specials:
        return cls(config.pad_id, config.bos_id, config.eos_id, config.source_eos)


class TokenFile:
    """The encoded lines of one input file."""

    def __init__(self, root: Path, file_id: str, dtype: str) -> None:
        self.file_id = file_id  # the input's name without .gz: "train.de"
        self.tokens = DiskArray(root / f"{file_id}.tokens", dtype)
        self.offsets = DiskArray(root / f"{file_id}.offsets", np.int64)

    def line(self, i: int) -> np.ndarray:
        start, stop = self.offsets[i : i + 2]
        return self.tokens[int(start) : int(stop)]


@dataclass
class Direction:
    """The usable pairs of one direction in one split."""

    name: str  # "de-en"
    source: str
    target: str
    src: TokenFile
    tgt: TokenFile
    pairs: DiskArray  # int64 line numbers
    sizes: DiskArray  # int32 padded sizes (what batching counts)
    prefix: list[int]  # ids before every source sentence (the target-language token, if any)
    specials: Specials = Specials()

    def __len__(self) -> int:
        return len(self.pairs)

    def example(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        line = self.pairs.item(k)
        return self.src.line(line), self.tgt.line(line)


class PreparedCorpus:
    """A prepared corpus directory, opened: its vocabulary, and every direction's training and
    validation pairs as arrays on disk."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            self.manifest = json.loads((self.root / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"{self.root / MANIFEST}: not a prepared corpus ({e})") from e
        self.spm_path = self.root / SPM_FILE
        # Fine-tuning (prepared with an initial model's tokenizer): that model's metadata, else None.
        self.init_info: ModelInfo | None = None
        if (self.root / TOKENIZER_DIR).is_dir():
            try:
                self.init_info = read_info(self.root / TOKENIZER_DIR)
                self.tokenizer = load_tokenizer(self.root / TOKENIZER_DIR, self.init_info)
            except ModelDirError as e:
                raise DataError(str(e)) from e
            config = self.init_info.config
        else:
            self.tokenizer = Tokenizer(self.spm_path)
            config = ModelConfig(vocab_size=self.manifest["vocab_size"])
        self.specials = Specials.of(config)
        self.vocab_sha256: str = self.manifest["spec"]["vocab_sha256"]
        names = list(self.manifest["directions"]["train"])
        self.pairs = [(n.split("-")[0], n.split("-")[1]) for n in names]
        self.target_prefix: dict[str, list[int]] = self.manifest["target_prefix"]
        self.splits: dict[str, str] = self.manifest["spec"]["splits"]
        self._files: dict[str, TokenFile] = {}
        self._info = self.info(config)
        self.train = [self._direction("train", n) for n in names]
        self.valid = [self._direction("valid", n) for n in names]

    def info(self, config: ModelConfig) -> ModelInfo:
        """The metadata of a model trained on this corpus (bilingual, or multilingual)."""
        return model_info(config, self.pairs, self.target_prefix)

    @property
    def tokenizer_source(self) -> Path:
        """What ``save_model_dir`` copies the tokenizer from: the SentencePiece model, or (fine-tuning)
        the directory of the initial model's tokenizer files."""
        return self.root / TOKENIZER_DIR if self.init_info is not None else self.spm_path

    @property
    def tokenizer_files(self) -> list[Path]:
        """The files of its tokenizer, as a model directory holds them."""
        if self.init_info is not None:
            return tokenizer_files(self.root / TOKENIZER_DIR)
        return [self.spm_path]

    def _direction(self, role: str, name: str) -> Direction:
        entry = self.manifest["directions"][role][name]
        files = []
        for side in ("src", "tgt"):
            if entry[side] not in self._files:
                self._files[entry[side]] = TokenFile(self.root, entry[side], self.manifest["token_dtype"])
            files.append(self._files[entry[side]])
        prefix = f"{self.splits[role]}.{name}"
        source, target = name.split("-")
        return Direction(
            name,
            source,
            target,
            files[0],
            files[1],
            DiskArray(self.root / f"{prefix}.pairs", np.int64),
            DiskArray(self.root / f"{prefix}.sizes", np.int32),
            source_prefix(self._info, target),
            self.specials,
        )

    def valid_text(self, direction: Direction) -> tuple[list[str], list[str]]:
        """The validation sources and references of ``direction``, as text (for BLEU)."""
        src, ref = direction.src.file_id, direction.tgt.file_id
        return read_lines(self.root / f"{src}.txt"), read_lines(self.root / f"{ref}.txt")

    @property
    def train_pairs(self) -> int:
        return sum(len(d) for d in self.train)


@dataclass
class Batch:
    src: Tensor  # (B, S) [target token] + source ids + eos, right-padded
    tgt_in: Tensor  # (B, T) bos + target ids: the decoder's input
    tgt_out: Tensor  # (B, T) target ids + eos: what the decoder must predict
    n_tokens: int  # real (non-pad) target tokens, the loss normaliser

    def to(self, device: torch.device) -> Batch:
        nb = device.type == "cuda"
        return Batch(
            self.src.to(device, non_blocking=nb),
            self.tgt_in.to(device, non_blocking=nb),
            self.tgt_out.to(device, non_blocking=nb),
            self.n_tokens,
        )


Example = tuple[Sequence[int], np.ndarray, np.ndarray]  # (source prefix, source ids, target ids)


def collate(examples: Sequence[Example], specials: Specials = Specials()) -> Batch:
    s_len = max(len(p) + len(s) for p, s, _ in examples) + 1
    t_len = max(len(t) for _, _, t in examples) + 1
    src = np.full((len(examples), s_len), specials.pad, dtype=np.int64)
    tgt_in = np.full((len(examples), t_len), specials.pad, dtype=np.int64)
    tgt_out = np.full((len(examples), t_len), specials.pad, dtype=np.int64)
    for i, (p, s, t) in enumerate(examples):
        n = len(p)
        src[i, :n] = p
        src[i, n : n + len(s)] = s
        if specials.source_eos:
            src[i, n + len(s)] = specials.eos
        tgt_in[i, 0] = specials.bos
        tgt_in[i, 1 : len(t) + 1] = t
        tgt_out[i, : len(t)] = t
        tgt_out[i, len(t)] = specials.eos
    n_tokens = sum(len(t) + 1 for _, _, t in examples)
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out), n_tokens)


def batch_of(directions: Sequence[Direction], planned: PlannedBatch) -> Batch:
    examples: list[Example] = []
    for d, k in zip(planned.directions.tolist(), planned.indices.tolist(), strict=True):
        examples.append((directions[d].prefix, *directions[d].example(k)))
    return collate(examples, directions[0].specials)


def iterate(directions: Sequence[Direction], plan: EpochPlan, start: int = 0) -> Iterator[Batch]:
    """The batches of ``plan`` (over ``directions``) from the ``start``-th on."""
    for planned in plan.batches(start):
        yield batch_of(directions, planned)
