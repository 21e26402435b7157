"""The model directory: everything needed to translate, and nothing that needs unpickling.

config.json          {"format": 1, "model": ModelConfig, "source_lang", "target_lang", "training": {...}}
model.safetensors    weights (float32 or float16; loaded into the compute dtype)
sentencepiece.model  the joint vocabulary (special ids fixed by model.tokenizer)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model.config import ModelConfig
from model.tokenizer import Tokenizer
from model.transformer import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SPM_FILE = "sentencepiece.model"
FORMAT_VERSION = 1


class ModelDirError(ValueError):
    """A model directory that is missing, incomplete or corrupted; the message names the file."""


@dataclass
class ModelInfo:
    config: ModelConfig
    source_lang: str
    target_lang: str
    training: dict[str, Any] = field(default_factory=dict)  # free-form training metadata

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "model": self.config.to_dict(),
            "source_lang": self.source_lang,
            "target_lang": self.target_lang,
            "training": self.training,
        }


def save_model_dir(
    path: str | Path,
    model: Transformer,
    info: ModelInfo,
    spm_model: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``model`` as a model directory; ``dtype`` float16 halves the size on disk."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    if Path(spm_model).resolve() != (path / SPM_FILE).resolve():
        shutil.copyfile(spm_model, path / SPM_FILE)
    (path / CONFIG_FILE).write_text(json.dumps(info.to_json(), indent=2) + "\n")
    return path


def read_info(path: str | Path) -> ModelInfo:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise ModelDirError(f"{file}: missing (is {path} a model directory?)")
    try:
        data = json.loads(file.read_text())
        return ModelInfo(
            config=ModelConfig.from_dict(data["model"]),
            source_lang=str(data["source_lang"]),
            target_lang=str(data["target_lang"]),
            training=dict(data.get("training", {})),
        )
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ModelDirError(f"{file}: invalid model config ({type(e).__name__}: {e})") from e


def load_tokenizer(path: str | Path) -> Tokenizer:
    file = Path(path) / SPM_FILE
    if not file.is_file():
        raise ModelDirError(f"{file}: missing")
    try:
        return Tokenizer(file)
    except ValueError as e:
        raise ModelDirError(str(e)) from e


def read_info_and_tokenizer(path: str | Path) -> tuple[ModelInfo, Tokenizer]:
    """The directory's metadata and vocabulary, checked against each other (``ModelDirError``)."""
    info = read_info(path)
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size != info.config.vocab_size:
        raise ModelDirError(
            f"{path}: sentencepiece.model has {tokenizer.vocab_size} pieces, "
            f"config.json says vocab_size={info.config.vocab_size}"
        )
    return info, tokenizer


def load_model(
    path: str | Path,
    info: ModelInfo,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """Build the Transformer of ``info`` and fill it from model.safetensors (never unpickled)."""
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise ModelDirError(f"{file}: missing")
    try:
        state = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelDirError(f"{file}: cannot read weights ({e})") from e
    model = Transformer(info.config)
    try:
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise ModelDirError(f"{file}: weights do not match {CONFIG_FILE} ({e})") from e
    return model.to(device=device, dtype=dtype).eval()
