"""Fine-tuning: training that starts from an existing model directory (``training.train --init``).

    python -m training.train --init MODEL_DIR --data-dir D [--config C] [--out O] [--resume]

The initial model decides everything the weights depend on: the architecture (its config.json),
the tokenizer (its files, copied unchanged: no SentencePiece model is trained), the special ids,
and the directions with their target-language tokens (a multilingual model stays multilingual,
even when it is fine-tuned on one of its directions). The training config gives the rest: the
data, the optimisation ([train]) and the regularisation. Its [model] table may set ``dropout``,
``attention_dropout`` and ``activation_dropout``; any other key it sets must equal the initial
model's (so the config a model was trained with can be reused to fine-tune it), else a
``ConfigError`` names it. [data] ``spm_model`` must be empty and ``vocab_size`` is not used; the
languages (``source_lang``/``target_lang`` or ``directions``) default to the model's and must be
directions it translates.

Without ``--config``, ``training/configs/finetune.toml``: fine-tuning defaults (a low learning
rate, a short warmup; see there).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from model.checkpoint import CONFIG_FILE, ModelInfo, tokenizer_files
from training.config import ConfigError, TrainConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "finetune.toml"

# Training-only settings of [model]: the one part of the architecture's table fine-tuning may change.
REGULARISATION = ("dropout", "attention_dropout", "activation_dropout")
# What config.json's "training" says about where a model comes from: kept by every fine-tuned copy.
ATTRIBUTION = ("origin", "licence", "command", "init")


def copy_tokenizer(model_dir: str | Path, out: Path) -> list[Path]:
    """Copy ``model_dir``'s tokenizer files (``model.directory.TOKENIZER_FILES``, byte for byte)
    into ``out``; returns the copies."""
    out.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(path, out / path.name)) for path in tokenizer_files(model_dir)]


def tokenizer_sha256(model_dir: str | Path, info: ModelInfo) -> str:
    """One fingerprint of what tokenization depends on: the tokenizer files' bytes, the special and
    vocabulary sizes of the config, and the target-language tokens. A prepared corpus and the
    checkpoints are keyed by it, so that nothing made with another tokenizer is reused."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tokenizer_files(model_dir)}
    config = info.config.to_dict()
    ids = {k: v for k, v in sorted(config.items()) if k.endswith("_id") or k.endswith("vocab_size")}
    spec = {"files": files, "config": ids, "target_prefix": info.target_prefix}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def apply_init(cfg: TrainConfig, info: ModelInfo, where: str) -> None:
    """Make ``cfg`` train the model of ``info`` (read from ``where``): its architecture, its
    languages where the config names none. ``ConfigError`` where the config contradicts it."""
    given = cfg.given.get("model", set())
    differ = [
        f"{key} = {getattr(cfg.model, key)!r} (the model's is {getattr(info.config, key)!r})"
        for key in sorted(given - set(REGULARISATION))
        if getattr(cfg.model, key) != getattr(info.config, key)
    ]
    if differ:
        raise ConfigError(
            f"--init {where}: the architecture is the model's ({CONFIG_FILE}); [model] may set only "
            f"{', '.join(REGULARISATION)}, but it sets {'; '.join(differ)}"
        )
    cfg.model = replace(info.config, **{k: getattr(cfg.model, k) for k in REGULARISATION if k in given})
    if cfg.data.spm_model:
        raise ConfigError(
            f"--init {where}: the tokenizer is the model's; data.spm_model ({cfg.data.spm_model}) "
            "must be empty"
        )
    data_given = cfg.given.get("data", set())
    if not data_given & {"source_lang", "target_lang", "directions"}:
        if info.is_multilingual:
            cfg.data.directions = [f"{s}-{t}" for s, t in info.directions]
        else:
            cfg.data.source_lang, cfg.data.target_lang = info.source_lang, info.target_lang
            cfg.data.directions = []
    unknown = [f"{s}-{t}" for s, t in cfg.data.pairs if (s, t) not in info.directions]
    if unknown:
        served = ", ".join(f"{s}-{t}" for s, t in info.directions)
        raise ConfigError(
            f"--init {where}: the model translates {served}, not {', '.join(unknown)} "
            "(fine-tuning cannot add a direction)"
        )


def attribution(where: str | Path, info: ModelInfo) -> dict[str, Any]:
    """config.json's record of the initial model: its path and where it comes from (origin,
    licence, the command that made it, and its own initial model if it was fine-tuned too)."""
    record: dict[str, Any] = {"model_dir": str(Path(where).resolve())}
    record.update({k: info.training[k] for k in ATTRIBUTION if k in info.training})
    for key in ("steps", "train_pairs"):
        if key in info.training:
            record[key] = info.training[key]
    return record
