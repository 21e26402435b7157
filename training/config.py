"""Typed training configuration read from TOML: three tables, [data], [model] and [train].

Unknown keys are an error (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from model.config import ModelConfig


class ConfigError(ValueError):
    """A training configuration that cannot be used; the message says which file and key."""


@dataclass
class DataConfig:
    dir: str = "../shared/data/multi30k"  # directory of {split}.{lang}[.gz] files; relative to the CWD
    source_lang: str = "de"  # a bilingual model: source_lang -> target_lang
    target_lang: str = "en"
    # A multilingual model: two or more "source-target" directions, e.g. ["de-en", "en-de", "fr-en"]
    # (source_lang and target_lang are then ignored). One model, one shared vocabulary, a
    # target-language token before every source sentence. A single direction is a bilingual model.
    directions: list[str] = field(default_factory=list)
    # Multilingual: each epoch draws direction d's pairs with probability ~ n_d ** (1 / T), n_d its
    # pair count: 1 keeps the data's proportions, larger values flatten them so that small
    # directions are not drowned (Arivazhagan et al. 2019 use 5). An epoch draws as many pairs as
    # all directions hold together.
    sampling_temperature: float = 5.0
    train_split: str = "train"
    valid_split: str = "val"
    vocab_size: int = 8000  # joint SentencePiece vocabulary trained on the training text of every language
    # SentencePiece trains on at most this many sentences, sampled uniformly from each language's
    # training text (an equal share per language): a large corpus is not read into memory for it.
    spm_sample_sentences: int = 1_000_000
    spm_model: str = ""  # reuse this SentencePiece model instead of training one
    max_tokens_per_sentence: int = 200  # longer pairs are dropped (and counted)
    max_length_ratio: float = 0.0  # drop pairs whose token lengths differ more than this factor (0: off)
    # Where the tokenized corpus (training.prepare) is cached, keyed by the data files, vocabulary
    # and filters: "" is <out>/prepared. Several runs may share one. A directory that is itself a
    # prepared corpus (it holds manifest.json) is used as it is, without the raw files.
    prepared_dir: str = ""

    def __post_init__(self) -> None:
        for text in self.directions:
            src, sep, tgt = text.partition("-")
            if not sep or not src or not tgt or "-" in tgt or src == tgt:
                raise ValueError(f"directions: {text!r} is not 'source-target' with two different languages")
        if len(set(self.directions)) != len(self.directions):
            raise ValueError("directions: a direction is listed twice")
        if self.sampling_temperature <= 0:
            raise ValueError("sampling_temperature must be > 0")
        if self.spm_sample_sentences < 1:
            raise ValueError("spm_sample_sentences must be >= 1")

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """The (source, target) directions to train, in config order."""
        if self.directions:
            return [(d.split("-")[0], d.split("-")[1]) for d in self.directions]
        return [(self.source_lang, self.target_lang)]

    @property
    def multilingual(self) -> bool:
        return len(self.pairs) > 1


@dataclass
class TrainParams:
    seed: int = 1
    max_tokens: int = 4096  # source + target tokens per batch (padding included), per process
    accum_steps: int = 1  # batches whose gradients are summed before one optimizer step
    epochs: int = 30
    max_steps: int = 0  # stop after this many optimizer steps (0: run all epochs)
    lr: float = 7e-4  # peak learning rate, reached at the end of warmup
    warmup_steps: int = 4000
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 1.0  # 0 disables gradient clipping
    amp: str = "auto"  # auto (bf16 on CUDA, none on CPU) | bf16 | fp16 | none
    device: str = "auto"  # auto | cpu | cuda
    log_every: int = 50  # steps between JSONL log lines
    checkpoint_every: int = 1000  # steps between checkpoints (one is always written at the end)
    keep_checkpoints: int = 5  # older step checkpoints are deleted
    average_last: int = 5  # the exported model averages the weights of the last K checkpoints
    epoch_checkpoints: bool = True  # also checkpoint at the end of every epoch
    # Batches are formed from pools of this many pairs: a pool (pieces of the corpus drawn at random)
    # is sorted by length, cut into batches of similar lengths, and its batches shuffled. Bounds the
    # memory that batching takes, whatever the corpus size; a corpus smaller than this is one pool.
    shuffle_pool: int = 262_144
    valid_max_sentences: int = 0  # validation BLEU on at most this many sentences per direction (0: all)
    valid_batch_size: int = 128
    export_dtype: str = "float32"  # float32 | float16 weights in the exported model directory

    def __post_init__(self) -> None:
        choices = {"amp": ("auto", "bf16", "fp16", "none"), "device": ("auto", "cpu", "cuda")}
        choices["export_dtype"] = ("float32", "float16")
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {', '.join(allowed)}, not {getattr(self, key)!r}")
        for key in (
            "max_tokens",
            "accum_steps",
            "warmup_steps",
            "checkpoint_every",
            "log_every",
            "shuffle_pool",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1")


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainParams = field(default_factory=TrainParams)
    # The keys each table set (the others are defaults): fine-tuning (``training.finetune``) takes
    # what the file leaves out from the initial model instead.
    given: dict[str, set[str]] = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> TrainConfig:
        unknown = sorted(set(raw) - {"data", "model", "train"})
        if unknown:
            raise ConfigError(f"{source}: unknown table(s): {', '.join(unknown)}")
        try:
            return cls(
                data=_build(DataConfig, raw.get("data", {}), f"{source} [data]"),
                model=_build(ModelConfig, raw.get("model", {}), f"{source} [model]"),
                train=_build(TrainParams, raw.get("train", {}), f"{source} [train]"),
                given={name: set(raw.get(name, {})) for name in ("data", "model", "train")},
            )
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"{path}: config file not found") from e
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from e
        return cls.from_dict(raw, str(path))


def from_command_line(
    config: str, *, data_dir: str | None, prepared_dir: str | None, out: str | None
) -> tuple[TrainConfig, Path]:
    """The config of ``training.train`` and ``training.prepare``: the file with ``--data-dir`` and
    ``--prepared-dir`` over it, and the output directory (default ``runs/<config name>``)."""
    cfg = TrainConfig.load(config)
    if data_dir:
        cfg.data.dir = data_dir
    if prepared_dir:
        cfg.data.prepared_dir = prepared_dir
    return cfg, Path(out or Path("runs") / Path(config).stem)


def _build(cls: type, table: Any, where: str) -> Any:
    """Instantiate a dataclass from a TOML table, checking key names and value types."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    values = {}
    for key, value in table.items():
        values[key] = _coerce(value, hints[key], f"{where} {key}")
    return cls(**values)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    elif get_origin(hint) is list:  # list[str]
        (item,) = get_args(hint)
        ok = isinstance(value, list) and all(isinstance(v, item) for v in value)
        value = list(value) if ok else value
    else:  # tuple[float, float]
        ok = isinstance(value, list) and len(value) == 2 and all(isinstance(v, int | float) for v in value)
        value = tuple(float(v) for v in value) if ok else value
    if not ok:
        raise ConfigError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {value!r}")
    return value
