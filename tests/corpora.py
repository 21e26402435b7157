"""Synthetic parallel corpora for the training tests: a toy lexicon in three languages, where every
German word has one English and one French word, in the same order (easy to learn in seconds)."""

from __future__ import annotations

import random
from pathlib import Path

from training.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "training" / "configs" / "tiny.toml"

LEXICON = {  # de: (en, fr)
    "ein": ("a", "un"), "mann": ("man", "homme"), "frau": ("woman", "femme"), "hund": ("dog", "chien"),
    "kind": ("child", "enfant"), "läuft": ("runs", "court"), "sitzt": ("sits", "assis"),
    "auf": ("on", "sur"), "der": ("the", "le"), "straße": ("street", "rue"), "wiese": ("meadow", "pré"),
    "rot": ("red", "rouge"), "blau": ("blue", "bleu"), "groß": ("big", "grand"),
    "klein": ("small", "petit"), "spielt": ("plays", "joue"), "mit": ("with", "avec"),
    "ball": ("ball", "balle"),
}  # fmt: skip
COLUMN = {"en": 0, "fr": 1}


def translate_words(german: str, lang: str) -> str:
    return " ".join(w if lang == "de" else LEXICON[w][COLUMN[lang]] for w in german.split())


def write_corpus(
    path: Path, n_train: int = 400, n_val: int = 30, seed: int = 0, langs: tuple[str, ...] = ("de", "en")
) -> Path:
    """{train,val}.{lang} for every language of ``langs``, line-aligned (Multi30k's layout)."""
    rng = random.Random(seed)
    words = list(LEXICON)
    for split, n in (("train", n_train), ("val", n_val)):
        german = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(n)]
        for lang in langs:
            text = "".join(translate_words(s, lang).capitalize() + ".\n" for s in german)
            (path / f"{split}.{lang}").write_text(text)
    return path


def tiny_config(data_dir: Path, **train_overrides: object) -> TrainConfig:
    cfg = TrainConfig.load(TINY)
    cfg.data.dir = str(data_dir)
    for key, value in train_overrides.items():
        setattr(cfg.train, key, value)
    return cfg
