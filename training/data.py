"""A prepared corpus (``training.prepare``), memory-mapped, and the padded batches read from it.

The token arrays stay on disk: a batch reads its pairs' tokens through the memory maps, and the
pages it touched are let go of once it is built (``PreparedCorpus.release``: the kernel maps ~16
pages around each page read, so a few thousand random reads would otherwise keep hundreds of MB
of the files resident), so the trainer's resident memory stays the same whether the corpus has
thousands of pairs or hundreds of millions.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from model.checkpoint import ModelInfo, source_prefix
from model.config import ModelConfig
from model.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from training.prepare import MANIFEST, SPM_FILE, model_info
from training.sampling import EpochPlan, PlannedBatch
from training.text import DataError, read_lines, sha256_file

__all__ = ["Batch", "DataError", "PreparedCorpus", "collate", "iterate", "read_lines"]


class Mapped:
    """A read-only array of a file, memory-mapped: pages are read when touched, and ``release``
    drops them from this process (the kernel's page cache keeps them for the next reader)."""

    def __init__(self, path: Path, dtype: Any) -> None:
        self._mmap: mmap.mmap | None = None
        with path.open("rb") as f:
            if f.seek(0, 2) == 0:  # an empty file cannot be mapped
                self.array: np.ndarray = np.zeros(0, dtype)
                return
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.array = np.frombuffer(self._mmap, dtype)

    def release(self) -> None:
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)


class TokenFile:
    """The encoded lines of one input file."""

    def __init__(self, root: Path, file_id: str, dtype: str) -> None:
        self.file_id = file_id  # the input's name without .gz: "train.de"
        self.tokens = Mapped(root / f"{file_id}.tokens", dtype)
        self.offsets = Mapped(root / f"{file_id}.offsets", np.int64)

    def line(self, i: int) -> np.ndarray:
        o = self.offsets.array
        return self.tokens.array[o[i] : o[i + 1]]


@dataclass
class Direction:
    """The usable pairs of one direction in one split."""

    name: str  # "de-en"
    source: str
    target: str
    src: TokenFile
    tgt: TokenFile
    pairs: Mapped  # int64 line numbers
    sizes: Mapped  # int32 padded sizes (what batching counts)
    prefix: list[int]  # ids before every source sentence (the target-language token, if any)

    def __len__(self) -> int:
        return len(self.pairs.array)

    def example(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        line = int(self.pairs.array[k])
        return self.src.line(line), self.tgt.line(line)


class PreparedCorpus:
    """A prepared corpus directory, opened: its vocabulary, and every direction's training and
    validation pairs as memory-mapped arrays."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            self.manifest = json.loads((self.root / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"{self.root / MANIFEST}: not a prepared corpus ({e})") from e
        self.spm_path = self.root / SPM_FILE
        self.tokenizer = Tokenizer(self.spm_path)
        self.vocab_sha256: str = self.manifest["spec"]["vocab_sha256"]
        names = list(self.manifest["directions"]["train"])
        self.pairs = [(n.split("-")[0], n.split("-")[1]) for n in names]
        self.target_prefix: dict[str, list[int]] = self.manifest["target_prefix"]
        self.splits: dict[str, str] = self.manifest["spec"]["splits"]
        self._files: dict[str, TokenFile] = {}
        self._info = self.info(ModelConfig(vocab_size=self.manifest["vocab_size"]))
        self.train = [self._direction("train", n) for n in names]
        self.valid = [self._direction("valid", n) for n in names]

    def info(self, config: ModelConfig) -> ModelInfo:
        """The metadata of a model trained on this corpus (bilingual, or multilingual)."""
        return model_info(config, self.pairs, self.target_prefix)

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
            Mapped(self.root / f"{prefix}.pairs", np.int64),
            Mapped(self.root / f"{prefix}.sizes", np.int32),
            source_prefix(self._info, target),
        )

    def valid_text(self, direction: Direction) -> tuple[list[str], list[str]]:
        """The validation sources and references of ``direction``, as text (for BLEU)."""
        src, ref = direction.src.file_id, direction.tgt.file_id
        return read_lines(self.root / f"{src}.txt"), read_lines(self.root / f"{ref}.txt")

    @property
    def train_pairs(self) -> int:
        return sum(len(d) for d in self.train)

    def release(self) -> None:
        """Let go of every mapped page this process touched (they stay in the page cache)."""
        for f in self._files.values():
            f.tokens.release()
            f.offsets.release()
        for d in self.train + self.valid:
            d.pairs.release()
            d.sizes.release()

    def check_vocabulary(self, path: Path) -> None:
        if sha256_file(path) != self.vocab_sha256:
            raise DataError(f"{self.root}: prepared with another vocabulary than {path}")


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


def collate(examples: Sequence[Example]) -> Batch:
    s_len = max(len(p) + len(s) for p, s, _ in examples) + 1
    t_len = max(len(t) for _, _, t in examples) + 1
    src = np.full((len(examples), s_len), PAD_ID, dtype=np.int64)
    tgt_in = np.full((len(examples), t_len), PAD_ID, dtype=np.int64)
    tgt_out = np.full((len(examples), t_len), PAD_ID, dtype=np.int64)
    for i, (p, s, t) in enumerate(examples):
        n = len(p)
        src[i, :n] = p
        src[i, n : n + len(s)] = s
        src[i, n + len(s)] = EOS_ID
        tgt_in[i, 0] = BOS_ID
        tgt_in[i, 1 : len(t) + 1] = t
        tgt_out[i, : len(t)] = t
        tgt_out[i, len(t)] = EOS_ID
    n_tokens = sum(len(t) + 1 for _, _, t in examples)
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out), n_tokens)


def batch_of(directions: Sequence[Direction], planned: PlannedBatch) -> Batch:
    examples: list[Example] = []
    for d, k in zip(planned.directions.tolist(), planned.indices.tolist(), strict=True):
        examples.append((directions[d].prefix, *directions[d].example(k)))
    return collate(examples)


def iterate(
    corpus: PreparedCorpus, directions: Sequence[Direction], plan: EpochPlan, start: int = 0
) -> Iterator[Batch]:
    """The batches of ``plan`` from the ``start``-th on, read from ``corpus``; the mapped pages a
    batch touched are let go of once it is built (~0.1 ms)."""
    for planned in plan.batches(start):
        batch = batch_of(directions, planned)
        corpus.release()
        yield batch
