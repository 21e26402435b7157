"""Training checkpoints: the full state for an exact resume, and the average of the last ones.

``checkpoints/step_*.pt`` holds the model, optimizer and scheduler states, ``TrainState`` (step,
epoch, position in the epoch), every process's RNG state, the sha256 of the vocabulary the
run trains with (a resume with another vocabulary is refused), and the model directory a
fine-tuning run started from ("init", "" for none).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # current epoch (0-based)
    batch_in_epoch: int = 0  # batches of the current epoch already consumed (for exact resume)
    train_time_s: float = 0.0


def checkpoint_paths(out: Path) -> list[Path]:
    return sorted((out / "checkpoints").glob("step_*.pt"))


def save_checkpoint(
    out: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    state: TrainState,
    rng: list[Any],
    keep: int,
    vocab_sha256: str,
    *,
    init: Path | None = None,
) -> Path:
    path = out / "checkpoints" / f"step_{state.step:08d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "state": asdict(state),
        "rng": rng,
        "vocab_sha256": vocab_sha256,
        "init": str(init.resolve()) if init is not None else "",
    }
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    tmp.replace(path)  # atomic: an interrupted save never leaves a half-written checkpoint
    for old in checkpoint_paths(out)[:-keep]:
        old.unlink()
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    # weights_only: tensors and plain containers only, never arbitrary pickled objects.
    return torch.load(path, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Mean of the model weights of ``paths`` (Vaswani et al. average the last 5 or 20)."""
    total: dict[str, torch.Tensor] = {}
    for p in paths:
        for k, v in load_checkpoint(p)["model"].items():
            total[k] = total.get(k, torch.zeros_like(v, dtype=torch.float64)) + v.double()
    return {k: (v / len(paths)).float() for k, v in total.items()}
