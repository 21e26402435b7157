"""Parallel text -> filtered token pairs -> token-bucketed, padded batches."""

from __future__ import annotations

import gzip
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from model.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


class DataError(ValueError):
    """Training data that cannot be used; the message names the file."""


def find_split(data_dir: str | Path, split: str, lang: str) -> Path:
    """``{split}.{lang}`` or ``{split}.{lang}.gz`` inside ``data_dir``."""
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        path = Path(data_dir) / name
        if path.is_file():
            return path
    raise DataError(f"{Path(data_dir) / f'{split}.{lang}'}[.gz]: file not found")


def read_lines(path: str | Path) -> list[str]:
    """One sentence per line, gzip or plain UTF-8; trailing newlines stripped."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return [line.rstrip("\r\n") for line in f]
    except FileNotFoundError as e:
        raise DataError(f"{path}: file not found") from e
    except (UnicodeDecodeError, OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read as UTF-8 text ({e})") from e


def read_parallel(
    data_dir: str | Path, split: str, src_lang: str, tgt_lang: str
) -> tuple[list[str], list[str]]:
    src_path, tgt_path = find_split(data_dir, split, src_lang), find_split(data_dir, split, tgt_lang)
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(
            f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: files are not parallel"
        )
    return src, tgt


@dataclass
class FilterStats:
    kept: int = 0
    empty: int = 0
    too_long: int = 0
    bad_ratio: int = 0


def encode_pairs(
    tokenizer: Tokenizer,
    src: list[str],
    tgt: list[str],
    *,
    max_tokens: int,
    max_ratio: float = 0.0,
) -> tuple[list[tuple[list[int], list[int]]], FilterStats]:
    """Token ids of every usable pair; empty, over-long and (optionally) badly aligned pairs are dropped."""
    stats = FilterStats()
    pairs = []
    for s, t in zip(tokenizer.encode(src), tokenizer.encode(tgt), strict=True):
        if not s or not t:
            stats.empty += 1
        elif len(s) + 1 > max_tokens or len(t) + 1 > max_tokens:
            stats.too_long += 1
        elif max_ratio and max(len(s), len(t)) > max_ratio * min(len(s), len(t)):
            stats.bad_ratio += 1
        else:
            pairs.append((s, t))
    stats.kept = len(pairs)
    return pairs, stats


@dataclass
class Batch:
    src: Tensor  # (B, S) source ids + eos, right-padded
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


def collate(pairs: list[tuple[list[int], list[int]]]) -> Batch:
    s_len = max(len(s) for s, _ in pairs) + 1
    t_len = max(len(t) for _, t in pairs) + 1
    src = torch.full((len(pairs), s_len), PAD_ID, dtype=torch.long)
    tgt_in = torch.full((len(pairs), t_len), PAD_ID, dtype=torch.long)
    tgt_out = torch.full((len(pairs), t_len), PAD_ID, dtype=torch.long)
    for i, (s, t) in enumerate(pairs):
        src[i, : len(s) + 1] = torch.tensor(s + [EOS_ID])
        tgt_in[i, : len(t) + 1] = torch.tensor([BOS_ID] + t)
        tgt_out[i, : len(t) + 1] = torch.tensor(t + [EOS_ID])
    return Batch(src, tgt_in, tgt_out, int((tgt_out != PAD_ID).sum()))


def bucket_batches(
    lengths: list[tuple[int, int]], max_tokens: int, *, seed: int, epoch: int
) -> list[list[int]]:
    """Group example indices into batches of similar length whose padded size (rows x (longest
    source + longest target)) stays within ``max_tokens``; the batch order is shuffled per epoch.

    Deterministic in (seed, epoch): a resumed run sees exactly the batches it would have seen.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    # Sort by length with a random tie-break, so batches differ between epochs but padding stays low.
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i][0] + lengths[i][1], rng.random()))
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for i in order:
        size = lengths[i][0] + lengths[i][1] + 2  # + eos / bos
        if batch and max(longest, size) * (len(batch) + 1) > max_tokens:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, size)
    if batch:
        batches.append(batch)
    rng.shuffle(batches)
    return batches


def shard(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """This process's share under data parallelism: every rank gets the same number of batches
    (the few left over are dropped) so that no rank waits for a gradient all-reduce that never comes."""
    usable = len(batches) - len(batches) % world
    return batches[rank:usable:world]


def iterate(pairs: list[tuple[list[int], list[int]]], batches: list[list[int]]) -> Iterator[Batch]:
    for idx in batches:
        yield collate([pairs[i] for i in idx])
