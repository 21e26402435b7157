"""Reading parallel text: where each side of a direction is, and its lines, streamed.

Input files are ``{split}.{lang}[.gz]`` (Multi30k's layout: every language line-aligned with every
other) or ``{split}.{src}-{tgt}.{lang}[.gz]`` (OPUS's, for corpora that differ per pair).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from tqdm import tqdm

from training.config import DataConfig

CHUNK_LINES = 16_384  # lines per chunk: large enough to amortise one SentencePiece call over them


class DataError(ValueError):
    """Training data that cannot be used; the message names the file."""


# -- finding the input files -----------------------------------------------------------------------
def find_file(data_dir: str | Path, split: str, lang: str, pair: tuple[str, str] | None = None) -> Path:
    """The text of ``lang`` in ``split``: ``{split}.{src}-{tgt}.{lang}`` (either order of the pair;
    OPUS's layout, for corpora that differ per pair) or ``{split}.{lang}`` (Multi30k's: every
    language line-aligned with every other), each plain or ``.gz``."""
    stems = [f"{split}.{a}-{b}.{lang}" for a, b in ([pair, pair[::-1]] if pair else [])]
    for stem in [*stems, f"{split}.{lang}"]:
        for name in (stem, stem + ".gz"):
            path = Path(data_dir) / name
            if path.is_file():
                return path
    raise DataError(f"{Path(data_dir) / f'{split}.{lang}'}[.gz]: file not found")


def file_id(path: Path) -> str:
    """The name a prepared corpus gives an input file: its name without .gz."""
    return path.name.removesuffix(".gz")


def language_of(path: Path) -> str:
    return file_id(path).rsplit(".", 1)[-1]


@dataclass
class Sources:
    """Which input file holds each side of each direction, for the training and validation splits."""

    pairs: list[tuple[str, str]]
    splits: dict[str, str]  # "train" / "valid" -> the split's name in the data directory
    sides: dict[str, dict[str, tuple[Path, Path]]] = field(default_factory=dict)  # split -> "de-en" -> files

    @classmethod
    def find(cls, data: DataConfig) -> Sources:
        splits = {"train": data.train_split, "valid": data.valid_split}
        sides = {
            role: {
                f"{s}-{t}": (find_file(data.dir, name, s, (s, t)), find_file(data.dir, name, t, (s, t)))
                for s, t in data.pairs
            }
            for role, name in splits.items()
        }
        return cls(data.pairs, splits, sides)

    def files(self, role: str) -> dict[str, Path]:
        """Every input file of ``role`` ("train" or "valid") once, by file id."""
        return {file_id(p): p for pair in self.sides[role].values() for p in pair}


def fingerprint(path: Path) -> dict[str, Any]:
    """What identifies an input file without reading it (reading 10 GB to hash it would take minutes)."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


# -- reading text, streamed ------------------------------------------------------------------------
class _Progress:
    """A progress bar over an input file's bytes (compressed bytes for .gz: the size is known)."""

    def __init__(self, raw: BinaryIO, desc: str | None) -> None:
        self.raw = raw
        total = os.fstat(raw.fileno()).st_size
        self.bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=desc,
            file=sys.stderr,
            mininterval=1.0,
            disable=desc is None,
        )

    def update(self) -> None:
        self.bar.update(self.raw.tell() - self.bar.n)

    def close(self) -> None:
        self.update()
        self.bar.close()


def stream_lines(path: Path, desc: str | None = None, chunk: int = CHUNK_LINES) -> Iterator[list[str]]:
    """The lines of ``path`` (plain or gzip, UTF-8) in chunks, without their line ends, with a
    progress bar named ``desc`` (None: none). Lines end at "\\n" only: a stray "\\r" or Unicode line
    separator inside a line must not split it (the two sides of a pair would no longer line up)."""
    try:
        with path.open("rb") as raw:
            progress = _Progress(raw, desc)
            binary: BinaryIO = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw  # type: ignore[assignment]
            text = io.TextIOWrapper(binary, encoding="utf-8", newline="\n")
            lines = (line.rstrip("\r\n") for line in text)
            while block := list(itertools.islice(lines, chunk)):
                yield block
                progress.update()
            progress.close()
    except FileNotFoundError as e:
        raise DataError(f"{path}: file not found") from e
    except (UnicodeDecodeError, OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read as UTF-8 text ({e})") from e


def read_lines(path: str | Path) -> list[str]:
    """All lines of a (small) file, plain or gzip: test sets, validation text."""
    return [line for block in stream_lines(Path(path)) for line in block]


def reservoir_sample(lines: Iterator[str], k: int, rng: random.Random) -> list[str]:
    """A uniform random sample of ``k`` of ``lines`` (all of them if fewer), in one pass and O(k)
    memory (Vitter's algorithm R)."""
    sample: list[str] = []
    for n, line in enumerate(lines):
        if n < k:
            sample.append(line)
        else:
            j = rng.randrange(n + 1)
            if j < k:
                sample[j] = line
    return sample
