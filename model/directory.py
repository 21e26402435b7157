"""The model directory: everything needed to translate, and nothing that needs unpickling.

config.json          {"format": 1, "model": ModelConfig, "source_lang", "target_lang", "training": {...}}
model.safetensors    weights (float32 or float16; loaded into the compute dtype)
sentencepiece.model  the joint vocabulary (special ids fixed by model.tokenizer)

An imported model (model.convert: OPUS-MT, Argos) keeps its toolkit's tokenization instead: a
SentencePiece model per side, ``source.spm`` and ``target.spm`` (or ``sentencepiece.model`` for
both), whose pieces map to the model's ids through ``shared_vocabulary.json`` or
``source_vocabulary.json`` + ``target_vocabulary.json`` (JSON lists of pieces in id order,
CTranslate2's names); its special ids are the config's. It may carry a model card, README.md.

A multilingual model (one model, several directions) writes "format": 2, "source_lang" and
"target_lang" "mul" (ISO 639's code for several languages), and two more keys:

    "directions": ["de-en", "en-de", ...]           the (source, target) pairs it was trained on
    "target_prefix": {"de": [4], "en": [5], ...}    ids put before the source ids to ask for a target:
                                                    the control symbols <2de>, <2en>, ... of its vocabulary

``ModelInfo.directions`` lists the pairs of either kind; ``source_prefix`` gives the ids to prepend.

A model of either kind may also force the start of every output (an Argos package's
``target_prefix``, CTranslate2's ``translate_batch(..., target_prefix=...)``):

    "output_prefix": [7]    target ids decoded first, whatever the model prefers; they are part of
                            the output's tokens (as CTranslate2 returns them) and decode to nothing

(Written only when present; the format number stays: code that predates the key translates without
forcing it.)

No torch here: the HTTP front end reads a directory's metadata and vocabulary and never its
weights, which ``model.checkpoint`` writes and loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config import ModelConfig
from model.tokenizer import Tokenizer, target_token

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SPM_FILE = "sentencepiece.model"
SOURCE_SPM, TARGET_SPM = "source.spm", "target.spm"
SHARED_VOCAB = "shared_vocabulary.json"
SOURCE_VOCAB, TARGET_VOCAB = "source_vocabulary.json", "target_vocabulary.json"
MODEL_CARD = "README.md"
# Every file of a directory's tokenization; those present are copied with the model.
TOKENIZER_FILES = (SPM_FILE, SOURCE_SPM, TARGET_SPM, SHARED_VOCAB, SOURCE_VOCAB, TARGET_VOCAB)
FORMAT_VERSION = 1  # a bilingual model directory
MULTILINGUAL_FORMAT_VERSION = 2  # a multilingual one: adds "directions" and "target_prefix"
MULTILINGUAL = "mul"  # source_lang and target_lang of a multilingual model (ISO 639-2: multiple languages)


class ModelDirError(ValueError):
    """A model directory that is missing, incomplete or corrupted; the message names the file."""


@dataclass
class ModelInfo:
    config: ModelConfig
    source_lang: str  # MULTILINGUAL ("mul") for a multilingual model: see ``directions``
    target_lang: str
    training: dict[str, Any] = field(default_factory=dict)  # free-form training metadata
    # Multilingual models only: the (source, target) pairs trained on, and for every target language
    # the token ids that ask for it (put before the source ids).
    multilingual_directions: list[tuple[str, str]] = field(default_factory=list)
    target_prefix: dict[str, list[int]] = field(default_factory=dict)
    # Target ids every output starts with, forced (``model.decoding.prefix``); empty: none.
    output_prefix: list[int] = field(default_factory=list)

    @classmethod
    def multilingual(
        cls,
        config: ModelConfig,
        directions: list[tuple[str, str]],
        target_prefix: dict[str, list[int]],
        training: dict[str, Any] | None = None,
    ) -> ModelInfo:
        info = cls(config, MULTILINGUAL, MULTILINGUAL, training or {}, list(directions), dict(target_prefix))
        info.check()
        return info

    @property
    def is_multilingual(self) -> bool:
        return bool(self.multilingual_directions)

    @property
    def directions(self) -> list[tuple[str, str]]:
        """Every (source, target) pair this model translates: one for a bilingual model."""
        return list(self.multilingual_directions) or [(self.source_lang, self.target_lang)]

    def check(self) -> None:
        """``ValueError`` when the multilingual fields do not fit together, or the output prefix
        holds ids the decoder cannot be made to produce."""
        cfg = self.config
        specials = {cfg.pad_id, cfg.bos_id, cfg.eos_id}
        bad = [i for i in self.output_prefix if not 0 <= i < cfg.vocab_size or i in specials]
        if bad:
            raise ValueError(f"output_prefix {self.output_prefix}: {bad} are not word ids of the vocabulary")
        if not self.is_multilingual:
            return
        if len(set(self.multilingual_directions)) != len(self.multilingual_directions):
            raise ValueError("directions: listed twice")
        for src, tgt in self.multilingual_directions:
            if not src or not tgt or src == tgt:
                raise ValueError(f"direction {src}-{tgt}: needs two different languages")
            if tgt not in self.target_prefix:
                raise ValueError(f"direction {src}-{tgt}: no target_prefix for {tgt!r}")
        for lang, ids in self.target_prefix.items():
            if not ids or not all(0 <= i < self.config.vocab_size for i in ids):
                raise ValueError(f"target_prefix {lang!r}: {ids} are not ids of the vocabulary")

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": MULTILINGUAL_FORMAT_VERSION if self.is_multilingual else FORMAT_VERSION,
            "model": self.config.to_dict(),
            "source_lang": self.source_lang,
            "target_lang": self.target_lang,
        }
        if self.is_multilingual:
            data["directions"] = [f"{s}-{t}" for s, t in self.multilingual_directions]
            data["target_prefix"] = self.target_prefix
        if self.output_prefix:
            data["output_prefix"] = self.output_prefix
        data["training"] = self.training
        return data


def source_prefix(info: ModelInfo, target: str | None) -> list[int]:
    """The token ids to put before a source sentence's ids so that the model translates into
    ``target``: none for a bilingual model, the target-language token for a multilingual one.

    The one place that knows how a target is asked for (training, ``Translator`` and the service
    call it). ``ValueError`` for a target the model does not translate into, or none given to a
    multilingual model.
    """
    if not info.is_multilingual:
        if target is not None and target != info.target_lang:
            raise ValueError(f"this model translates into {info.target_lang!r} only, not {target!r}")
        return []
    if target is None:
        raise ValueError(
            f"a multilingual model needs a target language: one of {', '.join(info.target_prefix)}"
        )
    if target not in info.target_prefix:
        raise ValueError(
            f"target {target!r} is not one this model translates into ({', '.join(info.target_prefix)})"
        )
    return list(info.target_prefix[target])


def read_info(path: str | Path) -> ModelInfo:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise ModelDirError(f"{file}: missing (is {path} a model directory?)")
    try:
        data = json.loads(file.read_text())
        version = int(data.get("format", FORMAT_VERSION))
        if version > MULTILINGUAL_FORMAT_VERSION:
            raise ValueError(
                f"format {version} is newer than this code reads ({MULTILINGUAL_FORMAT_VERSION})"
            )
        info = ModelInfo(
            config=ModelConfig.from_dict(data["model"]),
            source_lang=str(data["source_lang"]),
            target_lang=str(data["target_lang"]),
            training=dict(data.get("training", {})),
            multilingual_directions=[_direction(d) for d in data.get("directions", [])],
            target_prefix={str(k): [int(i) for i in v] for k, v in data.get("target_prefix", {}).items()},
            output_prefix=[int(i) for i in data.get("output_prefix", [])],
        )
        info.check()
        return info
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelDirError(f"{file}: invalid model config ({type(e).__name__}: {e})") from e


def _direction(text: str) -> tuple[str, str]:
    src, sep, tgt = str(text).partition("-")
    if not sep:
        raise ValueError(f"direction {text!r} is not 'source-target'")
    return src, tgt


def load_tokenizer(path: str | Path, info: ModelInfo | None = None) -> Tokenizer:
    """The directory's tokenizer. ``info`` gives a mapped vocabulary its unknown id and the ids
    that decode to nothing (specials, target-language tokens); without it, the defaults."""
    path = Path(path)
    source = path / SOURCE_SPM if (path / SOURCE_SPM).is_file() else path / SPM_FILE
    target = path / TARGET_SPM if (path / TARGET_SPM).is_file() else None
    if not source.is_file():
        raise ModelDirError(f"{path / SPM_FILE}: missing (nor is there a {SOURCE_SPM})")
    vocabs: tuple[list[str] | None, list[str] | None] = (None, None)
    if (path / SHARED_VOCAB).is_file():
        vocabs = (_vocabulary(path / SHARED_VOCAB), None)
    elif (path / SOURCE_VOCAB).is_file() or (path / TARGET_VOCAB).is_file():
        vocabs = (_vocabulary(path / SOURCE_VOCAB), _vocabulary(path / TARGET_VOCAB))
    skip: set[int] = set()
    unk = 1
    if info is not None:
        cfg = info.config
        unk = cfg.unk_id
        skip = {cfg.pad_id, cfg.unk_id, cfg.bos_id, cfg.eos_id}
        skip.update(i for ids in info.target_prefix.values() for i in ids)
        # The forced output prefix (a target-language token) is in every output's tokens, never
        # in its text: as Argos Translate strips it.
        skip.update(info.output_prefix)
    try:
        return Tokenizer(
            source, target=target, source_vocab=vocabs[0], target_vocab=vocabs[1], unk_id=unk, skip_ids=skip
        )
    except (ValueError, FileNotFoundError) as e:
        raise ModelDirError(str(e)) from e


def _vocabulary(file: Path) -> list[str]:
    if not file.is_file():
        raise ModelDirError(f"{file}: missing")
    try:
        pieces = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{file}: not a JSON list of pieces ({e})") from e
    if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
        raise ModelDirError(f"{file}: not a JSON list of pieces")
    if len(set(pieces)) != len(pieces):
        raise ModelDirError(f"{file}: a piece is listed twice")
    return pieces


def tokenizer_files(path: str | Path) -> list[Path]:
    """The tokenization files present in model directory ``path``."""
    return [Path(path) / name for name in TOKENIZER_FILES if (Path(path) / name).is_file()]


def read_info_and_tokenizer(path: str | Path) -> tuple[ModelInfo, Tokenizer]:
    """The directory's metadata and vocabulary, checked against each other (``ModelDirError``)."""
    info = read_info(path)
    tokenizer = load_tokenizer(path, info)
    cfg = info.config
    if tokenizer.vocab_size != cfg.vocab_size or tokenizer.source_vocab_size != cfg.source_vocab:
        names = ", ".join(f.name for f in tokenizer_files(path))
        raise ModelDirError(
            f"{path}: the vocabulary ({names}) has {tokenizer.source_vocab_size} source and "
            f"{tokenizer.vocab_size} target pieces, config.json says {cfg.source_vocab} and "
            f"{cfg.vocab_size}: the vocabulary does not match the weights"
        )
    for lang, ids in info.target_prefix.items():
        if tokenizer.mapped:
            if not all(0 <= i < tokenizer.source_vocab_size for i in ids):
                raise ModelDirError(f"{path}: target_prefix of {lang!r} has ids outside the vocabulary")
        elif ids != [tokenizer.control_id(target_token(lang))]:
            raise ModelDirError(
                f"{path}: target_prefix of {lang!r} in config.json is {ids}, but sentencepiece.model "
                f"has {target_token(lang)} at {tokenizer.control_id(target_token(lang))}"
            )
    return info, tokenizer
