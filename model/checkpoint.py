"""A model directory's weights: written from a ``Transformer`` and read back into one (torch).

The directory's layout, its metadata and vocabulary are ``model.directory``'s (no torch: the HTTP
front end reads them); they are imported here too, so that ``model.checkpoint`` offers the whole
directory to training and the workers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.overrides import TorchFunctionMode

from model.directory import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MULTILINGUAL,
    MULTILINGUAL_FORMAT_VERSION,
    SPM_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    ModelDirError,
    ModelInfo,
    load_tokenizer,
    read_info,
    read_info_and_tokenizer,
    source_prefix,
    tokenizer_files,
)
from model.transformer import Transformer

__all__ = [
    "CONFIG_FILE",
    "FORMAT_VERSION",
    "MULTILINGUAL",
    "MULTILINGUAL_FORMAT_VERSION",
    "SPM_FILE",
    "TOKENIZER_FILES",
    "WEIGHTS_FILE",
    "ModelDirError",
    "ModelInfo",
    "load_model",
    "load_tokenizer",
    "read_info",
    "read_info_and_tokenizer",
    "save_model_dir",
    "source_prefix",
    "tokenizer_files",
]


def save_model_dir(
    path: str | Path,
    model: Transformer,
    info: ModelInfo,
    tokenizer: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``model`` as a model directory; ``dtype`` float16 halves the size on disk.
    ``tokenizer``: the joint SentencePiece model, or a model directory whose tokenization files
    (``TOKENIZER_FILES``) are copied: a fine-tuned model keeps its original's."""
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    with torch.device("meta"):  # the names a whole model has, at no cost
        missing = Transformer(model.cfg).state_dict().keys() - state.keys()
    if missing:
        # A model loaded to translate (``Translator.load``) keeps its linear layers' prepared
        # weights only (``model.runtime.prepack``): writing it would lose them.
        raise ValueError(
            f"this model lacks {len(missing)} weights ({sorted(missing)[0]}, ...): it was prepared to "
            "translate; load it with Translator.load(..., prepack=False) or load_model to save it"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    files = tokenizer_files(tokenizer) if Path(tokenizer).is_dir() else [Path(tokenizer)]
    for file in files:
        name = file.name if Path(tokenizer).is_dir() else SPM_FILE
        if file.resolve() != (path / name).resolve():
            shutil.copyfile(file, path / name)
    (path / CONFIG_FILE).write_text(json.dumps(info.to_json(), indent=2) + "\n")
    return path


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
    with _Uninitialized():  # (every parameter is then read from the file: strict)
        model = Transformer(info.config)
    try:
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise ModelDirError(f"{file}: weights do not match {CONFIG_FILE} ({e})") from e
    return model.to(device=device, dtype=dtype).eval()


class _Uninitialized(TorchFunctionMode):
    """A model built to be loaded: its initialisation's in-place draws and fills are skipped
    (``torch.nn.init``'s functions, ``uniform_``, ``normal_``, ``zero_``, ``fill_``). Built
    plainly it drew random values for every weight, twice (each layer's own initialisation, then
    the model's), only to have them overwritten: 0.5 of an OPUS-MT-size model's 0.66 s load (AMD
    EPYC avx512_vnni). What is computed, not drawn (the sinusoidal position table), is computed.
    (Building on the meta device instead imported TorchDynamo, 1.5 s and its memory, in every
    worker.) Modes are per thread: another thread's tensors are untouched."""

    SKIPPED = frozenset({Tensor.uniform_, Tensor.normal_, Tensor.zero_, Tensor.fill_})

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in self.SKIPPED or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))
