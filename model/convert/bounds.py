"""What a converter accepts from a file it did not make (a model from anywhere may be hostile).

Bounds on the counts a file declares, checked before anything is made for them, and the check every
converter ends with: the state dict it made is, name for name and shape for shape, the one our
``Transformer`` has for the config it made (built on the meta device: no memory, no
initialisation), so that a model directory it writes always loads."""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.convert.errors import ConversionError
from model.transformer import Transformer

MAX_LAYERS = 256  # per stack: deep NMT models have tens
MAX_VOCABULARY = 1 << 20  # tokens (the largest NMT vocabularies have ~256k)
MAX_POSITIONS = 1 << 14  # rows of a position table (OPUS-MT's have 512 or 1024)
MAX_WIDTH = 1 << 16  # d_model and the feed-forward width (big models have 1024 and 4096..16384)
MAX_ARCHIVE_MEMBERS = 10_000  # files in a zip (an Argos package, a torch.save archive): tens in practice


def expected_shapes(cfg: ModelConfig, source: str) -> dict[str, tuple[int, ...]]:
    """Our Transformer's state dict shapes for ``cfg``; ``ConversionError`` naming ``source`` (what
    the config came from) when no model can be built from it."""
    try:
        with torch.device("meta"):  # shapes only: no memory, no initialisation
            return {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    except (AssertionError, ValueError, RuntimeError, ZeroDivisionError) as e:  # e.g. a pad id past the rows
        raise ConversionError(f"{source} describes no model we can build ({e})") from e


def check_state(cfg: ModelConfig, state: dict[str, torch.Tensor], source: str) -> None:
    """``ConversionError`` unless ``state`` has exactly the names and shapes ``cfg`` implies."""
    expected = expected_shapes(cfg, source)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ConversionError(f"the weights do not fit {source}: missing {missing[:5]}, extra {extra[:5]}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ConversionError(f"{name}: shape {tuple(state[name].shape)}, {source} implies {shape}")
